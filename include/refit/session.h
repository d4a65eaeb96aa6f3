// refit/session.h — the library API: one trainer rank or one engine rank of a refit.
//
// A refit connects `policy.world_size` trainer ranks to `num_engines * tp_size` engine ranks
// (docs/design.md §3). Each rank is one process that creates a Trainer or an Engine with the same
// Config and the address of trainer rank 0, which hosts the rendezvous store. The caller owns the
// tensors: it registers the storage of every local tensor (trainer) or parameter (engine) once,
// and refit reads or writes that storage in place — no copies into refit-owned tensors.
//
// Threads.
//  - A Trainer or an Engine is driven by one thread at a time. No method of an object may run
//    while another of its methods runs on another thread — accessors (weight_version(),
//    session_ok(), ...) included: C++ does not check it, and it is a data race. The one exception
//    is Engine::request_stop(), which any thread may call at any time (below). Calls may come
//    from different threads one after another, when the caller orders them (for example by
//    joining the thread that made the previous call). Objects are independent of each other: a
//    Trainer and an Engine of one process may be driven by two threads at once.
//  - The calls that talk to other ranks block the calling thread: create, Trainer::refit,
//    shutdown and traffic, Engine::serve_one and serve. Every wait inside them is bounded by
//    refit.timeout_s, except an engine's wait for the next refit, which lasts as long as the
//    trainer lives. A failure anywhere surfaces on every rank as a non-ok Status naming its cause.
//  - refit runs threads of its own inside each rank (a heartbeat, data-plane workers, a sender or
//    an applier, the store server on trainer rank 0: docs/design.md §5b). None of them calls the
//    caller's code.
//  - Every Engine hook (on_pause, on_resume, on_verify, on_load_weights, on_weights_changed)
//    runs on the thread that called serve_one() or serve(), inside that call. A hook may call
//    weight_version(), is_valid() and session_ok() of its Engine, and no other of its methods.
//  - serve() returns when the trainer shuts the engines down (Trainer::shutdown() on every
//    trainer rank), with the failure that ended the session, or after Engine::request_stop()
//    from another thread: within 100 ms while it waits for a refit to begin; a refit in flight
//    runs to its end first (each step bounded by refit.timeout_s). The session goes on: serve
//    again later, or destroy the engine (its peers then fail within the silence bound, 5.5 s,
//    naming it).
//  - The Python module wraps these objects with the same rule, enforced: a second thread's call
//    while one runs raises RuntimeError; Engine.weight_version and Engine.is_valid alone may be
//    read from any thread (docs/python.md).
// Lifetime: registered storage must stay valid (and, on the trainer, unmodified during refit())
// until the object is destroyed. Destroying a Trainer or an Engine tells no other rank: it joins
// refit's threads in the rank (bounded: a heartbeat request ends within 2 s) and closes its
// collectives, mailbox and store connections — on trainer rank 0 also the store server. The other
// ranks learn it from the silence: within 5.5 s their current or next wait fails, naming this rank
// (trainer rank 0: the store it hosts). Call Trainer::shutdown() first for a clean end; an
// engine rank ends cleanly when serve_one() returned false. Never destroy an object while another
// thread is inside one of its methods.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "refit/config.h"
#include "refit/dtype.h"
#include "refit/status.h"

