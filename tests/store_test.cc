// The rendezvous store: a server in-process, clients on threads.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sodium.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "control/auth.h"
#include "control/lane.h"
#include "control/fd_limit.h"
#include "control/ports.h"
#include "control/store.h"
#include "control/store_lanes.h"
#include "control/store_wire.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::seconds_since;

std::unique_ptr<StoreServer> start_server() {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  EXPECT_TRUE(server.ok()) << server.status().to_string();
  return server.ok() ? std::move(server).value() : nullptr;
}

std::unique_ptr<Store> connect(int port, std::chrono::milliseconds timeout = 5s) {
  auto client = connect_store("127.0.0.1", port, timeout, nullptr);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  return client.ok() ? std::move(client).value() : nullptr;
}

// The counters under "heartbeat/" a watch reports, once it reports any: a closed connection
// reaches the server as a connection event, so this waits for it in rounds (at most 5 s).
std::vector<Store::Stale> closed_counters(Store& watcher) {
  for (int round = 0; round < 100; ++round) {
    auto w = watcher.watch({}, "heartbeat/", std::chrono::hours(1));
    EXPECT_TRUE(w.ok()) << w.status().to_string();
    if (!w.ok() || !w->stale.empty()) return w.ok() ? w->stale : std::vector<Store::Stale>{};
    std::this_thread::sleep_for(50ms);
  }
  return {};
}

// A port that was just free: a server bound it and went away.
int vacated_port() {
  auto server = start_server();
  return server ? server->port() : 0;
}

TEST(Store, SetGetTryGetAcrossClients) {
  auto server = start_server();
  ASSERT_TRUE(server);
  EXPECT_GT(server->port(), 0);
  auto a = connect(server->port());
  auto b = connect(server->port());
  ASSERT_TRUE(a && b);

  ASSERT_TRUE(a->set("k", "v1").ok());
  auto v = b->get("k", 1s);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "v1");

  ASSERT_TRUE(b->set("k", "v2").ok());  // overwrite
  auto t = a->try_get("k");
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(t->has_value());
  EXPECT_EQ(**t, "v2");

  auto absent = a->try_get("nope");
  ASSERT_TRUE(absent.ok()) << absent.status().to_string();
  EXPECT_FALSE(absent->has_value());

  // Binary values and empty values survive.
  std::string binary("\0\1\2\xff", 4);
  ASSERT_TRUE(a->set("bin", binary).ok());
  ASSERT_TRUE(a->set("empty", "").ok());
  EXPECT_EQ(*b->get("bin", 1s), binary);
  EXPECT_EQ(*b->get("empty", 1s), "");

  // A large value (8 MiB) round-trips.
  std::string big(8 << 20, 'x');
  for (std::size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>(i / 4096);
  ASSERT_TRUE(a->set("big", big).ok());
  auto got = b->get("big", 2s);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, big);
}

// One request reads many keys: present, absent, empty and binary values, in order (the liveness
// A key erased is gone for every client (an absent one erases without error, and a PrefixStore
// erases its own); only export/ and outcome/ keys may go: a heartbeat, an address or a recorded
// failure is refused, naming the key.
TEST(Store, EraseRemovesExportAndOutcomeKeysOnly) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto a = connect(server->port());
  auto b = connect(server->port());
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->set("export/engine/0/abc", std::string(1 << 20, 'h')).ok());
  ASSERT_TRUE(b->erase("export/engine/0/abc").ok());
  auto gone = a->try_get("export/engine/0/abc");
  ASSERT_TRUE(gone.ok()) << gone.status().to_string();
  EXPECT_FALSE(gone->has_value());
  EXPECT_TRUE(a->erase("outcome/0/9/1").ok());  // never set
  PrefixStore group("run", *a);
  ASSERT_TRUE(group.set("outcome/0/1/3", "ok").ok());
  ASSERT_TRUE(group.erase("outcome/0/1/3").ok());
  EXPECT_FALSE(b->try_get("run/outcome/0/1/3")->has_value());
  ASSERT_TRUE(b->add("heartbeat/trainer/1", 1).ok());
  ASSERT_TRUE(b->set("error/first", "boom").ok());
  ASSERT_TRUE(b->set("mailbox/engine/0", "tcp://127.0.0.1:1").ok());
  for (const char* kept : {"heartbeat/trainer/1", "error/first", "mailbox/engine/0",
                           "run/mailbox/exported/x", "myexport/1"}) {
    const Status refused = a->erase(kept);
    ASSERT_FALSE(refused.ok()) << kept;
    EXPECT_NE(refused.message().find(std::string("'") + kept + "' is not erasable"),
              std::string::npos)
        << refused.to_string();
  }
  EXPECT_EQ(*a->try_get("heartbeat/trainer/1"), std::optional<std::string>("1"));
  EXPECT_EQ(*a->try_get("error/first"), std::optional<std::string>("boom"));
}

// check reads every peer's heartbeat this way); the same through a PrefixStore.
TEST(Store, TryGetManyReadsEveryKeyInOneRequest) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto a = connect(server->port());
  ASSERT_TRUE(a);
  const std::string binary("\0\1\2\xff", 4);
  ASSERT_TRUE(a->set("x", "1").ok());
  ASSERT_TRUE(a->set("empty", "").ok());
  ASSERT_TRUE(a->set("bin", binary).ok());
  auto v = a->try_get_many({"x", "missing", "empty", "bin", "x"});
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  ASSERT_EQ(v->size(), 5u);
  EXPECT_EQ((*v)[0], std::optional<std::string>("1"));
  EXPECT_EQ((*v)[1], std::nullopt);
  EXPECT_EQ((*v)[2], std::optional<std::string>(""));
  EXPECT_EQ((*v)[3], std::optional<std::string>(binary));
  EXPECT_EQ((*v)[4], std::optional<std::string>("1"));
  EXPECT_TRUE(a->try_get_many({})->empty());
  PrefixStore group("heartbeat", *a);
  ASSERT_TRUE(group.set("engine 0 tp rank 1", "7").ok());
  auto g = group.try_get_many({"engine 0 tp rank 1", "trainer rank 0"});
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(*g, (std::vector<std::optional<std::string>>{"7", std::nullopt}));
}

