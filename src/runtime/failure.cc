#include "runtime/failure.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>

#include "control/store.h"
#include "refit/config.h"

namespace refit {

void announce_failure(Store* store, const std::string& who, const Status& status) {
  if (store == nullptr) return;
  const std::string cause = fmt::format("{}: {}", who, status.to_string());
  auto n = store->add("error/count", 1);
  if (n.ok() && *n == 1) (void)store->set("error/first", cause);
}

std::string RefitEpochs::key(std::uint32_t epoch) { return fmt::format("refit/failed/{}", epoch); }

std::uint32_t RefitEpochs::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

std::optional<std::string> RefitEpochs::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::string RefitEpochs::record(Store& store, const std::string& cause) {
  const std::uint32_t epoch = current();
  if (auto known = failed()) return *known;
  std::string recorded = cause;
  auto n = store.add(fmt::format("refit/failures/{}", epoch), 1);
  if (n.ok() && *n == 1) {
    (void)store.set(key(epoch), cause);
  } else if (n.ok()) {
    // Another rank was first: its cause, which it writes right after its add.
    auto first = store.get(key(epoch), std::chrono::seconds(2));
    if (first.ok()) recorded = *first;
  }
  (void)seen(epoch, recorded);
  return failed().value_or(recorded);
}

bool RefitEpochs::seen(std::uint32_t epoch, const std::string& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (epoch != epoch_ || failed_.has_value()) return false;
  failed_ = cause;
  return true;
}

void RefitEpochs::advance() {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  failed_.reset();
}

struct Heartbeat::State {
  std::unique_ptr<Store> own;
  Store& store;
  std::string key;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread thread;
  std::function<Status()> check;                // set by watch()
  std::function<void(const Status&)> on_lost;  // called once, when check fails
  Status lost;                                  // the failed check (guarded by mu)
};

Heartbeat::Heartbeat(std::unique_ptr<Store> store, std::string who) {
  Store& beats = *store;
  s_.reset(new State{std::move(store), beats, "heartbeat/" + who, {}, {}, false, {}, {}, {}, {}});
  s_->thread = std::thread([s = s_.get()] {
    std::unique_lock<std::mutex> lock(s->mu);
    while (!s->stop) {
      std::function<Status()> check = s->check;
      lock.unlock();
      (void)s->store.add(s->key, 1);  // a store that is gone is the liveness check's to report
      if (check) {
        const Status st = check();
        if (!st.ok()) {
          lock.lock();
          s->lost = st;
          auto lost = std::move(s->on_lost);
          s->check = nullptr;
          s->on_lost = nullptr;
          lock.unlock();
          if (lost) lost(st);
        }
      }
      lock.lock();
      s->cv.wait_for(lock, kHeartbeatInterval, [s] { return s->stop; });
    }
  });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
  }
  s_->cv.notify_all();
  if (s_->thread.joinable()) s_->thread.join();
}

void Heartbeat::leave() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->stop) return;
    s_->stop = true;
  }
  s_->cv.notify_all();
  if (s_->thread.joinable()) s_->thread.join();
  (void)s_->store.set(s_->key, "left");
}

void Heartbeat::watch(const std::string& who, std::vector<std::string> peers,
                      std::function<void(const Status&)> on_lost, RefitEpochs* epochs,
                      std::function<void(std::uint32_t)> on_refit_failed) {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->check =
      liveness_check(s_->store, who, std::move(peers), epochs, std::move(on_refit_failed));
  s_->on_lost = std::move(on_lost);
}

Status Heartbeat::verdict() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->lost;
}

Result<LivenessConnections> connect_liveness(const std::string& host, int port,
                                             std::shared_ptr<const ControlAuth> auth,
                                             const std::string& who) {
  LivenessConnections c;
  REFIT_ASSIGN_OR_RETURN(c.probe, connect_store(host, port, kBeatRequestTimeout, auth));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Store> beats,
                         connect_store(host, port, kBeatRequestTimeout, auth));
  c.heartbeat = std::make_unique<Heartbeat>(std::move(beats), who);
  return c;
}

std::vector<std::string> rank_names(const Config& config) {
  std::vector<std::string> names;
  for (int r = 0; r < config.policy.world_size; ++r)
    names.push_back(fmt::format("trainer rank {}", r));
  for (int e = 0; e < config.generation.num_engines; ++e)
    for (int t = 0; t < config.generation.tp_size; ++t)
      names.push_back(fmt::format("engine {} tp rank {}", e, t));
  return names;
}

