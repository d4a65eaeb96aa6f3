// The authenticated control plane (control/auth.h): keys from the run secret, the store's
// set-once keys, mailboxes that drop what their claimed sender did not send, and the rule that
// only loopback addresses may go unauthenticated. The attack on a running session is
// Attack.ForeignProcessesCannotReachOrForgeTheControlPlane (separate_launch_test.cc).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/log_throttle.h"
#include "control/auth.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;

MailboxOptions box_options(const std::string& id, std::shared_ptr<const ControlAuth> auth) {
  return MailboxOptions{.id = id,
                        .timeout = 5s,
                        .auth = std::move(auth),
                        .settings = {.lanes = true, .host_identity = "auth-test-host"}};
}

std::shared_ptr<const ControlAuth> auth_of(const std::string& secret) {
  auto a = ControlAuth::from_secret(secret);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return std::make_shared<const ControlAuth>(*a);
}

TEST(ControlAuth, KeysComeFromTheSecretAlone) {
  const auto a = auth_of("secret-one-0123456789");
  const auto b = auth_of("secret-one-0123456789");
  const auto c = auth_of("secret-two-0123456789");
  EXPECT_EQ(a->server_public(), b->server_public());
  EXPECT_EQ(a->member_secret(), b->member_secret());
  EXPECT_NE(a->server_public(), c->server_public());
  EXPECT_NE(a->server_public(), a->member_public());
  EXPECT_EQ(a->server_public().size(), 40u);
  auto short_secret = ControlAuth::from_secret("too-short");
  ASSERT_FALSE(short_secret.ok());
  EXPECT_NE(short_secret.status().message().find("at least 16"), std::string::npos);
  const std::string s1 = ControlAuth::generate_secret(), s2 = ControlAuth::generate_secret();
  EXPECT_EQ(s1.size(), 64u);
  EXPECT_NE(s1, s2);
}

TEST(ControlAuth, OnlyLoopbackMayGoUnauthenticated) {
  const auto a = auth_of("secret-one-0123456789");
  EXPECT_TRUE(check_listen_address("127.0.0.1", nullptr, "x").ok());
  EXPECT_TRUE(check_listen_address("::1", nullptr, "x").ok());
  EXPECT_TRUE(check_listen_address("10.1.2.3", a.get(), "x").ok());
  const Status s = check_listen_address("10.1.2.3", nullptr, "mailbox 'engine/0'");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("mailbox 'engine/0': listening on 10.1.2.3"), std::string::npos);
  EXPECT_NE(s.message().find("REFIT_SECRET"), std::string::npos);
  auto server = StoreServer::start("10.1.2.3", 0, nullptr);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("store server: listening on 10.1.2.3"),
            std::string::npos);
}

struct AuthedStore {
  std::shared_ptr<const ControlAuth> auth = auth_of("store-secret-0123456789");
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> store;
  AuthedStore() {
    auto s = StoreServer::start("127.0.0.1", 0, auth);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    server = std::move(s).value();
    auto c = connect_store("127.0.0.1", server->port(), 5s, auth);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    store = std::move(c).value();
  }
};

TEST(ControlAuth, StoreNeedsTheSecretAndKeepsAuthKeysOnce) {
  AuthedStore s;
  ASSERT_TRUE(s.store->set("plain", "1").ok());
  ASSERT_TRUE(s.store->set("plain", "2").ok());  // other keys may change
  ASSERT_TRUE(s.store->set("auth/key/engine/0", "A").ok());
  const Status again = s.store->set("auth/key/engine/0", "B");
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.message().find("can be set only once"), std::string::npos);
  ASSERT_TRUE(s.store->set("run7/auth/key/trainer/0", "A").ok());  // under a PrefixStore
  EXPECT_FALSE(s.store->set("run7/auth/key/trainer/0", "B").ok());
  EXPECT_EQ(*s.store->get("auth/key/engine/0", 1s), "A");
  EXPECT_FALSE(connect_store("127.0.0.1", s.server->port(), 800ms, nullptr).ok());
  auto wrong = connect_store("127.0.0.1", s.server->port(), 3s, auth_of("not-the-secret-0123456"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("same run secret"), std::string::npos)
      << wrong.status().to_string();
}

TEST(ControlAuth, MailboxesTalkAndAnIdIsTakenOnce) {
  AuthedStore s;
  auto a = Mailbox::open(*s.store, box_options("trainer/0", s.auth));
  auto b = Mailbox::open(*s.store, box_options("engine/0", s.auth));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->send("engine/0", MessageType::kBegin, "hello").ok());
  auto m = (*b)->receive(5s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->from, "trainer/0");
  EXPECT_EQ(m->payload, "hello");
  auto twin = Mailbox::open(*s.store, box_options("engine/0", s.auth));
  ASSERT_FALSE(twin.ok());
  EXPECT_NE(twin.status().message().find("is another process running as 'engine/0'?"),
            std::string::npos)
      << twin.status().to_string();
}

