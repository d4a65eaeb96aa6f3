// Which way moves bytes from GPU 0 to GPU 1 fastest: copy engine or SM stores/loads, pushed by the
// sender or pulled by the receiver, into memory allocated in-process or mapped through CUDA IPC
// from another process (as refit's peer executor does). Built and run on a host with two GPUs:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/nvlink_probe bench/gpu/nvlink_probe.cu
//   /tmp/nvlink_probe [MiB per copy, default 1024]
//
// Prints one line per method: the median of 7 timed copies (after 2 warm-ups), in GB/s.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

// Grid-stride 16-byte copy; `unroll` loads in flight per thread before the stores.
__global__ void copy16(const int4* __restrict__ s, int4* __restrict__ d, size_t n) {
  constexpr int kUnroll = 4;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = s[i + k * stride];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) d[i + k * stride] = v[k];
  }
  for (; i < n; i += stride) d[i] = s[i];
}

// Pseudo-random words, different for each `seed`.
__global__ void fill_random(unsigned* p, size_t n, unsigned seed) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed * 0x9E3779B9u;
    x ^= x >> 15; x *= 0x2c1b3c6dU; x ^= x >> 12; x *= 0x297a2d39U; x ^= x >> 15;
    p[i] = x;
  }
}

// `before` runs untimed ahead of each timed copy.
static double median_gbps_with(size_t bytes, cudaStream_t st, const std::function<void(int)>& before,
                               const std::function<void()>& issue) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> v;
  for (int i = 0; i < 9; ++i) {
    before(i);
    CK(cudaStreamSynchronize(st));
    CK(cudaEventRecord(a, st));
    issue();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2) v.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static double median_gbps(size_t bytes, cudaStream_t st, const std::function<void()>& issue) {
  return median_gbps_with(bytes, st, [](int) {}, issue);
}

