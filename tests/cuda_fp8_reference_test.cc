// The FP8 reference quantizer on the GPU (harness/fp8_reference_device.h), which --verify runs on
// `device: cuda`, against the CPU quantizer (common/quantize.h) bit for bit; and the whole GPU
// verification (find_fp8_mismatch_on_device) against the CPU reference's expected parameters,
// with one byte damaged in a code, a scale and a bf16 parameter. Skips without a GPU (in CPU
// builds it checks that the calls report kUnsupported).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/convert.h"
#include "common/quantize.h"
#include "device/device.h"
#include "engine/engine_layout.h"
#include "harness/fp8_reference.h"
#include "harness/fp8_reference_device.h"
#include "io/safetensors.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "spec/fp8.h"
#include "test_util.h"
#include "weights/setup.h"

namespace refit {
namespace {

using testing::TempDir;

// Values that exercise every path of the quantizer, per block of `br` x `bc` of an `rows` x
// `cols` tensor: random magnitudes over 2^-40 ... 2^20, an all-zero block, a block whose amax
// underflows the scale (below 448 * 2^-150), one near the float32 maximum, one of subnormal
// floats, and one of exact e4m3 ties at scale 1.
std::vector<float> test_values(std::int64_t rows, std::int64_t cols, std::int64_t br,
                               std::int64_t bc, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-40, 20);
  const std::int64_t nbc = (cols + bc - 1) / bc;
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t b = (r / br) * nbc + c / bc;
      float v = std::ldexp(mant(rng), expo(rng));
      switch (b % 7) {
        case 1:
          v = 0.0f;
          break;
        case 2:
          v = std::ldexp(mant(rng), -142);
          break;  // amax / 448 underflows
        case 3:
          v = 3.0e38f * mant(rng);
          break;
        case 4:
          v = std::ldexp(mant(rng), -130);
          break;  // subnormal floats
        case 5:   // scale 1: every other value halfway between two codes
          v = (c % 2 ? -1.0f : 1.0f) * (r % br == 0 && c % bc == 0 ? 448.0f : 1.0625f);
          break;
        default:
          break;
      }
      x[static_cast<std::size_t>(r * cols + c)] = v;
    }
  return x;
}

struct Gpu {
  DeviceBuffer buf;
  static Gpu of(const void* host, std::size_t bytes) {
    Gpu g;
    auto b = DeviceBuffer::allocate(std::max<std::size_t>(bytes, 1), 0);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    g.buf = std::move(*b);
    if (bytes > 0) {
      EXPECT_TRUE(copy_to_device(g.buf.data(), host, bytes).ok());
    }
    return g;
  }
  static Gpu zeros(std::size_t bytes) {
    std::vector<std::byte> z(bytes);
    return of(z.data(), bytes);
  }
};