// Without authentication (loopback), a malformed message is dropped and counted, never returned
// as an error, and the next good message still arrives.
TEST(ControlAuth, MalformedMessagesAreDroppedNotFatal) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok());
  auto store = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(store.ok());
  auto box = Mailbox::open(**store, box_options("engine/0", nullptr));
  auto peer = Mailbox::open(**store, box_options("trainer/0", nullptr));
  ASSERT_TRUE(box.ok() && peer.ok());
  auto address = (*store)->get("mailbox/engine/0", 1s);
  ASSERT_TRUE(address.ok());
  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::push);
  raw.set(zmq::sockopt::linger, 0);
  raw.connect(*address);
  const std::string garbage(64 << 10, '\x5A');
  ASSERT_TRUE(raw.send(zmq::buffer(garbage), zmq::send_flags::none));
  const std::uint8_t bad_type = 200;
  std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(&bad_type, 1), zmq::str_buffer("x"),
                                         zmq::str_buffer("y")};
  ASSERT_TRUE(zmq::send_multipart(raw, parts));
  // Both are dropped: receive() goes on waiting (here: times out) instead of failing.
  for (int i = 0; i < 50 && (*box)->dropped() < 2; ++i) {
    auto none = (*box)->receive(100ms);
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), StatusCode::kTimeout) << none.status().to_string();
  }
  EXPECT_EQ((*box)->dropped(), 2);
  ASSERT_TRUE((*peer)->send("engine/0", MessageType::kCommit, "ok").ok());
  auto m = (*box)->receive(5s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->type, MessageType::kCommit);
}

// The ZAP handler's thread sleeps until a handshake asks it something: idle, it never wakes; each
// CURVE connection wakes it (once, or twice where ZeroMQ signals its socket again).
TEST(ControlAuth, ZapHandlerWakesOnlyForHandshakes) {
  const auto auth = auth_of("a secret of at least sixteen bytes");
  zmq::context_t ctx;
  log::Throttle throttle;
  auto zap = ZapHandler::start(
      ctx.handle(), [&](const std::string& key) { return key == auth->member_public(); },
      "zap-test", throttle);
  ASSERT_TRUE(zap.ok()) << zap.status().to_string();
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ((*zap)->wakeups(), 0u);

  zmq::socket_t server(ctx, zmq::socket_type::pull);
  server.set(zmq::sockopt::curve_server, 1);
  server.set(zmq::sockopt::curve_secretkey, auth->server_secret());
  server.bind("tcp://127.0.0.1:*");
  const std::string endpoint = server.get(zmq::sockopt::last_endpoint);
  constexpr int kClients = 3;
  for (int c = 0; c < kClients; ++c) {
    zmq::context_t client_ctx;
    zmq::socket_t client(client_ctx, zmq::socket_type::push);
    client.set(zmq::sockopt::linger, 1000);
    client.set(zmq::sockopt::curve_serverkey, auth->server_public());
    client.set(zmq::sockopt::curve_publickey, auth->member_public());
    client.set(zmq::sockopt::curve_secretkey, auth->member_secret());
    client.connect(endpoint);
    ASSERT_TRUE(client.send(zmq::str_buffer("hello"), zmq::send_flags::none));
    server.set(zmq::sockopt::rcvtimeo, 5000);
    zmq::message_t got;
    ASSERT_TRUE(server.recv(got)) << "client " << c;  // its handshake was accepted
    EXPECT_EQ(got.to_string(), "hello");
  }
  // (A handshake is answered before its connection carries a message.)
  EXPECT_GE((*zap)->wakeups(), static_cast<std::uint64_t>(kClients));
  EXPECT_LE((*zap)->wakeups(), static_cast<std::uint64_t>(2 * kClients));
  server.close();
  zap->reset();  // before the context
}

// The secret as a file: it must be private to its owner, and only one of the two variables may
// be set. Checked through the CLI, where the setting is read (once per process).
TEST(ControlAuth, SecretFileMustBePrivate) {
  testing::TempDir dir;
  const std::string path = dir.write("secret", "file-secret-0123456789abcdef\n");
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  ::setenv("REFIT_SECRET_FILE", path.c_str(), 1);
  auto open_file = testing::run_cli({"run", "--steps", "1"}, 120);
  ::setenv("REFIT_SECRET", "inline-secret-0123456789", 1);
  auto both = testing::run_cli({"run", "--steps", "1"}, 120);
  ::unsetenv("REFIT_SECRET");
  ::unsetenv("REFIT_SECRET_FILE");
  EXPECT_EQ(open_file.exit_code, 2) << open_file.output;
  EXPECT_NE(open_file.output.find("other users can read it (mode 644); chmod 600 it"),
            std::string::npos)
      << open_file.output;
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("REFIT_SECRET and REFIT_SECRET_FILE are both set"),
            std::string::npos)
      << both.output;
}

}  // namespace
}  // namespace refit