// The liveness read: keys' values and the keys under a prefix that stood still, in one request
// answered from the server's record of when each key last changed. A silence of 0 makes every
// such key stale, one of an hour none: the answer depends on the record, not on the test's timing.
TEST(Store, WatchNamesTheKeysThatStoodStill) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto a = connect(server->port());
  ASSERT_TRUE(a);
  ASSERT_TRUE(a->set("error/first", "boom").ok());
  ASSERT_TRUE(a->add("heartbeat/trainer/1", 1).ok());
  ASSERT_TRUE(a->add("heartbeat/engine/0", 3).ok());
  ASSERT_TRUE(a->set("heartbeat/engine/1", "left").ok());
  ASSERT_TRUE(a->set("other/engine/2", "1").ok());
  const std::int64_t before = a->requests();
  auto w = a->watch({"error/first", "refit/failed/0"}, "heartbeat/", 0ms);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(a->requests(), before + 1);
  EXPECT_EQ(w->values, (std::vector<std::optional<std::string>>{"boom", std::nullopt}));
  std::vector<std::string> stale;
  for (const Store::Stale& k : w->stale) {
    stale.push_back(k.key);
    EXPECT_GE(k.age.count(), 0);
  }
  std::sort(stale.begin(), stale.end());
  // Not the rank that left, not a key outside the prefix.
  EXPECT_EQ(stale, (std::vector<std::string>{"heartbeat/engine/0", "heartbeat/trainer/1"}));
  auto none = a->watch({}, "heartbeat/", std::chrono::hours(1));
  ASSERT_TRUE(none.ok()) << none.status().to_string();
  EXPECT_TRUE(none->values.empty());
  EXPECT_TRUE(none->stale.empty());
  // Through a prefix store, keys and names are the group's own.
  PrefixStore group("run", *a);
  ASSERT_TRUE(group.add("heartbeat/engine/3", 1).ok());
  auto g = group.watch({"heartbeat/engine/3"}, "heartbeat/", 0ms);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(g->values, (std::vector<std::optional<std::string>>{"1"}));
  ASSERT_EQ(g->stale.size(), 1u);
  EXPECT_EQ(g->stale[0].key, "heartbeat/engine/3");
}

// A counter whose connection closes without the key holding "left" (its process exited or was
// killed: the kernel closes the connection at once) is reported closed by the next watch, however
// long the silence asked for; one that left, or whose connection is open, is not.
TEST(Store, WatchNamesTheCountersWhoseConnectionClosedWithoutLeaving) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto watcher = connect(server->port());
  auto alive = connect(server->port());
  auto gone = connect(server->port());
  auto leaver = connect(server->port());
  ASSERT_TRUE(watcher && alive && gone && leaver);
  ASSERT_TRUE(alive->add("heartbeat/engine/0", 1).ok());
  ASSERT_TRUE(gone->add("heartbeat/engine/1", 1).ok());
  ASSERT_TRUE(leaver->add("heartbeat/engine/2", 1).ok());
  ASSERT_TRUE(leaver->set("heartbeat/engine/2", "left").ok());
  gone.reset();
  leaver.reset();
  const std::vector<Store::Stale> stale = closed_counters(*watcher);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].key, "heartbeat/engine/1");
  EXPECT_TRUE(stale[0].closed);
  EXPECT_GE(stale[0].age.count(), 0);
  // A silence of 0 adds the open connection's counter, as standing still, not closed.
  auto all = watcher->watch({}, "heartbeat/", 0ms);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  std::map<std::string, bool> closed;
  for (const Store::Stale& k : all->stale) closed[k.key] = k.closed;
  EXPECT_EQ(closed, (std::map<std::string, bool>{{"heartbeat/engine/0", false},
                                                 {"heartbeat/engine/1", true}}));
}

// A rank's beat carries its liveness read (Store::beat_and_watch): one request that adds to the
// rank's counter before it reads, and makes that connection the counter's, so that its close reads
// as the rank's exit. A beat on a key that holds no integer fails naming the key, and reads nothing.
TEST(Store, ABeatCarriesTheWatchInOneRequestAndCountsForItsConnection) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto watcher = connect(server->port());
  auto rank = connect(server->port());
  ASSERT_TRUE(watcher && rank);
  ASSERT_TRUE(watcher->set("error/first", "boom").ok());
  const std::int64_t before = rank->requests();
  auto w = rank->beat_and_watch("heartbeat/engine/1", {"error/first", "heartbeat/engine/1"},
                                "heartbeat/", std::chrono::hours(1), 5s);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(rank->requests(), before + 1);
  EXPECT_EQ(w->values, (std::vector<std::optional<std::string>>{"boom", "1"}));
  EXPECT_TRUE(w->stale.empty());
  // Through a prefix store, the beat and the keys are the group's own.
  auto member = connect(server->port());
  ASSERT_TRUE(member);
  PrefixStore group("run", *member);
  auto g = group.beat_and_watch("heartbeat/engine/1", {"heartbeat/engine/1"}, "heartbeat/", 0ms,
                                5s);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(g->values, (std::vector<std::optional<std::string>>{"1"}));
  ASSERT_EQ(g->stale.size(), 1u);  // a silence of 0: the key just beaten, as the group names it
  EXPECT_EQ(g->stale[0].key, "heartbeat/engine/1");
  ASSERT_TRUE(watcher->set("heartbeat/engine/7", "left").ok());
  auto bad = rank->beat_and_watch("heartbeat/engine/7", {}, "heartbeat/", 0ms, 5s);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'heartbeat/engine/7' is not an integer"),
            std::string::npos)
      << bad.status().to_string();
  rank.reset();  // exits without leaving
  const std::vector<Store::Stale> stale = closed_counters(*watcher);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].key, "heartbeat/engine/1");
  EXPECT_TRUE(stale[0].closed);
}