TEST(CudaFp8Reference, KernelsMatchTheCpuQuantizerBitForBit) {
  if (device_count() == 0) {
    if (!cuda_built()) {
      EXPECT_EQ(
          fp8_ref_quantize(nullptr, 1, 1, 1, 1, nullptr, nullptr, nullptr, 0, nullptr, nullptr)
              .code(),
          StatusCode::kUnsupported);
    }
    GTEST_SKIP() << (cuda_built() ? "no CUDA device visible" : "built without CUDA");
  }
  ASSERT_TRUE(set_device(0).ok());
  auto stream = DeviceStream::create(0);
  ASSERT_TRUE(stream.ok());
  int shapes = 0;
  // Ragged blocks, 128 x 128, one block per tensor (the tensor scheme, with row chunks), one row.
  for (const auto& [rows, cols, br, bc] :
       std::vector<std::array<std::int64_t, 4>>{{37, 53, 16, 16},
                                                {256, 384, 128, 128},
                                                {300, 200, 300, 200},
                                                {1, 4099, 128, 128},
                                                {129, 7, 128, 128},
                                                {1000, 97, 1000, 97}}) {
    const std::vector<float> x = test_values(rows, cols, br, bc, static_cast<std::uint32_t>(rows));
    const std::int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
    const auto n = x.size(), blocks = static_cast<std::size_t>(nbr * nbc);
    std::vector<std::uint8_t> want_codes(n);
    std::vector<float> want_scales(blocks);
    ASSERT_TRUE(
        quantize_fp8_blocks(x.data(), rows, cols, br, bc, want_codes.data(), want_scales.data()));
    Gpu dx = Gpu::of(x.data(), n * 4), amax = Gpu::zeros(blocks * 4),
        scales = Gpu::zeros(blocks * 4), codes = Gpu::zeros(n),
        status = Gpu::zeros(kFp8RefStatusWords * 8);
    auto* words = static_cast<std::uint64_t*>(status.buf.data());
    ASSERT_TRUE(fp8_ref_reset_status(words, stream->handle()).ok());
    ASSERT_TRUE(fp8_ref_quantize(static_cast<const float*>(dx.buf.data()), rows, cols, br, bc,
                                 static_cast<std::uint32_t*>(amax.buf.data()),
                                 static_cast<float*>(scales.buf.data()),
                                 static_cast<std::uint8_t*>(codes.buf.data()), 5, words,
                                 stream->handle())
                    .ok());
    ASSERT_TRUE(synchronize_stream(stream->handle(), std::chrono::seconds(60), "test").ok());
    std::vector<std::uint8_t> got_codes(n);
    std::vector<float> got_scales(blocks);
    std::uint64_t host[kFp8RefStatusWords];
    ASSERT_TRUE(copy_to_host(got_codes.data(), codes.buf.data(), n).ok());
    ASSERT_TRUE(copy_to_host(got_scales.data(), scales.buf.data(), blocks * 4).ok());
    ASSERT_TRUE(copy_to_host(host, words, sizeof host).ok());
    EXPECT_EQ(host[0], 0u) << "no block is non-finite";
    EXPECT_EQ(std::memcmp(got_scales.data(), want_scales.data(), blocks * 4), 0)
        << rows << "x" << cols << " blocks " << br << "x" << bc;
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(got_codes[i], want_codes[i])
          << rows << "x" << cols << " element " << i << " = " << x[i] << ", scale "
          << want_scales[static_cast<std::size_t>((static_cast<std::int64_t>(i) / cols / br) * nbc +
                                                  static_cast<std::int64_t>(i) % cols / bc)];
    ++shapes;
  }
  EXPECT_EQ(shapes, 6);
}

TEST(CudaFp8Reference, NonFiniteBlocksAreCountedAndBytesCompared) {
  if (device_count() == 0)
    GTEST_SKIP() << (cuda_built() ? "no CUDA device visible" : "built without CUDA");
  ASSERT_TRUE(set_device(0).ok());
  auto stream = DeviceStream::create(0);
  ASSERT_TRUE(stream.ok());
  // 4 x 4 blocks of 2 x 2: NaN in block 5 and inf in block 14.
  std::vector<float> x(64, 1.0f);
  x[2 * 8 + 3] = std::nanf("");
  x[7 * 8 + 4] = -INFINITY;
  Gpu dx = Gpu::of(x.data(), 256), amax = Gpu::zeros(64), scales = Gpu::zeros(64),
      codes = Gpu::zeros(64), status = Gpu::zeros(32);
  auto* words = static_cast<std::uint64_t*>(status.buf.data());
  ASSERT_TRUE(fp8_ref_reset_status(words, stream->handle()).ok());
  ASSERT_TRUE(fp8_ref_quantize(static_cast<const float*>(dx.buf.data()), 8, 8, 2, 2,
                               static_cast<std::uint32_t*>(amax.buf.data()),
                               static_cast<float*>(scales.buf.data()),
                               static_cast<std::uint8_t*>(codes.buf.data()), 9, words,
                               stream->handle())
                  .ok());
  // Two buffers differing in bytes 3 and 900.
  std::vector<std::uint8_t> a(1000, 7), b(1000, 7);
  b[900] = 8;
  b[3] = 0;
  Gpu da = Gpu::of(a.data(), 1000), db = Gpu::of(b.data(), 1000);
  ASSERT_TRUE(fp8_ref_compare(da.buf.data(), db.buf.data(), 1000, words, stream->handle()).ok());
  ASSERT_TRUE(synchronize_stream(stream->handle(), std::chrono::seconds(60), "test").ok());
  std::uint64_t host[kFp8RefStatusWords];
  ASSERT_TRUE(copy_to_host(host, words, sizeof host).ok());
  EXPECT_EQ(host[0], 2u);
  EXPECT_EQ(host[1], (std::uint64_t{9} << 32) | 5u);
  EXPECT_EQ(host[2], 2u);
  EXPECT_EQ(host[3], 3u);
}

