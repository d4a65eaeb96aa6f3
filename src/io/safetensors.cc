#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/convert.h"
#include "common/file_io.h"
#include "io/mapped_files.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kIndexName = "model.safetensors.index.json";
constexpr std::string_view kSupportedDtypes = "F32, BF16, F16, F8_E4M3";

std::string errno_text(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

// Owns a file descriptor.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes and reports the close error (which can carry a delayed write error).
  int close_checked() {
    int rc = fd_ >= 0 ? ::close(fd_) : 0;
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

std::optional<DType> parse_safetensors_dtype(std::string_view s) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    if (s == dtype_safetensors_name(d)) return d;
  }
  return std::nullopt;
}

// numel of `shape`, or -1 when it exceeds what any file could hold.
std::int64_t checked_numel(const std::vector<std::int64_t>& shape) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 60;
  std::int64_t n = 1;
  for (auto d : shape) {
    if (d < 0) return -1;
    if (d == 0) n = 0;
  }
  if (n == 0) return 0;
  for (auto d : shape) {
    if (n > kLimit / d) return -1;
    n *= d;
  }
  return n;
}

// A file written under a temporary name and renamed over its final path on commit(); removed
// if never committed.
class AtomicFile {
 public:
  AtomicFile() = default;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (!tmp_.empty()) {
      fd_.reset();
      ::unlink(tmp_.c_str());
    }
  }

  Status open(const std::string& path) {
    path_ = path;
    std::string templ = path + ".tmp-XXXXXX";
    int fd = ::mkostemp(templ.data(), O_CLOEXEC);
    if (fd < 0) {
      return Status::IOError(
          fmt::format("cannot create a temporary file next to {}: {}", path, errno_text(errno)));
    }
    fd_.reset(fd);
    tmp_ = templ;
    if (::fchmod(fd, 0644) != 0) {
      return Status::IOError(fmt::format("fchmod {}: {}", tmp_, errno_text(errno)));
    }
    return Status::Ok();
  }

  Status write(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_.get(), p, std::min<std::size_t>(n, std::size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        return Status::IOError(fmt::format("write {}: {}", tmp_, errno_text(errno)));
      }
      p += w;
      n -= static_cast<std::size_t>(w);
    }
    return Status::Ok();
  }

  Status commit() {
    if (fd_.close_checked() != 0) {
      return Status::IOError(fmt::format("close {}: {}", tmp_, errno_text(errno)));
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      return Status::IOError(fmt::format("rename {} to {}: {}", tmp_, path_, errno_text(errno)));
    }
    tmp_.clear();
    return Status::Ok();
  }

 private:
  std::string path_;
  std::string tmp_;
  Fd fd_;
};

// A checkpoint index is a few MiB at most (one line per tensor).
Result<std::string> read_text_file(const std::string& path) {
  return read_regular_file(path, "checkpoint index", std::size_t{256} << 20);
}

// Parses JSON text. Top-level duplicate keys are an error (nlohmann would silently keep the
// last), reported through `duplicate`.
Result<json> parse_json(std::string_view text, const std::string& what) {
  std::set<std::string> keys;
  std::string duplicate;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      if (!keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    return Status::Corruption(fmt::format("{}: invalid JSON: {}", what, e.what()));
  }
  if (!duplicate.empty()) {
    return Status::Corruption(fmt::format("{}: key \"{}\" appears twice", what, duplicate));
  }
  return j;
}

}  // namespace

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::~SafetensorsFile() {
  unregister_mapped_file(guard_);
  if (map_ != nullptr) ::munmap(map_, size_);
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  // Never blocks: a FIFO (or any non-regular file) is refused before it could be read.
  REFIT_ASSIGN_OR_RETURN(const int raw_fd, open_regular_file(path, "safetensors file"));
  Fd fd(raw_fd);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return Status::IOError(fmt::format("fstat {}: {}", path, errno_text(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status::IOError(fmt::format("{}: not a regular file", path));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < 8) {
    return Status::Corruption(fmt::format(
        "{}: file is {} bytes, shorter than the 8-byte header length of a safetensors file", path,
        size));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) {
    return Status::IOError(fmt::format("mmap {} ({} bytes): {}", path, size, errno_text(errno)));
  }
  file->map_ = map;
  file->size_ = size;
  file->guard_ = register_mapped_file(map, size, path);
  const auto* bytes = static_cast<const unsigned char*>(map);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8) {
    return Status::Corruption(
        fmt::format("{}: header length {} exceeds the file ({} bytes, {} after the length prefix)",
                    path, header_len, size, size - 8));
  }
  file->data_ = static_cast<const std::byte*>(map) + 8 + header_len;
  std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_len);
  REFIT_RETURN_IF_ERROR(file->parse_header(header, size - 8 - header_len));
  return file;
}

