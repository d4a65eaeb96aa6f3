// Bucket plan (docs/design.md §2 stage 5): a greedy, order-preserving packing of the spec's tensors into
// buckets, derived from metadata only so that every participant computes the same plan.
#include "plan/bucket_plan.h"

#include <fmt/format.h>
#include <algorithm>

namespace refit {
namespace {

// 64-bit FNV-1a. Integers are fed as 8 little-endian bytes and strings with their length first,
// so the hash does not depend on the host and adjacent fields cannot alias.
class Fnv1a {
 public:
  void bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ull;
    }
  }
  void u64(std::uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    bytes(b, 8);
  }
  void i64(std::int64_t v) { u64(static_cast<std::uint64_t>(v)); }
  void str(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

std::int64_t align_up(std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; }

std::uint64_t plan_hash(const BucketPlan& plan, const ModelSpec& spec) {
  Fnv1a h;
  h.str("refit.bucket_plan.v1");
  h.str(std::string(dtype_name(plan.dtype)));
  h.i64(plan.buffer_size_bytes);
  h.i64(plan.alignment);
  h.u64(plan.buckets.size());
  for (const Bucket& b : plan.buckets) {
    h.u64(b.entries.size());
    h.i64(b.bytes);
    for (const BucketEntry& e : b.entries) {
      const TensorSpec& t = spec.tensors()[e.tensor];
      h.str(t.name);
      h.u64(t.shape.size());
      for (auto d : t.shape) h.i64(d);
      h.i64(e.elem_begin);
      h.i64(e.elem_count);
      h.i64(e.offset);
    }
  }
  return h.value();
}

}  // namespace

std::string BucketPlan::hash_hex() const { return fmt::format("{:016x}", hash); }

Result<BucketPlan> make_bucket_plan(const ModelSpec& spec, DType dtype,
                                    std::int64_t buffer_size_bytes, std::int64_t alignment) {
  const auto elem = static_cast<std::int64_t>(dtype_size(dtype));
  if (alignment < 1)
    return Status::InvalidArgument(
        fmt::format("bucket plan: alignment {} must be at least 1 byte", alignment));
  if (buffer_size_bytes < alignment)
    return Status::InvalidArgument(fmt::format(
        "refit.buffer_size_bytes: {} is smaller than the bucket alignment; the minimum is {}",
        buffer_size_bytes, std::max(alignment, elem)));
  if (buffer_size_bytes < elem)
    return Status::InvalidArgument(
        fmt::format("refit.buffer_size_bytes: {} cannot hold one {} element; the minimum is {}",
                    buffer_size_bytes, dtype_name(dtype), std::max(alignment, elem)));

  BucketPlan plan;
  plan.dtype = dtype;
  plan.buffer_size_bytes = buffer_size_bytes;
  plan.alignment = alignment;
  const std::int64_t chunk_elems = buffer_size_bytes / elem;

  auto close = [&] {
    if (plan.buckets.empty() || plan.buckets.back().entries.empty()) return;
    plan.buckets.emplace_back();
  };
  auto current = [&]() -> Bucket& {
    if (plan.buckets.empty()) plan.buckets.emplace_back();
    return plan.buckets.back();
  };
  auto place = [&](Bucket& b, std::uint32_t tensor, std::int64_t begin, std::int64_t count,
                   std::int64_t offset) {
    b.entries.push_back(BucketEntry{tensor, begin, count, offset});
    b.bytes = offset + count * elem;
    plan.payload_bytes += count * elem;
  };

  const auto& tensors = spec.tensors();
  for (std::uint32_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t n = tensors[i].numel();
    if (n == 0) continue;  // nothing to move; see the header
    const std::int64_t bytes = n * elem;
    if (bytes <= buffer_size_bytes) {
      Bucket* b = &current();
      std::int64_t offset = b->entries.empty() ? 0 : align_up(b->bytes, alignment);
      if (offset + bytes > buffer_size_bytes) {
        close();
        b = &current();
        offset = 0;
      }
      place(*b, i, 0, n, offset);
      continue;
    }
    // Larger than a buffer: consecutive chunks, each at the start of a bucket of its own. The
    // tail chunk's bucket stays open for the tensors that follow.
    for (std::int64_t begin = 0; begin < n; begin += chunk_elems) {
      close();
      place(current(), i, begin, std::min(chunk_elems, n - begin), 0);
    }
  }
  if (!plan.buckets.empty() && plan.buckets.back().entries.empty()) plan.buckets.pop_back();
  for (const Bucket& b : plan.buckets)
    plan.max_bucket_bytes = std::max(plan.max_bucket_bytes, b.bytes);
  plan.hash = plan_hash(plan, spec);
  return plan;
}

}  // namespace refit