namespace refit {

// Where a rank finds the control plane.
struct Endpoint {
  std::string master_addr = "127.0.0.1";  // trainer rank 0's address (MASTER_ADDR)
  int master_port = 29501;                // its store port (REFIT_PORT; 0 on trainer rank 0: any)
  std::string host = "127.0.0.1";         // the address this process listens on for its peers
};

// torchrun's environment, read now (not cached), for callers that leave these out:
//  - the endpoint: MASTER_ADDR (default 127.0.0.1); the store's port: REFIT_PORT, else
//    MASTER_PORT + 1 (never torch.distributed's own port), else 29501; and the address to listen
//    on: REFIT_HOST, else the local address this host uses to reach MASTER_ADDR (127.0.0.1 when
//    MASTER_ADDR is a loopback address);
//  - a trainer rank: RANK; an engine rank: ENGINE_RANK, else RANK.
// Arguments given win over the environment. A bad or missing value is an InvalidArgument naming
// the variable.
Result<Endpoint> endpoint_from_environment(std::optional<std::string> master_addr = std::nullopt,
                                           std::optional<int> master_port = std::nullopt,
                                           std::optional<std::string> host = std::nullopt);
Result<int> trainer_rank_from_environment();
Result<int> engine_rank_from_environment();

// One tensor a rank must register: name, local shape, dtype.
struct TensorSlot {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::int64_t numel() const;
};

// Seconds each stage was busy in the last refit (stages overlap, so they may add up to more than
// the refit's own time), and the refit's bytes.
//  - Trainer::last_stats: `seconds` of the whole refit() on this rank, `apply_s` of the slowest
//    engine it feeds, `bytes` of one copy of the model on the wire (target dtypes, FP8 scales
//    included: the same number as bytes_per_refit()), `buckets` rounds of the transfer plan
//    (buckets with executor gather).
//  - Engine::last_stats: `seconds` from the refit's first begin to its end on this rank,
//    `apply_s` spent applying, `bytes` that reached this rank, and `checksums_matched` feeders
//    whose bytes passed refit.checksum.
struct RefitStats {
  double seconds = 0;
  double unshard_s = 0, cast_pack_s = 0, transfer_s = 0, apply_s = 0;
  // Seconds generation was paused, from the pause hook's start until generation resumed (the
  // longest of the engine ranks, on trainer ranks): the whole refit, or with refit.staged only
  // its apply.
  double pause_s = 0;
  std::int64_t bytes = 0;
  int buckets = 0;
  int checksums_matched = 0;
};

// What one rank moved in the last refit.
struct RankTraffic {
  std::string role;  // "trainer" | "engine"
  int rank = 0;      // trainer rank, or global engine rank (engine index * tp_size + tp rank)
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  // Transfer plan (refit.executor other than gather): the rank's pairs served by peer access and
  // by point-to-point.
  int peer_pairs = 0;
  int p2p_pairs = 0;
  // Seconds the rank spent in setup (Trainer::create / Engine::create), and the heap its view of
  // the transfer plan holds (0 with executor gather).
  double setup_seconds = 0;
  std::int64_t plan_bytes = 0;
  // refit.delta (docs/delta.md): the rank's pairs that moved a delta (trainer: sent one; engine:
  // applied one), the elements of their routes and how many of them changed; trainer ranks: the
  // bytes a full refit of all its pairs moves (bytes_sent counts what actually moved) and the
  // seconds spent encoding and keeping its copies; engine ranks: the seconds spent applying
  // delta streams.
  int delta_pairs = 0;
  std::int64_t delta_elements = 0;
  std::int64_t delta_changed = 0;
  std::int64_t full_bytes = 0;
  double encode_s = 0;
  double delta_apply_s = 0;
  bool operator==(const RankTraffic&) const = default;
};

// One whole parameter of an engine rank, handed to a load_weights hook (Engine::on_load_weights):
// the layout's name (the Hugging Face name with generation.layout: hf), shape and dtype
// (refit.target_precision), and its bytes: host memory with device: cpu, memory of CUDA device
// `device` with device: cuda. Row-major, contiguous; valid for the duration of the hook's call.
struct ParamView {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kBFloat16;
  const void* data = nullptr;
  int device = -1;  // CUDA device ordinal; -1 for host memory
  std::int64_t numel() const;
};

class Trainer {
 public:
  // Trainer rank `rank`: joins the control plane (rank 0 hosts it), forms the trainer group and
  // the point-to-point group (or, with executor gather and broadcast, the update group), and
  // waits for the engines it feeds to join; vLLM plan hashes are compared here. Collective with
  // every rank of the refit: blocks until they joined, each wait bounded by refit.timeout_s.
  static Result<std::unique_ptr<Trainer>> create(const Config& config, int rank,
                                                 const Endpoint& endpoint);
  // Tells no peer (see "Lifetime" above); call shutdown() first.
  virtual ~Trainer() = default;

  // The local tensors this rank holds, under the trainer's names (FSDP2: HF names with dim-0
  // chunk shapes; Megatron: Megatron names with TP/PP/EP shard shapes), in the policy dtype.
  virtual const std::vector<TensorSlot>& tensors() const = 0;
  // Registers the storage of local tensor `name` (contiguous, row-major; host memory with
  // device: cpu, CUDA memory with device: cuda). Local: talks to no other rank, except that an
  // error is kept where the peers read it (note_error). Registering a name again replaces its
  // storage for the next refit. Errors name the tensor and the expected shape/dtype.
  virtual Status register_tensor(const std::string& name, void* data, DType dtype,
                                 const std::vector<std::int64_t>& shape) = 0;

