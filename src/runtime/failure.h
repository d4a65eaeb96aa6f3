// How a failure on one process reaches every other one.
//
// The failing process records its failure once per run under the store key "error/first" (the
// first writer wins), as a record (control/messages.h, FailureOrigin: the rank, the code, its error), and
// closes its collectives. Every process checks that key (and that the store, hosted by trainer
// rank 0, is still there) while it waits, and processes that fail because a peer vanished look it
// up, so every process stops within a second of the first failure and reports the same root
// cause, with that rank attached (Status::origin). (No abort messages: a send to a dead peer
// would block for the send timeout.)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "refit/rank.h"
#include "refit/status.h"

namespace refit {

class ControlAuth;
class Store;
struct StoreClientOptions;
struct Config;

// Records `failure` as the run's first failure, unless another process did first.
void announce_failure(Store* store, const FailureOrigin& failure);
// `status`, seen on `who`, as the record announce_failure stores.
FailureOrigin failure_of(const RankId& who, const Status& status);
// Where rank `who` keeps an error of its own that did not end its session (RankCore::
// note_error): a failure record, or "" once a refit of that rank succeeded. The liveness check
// names it when that rank exits or stops.
std::string noted_error_key(const RankId& who);

// Heartbeats: every rank adds 1 to "heartbeat/<its mailbox id>" every kHeartbeatInterval from a
// thread of its own, for as long as it lives (a stopped or hung process stops beating; a busy one
// does not). A rank that leaves cleanly sets the key to "left". Once it watches its peers, each
// beat carries its liveness read: one store request per rank and interval.
inline constexpr std::chrono::milliseconds kHeartbeatInterval{500};
// A peer whose heartbeat stood still this long, or a store that did not answer a liveness read
// this long, counts as gone. Every waiting rank checks every 500 ms, so a stopped peer is noticed within
// kPeerSilence + 0.5 s.
inline constexpr std::chrono::milliseconds kPeerSilence{5000};
// How long one plain heartbeat request may take (the heartbeat's own store connection: a beat
// before the rank watches its peers, and the "left" of a clean exit).
inline constexpr std::chrono::milliseconds kBeatRequestTimeout{2000};

// Refits that fail in flight with every rank alive (docs/runtime.md, "A refit that fails in
// flight"). Every rank counts refit epochs: 0 at setup, one more after each refit that failed in
// flight. The first rank whose refit of epoch E fails (a timeout or a broken connection while
// every rank is alive) records why under "refit/failed/<E>" (first writer wins); every other rank's
// heartbeat watch reads that key and wakes its collectives and waits. Every rank then moves to
// epoch E + 1: it forms its groups anew, and its mailbox drops messages of epoch E (Mailbox::
// set_epoch). Thread-safe: the watch runs on the heartbeat's thread.
class RefitEpochs {
 public:
  static std::string key(std::uint32_t epoch);
  std::uint32_t current() const;
  // The current epoch's failure, once recorded here or seen by the watch.
  std::optional<FailureOrigin> failed() const;
  // Records `cause` as the current epoch's failure unless another rank did first; returns the
  // recorded one.
  FailureOrigin record(Store& store, const FailureOrigin& cause);
  // The watch found `encoded` (a failure record) under key(epoch): true the first time for the
  // current epoch.
  bool seen(std::uint32_t epoch, const std::string& encoded);
  void advance();  // to the next epoch

