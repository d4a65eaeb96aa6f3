#include "transport/transport.h"

namespace refit {

BucketMessage bucket_message(int slot, const BucketHeader& h) {
  return BucketMessage{.slot = slot,
                       .step = h.step,
                       .bucket = h.bucket,
                       .bytes = static_cast<std::uint64_t>(h.bytes),
                       .meta = h.meta};
}

IncomingBucket incoming_bucket(const BucketMessage& m) {
  return IncomingBucket{.slot = m.slot,
                        .header = BucketHeader{.step = m.step,
                                               .bucket = m.bucket,
                                               .bytes = static_cast<std::size_t>(m.bytes),
                                               .meta = m.meta}};
}

}  // namespace refit