std::function<Status()> liveness_check(Store& store, const std::string& who,
                                       std::vector<std::string> peers, RefitEpochs* epochs,
                                       std::function<void(std::uint32_t)> on_refit_failed) {
  using Clock = std::chrono::steady_clock;
  struct Seen {
    std::string value;
    Clock::time_point since;
  };
  auto seen = std::make_shared<std::map<std::string, Seen>>();
  // When the store last answered: a request that times out (a busy host) is fatal only once the
  // store has not answered for kPeerSilence.
  auto answered = std::make_shared<Clock::time_point>(Clock::now());
  std::erase(peers, who);
  std::vector<std::string> keys{"error/first"};
  for (const std::string& peer : peers) keys.push_back("heartbeat/" + peer);
  return [&store, who, peers = std::move(peers), keys = std::move(keys), seen, answered, epochs,
          on_refit_failed = std::move(on_refit_failed)]() mutable -> Status {
    const auto silent = [&](const Status& why) {
      return Status::Aborted(fmt::format(
          "aborted because trainer rank 0: the store it hosts did not answer for {:.1f} s "
          "(stopped, hung or cut off; seen by {}): {}",
          kPeerSilence.count() / 1000.0, who, why.to_string()));
    };
    // A failed request: the connection is gone (fatal), or the store is slow (fatal only after
    // kPeerSilence without an answer; else this round is skipped).
    const auto failed = [&](const Status& why) {
      if (why.code() != StatusCode::kTimeout)
        return Status::Aborted(
            fmt::format("lost the control plane (the store of trainer rank 0): {}", why.to_string()));
      if (Clock::now() - *answered >= kPeerSilence) return silent(why);
      return Status::Ok();
    };
    const Status reachable = store.ping(kPeerSilence);
    if (!reachable.ok() && reachable.code() != StatusCode::kTimeout) return failed(reachable);
    if (!reachable.ok()) return silent(reachable);
    *answered = Clock::now();
    // The run's first failure, every peer's heartbeat and the current refit epoch's failure, in
    // one request.
    const std::uint32_t epoch = epochs != nullptr ? epochs->current() : 0;
    if (epochs != nullptr) keys.push_back(RefitEpochs::key(epoch));
    auto values = store.try_get_many(keys);
    if (epochs != nullptr) keys.pop_back();
    if (!values.ok()) return failed(values.status());
    if (epochs != nullptr) {
      const std::optional<std::string>& refit = values->back();
      if (refit.has_value() && epochs->seen(epoch, *refit) && on_refit_failed)
        on_refit_failed(epoch);
    }
    const std::optional<std::string>& first = (*values)[0];
    if (first.has_value() && first->rfind(who + ":", 0) != 0)
      return Status::Aborted("aborted because " + *first);
    const auto now = Clock::now();
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const std::string& peer = peers[i];
      const std::optional<std::string>& beat = (*values)[i + 1];
      if (!beat.has_value() || *beat == "left") continue;
      auto [it, fresh] = seen->try_emplace(peer, Seen{*beat, now});
      if (fresh || it->second.value != *beat) {
        it->second = Seen{*beat, now};
        continue;
      }
      if (now - it->second.since < kPeerSilence) continue;
      const Status gone = Status::Aborted(fmt::format(
          "stopped: no heartbeat for {:.1f} s (seen by {}; the process is stopped, hung or cut off)",
          std::chrono::duration<double>(now - it->second.since).count(), who));
      announce_failure(&store, peer, gone);
      return Status::Aborted(fmt::format("aborted because {}: {}", peer, gone.message()));
    }
    return Status::Ok();
  };
}

Status with_root_cause(Store* store, const std::string& who, const Status& status) {
  if (store == nullptr || status.ok()) return status;
  auto first = store->try_get("error/first");
  if (!first.ok() || !first->has_value()) return status;
  const std::string& cause = **first;
  if (cause.rfind(who + ":", 0) == 0) return status;  // the root cause is this process itself
  if (status.message().find(cause) != std::string::npos) return status;
  return Status(StatusCode::kAborted,
                fmt::format("aborted because {} (seen here as: {})", cause, status.to_string()));
}

std::optional<Blame> blame_process(const std::string& name, int tp_size) {
  Blame b;
  int a = -1, t = -1, n = 0;
  if (std::sscanf(name.c_str(), "trainer rank %d%n", &a, &n) == 1 &&
      static_cast<std::size_t>(n) == name.size() && a >= 0) {
    b.role = "trainer";
    b.rank = a;
  } else if (std::sscanf(name.c_str(), "engine %d tp rank %d%n", &a, &t, &n) == 2 &&
             static_cast<std::size_t>(n) == name.size() && a >= 0 && t >= 0) {
    b.role = "engine";
    b.rank = a * tp_size + t;
  } else {
    return std::nullopt;
  }
  b.process = name;
  return b;
}

