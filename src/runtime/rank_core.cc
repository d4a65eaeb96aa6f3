#include "runtime/rank_core.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <thread>

#include "common/env.h"
#include "common/log.h"
#include "common/timer.h"
#include "control/auth.h"
#include "control/messages.h"
#include "executor/routes.h"
#include "plane/groups.h"

namespace refit {

Result<RankServices> default_services() {
  REFIT_ASSIGN_OR_RETURN(const std::shared_ptr<const ControlAuth> auth, process_control_auth());
  RankServices s;
  s.authenticated = auth != nullptr;
  REFIT_ASSIGN_OR_RETURN(const ControlSettings control, control_settings_from_environment());
  // Same-host lanes carry the heartbeats of the ranks on the store's host too.
  const std::string lanes_host = control.lanes ? control.host_identity : std::string();
  s.start_store = [auth, lanes_host](const std::string& host, int port, int ranks) {
    return StoreServer::start(StoreServerOptions{.host = host,
                                                 .port = port,
                                                 .auth = auth,
                                                 .ranks = ranks,
                                                 .lane_host_identity = lanes_host});
  };
  s.connect_store = [auth, lanes_host](const StoreClientOptions& options) {
    StoreClientOptions o = options;
    o.auth = auth;
    o.lane_host_identity = lanes_host;
    return connect_store(o);
  };
  s.open_mailbox = [auth, control](Store& store, MailboxOptions options) {
    options.auth = auth;
    options.settings = control;
    return Mailbox::open(store, std::move(options));
  };
  REFIT_ASSIGN_OR_RETURN(s.plane_settings, PlaneSettings::from_environment());
  s.host_identity = env::host_identity();
  REFIT_ASSIGN_OR_RETURN(s.run_id, env::run_id());
  s.make_plane = [settings = s.plane_settings](const Config& config, int device) {
    return make_data_plane(config, device, settings);
  };
  return s;
}

Result<RankServices> services_from_environment() {
  REFIT_RETURN_IF_ERROR(env::check());
  return default_services();
}

Status check_rank_in_config(const Config& config, const RankId& self) {
  if (self.is_trainer() && (self.rank < 0 || self.rank >= config.policy.world_size))
    return Status::InvalidArgument(fmt::format("trainer rank {} is outside policy.world_size {}",
                                               self.rank, config.policy.world_size));
  if (!self.is_trainer() && (self.rank < 0 || self.rank >= config.engine_ranks()))
    return Status::InvalidArgument(
        fmt::format("engine rank {} is outside 0..{} (engine index * generation.tp_size + tp rank)",
                    self.rank, config.engine_ranks() - 1));
  return Status::Ok();
}

RankCore::RankCore(const Config& config, RankId self, const Endpoint& endpoint,
                   RankServices services)
    : cfg_(config),
      self_(self),
      ep_(endpoint),
      services_(std::move(services)),
      kind_(refit::executor_kind(config)) {}

namespace {
void linger_after_failure(const RankServices& services, const std::string& host, int port,
                          const Config& cfg, const RankId& self);
}  // namespace

RankCore::~RankCore() {
  // Its checking thread may abort the groups: stopped before them (the owner's stop_watching()
  // usually did). Its beats go on while trainer rank 0 lingers after a failure.
  stop_watching();
  if (server_) {
    if (!latch_.status().ok())
      linger_after_failure(services_, ep_.master_addr, server_->port(), cfg_, self_);
    {
      // Before the store: their liveness function (alive()) reads the server.
      std::lock_guard<std::mutex> lock(groups_mu_);
      trainer_group_.reset();
      p2p_group_.reset();
    }
    if (heartbeat_) heartbeat_->stop();
    // The store goes before this rank's heartbeat connection closes. The other way round, a
    // peer's check between the two would read an exited trainer rank 0 from a store that still
    // answers; this way every peer reads the lost control plane.
    server_.reset();
  }
  heartbeat_.reset();
}

namespace {

// Trainer rank 0 hosts the store. When its session failed, the others still have to read the
// run's root cause there (error/first, which their next liveness check reads within 0.5 s); a
// store gone with its host would leave them only "lost the control plane", and a rank still
// starting only "cannot reach the store server". So the store stays up until every other rank
// left, exited or fell silent for a second, at most kPeerSilence (also while a rank has not
// joined yet).
void linger_after_failure(const RankServices& services, const std::string& host, int port,
                          const Config& cfg, const RankId& self) {
  if (!services.connect_store) return;
  const auto until = std::chrono::steady_clock::now() + kPeerSilence;
  Result<std::unique_ptr<Store>> own = services.connect_store(
      StoreClientOptions{.host = host,
                         .port = port,
                         .connect_timeout = std::chrono::seconds(1),
                         .request_timeout = std::chrono::seconds(1),
                         .auth = nullptr});
  if (!own.ok()) return;
  std::vector<std::string> keys;  // every other rank's heartbeat (runtime/failure.cc)
  for (const RankId& r : rank_ids(cfg))
    if (r != self) keys.push_back("heartbeat/" + r.mailbox());
  int rounds = 0;
  while (std::chrono::steady_clock::now() < until) {
    Result<Store::Watched> w = (*own)->watch(keys, "heartbeat/", std::chrono::seconds(1));
    if (!w.ok()) return;
    std::size_t gone = 0;
    // A rank that never joined may still be starting (an engine launched after the trainers):
    // it reads the cause at its setup, so it is waited for too, until kPeerSilence.
    for (const std::optional<std::string>& v : w->values)
      if (v && *v == "left") ++gone;
    for (const Store::Stale& k : w->stale)  // exited or stopped (not this rank's own)
      if (std::find(keys.begin(), keys.end(), k.key) != keys.end()) ++gone;
    if (gone >= keys.size()) break;
    ++rounds;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (rounds > 0)
    log::debug("{}: kept the store up {} round(s) after the failure, until the others were gone",
               self.name(), rounds);
}

}  // namespace

Status RankCore::set_up(const std::function<Status()>& setup) {
  Timer timer;
  const Status st = guarded(setup);
  if (executor_ != nullptr) executor_->set_setup_seconds(timer.seconds());
  if (st.ok()) watch_peers();
  return st;
}

void RankCore::adopt(ExecutorBase& executor) {
  executor.set_probe(&probe());
  std::lock_guard<std::mutex> lock(groups_mu_);  // abort_locked reads it on the heartbeat's thread
  executor_ = &executor;
}

GatherLinks RankCore::gather_links() {
  return GatherLinks{.mailbox = mailbox_.get(),
                     .store = store_.get(),
                     .plane = plane_.get(),
                     .run_id = run_id_,
                     .join_group = [this](const char* name, int rank, int size) {
                       return join_group(name, rank, size);
                     }};
}

Status RankCore::guarded(const std::function<Status()>& body) {
  if (!latch_.status().ok()) return latch_.status();
  const Status st = body();
  if (st.ok()) return st;
  // Failures are recorded over the probe connection, whose requests end within seconds even when
  // the store's host is stopped (store_ would wait up to refit.timeout_s: never used here).
  // Chosen once the body ran:
  // a setup that failed after connecting (a disagreement) has a store to record it in.
  return latch_.guard(
      [&] { return st; }, probe_store_.get(), self_,
      [this] { abort_collectives(); },
      [this] {
        // Before the heartbeat exists (early setup) there is no watch to wait for.
        return heartbeat_ ? heartbeat_->verdict() : Status::Unsupported("no heartbeat watch yet");
      });
}

Status RankCore::fail(const Status& cause) {
  if (!latch_.status().ok()) return latch_.status();
  return latch_.guard([&] { return cause; }, probe_store_.get(), self_,
                      [this] { abort_collectives(); });
}

void RankCore::note_error(const Status& error) {
  if (!probe_store_ || error.ok()) return;
  noted_ = probe_store_->set(noted_error_key(self_), encode_failure(failure_of(self_, error))).ok();
}

void RankCore::forget_noted_error() {
  if (!noted_ || !probe_store_) return;
  noted_ = !probe_store_->set(noted_error_key(self_), "").ok();
}

Status RankCore::connect() {
  const int device =
      default_device(cfg_, self_.is_trainer(), self_.rank, services_.plane_settings);
  REFIT_ASSIGN_OR_RETURN(plane_, services_.make_plane(cfg_, device));
  const bool hosts_store = self_ == RankId::trainer(0);
  if (hosts_store) {
    REFIT_ASSIGN_OR_RETURN(server_,
                           services_.start_store(ep_.master_addr, ep_.master_port,
                                                 cfg_.policy.world_size + cfg_.engine_ranks()));
    log::info("control plane: store on {}:{}{}, {}", ep_.master_addr, server_->port(),
              ep_.master_port == 0 ? " (port 0: the system chose it; give the other ranks "
                                     "REFIT_PORT=" +
                                         std::to_string(server_->port()) + ")"
                                   : std::string(),
              services_.authenticated
                  ? "authenticated (CURVE, keys from the run secret)"
                  : "unauthenticated (loopback only; set REFIT_SECRET to authenticate)");
  }
  const int port = store_port();
  REFIT_ASSIGN_OR_RETURN(store_, services_.connect_store(StoreClientOptions{
                                     .host = ep_.master_addr,
                                     .port = port,
                                     .connect_timeout = timeout(),
                                     .request_timeout = timeout(),
                                     .auth = nullptr}));
  REFIT_ASSIGN_OR_RETURN(
      LivenessConnections live,
      connect_liveness(services_.connect_store, ep_.master_addr, port, self_, timeout()));
  probe_store_ = std::move(live.probe);
  heartbeat_ = std::move(live.heartbeat);
  // From now on a stopped store host or a silent peer ends this rank's store requests, on which
  // setup waits (runtime/failure.h); once set up, its collectives too (watch_peers()).
  heartbeat_->watch(self_, rank_ids(cfg_), [this](const Status& why) { store_->abort(why); });
  if (hosts_store) {
    REFIT_RETURN_IF_ERROR(store_->set(
        "run_id", services_.run_id.value_or(fmt::format("{}-{}", getpid(), time(nullptr)))));
  }
  REFIT_ASSIGN_OR_RETURN(run_id_, store_->get("run_id", timeout()));
  REFIT_ASSIGN_OR_RETURN(mailbox_, services_.open_mailbox(*store_, MailboxOptions{
                                                            .id = self_.mailbox(),
                                                            .host = ep_.host,
                                                            .timeout = timeout(),
                                                            .auth = nullptr,
                                                            .settings = {},
                                                            .lane_limits = {}}));
  mailbox_->set_liveness_check(alive(), std::chrono::milliseconds(500));
  probe().at_setup();
  return Status::Ok();
}

void RankCore::watch_peers() {
  heartbeat_->watch(
      self_, rank_ids(cfg_),
      [this](const Status& why) {
        store_->abort(why);
        abort_collectives();
      },
      &epochs_, [this](std::uint32_t epoch) { abort_epoch(epoch); });
}

Status RankCore::trainers_meet(const std::string& name, bool wait) {
  const int world = cfg_.policy.world_size;
  if (world == 1) return Status::Ok();
  const std::string key = "meet/" + name;
  REFIT_ASSIGN_OR_RETURN(const std::int64_t arrived, store_->add(key, 1));
  if (arrived == world) REFIT_RETURN_IF_ERROR(store_->set(key + "/all", "1"));
  if (!wait) return Status::Ok();
  return get_while_alive(*store_, key + "/all", timeout(), alive())
      .status()
      .with_context(fmt::format("{}: waiting for every trainer rank at {}", id(), name));
}

void RankCore::leave() {
  if (heartbeat_) heartbeat_->leave();
}

namespace {
std::string control_key(const RankId& rank) { return "control/" + rank.mailbox(); }
}  // namespace

ControlTraffic RankCore::control_traffic() const {
  return ControlTraffic{.store_requests = store_ ? store_->requests() : 0,
                        .mailbox_messages = mailbox_ ? mailbox_->sent() : 0,
                        .refit_store_requests = refit_store_requests_,
                        .refit_mailbox_messages = refit_mailbox_messages_,
                        .busiest_refit_mailbox_messages = refit_mailbox_messages_};
}

RankCore::RefitScope::RefitScope(RankCore& core)
    : core_(core),
      store0_(core.store_ ? core.store_->requests() : 0),
      mailbox0_(core.mailbox_ ? core.mailbox_->sent() : 0) {}

RankCore::RefitScope::~RefitScope() {
  if (core_.store_) core_.refit_store_requests_ += core_.store_->requests() - store0_;
  if (core_.mailbox_) core_.refit_mailbox_messages_ += core_.mailbox_->sent() - mailbox0_;
}

Status RankCore::publish_control_traffic() {
  // The set itself is counted: it is this rank's last store request of the session.
  ControlTraffic t = control_traffic();
  ++t.store_requests;
  return store_->set(control_key(self_),
                     fmt::format("{} {} {} {}", t.store_requests, t.mailbox_messages,
                                 t.refit_store_requests, t.refit_mailbox_messages));
}

Result<ControlTraffic> RankCore::read_control_traffic() {
  std::vector<RankId> others = rank_ids(cfg_);
  std::erase(others, self_);
  std::vector<std::string> keys;
  for (const RankId& r : others) keys.push_back(control_key(r));
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::optional<std::string>> values,
                         store_->try_get_many(keys));
  ControlTraffic sum = control_traffic();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    ControlTraffic t;
    if (!values[i] ||
        std::sscanf(values[i]->c_str(), "%" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64,
                    &t.store_requests, &t.mailbox_messages, &t.refit_store_requests,
                    &t.refit_mailbox_messages) != 4)
      return Status::NotFound(fmt::format(
          "{}: {} published no control-plane record ({}); it did not leave the session cleanly",
          id(), others[i].name(), keys[i]));
    sum.store_requests += t.store_requests;
    sum.mailbox_messages += t.mailbox_messages;
    sum.refit_store_requests += t.refit_store_requests;
    sum.refit_mailbox_messages += t.refit_mailbox_messages;
    sum.busiest_refit_mailbox_messages =
        std::max(sum.busiest_refit_mailbox_messages, t.refit_mailbox_messages);
  }
  return sum;
}

