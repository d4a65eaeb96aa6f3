// The Gloo communicator: N ranks as threads over one in-process store server, and forked
// processes where one rank dies.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/gloo/gloo_store.h"
#include "control/store.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::seconds_since;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Deterministic bytes that differ per source and position.
std::vector<char> pattern(std::size_t n, int source) {
  std::vector<char> v(n);
  std::uint32_t x = 0x9e3779b9u * static_cast<std::uint32_t>(source + 1);
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<char>(x >> 24);
  }
  return v;
}

// Runs body(rank, communicator) on `n` threads; each thread has its own store client and
// communicator. Every rank ends with a barrier so no rank tears down while others still send.
void run_ranks(int n, GlooOptions base, const std::function<void(int, Communicator&)>& body) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  const int port = (*server)->port();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto store = connect_store("127.0.0.1", port, 5s, nullptr);
      ASSERT_TRUE(store.ok()) << store.status().to_string();
      GlooOptions o = base;
      o.rank = r;
      o.size = n;
      auto comm = make_gloo_communicator(**store, o);
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      EXPECT_EQ((*comm)->rank(), r);
      EXPECT_EQ((*comm)->size(), n);
      EXPECT_EQ((*comm)->backend(), "gloo");
      body(r, **comm);
      Status s = (*comm)->barrier();
      EXPECT_TRUE(s.ok()) << s.to_string();
    });
  }
  for (auto& t : threads) t.join();
}

GlooOptions options(const std::string& name) {
  GlooOptions o;
  o.name = name;
  o.timeout = 8s;
  return o;
}

// Rank `rank` of `size`, its own store connection to `port` (a forked rank's).
struct ForkedRank {
  Result<std::unique_ptr<Store>> store;
  GlooOptions options;
};
ForkedRank forked_rank(const std::string& name, int rank, int size, int port,
                       std::chrono::milliseconds timeout) {
  ForkedRank f{connect_store("127.0.0.1", port, 5s, nullptr), options(name)};
  f.options.rank = rank;
  f.options.size = size;
  f.options.timeout = timeout;
  return f;
}

// Sockets this process holds now.
int open_sockets() {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code ec2;
    const auto target = std::filesystem::read_symlink(e.path(), ec2);
    if (!ec2 && target.string().rfind("socket:", 0) == 0) ++n;
  }
  return n;
}

