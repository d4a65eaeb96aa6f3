// refit.Trainer and refit.Engine: refit::Trainer / refit::Engine (refit/session.h) over storage the
// caller registers through DLPack, zero-copy.
//
// Every blocking call (create, refit, serve_one, serve, shutdown) releases the GIL. A registered
// tensor is a consumed DLPack export plus a reference to the object it came from; both live until
// the object is closed, and the C++ rank is always destroyed before them. Hooks are plain Python
// callables kept by the wrapper; the C++ engine only holds lambdas that take the GIL to call them,
// so destroying it never touches Python objects.
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "binding.h"
#include "dlpack.h"
#include "errors.h"
#include "refit/session.h"

namespace py = pybind11;

namespace refit::python {
namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string default_version(const Config& c, int step) {
  switch (c.generation.backend) {
    case EngineProtocol::kSglang:
      return "step-" + std::to_string(step);
    case EngineProtocol::kVllm:
      return std::to_string(step);
  }
  return std::to_string(step);
}

py::list slot_list(const std::vector<TensorSlot>& slots) {
  py::object make = py::module_::import("refit._common").attr("TensorSlot");
  py::list out;
  for (const TensorSlot& s : slots)
    out.append(make(s.name, py::tuple(py::cast(s.shape)), std::string(dtype_name(s.dtype))));
  return out;
}

// Runs `f` without the GIL where this thread holds it and the interpreter is not shutting down:
// a rank dropped without close() may wait seconds as it goes (trainer rank 0 keeps its store up
// until its peers read a failure), and other Python threads run meanwhile. At shutdown the GIL is
// kept (another thread must not run then).
template <class F>
void without_gil(F&& f) {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (finalizing || !PyGILState_Check()) {
    f();
    return;
  }
  py::gil_scoped_release nogil;
  f();
}

// Raises the Python exception object `exc` (with the traceback it carries).
[[noreturn]] void reraise(const py::object& exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// The exception object of a caught error_already_set, traceback attached.
py::object exception_object(py::error_already_set& e) {
  py::object value = e.value();
  if (e.trace()) PyException_SetTraceback(value.ptr(), e.trace().ptr());
  return value;
}

std::string describe(py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  std::string text = py::str(e.value());
  return text.empty() ? type : type + ": " + text;
}

// Runs a registration; an error it raises is also kept where the peers read it (note_error), so
// that they name it should this process go before fixing it, then raised as it was.
template <typename Rank, typename Fn>
void noting_errors(Rank& rank, const std::string& who, Fn&& fn) {
  try {
    fn();
  } catch (py::error_already_set& e) {
    const Status st = status_from_exception(e.value(), who);
    {
      py::gil_scoped_release nogil;
      rank.note_error(st);
    }
    throw;
  }
}

// Ends the session of `rank` with `error` (a Python exception object) as its cause (Trainer::
// fail): every peer then names this rank and the error, not its silence.
template <typename Rank>
void fail_with(Rank& rank, const py::handle& error, const std::string& who) {
  const Status st = status_from_exception(error, who);
  py::gil_scoped_release nogil;
  (void)rank.fail(st);
}

// A Trainer or Engine is driven by one thread; a second concurrent call is refused.
class CallGuard {
 public:
  // `self` and `session_ok` attribute the exceptions the call raises (errors.h, ErrorScope).
  CallGuard(std::atomic<bool>& busy, const std::string& who, const char* call, RankId self,
            std::function<bool()> session_ok)
      : busy_(busy), scope_(self, std::move(session_ok)) {
    if (busy_.exchange(true))
      throw std::runtime_error(who + ": " + call +
                               "() called while another call on this object is running on "
                               "another thread; a refit Trainer/Engine is driven by one thread");
  }
  ~CallGuard() { busy_.store(false); }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  std::atomic<bool>& busy_;
  ErrorScope scope_;
};

// What the caller registered for one slot.
struct Registration {
  ExportedTensor tensor;
  py::object owner;  // the object passed to register(): its storage must stay put
};

// Registered storage of one rank: slot lookup, DLPack checks, and the registrations themselves.
class Registry {
 public:
  // `device_memory`: the rank runs with device: cuda, so its storage is GPU memory.
  void init(const std::vector<TensorSlot>& slots, bool device_memory) {
    slots_ = slots;
    device_memory_ = device_memory;
    regs_.clear();
    regs_.resize(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) index_[slots_[i].name] = i;
  }

  const std::vector<TensorSlot>& slots() const { return slots_; }

  // `writes`: the engine writes into the storage, so read-only exports are refused.
  template <typename RegisterFn>
  void add(const std::string& who, bool writes, const std::string& name, const py::object& obj,
           RegisterFn&& register_fn) {
    auto it = index_.find(name);
    if (it == index_.end()) {  // the library's message lists what to do
      raise_if_error(register_fn(name, nullptr, DType::kFloat32, {}));
      raise_status(Status::NotFound(who + ": no tensor named " + name));
    }
    const TensorSlot& slot = slots_[it->second];
    const std::string what = who + ": tensor " + name;
    auto dev = ExportedTensor::device_of(obj.ptr(), what);
    raise_if_error(dev.status());
    if (!placed_right(*dev)) raise_status(device_error(what, *dev));
    auto exported = ExportedTensor::from_object(obj.ptr(), what);
    raise_if_error(exported.status());
    const dlpack::Tensor* t = exported->tensor();
    const TensorDevice actual{t->device.device_type, t->device.device_id};
    if (!placed_right(actual)) raise_status(device_error(what, actual));
    const std::vector<std::int64_t> shape = exported->shape();
    if (!dtype_matches(t->dtype, slot.dtype)) {
      std::string allowed = std::string(dtype_name(slot.dtype));
      if (slot.dtype != DType::kFloat32)
        allowed += cat(" (or uint", dtype_size(slot.dtype) * 8, " holding its bit patterns)");
      raise_status(Status::InvalidArgument(cat(what, " registered as ", dlpack_dtype_name(t->dtype),
                                               " ", shape_text(shape), ", expected ", allowed, " ",
                                               shape_text(slot.shape))));
    }
    if (writes && exported->read_only())
      raise_status(Status::InvalidArgument(
          what +
          " is read-only; the engine writes its parameters in place: register writable "
          "storage"));
    if (!exported->contiguous())
      raise_status(Status::InvalidArgument(
          cat(what, " is not contiguous (shape ", shape_text(shape), ", strides ",
              exported->strides_text(),
              "); refit reads and writes row-major storage in place: register a contiguous "
              "tensor (a .contiguous() copy must then be the tensor you update)")));
    void* data = exported->data();
    const std::size_t esize = dtype_size(slot.dtype);
    if (data != nullptr && reinterpret_cast<std::uintptr_t>(data) % esize != 0)
      raise_status(
          Status::InvalidArgument(cat(what, " is not aligned to its ", esize, "-byte elements")));
    raise_if_error(register_fn(name, data, slot.dtype, shape));
    regs_[it->second] = Registration{std::move(exported).value(), obj};
  }

  std::vector<std::string> unregistered() const {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (!regs_[i].owner && slots_[i].numel() > 0) out.push_back(slots_[i].name);
    return out;
  }

  py::object registered(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end() || !regs_[it->second].owner) return py::none();
    return regs_[it->second].owner;
  }

  void clear() { regs_.clear(); }

 private:
  bool placed_right(const TensorDevice& dev) const {
    return device_memory_ ? dev.type == dlpack::kCuda : dev.host();
  }
  Status device_error(const std::string& what, const TensorDevice& dev) const {
    if (device_memory_)
      return Status::InvalidArgument(what + " is on " + dev.name() +
                                     "; with device: cuda refit reads and writes GPU memory in "
                                     "place: register a CUDA tensor on this rank's GPU");
    return Status::Unsupported(
        what + " is on " + dev.name() +
        "; with device: cpu refit registers host memory: register a host tensor (e.g. t.cpu(), "
        "pinned) and copy into it before each refit — refit.torch does this for you — or run "
        "with device: cuda");
  }

  std::vector<TensorSlot> slots_;
  std::unordered_map<std::string, std::size_t> index_;
  std::vector<Registration> regs_;
  bool device_memory_ = false;
};

// A refit's RefitStats as the `last_stats` dict of Trainer and Engine.
py::dict stats_dict(const RefitStats& s) {
  py::dict d;
  d["seconds"] = s.seconds;
  d["unshard_s"] = s.unshard_s;
  d["cast_pack_s"] = s.cast_pack_s;
  d["transfer_s"] = s.transfer_s;
  d["apply_s"] = s.apply_s;
  d["pause_s"] = s.pause_s;
  d["bytes"] = s.bytes;
  d["buckets"] = s.buckets;
  d["checksums_matched"] = s.checksums_matched;
  d["gbps"] = s.seconds > 0 ? static_cast<double>(s.bytes) / s.seconds / 1e9 : 0.0;
  return d;
}

class PyTrainer {
 public:
  PyTrainer(const PyConfig& cfg, int rank, const std::string& master_addr, int master_port,
            const std::string& host)
      : config_(cfg.config), rank_(rank), self_(RankId::trainer(rank)), who_(self_.name()) {
    const Endpoint ep{master_addr, master_port, host};
    const ErrorScope scope(self_, [] { return false; });
    Status st;
    {
      py::gil_scoped_release nogil;
      auto created = Trainer::create(config_, rank, ep);
      if (created.ok())
        trainer_ = std::move(created).value();
      else
        st = created.status();
    }
    raise_if_error(st);
    registry_.init(trainer_->tensors(), config_.device == Device::kCuda);
  }

