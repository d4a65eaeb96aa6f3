#include "runtime/failure.h"

#include <fmt/format.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>

#include "common/log.h"
#include "control/messages.h"
#include "control/store.h"
#include "refit/config.h"

namespace refit {
namespace {

constexpr const char* kFirstFailure = "error/first";
constexpr const char* kHeartbeatPrefix = "heartbeat/";

std::string heartbeat_key(const RankId& rank) { return kHeartbeatPrefix + rank.mailbox(); }

// The store's record of a failure; a record this build cannot read (a bug) is kept as its text.
FailureOrigin read_record(const std::string& encoded) {
  Result<FailureOrigin> f = decode_failure(encoded, "the store");
  if (f.ok()) return *f;
  // Blamed on the store's host, whose store holds it.
  return FailureOrigin{.rank = RankId::trainer(0),
                       .code = StatusCode::kInternal,
                       .error = "unreadable failure record in the store: " + f.status().message()};
}

}  // namespace

FailureOrigin failure_of(const RankId& who, const Status& status) {
  if (const FailureOrigin* o = status.origin(); o != nullptr && !(o->rank == who)) return *o;
  return FailureOrigin{
      .rank = who, .code = status.code(), .kind = status.kind(), .error = status.to_string()};
}

std::string noted_error_key(const RankId& who) { return "error/rank/" + who.mailbox(); }

void announce_failure(Store* store, const FailureOrigin& failure) {
  if (store == nullptr) return;
  auto n = store->add("error/count", 1);
  if (n.ok() && *n == 1) (void)store->set(kFirstFailure, encode_failure(failure));
}

std::string RefitEpochs::key(std::uint32_t epoch) { return fmt::format("refit/failed/{}", epoch); }

std::uint32_t RefitEpochs::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

std::optional<FailureOrigin> RefitEpochs::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

FailureOrigin RefitEpochs::record(Store& store, const FailureOrigin& cause) {
  const std::uint32_t epoch = current();
  if (auto known = failed()) return *known;
  std::string recorded = encode_failure(cause);
  auto n = store.add(fmt::format("refit/failures/{}", epoch), 1);
  if (n.ok() && *n == 1) {
    (void)store.set(key(epoch), recorded);
  } else if (n.ok()) {
    // Another rank was first: its cause, which it writes right after its add.
    auto first = store.get(key(epoch), std::chrono::seconds(2));
    if (first.ok()) recorded = *first;
  }
  (void)seen(epoch, recorded);
  return failed().value_or(cause);
}

bool RefitEpochs::seen(std::uint32_t epoch, const std::string& encoded) {
  std::lock_guard<std::mutex> lock(mu_);
  if (epoch != epoch_ || failed_.has_value()) return false;
  failed_ = read_record(encoded);
  return true;
}

void RefitEpochs::advance() {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  failed_.reset();
}

namespace {

using Clock = std::chrono::steady_clock;

// One rank's liveness check: the keys its read asks the store for, and what each answer means
// (liveness verdicts: failure.h, Heartbeat::watch). The heartbeat thread makes the reads, the
// checking thread judges them.
class LivenessCheck {
 public:
  LivenessCheck(const RankId& who, std::vector<RankId> peers, RefitEpochs* epochs,
                std::function<void(std::uint32_t)> on_refit_failed)
      : who_(who), epochs_(epochs), on_refit_failed_(std::move(on_refit_failed)) {
    std::erase(peers, who);
    // The peers by heartbeat key: the store names the stale keys, this check names their ranks.
    for (const RankId& peer : peers) by_key_.emplace(heartbeat_key(peer), peer);
  }

  // The keys of the next read: the run's first failure and, with epochs, the current refit
  // epoch's (`*epoch`). Safe from any thread.
  std::vector<std::string> keys(std::uint32_t* epoch) const {
    std::vector<std::string> keys{kFirstFailure};
    *epoch = epochs_ != nullptr ? epochs_->current() : 0;
    if (epochs_ != nullptr) keys.push_back(RefitEpochs::key(*epoch));
    return keys;
  }

