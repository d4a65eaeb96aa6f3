#include <gtest/gtest.h>

#include <chrono>

#include "plan/bucket_plan.h"
#include "refit/model_spec.h"

namespace refit {
namespace {

ModelSpec load(const std::string& name) {
  auto spec = load_model_spec(name);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return spec.ok() ? std::move(spec).value() : ModelSpec();
}

BucketPlan plan_or_die(const ModelSpec& spec, DType dtype, std::int64_t buffer,
                       std::int64_t alignment = kBucketAlignment) {
  auto plan = make_bucket_plan(spec, dtype, buffer, alignment);
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  return plan.ok() ? std::move(plan).value() : BucketPlan();
}

// Bounds, alignment, no overlap, and every element of every tensor exactly once, in spec order.
void expect_valid(const ModelSpec& spec, const BucketPlan& plan) {
  const auto elem = static_cast<std::int64_t>(dtype_size(plan.dtype));
  std::uint32_t tensor = 0;
  std::int64_t next_elem = 0, payload = 0, max_bytes = 0;
  auto skip_empty = [&] {
    while (tensor < spec.tensors().size() && spec.tensors()[tensor].numel() == 0) ++tensor;
  };
  skip_empty();
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    const Bucket& bucket = plan.buckets[b];
    ASSERT_FALSE(bucket.entries.empty()) << "bucket " << b;
    ASSERT_LE(bucket.bytes, plan.buffer_size_bytes) << "bucket " << b;
    std::int64_t end = 0;
    for (const BucketEntry& e : bucket.entries) {
      ASSERT_EQ(e.offset % plan.alignment, 0) << "bucket " << b;
      ASSERT_GE(e.offset, end) << "bucket " << b << " entries overlap";
      ASSERT_GT(e.elem_count, 0);
      end = e.offset + e.elem_count * elem;
      ASSERT_LE(end, plan.buffer_size_bytes);
      // Coverage in order: this entry continues exactly where the previous one stopped.
      ASSERT_LT(tensor, spec.tensors().size());
      ASSERT_EQ(e.tensor, tensor) << "bucket " << b;
      ASSERT_EQ(e.elem_begin, next_elem) << spec.tensors()[tensor].name;
      next_elem += e.elem_count;
      payload += e.elem_count * elem;
      ASSERT_LE(next_elem, spec.tensors()[tensor].numel());
      if (next_elem == spec.tensors()[tensor].numel()) {
        ++tensor;
        next_elem = 0;
        skip_empty();
      }
    }
    EXPECT_EQ(bucket.bytes, end) << "bucket " << b;
    max_bytes = std::max(max_bytes, bucket.bytes);
  }
  EXPECT_EQ(tensor, spec.tensors().size()) << "tensors missing from the plan";
  EXPECT_EQ(payload, plan.payload_bytes);
  EXPECT_EQ(max_bytes, plan.max_bucket_bytes);
}

TEST(BucketPlan, DeterministicAndHashSensitive) {
  const ModelSpec spec = load("tiny-qwen3");
  const BucketPlan a = plan_or_die(spec, DType::kBFloat16, 64 << 10);
  const BucketPlan b = plan_or_die(spec, DType::kBFloat16, 64 << 10);
  ASSERT_EQ(a.buckets.size(), b.buckets.size());
  for (std::size_t i = 0; i < a.buckets.size(); ++i) {
    ASSERT_EQ(a.buckets[i].entries.size(), b.buckets[i].entries.size());
    EXPECT_EQ(a.buckets[i].bytes, b.buckets[i].bytes);
    for (std::size_t k = 0; k < a.buckets[i].entries.size(); ++k) {
      const BucketEntry &x = a.buckets[i].entries[k], &y = b.buckets[i].entries[k];
      EXPECT_EQ(x.tensor, y.tensor);
      EXPECT_EQ(x.elem_begin, y.elem_begin);
      EXPECT_EQ(x.elem_count, y.elem_count);
      EXPECT_EQ(x.offset, y.offset);
    }
  }
  EXPECT_EQ(a.hash, b.hash);
  EXPECT_EQ(a.hash_hex(), b.hash_hex());
  EXPECT_EQ(a.hash_hex().size(), 16u);
  EXPECT_EQ(a.hash_hex().find_first_not_of("0123456789abcdef"), std::string::npos);

  EXPECT_NE(plan_or_die(spec, DType::kBFloat16, 32 << 10).hash, a.hash) << "buffer size";
  EXPECT_NE(plan_or_die(spec, DType::kFloat32, 64 << 10).hash, a.hash) << "dtype";
  EXPECT_NE(plan_or_die(spec, DType::kBFloat16, 64 << 10, 512).hash, a.hash) << "alignment";
  EXPECT_NE(plan_or_die(load("tiny-llama"), DType::kBFloat16, 64 << 10).hash, a.hash) << "model";
}

TEST(BucketPlan, BoundsAlignmentAndCompletenessOnEveryPreset) {
  for (const char* preset : {"tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-moe"}) {
    const ModelSpec spec = load(preset);
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (std::int64_t buffer : {256ll, 1000ll, 4096ll, 20000ll, 1ll << 20}) {
        for (std::int64_t alignment : {1ll, 4ll, 256ll}) {
          if (buffer < alignment) continue;
          SCOPED_TRACE(std::string(preset) + " " + std::string(dtype_name(dtype)) + " buffer " +
                       std::to_string(buffer) + " alignment " + std::to_string(alignment));
          expect_valid(spec, plan_or_die(spec, dtype, buffer, alignment));
        }
      }
    }
  }
}