std::function<Status()> RankCore::alive() const {
  std::function<Status()> peers = rank_liveness(*heartbeat_, epochs_);
  if (!server_) return peers;
  // Trainer rank 0: the store it hosts has to be able to serve every rank, too.
  const StoreServer* server = server_.get();
  return [peers = std::move(peers), server]() -> Status {
    if (Status s = server->failure(); !s.ok()) return s;
    return peers();
  };
}

Result<std::unique_ptr<Communicator>> RankCore::join_group(const std::string& name, int rank,
                                                           int size,
                                                           std::chrono::milliseconds wait,
                                                           std::optional<std::vector<int>> peers) {
  return make_group(*store_,
                    GroupOptions{.name = name,
                                 .rank = rank,
                                 .size = size,
                                 .host = ep_.host,
                                 .timeout = wait.count() > 0 ? wait : timeout(),
                                 .liveness = alive(),
                                 .peers = std::move(peers)},
                    *plane_);
}

void RankCore::hold(Group which, std::unique_ptr<Communicator> group) {
  std::lock_guard<std::mutex> lock(groups_mu_);
  (which == Group::kTrainer ? trainer_group_ : p2p_group_) = std::move(group);
}

Communicator* RankCore::group(Group which) const {
  std::lock_guard<std::mutex> lock(groups_mu_);
  return (which == Group::kTrainer ? trainer_group_ : p2p_group_).get();
}