// The engine rank's parameters as the CPU reference says they must be, on the GPU.
struct EngineOnGpu {
  std::unique_ptr<RankModel> model;
  WireModel wire;
  EngineShardLayout layout;
  std::unique_ptr<DataPlane> plane;
  std::vector<std::unique_ptr<PlaneBuffer>> memory;
  std::vector<PieceTarget> params;
  std::vector<std::vector<std::byte>> want;
};

void load_engine(const Config& cfg, int tp_rank, int step, const WeightUpdate& update,
                 EngineOnGpu& e) {
  auto model = load_rank_model(cfg);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  e.model = std::move(*model);
  e.model->weights->set_update(update);
  auto wire = wire_model(cfg, e.model->spec);
  ASSERT_TRUE(wire.ok()) << wire.status().to_string();
  e.wire = std::move(*wire);
  auto layout = engine_wire_layout(cfg, e.model->spec, e.wire, tp_rank);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  e.layout = std::move(*layout);
  auto plane = make_data_plane(cfg, 0);
  ASSERT_TRUE(plane.ok()) << plane.status().to_string();
  e.plane = std::move(*plane);
  Fp8Reference ref(*e.model, e.wire, cfg.policy.dtype, step);
  for (const EngineParam& p : e.layout.params) {
    auto bytes = ref.param(p);
    ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
    auto mem = e.plane->allocate(bytes->size());
    ASSERT_TRUE(mem.ok());
    ASSERT_TRUE(e.plane->write((*mem)->data(), bytes->data(), bytes->size()).ok());
    e.params.push_back({&p.pieces, p.shape, (*mem)->data()});
    e.memory.push_back(std::move(*mem));
    e.want.push_back(std::move(*bytes));
  }
}

// Verifies, then damages one element of the first parameter of each kind (fp8 codes, float32
// scales, bf16) and expects exactly that element reported, with both values. `update`: the
// weights' update (refit run --update), which the GPU reference must generate as the CPU does.
void expect_gpu_verify_agrees(const Config& cfg, int tp_rank, int step, const std::string& what,
                              const WeightUpdate& update = {}) {
  EngineOnGpu e;
  load_engine(cfg, tp_rank, step, update, e);
  if (::testing::Test::HasFatalFailure()) return;
  auto verify = [&]() {
    return find_fp8_mismatch_on_device(*e.plane, *e.model, e.wire, e.layout, e.params,
                                       cfg.policy.dtype, cfg.seed, step, std::chrono::seconds(60));
  };
  auto clean = verify();
  ASSERT_TRUE(clean.ok()) << what << ": " << clean.status().to_string();
  EXPECT_FALSE(clean->has_value())
      << what << ": parameter " << e.layout.params[(*clean)->param].name << " element "
      << (*clean)->element;
  int damaged = 0;
  for (const DType kind : {DType::kFloat8E4M3, DType::kFloat32, DType::kBFloat16}) {
    std::size_t i = 0;
    while (i < e.layout.params.size() && e.layout.params[i].dtype != kind) ++i;
    ASSERT_LT(i, e.layout.params.size()) << what << ": no parameter of " << dtype_name(kind);
    const std::size_t esize = dtype_size(kind);
    const std::int64_t element = e.layout.params[i].numel() / 2 + 1;
    std::byte* at = e.params[i].data + element * static_cast<std::int64_t>(esize);
    const std::byte old = e.want[i][static_cast<std::size_t>(element) * esize];
    const std::byte flipped = old ^ std::byte{0x01};
    ASSERT_TRUE(e.plane->write(at, &flipped, 1).ok());
    auto found = verify();
    ASSERT_TRUE(found.ok()) << found.status().to_string();
    ASSERT_TRUE(found->has_value())
        << what << ": damage in " << e.layout.params[i].name << " not found";
    EXPECT_EQ((*found)->param, i) << what;
    EXPECT_EQ((*found)->element, element) << what << " " << e.layout.params[i].name;
    std::uint32_t want = 0;
    std::memcpy(&want, e.want[i].data() + static_cast<std::size_t>(element) * esize, esize);
    EXPECT_EQ((*found)->want, want) << what << " " << e.layout.params[i].name;
    EXPECT_EQ((*found)->got, want ^ 1u) << what << " " << e.layout.params[i].name;
    ASSERT_TRUE(e.plane->write(at, &old, 1).ok());
    ++damaged;
  }
  EXPECT_EQ(damaged, 3);
}