Status SafetensorsFile::check_header(std::string_view header, std::uint64_t data_size,
                                     const std::string& name) {
  SafetensorsFile file;
  file.path_ = name;
  return file.parse_header(header, data_size);
}

Status SafetensorsFile::parse_header(std::string_view header, std::uint64_t data_size) {
  REFIT_ASSIGN_OR_RETURN(json j, parse_json(header, path_ + ": header"));
  if (!j.is_object()) {
    return Status::Corruption(
        fmt::format("{}: header is JSON {}, expected an object", path_, j.type_name()));
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == kMetadataKey) {
      if (!v.is_object()) {
        return Status::Corruption(
            fmt::format("{}: __metadata__ is JSON {}, expected an object", path_, v.type_name()));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Status::Corruption(
              fmt::format("{}: __metadata__ value of \"{}\" is JSON {}, expected a string", path_,
                          m.key(), m.value().type_name()));
        }
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return Status::Corruption(fmt::format("{}: tensor {}: {}", path_, name, what));
    };
    if (!v.is_object())
      return bad(fmt::format("header entry is JSON {}, expected an object", v.type_name()));
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!v.contains(field)) return bad(fmt::format("header entry has no \"{}\"", field));
    }
    TensorInfo info;
    info.name = name;
    const json& dt = v["dtype"];
    if (!dt.is_string())
      return bad(fmt::format("dtype is JSON {}, expected a string", dt.type_name()));
    auto dtype = parse_safetensors_dtype(dt.get<std::string>());
    if (!dtype) {
      return Status::Unsupported(fmt::format("{}: tensor {} has dtype {}; refit reads {}", path_,
                                             name, dt.get<std::string>(), kSupportedDtypes));
    }
    info.dtype = *dtype;
    const json& shape = v["shape"];
    if (!shape.is_array())
      return bad(fmt::format("shape is JSON {}, expected an array", shape.type_name()));
    for (const json& d : shape) {
      if (!d.is_number_unsigned() ||
          d.get<std::uint64_t>() >
              static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return bad(
            fmt::format("shape {} has an entry that is not a non-negative integer", shape.dump()));
      }
      info.shape.push_back(d.get<std::int64_t>());
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return bad(fmt::format("data_offsets {} is not a pair of non-negative integers", off.dump()));
    }
    info.begin = off[0].get<std::uint64_t>();
    info.end = off[1].get<std::uint64_t>();
    if (info.begin > info.end) {
      return bad(fmt::format("data_offsets [{}, {}] end before they begin", info.begin, info.end));
    }
    if (info.end > data_size) {
      return bad(fmt::format(
          "data_offsets [{}, {}] reach beyond the data section ({} bytes; file truncated?)",
          info.begin, info.end, data_size));
    }
    const std::int64_t numel = checked_numel(info.shape);
    if (numel < 0) return bad(fmt::format("shape {} is too large", shape_string(info.shape)));
    const std::uint64_t expected = static_cast<std::uint64_t>(numel) * dtype_size(info.dtype);
    if (info.end - info.begin != expected) {
      return bad(
          fmt::format("data_offsets [{}, {}] span {} bytes, but shape {} of {} needs {} bytes",
                      info.begin, info.end, info.end - info.begin, shape_string(info.shape),
                      dt.get<std::string>(), expected));
    }
    tensors_.push_back(std::move(info));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
  });
  // Byte ranges must be disjoint (empty tensors occupy nothing). Gaps are tolerated.
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors_) {
    if (t.nbytes() == 0) continue;
    if (prev != nullptr && t.begin < prev->end) {
      return Status::Corruption(
          fmt::format("{}: tensor {} (bytes [{}, {})) overlaps tensor {} (bytes [{}, {}))", path_,
                      t.name, t.begin, t.end, prev->name, prev->begin, prev->end));
    }
    prev = &t;
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  return Status::Ok();
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------
// Writer

Status write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header[std::string(kMetadataKey)] = std::move(m);
  }
  std::set<std::string_view> names;
  std::vector<std::uint64_t> sizes;
  std::uint64_t offset = 0;
  for (const TensorView& t : tensors) {
    auto bad = [&](const std::string& what) {
      return Status::InvalidArgument(
          fmt::format("writing {}: tensor \"{}\": {}", path, t.name, what));
    };
    if (t.name.empty()) return bad("empty name");
    if (t.name == kMetadataKey) return bad("the name is reserved for the metadata");
    if (!names.insert(t.name).second) return bad("name appears twice");
    const std::int64_t numel = checked_numel(t.shape);
    if (numel < 0) return bad(fmt::format("invalid shape {}", shape_string(t.shape)));
    const std::uint64_t nbytes = static_cast<std::uint64_t>(numel) * dtype_size(t.dtype);
    if (nbytes > 0 && t.data == nullptr) return bad("data is null");
    header[t.name] = {{"dtype", std::string(dtype_safetensors_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    sizes.push_back(nbytes);
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  AtomicFile out;
  REFIT_RETURN_IF_ERROR(out.open(path));
  REFIT_RETURN_IF_ERROR(out.write(len, 8));
  REFIT_RETURN_IF_ERROR(out.write(text.data(), text.size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (sizes[i] > 0) REFIT_RETURN_IF_ERROR(out.write(tensors[i].data, sizes[i]));
  }
  return out.commit();
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

void TensorRef::read(void* dst, DType dst_dtype) const {
  convert(data(), info->dtype, dst, dst_dtype, static_cast<std::size_t>(info->numel()));
}

void TensorRef::read_range(std::int64_t elem_begin, std::int64_t count, void* dst,
                           DType dst_dtype) const {
  assert(elem_begin >= 0 && count >= 0 && elem_begin + count <= info->numel());
  convert(data() + elem_begin * static_cast<std::int64_t>(dtype_size(info->dtype)), info->dtype,
          dst, dst_dtype, static_cast<std::size_t>(count));
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Status::NotFound(
        fmt::format("checkpoint directory {} does not exist or is not a directory", dir));
  }
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = dir;
  const fs::path root(dir);
  const fs::path index_path = root / kIndexName;

  if (fs::exists(index_path, ec)) {
    const std::string index_name = index_path.string();
    REFIT_ASSIGN_OR_RETURN(std::string text, read_text_file(index_name));
    REFIT_ASSIGN_OR_RETURN(json index, parse_json(text, index_name));
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return Status::Corruption(
          fmt::format("{}: expected an object with a \"weight_map\" object", index_name));
    }
    const json& weight_map = index["weight_map"];
    std::map<std::string, std::vector<std::string>> by_file;  // file -> tensors
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      if (!it.value().is_string()) {
        return Status::Corruption(
            fmt::format("{}: weight_map entry of tensor {} is JSON {}, "
                        "expected a file name",
                        index_name, it.key(), it.value().type_name()));
      }
      by_file[it.value().get<std::string>()].push_back(it.key());
    }
    for (const auto& [file_name, names] : by_file) {
      const std::string file_path = (root / file_name).string();
      if (!fs::exists(file_path, ec)) {
        return Status::Corruption(
            fmt::format("{}: weight_map names {} (tensor {}), which does "
                        "not exist",
                        index_name, file_path, names.front()));
      }
      REFIT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(file_path));
      for (const std::string& name : names) {
        const TensorInfo* info = file->find(name);
        if (info == nullptr) {
          return Status::Corruption(
              fmt::format("{}: weight_map puts tensor {} in {}, which has no such tensor",
                          index_name, name, file_path));
        }
        ckpt->tensors_.emplace(name, TensorRef{file.get(), info});
      }
      ckpt->files_.push_back(std::move(file));
    }
    return ckpt;
  }

  std::vector<std::string> paths;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->path().extension() != ".safetensors") continue;
    // Not skipped: a checkpoint that silently lost a file would load random weights instead.
    if (!it->is_regular_file(type_ec))
      return Status::InvalidArgument(fmt::format(
          "checkpoint directory {}: {} is not a regular file; refit reads only regular "
          "safetensors files",
          dir, it->path().string()));
    paths.push_back(it->path().string());
  }
  if (ec) {
    return Status::IOError(
        fmt::format("cannot list checkpoint directory {}: {}", dir, ec.message()));
  }
  std::sort(paths.begin(), paths.end());
  for (const std::string& p : paths) {
    REFIT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(p));
    for (const TensorInfo& info : file->tensors()) {
      auto [it, inserted] = ckpt->tensors_.emplace(info.name, TensorRef{file.get(), &info});
      if (!inserted) {
        return Status::Corruption(fmt::format(
            "checkpoint {}: tensor {} is in both {} and {} (and there is no {} to choose)", dir,
            info.name, it->second.file->path(), p, kIndexName));
      }
    }
    ckpt->files_.push_back(std::move(file));
  }
  return ckpt;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, ref] : tensors_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