  // One refit of every registered tensor into every engine; returns when every engine it feeds
  // committed. `version` is the weight version the engines publish. With `verify`, the engines
  // run their verification hook after the commit and the verdict is returned here (on every
  // trainer rank). Collective over the trainer group.
  // A refit that moved every byte but failed at its end — a checksum mismatch (refit.checksum) or
  // a failed verification — returns an error on every trainer rank and leaves the session usable
  // (session_ok() stays true): the engines did not publish its version (with refit.keep_previous
  // they rolled back), and the next refit() runs normally. So does a refit an engine rank refused
  // before any byte moved (its pause hook failed or outlasted refit.timeout_s; code kAborted): the
  // engines keep their weights and version. And so does a refit that failed in flight with every
  // rank alive — a wait that timed out because a rank stalled (code kAborted, "failed in flight");
  // every rank forms its groups anew before returning (docs/runtime.md, "A refit that fails in
  // flight"). Any other failure ends the session.
  virtual Status refit(int step, const std::string& version, bool verify) = 0;
  // Whether this rank can run another refit: false once a failure ended the session (every later
  // call returns that failure; re-create every rank to recover, docs/runtime.md).
  virtual bool session_ok() const = 0;
  // Ends this rank's session with `cause`, a failure of the caller's own (an exception in its
  // loop, a registration it could not fix): records it as the run's first failure with this rank
  // as its origin (unless another rank's came first) and closes the collectives, so that every
  // peer's current or next wait fails within 0.5 s naming this rank and `cause`, not only its
  // silence after it exits. On trainer rank 0 the store then outlives the object until the others
  // read it (at most 5 s). Returns the failure that ended the session (the first one, when one
  // already had).
  virtual Status fail(const Status& cause) = 0;
  // Keeps `error`, a call of this rank that failed without ending the session (a refused
  // registration), where the peers read it: should this process exit or stop before its next
  // refit succeeds, they name it with this error, not only as gone. One store request; the
  // registration calls keep their own errors this way.
  virtual void note_error(const Status& error) = 0;
  // The last refit's stage times and bytes; the reference is valid until the next refit().
  virtual const RefitStats& last_stats() const = 0;
  // The plan: bytes of one copy of the model (target dtype), rounds of the transfer plan (buckets
  // with executor gather), and the plan's hash.
  virtual std::int64_t bytes_per_refit() const = 0;
  virtual int buckets_per_refit() const = 0;
  virtual std::string plan_hash() const = 0;
  // The port of the run's store: on trainer rank 0, the one it bound (the system's choice when
  // the endpoint's port was 0); elsewhere the endpoint's.
  virtual int store_port() const = 0;
  // Every rank's traffic in the last refit (trainer ranks, then engine ranks), as each rank
  // reported it on the control plane after the refit. Call after refit(); it reads the store
  // (blocking, bounded by refit.timeout_s). Not collective.
  virtual Result<std::vector<RankTraffic>> traffic() = 0;

  // Tells the engines it feeds that no refit follows and waits until they left (their
  // serve_one() returns false, serve() returns ok). Collective over the trainer group; trainer
  // rank 0, which hosts the store, leaves last. After it only destruction is left.
  virtual Status shutdown() = 0;
};

class Engine {
 public:
  // Engine rank `engine_rank` (= engine index * tp_size + tp rank): joins the control plane and
  // the point-to-point group (executor gather: the update group, or its trainer rank's ipc slots),
  // then announces itself (with its plan hash) to every trainer rank that feeds it. Collective
  // with the trainer ranks: blocks until they joined, each wait bounded by refit.timeout_s.
  static Result<std::unique_ptr<Engine>> create(const Config& config, int engine_rank,
                                                const Endpoint& endpoint);
  // Tells no peer (see "Lifetime" above). Storage from allocate_params() is freed; registered
  // storage is the caller's and keeps the bytes of the last refit (a complete version when
  // is_valid() was true).
  virtual ~Engine() = default;

