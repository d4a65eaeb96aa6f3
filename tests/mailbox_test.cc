// Mailboxes over an in-process store: ordering, timeouts, dead and missing peers, same-host lanes
// and the strangers they refuse.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sodium.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "common/env.h"
#include "control/auth.h"
#include "control/inbox.h"
#include "control/lane.h"
#include "control/mailbox.h"
#include "control/messages.h"
#include "control/store.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::seconds_since;

// A mailbox of this test process, with lanes between mailboxes of one test host.
MailboxOptions box_options(const std::string& id, std::chrono::milliseconds timeout,
                           std::shared_ptr<const ControlAuth> auth) {
  return MailboxOptions{.id = id,
                        .timeout = timeout,
                        .auth = std::move(auth),
                        .settings = {.lanes = true, .host_identity = "mailbox-test-host"}};
}

class MailboxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = StoreServer::start("127.0.0.1", 0, nullptr);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    server_ = std::move(server).value();
    auto store = connect_store("127.0.0.1", server_->port(), 5s, nullptr);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    store_ = std::move(store).value();
  }

  std::unique_ptr<Mailbox> open(const std::string& id, std::chrono::milliseconds timeout = 2s) {
    auto box = Mailbox::open(*store_, box_options(id, timeout, nullptr));
    EXPECT_TRUE(box.ok()) << box.status().to_string();
    return box.ok() ? std::move(box).value() : nullptr;
  }

  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
};

TEST_F(MailboxTest, ExchangeInOrder) {
  auto trainer = open("trainer/0");
  auto engine = open("engine/0/1");
  ASSERT_TRUE(trainer && engine);
  EXPECT_EQ(trainer->id(), "trainer/0");
  auto published = store_->get("mailbox/engine/0/1", 1s);
  ASSERT_TRUE(published.ok());
  EXPECT_EQ(published->rfind("tcp://127.0.0.1:", 0), 0u) << *published;

  constexpr int kMessages = 200;
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(engine->send("trainer/0", MessageType::kBucketDone, std::to_string(i)).ok());
  }
  for (int i = 0; i < kMessages; ++i) {
    auto m = trainer->receive(2s);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->type, MessageType::kBucketDone);
    EXPECT_EQ(m->from, "engine/0/1");
    EXPECT_EQ(m->payload, std::to_string(i));
  }

  std::string binary("a\0b", 3);
  ASSERT_TRUE(trainer->send("engine/0/1", MessageType::kCommit, binary).ok());
  ASSERT_TRUE(trainer->send("engine/0/1", MessageType::kShutdown, "").ok());
  auto c = engine->receive(2s);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->type, MessageType::kCommit);
  EXPECT_EQ(c->payload, binary);
  auto s = engine->receive(2s);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->type, MessageType::kShutdown);
  EXPECT_EQ(s->from, "trainer/0");
  EXPECT_TRUE(s->payload.empty());
}

// Refit epochs (docs/runtime.md, "A refit that fails in flight"): messages of a failed refit's
// epoch are dropped once the receiver moved on; a message from a peer that moved on first ends
// the wait with kAborted and is kept until the receiver moved on too.
TEST_F(MailboxTest, EpochsDropOlderMessagesAndKeepNewerOnes) {
  auto trainer = open("trainer/0");
  auto engine = open("engine/0");
  ASSERT_TRUE(trainer && engine);
  EXPECT_EQ(engine->epoch(), 0u);
  ASSERT_TRUE(trainer->send("engine/0", MessageType::kCommit, "epoch 0").ok());
  trainer->set_epoch(1);
  ASSERT_TRUE(trainer->send("engine/0", MessageType::kBegin, "epoch 1").ok());
  // Still at epoch 0: the first arrives; the second is of a later epoch.
  auto first = engine->receive(2s);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_EQ(first->payload, "epoch 0");
  EXPECT_EQ(first->epoch, 0u);
  auto later = engine->receive(2s);
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.status().code(), StatusCode::kAborted);
  EXPECT_NE(later.status().message().find("belongs to refit epoch 1, after this rank's 0"),
            std::string::npos)
      << later.status().to_string();
  EXPECT_EQ(engine->kept_epoch(), 1u);
  // Asked again before moving on: the same answer, at once.
  const auto t0 = Clock::now();
  EXPECT_EQ(engine->receive(2s).status().code(), StatusCode::kAborted);
  EXPECT_LT(seconds_since(t0), 1.0);
  engine->set_epoch(1);
  auto kept = engine->receive(2s);
  ASSERT_TRUE(kept.ok()) << kept.status().to_string();
  EXPECT_EQ(kept->payload, "epoch 1");
  EXPECT_EQ(kept->epoch, 1u);
  EXPECT_EQ(engine->kept_epoch(), 0u);
  // An epoch-0 straggler after both moved on is dropped; the next message arrives.
  trainer->set_epoch(0);
  ASSERT_TRUE(trainer->send("engine/0", MessageType::kCommitted, "stale").ok());
  trainer->set_epoch(1);
  ASSERT_TRUE(trainer->send("engine/0", MessageType::kCommit, "fresh").ok());
  auto fresh = engine->receive(2s);
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  EXPECT_EQ(fresh->payload, "fresh");
  EXPECT_EQ(engine->dropped(), 0) << "a stale message is not a malformed one";
}