// A group used only point to point connects the pairs that exchange bytes, nothing else: here 3
// "trainer" ranks (0-2) each feed two of 3 "engine" ranks (3-5). Every pair's bytes arrive; an
// exchange with a rank that is not a peer, and any collective, are refused naming the peers; the
// process holds 2 sockets per connected pair, 18 fewer than the full mesh of the same 6 ranks.
TEST(GlooPeers, OnlyThePairsThatExchangeBytesAreConnected) {
  constexpr int n = 6;
  const auto peers_of = [](int r) {
    std::vector<int> p = r < 3 ? std::vector<int>{3 + r, 3 + (r + 1) % 3}
                               : std::vector<int>{r - 3, (r - 3 + 2) % 3};
    std::sort(p.begin(), p.end());
    return p;
  };
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  const int port = (*server)->port();
  std::vector<std::unique_ptr<Store>> stores;
  for (int r = 0; r < n; ++r) {
    auto store = connect_store("127.0.0.1", port, 5s, nullptr);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    stores.push_back(std::move(*store));
  }
  // Forms the group on every rank at once (peers or the full mesh), counts the sockets while
  // every rank holds its communicator, runs `body` on each, and returns the socket count.
  auto form = [&](const std::string& name, bool only_peers,
                  const std::function<void(int, Communicator&)>& body) {
    std::vector<std::unique_ptr<Communicator>> comms(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        GlooOptions o = options(name);
        o.rank = r;
        o.size = n;
        if (only_peers) o.peers = peers_of(r);
        auto comm = make_gloo_communicator(*stores[r], o);
        ASSERT_TRUE(comm.ok()) << comm.status().to_string();
        comms[r] = std::move(*comm);
      });
    for (auto& t : threads) t.join();
    const int sockets = open_sockets();
    threads.clear();
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        if (comms[r]) body(r, *comms[r]);
      });
    for (auto& t : threads) t.join();
    return sockets;
  };
  const int base = open_sockets();
  const int with_peers = form("peers", true, [&](int r, Communicator& c) {
    const std::vector<int> peers = peers_of(r);
    std::vector<std::vector<char>> got(peers.size(), std::vector<char>(4096));
    std::vector<std::vector<char>> mine;
    std::vector<P2POp> ops;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      mine.push_back(pattern(4096, r * 10 + peers[i]));
      ops.push_back({.kind = P2POp::Kind::kSend, .peer = peers[i], .buf = mine.back().data(),
                     .bytes = 4096});
    }
    for (std::size_t i = 0; i < peers.size(); ++i)
      ops.push_back({.kind = P2POp::Kind::kRecv, .peer = peers[i], .buf = got[i].data(),
                     .bytes = 4096});
    const Status s = c.exchange(ops);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (std::size_t i = 0; i < peers.size(); ++i)
      EXPECT_EQ(got[i], pattern(4096, peers[i] * 10 + r)) << "rank " << r << " from " << peers[i];
    // Rank 0's non-peer: 1, another trainer rank; rank 3's: 4.
    if (r == 0 || r == 3) {
      std::vector<char> buf(8);
      const int stranger = r + 1;
      const Status refused = c.exchange(
          {{.kind = P2POp::Kind::kSend, .peer = stranger, .buf = buf.data(), .bytes = 8}});
      EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
      EXPECT_TRUE(contains(refused.message(),
                           fmt::format("rank {} is not among this rank's peers", stranger)))
          << refused.to_string();
      const Status collective = c.barrier();
      EXPECT_EQ(collective.code(), StatusCode::kInvalidArgument) << collective.to_string();
      EXPECT_TRUE(contains(collective.message(), "a collective needs every member connected"))
          << collective.to_string();
    }
  });
  const int full_mesh = form("mesh", false, [](int, Communicator& c) {
    const Status s = c.barrier();
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
  EXPECT_GT(with_peers, base);
  EXPECT_EQ(full_mesh - with_peers, 2 * (n * (n - 1) / 2 - 6))
      << "sockets: " << base << " before, " << with_peers << " with peers, " << full_mesh
      << " with the full mesh";
}

// Peer lists are checked before anything connects.
TEST(GlooPeers, BadPeerListsAreRefused) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok());
  auto store = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(store.ok());
  for (const std::vector<int>& bad : {std::vector<int>{0}, std::vector<int>{4}, std::vector<int>{1, 1}}) {
    GlooOptions o = options("bad");
    o.rank = 0;
    o.size = 3;
    o.peers = bad;
    auto comm = make_gloo_communicator(**store, o);
    ASSERT_FALSE(comm.ok());
    EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(comm.status().message(), "is not another member of the group"))
        << comm.status().to_string();
  }
}

// No uninitialised bytes leave a process: Gloo's rendezvous values (its TCP addresses, a
// sockaddr_storage that getsockname fills only partly) reach the store with everything past the
// address zeroed.
TEST(Gloo, RendezvousValuesCarryNoUninitialisedBytes) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  const int port = (*server)->port();
  constexpr int kRanks = 3;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      auto store = connect_store("127.0.0.1", port, 5s, nullptr);
      ASSERT_TRUE(store.ok());
      GlooOptions o = options("scrub");
      o.rank = r;
      o.size = kRanks;
      auto comm = make_gloo_communicator(**store, o);
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      EXPECT_TRUE((*comm)->barrier().ok());
    });
  for (auto& t : threads) t.join();
  auto store = connect_store("127.0.0.1", port, 5s, nullptr);
  ASSERT_TRUE(store.ok());
  constexpr std::size_t kAddress = sizeof(sockaddr_storage) + sizeof(std::int64_t);
  for (int r = 0; r < kRanks; ++r) {
    auto value = (*store)->try_get(fmt::format("gloo/scrub/peers/{}", r));
    ASSERT_TRUE(value.ok() && value->has_value()) << "rank " << r << "'s rendezvous key";
    // One entry per peer: its rank, the address's length, the address.
    const std::string& v = **value;
    constexpr std::size_t kEntry = 8 + kAddress;
    ASSERT_EQ(v.size(), (kRanks - 1) * kEntry) << "rank " << r;
    for (std::size_t entry = 0; entry < v.size(); entry += kEntry) {
      std::int32_t length = 0;
      std::memcpy(&length, v.data() + entry + 4, sizeof(length));
      ASSERT_EQ(length, static_cast<std::int32_t>(kAddress));
      const std::size_t at = entry + 8;
      sa_family_t family;
      std::memcpy(&family, v.data() + at, sizeof(family));
      ASSERT_EQ(family, AF_INET);
      for (std::size_t b = sizeof(sockaddr_in); b < sizeof(sockaddr_storage); ++b)
        ASSERT_EQ(v[at + b], 0) << "rank " << r << " address at " << at << " byte " << b;
      for (std::size_t b = offsetof(sockaddr_in, sin_zero); b < sizeof(sockaddr_in); ++b)
        ASSERT_EQ(v[at + b], 0) << "sin_zero byte " << b;
    }
  }
}