// A liveness read looks at the heartbeats that stood still (and those of ranks that left), not at
// every live rank's: the server keeps each directory of keys oldest first and stops at the first
// that changed within the silence. Prefixes that end inside a key's last part still match.
TEST(Store, AWatchVisitsTheKeysThatStoodStillNotEveryLiveOne) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto a = connect(server->port());
  ASSERT_TRUE(a);
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(a->add(fmt::format("heartbeat/trainer/{}", i), 1).ok());
  ASSERT_TRUE(a->set("mailbox/trainer/0", "set once, outside the prefix").ok());
  std::int64_t before = server->watch_visits();
  auto live = a->watch({}, "heartbeat/", std::chrono::hours(1));
  ASSERT_TRUE(live.ok()) << live.status().to_string();
  EXPECT_TRUE(live->stale.empty());
  EXPECT_EQ(server->watch_visits() - before, 1);  // the oldest heartbeat, which is young
  before = server->watch_visits();
  auto all = a->watch({}, "heartbeat/", 0ms);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(all->stale.size(), 300u);
  EXPECT_EQ(server->watch_visits() - before, 300);
  // A prefix that ends inside a key's last part: the keys of the directory it ends in match, and
  // those of the directories under it.
  ASSERT_TRUE(a->add("heartbeat/engine0", 1).ok());
  ASSERT_TRUE(a->add("heartbeat/engine/1", 1).ok());
  ASSERT_TRUE(a->add("heartbeat/other", 1).ok());
  auto partial = a->watch({}, "heartbeat/eng", 0ms);
  ASSERT_TRUE(partial.ok()) << partial.status().to_string();
  std::vector<std::string> names;
  for (const Store::Stale& k : partial->stale) names.push_back(k.key);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"heartbeat/engine/1", "heartbeat/engine0"}));
}

// A stretch in which the server heard no request at all (its own process stalled: every live rank
// beats every 0.5 s) is not counted in a key's age beyond its first second; a key that stood still
// while other connections went on talking is. Generous margins: a loaded machine only lengthens
// the deaf stretch, which the first case leaves out, and the second needs a talker silent 2.5 s.
TEST(Store, WatchLeavesOutTheStretchesInWhichTheServerHeardNothing) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto beats = connect(server->port());
  auto talker = connect(server->port());
  ASSERT_TRUE(beats && talker);
  ASSERT_TRUE(beats->add("heartbeat/trainer/1", 1).ok());
  std::this_thread::sleep_for(3s);  // nobody talks
  auto deaf = beats->watch({}, "heartbeat/", 2500ms);
  ASSERT_TRUE(deaf.ok()) << deaf.status().to_string();
  EXPECT_TRUE(deaf->stale.empty()) << deaf->stale[0].key << " " << deaf->stale[0].age.count();

  ASSERT_TRUE(beats->add("heartbeat/trainer/1", 1).ok());
  const auto until = std::chrono::steady_clock::now() + 4s;
  while (std::chrono::steady_clock::now() < until) {  // another connection talks all along
    ASSERT_TRUE(talker->ping(5s).ok());
    std::this_thread::sleep_for(100ms);
  }
  auto heard = beats->watch({}, "heartbeat/", 2500ms);
  ASSERT_TRUE(heard.ok()) << heard.status().to_string();
  ASSERT_EQ(heard->stale.size(), 1u);
  EXPECT_EQ(heard->stale[0].key, "heartbeat/trainer/1");
  EXPECT_GE(heard->stale[0].age.count(), 2500);
}

TEST(Store, GetBlocksUntilAnotherClientSets) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto reader = connect(server->port());
  auto writer = connect(server->port());
  ASSERT_TRUE(reader && writer);

  // Two parked gets on different keys; answering them in reverse order shows the server is not
  // blocked by either of them.
  Result<std::string> first = Status::Internal("unset"), second = Status::Internal("unset");
  std::thread t1([&] { first = reader->get("first", 5s); });
  std::thread t2([&] { second = reader->get("second", 5s); });  // same client, concurrent call
  std::this_thread::sleep_for(100ms);
  auto probe = writer->try_get("first");
  ASSERT_TRUE(probe.ok());
  EXPECT_FALSE(probe->has_value());
  ASSERT_TRUE(writer->set("second", "2").ok());
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(writer->set("first", "1").ok());
  t1.join();
  t2.join();
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(*first, "1");
  EXPECT_EQ(*second, "2");
}

// get_while_alive asks its liveness check between 500 ms slices: a failing check ends the wait
// with the check's Status (counted, so the path that ran is known); a passing one lets the wait
// run to its timeout, which names the key; a key set meanwhile is returned.
TEST(Store, GetWhileAliveEndsWhenTheCheckFails) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto c = connect(server->port());
  ASSERT_TRUE(c);
  int asked = 0;
  auto v = get_while_alive(*c, "never/set", 60s, [&] {
    return ++asked < 2 ? Status::Ok() : Status::Aborted("aborted because engine 3 died");
  });
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kAborted) << v.status().to_string();
  EXPECT_EQ(asked, 2);
  EXPECT_NE(v.status().message().find("waiting for store key 'never/set'"), std::string::npos)
      << v.status().message();
  EXPECT_NE(v.status().message().find("engine 3 died"), std::string::npos);

  asked = 0;
  auto t = get_while_alive(*c, "never/set", 1200ms, [&] {
    ++asked;
    return Status::Ok();
  });
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kTimeout);
  EXPECT_NE(t.status().message().find("store key 'never/set' was not set within 1200 ms"),
            std::string::npos)
      << t.status().message();
  EXPECT_GE(asked, 1);

  std::thread setter([&] {
    std::this_thread::sleep_for(700ms);
    auto other = connect(server->port());
    ASSERT_TRUE(other && other->set("late/key", "v").ok());
  });
  auto late = get_while_alive(*c, "late/key", 10s, [] { return Status::Ok(); });
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status().to_string();
  EXPECT_EQ(*late, "v");
}

TEST(Store, GetTimeoutNamesTheKey) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto c = connect(server->port());
  ASSERT_TRUE(c);
  const auto t0 = Clock::now();
  auto v = c->get("missing/key", 200ms);
  const double s = seconds_since(t0);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kTimeout);
  EXPECT_NE(v.status().message().find("missing/key"), std::string::npos) << v.status().message();
  EXPECT_NE(v.status().message().find(std::to_string(server->port())), std::string::npos);
  EXPECT_GE(s, 0.19);
  EXPECT_LT(s, 2.0);
  // The client stays usable after a timeout.
  ASSERT_TRUE(c->set("missing/key", "late").ok());
  EXPECT_EQ(*c->get("missing/key", 1s), "late");
}