Result<std::vector<bool>> RankCore::same_host(const std::vector<RankId>& peers) {
  REFIT_RETURN_IF_ERROR(publish_host(*store_, self_.mailbox(), services_.host_identity));
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::string> hosts,
                         read_hosts(*store_, mailbox_ids(peers), timeout(), alive()));
  std::vector<bool> same;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    same.push_back(hosts[i] == services_.host_identity);
    const int trainer = self_.is_trainer() ? self_.rank : peers[i].rank;
    const int engine = self_.is_trainer() ? peers[i].rank : self_.rank;
    REFIT_RETURN_IF_ERROR(check_pair_at_setup(cfg_, same.back(), trainer, engine));
  }
  return same;
}

Result<Communicator*> RankCore::join_p2p(const std::vector<RankId>& byte_peers) {
  if (!kind_.p2p_group) return static_cast<Communicator*>(nullptr);
  const int rank =
      self_.is_trainer() ? p2p_rank_of_trainer(self_.rank) : p2p_rank_of_engine(cfg_, self_.rank);
  // Only the pairs that exchange bytes are connected (setup costs O(peers) per rank, not
  // O(ranks)); a rank without any still forms the group, connected to no one.
  p2p_peers_.clear();
  for (const RankId& p : byte_peers)
    p2p_peers_.push_back(p.is_trainer() ? p2p_rank_of_trainer(p.rank)
                                        : p2p_rank_of_engine(cfg_, p.rank));
  std::sort(p2p_peers_.begin(), p2p_peers_.end());
  p2p_peers_.erase(std::unique(p2p_peers_.begin(), p2p_peers_.end()), p2p_peers_.end());
  REFIT_ASSIGN_OR_RETURN(auto p2p, join_group("p2p", rank,
                                              cfg_.policy.world_size + cfg_.engine_ranks(), {},
                                              p2p_peers_));
  hold(Group::kP2p, std::move(p2p));
  return group(Group::kP2p);
}