TEST(Gloo, ScrubLeavesOtherValuesAlone) {
  std::string text = "not an address list";
  gloo_backend::scrub_tcp_addresses(text);
  EXPECT_EQ(text, "not an address list");
  // One IPv4 address with stack garbage past it.
  std::string addr(sizeof(sockaddr_storage) + sizeof(std::int64_t), '\xAA');
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(1234);
  std::memcpy(addr.data(), &in, offsetof(sockaddr_in, sin_zero));
  gloo_backend::scrub_tcp_addresses(addr);
  EXPECT_EQ(addr[sizeof(sockaddr_in)], 0);
  EXPECT_EQ(addr[sizeof(sockaddr_storage) - 1], 0);
  EXPECT_EQ(addr[offsetof(sockaddr_in, sin_zero)], 0);
  EXPECT_EQ(addr[sizeof(sockaddr_storage)], '\xAA') << "the sequence number is Gloo's";
}

class GlooRanks : public ::testing::TestWithParam<int> {};

TEST_P(GlooRanks, BroadcastFromEveryRoot) {
  const int n = GetParam();
  const std::vector<std::size_t> sizes{1, 1000003, std::size_t{64} << 20};
  std::vector<std::vector<std::vector<char>>> expected(sizes.size());  // [size][root]
  for (std::size_t s = 0; s < sizes.size(); ++s)
    for (int root = 0; root < n; ++root)
      expected[s].push_back(pattern(sizes[s], root * 10 + static_cast<int>(s)));

  run_ranks(n, options("bcast" + std::to_string(n)), [&](int rank, Communicator& comm) {
    for (std::size_t s = 0; s < sizes.size(); ++s) {
      for (int root = 0; root < n; ++root) {
        std::vector<char> buf =
            rank == root ? expected[s][root] : std::vector<char>(sizes[s], '\0');
        Status st = comm.broadcast(buf.data(), buf.size(), root);
        ASSERT_TRUE(st.ok()) << st.to_string();
        EXPECT_TRUE(buf == expected[s][root])
            << "rank " << rank << " root " << root << " bytes " << sizes[s];
      }
    }
    // Zero bytes is a no-op; a bad root is rejected before any traffic.
    EXPECT_TRUE(comm.broadcast(nullptr, 0, 0).ok());
    Status bad = comm.broadcast(nullptr, 0, n);
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(bad.message(), "gloo[bcast" + std::to_string(n) + "] broadcast"))
        << bad.message();
  });
}