TEST_F(MailboxTest, SendWaitsForAPeerThatOpensLater) {
  auto trainer = open("trainer/0");
  ASSERT_TRUE(trainer);
  Status sent = Status::Internal("unset");
  std::thread sender([&] { sent = trainer->send("engine/late", MessageType::kBegin, "step 1"); });
  std::this_thread::sleep_for(200ms);
  auto late = open("engine/late");
  ASSERT_TRUE(late);
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent.to_string();
  auto m = late->receive(2s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->type, MessageType::kBegin);
  EXPECT_EQ(m->payload, "step 1");
}

TEST_F(MailboxTest, ReceiveTimesOut) {
  auto box = open("engine/0/0");
  ASSERT_TRUE(box);
  const auto t0 = Clock::now();
  auto m = box->receive(150ms);
  const double s = seconds_since(t0);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kTimeout);
  EXPECT_NE(m.status().message().find("engine/0/0"), std::string::npos);
  EXPECT_GE(s, 0.14);
  EXPECT_LT(s, 1.5);
}

// A wait for one phase's messages is a deadline: messages a peer keeps sending for a later phase
// (kept for it) do not extend it.
TEST_F(MailboxTest, AStreamOfLaterMessagesDoesNotExtendAWait) {
  auto trainer = open("trainer/0");
  auto engine = open("engine/0");
  ASSERT_TRUE(trainer && engine);
  Inbox inbox(*trainer);
  std::atomic<bool> stop{false}, ran_out{false};
  std::thread flood([&] {  // a verdict every 20 ms, for at most 10 s
    const auto until = Clock::now() + 10s;
    while (!stop.load()) {
      if (Clock::now() >= until) {
        ran_out = true;
        return;
      }
      (void)engine->send("trainer/0", MessageType::kVerified, "{}");
      std::this_thread::sleep_for(20ms);
    }
  });
  auto r = inbox.collect(MessageType::kCommitted, {"engine/0"}, 400ms, "commit acknowledgements",
                         {MessageType::kVerified});
  stop = true;
  flood.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout);
  EXPECT_NE(r.status().message().find("no message within 400 ms"), std::string::npos)
      << r.status().to_string();
  EXPECT_GT(inbox.kept(), 0u) << "the later phase's messages arrived during the wait";
  EXPECT_FALSE(ran_out.load()) << "the wait lasted as long as the stream";
}

