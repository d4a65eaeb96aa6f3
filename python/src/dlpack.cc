#include "dlpack.h"

#include <sstream>
#include <utility>

namespace refit::python {
namespace {

// A new reference, released on scope exit.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

std::string join_dims(const std::int64_t* v, std::int32_t n) {
  std::ostringstream out;
  out << '[';
  for (std::int32_t i = 0; i < n; ++i) out << (i ? ", " : "") << v[i];
  out << ']';
  return out.str();
}

// Calls obj.__dlpack__(max_version=(1, 0)); producers that predate versioned capsules (NumPy < 2)
// reject the keyword with TypeError, and are asked again without it.
PyObject* call_dlpack(PyObject* obj) {
  Ref method(PyObject_GetAttrString(obj, "__dlpack__"));
  if (!method) return nullptr;
  Ref args(PyTuple_New(0));
  Ref kwargs(Py_BuildValue("{s:(ii)}", "max_version", 1, 0));
  if (!args || !kwargs) return nullptr;
  PyObject* capsule = PyObject_Call(method.get(), args.get(), kwargs.get());
  if (capsule != nullptr || !PyErr_ExceptionMatches(PyExc_TypeError)) return capsule;
  PyErr_Clear();
  return PyObject_CallNoArgs(method.get());
}

}  // namespace

std::string take_python_error() {
  if (!PyErr_Occurred()) return {};
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  std::string text = type ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "error";
  if (value != nullptr) {
    Ref s(PyObject_Str(value));
    if (s) {
      if (const char* c = PyUnicode_AsUTF8(s.get())) {
        if (*c) text += std::string(": ") + c;
      } else {
        PyErr_Clear();
      }
    } else {
      PyErr_Clear();
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

std::string TensorDevice::name() const {
  switch (type) {
    case dlpack::kCpu:
      return "cpu";
    case dlpack::kCudaHost:
      return "cuda_host";
    case dlpack::kCuda:
      return "cuda:" + std::to_string(id);
    case dlpack::kCudaManaged:
      return "cuda_managed:" + std::to_string(id);
    case dlpack::kRocm:
      return "rocm:" + std::to_string(id);
    case dlpack::kRocmHost:
      return "rocm_host";
    default:
      return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
  }
}

std::string dlpack_dtype_name(const dlpack::DataType& dt) {
  std::string base;
  switch (dt.code) {
    case dlpack::kInt:
      base = "int";
      break;
    case dlpack::kUInt:
      base = "uint";
      break;
    case dlpack::kFloat:
      base = "float";
      break;
    case dlpack::kBfloat:
      base = "bfloat";
      break;
    case dlpack::kComplex:
      base = "complex";
      break;
    case dlpack::kBool:
      return "bool";
    case dlpack::kFloat8E4M3Fn:
      return "float8_e4m3fn";
    default:
      return "DLPack type code " + std::to_string(dt.code) + " (" + std::to_string(dt.bits) +
             " bits)";
  }
  std::string name = base + std::to_string(dt.bits);
  if (dt.lanes != 1) name += "x" + std::to_string(dt.lanes);
  return name;
}

bool dtype_matches(const dlpack::DataType& dt, DType expected) {
  if (dt.lanes != 1) return false;
  const unsigned bits = static_cast<unsigned>(dtype_size(expected) * 8);
  if (dt.bits != bits) return false;
  switch (expected) {
    case DType::kFloat32:
      return dt.code == dlpack::kFloat;
    case DType::kBFloat16:
      return dt.code == dlpack::kBfloat || dt.code == dlpack::kUInt;
    case DType::kFloat16:
      return dt.code == dlpack::kFloat || dt.code == dlpack::kUInt;
    case DType::kFloat8E4M3:
      return dt.code == dlpack::kFloat8E4M3Fn || dt.code == dlpack::kUInt;
  }
  return false;
}

ExportedTensor::~ExportedTensor() { release(); }

ExportedTensor::ExportedTensor(ExportedTensor&& other) noexcept
    : legacy_(std::exchange(other.legacy_, nullptr)),
      versioned_(std::exchange(other.versioned_, nullptr)),
      read_only_(other.read_only_) {}

ExportedTensor& ExportedTensor::operator=(ExportedTensor&& other) noexcept {
  if (this != &other) {
    release();
    legacy_ = std::exchange(other.legacy_, nullptr);
    versioned_ = std::exchange(other.versioned_, nullptr);
    read_only_ = other.read_only_;
  }
  return *this;
}

void ExportedTensor::release() {
  if (legacy_ == nullptr && versioned_ == nullptr) return;
  // The producer's deleter drops Python references: it needs the GIL, and an interpreter.
  if (Py_IsInitialized()) {
    PyGILState_STATE gil = PyGILState_Ensure();
    if (legacy_ != nullptr && legacy_->deleter != nullptr) legacy_->deleter(legacy_);
    if (versioned_ != nullptr && versioned_->deleter != nullptr) versioned_->deleter(versioned_);
    PyGILState_Release(gil);
  }
  legacy_ = nullptr;
  versioned_ = nullptr;
}

const dlpack::Tensor* ExportedTensor::tensor() const {
  if (versioned_ != nullptr) return &versioned_->dl_tensor;
  if (legacy_ != nullptr) return &legacy_->dl_tensor;
  return nullptr;
}

void* ExportedTensor::data() const {
  const dlpack::Tensor* t = tensor();
  if (t == nullptr || t->data == nullptr) return nullptr;
  return static_cast<char*>(t->data) + t->byte_offset;
}

std::vector<std::int64_t> ExportedTensor::shape() const {
  const dlpack::Tensor* t = tensor();
  if (t == nullptr) return {};
  return std::vector<std::int64_t>(t->shape, t->shape + t->ndim);
}

bool ExportedTensor::contiguous() const {
  const dlpack::Tensor* t = tensor();
  if (t == nullptr || t->strides == nullptr) return true;
  std::int64_t expected = 1;
  for (std::int32_t i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] == 0) return true;  // no elements: nothing to address
    if (t->shape[i] != 1 && t->strides[i] != expected) return false;
    expected *= t->shape[i];
  }
  return true;
}

std::string ExportedTensor::strides_text() const {
  const dlpack::Tensor* t = tensor();
  if (t == nullptr || t->strides == nullptr) return "row-major";
  return join_dims(t->strides, t->ndim);
}

Result<TensorDevice> ExportedTensor::device_of(PyObject* obj, const std::string& what) {
  TensorDevice dev;
  if (PyCapsule_CheckExact(obj)) {
    // A bare capsule: its DLTensor says where it is (read without consuming it; one that is not
    // a tensor capsule is refused by from_object, naming what it is).
    const dlpack::Tensor* t = nullptr;
    if (PyCapsule_IsValid(obj, "dltensor_versioned")) {
      auto* m = static_cast<dlpack::ManagedTensorVersioned*>(
          PyCapsule_GetPointer(obj, "dltensor_versioned"));
      if (m != nullptr && m->version.major == 1) t = &m->dl_tensor;
    } else if (PyCapsule_IsValid(obj, "dltensor")) {
      auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(obj, "dltensor"));
      if (m != nullptr) t = &m->dl_tensor;
    }
    take_python_error();
    if (t != nullptr) dev = TensorDevice{t->device.device_type, t->device.device_id};
    return dev;
  }
  if (!PyObject_HasAttrString(obj, "__dlpack_device__")) return dev;
  Ref result(PyObject_CallMethod(obj, "__dlpack_device__", nullptr));
  if (!result)
    return Status::InvalidArgument(what + ": __dlpack_device__() failed: " + take_python_error());
  int type = 0, id = 0;
  if (!PyArg_ParseTuple(result.get(), "ii", &type, &id)) {
    take_python_error();
    return Status::InvalidArgument(what +
                                   ": __dlpack_device__() did not return (device_type, device_id)");
  }
  dev.type = type;
  dev.id = id;
  return dev;
}

Result<ExportedTensor> ExportedTensor::from_object(PyObject* obj, const std::string& what) {
  PyObject* c = nullptr;
  if (PyCapsule_CheckExact(obj)) {
    Py_INCREF(obj);
    c = obj;
  } else {
    if (!PyObject_HasAttrString(obj, "__dlpack__"))
      return Status::InvalidArgument(
          what + ": a " + Py_TYPE(obj)->tp_name +
          " is not a tensor: pass an object with __dlpack__ (a NumPy array, a torch tensor)");
    c = call_dlpack(obj);
    if (c == nullptr)
      return Status::InvalidArgument(what + ": __dlpack__() failed: " + take_python_error());
  }
  const Ref capsule(c);
  ExportedTensor out;
  if (PyCapsule_IsValid(capsule.get(), "dltensor_versioned")) {
    auto* m = static_cast<dlpack::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule.get(), "dltensor_versioned"));
    if (m == nullptr || m->version.major != 1) {
      take_python_error();
      return Status::InvalidArgument(what + ": DLPack capsule of major version " +
                                     std::to_string(m ? m->version.major : 0) +
                                     " (refit reads version 1 capsules)");
    }
    // Consumed: from here on the capsule's own destructor leaves the tensor to us.
    if (PyCapsule_SetName(capsule.get(), "used_dltensor_versioned") != 0)
      return Status::Internal(what + ": cannot consume the DLPack capsule: " + take_python_error());
    out.versioned_ = m;
    out.read_only_ = (m->flags & dlpack::kFlagReadOnly) != 0;
  } else if (PyCapsule_IsValid(capsule.get(), "dltensor")) {
    auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.get(), "dltensor"));
    if (m == nullptr) {
      return Status::InvalidArgument(what + ": empty DLPack capsule: " + take_python_error());
    }
    if (PyCapsule_SetName(capsule.get(), "used_dltensor") != 0)
      return Status::Internal(what + ": cannot consume the DLPack capsule: " + take_python_error());
    out.legacy_ = m;
  } else {
    const char* name =
        PyCapsule_CheckExact(capsule.get()) ? PyCapsule_GetName(capsule.get()) : nullptr;
    take_python_error();
    return Status::InvalidArgument(
        what + ": __dlpack__() returned " +
        (name ? std::string("a capsule named \"") + name + "\"" : std::string("no capsule")) +
        "; expected an unconsumed \"dltensor\" or \"dltensor_versioned\" capsule");
  }
  return out;
}

}  // namespace refit::python