TEST(Store, WaitForSeveralKeys) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto c = connect(server->port());
  auto w = connect(server->port());
  ASSERT_TRUE(c && w);
  EXPECT_TRUE(c->wait({}, 10ms).ok());

  Status waited = Status::Internal("unset");
  std::thread waiter([&] { waited = w->wait({"a", "b", "c"}, 5s); });
  ASSERT_TRUE(c->set("a", "1").ok());
  ASSERT_TRUE(c->set("b", "1").ok());
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(c->set("c", "1").ok());
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited.to_string();

  // A timed-out wait names the keys still missing, not the present ones.
  Status partial = c->wait({"a", "x", "y"}, 150ms);
  ASSERT_FALSE(partial.ok());
  EXPECT_EQ(partial.code(), StatusCode::kTimeout);
  EXPECT_NE(partial.message().find("still missing: 'x', 'y'"), std::string::npos)
      << partial.message();
}

TEST(Store, AddIsAtomicAcrossThreads) {
  auto server = start_server();
  ASSERT_TRUE(server);
  constexpr int kThreads = 4, kAdds = 100;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto c = connect(server->port());
      if (!c) return void(++failures);
      for (int i = 0; i < kAdds; ++i)
        if (!c->add("counter", 1).ok()) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  auto c = connect(server->port());
  ASSERT_TRUE(c);
  auto n = c->add("counter", 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, kThreads * kAdds);
  EXPECT_EQ(*c->get("counter", 1s), std::to_string(kThreads * kAdds));
  EXPECT_EQ(*c->add("fresh", -5), -5);

  ASSERT_TRUE(c->set("text", "hello").ok());
  auto bad = c->add("text", 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'text' is not an integer"), std::string::npos)
      << bad.status().message();
}

TEST(Store, PrefixStoreNamespacesKeys) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto base = connect(server->port());
  ASSERT_TRUE(base);
  PrefixStore group("gloo/update", *base);

  ASSERT_TRUE(group.set("0", "addr").ok());
  EXPECT_EQ(*base->get("gloo/update/0", 1s), "addr");
  EXPECT_EQ(*group.get("0", 1s), "addr");
  EXPECT_FALSE(base->try_get("0")->has_value());
  EXPECT_TRUE(group.try_get("0")->has_value());
  EXPECT_EQ(*group.add("n", 3), 3);
  EXPECT_EQ(*base->get("gloo/update/n", 1s), "3");
  ASSERT_TRUE(base->set("gloo/update/1", "x").ok());
  EXPECT_TRUE(group.wait({"0", "1"}, 1s).ok());

  auto missing = group.get("2", 100ms);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("gloo/update/2"), std::string::npos);
}

