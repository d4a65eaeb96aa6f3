#include "executor/bucket_meta.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace refit {

std::string encode_sglang_meta(const ModelSpec& spec, const Bucket& bucket, DType dtype) {
  nlohmann::json names = nlohmann::json::array(), shapes = nlohmann::json::array(),
                 offsets = nlohmann::json::array(), ranges = nlohmann::json::array();
  for (const BucketEntry& e : bucket.entries) {
    const TensorSpec& t = spec.tensors()[e.tensor];
    names.push_back(t.name);
    shapes.push_back(t.shape);
    offsets.push_back(e.offset);
    ranges.push_back({e.elem_begin, e.elem_count});
  }
  nlohmann::json j = {{"dtype", dtype_name(dtype)},
                      {"names", std::move(names)},
                      {"shapes", std::move(shapes)},
                      {"offsets", std::move(offsets)},
                      {"elem_ranges", std::move(ranges)}};
  return j.dump();
}

Result<std::vector<BucketEntry>> decode_sglang_meta(const ModelSpec& spec, const std::string& meta,
                                                    DType dtype, int bucket) {
  auto j = nlohmann::json::parse(meta, nullptr, false);
  auto bad = [&](const std::string& what) {
    return Status::Corruption(fmt::format("sglang: metadata of bucket {}: {}", bucket, what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not JSON");
  for (const char* key : {"dtype", "names", "shapes", "offsets", "elem_ranges"})
    if (!j.contains(key)) return bad(fmt::format("missing \"{}\"", key));
  if (j["dtype"] != dtype_name(dtype))
    return bad(
        fmt::format("dtype {} but this engine loads {}", j["dtype"].dump(), dtype_name(dtype)));
  const auto& names = j["names"];
  if (!names.is_array() || j["shapes"].size() != names.size() ||
      j["offsets"].size() != names.size() || j["elem_ranges"].size() != names.size())
    return bad("names, shapes, offsets and elem_ranges differ in length");
  std::vector<BucketEntry> entries;
  entries.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string name = names[i].get<std::string>();
    auto idx = spec.find(name);
    if (!idx) return bad(fmt::format("tensor {} is not a parameter of this engine's model", name));
    const TensorSpec& t = spec.tensors()[*idx];
    if (j["shapes"][i].get<std::vector<std::int64_t>>() != t.shape)
      return bad(fmt::format("tensor {} has shape {} but the engine's model says {}", name,
                             j["shapes"][i].dump(), nlohmann::json(t.shape).dump()));
    BucketEntry e;
    e.tensor = static_cast<std::uint32_t>(*idx);
    e.offset = j["offsets"][i].get<std::int64_t>();
    e.elem_begin = j["elem_ranges"][i][0].get<std::int64_t>();
    e.elem_count = j["elem_ranges"][i][1].get<std::int64_t>();
    if (e.elem_begin < 0 || e.elem_count < 0 || e.elem_begin + e.elem_count > t.numel())
      return bad(fmt::format("tensor {} element range [{}, {}) outside its {} elements", name,
                             e.elem_begin, e.elem_begin + e.elem_count, t.numel()));
    entries.push_back(e);
  }
  return entries;
}

}  // namespace refit