TEST_P(GlooRanks, AllGatherVWithUnevenAndZeroCounts) {
  const int n = GetParam();
  const std::vector<std::vector<std::size_t>> cases = {
      [&] {  // uneven, rank 1 (if any) contributes nothing
        std::vector<std::size_t> c(n);
        for (int r = 0; r < n; ++r) c[r] = r == 1 ? 0 : 1000 * r + 17;
        return c;
      }(),
      std::vector<std::size_t>(n, 0),  // nothing at all
      [&] {                            // only the last rank contributes
        std::vector<std::size_t> c(n, 0);
        c[n - 1] = 333333;
        return c;
      }(),
  };
  run_ranks(n, options("gather" + std::to_string(n)), [&](int rank, Communicator& comm) {
    for (const auto& counts : cases) {
      const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
      std::vector<char> expected;
      for (int r = 0; r < n; ++r) {
        auto part = pattern(counts[r], r);
        expected.insert(expected.end(), part.begin(), part.end());
      }
      const auto mine = pattern(counts[rank], rank);
      std::vector<char> out(total, '\0');
      Status st = comm.all_gather_v(counts[rank] ? mine.data() : nullptr, out.data(), counts);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(out == expected) << "rank " << rank << " total " << total;
    }
    // In place: the send buffer is this rank's slot of the output.
    std::vector<std::size_t> counts(n, 5);
    std::vector<char> out(5 * n, '\0');
    for (int i = 0; i < 5; ++i) out[5 * rank + i] = static_cast<char>(rank + i);
    ASSERT_TRUE(comm.all_gather_v(out.data() + 5 * rank, out.data(), counts).ok());
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < 5; ++i) EXPECT_EQ(out[5 * r + i], static_cast<char>(r + i));

    Status bad = comm.all_gather_v(nullptr, nullptr, std::vector<std::size_t>(n + 1, 0));
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(bad.message(), "all_gather_v")) << bad.message();
  });
}

TEST_P(GlooRanks, BarrierWaitsForEveryRank) {
  const int n = GetParam();
  std::atomic<int> arrived{0};
  run_ranks(n, options("barrier" + std::to_string(n)), [&](int rank, Communicator& comm) {
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * rank));
    arrived.fetch_add(1);
    ASSERT_TRUE(comm.barrier().ok());
    EXPECT_EQ(arrived.load(), n) << "rank " << rank << " left the barrier early";
  });
}

TEST_P(GlooRanks, ChunkedTransfers) {
  const int n = GetParam();
  GlooOptions o = options("chunks" + std::to_string(n));
  o.max_chunk_bytes = 65536;
  const auto data = pattern(1000003, 7);
  run_ranks(n, o, [&](int rank, Communicator& comm) {
    const int root = n - 1;
    std::vector<char> buf = rank == root ? data : std::vector<char>(data.size(), '\0');
    ASSERT_TRUE(comm.broadcast(buf.data(), buf.size(), root).ok());
    EXPECT_TRUE(buf == data);

    // Above the chunk size, all_gather_v goes rank by rank.
    std::vector<std::size_t> counts(n);
    for (int r = 0; r < n; ++r) counts[r] = r == 0 ? 0 : 70001 * r;
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    std::vector<char> expected;
    for (int r = 0; r < n; ++r) {
      auto part = pattern(counts[r], 100 + r);
      expected.insert(expected.end(), part.begin(), part.end());
    }
    const auto mine = pattern(counts[rank], 100 + rank);
    std::vector<char> out(total, '\0');
    ASSERT_TRUE(comm.all_gather_v(mine.data(), out.data(), counts).ok());
    EXPECT_TRUE(out == expected);
  });
}

INSTANTIATE_TEST_SUITE_P(Gloo, GlooRanks, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

TEST(Gloo, Broadcast256MiB) {
  const std::size_t bytes = std::size_t{256} << 20;
  const auto data = pattern(bytes, 3);
  run_ranks(3, options("big"), [&](int rank, Communicator& comm) {
    std::vector<char> buf = rank == 0 ? data : std::vector<char>(bytes, '\0');
    Status st = comm.broadcast(buf.data(), bytes, 0);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(buf == data) << "rank " << rank;
  });
}

// Two ranks over one store; the body of each runs on its own thread.
struct Pair2 {
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> stores[2];
  std::unique_ptr<Communicator> comms[2];
};

void connect_pair(Pair2& p, const GlooOptions& base) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok());
  p.server = std::move(server).value();
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      auto store = connect_store("127.0.0.1", p.server->port(), 5s, nullptr);
      ASSERT_TRUE(store.ok());
      p.stores[r] = std::move(store).value();
      GlooOptions o = base;
      o.rank = r;
      o.size = 2;
      auto comm = make_gloo_communicator(*p.stores[r], o);
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      p.comms[r] = std::move(comm).value();
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(p.comms[0] && p.comms[1]);
}