  ~PyTrainer() {
    without_gil([this] { trainer_.reset(); });  // before the storage it reads
    registry_.clear();
  }

  Trainer& open(const char* call) {
    if (!trainer_) throw std::runtime_error(who_ + ": " + call + "() after close()");
    return *trainer_;
  }

  py::list tensors() const { return slot_list(registry_.slots()); }

  void register_tensor(const std::string& name, const py::object& tensor) {
    CallGuard guard(busy_, who_, "register", self_, [this] { return session_ok(); });
    Trainer& t = open("register");
    noting_errors(t, who_, [&] {
      registry_.add(
          who_, /*writes=*/false, name, tensor,
          [&](const std::string& n, void* data, DType dt, const std::vector<std::int64_t>& s) {
            return t.register_tensor(n, data, dt, s);
          });
    });
  }

  void refit(int step, const std::optional<std::string>& version, bool verify) {
    CallGuard guard(busy_, who_, "refit", self_, [this] { return session_ok(); });
    Trainer& t = open("refit");
    const std::string v = version ? *version : default_version(config_, step);
    Status st;
    {
      py::gil_scoped_release nogil;
      st = t.refit(step, v, verify);
    }
    raise_if_error(st);
  }

  py::dict last_stats() { return stats_dict(open("last_stats").last_stats()); }