void RankCore::abort_collectives() {
  std::lock_guard<std::mutex> lock(groups_mu_);
  abort_locked();
}

void RankCore::abort_locked() {
  if (trainer_group_) trainer_group_->abort();
  if (p2p_group_) p2p_group_->abort();
  if (executor_ != nullptr) executor_->abort();
}

// The refit of `epoch` failed in flight (the heartbeat watch saw it): wakes the collectives of
// that epoch, not those already formed for the next.
void RankCore::abort_epoch(std::uint32_t epoch) {
  std::lock_guard<std::mutex> lock(groups_mu_);
  if (groups_epoch_ == epoch) abort_locked();
}

bool RankCore::behind() const {
  return epochs_.failed().has_value() || mailbox_->kept_epoch() > epochs_.current();
}

std::optional<FailureOrigin> RankCore::settle_in_flight(int step, const Status& failure) {
  if (!heartbeat_ || !probe_store_) return std::nullopt;
  const std::optional<FailureOrigin> cause =
      in_flight_cause(epochs_, *probe_store_, self_, failure,
                      mailbox_->kept_epoch() > epochs_.current(),
                      [this] { return heartbeat_->verdict(); });
  if (!cause) return std::nullopt;
  log::warn("{}: refit step {} failed in flight with every rank alive ({}: {}); forming the "
            "groups anew for refit epoch {}",
            id(), step, cause->rank.name(), cause->error, epochs_.current() + 1);
  advance_epoch();
  return cause;
}

