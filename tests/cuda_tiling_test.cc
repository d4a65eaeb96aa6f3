// The CPU half of the GPU copy engine (device/copy_kernels.h): how runs are cut into tiles and
// how layout pieces become runs. Runs everywhere (no GPU needed).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "common/convert.h"
#include "device/copy_kernels.h"
#include "engine/engine_layout.h"

namespace refit {
namespace {

// Every (src element, dst element) pair a run or a tile list copies, in order.
using Pairs = std::vector<std::pair<std::int64_t, std::int64_t>>;
Pairs expand(const Block2D& b) {
  Pairs out;
  for (std::int64_t r = 0; r < b.rows; ++r)
    for (std::int64_t c = 0; c < b.cols; ++c)
      out.emplace_back(b.src_offset + r * b.src_stride + c, b.dst_offset + r * b.dst_stride + c);
  return out;
}
Pairs expand(const std::vector<DeviceTile>& tiles) {
  Pairs out;
  for (const DeviceTile& t : tiles)
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t c = 0; c < t.cols; ++c)
        out.emplace_back(t.src_offset + r * t.src_stride + c, t.dst_offset + r * t.dst_stride + c);
  return out;
}

TEST(CudaTiling, TilesCoverEveryRunExactlyOnceInOrder) {
  std::mt19937_64 rng(5);
  std::vector<Block2D> runs = {
      {0, 0, 0, 0, 1, 3 * kTileElems + 5},                         // long row
      {10, 300, 7, 300, 400, 300},                                 // contiguous: collapsed, split
      {3, 70, 9, 64, 1000, 64},                                    // strided short rows, grouped
      {0, kTileElems + 40, 1, kTileElems + 3, 3, kTileElems + 1},  // long strided rows
      {5, 1, 6, 1, 7, 1},                                          // column vector (contiguous)
      {5, 2, 6, 3, 7, 1},                                          // column vector, strided
  };
  for (int i = 0; i < 20; ++i) {
    const std::int64_t cols = 1 + static_cast<std::int64_t>(rng() % 3000);
    const std::int64_t rows = 1 + static_cast<std::int64_t>(rng() % 200);
    runs.push_back(Block2D{static_cast<std::int64_t>(rng() % 100),
                           cols + static_cast<std::int64_t>(rng() % 3),
                           static_cast<std::int64_t>(rng() % 100),
                           cols + static_cast<std::int64_t>(rng() % 3), rows, cols});
  }
  for (const Block2D& run : runs) {
    std::vector<DeviceTile> tiles;
    ASSERT_TRUE(tile_run(run, 42, tiles).ok());
    for (const DeviceTile& t : tiles) {
      EXPECT_LE(static_cast<std::int64_t>(t.rows) * t.cols, kTileElems);
      EXPECT_GT(t.rows, 0);
      EXPECT_GT(t.cols, 0);
      EXPECT_EQ(t.tag, 42u);
    }
    EXPECT_EQ(expand(tiles), expand(run)) << run.rows << "x" << run.cols;
  }
}

TEST(CudaTiling, ContiguousRunsBecomeFullTiles) {
  std::vector<DeviceTile> tiles;
  ASSERT_TRUE(tile_run(Block2D{0, 1024, 0, 1024, 1024, 1024}, 0, tiles).ok());
  ASSERT_EQ(tiles.size(), static_cast<std::size_t>(1024 * 1024 / kTileElems));
  for (const DeviceTile& t : tiles) {
    EXPECT_EQ(t.rows, 1);
    EXPECT_EQ(t.cols, kTileElems);
  }
}

TEST(CudaTiling, EmptyRunsGiveNoTilesAndBadRunsAreRejected) {
  std::vector<DeviceTile> tiles;
  ASSERT_TRUE(tile_run(Block2D{0, 4, 0, 4, 0, 4}, 0, tiles).ok());
  ASSERT_TRUE(tile_run(Block2D{0, 4, 0, 4, 4, 0}, 0, tiles).ok());
  EXPECT_TRUE(tiles.empty());
  const Status neg = tile_run(Block2D{-1, 4, 0, 4, 2, 4}, 0, tiles);
  EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(neg.message().find("non-negative"), std::string::npos) << neg.message();
  const Status wide = tile_run(Block2D{0, std::int64_t{1} << 32, 0, 8, 2, 8}, 0, tiles);
  EXPECT_EQ(wide.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wide.message().find("2^31"), std::string::npos) << wide.message();
}

// Executing the piece runs of an engine rank on the CPU (convert_block, the GPU kernel's
// reference) from HF tensors laid out in an arena builds the engine parameters: each element
// equals the HF element its piece names.
TEST(CudaTiling, PieceRunsPlaceHfElementsWhereTheEngineLayoutSays) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  // HF arena: tensor t element i holds the value t * 1e5 + i (exact in fp32 for these sizes).
  std::vector<std::int64_t> hf_base;
  std::int64_t total = 0;
  for (const TensorSpec& t : spec->tensors()) {
    hf_base.push_back(total);
    total += t.numel() + 5;
  }
  std::vector<float> hf(static_cast<std::size_t>(total), -1.0f);
  for (std::size_t t = 0; t < spec->tensors().size(); ++t)
    for (std::int64_t i = 0; i < spec->tensors()[t].numel(); ++i)
      hf[static_cast<std::size_t>(hf_base[t] + i)] = static_cast<float>(t * 100000 + i);
  for (int rank = 0; rank < 2; ++rank) {
    auto layout = engine_layout(*spec, 2, rank, EngineLayout::kFused, EngineProtocol::kVllm);
    ASSERT_TRUE(layout.ok());
    std::vector<Block2D> runs;
    std::vector<std::uint32_t> tags;
    std::vector<std::int64_t> param_base;
    std::int64_t elems = 0;
    for (const EngineParam& p : layout->params) {
      param_base.push_back(elems);
      append_piece_runs(*spec, p.pieces, p.shape, elems, &hf_base, runs, tags);
      elems += matrix_shape(p.shape).numel();
    }
    ASSERT_EQ(runs.size(), tags.size());
    std::vector<float> engine(static_cast<std::size_t>(elems), -2.0f);
    for (const Block2D& b : runs)
      convert_block(hf.data(), DType::kFloat32, b.src_offset, b.src_stride, engine.data(),
                    DType::kFloat32, b.dst_offset, b.dst_stride, b.rows, b.cols);
    for (std::size_t k = 0; k < layout->params.size(); ++k) {
      const EngineParam& p = layout->params[k];
      const std::int64_t cols = matrix_shape(p.shape).cols;
      for (const Piece& pc : p.pieces) {
        const std::int64_t hf_cols = matrix_shape(spec->tensors()[pc.hf_tensor].shape).cols;
        for (std::int64_t r = 0; r < pc.rows; r += std::max<std::int64_t>(1, pc.rows / 7))
          for (std::int64_t c = 0; c < pc.cols; c += std::max<std::int64_t>(1, pc.cols / 5)) {
            const float want = static_cast<float>(pc.hf_tensor * 100000 +
                                                  (pc.src_row + r) * hf_cols + pc.src_col + c);
            const float got = engine[static_cast<std::size_t>(
                param_base[k] + (pc.dst_row + r) * cols + pc.dst_col + c)];
            ASSERT_EQ(got, want) << p.name << " rank " << rank << " row " << r << " col " << c;
          }
      }
    }
  }
}

}  // namespace
}  // namespace refit
