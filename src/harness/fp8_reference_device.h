// The FP8 reference quantizer on the GPU (docs/fp8.md, "Checks"): --verify of an FP8 refit on
// `device: cuda` recomputes every code and scale on the engine rank's GPU, with kernels written
// apart from the sender's (device/quant_kernels.cu): one thread block per chunk of a block
// folding max |x| in shared memory, one thread per block for the scale, one thread per element
// for the code, all in the plain arithmetic of harness/fp8_reference_math.h. Placement into
// the engine's layout is cudaMemcpy2D; comparison a byte-wise kernel.
//
// No CUDA includes. Without CUDA every call returns kUnsupported. Calls are asynchronous on
// `stream` unless they say otherwise.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "refit/status.h"

namespace refit {

// Device memory of four uint64 words the kernels below report into: [0] the number of
// non-finite blocks, [1] the smallest (tag << 32 | block) among them, [2] the number of
// mismatching bytes, [3] the smallest mismatching byte offset. Reset: words 0 and 2 to 0, words
// 1 and 3 to all ones.
inline constexpr std::size_t kFp8RefStatusWords = 4;
Status fp8_ref_reset_status(std::uint64_t* status, void* stream);

// x: [rows, cols] float32 (device). Writes the block scales [ceil(rows/br), ceil(cols/bc)] and the
// codes [rows, cols] (device), using `amax` (device scratch of one uint32 per block). A block
// without a finite amax is counted in `status` under `tag`; its scale and codes are then
// undefined.
Status fp8_ref_quantize(const float* x, std::int64_t rows, std::int64_t cols,
                        std::int64_t block_rows, std::int64_t block_cols, std::uint32_t* amax,
                        float* scales, std::uint8_t* codes, std::uint32_t tag,
                        std::uint64_t* status, void* stream);

// Copies `rows` rows of `width` bytes from src (row pitch src_pitch) to dst (row pitch dst_pitch),
// device to device (cudaMemcpy2DAsync).
Status fp8_ref_copy_rect(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                         std::size_t width, std::size_t rows, void* stream);

// Counts the bytes in which a and b (device, n bytes each) differ into `status`.
Status fp8_ref_compare(const void* a, const void* b, std::size_t n, std::uint64_t* status,
                       void* stream);

}  // namespace refit