Result<TensorRef> Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return Status::NotFound(fmt::format("checkpoint {} has no tensor {} ({} tensors in {} files)",
                                        dir_, name, tensors_.size(), files_.size()));
  }
  return it->second;
}

Status Checkpoint::check_against_spec(const ModelSpec& spec) const {
  constexpr std::size_t kShown = 5;
  std::vector<std::string> problems;
  bool any_mismatch = false;
  for (const TensorSpec& t : spec.tensors()) {
    auto it = tensors_.find(t.name);
    if (it == tensors_.end()) {
      problems.push_back(fmt::format("tensor {} is missing", t.name));
      continue;
    }
    const TensorInfo& info = *it->second.info;
    if (info.shape != t.shape) {
      any_mismatch = true;
      problems.push_back(fmt::format("{}: tensor {} has shape {}, the model config says {}",
                                     it->second.file->path(), t.name, shape_string(info.shape),
                                     shape_string(t.shape)));
    }
  }
  if (problems.empty()) return Status::Ok();
  std::string shown;
  for (std::size_t i = 0; i < std::min(problems.size(), kShown); ++i) {
    shown += (i == 0 ? "" : "; ") + problems[i];
  }
  if (problems.size() > kShown) shown += fmt::format("; and {} more", problems.size() - kShown);
  std::string msg =
      fmt::format("checkpoint {} does not match the model config{}: {} of {} tensors differ: {}",
                  dir_, spec.source().empty() ? "" : " of " + spec.source(), problems.size(),
                  spec.tensors().size(), shown);
  return any_mismatch ? Status::InvalidArgument(std::move(msg)) : Status::NotFound(std::move(msg));
}