TEST_F(MailboxTest, SendToAPeerThatNeverAppearsFailsNamingIt) {
  auto box = open("trainer/0", 300ms);
  ASSERT_TRUE(box);
  const auto t0 = Clock::now();
  Status s = box->send("engine/ghost", MessageType::kBegin, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_NE(s.message().find("engine/ghost"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("trainer/0"), std::string::npos) << s.message();
}

TEST_F(MailboxTest, SendToAPeerThatClosedFailsWithinTheTimeout) {
  auto trainer = open("trainer/0", 300ms);
  auto engine = open("engine/0/0");
  ASSERT_TRUE(trainer && engine);
  ASSERT_TRUE(trainer->send("engine/0/0", MessageType::kBegin, "1").ok());
  ASSERT_TRUE(engine->receive(2s).ok());
  engine.reset();  // the engine process exits

  // The disconnect is noticed asynchronously; within a few sends every send must fail fast.
  const auto t0 = Clock::now();
  Status s;
  for (int i = 0; i < 20 && s.ok(); ++i) {
    s = trainer->send("engine/0/0", MessageType::kBucket, "b");
    if (s.ok()) std::this_thread::sleep_for(50ms);
  }
  ASSERT_FALSE(s.ok()) << "sends to a closed mailbox kept succeeding";
  EXPECT_LT(seconds_since(t0), 3.0);
  EXPECT_NE(s.message().find("engine/0/0"), std::string::npos) << s.message();
}

// A TCP relay on 127.0.0.1: it takes connections at once, but forwards their bytes to `to_port`
// (both ways) only `hold` after the first arrived: a peer whose handshake is slow (a host where
// many ranks start at once).
class SlowRelay {
 public:
  SlowRelay(int to_port, std::chrono::milliseconds hold) : to_port_(to_port), hold_(hold) {}
  int port() const { return relay_.port(); }

 private:
  void serve(const testing::LoopbackRelay& relay) const {
    const auto end = Clock::now() + 30s;  // every loop below is bounded by this
    int client = -1;
    while (client < 0 && !relay.stopping() && Clock::now() < end) {
      pollfd p{relay.listen_fd(), POLLIN, 0};
      if (::poll(&p, 1, 50) == 1)
        client = ::accept4(relay.listen_fd(), nullptr, nullptr, SOCK_CLOEXEC);
    }
    const auto forward_at = Clock::now() + hold_;
    while (!relay.stopping() && Clock::now() < forward_at) std::this_thread::sleep_for(10ms);
    const int server =
        client >= 0 && !relay.stopping() ? testing::connect_to_loopback(to_port_) : -1;
    bool open = server >= 0;
    while (open && !relay.stopping() && Clock::now() < end) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      for (int i = 0; i < 2; ++i)
        if (p[i].revents != 0 && !testing::LoopbackRelay::forward(p[i].fd, p[1 - i].fd))
          open = false;
    }
    if (server >= 0) ::close(server);
    if (client >= 0) ::close(client);
  }
  const int to_port_;
  const std::chrono::milliseconds hold_;
  testing::LoopbackRelay relay_{[this](const testing::LoopbackRelay& r) { serve(r); }};  // last
};

// A peer that takes no message within the send timeout (3 s) is probed: one whose port accepts
// connections is alive, only slow (its handshake), and is waited for up to the mailbox's whole
// timeout; one whose port refuses has exited, and the send fails at once.
TEST_F(MailboxTest, APeerSlowToCompleteItsHandshakeIsWaitedForAndAGoneOneIsNot) {
  auto trainer = open("trainer/0", 10s);
  auto engine = open("engine/0");
  ASSERT_TRUE(trainer && engine);
  auto published = store_->get("mailbox/engine/0", 1s);
  ASSERT_TRUE(published.ok());
  SlowRelay relay(std::atoi(published->c_str() + published->rfind(':') + 1), 4500ms);
  // "engine/slow" is engine/0 behind the relay (no lane: its messages go over ZeroMQ).
  ASSERT_TRUE(
      store_->set("mailbox/engine/slow", fmt::format("tcp://127.0.0.1:{}", relay.port())).ok());
  const Status slow = trainer->send("engine/slow", MessageType::kBegin, "late but there");
  ASSERT_TRUE(slow.ok()) << slow.to_string();
  auto m = engine->receive(5s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->from, "trainer/0");
  EXPECT_EQ(m->payload, "late but there");

  // A port nothing listens on (taken, then freed): the peer exited.
  const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&a), len), 0);
  ASSERT_EQ(::getsockname(probe, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(probe);
  ASSERT_TRUE(
      store_->set("mailbox/engine/gone", fmt::format("tcp://127.0.0.1:{}", ntohs(a.sin_port)))
          .ok());
  const Status gone = trainer->send("engine/gone", MessageType::kBegin, "x");
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.message().find("its port refuses connections (exited?)"), std::string::npos)
      << gone.to_string();
}