Config cuda_fp8_config(const std::string& model, const std::string& policy,
                       const std::string& generation, const std::string& fp8) {
  auto c =
      parse_config(fmt::format("model: {}\ndevice: cuda\nseed: 5\npolicy: {{{}}}\n"
                               "generation: {{{}}}\nrefit: {{target_precision: fp8, fp8: {}}}\n",
                               model, policy, generation, fp8));
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return *c;
}

TEST(CudaFp8Reference, GpuVerificationAgreesWithTheCpuReference) {
  if (device_count() == 0)
    GTEST_SKIP() << (cuda_built() ? "no CUDA device visible" : "built without CUDA");
  // Generated weights: fp32 and bf16 trainers, blocks cut by TP slices of fused qkv, MoE experts
  // per tensor, replicated kv heads at TP 4.
  expect_gpu_verify_agrees(cuda_fp8_config("tiny-qwen3", "world_size: 1",
                                           "backend: vllm, tp_size: 2", "{block: [16, 16]}"),
                           1, 2, "tiny-qwen3 tp 2 rank 1");
  expect_gpu_verify_agrees(cuda_fp8_config("tiny-qwen3", "world_size: 1, dtype: bfloat16",
                                           "backend: sglang, tp_size: 1", "{block: [8, 8]}"),
                           0, 3, "tiny-qwen3 bf16 tp 1");
  expect_gpu_verify_agrees(
      cuda_fp8_config("tiny-moe", "world_size: 1", "backend: vllm, tp_size: 2", "{scheme: tensor}"),
      0, 1, "tiny-moe tensor scheme");
  expect_gpu_verify_agrees(
      cuda_fp8_config("tiny-qwen3", "world_size: 1", "backend: vllm, tp_size: 2, layout: hf",
                      "{block: [16, 16]}"),
      0, 1, "tiny-qwen3 hf layout");
  // --update adam:LR: each step moves every element by about LR from its base, and the reference
  // generates the same (with drift's weights instead, every code differs).
  for (const int step : {1, 4})
    expect_gpu_verify_agrees(cuda_fp8_config("tiny-qwen3", "world_size: 1",
                                             "backend: sglang, tp_size: 1", "{block: [16, 16]}"),
                             0, step, fmt::format("tiny-qwen3 adam:1e-5 step {}", step),
                             WeightUpdate{.kind = WeightUpdate::Kind::kAdam, .lr = 1e-5f});
}

TEST(CudaFp8Reference, GpuVerificationOfACheckpoint) {
  if (device_count() == 0)
    GTEST_SKIP() << (cuda_built() ? "no CUDA device visible" : "built without CUDA");
  // A model directory with safetensors: the reference builds each tensor on the host.
  TempDir dir;
  auto json = preset_config_json("tiny-qwen3");
  ASSERT_TRUE(json.ok());
  dir.write("config.json", *json);
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<std::vector<float>> data;
  std::vector<TensorView> views;
  for (const TensorSpec& t : spec->tensors()) {
    data.emplace_back(static_cast<std::size_t>(t.numel()));
    for (float& v : data.back()) v = normal(rng);
    views.push_back({t.name, DType::kFloat32, t.shape, data.back().data()});
  }
  ASSERT_TRUE(write_safetensors(dir.path() + "/model.safetensors", views).ok());
  expect_gpu_verify_agrees(cuda_fp8_config(dir.path(), "world_size: 1", "backend: vllm, tp_size: 2",
                                           "{block: [16, 16]}"),
                           0, 2, "checkpoint tp 2 rank 0");
}

}  // namespace
}  // namespace refit