  py::list traffic() {
    CallGuard guard(busy_, who_, "traffic", self_, [this] { return session_ok(); });
    Trainer& t = open("traffic");
    Result<std::vector<RankTraffic>> r = std::vector<RankTraffic>{};
    {
      py::gil_scoped_release nogil;
      r = t.traffic();
    }
    raise_if_error(r.status());
    py::list out;
    for (const RankTraffic& x : *r) {
      py::dict d;
      d["role"] = x.role;
      d["rank"] = x.rank;
      d["bytes_sent"] = x.bytes_sent;
      d["bytes_received"] = x.bytes_received;
      d["peer_pairs"] = x.peer_pairs;
      d["p2p_pairs"] = x.p2p_pairs;
      d["setup_seconds"] = x.setup_seconds;
      d["plan_bytes"] = x.plan_bytes;
      d["delta_pairs"] = x.delta_pairs;
      d["delta_elements"] = x.delta_elements;
      d["delta_changed"] = x.delta_changed;
      d["full_bytes"] = x.full_bytes;
      d["encode_s"] = x.encode_s;
      d["delta_apply_s"] = x.delta_apply_s;
      out.append(std::move(d));
    }
    return out;
  }

  void shutdown() {
    CallGuard guard(busy_, who_, "shutdown", self_, [this] { return session_ok(); });
    Trainer& t = open("shutdown");
    Status st;
    {
      py::gil_scoped_release nogil;
      st = t.shutdown();
    }
    shut_down_ = true;
    raise_if_error(st);
  }

  // `error` (an exception, or None): recorded first as this rank's failure (Trainer::fail).
  void close(const py::object& error = py::none()) {
    CallGuard guard(busy_, who_, "close", self_, [this] { return session_ok(); });
    if (trainer_ && !error.is_none()) fail_with(*trainer_, error, who_);
    {
      py::gil_scoped_release nogil;  // the C++ trainer holds no Python objects
      trainer_.reset();
    }
    registry_.clear();
  }

  void exit(const py::object& exc) {
    // A clean exit tells the engines no refit follows. After an exception a collective shutdown
    // could only wait: the exception is recorded as this rank's failure instead, which every
    // peer's next wait reads (its session ends naming this rank and the exception).
    if (trainer_ && !shut_down_ && exc.is_none()) {
      try {
        shutdown();
      } catch (...) {
        close();
        throw;
      }
    }
    close(exc);
  }

  int rank() const { return rank_; }
  const Config& config() const { return config_; }
  bool closed() const { return !trainer_; }
  bool session_ok() const { return trainer_ && trainer_->session_ok(); }
  const std::string& who() const { return who_; }
  Registry& registry() { return registry_; }

 private:
  const Config config_;
  const int rank_;
  const RankId self_;
  const std::string who_;
  Registry registry_;
  std::unique_ptr<Trainer> trainer_;
  std::atomic<bool> busy_{false};
  bool shut_down_ = false;
};

class PyEngine {
 public:
  PyEngine(const PyConfig& cfg, int engine_rank, const std::string& master_addr, int master_port,
           const std::string& host)
      : config_(cfg.config),
        engine_rank_(engine_rank),
        self_(RankId::engine(engine_rank, std::max(1, cfg.config.generation.tp_size))),
        who_(self_.name()) {
    const Endpoint ep{master_addr, master_port, host};
    const ErrorScope scope(self_, [] { return false; });
    Status st;
    {
      py::gil_scoped_release nogil;
      auto created = Engine::create(config_, engine_rank, ep);
      if (created.ok())
        engine_ = std::move(created).value();
      else
        st = created.status();
    }
    raise_if_error(st);
    registry_.init(engine_->params(), config_.device == Device::kCuda);
    version_ = engine_->weight_version();
    published_ = engine_->published();
    // Runs on the serving thread right after the commit published the version: keep a copy other
    // threads may read, then the user's hook.
    engine_->on_resume([this] {
      {
        std::lock_guard lock(version_mu_);
        version_ = engine_->weight_version();
        valid_ = engine_->is_valid();
      }
      run_hook(resume_);
    });
  }

  ~PyEngine() {
    without_gil([this] { engine_.reset(); });
    registry_.clear();
  }

  Engine& open(const char* call) {
    if (!engine_) throw std::runtime_error(who_ + ": " + call + "() after close()");
    return *engine_;
  }

  py::list params() const { return slot_list(registry_.slots()); }

  void register_param(const std::string& name, const py::object& tensor) {
    CallGuard guard(busy_, who_, "register", self_, [this] { return session_ok(); });
    Engine& e = open("register");
    noting_errors(e, who_, [&] {
      registry_.add(
          who_, /*writes=*/true, name, tensor,
          [&](const std::string& n, void* data, DType dt, const std::vector<std::int64_t>& s) {
            return e.register_param(n, data, dt, s);
          });
    });
  }

  void set_pause(const py::object& fn) {
    CallGuard guard(busy_, who_, "on_pause", self_, [this] { return session_ok(); });
    Engine& e = open("on_pause");
    pause_ = fn;
    if (fn.is_none())
      e.on_pause(nullptr);
    else
      e.on_pause(std::function<Status()>([this] { return run_pause(); }));
  }

