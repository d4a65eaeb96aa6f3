// The machinery both sides of a refit session share: one rank's identity and config, its failure
// latch, its data plane, the control plane (the store — trainer rank 0 hosts it —, the liveness
// connections and heartbeat, the mailbox), its refit epochs, the collective groups it formed and
// their abort, and recovery after a refit failed in flight (docs/runtime.md). The Trainer and the
// Engine (runtime/trainer.cc, runtime/engine.cc) each hold one and add only their own side's job.
//
// The components come from RankServices: the real store, mailbox and data plane by default
// (default_services), or others a test hands in, so that a rank's state machine can run in one
// process with real components on threads.
//
// Threading: driven by the rank's thread. The heartbeat's thread calls abort_collectives() (a peer
// fell silent) and abort_epoch() (a refit failed in flight elsewhere); both take the group lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "executor/executor.h"
#include "executor/probe.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "refit/rank.h"
#include "refit/session.h"
#include "runtime/failure.h"
#include "runtime/traffic.h"

namespace refit {

// Where a rank's components come from. Settings the components need from the environment (the
// run secret, the mailbox's lanes and spin, the CPU plane's threads, the host identity, the run
// id) are read once, by default_services(), and captured here: nothing below reads them again.
struct RankServices {
  // (host, port, ranks): binds the store for `ranks` ranks (0 = any port, the server says which).
  std::function<Result<std::unique_ptr<StoreServer>>(const std::string& host, int port, int ranks)>
      start_store;
  ConnectStoreFn connect_store;  // adds the run's keys to the options
  // Adds the run's keys and the control settings (lanes, spin, host identity) to the options.
  std::function<Result<std::unique_ptr<Mailbox>>(Store& store, MailboxOptions options)>
      open_mailbox;
  std::function<Result<std::unique_ptr<DataPlane>>(const Config& config, int device)> make_plane;
  // The plane's settings (REFIT_CPU_THREADS, REFIT_COPY_ENGINE, REFIT_DEVICE) that make_plane
  // uses, and which picks the rank's device.
  PlaneSettings plane_settings;
  // Acts at fixed points of each refit (fault injection, executor/probe.h); null: none.
  std::shared_ptr<RefitProbe> probe;
  // Whether the control plane is authenticated (the run has a secret): logged at setup.
  bool authenticated = false;
  // Which host this process is on (env::host_identity): peers on the same one can map each
  // other's memory. Published at setup and compared with the peers'.
  std::string host_identity;
  // The run's id (REFIT_RUN_ID), which trainer rank 0 stores for every rank; nullopt: it makes
  // one of its process id and the time.
  std::optional<std::string> run_id;
};
// The real components, with this process's settings.
Result<RankServices> default_services();
// What Trainer::create and Engine::create use: the REFIT_* variables checked (a bad value is a
// setup error, before joining) and default_services().
Result<RankServices> services_from_environment();

// The rank `self` names exists in `config` (trainer: below policy.world_size; engine: below
// engine_ranks()); the error names the rank and the range.
Status check_rank_in_config(const Config& config, const RankId& self);

class RankCore {
 public:
  RankCore(const Config& config, RankId self, const Endpoint& endpoint, RankServices services);
  ~RankCore();
  RankCore(const RankCore&) = delete;
  RankCore& operator=(const RankCore&) = delete;

  const Config& config() const { return cfg_; }
  const RankId& self() const { return self_; }
  std::string id() const { return self_.name(); }  // "trainer rank 0", "engine 1 tp rank 0"
  const Endpoint& endpoint() const { return ep_; }
  std::chrono::milliseconds timeout() const { return cfg_.refit.timeout(); }
  RefitProbe& probe() { return services_.probe ? *services_.probe : RefitProbe::none(); }