namespace {
constexpr std::string_view kNotPublished = "the engines did not publish version '";
constexpr std::string_view kReported = " reported: ";
constexpr std::string_view kStillUsable = " (the session stays usable: ";
constexpr std::string_view kInFlight = "failed in flight: ";
}  // namespace

std::string failed_refit_message(int step, const std::string& version, const std::string& process,
                                 const std::string& error) {
  // The engine's own error often starts with its name already.
  const std::string own = process + ": ";
  const std::string e = error.rfind(own, 0) == 0 ? error.substr(own.size()) : error;
  return fmt::format("refit step {}: {}{}': {}{}{}{}the next refit publishes a new version)", step,
                     kNotPublished, version, process, kReported, e, kStillUsable);
}

std::string failed_in_flight_message(int step, const std::string& version,
                                     const std::string& cause) {
  const std::size_t colon = cause.find(": ");
  const std::string process = colon == std::string::npos ? "?" : cause.substr(0, colon);
  const std::string error = colon == std::string::npos ? cause : cause.substr(colon + 2);
  return fmt::format("refit step {} (version '{}') {}{}{}{}{}every rank is alive; the groups "
                     "were formed anew and the next refit publishes a new version)",
                     step, version, kInFlight, process, kReported, error, kStillUsable);
}

Blame blame_failure(const std::string& self, const Status& status, int tp_size) {
  // with_root_cause and liveness_check write "aborted because <process>: <error>", followed by
  // " (seen here as: <this process's error>)" from with_root_cause; contexts may precede it.
  static const std::string kBecause = "aborted because ";
  static const std::string kSeen = " (seen here as: ";
  const std::string& m = status.message();
  // A refit that failed at its end: the engine rank that reported it; one that failed in flight:
  // the rank that recorded it first.
  std::size_t from = std::string::npos, skip = 0;
  if (const std::size_t np = m.rfind(kNotPublished); np != std::string::npos) {
    from = m.find("': ", np + kNotPublished.size());
    skip = 3;
  } else if (const std::size_t fl = m.rfind(kInFlight); fl != std::string::npos) {
    from = fl;
    skip = kInFlight.size();
  }
  if (from != std::string::npos) {
    const std::size_t rep = m.find(kReported, from + skip);
    if (rep != std::string::npos) {
      if (auto b = blame_process(m.substr(from + skip, rep - from - skip), tp_size)) {
        const std::size_t start = rep + kReported.size();
        const std::size_t end = m.find(kStillUsable, start);
        b->message = b->process + ": " +
                     m.substr(start, end == std::string::npos ? std::string::npos : end - start);
        return *b;
      }
    }
  }
  const std::size_t at = m.find(kBecause);
  if (at != std::string::npos) {
    const std::size_t start = at + kBecause.size();
    const std::size_t colon = m.find(": ", start);
    if (colon != std::string::npos) {
      if (auto b = blame_process(m.substr(start, colon - start), tp_size)) {
        const std::size_t seen = m.find(kSeen, colon);
        b->message = m.substr(start, seen == std::string::npos ? std::string::npos : seen - start);
        return *b;
      }
    }
  }
  Blame b;
  if (auto parsed = blame_process(self, tp_size)) b = *parsed;
  b.process = self;
  b.message = fmt::format("{}: {}", self, status.to_string());
  return b;
}

std::function<Status()> rank_liveness(const Heartbeat& heartbeat, const RefitEpochs& epochs) {
  return [hb = &heartbeat, ep = &epochs]() -> Status {
    REFIT_RETURN_IF_ERROR(hb->verdict());
    if (auto cause = ep->failed()) return Status::Aborted("the refit in flight failed: " + *cause);
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

std::optional<std::string> in_flight_cause(RefitEpochs& epochs, Store& store,
                                           const std::string& who, const Status& failure,
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
  return epochs.record(store, fmt::format("{}: {}", who, failure.to_string()));
}

Status FailureLatch::guard(const std::function<Status()>& step, const std::unique_ptr<Store>& store,
                           const std::string& who, const std::function<void()>& close_collectives,
                           const std::function<Status()>& verdict) {
  if (!failed_.ok()) return failed_;
  Status st = step();
  if (st.ok()) return st;
  // The watch announces a silent peer under "error/first", which with_root_cause then finds.
  (void)settle_verdict(st, verdict);
  st = with_root_cause(store.get(), who, st);
  announce_failure(store.get(), who, st);
  close_collectives();
  failed_ = st;
  return st;
}

}  // namespace refit
