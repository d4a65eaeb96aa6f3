// CUDA IPC (device/cuda_ipc.h) across two real processes: the test re-executes its own binary
// as the importing child (CudaIpcChild.*, which skips unless the parent set its environment).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda_ipc.h"
#include "test_util.h"
#include "device/device.h"

extern char** environ;

namespace refit {
namespace {

constexpr std::size_t kBytes = 1 << 20;
constexpr std::size_t kOffset = 4096;  // the exported range starts inside its allocation

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}
std::string from_hex(const char* hex) {
  std::string out;
  for (std::size_t i = 0; hex[i] && hex[i + 1]; i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex + i, 2), nullptr, 16)));
  return out;
}
std::uint8_t pattern(std::size_t i) { return static_cast<std::uint8_t>(i * 7 + 3); }


TEST(CudaIpc, MalformedHandlesAreRejectedBeforeCuda) {
  auto mem = IpcMemory::open("not a handle", 0);
  ASSERT_FALSE(mem.ok());
  auto ev = IpcEvent::open(std::string(68, 'x'), 0);
  ASSERT_FALSE(ev.ok());
  if (!cuda_built()) {
    EXPECT_EQ(mem.status().code(), StatusCode::kUnsupported);
    return;
  }
  EXPECT_EQ(mem.status().code(), StatusCode::kCorruption);
  EXPECT_NE(mem.status().message().find("RFTM"), std::string::npos) << mem.status().message();
  EXPECT_EQ(ev.status().code(), StatusCode::kCorruption);
}

TEST(CudaIpc, ExportRefusesRangesPastTheAllocation) {
  REFIT_REQUIRE_GPU();
  auto buf = DeviceBuffer::allocate(kBytes, 0);
  ASSERT_TRUE(buf.ok());
  auto h = export_device_memory(buf->bytes() + 16, kBytes);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find("past its allocation"), std::string::npos);
  auto ok = export_device_memory(buf->bytes() + 16, kBytes - 16);
  EXPECT_TRUE(ok.ok()) << ok.status().to_string();
}

// The parent fills a sub-range of an allocation on its stream and records its IPC event without
// waiting; the child opens memory and event once, orders its own stream after the event on the
// GPU, checks the bytes and answers in the second half.
TEST(CudaIpc, ChildProcessSeesDataOrderedByTheExportedEvent) {
  REFIT_REQUIRE_GPU();
  auto buf = DeviceBuffer::allocate(kOffset + kBytes, 0);
  ASSERT_TRUE(buf.ok());
  auto stream = DeviceStream::create(0);
  ASSERT_TRUE(stream.ok());
  auto event = IpcEvent::create(0);
  ASSERT_TRUE(event.ok()) << event.status().to_string();
  std::vector<std::uint8_t> host(kBytes / 2);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = pattern(i);
  std::byte* range = buf->bytes() + kOffset;
  ASSERT_TRUE(fill_bytes_async(range, 0, kBytes, stream->handle()).ok());
  ASSERT_TRUE(synchronize_stream(stream->handle(), std::chrono::seconds(10), "clear").ok());
  ASSERT_TRUE(copy_to_device(range, host.data(), host.size()).ok());
  ASSERT_TRUE(event->record(stream->handle()).ok());
  auto mem_handle = export_device_memory(range, kBytes);
  ASSERT_TRUE(mem_handle.ok()) << mem_handle.status().to_string();
  auto ev_handle = event->handle();
  ASSERT_TRUE(ev_handle.ok()) << ev_handle.status().to_string();
  const int rc = testing::run_test_child(
      "CudaIpcChild.*",
      {"REFIT_TEST_IPC_MEM=" + to_hex(*mem_handle), "REFIT_TEST_IPC_EVENT=" + to_hex(*ev_handle)},
      std::chrono::seconds(60));
  ASSERT_EQ(rc, 0) << "the importing child failed";
  std::vector<std::uint8_t> answer(kBytes / 2);
  ASSERT_TRUE(copy_to_host(answer.data(), range + kBytes / 2, answer.size()).ok());
  for (std::size_t i = 0; i < answer.size(); ++i)
    ASSERT_EQ(answer[i], static_cast<std::uint8_t>(~pattern(i))) << "byte " << i;
}

TEST(CudaIpcChild, ImportCheckAndAnswer) {
  const char* mem_hex = std::getenv("REFIT_TEST_IPC_MEM");
  const char* ev_hex = std::getenv("REFIT_TEST_IPC_EVENT");
  if (mem_hex == nullptr || ev_hex == nullptr) GTEST_SKIP() << "runs only as CudaIpc's child";
  auto mem = IpcMemory::open(from_hex(mem_hex), 0);
  ASSERT_TRUE(mem.ok()) << mem.status().to_string();
  ASSERT_EQ(mem->size(), kBytes);
  EXPECT_TRUE(mem->on_this_device());  // exported from GPU 0, opened on GPU 0
  auto ev = IpcEvent::open(from_hex(ev_hex), 0);
  ASSERT_TRUE(ev.ok()) << ev.status().to_string();
  EXPECT_TRUE(ev->imported());
  EXPECT_EQ(ev->record(nullptr).code(), StatusCode::kInvalidArgument);
  auto stream = DeviceStream::create(0);
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(ev->wait_on(stream->handle()).ok());
  std::vector<std::uint8_t> got(kBytes / 2);
  ASSERT_TRUE(synchronize_stream(stream->handle(), std::chrono::seconds(10), "wait").ok());
  ASSERT_TRUE(copy_to_host(got.data(), mem->data(), got.size()).ok());
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], pattern(i)) << "byte " << i;
  for (auto& b : got) b = static_cast<std::uint8_t>(~b);
  ASSERT_TRUE(copy_to_device(mem->data() + kBytes / 2, got.data(), got.size()).ok());
}

}  // namespace
}  // namespace refit