  // The owner's setup: runs `setup` through the failure latch, tells the adopted executor how long
  // it took, and (once it succeeded) starts the peer watch (watch_peers).
  Status set_up(const std::function<Status()>& setup);
  // The executor the owner made: it gets the rank's probe, is aborted with the groups, and learns
  // its setup time from set_up.
  void adopt(ExecutorBase& executor);
  // Which executors refit.executor chose (decided once, at construction).
  const ExecutorKind& executor_kind() const { return kind_; }
  // What a gather executor uses of this rank (after connect()).
  GatherLinks gather_links();

  // Runs `body` through the failure latch (runtime/failure.h): a failure is traced to the run's
  // root cause, recorded, the collectives are closed, and every later call returns it.
  Status guarded(const std::function<Status()>& body);
  bool session_ok() const { return latch_.status().ok(); }
  const Status& failure() const { return latch_.status(); }
  // Engine/Trainer::fail: ends the session with the caller's own `cause`, recorded as this
  // rank's failure (no wait for the heartbeat watch: the cause is known).
  Status fail(const Status& cause);
  // Engine/Trainer::note_error: keeps `error` under noted_error_key(self) for the peers' liveness
  // checks, until forget_noted_error() (a refit of this rank succeeded).
  void note_error(const Status& error);
  void forget_noted_error();

  // Setup of everything shared: the data plane on the rank's device, the store (trainer rank 0
  // starts it), the liveness connections and heartbeat, the run id, the mailbox, and the probe's
  // setup point. Waits on the store from here on end when a peer or the store's host is gone.
  Status connect();
  // After setup: the heartbeat watch also wakes this rank's collectives when a peer falls silent
  // or the refit in flight fails elsewhere.
  void watch_peers();
  // Leaves on purpose: peers see "left", not a silent heartbeat.
  void leave();
  // The trainer ranks meet at `name` (once per session) through the store: each adds itself to
  // the count under `meet/<name>`, the last one sets `meet/<name>/all`, and with `wait` a rank
  // waits for that key (refit.timeout_s, ending early when a peer or the store's host is gone).
  // One add and one wait per rank, and no group: the transfer plan without FP8 forms no trainer
  // group.
  Status trainers_meet(const std::string& name, bool wait);
  // Publishes this rank's control-plane work (control_traffic()) for trainer rank 0's report:
  // each rank but trainer rank 0 does just before its last message or barrier of the session.
  Status publish_control_traffic();
  // This rank's control-plane work so far: requests on its main store connection, messages its
  // mailbox sent, and the part of each made inside refit_scope()s.
  ControlTraffic control_traffic() const;
  // Counts what the control plane does until the returned object is destroyed as refit work.
  class RefitScope {
   public:
    explicit RefitScope(RankCore& core);
    ~RefitScope();
    RefitScope(const RefitScope&) = delete;
    RefitScope& operator=(const RefitScope&) = delete;

   private:
    RankCore& core_;
    std::int64_t store0_, mailbox0_;
  };
  RefitScope refit_scope() { return RefitScope(*this); }
  // Every rank's published control-plane work, summed (trainer rank 0, once every rank left).
  Result<ControlTraffic> read_control_traffic();
  // Stops the heartbeat's watch: the owner calls this first when it is destroyed, so that the
  // watch cannot abort an executor being torn down. The beats go on until ~RankCore, which on
  // trainer rank 0 stops its store before it closes the heartbeat's connection.
  void stop_watching() {
    if (heartbeat_) heartbeat_->stop_checks();
  }

  DataPlane& plane() { return *plane_; }
  Store& store() { return *store_; }
  Mailbox& mailbox() { return *mailbox_; }
  const std::string& run_id() const { return run_id_; }
  // The store's port: on trainer rank 0 the one it bound (the system's choice when the endpoint's
  // port was 0), elsewhere the endpoint's.
  int store_port() const { return server_ ? server_->port() : ep_.master_port; }
  // The check every wait of this rank runs: the heartbeat watch's verdict and the refit epoch.
  std::function<Status()> alive() const;