TEST(BucketPlan, PacksGreedilyInOrder) {
  // tiny-llama, bf16: embed 777x64 = 99,456 B; q/k/v/o 64x64 = 8192 B each.
  const ModelSpec spec = load("tiny-llama");
  const BucketPlan plan = plan_or_die(spec, DType::kBFloat16, 1 << 20);
  // Everything fits in one MiB: the whole model is one bucket, entries back to back (aligned).
  std::int64_t total = 0;
  for (const auto& t : spec.tensors()) total += t.numel() * 2;
  EXPECT_EQ(plan.payload_bytes, total);
  ASSERT_EQ(plan.buckets.size(), 1u);
  const auto& e = plan.buckets[0].entries;
  ASSERT_EQ(e.size(), spec.tensors().size());
  EXPECT_EQ(e[0].offset, 0);
  EXPECT_EQ(e[1].offset, 99'584);  // 99,456 aligned up to 256
  EXPECT_EQ(e[2].offset, 99'584 + 8192);

  // A 16 KiB buffer holds two projections; the embedding is split into 16 KiB chunks.
  const BucketPlan small = plan_or_die(spec, DType::kBFloat16, 16 << 10);
  expect_valid(spec, small);
  // 49,728 elements / 8192: 6 full chunks + a tail of 576 elements.
  for (int b = 0; b < 6; ++b) {
    ASSERT_EQ(small.buckets[b].entries.size(), 1u);
    EXPECT_EQ(small.buckets[b].entries[0].elem_count, 8192);
    EXPECT_EQ(small.buckets[b].bytes, 16 << 10);
  }
  // The tail (1152 B) shares its bucket with q_proj (8 KiB at 1280); k_proj no longer fits.
  ASSERT_EQ(small.buckets[6].entries.size(), 2u);
  EXPECT_EQ(small.buckets[6].entries[0].elem_begin, 6 * 8192);
  EXPECT_EQ(small.buckets[6].entries[0].elem_count, 576);
  EXPECT_EQ(small.buckets[6].entries[1].tensor, 1u);
  EXPECT_EQ(small.buckets[6].entries[1].offset, 1280);
  EXPECT_EQ(small.buckets[7].entries[0].tensor, 2u);
  EXPECT_EQ(small.buckets[7].entries[0].offset, 0);
}

TEST(BucketPlan, SplitsTensorsLargerThanTheBuffer) {
  // A buffer that is not a multiple of the element size: chunks of floor(buffer / 4) elements.
  const ModelSpec spec = load("tiny-qwen2");
  const std::int64_t buffer = 1001;
  const BucketPlan plan = plan_or_die(spec, DType::kFloat32, buffer, 1);
  expect_valid(spec, plan);
  const std::int64_t largest = spec.tensors()[0].numel();  // embed 515 x 56
  ASSERT_GT(largest * 4, buffer);
  std::int64_t chunks = 0;
  for (const Bucket& b : plan.buckets)
    for (const BucketEntry& e : b.entries)
      if (e.tensor == 0) {
        ++chunks;
        EXPECT_EQ(e.offset, 0) << "every chunk starts a bucket";
        EXPECT_LE(e.elem_count, 250);
      }
  EXPECT_EQ(chunks, (largest + 249) / 250);
  EXPECT_LE(plan.max_bucket_bytes, buffer);
}

TEST(BucketPlan, RejectsBuffersThatCannotHoldAnElementOrAnAlignment) {
  const ModelSpec spec = load("tiny-qwen3");
  auto small = make_bucket_plan(spec, DType::kBFloat16, 100, 256);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  const std::string m = small.status().message();
  EXPECT_NE(m.find("refit.buffer_size_bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("100"), std::string::npos) << m;
  EXPECT_NE(m.find("256"), std::string::npos) << m;

  auto tiny = make_bucket_plan(spec, DType::kFloat32, 3, 1);
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument);
  const std::string n = tiny.status().message();
  EXPECT_NE(n.find("refit.buffer_size_bytes"), std::string::npos) << n;
  EXPECT_NE(n.find(" 3 "), std::string::npos) << n;
  EXPECT_NE(n.find("minimum is 4"), std::string::npos) << n;

  EXPECT_FALSE(make_bucket_plan(spec, DType::kBFloat16, 1024, 0).ok());
  // One element exactly is enough.
  auto one = make_bucket_plan(spec, DType::kFloat32, 4, 1);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  expect_valid(spec, *one);
}

TEST(BucketPlan, Qwen3MoeBuildsFast) {
  const ModelSpec spec = load("qwen3-30b-a3b");
  const auto t0 = std::chrono::steady_clock::now();
  const BucketPlan plan = plan_or_die(spec, DType::kBFloat16, 256ll << 20);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(plan.payload_bytes, spec.total_parameters() * 2);
  expect_valid(spec, plan);
  // ~61 GB in 256 MiB buckets: at least ceil(payload / buffer) buckets.
  EXPECT_GE(static_cast<std::int64_t>(plan.buckets.size()),
            (plan.payload_bytes + (256ll << 20) - 1) / (256ll << 20));
}

}  // namespace
}  // namespace refit