static int sms(int dev) {
  int n = 0;
  CK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// Copies on `dev`'s stream from s to d: copy engine (one call, or `pieces` calls over `streams`
// streams) or the SM kernel with `blocks_per_sm`.
static void run_set(const char* where, int dev, const void* s, void* d, size_t bytes) {
  CK(cudaSetDevice(dev));
  cudaStream_t st[4];
  for (auto& x : st) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  cudaEvent_t fork, join[4];
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (auto& j : join) CK(cudaEventCreateWithFlags(&j, cudaEventDisableTiming));
  auto ce = [&](int pieces, int streams) {
    return [=, &st, &fork, &join]() {
      CK(cudaEventRecord(fork, st[0]));
      for (int k = 1; k < streams; ++k) CK(cudaStreamWaitEvent(st[k], fork));
      const size_t piece = bytes / pieces;
      for (int p = 0; p < pieces; ++p)
        CK(cudaMemcpyAsync(static_cast<char*>(d) + p * piece, static_cast<const char*>(s) + p * piece,
                           piece, cudaMemcpyDeviceToDevice, st[p % streams]));
      for (int k = 1; k < streams; ++k) {
        CK(cudaEventRecord(join[k], st[k]));
        CK(cudaStreamWaitEvent(st[0], join[k]));
      }
    };
  };
  auto sm = [&](int blocks_per_sm, int threads) {
    return [=, &st]() {
      copy16<<<sms(dev) * blocks_per_sm, threads, 0, st[0]>>>(static_cast<const int4*>(s),
                                                              static_cast<int4*>(d), bytes / 16);
      CK(cudaGetLastError());
    };
  };
  std::printf("%-26s ce x1              %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(1, 1)));
  std::printf("%-26s ce 64 pieces x1    %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(64, 1)));
  if (bytes >= (size_t{1} << 30)) {
    const int big = static_cast<int>(bytes >> 28);  // 256 MiB pieces
    std::printf("%-26s ce 256 MiB pieces  %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(big, 1)));
    std::printf("%-26s ce 256 MiB x2      %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(big, 2)));
  }
  std::printf("%-26s ce 64 pieces x2    %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(64, 2)));
  std::printf("%-26s ce 64 pieces x4    %7.1f GB/s\n", where, median_gbps(bytes, st[0], ce(64, 4)));
  std::printf("%-26s sm 1x256           %7.1f GB/s\n", where, median_gbps(bytes, st[0], sm(1, 256)));
  std::printf("%-26s sm 2x512           %7.1f GB/s\n", where, median_gbps(bytes, st[0], sm(2, 512)));
  std::printf("%-26s sm 4x256           %7.1f GB/s\n", where, median_gbps(bytes, st[0], sm(4, 256)));
  std::printf("%-26s sm 8x256           %7.1f GB/s\n", where, median_gbps(bytes, st[0], sm(8, 256)));
  std::fflush(stdout);
  for (auto& x : st) CK(cudaStreamDestroy(x));
}

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  int pipe_h[2], pipe_back[2];
  if (pipe(pipe_h) != 0 || pipe(pipe_back) != 0) return 2;
  // Two processes before CUDA starts: the child owns memory on GPU 1 and on GPU 0 and exports it.
  const pid_t child = fork();
  if (child == 0) {
    void *d1 = nullptr, *s0 = nullptr;
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&d1, bytes));
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&s0, bytes));
    CK(cudaMemset(s0, 7, bytes));
    cudaIpcMemHandle_t h[2];
    CK(cudaIpcGetMemHandle(&h[0], d1));
    CK(cudaIpcGetMemHandle(&h[1], s0));
    if (write(pipe_h[1], h, sizeof h) != static_cast<ssize_t>(sizeof h)) return 2;
    char done = 0;
    if (read(pipe_back[0], &done, 1) != 1) return 2;
    return 0;
  }
  cudaIpcMemHandle_t h[2];
  if (read(pipe_h[0], h, sizeof h) != static_cast<ssize_t>(sizeof h)) return 2;
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, 0, 1));
  std::printf("%zu MiB per copy; peer access 0->1: %d; SMs: %d\n", bytes >> 20, can, sms(0));
  void *a0 = nullptr, *b1 = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&a0, bytes));
  CK(cudaMemset(a0, 3, bytes));
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaMalloc(&b1, bytes));
  run_set("push, in-process", 0, a0, b1, bytes);
  run_set("pull, in-process", 1, a0, b1, bytes);
  // Through IPC: GPU 1 memory of the other process written from here (push), GPU 0 memory of the
  // other process read by GPU 1 from here (pull).
  void *ipc_d1 = nullptr, *ipc_s0 = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaIpcOpenMemHandle(&ipc_d1, h[0], cudaIpcMemLazyEnablePeerAccess));
  run_set("push, ipc-mapped dst", 0, a0, ipc_d1, bytes);
  CK(cudaSetDevice(1));
  CK(cudaIpcOpenMemHandle(&ipc_s0, h[1], cudaIpcMemLazyEnablePeerAccess));
  run_set("pull, ipc-mapped src", 1, ipc_s0, b1, bytes);
  // Does what the bytes are matter? GPU 0 pushes to GPU 1 (in-process) by copy engine and by SMs:
  // random source written once; random source rewritten (new values) before every copy;
  // random source written once but the destination cleared before every copy.
  if (std::getenv("PROBE_DATA") != nullptr) {
    cudaStream_t s0;
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    auto ce = [&] { CK(cudaMemcpyAsync(b1, a0, bytes, cudaMemcpyDeviceToDevice, s0)); };
    auto smk = [&] {
      copy16<<<sms(0), 256, 0, s0>>>(static_cast<const int4*>(a0), static_cast<int4*>(b1), bytes / 16);
    };
    auto fill = [&](unsigned seed) {
      fill_random<<<sms(0) * 4, 256, 0, s0>>>(static_cast<unsigned*>(a0), bytes / 4, seed);
    };
    auto clear_dst = [&] { CK(cudaMemsetAsync(b1, 0, bytes, s0)); };
    struct M { const char* name; std::function<void()> copy; };
    for (const M& m : {M{"ce", ce}, M{"sm", smk}}) {
      fill(1);
      std::printf("data: %-3s random, written once       %7.1f GB/s\n", m.name,
                  median_gbps_with(bytes, s0, [](int) {}, m.copy));
      std::printf("data: %-3s random, rewritten each time %7.1f GB/s\n", m.name,
                  median_gbps_with(bytes, s0, [&](int i) { fill(100 + i); }, m.copy));
      fill(1);
      std::printf("data: %-3s random once, dst cleared    %7.1f GB/s\n", m.name,
                  median_gbps_with(bytes, s0, [&](int) { clear_dst(); }, m.copy));
      CK(cudaMemsetAsync(a0, 0, bytes, s0));
      std::printf("data: %-3s zeros, dst cleared          %7.1f GB/s\n", m.name,
                  median_gbps_with(bytes, s0, [&](int) { clear_dst(); }, m.copy));
      std::fflush(stdout);
    }
  }
  // Both GPUs drive the one direction at once: GPU 0 pushes the first half with its SMs while
  // GPU 1 pulls the second half with its copy engine (host-timed, both streams synchronised).
  {
    cudaStream_t s0, s1;
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    CK(cudaSetDevice(1));
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    for (double share : {0.5, 0.6, 0.7}) {
      const size_t first = static_cast<size_t>(bytes * share) / 4096 * 4096;
      std::vector<double> v;
      for (int i = 0; i < 9; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        CK(cudaSetDevice(0));
        copy16<<<sms(0) * 2, 512, 0, s0>>>(static_cast<const int4*>(a0), static_cast<int4*>(b1),
                                          first / 16);
        CK(cudaSetDevice(1));
        CK(cudaMemcpyAsync(static_cast<char*>(b1) + first, static_cast<const char*>(a0) + first,
                           bytes - first, cudaMemcpyDeviceToDevice, s1));
        CK(cudaStreamSynchronize(s1));
        CK(cudaSetDevice(0));
        CK(cudaStreamSynchronize(s0));
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (i >= 2) v.push_back(bytes / sec / 1e9);
      }
      std::sort(v.begin(), v.end());
      std::printf("%-26s sm push %.0f%% + ce pull %7.1f GB/s\n", "mixed, in-process", share * 100,
                  v[v.size() / 2]);
    }
  }
  char done = 1;
  if (write(pipe_back[1], &done, 1) != 1) return 2;
  int status = 0;
  waitpid(child, &status, 0);
  return 0;
}