  // The parameters this rank stores, under the engine's names and TP shard shapes
  // (vLLM / SGLang layout), in refit.target_precision.
  virtual const std::vector<TensorSlot>& params() const = 0;
  // Registers writable storage for parameter `name` (as Trainer::register_tensor). Local; call it
  // before the first serve_one(), or between serve_one() calls (never from a hook).
  virtual Status register_param(const std::string& name, void* data, DType dtype,
                                const std::vector<std::int64_t>& shape) = 0;
  // Instead of registering: refit allocates zero-filled storage for every parameter, in memory the
  // trainer ranks on this host can map (POSIX shared memory on CPU, CUDA IPC on GPU), and
  // registers it. Those trainer ranks then write their routes straight into the parameters
  // (refit.executor auto or peer) — one read of the source and one write of the destination per
  // element, no staging buffers. On CUDA, registered cudaMalloc memory (the caching allocators')
  // is exported per parameter instead; host memory the caller allocated cannot be mapped, and
  // its feeders use point-to-point. Returns the pointers in params() order; they live as long as
  // the Engine. Local; at most once, before the first serve_one().
  virtual Result<std::vector<void*>> allocate_params() = 0;

  // The hooks (on_pause, on_resume, on_verify, on_load_weights, on_weights_changed) are set from
  // the driving thread before the first serve_one() or between serve_one() calls, never from a
  // hook; each runs on the thread that called serve_one() / serve(), inside that call.
  //
  // Called around every refit: generation must pause before any parameter changes and may
  // resume after the commit (SGLang's pause/resume; vLLM's sleep/wake). The resume hook also runs
  // when a refit is aborted before any byte landed (for the ranks whose pause succeeded), after a
  // pause hook that outlasted refit.timeout_s, and after a refit.keep_previous rollback; never
  // after a refit that left the weights invalid. A pause hook that
  // returns an error (or runs past refit.timeout_s) makes every rank abort the refit before any
  // parameter is written: the weights keep their version and validity, the error (naming this
  // rank) is the refit's on every rank, and the session goes on (transfer plan; with executor
  // gather it ends the session). A hook returning void cannot fail.
  virtual void on_pause(std::function<Status()> hook) = 0;
  template <typename F>
    requires std::is_void_v<std::invoke_result_t<F&>>
  void on_pause(F hook) {
    on_pause(std::function<Status()>([h = std::move(hook)]() mutable {
      h();
      return Status::Ok();
    }));
  }
  virtual void on_resume(std::function<void()> hook) = 0;
  // Called after a commit when the trainer asked for verification; its Status is the verdict
  // sent back to the trainer. Receives the step and the weight version the refit will publish
  // when the verdict is OK (the resume hook runs after it; on a failed verdict, never).
  virtual void on_verify(std::function<Status(int step, const std::string& version)> hook) = 0;
  // Hands the refit's weights to the engine by name, as vLLM's and SGLang's model.load_weights
  // take them (docs/engines.md): after every byte of a refit landed in this rank's parameters
  // (registered or allocated), before the verification hook and before the version is
  // published, the hook is called with every parameter, in layout order, in batches: whole
  // tensors only, a decoder layer ("...layers.<N>....") never split across two calls, a batch at
  // most refit.buffer_size_bytes unless one layer is larger. The views point into the
  // parameters' storage and are valid during the call (the next refit rewrites them); copy what
  // must outlive it. After a rollback (refit.keep_previous) the hook is called again with the
  // restored bytes. A hook that returns an error ends the session (the engine's own weights are
  // then torn), as any rank's failure does; an empty hook removes it.
  virtual void on_load_weights(
      std::function<Status(const std::vector<ParamView>& batch)> hook) = 0;
  // Tells the engine which parameters a refit rewrote in place, so that it derives again what it
  // computes from them after loading (vLLM's process_weights_after_loading, SGLang's
  // post_load_weights: MLA's matrices from kv_b_proj, docs/engines.md). Called once per refit
  // after every byte landed and after the load_weights hook, before the verification hook and
  // before the version is published, with the names of every parameter of this rank in layout
  // order (a refit rewrites them all); called again after a rollback (refit.keep_previous)
  // restored the kept bytes. A hook that returns an error ends the session, as the load_weights
  // hook's does; an empty hook removes it. Works with either layout.
  virtual void on_weights_changed(
      std::function<Status(const std::vector<std::string>& names)> hook) = 0;