  // Forms group `name` (this process rank `rank` of `size`) on the plane's backend; every wait in
  // it runs alive(). `wait`: how long to wait for the others (default refit.timeout_s).
  // `peers`: a group used only point to point connects these members alone (GroupOptions::peers).
  Result<std::unique_ptr<Communicator>> join_group(const std::string& name, int rank, int size,
                                                   std::chrono::milliseconds wait = {},
                                                   std::optional<std::vector<int>> peers = {});
  // The groups this rank keeps (closed on a failure, formed anew after a refit failed in flight):
  // the trainer group (trainer ranks) and the point-to-point group (every rank).
  enum class Group { kTrainer, kP2p };
  void hold(Group which, std::unique_ptr<Communicator> group);
  Communicator* group(Group which) const;
  // The transfer plan at setup: publishes this rank's host, reads each peer's, and says which
  // share it (each pair checked against refit.executor: check_pair_at_setup).
  Result<std::vector<bool>> same_host(const std::vector<RankId>& peers);
  // Forms and holds the point-to-point group when the chosen executors need one
  // (ExecutorKind::p2p_group); returns it, or null. `byte_peers`: the ranks this one exchanges
  // bytes with (its plan view's pairs), the only members it connects to.
  Result<Communicator*> join_p2p(const std::vector<RankId>& byte_peers);
  // Wakes every call blocked in a collective of this rank (safe from another thread).
  void abort_collectives();

  // Refits that fail in flight (docs/runtime.md, "A refit that fails in flight").
  const RefitEpochs& epochs() const { return epochs_; }
  // Whether the current epoch failed on another rank, or a peer already sent a message of a
  // later epoch: this rank must move to the next epoch too.
  bool behind() const;
  // `failure` of refit `step` in flight: when every rank is alive and it timed out or lost a
  // connection, or another rank recorded the refit's failure first, the epoch's recorded cause —
  // and this rank has moved to the next epoch (its old collectives aborted, its mailbox on the new
  // epoch). nullopt when the session must end.
  std::optional<FailureOrigin> settle_in_flight(int step, const Status& failure);
  // Moves to the next epoch without a failure of its own (the failure was seen elsewhere).
  void advance_epoch();
  // Forms the groups of the current epoch anew (every rank does now) and hands the new
  // point-to-point group (null when there is none) to `recover` (the executor's).
  Status reform_groups(const std::function<Status(Communicator* p2p)>& recover);

 private:
  void abort_locked();
  void abort_epoch(std::uint32_t epoch);

  const Config cfg_;
  const RankId self_;
  const Endpoint ep_;
  RankServices services_;
  const ExecutorKind kind_;
  std::unique_ptr<DataPlane> plane_;  // before every buffer and group made on it
  std::unique_ptr<StoreServer> server_;  // trainer rank 0
  std::unique_ptr<Store> store_;
  // Liveness checks and failure records: requests bounded by kBeatRequestTimeout.
  std::unique_ptr<Store> probe_store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::string run_id_;
  std::int64_t refit_store_requests_ = 0, refit_mailbox_messages_ = 0;  // RefitScope
  FailureLatch latch_;
  bool noted_ = false;  // an error is kept under noted_error_key(self_)
  RefitEpochs epochs_;
  mutable std::mutex groups_mu_;  // the groups: replaced here, aborted from the heartbeat's thread
  std::unique_ptr<Communicator> trainer_group_, p2p_group_;
  std::vector<int> p2p_peers_;  // the p2p group ranks join_p2p connects to, for reform_groups
  ExecutorBase* executor_ = nullptr;  // adopted: aborted with the groups
  std::uint32_t groups_epoch_ = 0;  // the refit epoch the groups were formed for
  // Last: destroyed first, so that its thread is gone before the collectives it may abort.
  std::unique_ptr<Heartbeat> heartbeat_;
};

}  // namespace refit
