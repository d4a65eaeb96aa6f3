// The FP8 reference quantizer's kernels (harness/fp8_reference_device.h). Plain on purpose: they
// check the sender's kernels, so they share none of their tricks (no staging, no packed maxima,
// no reciprocal): max |x| by a shared-memory tree, one IEEE division per element.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device/cuda_check.h"
#include "harness/fp8_reference_device.h"
#include "harness/fp8_reference_math.h"

namespace refit {
namespace {

constexpr int kThreads = 256;
// Elements of one block that one thread block folds (a 128 x 128 block: one thread block).
constexpr std::int64_t kChunk = 16384;

template <class T>
__device__ __forceinline__ T smaller(T a, T b) {
  return b < a ? b : a;
}
template <class T>
__device__ __forceinline__ T larger(T a, T b) {
  return a < b ? b : a;
}

// Grid (quantization blocks, row chunks of a block): each thread block's max |x| over its chunks
// as float32 bits, folded into amax[block] with one atomicMax. A chunk is `chunk_rows` rows of the
// block (whose last row and column of blocks may be ragged); its element k is at row k / w, column
// k % w of the chunk.
__global__ void block_amax_kernel(const float* x, std::int64_t rows, std::int64_t cols,
                                  std::int64_t br, std::int64_t bc, std::int64_t nbc,
                                  std::int64_t chunk_rows, std::uint32_t* amax) {
  __shared__ std::uint32_t partial[kThreads];
  const std::int64_t block = blockIdx.x;
  const std::int64_t bi = block / nbc, bj = block % nbc;
  const std::int64_t h = smaller(br, rows - bi * br);
  const int w = static_cast<int>(smaller(bc, cols - bj * bc));
  std::uint32_t m = 0;
  bool any = false;
  // Row chunks blockIdx.y, + gridDim.y, ...
  for (std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * chunk_rows; r0 < h;
       r0 += static_cast<std::int64_t>(gridDim.y) * chunk_rows) {
    const int n = static_cast<int>(smaller(chunk_rows, h - r0)) * w;
    const float* base = x + (bi * br + r0) * cols + bj * bc;
    for (int k = static_cast<int>(threadIdx.x); k < n; k += kThreads)
      m = larger(m, fp8ref::magnitude_bits(base[static_cast<std::int64_t>(k / w) * cols + k % w]));
    any = true;
  }
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half)
      partial[threadIdx.x] = larger(partial[threadIdx.x], partial[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0 && any) atomicMax(amax + block, partial[0]);
}

// One thread per block: its scale, or the block counted as non-finite.
__global__ void block_scale_kernel(const std::uint32_t* amax, std::int64_t blocks, float* scales,
                                   std::uint32_t tag, unsigned long long* status) {
  const std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (b >= blocks) return;
  if (!fp8ref::finite_amax(amax[b])) {
    atomicAdd(status, 1ull);
    atomicMin(status + 1,
              (static_cast<unsigned long long>(tag) << 32) | static_cast<unsigned long long>(b));
    scales[b] = 1.0f;
    return;
  }
  scales[b] = fp8ref::scale_of_amax(amax[b]);
}

// A row per thread block (grid-stride over rows), a column per thread: each element's code with
// its block's scale.
__global__ void quantize_kernel(const float* x, std::int64_t rows, int cols, std::int64_t br,
                                int bc, std::int64_t nbc, const float* scales,
                                std::uint8_t* codes) {
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row_scales = scales + (r / br) * nbc;
    for (int c = static_cast<int>(threadIdx.x); c < cols; c += kThreads)
      codes[r * cols + c] = fp8ref::quantize(x[r * cols + c], row_scales[c / bc]);
  }
}

// Grid-stride byte comparison: the count and the smallest offset of differing bytes.
__global__ void compare_kernel(const std::uint8_t* a, const std::uint8_t* b, std::size_t n,
                               unsigned long long* status) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  unsigned long long count = 0, first = ~0ull;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride)
    if (a[i] != b[i]) {
      if (count == 0) first = i;
      ++count;
    }
  if (count > 0) {
    atomicAdd(status + 2, count);
    atomicMin(status + 3, first);
  }
}