TEST(Gloo, CollectiveTimesOutNamingGroupOpAndRank) {
  GlooOptions o = options("slow");
  o.timeout = 500ms;
  Pair2 p;
  ASSERT_NO_FATAL_FAILURE(connect_pair(p, o));
  const auto t0 = Clock::now();
  Status s = p.comms[0]->barrier();  // rank 1 never joins
  ASSERT_FALSE(s.ok());
  EXPECT_LT(seconds_since(t0), 3.0);
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "gloo[slow] barrier (rank 0 of 2)")) << s.message();
  // The group is unusable now; later calls fail at once with the first cause.
  std::vector<char> buf(10);
  Status later = p.comms[0]->broadcast(buf.data(), buf.size(), 0);
  EXPECT_FALSE(later.ok());
  EXPECT_TRUE(contains(later.message(), "failed earlier")) << later.message();
}

TEST(Gloo, ConnectTimesOutWhenAPeerNeverJoins) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok());
  auto store = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(store.ok());
  GlooOptions o = options("lonely");
  o.size = 2;
  o.timeout = 300ms;
  const auto t0 = Clock::now();
  auto comm = make_gloo_communicator(**store, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_LT(seconds_since(t0), 3.0);
  EXPECT_EQ(comm.status().code(), StatusCode::kTimeout) << comm.status().to_string();
  EXPECT_TRUE(contains(comm.status().message(), "gloo[lonely] connect (rank 0 of 2)"))
      << comm.status().message();
  EXPECT_TRUE(contains(comm.status().message(), "gloo/lonely/peers/1"))
      << comm.status().message();

  o.rank = 2;
  EXPECT_EQ(make_gloo_communicator(**store, o).status().code(), StatusCode::kInvalidArgument);
}

// A peer that published its addresses and died before it took its pair's connection: Gloo would
// wait 5 x the group's timeout for it. The liveness check's failure ends the connect instead,
// with its cause. The dead peer's key is written here by hand, with an address above this rank's
// own, so that this rank is the pair's listening side and only the peer could complete the pair.
TEST(Gloo, ConnectEndsWhenTheLivenessCheckFailsWhileAPairWaitsForItsPeer) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok());
  auto store = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(store.ok());
  sockaddr_storage peer{};
  auto* in = reinterpret_cast<sockaddr_in*>(&peer);
  in->sin_family = AF_INET;
  in->sin_port = htons(65000);
  in->sin_addr.s_addr = htonl(0x7ffffffe);  // 127.255.255.254, above 127.0.0.1
  std::string entry(8 + sizeof(sockaddr_storage) + sizeof(std::int64_t), '\0');
  const std::int32_t to_rank = 0, length = sizeof(sockaddr_storage) + sizeof(std::int64_t);
  std::memcpy(entry.data(), &to_rank, 4);
  std::memcpy(entry.data() + 4, &length, 4);
  std::memcpy(entry.data() + 8, &peer, sizeof(peer));
  ASSERT_TRUE((*store)->set("gloo/orphan/peers/1", entry).ok());

  // The peer "dies" once this rank has published its own addresses (its pair then listens).
  std::atomic<int> checks{0};
  auto probe = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(probe.ok());
  GlooOptions o = options("orphan");
  o.size = 2;
  o.timeout = 4s;  // Gloo's own connect wait: 20 s, then "Connect timeout"
  o.liveness = [&]() -> Status {
    ++checks;
    auto mine = (*probe)->try_get("gloo/orphan/peers/0");
    if (mine.ok() && mine->has_value()) return Status::Aborted("rank 1 died");
    return Status::Ok();
  };
  auto comm = make_gloo_communicator(**store, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kAborted) << comm.status().to_string();
  EXPECT_TRUE(contains(comm.status().message(), "gloo[orphan] connect (rank 0 of 2) to its peers"))
      << comm.status().message();
  EXPECT_TRUE(contains(comm.status().message(), "rank 1 died")) << comm.status().message();
  EXPECT_GT(checks.load(), 0);
}

