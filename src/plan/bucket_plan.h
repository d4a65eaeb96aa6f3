// The bucket plan (docs/design.md §2 stage 5): a deterministic assignment of HF tensors (in spec order)
// to flat buckets of at most buffer_size_bytes, computed from metadata alone, identical on every
// participant. Tensors start at offsets aligned to `alignment` (kBucketAlignment by default).
// A tensor that does not fit behind the current bucket's last entry starts a new bucket. A tensor
// larger than the buffer is split by elements into consecutive chunks of
// floor(buffer / element size) elements, each starting a bucket of its own (so a refit never
// needs memory beyond the configured buffers); the tail chunk's bucket is shared with the tensors
// that follow. Tensors with zero elements get no entry: they have no bytes to move and an engine
// has nothing to write for them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refit/config.h"  // kBucketAlignment
#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {


struct BucketEntry {
  std::uint32_t tensor = 0;     // index into ModelSpec::tensors()
  std::int64_t elem_begin = 0;  // HF elements [elem_begin, elem_begin + elem_count)
  std::int64_t elem_count = 0;
  std::int64_t offset = 0;  // byte offset in the bucket (aligned)
};

struct Bucket {
  std::vector<BucketEntry> entries;
  std::int64_t bytes = 0;  // end of the last entry (<= buffer_size_bytes)
};

struct BucketPlan {
  DType dtype = DType::kBFloat16;
  std::int64_t buffer_size_bytes = 0;
  std::int64_t alignment = kBucketAlignment;
  std::vector<Bucket> buckets;
  std::int64_t payload_bytes = 0;  // sum of entry bytes (the bytes a refit must move)
  std::int64_t max_bucket_bytes = 0;
  std::uint64_t hash = 0;  // over names, shapes, dtype and every entry

  // "0123456789abcdef"
  std::string hash_hex() const;
};

// Errors (InvalidArgument naming refit.buffer_size_bytes, its value and the minimum): buffer
// smaller than `alignment` or than one element; alignment < 1.
Result<BucketPlan> make_bucket_plan(const ModelSpec& spec, DType dtype,
                                    std::int64_t buffer_size_bytes, std::int64_t alignment);

}  // namespace refit