  void set_resume(const py::object& fn) {
    CallGuard guard(busy_, who_, "on_resume", self_, [this] { return session_ok(); });
    open("on_resume");
    resume_ = fn;  // called by the resume hook installed at construction
  }

  void set_verify(const py::object& fn) {
    CallGuard guard(busy_, who_, "on_verify", self_, [this] { return session_ok(); });
    Engine& e = open("on_verify");
    verify_ = fn;
    if (fn.is_none())
      e.on_verify(nullptr);
    else
      e.on_verify(
          [this](int step, const std::string& version) { return run_verify(step, version); });
  }

  void set_load_weights(const py::object& fn) {
    CallGuard guard(busy_, who_, "on_load_weights", self_, [this] { return session_ok(); });
    Engine& e = open("on_load_weights");
    load_ = fn;
    if (fn.is_none())
      e.on_load_weights(nullptr);
    else
      e.on_load_weights([this](const std::vector<ParamView>& batch) { return run_load(batch); });
  }

  void set_weights_changed(const py::object& fn) {
    CallGuard guard(busy_, who_, "on_weights_changed", self_, [this] { return session_ok(); });
    Engine& e = open("on_weights_changed");
    changed_ = fn;
    if (fn.is_none())
      e.on_weights_changed(nullptr);
    else
      e.on_weights_changed(
          [this](const std::vector<std::string>& names) { return run_changed(names); });
  }

  bool serve_one(std::optional<double> timeout) {
    CallGuard guard(busy_, who_, "serve_one", self_, [this] { return session_ok(); });
    if (timeout && !(*timeout >= 0))
      raise_status(Status::InvalidArgument(
          cat(who_, ": serve_one(timeout=", *timeout, "): the timeout is seconds, >= 0")));
    return serve_one_unguarded(open("serve_one"), timeout);
  }

  py::dict last_stats() { return stats_dict(open("last_stats").last_stats()); }