unsigned int grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::clamp<std::int64_t>(blocks, 1, 65536));
}

}  // namespace

Status fp8_ref_reset_status(std::uint64_t* status, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  REFIT_CUDA_CHECK(cudaMemsetAsync(status, 0, kFp8RefStatusWords * sizeof(std::uint64_t), s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(status + 1, 0xFF, sizeof(std::uint64_t), s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(status + 3, 0xFF, sizeof(std::uint64_t), s));
  return Status::Ok();
}

Status fp8_ref_quantize(const float* x, std::int64_t rows, std::int64_t cols,
                        std::int64_t block_rows, std::int64_t block_cols, std::uint32_t* amax,
                        float* scales, std::uint8_t* codes, std::uint32_t tag,
                        std::uint64_t* status, void* stream) {
  if (rows <= 0 || cols <= 0) return Status::Ok();
  if (block_rows <= 0 || block_cols <= 0)
    return Status::InvalidArgument("fp8 reference: a block needs positive sizes");
  const auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t nbr = (rows + block_rows - 1) / block_rows;
  const std::int64_t nbc = (cols + block_cols - 1) / block_cols;
  const std::int64_t blocks = nbr * nbc;
  const std::int64_t h = std::min(block_rows, rows), w = std::min(block_cols, cols);
  const std::int64_t chunk_rows = std::max<std::int64_t>(1, kChunk / w);
  const std::int64_t chunks = (h + chunk_rows - 1) / chunk_rows;
  if (blocks > 0x7FFFFFFF || cols > 0x7FFFFFFF || chunk_rows * w > 0x7FFFFFFF)
    return Status::InvalidArgument(
        "fp8 reference: a tensor with too many blocks, too many columns or too large a block");
  REFIT_CUDA_CHECK(cudaMemsetAsync(amax, 0, static_cast<std::size_t>(blocks) * 4, s));
  block_amax_kernel<<<dim3(static_cast<unsigned int>(blocks),
                           static_cast<unsigned int>(std::min<std::int64_t>(chunks, 65535))),
                      kThreads, 0, s>>>(x, rows, cols, block_rows, block_cols, nbc, chunk_rows,
                                        amax);
  REFIT_CUDA_CHECK_LAUNCH("fp8 reference amax kernel");
  block_scale_kernel<<<grid_for(blocks), kThreads, 0, s>>>(
      amax, blocks, scales, tag, reinterpret_cast<unsigned long long*>(status));
  REFIT_CUDA_CHECK_LAUNCH("fp8 reference scale kernel");
  const auto row_blocks = static_cast<unsigned int>(std::min<std::int64_t>(rows, 65535));
  quantize_kernel<<<row_blocks, kThreads, 0, s>>>(
      x, rows, static_cast<int>(cols), block_rows,
      static_cast<int>(std::min<std::int64_t>(block_cols, cols)), nbc, scales, codes);
  REFIT_CUDA_CHECK_LAUNCH("fp8 reference quantize kernel");
  return Status::Ok();
}

Status fp8_ref_copy_rect(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                         std::size_t width, std::size_t rows, void* stream) {
  if (width == 0 || rows == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                     cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status fp8_ref_compare(const void* a, const void* b, std::size_t n, std::uint64_t* status,
                       void* stream) {
  if (n == 0) return Status::Ok();
  compare_kernel<<<grid_for(
                       static_cast<std::int64_t>(std::min<std::size_t>(n, std::size_t{1} << 40))),
                   kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint8_t*>(a), static_cast<const std::uint8_t*>(b), n,
      reinterpret_cast<unsigned long long*>(status));
  REFIT_CUDA_CHECK_LAUNCH("fp8 reference compare kernel");
  return Status::Ok();
}

}  // namespace refit