  // Whether `read` says nothing but that every peer lives: no failure, no stale heartbeat. Such
  // a read needs no verdict (judge() would return Ok and do nothing else), so the beat thread
  // does not wake the checking thread for it.
  bool quiet(const Result<Store::Watched>& read) const {
    return read.ok() && read->values.size() == (epochs_ != nullptr ? 2u : 1u) &&
           !read->values[0].has_value() &&
           (epochs_ == nullptr || !read->values.back().has_value()) && read->stale.empty();
  }

  // The verdict on one read, made for `epoch`. `store` (the probe connection) serves what a
  // failure needs besides: the error a lost peer noted, the failure's record. Called from one
  // thread at a time.
  Status judge(Store& store, const Result<Store::Watched>& read, std::uint32_t epoch) {
    if (!read.ok()) return failed(store, read.status());
    const std::vector<std::optional<std::string>>& values = read->values;
    if (values.size() != (epochs_ != nullptr ? 2u : 1u))
      return Status::Internal(fmt::format("liveness read of {}: {} values for its keys",
                                          who_.name(), values.size()));
    if (epochs_ != nullptr) {
      const std::optional<std::string>& refit = values.back();
      if (refit.has_value() && epochs_->seen(epoch, *refit) && on_refit_failed_)
        on_refit_failed_(epoch);
    }
    if (const std::optional<std::string>& first = values[0]; first.has_value()) {
      const FailureOrigin o = read_record(*first);
      if (!(o.rank == who_))
        return Status::Aborted("aborted because " + o.describe()).with_origin(o);
    }
    for (const Store::Stale& s : read->stale) {
      const auto it = by_key_.find(s.key);
      if (it == by_key_.end()) continue;  // this rank, or no rank of this run
      const FailureOrigin gone = lost_peer(store, it->second, s);
      announce_failure(&store, gone);
      // The same words as every rank that reads the record: one line to grep for, whoever saw it.
      return Status::Aborted("aborted because " + gone.describe()).with_origin(gone);
    }
    return Status::Ok();
  }

 private:
  // A read that failed: the connection is gone, or the store did not answer it within
  // kPeerSilence (the read's own timeout: a busy store answers late, and only a store silent that
  // long is taken for stopped). Both fatal.
  Status failed(Store& store, const Status& why) {
    const RankId store_host = RankId::trainer(0);
    // Refused, not lost: this rank's heartbeat key holds no counter (another process of the same
    // rank left under it). This rank's own failure.
    if (why.code() == StatusCode::kInvalidArgument &&
        why.message().find("is not an integer") != std::string::npos)
      return Status::Aborted(fmt::format("{}: the store refused its heartbeat: {}", who_.name(),
                                         why.message()));
    if (why.code() != StatusCode::kTimeout) {
      // Blamed on the store's host: its process is gone or cut off (had it failed on its own,
      // its store would have outlived it until this rank read why: linger_after_failure).
      const FailureOrigin o{
          .rank = store_host,
          .code = StatusCode::kAborted,
          .kind = FailureKind::kPeerLost,
          .error = fmt::format("lost the control plane (the store it hosts; seen by {}): {}",
                               who_.name(), why.to_string())};
      return Status::Aborted("aborted because " + o.describe()).with_origin(o);
    }
    const FailureOrigin o{
        .rank = store_host,
        .code = StatusCode::kAborted,
        .kind = FailureKind::kPeerLost,
        .error = fmt::format("the store it hosts did not answer for {:.1f} s (stopped, hung or "
                             "cut off; seen by {}): {}",
                             kPeerSilence.count() / 1000.0, who_.name(), why.to_string())};
    const Status silent =
        Status::Aborted("aborted because " + o.rank.name() + ": " + o.error).with_origin(o);
    // A failing rank's last words (its failure record, the root cause) then fail at once instead
    // of each waiting out its own timeout.
    store.abort(silent);
    return silent;
  }