TEST(Store, ClientRetriesUntilTheServerStarts) {
  const int port = vacated_port();
  ASSERT_GT(port, 0);
  Result<std::unique_ptr<Store>> client = Status::Internal("unset");
  std::thread connecting([&] { client = connect_store("127.0.0.1", port, 5s, nullptr); });
  std::this_thread::sleep_for(300ms);
  auto server = StoreServer::start("127.0.0.1", port, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  connecting.join();
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  ASSERT_TRUE((*client)->set("k", "v").ok());
  EXPECT_EQ(*(*client)->get("k", 1s), "v");
}

TEST(Store, ConnectWithoutServerFailsNamingTheAddress) {
  const int port = vacated_port();
  const auto t0 = Clock::now();
  auto client = connect_store("127.0.0.1", port, 300ms, nullptr);
  const double s = seconds_since(t0);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kTimeout);
  EXPECT_NE(client.status().message().find("tcp://127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << client.status().message();
  EXPECT_LT(s, 2.0);

  EXPECT_EQ(connect_store("127.0.0.1", 0, 100ms, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StoreServer::start("127.0.0.1", 70000, nullptr).status().code(), StatusCode::kInvalidArgument);
}

TEST(Store, BindingAPortInUseFails) {
  auto server = start_server();
  ASSERT_TRUE(server);
  auto second = StoreServer::start("127.0.0.1", server->port(), nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kIOError);
  EXPECT_NE(second.status().message().find(std::to_string(server->port())), std::string::npos);
}

// A TCP relay on 127.0.0.1 in front of `to_port`: it forwards every connection both ways but the
// `cut`-th (from 1), which it closes when that connection's first bytes arrive, as a server's cap
// on waiting handshakes cuts one. Every loop is bounded by 30 s.
class CuttingRelay {
 public:
  CuttingRelay(int to_port, int cut) : to_port_(to_port), cut_(cut) {}
  int port() const { return relay_.port(); }
  int accepted() const { return accepted_.load(); }
  bool cut_done() const { return cut_done_.load(); }

 private:
  void serve(const testing::LoopbackRelay& relay) {
    const auto end = Clock::now() + 30s;
    std::vector<std::pair<int, int>> pairs;  // client, server; -1 once closed
    int cut_fd = -1;
    while (!relay.stopping() && Clock::now() < end) {
      std::vector<pollfd> p{{relay.listen_fd(), POLLIN, 0}, {cut_fd, POLLIN, 0}};
      for (const auto& [c, s] : pairs) {
        p.push_back({c, POLLIN, 0});
        p.push_back({s, POLLIN, 0});
      }
      if (::poll(p.data(), p.size(), 50) <= 0) continue;
      const std::size_t polled = pairs.size();  // a pair accepted below was not polled
      if (p[0].revents & POLLIN) {
        const int c = ::accept4(relay.listen_fd(), nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0 && ++accepted_ == cut_) {
          cut_fd = c;
        } else if (c >= 0) {
          const int s = testing::connect_to_loopback(to_port_);
          if (s >= 0)
            pairs.emplace_back(c, s);
          else
            ::close(c);
        }
      }
      if (cut_fd >= 0 && p[1].revents != 0) {
        char buf[4096];
        (void)::recv(cut_fd, buf, sizeof buf, 0);
        ::close(cut_fd);
        cut_fd = -1;
        cut_done_ = true;
      }
      for (std::size_t k = 0; k < polled; ++k) {
        auto& [c, s] = pairs[k];
        if (c < 0) continue;
        bool open = true;
        for (int side = 0; side < 2; ++side)
          if (p[2 + 2 * k + side].revents != 0 &&
              !testing::LoopbackRelay::forward(side == 0 ? c : s, side == 0 ? s : c))
            open = false;
        if (!open) {
          ::close(c);
          ::close(s);
          c = s = -1;
        }
      }
    }
    for (const auto& [c, s] : pairs) {
      if (c >= 0) ::close(c);
      if (s >= 0) ::close(s);
    }
    if (cut_fd >= 0) ::close(cut_fd);
  }
  const int to_port_;
  const int cut_;
  std::atomic<int> accepted_{0};
  std::atomic<bool> cut_done_{false};
  testing::LoopbackRelay relay_{[this](const testing::LoopbackRelay& r) { serve(r); }};  // last
};

// The server cuts a handshake (its cap on waiting handshakes) of a second connection of a client
// whose first connection it serves: the server is alive, so the client's calls go on (ZeroMQ
// connects again) instead of failing as if the server had exited.
TEST(Store, AConnectionCutInItsHandshakeWhileAnotherIsServedIsNotALostServer) {
  auto server = start_server();
  ASSERT_TRUE(server);
  CuttingRelay relay(server->port(), 2);
  auto c = connect(relay.port());  // its ping: the relay's first connection
  ASSERT_TRUE(c);
  ASSERT_EQ(relay.accepted(), 1);
  auto writer = connect(server->port());
  ASSERT_TRUE(writer);
  // The first connection parked in a get, the next call opens the second, which the relay cuts.
  Result<std::string> parked = Status::Internal("unset");
  std::thread waiter([&] { parked = c->get("parked", 10s); });
  std::this_thread::sleep_for(200ms);
  const Status set = c->set("k", "v");
  EXPECT_TRUE(relay.cut_done()) << "the relay cut no connection: the test did not run its case";
  EXPECT_TRUE(set.ok()) << set.to_string();
  ASSERT_TRUE(writer->set("parked", "1").ok());
  waiter.join();
  ASSERT_TRUE(parked.ok()) << parked.status().to_string();
  auto got = writer->try_get("k");
  ASSERT_TRUE(got.ok() && got->has_value());
  EXPECT_EQ(**got, "v");
  // A later call still works.
  EXPECT_TRUE(c->set("k2", "v").ok());
}

TEST(Store, DeadServerFailsPendingAndLaterCallsPromptly) {
  auto server = start_server();
  ASSERT_TRUE(server);
  const int port = server->port();
  auto c = connect(port);
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->set("k", "v").ok());

  Result<std::string> pending = Status::Internal("unset");
  const auto t0 = Clock::now();
  std::thread waiter([&] { pending = c->get("never", 8s); });
  std::this_thread::sleep_for(100ms);
  server.reset();  // the hosting process "exits"
  waiter.join();
  ASSERT_FALSE(pending.ok());
  EXPECT_LT(seconds_since(t0), 3.0) << "a parked get must not wait out its timeout";
  EXPECT_NE(pending.status().message().find("tcp://127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << pending.status().message();

  const auto t1 = Clock::now();
  Status later = c->set("k2", "v");
  EXPECT_FALSE(later.ok());
  EXPECT_TRUE(later.code() == StatusCode::kIOError || later.code() == StatusCode::kTimeout)
      << later.to_string();
  EXPECT_LT(seconds_since(t1), 3.0);
  EXPECT_NE(later.message().find(std::to_string(port)), std::string::npos) << later.message();
}

// A TCP socket listening on a free port of 127.0.0.1; `at` gets its address.
int listen_on_loopback(int backlog, sockaddr_in& at) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  at = sockaddr_in{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof at;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  EXPECT_EQ(::listen(fd, backlog), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len), 0);
  return fd;
}

// A TCP server that is not ZeroMQ's (torch.distributed's store, say) on a free port: it accepts,
// then says nothing (`close_at_once`: closes what it accepted).
class ForeignServer {
 public:
  explicit ForeignServer(bool close_at_once) : close_(close_at_once) {
    sockaddr_in a;
    fd_ = listen_on_loopback(64, a);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 50) != 1) continue;
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) continue;
        if (close_)
          ::close(c);
        else
          held_.push_back(c);
      }
    });
  }
  ~ForeignServer() {
    stop_.store(true);
    thread_.join();
    for (int c : held_) ::close(c);
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  const bool close_;
  int fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<int> held_;
  std::thread thread_;
};

std::shared_ptr<const ControlAuth> auth_of(const std::string& secret) {
  auto a = ControlAuth::from_secret(secret);
  EXPECT_TRUE(a.ok());
  return std::make_shared<const ControlAuth>(*a);
}

// The store's port held by another server: refused, saying which kind holds it.
TEST(Store, APortTakenIsRefusedNamingWhatHoldsIt) {
  ForeignServer torch(/*close_at_once=*/false);
  auto taken = StoreServer::start("127.0.0.1", torch.port(), nullptr);
  ASSERT_FALSE(taken.ok());
  EXPECT_NE(taken.status().message().find("port " + std::to_string(torch.port()) +
                                          " on 127.0.0.1 is taken by another server that is not "
                                          "ZeroMQ"),
            std::string::npos)
      << taken.status().to_string();
  EXPECT_NE(taken.status().message().find("REFIT_PORT"), std::string::npos);
  auto store = start_server();
  ASSERT_TRUE(store);
  auto twice = StoreServer::start("127.0.0.1", store->port(), nullptr);
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("is taken by another ZeroMQ server"), std::string::npos)
      << twice.status().to_string();
}