Status write_checkpoint(const std::string& dir, const std::vector<TensorView>& tensors,
                        int num_shards) {
  if (num_shards < 1 || (num_shards > 1 && static_cast<std::size_t>(num_shards) > tensors.size())) {
    return Status::InvalidArgument(
        fmt::format("write_checkpoint {}: num_shards {} must be in [1, number of tensors = {}]",
                    dir, num_shards, tensors.size()));
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError(fmt::format("cannot create directory {}: {}", dir, ec.message()));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};  // transformers wants it
  if (num_shards == 1) {
    return write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, metadata);
  }
  std::vector<std::uint64_t> cum(tensors.size() + 1, 0);  // bytes of tensors [0, i)
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::int64_t numel = checked_numel(tensors[i].shape);
    if (numel < 0) {
      return Status::InvalidArgument(fmt::format("write_checkpoint {}: tensor {}: invalid shape {}",
                                                 dir, tensors[i].name,
                                                 shape_string(tensors[i].shape)));
    }
    cum[i + 1] = cum[i] + static_cast<std::uint64_t>(numel) * dtype_size(tensors[i].dtype);
  }
  const std::uint64_t total = cum.back();
  const auto n = static_cast<std::size_t>(num_shards);
  json weight_map = json::object();
  std::size_t idx = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t begin = idx;
    const std::uint64_t target = total * (k + 1) / n;
    ++idx;  // every shard holds at least one tensor
    const std::size_t limit = tensors.size() - (n - 1 - k);  // leave one for each later shard
    while (idx < limit && cum[idx] < target) ++idx;
    if (k == n - 1) idx = tensors.size();
    const std::string file_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
    std::vector<TensorView> shard(tensors.begin() + static_cast<std::ptrdiff_t>(begin),
                                  tensors.begin() + static_cast<std::ptrdiff_t>(idx));
    for (const TensorView& t : shard) {
      if (weight_map.contains(t.name)) {
        return Status::InvalidArgument(
            fmt::format("write_checkpoint {}: tensor \"{}\" appears twice", dir, t.name));
      }
      weight_map[t.name] = file_name;
    }
    REFIT_RETURN_IF_ERROR(write_safetensors((fs::path(dir) / file_name).string(), shard, metadata));
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  AtomicFile out;
  REFIT_RETURN_IF_ERROR(out.open((fs::path(dir) / kIndexName).string()));
  REFIT_RETURN_IF_ERROR(out.write(text.data(), text.size()));
  return out.commit();
}

}  // namespace refit