  // Peer `peer`, whose heartbeat the store reported stale as `s`, with the error it kept before
  // it went (a refused registration), when it kept one.
  FailureOrigin lost_peer(Store& store, const RankId& peer, const Store::Stale& s) const {
    // Closed: the kernel closed its connections (it exited or was killed), told at once.
    // Otherwise its heartbeat stood still with the connection open.
    const char* state = s.closed ? "exited" : "stopped";
    const std::string detail =
        s.closed ? fmt::format("its connection to the control plane closed without leaving "
                               "(seen by {}; the process exited or was killed)",
                               who_.name())
                 : fmt::format("no heartbeat for {:.1f} s (seen by {}; the process is stopped, "
                               "hung or cut off)",
                               std::chrono::duration<double>(s.age).count(), who_.name());
    std::string noted_error;
    if (auto noted = store.try_get(noted_error_key(peer));
        noted.ok() && noted->has_value() && !(*noted)->empty())
      noted_error = fmt::format(" after its error: {};", read_record(**noted).error);
    return FailureOrigin{.rank = peer,
                         .code = StatusCode::kAborted,
                         .kind = FailureKind::kPeerLost,
                         .error = noted_error.empty()
                                      ? fmt::format("aborted: {}: {}", state, detail)
                                      : fmt::format("aborted: {}{} {}", state, noted_error, detail)};
  }

  const RankId who_;
  std::map<std::string, RankId> by_key_;
  RefitEpochs* const epochs_;
  const std::function<void(std::uint32_t)> on_refit_failed_;
};

}  // namespace

struct Heartbeat::State {
  std::unique_ptr<Store> own;
  Store& beats;
  Store& checks;
  std::string key;
  std::mutex mu;
  std::condition_variable beat_cv, check_cv;
  bool stop = false;         // the beats
  bool stop_checks = false;  // the checks (set whenever `stop` is)
  std::thread beat_thread, check_thread;
  std::shared_ptr<LivenessCheck> check;         // set by watch(), until it fails
  std::function<void(const Status&)> on_lost;  // called once, when check fails
  Status lost;                                  // the failed check (guarded by mu)
  // The latest read the beat thread made for `check`, until the checking thread takes it.
  struct Read {
    std::shared_ptr<LivenessCheck> check;
    std::uint32_t epoch;
    Result<Store::Watched> answer;
  };
  std::optional<Read> read;
  std::int64_t judged = 0;  // reads handed to the checking thread (guarded by mu)

  // Every kHeartbeatInterval, one request: adds 1 to the key and, once watch() set a check, reads
  // what the check needs in the same request, for the checking thread to judge (a quiet read,
  // every peer alive, needs no judging). Nothing else runs here: a check busy with a failure (its
  // follow-up requests, on_lost) never holds up a beat.
  void beat() {
    std::unique_lock<std::mutex> lock(mu);
    Clock::time_point last{};
    double last_took = 0;  // seconds the previous beat's request took
    while (!stop) {
      const std::shared_ptr<LivenessCheck> c = stop_checks ? nullptr : check;
      lock.unlock();
      const Clock::time_point now = Clock::now();
      if (c != nullptr) {
        std::uint32_t epoch = 0;
        const std::vector<std::string> keys = c->keys(&epoch);
        Result<Store::Watched> answer =
            beats.beat_and_watch(key, keys, kHeartbeatPrefix, kPeerSilence, kPeerSilence);
        if (!c->quiet(answer)) {
          lock.lock();
          if (check == c && !stop_checks) {
            read.emplace(Read{c, epoch, std::move(answer)});
            ++judged;
            check_cv.notify_one();
          }
          lock.unlock();
        }
      } else {
        (void)beats.add(key, 1);  // a store that is gone is the liveness check's to report
      }
      // A beat this late is most of the way to kPeerSilence: say so before a peer does.
      if (last != Clock::time_point{} && now - last > kPeerSilence / 2)
        log::warn("heartbeat '{}': {:.1f} s since the previous beat (whose request took {:.2f} "
                  "s); this process was starved or stopped, or the store answered late",
                  key, std::chrono::duration<double>(now - last).count(), last_took);
      last = now;
      last_took = std::chrono::duration<double>(Clock::now() - now).count();
      lock.lock();
      beat_cv.wait_for(lock, kHeartbeatInterval, [this] { return stop; });
    }
  }