TEST(Gloo, AbortWakesAPendingCallAndFailsLaterOnes) {
  GlooOptions o = options("abort");
  o.timeout = 20s;
  Pair2 p;
  ASSERT_NO_FATAL_FAILURE(connect_pair(p, o));
  std::vector<char> buf(1 << 20);
  Status pending;
  const auto t0 = Clock::now();
  std::thread rank0([&] { pending = p.comms[0]->broadcast(buf.data(), buf.size(), 1); });
  std::this_thread::sleep_for(200ms);
  p.comms[0]->abort();
  rank0.join();
  EXPECT_LT(seconds_since(t0), 3.0) << "abort() did not wake the pending broadcast";
  ASSERT_FALSE(pending.ok());
  EXPECT_EQ(pending.code(), StatusCode::kAborted) << pending.to_string();
  EXPECT_TRUE(contains(pending.message(), "gloo[abort] broadcast (rank 0 of 2, root 1"))
      << pending.message();

  const auto t1 = Clock::now();
  Status later = p.comms[0]->barrier();
  EXPECT_EQ(later.code(), StatusCode::kAborted);
  EXPECT_LT(seconds_since(t1), 0.5);

  // The peer sees its connection drop instead of waiting out its 20 s timeout.
  const auto t2 = Clock::now();
  Status peer = p.comms[1]->barrier();
  EXPECT_FALSE(peer.ok());
  EXPECT_LT(seconds_since(t2), 3.0);
  EXPECT_TRUE(contains(peer.message(), "gloo[abort] barrier (rank 1 of 2)")) << peer.message();
}

TEST(Gloo, AbortWakesAPendingBarrier) {
  GlooOptions o = options("abort-barrier");
  o.timeout = 20s;
  Pair2 p;
  ASSERT_NO_FATAL_FAILURE(connect_pair(p, o));
  Status pending;
  const auto t0 = Clock::now();
  std::thread rank1([&] { pending = p.comms[1]->barrier(); });  // rank 0 never joins
  std::this_thread::sleep_for(200ms);
  p.comms[1]->abort();
  p.comms[1]->abort();  // idempotent
  rank1.join();
  EXPECT_LT(seconds_since(t0), 3.0) << "abort() did not wake the pending barrier";
  EXPECT_EQ(pending.code(), StatusCode::kAborted) << pending.to_string();
  EXPECT_TRUE(contains(pending.message(), "gloo[abort-barrier] barrier (rank 1 of 2)"))
      << pending.message();
}

// Runs `body(rank, store port)` in `ranks` forked processes beside a store server in a forked
// process of its own, and returns what each body returned: empty for a rank that exited without
// returning, or that had not finished within `limit` (every process is killed then, so that a hang
// fails the test, not the suite). The ranks are forked (no exec) from a process with no thread of
// its own: a fork while another thread holds an allocator lock (the server's and ZeroMQ's threads,
// under ASan's allocator) could leave a child deadlocked in malloc.
std::vector<std::string> run_forked_ranks(int ranks, std::chrono::seconds limit,
                                          const std::function<std::string(int, int)>& body) {
  testing::ForkedStoreServer server;
  if (!server.ok()) {
    ADD_FAILURE() << "the store server process did not start";
    return {};
  }
  const int port = server.port();

  std::vector<pid_t> pids;
  std::vector<int> pipes;  // read ends, one per rank
  for (int r = 0; r < ranks; ++r) {
    int fds[2];
    if (pipe(fds) != 0) break;
    const pid_t pid = fork();
    if (pid < 0) break;
    if (pid == 0) {
      close(fds[0]);
      const std::string report = body(r, port);
      (void)!write(fds[1], report.data(), report.size());
      _exit(0);
    }
    close(fds[1]);
    pids.push_back(pid);
    pipes.push_back(fds[0]);
  }

  std::vector<std::string> reports(static_cast<std::size_t>(ranks));
  const auto deadline = Clock::now() + limit;
  for (std::size_t r = 0; r < pipes.size(); ++r) {
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pollfd pfd{pipes[r], POLLIN, 0};
      if (left.count() <= 0 || poll(&pfd, 1, static_cast<int>(left.count())) <= 0) break;
      char chunk[4096];
      const ssize_t n = read(pipes[r], chunk, sizeof chunk);
      if (n <= 0) break;
      reports[r].append(chunk, static_cast<std::size_t>(n));
    }
    close(pipes[r]);
  }
  for (pid_t pid : pids) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  return reports;
}

