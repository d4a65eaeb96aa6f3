// The CUDA data plane's choice of who moves a copy list (REFIT_COPY_ENGINE, default auto): the
// copy engines beside the kernel when every destination is another GPU's memory, the kernel
// alone otherwise, for memory allocated on the other GPU and for memory another process exported
// there through CUDA IPC (the peer executor's case). Checked by the plane's per-path byte counters
// and bit for bit. Needs 2 GPUs; skips elsewhere.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/env.h"
#include "device/device.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr std::int64_t kRun = std::int64_t{2} << 20, kRuns = 8, kTail = 12345;
constexpr std::int64_t kElems = kRun * kRuns + kTail;
constexpr std::size_t kBytes = static_cast<std::size_t>(kElems) * 2;
constexpr std::int64_t kEngineBytes = kRuns / 2 * kRun * 2;  // whole runs up to half the bytes

// Eight contiguous runs of 4 MiB of bf16 and one odd-sized last run, from src to dst.
std::vector<CopyRun> runs_between(const std::byte* src, std::byte* dst) {
  std::vector<CopyRun> runs;
  for (std::int64_t i = 0; i <= kRuns; ++i) {
    const std::int64_t n = i < kRuns ? kRun : kTail;
    runs.push_back({.src = src, .dst = dst,
                    .block = {.src_offset = i * kRun, .src_stride = n, .dst_offset = i * kRun,
                              .dst_stride = n, .rows = 1, .cols = n}});
  }
  return runs;
}

std::vector<std::uint16_t> finite_bf16(std::size_t n) {
  std::vector<std::uint16_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::uint16_t>((i * 2654435761u >> 7) & 0xBFFF);  // finite
  return v;
}

Result<std::unique_ptr<DataPlane>> cuda_plane(int device) {
  Config cfg;
  cfg.device = Device::kCuda;
  return make_data_plane(cfg, device);
}

bool skip_unless_two_gpus_and_auto() {
  if (device_count() < 2) return true;
  const auto use = env::copy_engine();
  return !use.ok() || *use != env::CopyEngineUse::kAuto;
}

TEST(CudaPlane, CopyEnginesBesideTheKernelOnlyIntoAnotherGpu) {
  if (device_count() < 2)
    GTEST_SKIP() << (cuda_built() ? "needs 2 visible GPUs" : "built without CUDA");
  if (skip_unless_two_gpus_and_auto()) GTEST_SKIP() << "needs 2 GPUs and REFIT_COPY_ENGINE unset";
  auto p0 = cuda_plane(0);
  auto p1 = cuda_plane(1);
  ASSERT_TRUE(p0.ok() && p1.ok());
  DataPlane& plane = **p0;
  auto src = plane.allocate(kBytes);
  auto local = plane.allocate(kBytes);
  auto remote = (*p1)->allocate(kBytes);
  ASSERT_TRUE(src.ok() && local.ok() && remote.ok());
  const std::vector<std::uint16_t> want = finite_bf16(static_cast<std::size_t>(kElems));
  ASSERT_TRUE(plane.write((*src)->data(), want.data(), kBytes).ok());
  ASSERT_TRUE(set_device(0).ok());
  ASSERT_TRUE(enable_peer_access(1).ok());

  auto runs_to = [&](std::byte* dst) { return runs_between((*src)->data(), dst); };
  auto read_back = [&](DataPlane& p, PlaneBuffer& buf) {
    std::vector<std::uint16_t> got(want.size());
    EXPECT_TRUE(p.read(got.data(), buf.data(), kBytes).ok());
    return got;
  };

  // Into the other GPU: the first half of the bytes (whole runs) on the copy engines, the rest by
  // the kernel.
  const std::vector<CopyRun> to_remote = runs_to((*remote)->data());
  ASSERT_TRUE(plane.copy(to_remote, DType::kBFloat16, DType::kBFloat16).ok());
  EXPECT_EQ(read_back(**p1, **remote), want);
  DataPlane::CopyPathBytes b = plane.copy_path_bytes();
  EXPECT_EQ(b.copy_engines, kEngineBytes);
  EXPECT_EQ(b.kernel, static_cast<std::int64_t>(kBytes) - kEngineBytes);

  // Into this GPU's own memory: the kernel alone.
  const std::vector<CopyRun> to_local = runs_to((*local)->data());
  ASSERT_TRUE(plane.copy(to_local, DType::kBFloat16, DType::kBFloat16).ok());
  EXPECT_EQ(read_back(plane, **local), want);
  const DataPlane::CopyPathBytes c = plane.copy_path_bytes();
  EXPECT_EQ(c.copy_engines, b.copy_engines);
  EXPECT_EQ(c.kernel, b.kernel + static_cast<std::int64_t>(kBytes));

  // A cast (bf16 -> fp32 halves) into the other GPU: the copy engines cannot cast.
  auto wide = (*p1)->allocate(kBytes * 2);
  ASSERT_TRUE(wide.ok());
  const std::vector<CopyRun> cast = runs_to((*wide)->data());
  ASSERT_TRUE(plane.copy(cast, DType::kBFloat16, DType::kFloat32).ok());
  EXPECT_EQ(plane.copy_path_bytes().copy_engines, b.copy_engines);
  std::vector<float> widened(want.size());
  ASSERT_TRUE((*p1)->read(widened.data(), (*wide)->data(), kBytes * 2).ok());
  for (std::size_t i = 0; i < want.size(); i += 4099) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &widened[i], 4);
    ASSERT_EQ(bits, static_cast<std::uint32_t>(want[i]) << 16) << "element " << i;
  }
}