  // Judges each read the beat thread hands over, until a check fails or the checks stop.
  void run_checks() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      check_cv.wait(lock, [this] { return stop_checks || read.has_value(); });
      if (stop_checks) return;
      Read r = std::move(*read);
      read.reset();
      if (r.check != check) continue;  // made for a check watch() replaced since
      lock.unlock();
      const Status st = r.check->judge(checks, r.answer, r.epoch);
      lock.lock();
      if (!st.ok() && check) {
        lost = st;
        auto tell = std::move(on_lost);
        check = nullptr;
        on_lost = nullptr;
        lock.unlock();
        if (tell) tell(st);
        lock.lock();
      }
    }
  }

  // Ends the checks (on_lost is not called from here on) and, with `beats`, the beats too.
  void halt(bool beats) {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop_checks = true;
      stop = stop || beats;
    }
    beat_cv.notify_all();
    check_cv.notify_all();
    if (beats && beat_thread.joinable()) beat_thread.join();
    if (check_thread.joinable()) check_thread.join();
  }
};

Heartbeat::Heartbeat(std::unique_ptr<Store> store, Store* checks, const RankId& who) {
  Store& beats = *store;
  s_.reset(new State{std::move(store), beats, checks != nullptr ? *checks : beats,
                     heartbeat_key(who)});
  s_->beat_thread = std::thread([s = s_.get()] { s->beat(); });
  s_->check_thread = std::thread([s = s_.get()] { s->run_checks(); });
}

Heartbeat::~Heartbeat() { s_->halt(/*beats=*/true); }

void Heartbeat::stop() { s_->halt(/*beats=*/true); }

void Heartbeat::stop_checks() { s_->halt(/*beats=*/false); }

void Heartbeat::leave() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->stop) return;
  }
  s_->halt(/*beats=*/true);
  (void)s_->beats.set(s_->key, "left");
}

void Heartbeat::watch(const RankId& who, std::vector<RankId> peers,
                      std::function<void(const Status&)> on_lost, RefitEpochs* epochs,
                      std::function<void(std::uint32_t)> on_refit_failed) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->check = std::make_shared<LivenessCheck>(who, std::move(peers), epochs,
                                                std::move(on_refit_failed));
    s_->on_lost = std::move(on_lost);
  }
  // The next beat (within kHeartbeatInterval) reads for it.
}

Status Heartbeat::verdict() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->lost;
}

std::int64_t Heartbeat::judged() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->judged;
}

Result<LivenessConnections> connect_liveness(const ConnectStoreFn& connect,
                                             const std::string& host, int port, const RankId& who,
                                             std::chrono::milliseconds connect_timeout) {
  LivenessConnections c;
  const StoreClientOptions o{.host = host,
                             .port = port,
                             .connect_timeout = connect_timeout,
                             .request_timeout = kBeatRequestTimeout,
                             .auth = nullptr};
  REFIT_ASSIGN_OR_RETURN(c.probe, connect(o));
  // The beats take a same-host lane to the store's process where there is one (a store on this
  // host, lanes on: control/store_lanes.h).
  StoreClientOptions beat = o;
  beat.lane_id = who.mailbox();
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Store> beats, connect(beat));
  c.heartbeat = std::make_unique<Heartbeat>(std::move(beats), c.probe.get(), who);
  return c;
}

std::vector<RankId> rank_ids(const Config& config) {
  std::vector<RankId> ids;
  for (int r = 0; r < config.policy.world_size; ++r) ids.push_back(RankId::trainer(r));
  for (int g = 0; g < config.engine_ranks(); ++g)
    ids.push_back(RankId::engine(g, config.generation.tp_size));
  return ids;
}

