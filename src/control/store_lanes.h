// Same-host lanes to the store (docs/runtime.md, "Heartbeats"; docs/security.md, "Same-host
// lanes"). Internal to src/control.
//
// A heartbeat over ZeroMQ wakes six times across four threads in two processes: the beat
// thread's context's I/O thread, the store's I/O thread and its serving thread, then the two I/O
// threads again and the beat thread with the answer. A rank on the
// store's host beats instead over a lane (control/lane.h) to the store's process: a Unix stream
// socket that the beat thread writes and the store's serving thread reads and answers, one
// wake-up each way. The store's gate (control/lane_gate.h) is addressed "store"; its address
// travels in the answer to a client's first ping, over the store connection (CURVE with the run's
// keys: only the store can have given it). A hello proves the run secret as a store connection's
// handshake does: its box is made with the members' key pair, which every holder of the secret
// derives (control/auth.h). Only heartbeats and liveness reads (kAdd, kWatch) travel on a lane;
// every other request stays on ZeroMQ.
//
// Frames (lane.h): a request is kRequestFrame, its epoch field the client's request number and
// its payload [op: 1 byte] then each argument as [length: u32, little-endian][bytes]; its answer
// is kAnswerFrame with the same number, payload [reply code: 1 byte][payload] (store_wire.h). The
// client's frames carry the lane's seal, the store's its answers' seal (FrameSeal::answers).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "control/lane.h"
#include "control/lane_gate.h"
#include "control/store_wire.h"
#include "refit/status.h"

namespace refit {
class ControlAuth;
namespace log {
class Throttle;
}  // namespace log
}  // namespace refit

namespace refit::store_lanes {

inline constexpr std::uint8_t kRequestFrame = 1;
inline constexpr std::uint8_t kAnswerFrame = 2;
// The longest request a store reads from a lane: a liveness read names a few keys.
inline constexpr std::int64_t kMaxRequestBytes = std::int64_t{64} << 10;
// Lanes count heartbeats as connections do (StoreServer: the connection that counts a key), by a
// number above any descriptor, so that a lane and a ZeroMQ connection are never taken for each
// other.
inline constexpr std::int64_t kFirstConnection = std::int64_t{1} << 40;

struct Answer {
  store_wire::Reply code = store_wire::Reply::kOk;
  std::string payload;
};

// The store's side: its gate and the lanes it proved, read and answered by the store's serving
// thread. Not thread-safe; the gate has a thread of its own.
class Server {
 public:
  using Handler = std::function<Answer(store_wire::Op, const std::vector<std::string>& args,
                                       std::int64_t connection)>;
  // Listens on a fresh abstract socket. With `auth`, a hello must prove the run secret; without
  // one, a connection of this process's user is enough (loopback-only runs). `who` names the
  // store in log lines, whose rate `throttle` limits (it must outlive the server).
  static Result<std::unique_ptr<Server>> open(const std::string& who,
                                              const std::string& host_identity,
                                              const ControlAuth* auth, log::Throttle& throttle);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // What a client needs to open a lane (lane::publish_address).
  const std::string& address() const { return gate_->address(); }
  // Readable while the gate has lanes to hand over or a lane has something to read.
  int fd() const { return epoll_.get(); }
  // Without blocking: takes the lanes the gate proved, answers every whole request that arrived
  // through `handle`, and closes each lane that ended or broke the protocol, calling
  // `closed(connection)` for it.
  void serve(const Handler& handle, const std::function<void(std::int64_t)>& closed);

  // Connections the gate refused, and lanes closed for a frame that was malformed or failed its
  // tag (thread-safe).
  std::int64_t refused() const { return gate_->refused() + broken_.load(); }
  // Requests answered so far.
  std::int64_t requests() const { return requests_; }
  std::size_t lanes() const { return lanes_.size(); }

 private:
  struct Lane {
    lane::Reader reader;
    lane::FrameSeal answers;
    std::string from;
    std::int64_t connection = 0;
  };
  Server(std::string who, std::unique_ptr<lane::Gate> gate, lane::Fd epoll,
         log::Throttle& throttle);
  void take_lanes();
  // Reads and answers what `lane` holds; false once it must close.
  bool serve_lane(Lane& lane, const Handler& handle);

  const std::string who_;
  std::unique_ptr<lane::Gate> gate_;
  lane::Fd epoll_;
  log::Throttle& throttle_;
  std::unordered_map<int, Lane> lanes_;  // by descriptor
  std::int64_t next_connection_ = kFirstConnection;
  std::atomic<std::int64_t> broken_{0};
  std::int64_t requests_ = 0;
};

// A client's lane: one request at a time, by one thread.
class Client {
 public:
  // A lane, as `id`, to the store whose gate `published` names (the answer to the first ping):
  // nullptr when that gate is on another host. An error when it is on this one and the lane
  // cannot be opened within `timeout` (another network namespace, a gate that is busy).
  static Result<std::unique_ptr<Client>> open(const std::string& published,
                                              const std::string& host_identity,
                                              const std::string& id, const ControlAuth* auth,
                                              std::chrono::milliseconds timeout);
  Client(lane::Reader reader, lane::FrameSeal seal)
      : reader_(std::move(reader)), seal_(std::move(seal)) {}

  // Sends one request and waits for its answer until `deadline`, in slices of at most 100 ms that
  // end once `stop()` holds (kAborted). kTimeout: no answer in time; the lane stays usable (a late
  // answer is skipped). Any other error (a request it could not write among them): the lane is
  // broken.
  Result<Answer> exchange(store_wire::Op op, const std::vector<std::string>& args,
                          std::chrono::steady_clock::time_point deadline,
                          const std::function<bool()>& stop);

 private:
  lane::Reader reader_;   // the store's answers, with the answers' seal
  lane::FrameSeal seal_;  // of this side's requests
  std::uint32_t number_ = 0;
};

}  // namespace refit::store_lanes