// The peer executor's case: the destination is memory another process (here the parent, on
// GPU 1) exported through CUDA IPC, mapped by this process's plane on GPU 0.
TEST(CudaPlane, CopyEnginesBesideTheKernelIntoIpcMappedMemoryOfAnotherGpu) {
  if (skip_unless_two_gpus_and_auto()) GTEST_SKIP() << "needs 2 GPUs and REFIT_COPY_ENGINE unset";
  auto p1 = cuda_plane(1);
  ASSERT_TRUE(p1.ok());
  std::string handle;
  auto dst = (*p1)->allocate_exported(kBytes, "", &handle);
  ASSERT_TRUE(dst.ok()) << dst.status().to_string();
  const int rc = testing::run_test_child("CudaPlaneChild.*", {"REFIT_TEST_PLANE_MEM=" + handle},
                                         std::chrono::seconds(120));
  ASSERT_EQ(rc, 0) << "the copying child failed";
  std::vector<std::uint16_t> got(static_cast<std::size_t>(kElems));
  ASSERT_TRUE((*p1)->read(got.data(), (*dst)->data(), kBytes).ok());
  EXPECT_EQ(got, finite_bf16(got.size()));
}

TEST(CudaPlaneChild, CopyIntoTheParentsMemory) {
  const char* handle = std::getenv("REFIT_TEST_PLANE_MEM");
  if (handle == nullptr) GTEST_SKIP() << "runs only as CudaPlane's child";
  auto p0 = cuda_plane(0);
  ASSERT_TRUE(p0.ok());
  DataPlane& plane = **p0;
  auto dst = plane.open_exported(handle, kBytes);
  ASSERT_TRUE(dst.ok()) << dst.status().to_string();
  auto src = plane.allocate(kBytes);
  ASSERT_TRUE(src.ok());
  const std::vector<std::uint16_t> want = finite_bf16(static_cast<std::size_t>(kElems));
  ASSERT_TRUE(plane.write((*src)->data(), want.data(), kBytes).ok());
  const std::vector<CopyRun> runs = runs_between((*src)->data(), (*dst)->data());
  ASSERT_TRUE(plane.copy(runs, DType::kBFloat16, DType::kBFloat16).ok());
  EXPECT_EQ(plane.copy_path_bytes().copy_engines, kEngineBytes);
  EXPECT_EQ(plane.copy_path_bytes().kernel, static_cast<std::int64_t>(kBytes) - kEngineBytes);
}

}  // namespace
}  // namespace refit