// A connection from 127.0.0.1:`source` to a listener of its own, accepted: `source` is then
// held by a connection, and nothing listens on it.
class HeldBySourcePort {
 public:
  explicit HeldBySourcePort(int source) {
    sockaddr_in a;
    listener_ = listen_on_loopback(1, a);
    client_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    from.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    from.sin_port = htons(static_cast<std::uint16_t>(source));
    EXPECT_EQ(::bind(client_, reinterpret_cast<sockaddr*>(&from), sizeof from), 0);
    EXPECT_EQ(::connect(client_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    accepted_ = ::accept(listener_, nullptr, nullptr);
    EXPECT_GE(accepted_, 0);
  }
  ~HeldBySourcePort() { release(); }
  void release() {
    for (int* fd : {&accepted_, &client_, &listener_})
      if (*fd >= 0) ::close(std::exchange(*fd, -1));
  }

 private:
  int listener_ = -1, client_ = -1, accepted_ = -1;
};

// A port held by a connection (an outgoing connection's source port; in the ephemeral range any
// connection of the host may take it, a rank dialing the store before it listens among them) and
// not by a server: tried again for a while, then refused saying so; a connection that lets go in
// time leaves the port to the store.
TEST(Store, APortHeldByAConnectionIsWaitedForThenRefusedSayingSo) {
  auto picked = pick_free_port();
  ASSERT_TRUE(picked.ok()) << picked.status().to_string();
  const PortRange ephemeral = ephemeral_ports();
  EXPECT_LT(*picked, ephemeral.low) << "the picked port lies in the ephemeral range";
  {
    HeldBySourcePort held(*picked);
    auto refused = StoreServer::start("127.0.0.1", *picked, nullptr);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find(
                  "port " + std::to_string(*picked) +
                  " on 127.0.0.1 is held by a connection, not by a server (nothing listens "
                  "there): a connection bound it as its source port"),
              std::string::npos)
        << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("below " + std::to_string(ephemeral.low)),
              std::string::npos);
  }
  HeldBySourcePort held(*picked);
  std::atomic<bool> released{false};
  std::thread letting_go([&] {
    std::this_thread::sleep_for(300ms);
    released = true;
    held.release();
  });
  auto store = StoreServer::start("127.0.0.1", *picked, nullptr);
  const bool after_release = released.load();
  letting_go.join();
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_TRUE(after_release) << "the port was free at the first bind: nothing was waited for";
  EXPECT_EQ((*store)->port(), *picked);
}

// Ports picked for a store: free, below the ephemeral range, and not torchrun's or refit's
// default.
TEST(Store, PickedPortsAreFreeAndBelowTheEphemeralRange) {
  const PortRange ephemeral = ephemeral_ports();
  ASSERT_LE(ephemeral.low, ephemeral.high);
  for (int i = 0; i < 20; ++i) {
    auto p = pick_free_port();
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    if (ephemeral.low > 21000) {
      EXPECT_LT(*p, ephemeral.low);
      EXPECT_GE(*p, 20000);
    }
    EXPECT_FALSE(*p >= 29400 && *p < 29600) << *p;
    auto server = StoreServer::start("127.0.0.1", *p, nullptr);
    EXPECT_TRUE(server.ok()) << server.status().to_string();
  }
}

// A rank that connects to a port where another server answers is told so; the run secret is not
// blamed, whether or not the rank holds one, and whether the server stays silent (which a stopped
// store host does too, and the message says both) or hangs up.
TEST(Store, AServerThatIsNotAStoreIsNamedAndTheSecretIsNotBlamed) {
  for (const bool close_at_once : {false, true}) {
    ForeignServer torch(close_at_once);
    for (const auto& auth :
         {std::shared_ptr<const ControlAuth>(), auth_of("a-secret-0123456789abcdef")}) {
      auto client = connect_store("127.0.0.1", torch.port(), 2s, auth);
      ASSERT_FALSE(client.ok());
      const std::string m = client.status().message();
      // One that hangs up is not a store; a silent one may be a stopped store host too.
      EXPECT_NE(m.find(close_at_once ? "is not a refit store"
                                     : "accepted this process's connections but never answered"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("torch.distributed's store"), std::string::npos) << m;
      EXPECT_EQ(m.find("run secret"), std::string::npos) << m;
    }
  }
}

// Authentication is blamed only when authentication failed: a store that went away is reported
// as unreachable, while a store of another secret, or one a rank without a secret meets, refuses
// the handshake and says so.
TEST(Store, TheSecretIsBlamedOnlyForAFailedAuthentication) {
  const auto mine = auth_of("the-run-secret-0123456789abcdef");
  int port = 0;
  {
    auto server = StoreServer::start("127.0.0.1", 0, mine);
    ASSERT_TRUE(server.ok());
    port = (*server)->port();
    auto other = connect_store("127.0.0.1", port, 3s, auth_of("another-secret-0123456789abcdef"));
    ASSERT_FALSE(other.ok());
    EXPECT_NE(other.status().message().find("refused this process's handshake"), std::string::npos)
        << other.status().to_string();
    EXPECT_NE(other.status().message().find("Every rank must hold the same run secret"),
              std::string::npos);
    auto none = connect_store("127.0.0.1", port, 3s, nullptr);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.status().message().find("another security mechanism"), std::string::npos)
        << none.status().to_string();
    EXPECT_NE(none.status().message().find("this process has none"), std::string::npos);
  }
  // The store's process is gone.
  auto gone = connect_store("127.0.0.1", port, 1s, mine);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().message().find("run secret"), std::string::npos)
      << gone.status().to_string();
  EXPECT_NE(gone.status().message().find("cannot reach the store server"), std::string::npos)
      << gone.status().to_string();
}

// The store's host checks that it may hold a descriptor per connection of every rank: it raises
// its soft limit as far as the hard one allows, and refuses past that, naming both.
TEST(Store, TheStoresHostCheckItsDescriptorLimit) {
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  const FdLimit now = fd_limit();
  auto huge = StoreServer::start(StoreServerOptions{.ranks = 1 << 28});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("RLIMIT_NOFILE is " + std::to_string(now.soft) +
                                         " (hard limit " + std::to_string(now.hard) + ")"),
            std::string::npos)
      << huge.status().to_string();
  const int ranks = static_cast<int>(std::min<std::int64_t>(now.hard, 1 << 20) - 256) / 4;
  if (ranks > 0 && now.soft < now.hard) {
    rlimit low = before;
    low.rlim_cur = std::min<rlim_t>(before.rlim_cur, 512);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    auto fits = StoreServer::start(StoreServerOptions{.ranks = ranks});
    EXPECT_TRUE(fits.ok()) << fits.status().to_string();
    EXPECT_GE(fd_limit().soft, 4 * ranks + 256);
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &before), 0);
}