TEST_F(MailboxTest, ConcurrentSendAndReceiveThreads) {
  auto a = open("a");
  auto b = open("b");
  ASSERT_TRUE(a && b);
  constexpr int kMessages = 500;
  auto pump = [&](Mailbox& self, const std::string& peer, int* received_in_order,
                  Status* send_status) {
    std::thread sender([&] {
      for (int i = 0; i < kMessages && send_status->ok(); ++i)
        *send_status = self.send(peer, MessageType::kBucket, std::to_string(i));
    });
    for (int i = 0; i < kMessages; ++i) {
      auto m = self.receive(5s);
      if (!m.ok() || m->payload != std::to_string(i) || m->from != peer) break;
      ++*received_in_order;
    }
    sender.join();
  };
  int a_got = 0, b_got = 0;
  Status a_sent, b_sent;
  std::thread ta([&] { pump(*a, "b", &a_got, &a_sent); });
  std::thread tb([&] { pump(*b, "a", &b_got, &b_sent); });
  ta.join();
  tb.join();
  EXPECT_TRUE(a_sent.ok()) << a_sent.to_string();
  EXPECT_TRUE(b_sent.ok()) << b_sent.to_string();
  EXPECT_EQ(a_got, kMessages);
  EXPECT_EQ(b_got, kMessages);
}

// Two mailboxes of one host exchange messages over their lanes, not ZeroMQ: the published lane
// names this host, and the receiving mailbox counts what came over it.
TEST_F(MailboxTest, SameHostMessagesTakeTheLane) {
  auto trainer = open("trainer/0");
  auto engine = open("engine/0/0");
  ASSERT_TRUE(trainer && engine);
  auto lane = store_->get("lane/engine/0/0", 1s);
  ASSERT_TRUE(lane.ok()) << lane.status().to_string();
  EXPECT_EQ(lane->rfind("mailbox-test-host\n", 0), 0u) << *lane;
  const std::string big(300 << 10, 'b');  // more than a socket buffer: written in pieces
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(trainer->send("engine/0/0", MessageType::kBucket, std::to_string(i) + big).ok());
  for (int i = 0; i < 5; ++i) {
    auto m = engine->receive(5s);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->from, "trainer/0");
    EXPECT_EQ(m->payload, std::to_string(i) + big);
  }
  ASSERT_TRUE(engine->send("trainer/0", MessageType::kCommitted, "c").ok());
  auto c = trainer->receive(2s);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->type, MessageType::kCommitted);
  EXPECT_EQ(engine->lane_messages(), 5);
  EXPECT_EQ(trainer->lane_messages(), 1);
  // What a sender wrote before it exited is still delivered.
  {
    auto last = open("trainer/1");
    ASSERT_TRUE(last);
    for (int i = 0; i < 3; ++i)
      ASSERT_TRUE(last->send("engine/0/0", MessageType::kShutdown, std::to_string(i)).ok());
  }
  for (int i = 0; i < 3; ++i) {
    auto m = engine->receive(2s);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->from, "trainer/1");
    EXPECT_EQ(m->payload, std::to_string(i));
  }
  EXPECT_EQ(engine->lane_messages(), 8);
  EXPECT_EQ(engine->dropped(), 0);
}

// A waiting mailbox wakes for a message on either of its two ways in: a lane, or its ZeroMQ
// socket (a sender with lanes off). Each ping is answered while the other side already waits, so
// a wake-up the wait missed would show as a receive that times out; with the spin on and off
// (that the spin catches messages is asserted by EnvCli.ControlSpinCatchesTheRefitsMessages).
TEST_F(MailboxTest, AWaitWakesForLaneAndZeroMqMessagesAlike) {
  for (const auto spin : {0us, 20000us}) {
    SCOPED_TRACE(fmt::format("spin {} us", spin.count()));
    const std::string tag = std::to_string(spin.count());
    MailboxOptions hub_options = box_options("trainer/" + tag, 5s, nullptr);
    hub_options.settings.spin = spin;
    auto hub = Mailbox::open(*store_, std::move(hub_options));
    ASSERT_TRUE(hub.ok()) << hub.status().to_string();
    auto by_lane = open("engine/lane/" + tag, 5s);
    MailboxOptions zmq_options = box_options("engine/zmq/" + tag, 5s, nullptr);
    zmq_options.settings.lanes = false;
    auto by_zmq = Mailbox::open(*store_, std::move(zmq_options));
    ASSERT_TRUE(by_lane && by_zmq.ok()) << by_zmq.status().to_string();
    constexpr int kRounds = 200;
    // Each peer answers every ping with its payload.
    auto echo = [&](Mailbox& self, Status* status) {
      for (int i = 0; i < kRounds / 2 && status->ok(); ++i) {
        auto m = self.receive(5s);
        if (!m.ok()) {
          *status = m.status();
          return;
        }
        *status = self.send(m->from, MessageType::kCommitted, m->payload);
      }
    };
    Status lane_status, zmq_status;
    std::thread lane_peer([&] { echo(*by_lane, &lane_status); });
    std::thread zmq_peer([&] { echo(**by_zmq, &zmq_status); });
    int answered = 0;
    for (int i = 0; i < kRounds; ++i) {
      const std::string peer = (i % 2 == 0 ? "engine/lane/" : "engine/zmq/") + tag;
      const Status sent = (*hub)->send(peer, MessageType::kBegin, std::to_string(i));
      auto m = (*hub)->receive(5s);
      if (!sent.ok() || !m.ok()) {  // the peers' threads end at their own timeout
        ADD_FAILURE() << "round " << i << ": " << sent.to_string() << "; "
                      << m.status().to_string();
        break;
      }
      EXPECT_EQ(m->from, peer);
      EXPECT_EQ(m->payload, std::to_string(i));
      ++answered;
    }
    lane_peer.join();
    zmq_peer.join();
    EXPECT_TRUE(lane_status.ok()) << lane_status.to_string();
    EXPECT_TRUE(zmq_status.ok()) << zmq_status.to_string();
    EXPECT_EQ(answered, kRounds);
    // Half of the answers came over the lane, the other half over ZeroMQ.
    EXPECT_EQ((*hub)->lane_messages(), kRounds / 2);
    EXPECT_EQ(by_lane->lane_messages(), kRounds / 2);
    EXPECT_EQ((*by_zmq)->lane_messages(), 0);
    EXPECT_EQ((*hub)->dropped(), 0);
  }
}