  int serve() {
    CallGuard guard(busy_, who_, "serve", self_, [this] { return session_ok(); });
    Engine& e = open("serve");
    int served = 0;
    while (true) {
      try {
        if (!serve_one_unguarded(e)) break;
        ++served;
      } catch (py::error_already_set&) {
        // A refit that failed at its end (checksum, verification) or was refused before any byte
        // moved (a pause hook) leaves the session usable:
        // the runtime logged it; serve the next one. Anything else ends serve().
        if (!refit_failed_) throw;
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // Ctrl-C between refits
    }
    return served;
  }

  // Any thread, without the call guard (Engine::request_stop is thread-safe); under stop_mu_,
  // which close() takes to let go of the engine.
  void request_stop() {
    std::lock_guard lock(stop_mu_);
    if (engine_) engine_->request_stop();
  }

  std::string weight_version() {
    std::lock_guard lock(version_mu_);
    return version_;
  }
  bool is_valid() {
    std::lock_guard lock(version_mu_);
    return valid_;
  }
  // Engine::published(), as of the last serve_one(); kept after close() so that the next
  // session's Engine can take it.
  std::map<std::string, int> published() {
    std::lock_guard lock(version_mu_);
    return published_;
  }
  // Engine::note_published, at construction (before any serve_one).
  void note_published(const std::map<std::string, int>& labels) {
    Engine& e = open("note_published");
    e.note_published(labels);
    std::lock_guard lock(version_mu_);
    published_ = e.published();
  }
  bool session_ok() { return engine_ && engine_->session_ok(); }

  // `error` (an exception, or None): recorded first as this rank's failure (Engine::fail).
  void close(const py::object& error = py::none()) {
    CallGuard guard(busy_, who_, "close", self_, [this] { return session_ok(); });
    if (engine_ && !error.is_none()) fail_with(*engine_, error, who_);
    std::unique_ptr<Engine> closing;
    {
      std::lock_guard lock(stop_mu_);
      closing = std::move(engine_);
    }
    {
      py::gil_scoped_release nogil;  // the C++ engine holds no Python objects
      closing.reset();
    }
    registry_.clear();
  }

  int engine_rank() const { return engine_rank_; }
  int tp_rank() const { return engine_rank_ % config_.generation.tp_size; }
  int engine_index() const { return engine_rank_ / config_.generation.tp_size; }
  const std::string& who() const { return who_; }
  Registry& registry() { return registry_; }

 private:
  bool serve_one_unguarded(Engine& e, std::optional<double> timeout = std::nullopt) {
    pending_ = py::object();
    refit_failed_ = false;
    Status st;
    bool committed = false;
    {
      py::gil_scoped_release nogil;
      auto r = timeout ? e.serve_one(std::chrono::milliseconds(
                             static_cast<std::int64_t>(std::min(*timeout, 1e9) * 1000.0)))
                       : e.serve_one();
      if (r.ok())
        committed = *r;
      else
        st = r.status();
    }
    {
      // The serving thread is the only writer: after a failure the weights may be torn, and
      // the copy other threads read must say so (empty version, not valid).
      std::lock_guard lock(version_mu_);
      version_ = e.weight_version();
      valid_ = e.is_valid();
      published_ = e.published();
    }
    py::object pending = std::move(pending_);
    pending_ = py::object();
    // A Ctrl-C or SystemExit raised in a hook goes on as it was raised: not as the __cause__ of a
    // refit.Error, and never taken by serve() for a refit that failed (the refit, aborted or
    // failed at its end, leaves the session usable as ever).
    if (pending && PyObject_IsInstance(pending.ptr(), PyExc_Exception) == 0) {
      refit_failed_ = false;
      reraise(pending);
    }
    refit_failed_ = !st.ok() && e.session_ok();
    if (!st.ok()) raise_status(st, pending);
    // A pause/resume hook failed: the refit itself committed (those hooks cannot fail it), but
    // the caller must hear of it.
    if (pending) reraise(pending);
    return committed;
  }

  // Hooks run on the serving thread, which released the GIL.
  void run_hook(const py::object& fn) {
    py::gil_scoped_acquire gil;
    if (!fn || fn.is_none()) return;
    try {
      fn();
    } catch (py::error_already_set& err) {
      if (!pending_) pending_ = exception_object(err);
    } catch (const std::exception& err) {
      if (!pending_)
        pending_ = py::reinterpret_steal<py::object>(
            PyObject_CallFunction(PyExc_RuntimeError, "s", err.what()));
    }
  }

  // The pause hook, as a Status: an exception aborts the refit before any parameter changes (the
  // exception itself is re-raised by serve_one() as the __cause__ of its refit.Error).
  Status run_pause() {
    run_hook(pause_);
    py::gil_scoped_acquire gil;
    if (!pending_) return Status::Ok();
    return Status::Aborted(
        cat("on_pause raised ", py::str(pending_.get_type().attr("__name__")).cast<std::string>(),
            ": ", py::str(pending_).cast<std::string>()));
  }

  Status run_verify(int step, const std::string& version) {
    py::gil_scoped_acquire gil;
    const std::string at = cat(" (step ", step, ", version ", version, ")");
    try {
      py::object r = verify_(step, version);
      if (r.is_none()) return Status::Ok();
      if (py::isinstance<py::bool_>(r))
        return r.cast<bool>()
                   ? Status::Ok()
                   : Status::Corruption(who_ + ": the verification hook returned False" + at);
      if (py::isinstance<py::str>(r)) {
        const auto text = r.cast<std::string>();
        return text.empty() ? Status::Ok() : Status::Corruption(who_ + ": " + text + at);
      }
      return Status::InvalidArgument(
          cat(who_, ": the verification hook returned a ",
              std::string(py::str(r.get_type().attr("__name__"))),
              "; return None or True (verified), False or a message (failed), or raise", at));
    } catch (py::error_already_set& err) {
      const std::string text = describe(err);
      if (!pending_) pending_ = exception_object(err);
      return Status::Corruption(who_ + ": the verification hook raised " + text + at);
    } catch (const std::exception& err) {
      return Status::Corruption(who_ + ": the verification hook failed: " + err.what() + at);
    }
  }

  // The load_weights hook: the batch as [(name, registered object), ...]. An exception ends the
  // session (refit/session.h on_load_weights) and is re-raised as the __cause__ of its error.
  Status run_load(const std::vector<ParamView>& batch) {
    py::gil_scoped_acquire gil;
    try {
      py::list items;
      for (const ParamView& v : batch)
        items.append(py::make_tuple(v.name, registry_.registered(v.name)));
      load_(items);
      return Status::Ok();
    } catch (py::error_already_set& err) {
      const std::string text = describe(err);
      if (!pending_) pending_ = exception_object(err);
      return Status::Internal(who_ + ": the load_weights hook raised " + text);
    } catch (const std::exception& err) {
      return Status::Internal(who_ + ": the load_weights hook failed: " + err.what());
    }
  }

  // The weights_changed hook: the names as a list of str. An exception ends the session, as the
  // load_weights hook's does, and is re-raised as the __cause__ of its error.
  Status run_changed(const std::vector<std::string>& names) {
    py::gil_scoped_acquire gil;
    try {
      py::list items;
      for (const std::string& n : names) items.append(n);
      changed_(items);
      return Status::Ok();
    } catch (py::error_already_set& err) {
      const std::string text = describe(err);
      if (!pending_) pending_ = exception_object(err);
      return Status::Internal(who_ + ": the weights_changed hook raised " + text);
    } catch (const std::exception& err) {
      return Status::Internal(who_ + ": the weights_changed hook failed: " + err.what());
    }
  }

  const Config config_;
  const int engine_rank_;
  const RankId self_;
  const std::string who_;
  Registry registry_;
  std::unique_ptr<Engine> engine_;
  std::atomic<bool> busy_{false};
  py::object pause_, resume_, verify_, load_, changed_;
  py::object pending_;  // the first exception a hook raised during the current serve_one
  bool refit_failed_ = false;  // the last serve_one's refit failed, the session did not
  std::mutex version_mu_;
  std::string version_;
  bool valid_ = true;
  std::map<std::string, int> published_;
  std::mutex stop_mu_;  // engine_ against request_stop() from another thread
};

// A rank from its constructor's arguments; those left out come from torchrun's environment
// (refit/session.h: endpoint_from_environment and the rank's variable).
template <typename Rank, Result<int> (*kRankFromEnvironment)()>
std::unique_ptr<Rank> rank_from_arguments(const PyConfig& cfg, std::optional<int> rank,
                                          std::optional<std::string> master_addr,
                                          std::optional<int> master_port,
                                          std::optional<std::string> host) {
  const Endpoint ep = value_or_raise(
      endpoint_from_environment(std::move(master_addr), master_port, std::move(host)));
  const int r = rank ? *rank : value_or_raise(kRankFromEnvironment());
  return std::make_unique<Rank>(cfg, r, ep.master_addr, ep.master_port, ep.host);
}

std::unique_ptr<PyEngine> engine_from_arguments(
    const PyConfig& cfg, std::optional<int> rank, std::optional<std::string> master_addr,
    std::optional<int> master_port, std::optional<std::string> host,
    const std::optional<std::map<std::string, int>>& published) {
  std::unique_ptr<PyEngine> e = rank_from_arguments<PyEngine, &engine_rank_from_environment>(
      cfg, rank, std::move(master_addr), master_port, std::move(host));
  if (published) e->note_published(*published);
  return e;
}

}  // namespace

void bind_session(py::module_& m) {
  py::class_<PyTrainer>(m, "Trainer", R"doc(
One trainer rank of a refit (refit/session.h).

Trainer(config, rank=None, *, master_addr=None, master_port=None, host=None) joins the control
plane (rank 0 hosts the store on master_addr:master_port; a master_port of 0 on rank 0 binds any
free port, see store_port), forms the trainer group and waits for its engines: it is collective
with every rank of the refit and blocks (GIL released) for at most config.timeout_s per wait.
`host` is the address this process listens on for its peers. Arguments left out come from
torchrun's environment: rank from RANK, master_addr from MASTER_ADDR (default 127.0.0.1),
master_port from REFIT_PORT, else MASTER_PORT + 1 (never torch.distributed's own port), else
29501, host from REFIT_HOST, else the local address this host uses to reach master_addr
(docs/python.md).

Then register every local tensor once (zero-copy: refit reads the registered storage in place at
each refit), and call refit(step) after every training step.
)doc")
      .def(py::init(&rank_from_arguments<PyTrainer, &trainer_rank_from_environment>),
           py::arg("config"), py::arg("rank") = py::none(), py::kw_only(),
           py::arg("master_addr") = py::none(), py::arg("master_port") = py::none(),
           py::arg("host") = py::none())
      .def_property_readonly("tensors", &PyTrainer::tensors, R"doc(
The local tensors this rank must register: [TensorSlot(name, shape, dtype), ...] under the
trainer's names (FSDP2: HF names with dim-0 chunk shapes; Megatron: Megatron names and shard
shapes), in the policy dtype.
)doc")
      .def("register", &PyTrainer::register_tensor, py::arg("name"), py::arg("tensor"), R"doc(
Registers the storage of local tensor `name`: any object with __dlpack__ (NumPy array, torch
tensor) in host memory (device: cpu) or CUDA memory (device: cuda), C-contiguous, of the slot's
shape and dtype. No copy is made: refit keeps
a reference to `tensor` and reads its storage at every refit, so update it in place. Registering a
name again replaces the previous storage. Raises refit.SetupError naming the tensor and the
expected shape/dtype; a tensor on the wrong kind of device is refused (see
refit.accepts_device_memory(config)).
)doc")
      .def("refit", &PyTrainer::refit, py::arg("step"), py::arg("version") = py::none(),
           py::arg("verify") = false, R"doc(
One refit of every registered tensor into every engine; returns when every engine this rank feeds
committed. `version` is the weight version the engines publish (default: "step-<step>" for
sglang, "<step>" for vllm). With verify=True the engines run their on_verify hook after the commit
and a failed verdict raises refit.Error here, on every trainer rank. Collective over the trainer
group; the GIL is released while it runs.
)doc")
      .def_property_readonly("last_stats", &PyTrainer::last_stats, R"doc(
The last refit: {"seconds", "unshard_s", "cast_pack_s", "transfer_s", "apply_s" (stages overlap),
"pause_s" (the longest pause of generation on an engine rank: the whole refit, or with
refit.staged only the apply), "bytes", "buckets", "gbps"} (docs/python.md says what "bytes"
counts).
)doc")
      .def("traffic", &PyTrainer::traffic, R"doc(
Every rank's traffic in the last refit, trainer ranks then engine ranks: a list of {"role"
("trainer" | "engine"), "rank", "bytes_sent", "bytes_received", "peer_pairs", "p2p_pairs",
"setup_seconds", "plan_bytes", and for refit.delta "delta_pairs", "delta_elements",
"delta_changed", "full_bytes", "encode_s", "delta_apply_s" (RankTraffic, docs/delta.md)}, as each
rank recorded it on the control plane. The GIL is released while it reads them.
)doc")
      .def_property_readonly(
          "bytes_per_refit",
          [](PyTrainer& t) { return t.open("bytes_per_refit").bytes_per_refit(); })
      .def_property_readonly(
          "buckets_per_refit",
          [](PyTrainer& t) { return t.open("buckets_per_refit").buckets_per_refit(); })
      .def_property_readonly("plan_hash",
                             [](PyTrainer& t) { return t.open("plan_hash").plan_hash(); })
      .def_property_readonly(
          "store_port", [](PyTrainer& t) { return t.open("store_port").store_port(); },
          R"doc(The port of the run's store: on trainer rank 0 the one it bound (the system's choice
with master_port=0), elsewhere the one it connected to.)doc")
      .def_property_readonly("rank", &PyTrainer::rank)
      .def_property_readonly("closed", &PyTrainer::closed)
      .def_property_readonly("session_ok", &PyTrainer::session_ok, R"doc(
False once a failure ended the session (every later call raises it; create every rank again).
A refit that moved every byte but failed at its end (refit.checksum mismatch, failed verification)
raises refit.Error on every trainer rank and leaves this True: the next refit() runs normally.)doc")
      .def(
          "unregistered",
          [](PyTrainer& t) {
            t.open("unregistered");
            return t.registry().unregistered();
          },
          "Names of the tensors not registered yet (refit() refuses to run while any is left).")
      .def(
          "registered",
          [](PyTrainer& t, const std::string& name) {
            t.open("registered");
            return t.registry().registered(name);
          },
          py::arg("name"), "The object registered for `name`, or None.")
      .def("shutdown", &PyTrainer::shutdown, R"doc(
Tells the engines this rank feeds that no refit follows and waits until they left. Collective.
)doc")
      .def("close", &PyTrainer::close, py::arg("error") = py::none(), R"doc(
Destroys the rank and drops the registered tensors (no message to the peers). With `error` (an
exception), first ends the session with it as this rank's failure: every peer's current or next
wait raises within about a second naming this rank and the error (trainer rank 0 keeps its store
up until they read it), not only its silence. __exit__ does this with the exception that ended
the with block.)doc")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyTrainer& t, const py::object&, const py::object& value, const py::object&) {
             t.exit(value);
             return false;
           })
      .def("__repr__", [](PyTrainer& t) {
        return cat("refit.Trainer(", t.who(), t.closed() ? ", closed" : "", ")");
      });

  py::class_<PyEngine>(m, "Engine", R"doc(
One engine rank of a refit (refit/session.h): engine_rank = engine index * tp_size + tp rank.

Engine(config, engine_rank=None, *, master_addr=None, master_port=None, host=None,
published=None) joins the control plane of trainer rank 0 (at master_addr:master_port) and
announces itself to the trainer ranks that feed it (GIL released while it waits). Arguments left
out come from the environment as for Trainer; engine_rank from ENGINE_RANK, else RANK. Register
every parameter of `params` once (zero-copy: refit writes into that storage), set the hooks, then
serve refits with serve_one() or serve().

published: {version label: refit step} this rank served before this Engine was created (the
`published` of the Engine it replaces, docs/rl-loop.md "Recovering from a dead rank"): a refit that would
publish one of those labels at another step is refused (refit.SetupError naming the label, both
steps and this rank) before any byte moves.
)doc")
      .def(py::init(&engine_from_arguments), py::arg("config"), py::arg("engine_rank") = py::none(),
           py::kw_only(), py::arg("master_addr") = py::none(), py::arg("master_port") = py::none(),
           py::arg("host") = py::none(), py::arg("published") = py::none())
      .def_property_readonly("params", &PyEngine::params, R"doc(
The parameters this rank stores: [TensorSlot(name, shape, dtype), ...] under the engine's names
and TP shard shapes (vLLM/SGLang layout: fused qkv_proj and gate_up_proj, vocabulary-parallel
embed_tokens/lm_head padded to a multiple of 64, MoE w13_weight/w2_weight), in
refit.target_precision.
)doc")
      .def("register", &PyEngine::register_param, py::arg("name"), py::arg("tensor"), R"doc(
Registers writable host storage for parameter `name` (any object with __dlpack__, C-contiguous;
a NumPy uint16 array may stand for bf16). No copy: refit writes into it during each refit and
keeps a reference to `tensor`. Raises refit.SetupError naming the tensor on a mismatch.
)doc")
      .def("on_pause", &PyEngine::set_pause, py::arg("hook"), R"doc(
hook() runs on the serving thread before any parameter changes (pause generation); None removes it.
If it raises (or runs past timeout_s), every rank aborts the refit before any parameter is
written (weight_version and is_valid are unchanged): the trainer's refit() raises refit.Error
(code "aborted") naming this rank, serve_one() raises refit.Error with the hook's exception as its
__cause__, and the session stays usable (serve() goes on). With executor gather it ends the
session.
)doc")
      .def("on_resume", &PyEngine::set_resume, py::arg("hook"), R"doc(
hook() runs on the serving thread after the commit, once weight_version is the new version and
before the trainer's refit() returns (resume generation; with verify, only after the verification
passed); None removes it. An exception in
on_resume does not undo the refit; serve_one()/serve() re-raise it afterwards.
)doc")
      .def("on_verify", &PyEngine::set_verify, py::arg("hook"), R"doc(
hook(step, version) runs after a commit when the trainer asked for verification. Return None or
True when the parameters are right; False or a message string, or raise, when not: the trainer's
refit(verify=True) then raises refit.Error (code "corruption") with that message.
)doc")
      .def("on_load_weights", &PyEngine::set_load_weights, py::arg("hook"), R"doc(
hook(batch) hands the refit's weights to the engine by name, as vLLM's and SGLang's
model.load_weights take them (docs/engines.md). After every byte of a refit landed, before the
on_verify hook and before the version is published, it is called with every parameter in layout
order, in batches: a list of (name, tensor) where tensor is the object registered under that name.
Whole tensors only; a decoder layer is never split across two calls; a batch holds at most
refit.buffer_size_bytes unless one layer is larger. Called again with the restored bytes after a
rollback (refit.keep_previous). If it raises, the session ends (the engine's weights are torn) and
serve_one() raises refit.Error with the exception as its __cause__. None removes it.
)doc")
      .def("on_weights_changed", &PyEngine::set_weights_changed, py::arg("hook"), R"doc(
hook(names) tells the engine which parameters a refit rewrote in place, so that it derives again
what it computes from them after loading (MLA's W_UK_T / W_UV in vLLM, w_kc / w_vc in SGLang:
docs/engines.md). Called once per refit after every byte landed and after on_load_weights, before
on_verify and before the version is published, with the names (list of str) of every parameter
of this rank in layout order; called again after a rollback (refit.keep_previous). If it raises,
the session ends and serve_one() raises refit.Error with the exception as its __cause__. None
removes it.
)doc")
      .def("serve_one", &PyEngine::serve_one, py::arg("timeout") = py::none(), R"doc(
Serves one refit (GIL released; waits for it to start as long as the trainer lives, or at most
`timeout` seconds, and config.timeout_s for each step of it). Returns True after a committed
refit, False when the trainer shut the engines down or request_stop() was called (nothing
changed; the session goes on). Past `timeout` with no refit begun it raises
refit.TimeoutError and nothing changed (recoverable: call it again later); an inference server
calls it from its own loop between batches. A refit that began runs to its end.
)doc")
      .def_property_readonly("last_stats", &PyEngine::last_stats, R"doc(
This rank's side of the last refit it served: {"seconds", "apply_s", "bytes" (what reached this
rank), "checksums_matched" (feeders whose bytes passed refit.checksum), ...}, the keys of
Trainer.last_stats.
)doc")
      .def("serve", &PyEngine::serve, R"doc(
Serves refits until the trainer shuts down or request_stop() is called; returns how many
committed. A Ctrl-C is acted on once the serve_one() in progress returns: after the next refit,
since between refits it waits for the next one (request_stop() from another thread ends it at
once).
)doc")
      .def("request_stop", &PyEngine::request_stop, R"doc(
Makes serve() (or serve_one()) on another thread return: from any thread, at any time, without
waiting. While it waits for a refit to begin it returns within 0.1 s; a refit in flight runs to its
end first. Nothing changes (weights, version, session): serve again later, or close the engine. A
request made while nothing serves ends the next serve() or serve_one() before it waits.
)doc")
      .def_property_readonly("weight_version", &PyEngine::weight_version, R"doc(
The version published by the last committed refit ("0" before the first); "" after a refit that
failed once it could have written the parameters (they are then torn, and generation stays
paused). With verify, a refit publishes only after its verification passed. Safe to read from
any thread, also while another serves.
)doc")
      .def_property_readonly("published", &PyEngine::published, R"doc(
{version label: refit step} of every version this rank published: each committed refit of this
session and the labels passed as `published=`. A refit whose label is among them at another step
is refused by this rank before any byte moves (refit.SetupError naming the label, both steps and
this rank; the weights keep their version, on_pause does not run, the session goes on); a refit
of the same step may reuse its label (the retry of a failed refit). Safe to read from any thread,
and after close(): pass it as `published=` to the Engine of the next session.
)doc")
      .def_property_readonly("is_valid", &PyEngine::is_valid, R"doc(
False exactly when weight_version is "": the parameters hold no complete version.
)doc")
      .def_property_readonly("session_ok", &PyEngine::session_ok, R"doc(
False once a failure ended the session. After a refit that failed at its end (checksum mismatch,
failed verification) or was refused before any byte moved (a pause hook raised), serve_one()
raises refit.Error and this stays True; serve() goes on.)doc")
      .def_property_readonly("engine_rank", &PyEngine::engine_rank)
      .def_property_readonly("engine_index", &PyEngine::engine_index)
      .def_property_readonly("tp_rank", &PyEngine::tp_rank)
      .def(
          "unregistered",
          [](PyEngine& e) {
            e.open("unregistered");
            return e.registry().unregistered();
          },
          "Names of the parameters not registered yet (a refit fails while any is left).")
      .def(
          "registered",
          [](PyEngine& e, const std::string& name) {
            e.open("registered");
            return e.registry().registered(name);
          },
          py::arg("name"), "The object registered for `name`, or None.")
      .def("close", &PyEngine::close, py::arg("error") = py::none(), R"doc(
Destroys the rank and drops the registered tensors (no message to the peers). With `error` (an
exception), first ends the session with it as this rank's failure, as Trainer.close(error) does;
__exit__ passes the exception that ended the with block.)doc")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyEngine& e, const py::object&, const py::object& value, const py::object&) {
             e.close(value);
             return false;
           })
      .def("__repr__", [](PyEngine& e) { return cat("refit.Engine(", e.who(), ")"); });

  m.def(
      "accepts_device_memory",
      [](const py::object& config) {
        if (config.is_none()) return false;
        return build_has_cuda() && config.cast<const PyConfig&>().config.device == Device::kCuda;
      },
      py::arg("config") = py::none(),
      "Whether Trainer/Engine.register take GPU (CUDA) tensors in place for `config`: true when this "
      "build has the CUDA data plane and config.device is cuda. Otherwise register host tensors; "
      "refit.torch then stages GPU tensors through pinned host copies.");
}

}  // namespace refit::python