 private:
  mutable std::mutex mu_;
  std::uint32_t epoch_ = 0;
  std::optional<FailureOrigin> failed_;
};
// How long, in refit.timeout_s, the ranks wait for each other to form the groups of a new refit
// epoch: a rank still stalled then (it has not seen the failure) ends the session.
inline constexpr int kReformWait = 4;

class Heartbeat {
 public:
  // Beats through `store`, a connection of its own whose requests time out within
  // kBeatRequestTimeout (a beat that carries a liveness read: within kPeerSilence), so that a
  // stopped store host cannot hold up this process's exit for longer. The liveness check
  // (watch()) judges what the beats read on a thread of its own, and makes a failure's follow-up
  // requests over `checks` (null: `store`), which must outlive this object: a check busy with a
  // failure never delays a beat.
  Heartbeat(std::unique_ptr<Store> store, Store* checks, const RankId& who);
  ~Heartbeat();  // stops beating (without "left": call leave() for a clean exit)
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  void leave();  // stops and marks this rank as gone on purpose
  // Stops beating and checking, and keeps its connection open until destroyed: a rank that
  // closes stops its threads first, then takes down what they might touch.
  void stop();
  // Stops the checks alone (the only thread that calls `on_lost`); the beats go on, so that peers
  // see this rank alive until it stops beating or closes its connection.
  void stop_checks();
  // From now on each beat also reads what the liveness check of `who` among `peers` needs
  // (Store::beat_and_watch, the first within one interval), and the checking thread judges it
  // (`checks` serves a failure's follow-up requests). The check fails when:
  //  - another process recorded the run's first failure;
  //  - the store (hosted by trainer rank 0) did not answer a read within kPeerSilence (a busy
  //    store is not a dead one: it answers within that), which is blamed on trainer rank 0, or
  //    the connection to it broke;
  //  - one of `peers` beat at least once and then not for kPeerSilence, or its connections
  //    closed without leaving. This is recorded as that peer's failure ("<peer>: aborted:
  //    stopped: no heartbeat for 5.0 s (seen by <who>; ...)", or "exited: ..."), with the error
  //    it kept under noted_error_key(peer) when it kept one ("exited after its error: ...").
  // On its first failure it calls `on_lost` once (from the checking thread). The runtime aborts
  // its collectives there, so that a rank blocked inside a Gloo or NCCL operation with a peer
  // that fell silent is woken instead of waiting out refit.timeout_s.
  // The read does not grow with the number of live ranks: the store keeps when each heartbeat
  // last changed and answers with the stale ones. With `epochs`, it also reads the current refit
  // epoch's failure key, and `on_refit_failed(epoch)` runs once when it appears.
  void watch(const RankId& who, std::vector<RankId> peers,
             std::function<void(const Status&)> on_lost, RefitEpochs* epochs = nullptr,
             std::function<void(std::uint32_t)> on_refit_failed = {});
  // The watch's verdict so far: ok until a check failed, then that failure (at most one beat,
  // 0.5 s, old). The rank's waits poll this instead of checking the store themselves, so each
  // rank checks its peers once per beat, not once per waiting thread.
  Status verdict() const;
  // How many liveness reads the beats handed to the checking thread: those that report a failure
  // or a stale peer. A read that says every peer lives is not handed over.
  std::int64_t judged() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// The connections a rank's liveness needs besides its main store connection, both with requests
// bounded by kBeatRequestTimeout so that a stopped store host cannot hold the rank: `probe` for
// failure records (and what a failed liveness check asks besides), and the heartbeat of rank `who`, which has its own. Their
// first contact waits up to `connect_timeout` (refit.timeout_s): under a burst of ranks starting at
// once the store answers late, and a busy store is not a dead one.
struct LivenessConnections {
  std::unique_ptr<Store> probe;
  std::unique_ptr<Heartbeat> heartbeat;  // its checks' follow-ups over `probe`: keep it the longer
};
// Connects a store client (the run's keys are the connector's to add).
using ConnectStoreFn = std::function<Result<std::unique_ptr<Store>>(const StoreClientOptions&)>;
Result<LivenessConnections> connect_liveness(const ConnectStoreFn& connect,
                                             const std::string& host, int port, const RankId& who,
                                             std::chrono::milliseconds connect_timeout);

// Every rank of the run `config` describes: trainer ranks, then engine ranks.
std::vector<RankId> rank_ids(const Config& config);

// The check a rank's waits run (mailboxes, store gets, group rendezvous): the heartbeat watch's
// verdict, then the current refit epoch's failure once another rank recorded it (kAborted).
std::function<Status()> rank_liveness(const Heartbeat& heartbeat, const RefitEpochs& epochs);

// A failure with code kTimeout or kIOError may be a peer's death that the heartbeat watch has not
// named yet (a send to a killed rank fails before its heartbeat is missed): waits up to
// kPeerSilence + 1 s while `verdict` stays ok (and `settled`, when given, is false), and returns
// it. Ok for other codes.
Status settle_verdict(const Status& failure, const std::function<Status()>& verdict,
                      const std::function<bool()>& settled = {});

// `status`, prefixed with the run's first recorded failure when that came from elsewhere, and
// carrying it as its origin.
Status with_root_cause(Store* store, const RankId& who, const Status& status);

// A refit that failed at its end with every rank alive (a checksum mismatch, a failed
// verification), as every trainer rank returns it: "refit step S: the engines did not publish
// version 'V': <process> reported: <error> (the session stays usable: …)", with `origin`, the
// first engine rank that failed, attached.
Status failed_refit(StatusCode code, int step, const std::string& version,
                    const FailureOrigin& origin);

// Whether `failure`, of a refit in flight on rank `who`, fails only the refit: it timed out or lost
// a connection and the heartbeat watch (`verdict`) names no dead peer within kPeerSilence + 1 s,
// or another rank recorded the current epoch's failure first (`epochs`, or `later_epoch`: a
// peer's message of a later epoch arrived). Then returns the epoch's recorded cause (this rank's
// failure when it is the first); nullopt when the session must end.
std::optional<FailureOrigin> in_flight_cause(RefitEpochs& epochs, Store& store,
                                             const RankId& who, const Status& failure,
                                             bool later_epoch,
                                             const std::function<Status()>& verdict);

// A refit that failed in flight with every rank alive, as every rank returns it: "refit step S
// failed in flight: <process> reported: <error> (the session stays usable: …)", where the cause is
// the one recorded first (RefitEpochs), attached as the origin.
Status failed_in_flight(int step, const std::string& version, const FailureOrigin& cause);

// The process a failure is blamed on (the JSON report's `error`, docs/runtime.md): the status's
// origin, or the rank that returned it.
struct Blame {
  std::string process;  // "trainer rank 1", "engine 0 tp rank 1"
  std::string role;     // "trainer" | "engine"
  int rank = -1;        // trainer rank, or global engine rank (engine index * tp_size + tp rank)
  std::string message;  // "<process>: <error>", as recorded under "error/first"
};
Blame blame_of(const FailureOrigin& origin);
Blame blame_failure(const RankId& self, const Status& status);

// The first failure of a rank, latched: guard() runs a step of the rank; when it fails, the
// cause is traced to the run's root cause, recorded in the store, the rank's collectives are
// closed (peers blocked on us fail now instead of at their timeout), and every later guard()
// returns the same Status without running anything — a rank never runs half a refit after a
// failure.
class FailureLatch {
 public:
  // `store` is read after `step` ran, so a failure during setup is announced once the store
  // connection exists.
  // `verdict` (the heartbeat watch's, may be null): a step that failed because a peer did not
  // answer or its connection broke (kTimeout, kIOError) waits up to kPeerSilence + 1 s for the
  // watch to name a peer that is gone, so that the failure is blamed on that peer and not on
  // this rank (a send to a killed rank fails before its heartbeat is missed).
  Status guard(const std::function<Status()>& step, Store* store, const RankId& who,
               const std::function<void()>& close_collectives,
               const std::function<Status()>& verdict = {});
  const Status& status() const { return failed_; }

 private:
  Status failed_;
};

}  // namespace refit