  // Serves one refit (blocking; the hooks run inside it). Waits for it to start as long as the
  // trainer lives (a failure of any rank, or the loss of the store, ends the wait, and so does
  // request_stop()); each step of the refit is bounded by refit.timeout_s. Returns true after a
  // committed refit, false when the trainer shut the engines down or a stop was requested. A refit
  // that failed at its end (checksum mismatch, failed verification), was refused before any byte
  // moved, or failed in flight with every rank alive is returned as its error with session_ok()
  // still true: serve the next one.
  virtual Result<bool> serve_one() = 0;
  // The same, waiting at most `wait` for a refit to begin: past it, an error of code kTimeout
  // (FailureKind::kTimeout) with nothing changed — the weights, their version and the session
  // (session_ok() stays true). An inference server calls it from its own loop between batches.
  // A refit that began runs to its end, each of its steps bounded by refit.timeout_s. A refit
  // that begins after the trainer's own wait for it ran out (refit.timeout_s) is refused by the
  // trainer, and this rank keeps its weights and version.
  virtual Result<bool> serve_one(std::chrono::milliseconds wait) = 0;
  // Serves refits until shutdown, past refits that failed at their end (serve_one() in a loop, on
  // the calling thread). Returns ok after the trainer's shutdown or a stop request
  // (request_stop()), or the failure that ended the session.
  virtual Status serve() = 0;
  // Asks the serving thread to return: thread-safe, callable from any thread (or a hook) at any
  // time, also while serve() or serve_one() runs; it does not wait. The wait for the next refit
  // sees the request within 100 ms; serve() then returns ok and serve_one() returns false, with
  // nothing changed (weights, version, session). A refit that has begun runs to its end first.
  // The request is used up by the call it ends; one made while nothing serves ends the next
  // serve() / serve_one() before it waits. The trainer does not hear of it: its next refit waits
  // for this rank's pause until refit.timeout_s, unless this rank serves again by then.
  virtual void request_stop() = 0;
  // Whether this rank can serve another refit (see Trainer::session_ok).
  virtual bool session_ok() const = 0;
  // See Trainer::fail and Trainer::note_error.
  virtual Status fail(const Status& cause) = 0;
  virtual void note_error(const Status& error) = 0;
  // This rank's side of the last refit it served (RefitStats); the reference is valid until the
  // next serve_one().
  virtual const RefitStats& last_stats() const = 0;
  // The version published by the last committed refit ("0" before the first), read on the driving
  // thread (or in a hook): not while another thread is inside serve_one(). Empty while a
  // refit may be writing the parameters, and after a refit that failed once it could have
  // written them (a failure, a checksum mismatch, a failed verification): the weights are then a
  // mix of two versions and generation stays paused (the resume hook did not run). With
  // refit.keep_previous, a refit that failed at its end with every rank alive restores the
  // previous version's bytes and label instead, and resumes generation.
  virtual std::string weight_version() const = 0;
  // False exactly when weight_version() is empty: the parameters hold no complete version.
  virtual bool is_valid() const = 0;
  // Version labels name one set of weights each. Every label this rank published, with the refit
  // step that published it: each committed refit of this Engine, and the labels handed to
  // note_published(). A refit whose label is among them at another step is refused by this rank
  // before any byte moves (its pause answer; code kInvalidArgument, FailureKind::kSetup), naming
  // the label, both steps and this rank: the weights keep their version, the pause hook does not
  // run, and the session goes on (with executor gather, which has no pause answer, the refusal
  // ends the session). A refit of the same step may reuse its label: the retry of a refit that
  // failed, or one the trainers did not see succeed. The trainers refuse a label they saw
  // published themselves, before any message; this check also covers labels they never saw.
  // Read on the driving thread, as weight_version().
  virtual std::map<std::string, int> published() const = 0;
  // Hands this rank labels published before this Engine was created, with their steps: an
  // inference server that outlives its Engine (docs/rl-loop.md, "Recovering from a dead rank")
  // passes the new one what the old one's published() returned. Local; call it before the first
  // serve_one() or between serve_one() calls. A label already known keeps its step.
  virtual void note_published(const std::map<std::string, int>& published) = 0;
};

}  // namespace refit