// A relay's answers reach the inbox one by one, each with its own sender; answers too large for
// one message travel in several. A relayed message from a rank that relays for no one, or with an
// answer of a rank outside the relay's group, is a protocol violation naming the relay.
TEST_F(MailboxTest, RelayedAnswersArriveEachWithItsOwnSender) {
  auto trainer = open("trainer/0");
  auto relay = open("engine/4");
  auto stranger = open("engine/8");
  ASSERT_TRUE(trainer && relay && stranger);
  Inbox inbox(*trainer, 4);
  inbox.accept_relayed({{"engine/4", {"engine/4", "engine/5", "engine/6", "engine/7"}}});
  // 3 answers of 300 KiB each: more than one message may hold (half the mailbox's bound).
  const std::string big(300 << 10, 'p');
  std::vector<Message> answers;
  for (const char* from : {"engine/4", "engine/5", "engine/6"})
    answers.push_back(Message{.type = MessageType::kPaused, .from = from, .payload = big + from});
  answers.push_back(Message{.type = MessageType::kVerified, .from = "engine/7", .payload = "v"});
  const std::int64_t sent_before = relay->sent();
  ASSERT_TRUE(send_relayed(*relay, "trainer/0", answers).ok());
  EXPECT_EQ(relay->sent() - sent_before, 3);  // 300 + 300 KiB would pass 512 KiB
  auto got = inbox.collect(MessageType::kPaused, {"engine/6", "engine/5", "engine/4"}, 2s, "pauses",
                           {MessageType::kVerified});
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ((*got)[0].payload, big + "engine/6");
  EXPECT_EQ((*got)[2].from, "engine/4");
  auto verdict = inbox.collect(MessageType::kVerified, {"engine/7"}, 2s, "verdicts");
  ASSERT_TRUE(verdict.ok()) << verdict.status().to_string();
  EXPECT_EQ((*verdict)[0].payload, "v");

  ASSERT_TRUE(send_relayed(*stranger, "trainer/0", {answers.back()}).ok());
  auto refused = inbox.next({MessageType::kVerified}, 2s, "a verdict");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("relayed answers from engine/8"), std::string::npos)
      << refused.status().to_string();

  ASSERT_TRUE(send_relayed(*relay, "trainer/0",
                           {Message{.type = MessageType::kVerified, .from = "engine/9"}})
                  .ok());
  auto outsider = inbox.next({MessageType::kVerified}, 2s, "a verdict");
  ASSERT_FALSE(outsider.ok());
  EXPECT_NE(outsider.status().message().find("engine/4 relayed verified of engine/9"),
            std::string::npos)
      << outsider.status().to_string();
}

TEST(MailboxNames, EveryTypeHasAName) {
  EXPECT_STREQ(message_type_name(MessageType::kHello), "hello");
  EXPECT_STREQ(message_type_name(MessageType::kBucketDone), "bucket-done");
  EXPECT_STREQ(message_type_name(MessageType::kShutdown), "shutdown");
}

}  // namespace
}  // namespace refit
