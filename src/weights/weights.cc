#include "weights/weights.h"

#include "io/safetensors.h"

namespace refit {
namespace {

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Uniform in [-0.5, 0.5) from 24 bits.
inline float unit(std::uint64_t bits24) {
  return static_cast<float>(static_cast<std::int32_t>(bits24 & 0xffffff) - (1 << 23)) *
         (1.0f / (1 << 24));
}

}  // namespace

WeightSource::WeightSource(const ModelSpec& spec, std::uint64_t seed, const Checkpoint* checkpoint)
    : spec_(spec), seed_(seed), checkpoint_(checkpoint) {}

void WeightSource::values(std::uint32_t tensor, std::int64_t begin, std::int64_t n, int step,
                          float* out) const {
  const std::uint64_t key = mix(seed_ * 0x9e3779b97f4a7c15ull + tensor + 1);
  const float s = static_cast<float>(step);
  const float* base = nullptr;
  std::vector<float> base_buf;
  if (checkpoint_ != nullptr) {
    auto ref = checkpoint_->find(spec_.tensors()[tensor].name);
    if (ref.ok()) {
      base_buf.resize(static_cast<std::size_t>(n));
      ref->read_range(begin, n, base_buf.data(), DType::kFloat32);
      base = base_buf.data();
    }
  }
  for (std::int64_t k = 0; k < n; ++k) {
    const std::uint64_t h = mix(key ^ static_cast<std::uint64_t>(begin + k));
    const float b = base ? base[k] : unit(h >> 40) * 0.2f;
    const float delta = unit(h) * (1.0f / 64);
    const float step_delta = s * delta;
    out[k] = b + step_delta;
  }
}

}  // namespace refit