Status with_root_cause(Store* store, const RankId& who, const Status& status) {
  if (store == nullptr || status.ok()) return status;
  auto first = store->try_get(kFirstFailure);
  if (!first.ok() || !first->has_value()) return status;
  const FailureOrigin cause = read_record(**first);
  if (cause.rank == who) return status;  // the root cause is this process itself
  if (const FailureOrigin* known = status.origin(); known != nullptr && known->rank == cause.rank)
    return status;
  // The cause already travelled in the text (through a library that keeps only messages).
  if (status.message().find(cause.describe()) != std::string::npos) return status.with_origin(cause);
  return Status(StatusCode::kAborted, fmt::format("aborted because {} (seen here as: {})",
                                                  cause.describe(), status.to_string()))
      .with_origin(cause);
}

namespace {
constexpr std::string_view kStillUsable = " (the session stays usable: ";
}  // namespace

Status failed_refit(StatusCode code, int step, const std::string& version,
                    const FailureOrigin& origin) {
  return Status(code, fmt::format("refit step {}: the engines did not publish version '{}': {} "
                                  "reported: {}{}the next refit publishes a new version)",
                                  step, version, origin.rank.name(), origin.error, kStillUsable))
      .with_origin(origin);
}

Status failed_in_flight(int step, const std::string& version, const FailureOrigin& cause) {
  return Status::Aborted(fmt::format("refit step {} (version '{}') failed in flight: {} reported: "
                                     "{}{}every rank is alive; the groups were formed anew and "
                                     "the next refit publishes a new version)",
                                     step, version, cause.rank.name(), cause.error, kStillUsable))
      .with_origin(cause);
}

Blame blame_of(const FailureOrigin& origin) {
  return Blame{.process = origin.rank.name(),
               .role = role_name(origin.rank.role),
               .rank = origin.rank.rank,
               .message = origin.rank.name() + ": " + origin.error};
}

Blame blame_failure(const RankId& self, const Status& status) {
  return blame_of(failure_of(self, status));
}

std::function<Status()> rank_liveness(const Heartbeat& heartbeat, const RefitEpochs& epochs) {
  return [hb = &heartbeat, ep = &epochs]() -> Status {
    REFIT_RETURN_IF_ERROR(hb->verdict());
    if (auto cause = ep->failed())
      return Status::Aborted("the refit in flight failed: " + cause->rank.name() + ": " +
                             cause->error)
          .with_origin(*cause);
    return Status::Ok();
  };
}

Status settle_verdict(const Status& failure, const std::function<Status()>& verdict,
                      const std::function<bool()>& settled) {
  if (!verdict) return Status::Ok();
  if (failure.code() != StatusCode::kTimeout && failure.code() != StatusCode::kIOError)
    return verdict();
  const auto until = std::chrono::steady_clock::now() + kPeerSilence + std::chrono::seconds(1);
  Status v = verdict();
  while (v.ok() && std::chrono::steady_clock::now() < until && !(settled && settled())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    v = verdict();
  }
  return v;
}

std::optional<FailureOrigin> in_flight_cause(RefitEpochs& epochs, Store& store,
                                             const RankId& who, const Status& failure,
                                             bool later_epoch,
                                             const std::function<Status()>& verdict) {
  const bool flagged = later_epoch || epochs.failed().has_value();
  if (!flagged && failure.code() != StatusCode::kTimeout &&
      failure.code() != StatusCode::kIOError)
    return std::nullopt;
  // Another rank recording the refit's failure meanwhile settles it too.
  if (!settle_verdict(flagged ? Status::Aborted("") : failure, verdict,
                      [&epochs] { return epochs.failed().has_value(); })
           .ok())
    return std::nullopt;
  return epochs.record(store, failure_of(who, failure));
}

Status FailureLatch::guard(const std::function<Status()>& step, Store* store, const RankId& who,
                           const std::function<void()>& close_collectives,
                           const std::function<Status()>& verdict) {
  if (!failed_.ok()) return failed_;
  Status st = step();
  if (st.ok()) return st;
  // The watch announces a silent peer under "error/first", which with_root_cause then finds.
  (void)settle_verdict(st, verdict);
  st = with_root_cause(store, who, st);
  announce_failure(store, failure_of(who, st));
  close_collectives();
  failed_ = st;
  return st;
}

}  // namespace refit