// Same-host lanes to the store (control/store_lanes.h): the host identity both sides are given.
constexpr char kLaneHost[] = "store-test-host";

std::unique_ptr<StoreServer> start_lane_server(std::shared_ptr<const ControlAuth> auth) {
  auto server = StoreServer::start(StoreServerOptions{
      .host = "127.0.0.1", .port = 0, .auth = std::move(auth), .lane_host_identity = kLaneHost});
  EXPECT_TRUE(server.ok()) << server.status().to_string();
  return server.ok() ? std::move(server).value() : nullptr;
}

// A heartbeat's client: it beats over a lane as `id` when `host` is the store's.
std::unique_ptr<Store> connect_beats(int port, const std::string& id, const std::string& host,
                                     std::shared_ptr<const ControlAuth> auth) {
  auto client = connect_store(StoreClientOptions{.host = "127.0.0.1",
                                                 .port = port,
                                                 .connect_timeout = 5s,
                                                 .request_timeout = 5s,
                                                 .auth = std::move(auth),
                                                 .lane_id = id,
                                                 .lane_host_identity = host});
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  return client.ok() ? std::move(client).value() : nullptr;
}

// A rank on the store's host beats over a lane to the store's process: its beats and liveness
// reads, and nothing else, are answered there (a refused one with the same error as over ZeroMQ),
// they count the key for the lane, and the lane's close without "left" (its process exited or was
// killed) reads as the rank's exit. A rank on another host beats over ZeroMQ. With and without a
// run secret.
TEST(Store, BeatsFromTheStoresHostTakeALaneThatCountsForTheRank) {
  for (const std::shared_ptr<const ControlAuth>& auth :
       {std::shared_ptr<const ControlAuth>(), auth_of("a-secret-0123456789abcdef")}) {
    SCOPED_TRACE(auth ? "with a run secret" : "without one");
    auto server = start_lane_server(auth);
    ASSERT_TRUE(server);
    EXPECT_FALSE(server->lane_address().empty());
    auto watcher = connect_store("127.0.0.1", server->port(), 5s, auth);
    ASSERT_TRUE(watcher.ok()) << watcher.status().to_string();
    auto rank = connect_beats(server->port(), "engine/1", kLaneHost, auth);
    auto far = connect_beats(server->port(), "engine/2", "another-host", auth);
    ASSERT_TRUE(rank && far);
    ASSERT_TRUE((*watcher)->set("error/first", "boom").ok());
    auto w = rank->beat_and_watch("heartbeat/engine/1", {"error/first", "heartbeat/engine/1"},
                                  "heartbeat/", std::chrono::hours(1), 5s);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_EQ(w->values, (std::vector<std::optional<std::string>>{"boom", "1"}));
    EXPECT_TRUE(w->stale.empty());
    auto n = rank->add("heartbeat/engine/1", 1);
    ASSERT_TRUE(n.ok()) << n.status().to_string();
    EXPECT_EQ(*n, 2);
    EXPECT_EQ(server->lane_requests(), 2);
    ASSERT_TRUE((*watcher)->set("heartbeat/engine/9", "left").ok());
    auto bad = rank->beat_and_watch("heartbeat/engine/9", {}, "heartbeat/", 0ms, 5s);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("'heartbeat/engine/9' is not an integer"),
              std::string::npos)
        << bad.status().to_string();
    EXPECT_EQ(server->lane_requests(), 3);
    // Every other request takes ZeroMQ, and so do the beats of a rank on another host.
    ASSERT_TRUE(rank->set("note/engine/1", "x").ok());
    auto far_beat =
        far->beat_and_watch("heartbeat/engine/2", {}, "heartbeat/", std::chrono::hours(1), 5s);
    ASSERT_TRUE(far_beat.ok()) << far_beat.status().to_string();
    EXPECT_EQ(server->lane_requests(), 3);
    rank.reset();  // exits without leaving: its lane closes
    const std::vector<Store::Stale> stale = closed_counters(**watcher);
    ASSERT_EQ(stale.size(), 1u);
    EXPECT_EQ(stale[0].key, "heartbeat/engine/1");
    EXPECT_TRUE(stale[0].closed);
  }
}

// A key counts for the connection that added to it last: a heartbeat that moved from its lane to
// ZeroMQ (a lane that broke) does not read as an exit when the lane closes, and does once the
// connection that took it over closes.
TEST(Store, AKeyCountsForTheConnectionThatAddedToItLast) {
  auto server = start_lane_server(nullptr);
  ASSERT_TRUE(server);
  auto watcher = connect(server->port());
  auto by_lane = connect_beats(server->port(), "trainer/1", kLaneHost, nullptr);
  auto by_zmq = connect(server->port());
  ASSERT_TRUE(watcher && by_lane && by_zmq);
  ASSERT_TRUE(by_lane->add("heartbeat/trainer/1", 1).ok());
  ASSERT_EQ(server->lane_requests(), 1);
  ASSERT_TRUE(by_zmq->add("heartbeat/trainer/1", 1).ok());
  by_lane.reset();
  // The lane's close reaches the store's thread at once; a request on another lane after it is
  // served after it.
  auto later = connect_beats(server->port(), "trainer/2", kLaneHost, nullptr);
  ASSERT_TRUE(later);
  ASSERT_TRUE(later->add("heartbeat/trainer/2", 1).ok());
  std::this_thread::sleep_for(200ms);
  auto w = watcher->watch({}, "heartbeat/", std::chrono::hours(1));
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_TRUE(w->stale.empty()) << w->stale[0].key;
  by_zmq.reset();
  const std::vector<Store::Stale> stale = closed_counters(*watcher);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].key, "heartbeat/trainer/1");
  EXPECT_TRUE(stale[0].closed);
}

