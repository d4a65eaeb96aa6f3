#include "executor/bucket_meta.h"

#include <algorithm>

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
                                                    DType dtype, int bucket,
                                                    std::int64_t buffer_bytes) {
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
  const auto& shapes = j["shapes"];
  const auto& offsets = j["offsets"];
  const auto& ranges = j["elem_ranges"];
  if (!names.is_array() || !shapes.is_array() || !offsets.is_array() || !ranges.is_array() ||
      shapes.size() != names.size() || offsets.size() != names.size() ||
      ranges.size() != names.size())
    return bad("names, shapes, offsets and elem_ranges must be arrays of one length");
  auto is_int = [](const nlohmann::json& v) { return v.is_number_integer(); };
  std::vector<BucketEntry> entries;
  entries.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!names[i].is_string()) return bad(fmt::format("names[{}] is not a string", i));
    const std::string name = names[i].get<std::string>();
    auto idx = spec.find(name);
    if (!idx) return bad(fmt::format("tensor {} is not a parameter of this engine's model", name));
    const TensorSpec& t = spec.tensors()[*idx];
    const auto& shape = shapes[i];
    if (!shape.is_array() || !std::all_of(shape.begin(), shape.end(), is_int) ||
        shape.get<std::vector<std::int64_t>>() != t.shape)
      return bad(fmt::format("tensor {} has shape {} but the engine's model says {}", name,
                             shape.dump(), nlohmann::json(t.shape).dump()));
    const auto& range = ranges[i];
    if (!is_int(offsets[i]) || !range.is_array() || range.size() != 2 || !is_int(range[0]) ||
        !is_int(range[1]))
      return bad(fmt::format("tensor {}: offset {} and element range {} must be integers", name,
                             offsets[i].dump(), range.dump()));
    BucketEntry e;
    e.tensor = static_cast<std::uint32_t>(*idx);
    e.offset = offsets[i].get<std::int64_t>();
    e.elem_begin = range[0].get<std::int64_t>();
    e.elem_count = range[1].get<std::int64_t>();
    if (e.offset < 0 || e.elem_begin < 0 || e.elem_count < 0 || e.elem_begin > t.numel() ||
        e.elem_count > t.numel() - e.elem_begin)
      return bad(fmt::format("tensor {} element range [{}, +{}) at offset {} outside its {} "
                             "elements",
                             name, e.elem_begin, e.elem_count, e.offset, t.numel()));
    const auto esize = static_cast<std::int64_t>(dtype_size(dtype));
    if (e.offset > buffer_bytes || e.elem_count > (buffer_bytes - e.offset) / esize)
      return bad(fmt::format("tensor {}: {} elements at byte offset {} run past the {}-byte buffer",
                             name, e.elem_count, e.offset, buffer_bytes));
    entries.push_back(e);
  }
  return entries;
}

}  // namespace refit