// Forked ranks: rank `kDying` exits abruptly after the first barrier; the others' next collective
// must fail within the timeout with a message naming the group, the operation and the rank.
TEST(GlooProcesses, DeadRankMakesOthersFailWithinTheTimeout) {
  constexpr int kRanks = 3, kDying = 2;
  const std::vector<std::string> reports = run_forked_ranks(kRanks, 12s, [](int r, int port) {
    auto [store, o] = forked_rank("update", r, kRanks, port, 5s);
    if (!store.ok()) return "setup: " + store.status().to_string();
    auto comm = make_gloo_communicator(**store, o);
    if (!comm.ok()) return "setup: " + comm.status().to_string();
    if (Status s = (*comm)->barrier(); !s.ok()) return "setup: " + s.to_string();
    if (r == kDying) _exit(3);  // no destructors, no goodbye
    std::vector<char> buf(1 << 20);
    const auto t0 = Clock::now();
    Status s = (*comm)->broadcast(buf.data(), buf.size(), kDying);
    return fmt::format("{:.3f}|{}", seconds_since(t0), s.to_string());
  });
  ASSERT_EQ(reports.size(), static_cast<std::size_t>(kRanks));
  EXPECT_TRUE(reports[kDying].empty()) << reports[kDying];
  for (int r = 0; r < kRanks; ++r) {
    if (r == kDying) continue;
    const std::string& rep = reports[r];
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + rep);
    ASSERT_FALSE(rep.empty()) << "no report: the rank hung";
    ASSERT_FALSE(contains(rep, "setup:"));
    const auto bar = rep.find('|');
    ASSERT_NE(bar, std::string::npos);
    EXPECT_LT(std::stod(rep.substr(0, bar)), 10.0);
    const std::string status = rep.substr(bar + 1);
    EXPECT_NE(status, "ok") << "a collective with a dead root succeeded";
    EXPECT_TRUE(contains(
        status, fmt::format("gloo[update] broadcast (rank {} of {}, root {}", r, kRanks, kDying)));
  }
}

