// The consumer side of DLPack (https://dmlc.github.io/dlpack/latest/): the C ABI written out from
// the specification, and the Python exchange protocol (`__dlpack_device__`, `__dlpack__` and its
// capsules, plain "dltensor" and versioned "dltensor_versioned").
//
// An ExportedTensor owns one consumed capsule's managed tensor and calls its deleter when it is
// destroyed, so the producer's storage (a NumPy array, a torch tensor) stays alive exactly as long
// as refit holds it. Construction and destruction need the GIL (the deleter of a NumPy or torch
// export releases Python references); the view it exposes may be read without it.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"

namespace refit::python {

namespace dlpack {

// DLDeviceType: the values refit tells apart (the rest are "another device").
enum DeviceType : std::int32_t {
  kCpu = 1,
  kCuda = 2,
  kCudaHost = 3,  // page-locked host memory: host memory as far as refit is concerned
  kRocm = 10,
  kRocmHost = 11,
  kCudaManaged = 13,
};

// DLDataTypeCode.
enum TypeCode : std::uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kOpaqueHandle = 3,
  kBfloat = 4,
  kComplex = 5,
  kBool = 6,
  kFloat8E4M3Fn = 10,
};

struct Device {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null means compact row-major (DLPack < 1.2)
  std::uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

struct PackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

inline constexpr std::uint64_t kFlagReadOnly = 1ull << 0;

struct ManagedTensorVersioned {
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;
  Tensor dl_tensor;
};

}  // namespace dlpack

// Where a tensor lives, as `__dlpack_device__` reports it.
struct TensorDevice {
  std::int32_t type = dlpack::kCpu;
  std::int32_t id = 0;
  bool host() const { return type == dlpack::kCpu || type == dlpack::kCudaHost; }
  std::string name() const;  // "cpu", "cuda:1", "device type 7:0"
};

// "float32", "uint16", "bfloat16", "float8_e4m3fn", ... of a DLPack dtype.
std::string dlpack_dtype_name(const dlpack::DataType& dt);

// The refit dtype a DLPack dtype stands for when `expected` is wanted: the matching type itself,
// or, for 16- and 8-bit refit types, unsigned integers of the same width holding the bit patterns
// (NumPy has no bfloat16: a uint16 array holds bf16 bits). False otherwise.
bool dtype_matches(const dlpack::DataType& dt, DType expected);

class ExportedTensor {
 public:
  ExportedTensor() = default;
  ~ExportedTensor();
  ExportedTensor(ExportedTensor&& other) noexcept;
  ExportedTensor& operator=(ExportedTensor&& other) noexcept;
  ExportedTensor(const ExportedTensor&) = delete;
  ExportedTensor& operator=(const ExportedTensor&) = delete;

  const dlpack::Tensor* tensor() const;
  bool read_only() const { return read_only_; }
  // First byte of the tensor (data + byte_offset).
  void* data() const;
  std::vector<std::int64_t> shape() const;
  // Row-major contiguous (size-1 dimensions may carry any stride).
  bool contiguous() const;
  std::string strides_text() const;

  // Exports `obj` through `__dlpack__` (asking for a versioned capsule first) and consumes the
  // capsule; `obj` may also be a capsule itself. Errors (a Python exception from the producer
  // included, which is cleared) name `what`.
  static Result<ExportedTensor> from_object(PyObject* obj, const std::string& what);
  // `__dlpack_device__` of `obj`, or an error naming `what`; CPU when the object has none.
  static Result<TensorDevice> device_of(PyObject* obj, const std::string& what);

 private:
  void release();
  dlpack::ManagedTensor* legacy_ = nullptr;
  dlpack::ManagedTensorVersioned* versioned_ = nullptr;
  bool read_only_ = false;
};

// The pending Python exception as "TypeName: message", cleared; "" when none is set.
std::string take_python_error();

}  // namespace refit::python