void RankCore::advance_epoch() {
  abort_epoch(epochs_.current());
  epochs_.advance();
  mailbox_->set_epoch(epochs_.current());
}

Status RankCore::reform_groups(const std::function<Status(Communicator* p2p)>& recover) {
  const std::uint32_t epoch = epochs_.current();
  const auto named = [epoch](const char* base) { return fmt::format("{}.{}", base, epoch); };
  const auto wait = kReformWait * cfg_.refit.timeout();
  std::unique_ptr<Communicator> trainer, p2p;
  if (group(Group::kTrainer) != nullptr) {
    REFIT_ASSIGN_OR_RETURN(trainer, join_group(named("trainer"), self_.rank,
                                               cfg_.policy.world_size, wait));
  }
  if (group(Group::kP2p) != nullptr) {
    const int rank = self_.is_trainer() ? p2p_rank_of_trainer(self_.rank)
                                        : p2p_rank_of_engine(cfg_, self_.rank);
    REFIT_ASSIGN_OR_RETURN(p2p, join_group(named("p2p"), rank,
                                           cfg_.policy.world_size + cfg_.engine_ranks(), wait,
                                           p2p_peers_));
  }
  REFIT_RETURN_IF_ERROR(recover(p2p.get()).with_context(id()));
  std::lock_guard<std::mutex> lock(groups_mu_);
  if (trainer) std::swap(trainer_group_, trainer);
  if (p2p) std::swap(p2p_group_, p2p);
  groups_epoch_ = epoch;
  return Status::Ok();  // the old groups go here
}

}  // namespace refit
