// Safetensors files and Hugging Face checkpoint directories.
//
// Format (https://huggingface.co/docs/safetensors): an 8-byte little-endian u64 N, N bytes of
// JSON header (may be padded with trailing spaces), then the data section. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets into the data
// section) and may hold "__metadata__": {string: string}.
//
// refit reads F32, BF16, F16 and F8_E4M3 tensors. A file holding any other dtype (I64, F64,
// BOOL, ...) is rejected at open with a message naming the tensor and the dtype.
//
// SafetensorsFile maps the file read-only (mmap) and validates the whole header at open: every
// later access is in bounds without further checks. The mapping lives as long as the object;
// pointers from data() and TensorRefs die with it. The file must not be truncated while open
// (reading a page past the new end raises SIGBUS); replace it by rename, as write_safetensors does.
// A SafetensorsFile / Checkpoint is immutable after open and safe for concurrent reads from many
// threads. Copies are deleted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

// One tensor entry of a safetensors header.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;  // row-major; empty for a 0-d tensor (one element)
  std::uint64_t begin = 0;          // byte offsets into the data section
  std::uint64_t end = 0;

  std::int64_t numel() const;
  std::uint64_t nbytes() const { return end - begin; }
};

// "[64, 32]" — the spelling used in every shape message.
std::string shape_string(const std::vector<std::int64_t>& shape);

class SafetensorsFile {
 public:
  // Maps and validates `path`. Errors (IOError, Corruption, Unsupported) name the file and,
  // where one is involved, the tensor.
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  // Validates a header (the JSON after the length prefix) against `data_size` bytes of data, as
  // open() does, without a file (the fuzz tests); `name` stands for the path in errors.
  static Status check_header(std::string_view header, std::uint64_t data_size,
                             const std::string& name);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Tensors in data order (ascending begin offset, then name).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The tensor named `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  // First byte of the tensor's data. No alignment is guaranteed (files written by refit align
  // the data section to 8 bytes; other writers may not): read it with memcpy or convert().
  const std::byte* data(const TensorInfo& info) const { return data_ + info.begin; }
  // The "__metadata__" map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Bytes of the whole file.
  std::size_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  Status parse_header(std::string_view header, std::uint64_t data_size);

  std::string path_;
  void* map_ = nullptr;
  std::size_t size_ = 0;
  int guard_ = -1;  // io/mapped_files.h: a truncated file is an error naming it, not SIGBUS
  const std::byte* data_ = nullptr;  // start of the data section inside the mapping
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, std::size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: `data` points to numel(shape) * dtype_size(dtype) bytes (may be null when
// that is 0). The caller keeps it alive during the call.
struct TensorView {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file: tensors in the given order, the JSON header padded with spaces to
// a multiple of 8 bytes (so the data section is 8-byte aligned). Written to a temporary file in
// the same directory, then renamed over `path`: readers never see a half-written file (no fsync:
// durability across a power loss is not promised). Names must be unique, non-empty and not
// "__metadata__"; dims must be >= 0.
Status write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// A tensor of a checkpoint: the file holding it and its header entry. Valid while the
// Checkpoint lives.
struct TensorRef {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;

  const std::byte* data() const { return file->data(*info); }
  // Converts the whole tensor into `dst` (numel elements of `dst_dtype`).
  void read(void* dst, DType dst_dtype) const;
  // Converts elements [elem_begin, elem_begin + count) of the flat tensor into `dst`.
  void read_range(std::int64_t elem_begin, std::int64_t count, void* dst, DType dst_dtype) const;
};

// A Hugging Face model directory: a single `model.safetensors`, a sharded set described by
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {tensor: file}}), or any
// set of `*.safetensors` without an index. When an index exists only the files it names are
// opened (repositories often carry extra files such as consolidated.safetensors).
class Checkpoint {
 public:
  // Opens every safetensors file of `dir`. A directory without any is not an error: empty().
  // NotFound if `dir` is not a directory; file errors as in SafetensorsFile::open; Corruption
  // when the index is invalid, names a missing file or a tensor its file lacks, or when two
  // files (without an index) hold the same tensor.
  static Result<std::unique_ptr<Checkpoint>> open(const std::string& dir);

  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  bool empty() const { return files_.empty(); }
  const std::string& dir() const { return dir_; }
  // The opened files, sorted by path.
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Every tensor name, sorted.
  std::vector<std::string> tensor_names() const;
  std::size_t num_tensors() const { return tensors_.size(); }

  // NotFound naming the tensor and the directory.
  Result<TensorRef> find(const std::string& name) const;

  // Every tensor of `spec` is present with the spec's shape; tensors the spec does not list
  // (e.g. lm_head.weight of a tied-embedding model) are ignored. Reports every mismatch (the
  // first few in full), e.g. "model-00002-of-00002.safetensors: tensor
  // model.layers.3.mlp.up_proj.weight has shape [64, 32], the model config says [96, 64]".
  // Code: NotFound if only tensors are missing, else InvalidArgument.
  Status check_against_spec(const ModelSpec& spec) const;

 private:
  Checkpoint() = default;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, TensorRef> tensors_;
};

// Writes `tensors` as a checkpoint directory (created if needed): one `model.safetensors` when
// num_shards == 1, else `model-0000i-of-0000n.safetensors` files (tensors kept in order, split
// into contiguous runs of roughly equal bytes) plus `model.safetensors.index.json` with
// metadata.total_size. For tests and tools.
Status write_checkpoint(const std::string& dir, const std::vector<TensorView>& tensors,
                        int num_shards = 1);

}  // namespace refit