// A group that connects on first use, in separate processes (each its own Gloo device and
// addresses, as between hosts): forming it opens no socket; 8 ranks, every pair among them,
// connect a third of their pairs with one connect() each (the peers listed in an order of the
// rank's own) and exchange over them, then the rest inside an exchange alone; both sides of a pair
// put it in the same batch. Every byte of every pair arrives, so no rank waited on another in a
// cycle, and a third connect() of pairs already connected does nothing.
TEST(GlooProcesses, PairsConnectOnFirstUseInBatchesBothSidesAgreeOn) {
  constexpr int kRanks = 8;
  const auto first = [](int a, int b) { return (a + b) % 3 == 0; };
  const std::vector<std::string> reports = run_forked_ranks(kRanks, 60s, [&](int r, int port) {
    auto [store, o] = forked_rank("lazy", r, kRanks, port, 20s);
    if (!store.ok()) return "setup: " + store.status().to_string();
    o.peers.emplace();
    for (int p = 0; p < kRanks; ++p)
      if (p != r) o.peers->push_back(p);
    o.connect_on_first_use = true;
    const int before = open_sockets();
    auto comm = make_gloo_communicator(**store, o);
    if (!comm.ok()) return "setup: " + comm.status().to_string();
    if (open_sockets() != before)
      return fmt::format("forming opened {} socket(s)", open_sockets() - before);
    // Sends each peer of `batch` 64 KiB and checks what it sent back.
    const auto swap = [&](const std::vector<int>& batch) -> std::string {
      std::vector<std::vector<char>> mine, got;
      std::vector<P2POp> ops;
      for (int p : batch) {
        mine.push_back(pattern(1 << 16, r * 16 + p));
        got.emplace_back(1 << 16);
      }
      for (std::size_t i = 0; i < batch.size(); ++i) {
        ops.push_back({.kind = P2POp::Kind::kSend, .peer = batch[i], .buf = mine[i].data(),
                       .bytes = mine[i].size()});
        ops.push_back({.kind = P2POp::Kind::kRecv, .peer = batch[i], .buf = got[i].data(),
                       .bytes = got[i].size()});
      }
      if (Status s = (*comm)->exchange(ops); !s.ok()) return s.to_string();
      for (std::size_t i = 0; i < batch.size(); ++i)
        if (got[i] != pattern(1 << 16, batch[i] * 16 + r))
          return fmt::format("wrong bytes from rank {}", batch[i]);
      return "";
    };
    std::vector<int> one, two;
    for (int k = 1; k < kRanks; ++k) {  // a rotation of the peers, different for every rank
      const int p = (r + k * (r % 2 == 0 ? 1 : kRanks - 1) + kRanks) % kRanks;
      (first(r, p) ? one : two).push_back(p);
    }
    if (Status s = (*comm)->connect(one); !s.ok()) return "connect: " + s.to_string();
    if (std::string e = swap(one); !e.empty()) return "first batch: " + e;
    if (std::string e = swap(two); !e.empty()) return "second batch: " + e;
    const int held = open_sockets();
    if (Status s = (*comm)->connect(o.peers.value()); !s.ok()) return "again: " + s.to_string();
    // Opened: a socket that closes meanwhile (a pair's listener, which Gloo's loop thread closes
    // once its peer connected, in its own time) is not what this counts.
    if (const int now = open_sockets(); now > held)
      return fmt::format("connecting again opened {} socket(s)", now - held);
    return fmt::format("ok {} {}", one.size(), two.size());
  });
  ASSERT_EQ(reports.size(), static_cast<std::size_t>(kRanks));
  for (int r = 0; r < kRanks; ++r) {
    int one = 0;
    for (int p = 0; p < kRanks; ++p) one += p != r && first(r, p) ? 1 : 0;
    EXPECT_EQ(reports[r], fmt::format("ok {} {}", one, kRanks - 1 - one))
        << "rank " << r << (reports[r].empty() ? ": hung" : "");
  }
}

// A pair whose peer never comes: the connect ends at abort() (within the 500 ms slices of its wait
// for the peer's address), not at the group's timeout, and the group then fails every call at
// once with that cause.
TEST(GlooPeers, AConnectOnFirstUseEndsAtAbort) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto store = connect_store("127.0.0.1", (*server)->port(), 5s, nullptr);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  GlooOptions o = options("forsaken");
  o.rank = 0;
  o.size = 2;
  o.timeout = 60s;
  o.peers = std::vector<int>{1};
  o.connect_on_first_use = true;
  auto comm = make_gloo_communicator(**store, o);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  std::thread aborter([&] {
    std::this_thread::sleep_for(300ms);
    (*comm)->abort();
  });
  const auto t0 = Clock::now();
  const Status s = (*comm)->connect({1});
  const double took = seconds_since(t0);
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
  EXPECT_TRUE(
      contains(s.message(), "gloo[forsaken] connect (rank 0 of 2, 1 more pair(s): with rank(s) 1)"))
      << s.to_string();
  EXPECT_LT(took, 5.0) << "the connect waited for its timeout, not for abort()";
  std::vector<char> buf(8);
  const Status later =
      (*comm)->exchange({{.kind = P2POp::Kind::kSend, .peer = 1, .buf = buf.data(), .bytes = 8}});
  EXPECT_EQ(later.code(), StatusCode::kAborted) << later.to_string();
  const Status stranger = (*comm)->connect({0});
  EXPECT_EQ(stranger.code(), StatusCode::kInvalidArgument) << stranger.to_string();

  // Aborted before anything connected: a connect fails at once.
  o.name = "forsaken-early";
  auto early = make_gloo_communicator(**store, o);
  ASSERT_TRUE(early.ok()) << early.status().to_string();
  (*early)->abort();
  const auto t1 = Clock::now();
  const Status none = (*early)->connect({1});
  EXPECT_EQ(none.code(), StatusCode::kAborted) << none.to_string();
  EXPECT_LT(seconds_since(t1), 1.0);
}

}  // namespace
}  // namespace refit