// A store's lanes take only holders of the run secret: a hello made with another secret's keys,
// or with none, is refused (counted with the store's refused connections) and opens no lane. A
// client on another host opens none.
TEST(Store, AStoreLaneRefusesAHelloWithoutTheRunSecret) {
  const auto mine = auth_of("the-run-secret-0123456789abcdef");
  auto server = start_lane_server(mine);
  ASSERT_TRUE(server);
  const std::string at = server->lane_address();
  const std::int64_t before = server->refused();
  for (const std::shared_ptr<const ControlAuth>& wrong :
       {auth_of("another-secret-0123456789abcdef"), std::shared_ptr<const ControlAuth>()}) {
    auto lane = store_lanes::Client::open(at, kLaneHost, "engine/1", wrong.get(), 2s);
    ASSERT_FALSE(lane.ok());
    EXPECT_NE(lane.status().message().find("refused the hello"), std::string::npos)
        << lane.status().to_string();
  }
  for (int i = 0; i < 100 && server->refused() < before + 2; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(server->refused(), before + 2);
  auto far = store_lanes::Client::open(at, "another-host", "engine/1", mine.get(), 2s);
  ASSERT_TRUE(far.ok()) << far.status().to_string();
  EXPECT_EQ(*far, nullptr);
  auto good = store_lanes::Client::open(at, kLaneHost, "engine/1", mine.get(), 2s);
  ASSERT_TRUE(good.ok() && *good) << good.status().to_string();
  auto a =
      (*good)->exchange(store_wire::Op::kAdd, {"heartbeat/engine/1", store_wire::encode_i64(1)},
                        Clock::now() + 5s, [] { return false; });
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->code, store_wire::Reply::kOk);
  EXPECT_EQ(a->payload, store_wire::encode_i64(1));
  EXPECT_EQ(server->lane_requests(), 1);
  EXPECT_EQ(server->refused(), before + 2);
}

// What a store's lane carries: heartbeats and liveness reads, answered under the answers' seal.
// Any other request is answered with an error and the lane stays; a frame that fails its tag, or
// is not a request, closes the lane (counted with the refused connections), and with it the
// heartbeat it counted reads as an exit.
TEST(Store, AStoreLaneAnswersOnlyBeatsAndClosesOnAForgedFrame) {
  const auto mine = auth_of("the-run-secret-0123456789abcdef");
  auto server = start_lane_server(mine);
  ASSERT_TRUE(server);
  auto watcher = connect_store("127.0.0.1", server->port(), 5s, mine);
  ASSERT_TRUE(watcher.ok()) << watcher.status().to_string();
  auto lane =
      store_lanes::Client::open(server->lane_address(), kLaneHost, "engine/1", mine.get(), 2s);
  ASSERT_TRUE(lane.ok() && *lane) << lane.status().to_string();
  const auto exchange = [&](store_wire::Op op, const std::vector<std::string>& args) {
    return (*lane)->exchange(op, args, Clock::now() + 5s, [] { return false; });
  };
  auto set = exchange(store_wire::Op::kSet, {"auth/key/engine/1", "forged"});
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  EXPECT_EQ(set->code, store_wire::Reply::kError);
  EXPECT_NE(set->payload.find("does not travel on a same-host lane"), std::string::npos)
      << set->payload;
  auto key = (*watcher)->try_get("auth/key/engine/1");
  ASSERT_TRUE(key.ok());
  EXPECT_FALSE(key->has_value());
  auto beat = exchange(store_wire::Op::kAdd, {"heartbeat/engine/1", store_wire::encode_i64(1)});
  ASSERT_TRUE(beat.ok() && beat->code == store_wire::Reply::kOk) << beat.status().to_string();
  EXPECT_EQ(server->lane_requests(), 2);

  // A second lane of the same member, whose frames are written without its seal.
  unsigned char sk[32];
  ASSERT_TRUE(lane::z85_key(mine->member_secret(), sk));
  const auto at = lane::parse_address(server->lane_address(), kLaneHost);
  ASSERT_TRUE(at.has_value());
  auto raw = lane::connect(*at, "engine/2", "store", sk, 2s);
  ASSERT_TRUE(raw.ok()) << raw.status().to_string();
  ASSERT_TRUE((*watcher)->set("heartbeat/engine/2", "0").ok());
  lane::FrameSeal wrong(sk);  // not the lane's key
  const std::int64_t refused = server->refused();
  std::string request(1, static_cast<char>(store_wire::Op::kAdd));
  for (const std::string& arg : {std::string("heartbeat/engine/2"), store_wire::encode_i64(1)}) {
    for (int i = 0; i < 4; ++i) request.push_back(static_cast<char>(arg.size() >> (8 * i)));
    request += arg;
  }
  ASSERT_TRUE(
      lane::write_frame(raw->fd.get(), wrong, store_lanes::kRequestFrame, 1, request, 1s).ok());
  for (int i = 0; i < 100 && server->refused() == refused; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(server->refused(), refused + 1);
  char b = 0;
  pollfd p{raw->fd.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  EXPECT_EQ(::recv(raw->fd.get(), &b, 1, 0), 0);  // closed, unanswered
  auto two = (*watcher)->try_get("heartbeat/engine/2");
  ASSERT_TRUE(two.ok() && two->has_value());
  EXPECT_EQ(**two, "0");  // the forged beat was not counted
  EXPECT_EQ(server->lane_requests(), 2);
  // The first lane is untouched; its close without "left" reads as its rank's exit.
  auto again = exchange(store_wire::Op::kAdd, {"heartbeat/engine/1", store_wire::encode_i64(1)});
  ASSERT_TRUE(again.ok() && again->code == store_wire::Reply::kOk) << again.status().to_string();
  lane->reset();
  const std::vector<Store::Stale> stale = closed_counters(**watcher);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0].key, "heartbeat/engine/1");
  EXPECT_TRUE(stale[0].closed);
  sodium_memzero(sk, sizeof sk);
}

}  // namespace
}  // namespace refit
