#include "weights/materialize.h"

#include <algorithm>
#include <memory>

#include "common/convert.h"

namespace refit {

void materialize_pieces(const ModelSpec& spec, const std::vector<Piece>& pieces,
                        const std::vector<std::int64_t>& shape, const WeightSource& weights,
                        int step, DType via, DType out_dtype, std::byte* out) {
  constexpr std::int64_t kChunk = 1 << 20;
  const std::int64_t dst_cols = matrix_shape(shape).cols;
  const std::size_t out_size = dtype_size(out_dtype);
  // Scratch of the longest run the pieces emit, at most kChunk elements, and not zeroed: called
  // per tensor on every step of `refit run`, a fixed 4 MiB of fresh zeroed pages per call cost
  // the ranks more than the refit itself at a few hundred processes.
  std::int64_t longest = 0;
  for (const Piece& p : pieces) {
    const std::int64_t hf_cols = matrix_shape(spec.tensors()[p.hf_tensor].shape).cols;
    longest = std::max(longest, p.cols == hf_cols && p.cols == dst_cols ? p.rows * p.cols : p.cols);
  }
  const auto scratch = static_cast<std::size_t>(std::min(kChunk, longest));
  // Kept by the thread between calls (a rank fills every tensor on every step), grown as needed.
  thread_local std::unique_ptr<float[]> f32;
  thread_local std::unique_ptr<std::byte[]> rounded;
  thread_local std::size_t held = 0;
  if (held < scratch) {
    f32 = std::make_unique_for_overwrite<float[]>(scratch);
    // No dtype is wider than float32, so any `via` fits.
    rounded = std::make_unique_for_overwrite<std::byte[]>(scratch * sizeof(float));
    held = scratch;
  }
  // Values of HF elements [begin, begin+n) → out at flat position dst (contiguous).
  auto emit = [&](std::uint32_t hf, std::int64_t begin, std::int64_t n, std::int64_t dst) {
    for (std::int64_t done = 0; done < n; done += kChunk) {
      const std::int64_t m = std::min(kChunk, n - done);
      weights.values(hf, begin + done, m, step, f32.get());
      std::byte* target = out + static_cast<std::size_t>(dst + done) * out_size;
      if (via == DType::kFloat32) {
        convert(f32.get(), DType::kFloat32, target, out_dtype, static_cast<std::size_t>(m));
      } else {
        convert(f32.get(), DType::kFloat32, rounded.get(), via, static_cast<std::size_t>(m));
        convert(rounded.get(), via, target, out_dtype, static_cast<std::size_t>(m));
      }
    }
  };
  for (const Piece& p : pieces) {
    const std::int64_t hf_cols = matrix_shape(spec.tensors()[p.hf_tensor].shape).cols;
    if (p.cols == hf_cols && p.cols == dst_cols) {  // whole rows on both sides: one run
      emit(p.hf_tensor, p.src_row * hf_cols, p.rows * p.cols, p.dst_row * dst_cols);
      continue;
    }
    for (std::int64_t r = 0; r < p.rows; ++r)
      emit(p.hf_tensor, (p.src_row + r) * hf_cols + p.src_col, p.cols,
           (p.dst_row + r) * dst_cols + p.dst_col);
  }
}

}  // namespace refit
