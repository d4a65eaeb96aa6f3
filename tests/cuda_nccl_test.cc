// The NCCL communicator (comm/nccl/nccl_communicator.h). One GPU allows one-rank groups (NCCL
// refuses two ranks on one device), which exercise rendezvous, every collective, abort and the
// bounded waits; a two-rank group whose peer never comes must time out, not hang.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "comm/nccl/nccl_communicator.h"
#include "control/store.h"
#include "device/device.h"
#include "test_util.h"

namespace refit {
namespace {

// An in-process store: enough for rendezvous between threads of one test.
class MemoryStore : public Store {
 public:
  Status set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> l(mu_);
    kv_[key] = value;
    cv_.notify_all();
    return Status::Ok();
  }
  Status erase(const std::string& key) override {
    std::lock_guard<std::mutex> l(mu_);
    kv_.erase(key);
    return Status::Ok();
  }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, timeout, [&] { return kv_.count(key) > 0; }))
      return Status::Timeout("store key " + key + " not set within " +
                             std::to_string(timeout.count()) + " ms");
    return kv_[key];
  }
  Result<std::optional<std::string>> try_get(const std::string& key) override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = kv_.find(key);
    if (it == kv_.end()) return std::optional<std::string>();
    return std::optional<std::string>(it->second);
  }
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    for (const auto& k : keys) REFIT_RETURN_IF_ERROR(get(k, timeout).status());
    return Status::Ok();
  }
  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    std::lock_guard<std::mutex> l(mu_);
    const std::int64_t v = (kv_.count(key) ? std::stoll(kv_[key]) : 0) + delta;
    kv_[key] = std::to_string(v);
    return v;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

TEST(CudaNccl, UnsupportedWithoutCuda) {
  if (cuda_built()) GTEST_SKIP() << "CUDA build";
  MemoryStore store;
  auto c = make_nccl_communicator(store, NcclOptions{"g", 0, 1, 0});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(c.status().message().find("nccl group 'g'"), std::string::npos);
}

TEST(CudaNccl, OneRankGroupRunsEveryCollective) {
  REFIT_REQUIRE_GPU();
  MemoryStore store;
  NcclOptions opt;
  opt.name = "solo";
  opt.timeout = std::chrono::seconds(60);
  auto comm = make_nccl_communicator(store, opt);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  EXPECT_EQ((*comm)->backend(), "nccl");
  EXPECT_EQ((*comm)->size(), 1);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  EXPECT_NE(std::getenv("NCCL_CUMEM_ENABLE"), nullptr);
  EXPECT_TRUE(store.try_get("nccl/solo/id")->has_value());

  const std::size_t n = (1 << 20) + 13;
  std::vector<std::uint8_t> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<std::uint8_t>(i * 31 + 1);
  auto send = DeviceBuffer::allocate(n, 0);
  auto recv = DeviceBuffer::allocate(n, 0);
  ASSERT_TRUE(send.ok() && recv.ok());
  ASSERT_TRUE(copy_to_device(send->data(), host.data(), n).ok());
  ASSERT_TRUE((*comm)->all_gather_v(send->data(), recv->data(), {n}).ok());
  std::vector<std::uint8_t> got(n);
  ASSERT_TRUE(copy_to_host(got.data(), recv->data(), n).ok());
  EXPECT_EQ(got, host);

  ASSERT_TRUE((*comm)->broadcast(send->data(), n, 0).ok());
  ASSERT_TRUE((*comm)->barrier().ok());
  ASSERT_TRUE((*comm)->enqueue_broadcast(recv->data(), n, 0).ok());
  ASSERT_TRUE((*comm)->synchronize().ok());
  ASSERT_TRUE((*comm)->all_gather_v(nullptr, recv->data(), {0}).ok());  // nothing to move

  const Status bad = (*comm)->all_gather_v(send->data(), recv->data(), {n, n});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("2 counts for 1 ranks"), std::string::npos) << bad.message();
  EXPECT_EQ((*comm)->broadcast(send->data(), n, 1).code(), StatusCode::kInvalidArgument);
  // Argument errors do not break the group.
  EXPECT_TRUE((*comm)->barrier().ok());

  (*comm)->abort();
  const Status after = (*comm)->barrier();
  EXPECT_EQ(after.code(), StatusCode::kAborted);
  EXPECT_NE(after.message().find("nccl group 'solo' rank 0/1"), std::string::npos)
      << after.message();
  EXPECT_EQ((*comm)->all_gather_v(send->data(), recv->data(), {n}).code(), StatusCode::kAborted);
}

TEST(CudaNccl, GroupWhosePeerNeverComesTimesOut) {
  REFIT_REQUIRE_GPU();
  MemoryStore store;
  NcclOptions opt;
  opt.name = "lonely";
  opt.size = 2;
  opt.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  auto comm = make_nccl_communicator(store, opt);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kTimeout) << comm.status().to_string();
  EXPECT_NE(comm.status().message().find("rank 0/2"), std::string::npos);
  EXPECT_LT(took, 30.0);
}

TEST(CudaNccl, RankWithoutRendezvousTimesOutNamingTheKey) {
  REFIT_REQUIRE_GPU();
  MemoryStore store;
  NcclOptions opt;
  opt.name = "late";
  opt.rank = 1;
  opt.size = 2;
  opt.timeout = std::chrono::milliseconds(300);
  auto comm = make_nccl_communicator(store, opt);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kTimeout);
  EXPECT_NE(comm.status().message().find("nccl/late/id"), std::string::npos)
      << comm.status().message();
}

}  // namespace
}  // namespace refit
