// Mailbox on ZeroMQ: one PULL socket to receive, one PUSH socket per peer to send.
//
// Wire: a 3-frame message [type: 1 byte][sender id][payload]. PUSH sockets are created with
// ZMQ_IMMEDIATE, so a message is queued only on a live connection: a send to a peer that is not
// (or no longer) connected fails after the send timeout instead of queueing forever. On close a
// PUSH socket lingers for at most kSendLinger so the last messages (commit, shutdown) still leave.
#include "control/mailbox.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control/store.h"

namespace refit {

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kHello:
      return "hello";
    case MessageType::kBegin:
      return "begin";
    case MessageType::kBucket:
      return "bucket";
    case MessageType::kBucketDone:
      return "bucket-done";
    case MessageType::kCommit:
      return "commit";
    case MessageType::kCommitted:
      return "committed";
    case MessageType::kShutdown:
      return "shutdown";
    case MessageType::kVerified:
      return "verified";
    case MessageType::kPaused:
      return "paused";
    case MessageType::kRoutes:
      return "routes";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kSendLinger{2000};

bool is_known_type(std::uint8_t t) {
  return t >= static_cast<std::uint8_t>(MessageType::kHello) &&
         t <= static_cast<std::uint8_t>(MessageType::kRoutes);
}

std::string mailbox_key(const std::string& id) { return "mailbox/" + id; }

class ZmqMailbox final : public Mailbox {
 public:
  ZmqMailbox(Store& store, std::string id, std::chrono::milliseconds timeout)
      : store_(store), id_(std::move(id)), timeout_(timeout), pull_(ctx_, zmq::socket_type::pull) {}
  ~ZmqMailbox() override {
    // Sockets before the context (whose destruction waits for the PUSH linger).
    peers_.clear();
    pull_.close();
  }
  ZmqMailbox(const ZmqMailbox&) = delete;
  ZmqMailbox& operator=(const ZmqMailbox&) = delete;

  Status bind_and_publish(const std::string& host) {
    const std::string requested = fmt::format("tcp://{}:*", host);
    try {
      pull_.set(zmq::sockopt::linger, 0);
      pull_.bind(requested);
      endpoint_ = pull_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status::IOError(
          fmt::format("mailbox '{}': cannot bind {}: {}", id_, requested, e.what()));
    }
    return store_.set(mailbox_key(id_), endpoint_)
        .with_context(fmt::format("mailbox '{}': publishing its address {}", id_, endpoint_));
  }

  const std::string& id() const override { return id_; }

  // Once a peer's address is known, a live peer takes a message at once (the connection is made
  // in milliseconds and nothing else queues on it); one that has not after a few seconds is gone.
  // Bounding this separately keeps a process whose peer died from sitting out the whole timeout.
  std::chrono::milliseconds send_timeout() const {
    return std::min(timeout_, std::chrono::milliseconds(3000));
  }

  Status send(const std::string& to, MessageType type, const std::string& payload) override {
    const std::string what =
        fmt::format("mailbox '{}': send {} to '{}'", id_, message_type_name(type), to);
    std::lock_guard<std::mutex> lock(send_mu_);
    auto it = peers_.find(to);
    if (it == peers_.end()) {
      auto address = store_.get(mailbox_key(to), timeout_);
      if (!address.ok()) {
        return address.status().with_context(
            fmt::format("{}: the peer did not publish its mailbox within {} ms (has it started?)",
                        what, timeout_.count()));
      }
      Peer peer;
      peer.address = *address;
      try {
        peer.socket = zmq::socket_t(ctx_, zmq::socket_type::push);
        peer.socket.set(zmq::sockopt::linger, static_cast<int>(kSendLinger.count()));
        peer.socket.set(zmq::sockopt::immediate, 1);
        peer.socket.set(zmq::sockopt::sndtimeo, static_cast<int>(send_timeout().count()));
        peer.socket.connect(peer.address);
      } catch (const zmq::error_t& e) {
        return Status::IOError(
            fmt::format("{}: cannot connect to {}: {}", what, peer.address, e.what()));
      }
      it = peers_.emplace(to, std::move(peer)).first;
    }

    const auto type_byte = static_cast<std::uint8_t>(type);
    std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(&type_byte, 1), zmq::buffer(id_),
                                           zmq::buffer(payload)};
    Status status;
    try {
      // Multipart delivery is atomic: the first frame is the one that may time out.
      if (!zmq::send_multipart(it->second.socket, parts)) {
        status = Status::Timeout(
            fmt::format("{} at {}: not delivered within {} ms; the peer is not connected (exited?)",
                        what, it->second.address, send_timeout().count()));
      }
    } catch (const zmq::error_t& e) {
      status = Status::IOError(fmt::format("{} at {}: {}", what, it->second.address, e.what()));
    }
    // Look the peer up again next time: it may have restarted under a new address.
    if (!status.ok()) peers_.erase(it);
    return status;
  }

  Result<Message> receive(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      std::vector<zmq::message_t> frames;
      try {
        if (zmq::recv_multipart(pull_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          return decode(frames);
        }
      } catch (const zmq::error_t& e) {
        return Status::IOError(fmt::format("mailbox '{}': receive failed: {}", id_, e.what()));
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        return Status::Timeout(
            fmt::format("mailbox '{}': no message within {} ms", id_, timeout.count()));
      }
      // While waiting, ask the liveness check now and then: a peer that died without a word
      // (killed, crashed) is noticed there long before the timeout.
      if (liveness_) {
        if (Clock::now() >= next_check_) {
          Status alive = liveness_();
          if (!alive.ok()) return alive;
          next_check_ = Clock::now() + liveness_interval_;
        }
        left = std::min(left, liveness_interval_);
      }
      zmq_pollitem_t item{pull_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, static_cast<long>(left.count())) < 0 && zmq_errno() != EINTR) {
        return Status::IOError(
            fmt::format("mailbox '{}': poll failed: {}", id_, zmq_strerror(zmq_errno())));
      }
    }
  }

  void set_liveness_check(std::function<Status()> check,
                          std::chrono::milliseconds interval) override {
    liveness_ = std::move(check);
    liveness_interval_ = interval;
    next_check_ = Clock::now() + interval;
  }

 private:
  struct Peer {
    std::string address;
    zmq::socket_t socket;
  };
  std::function<Status()> liveness_;
  std::chrono::milliseconds liveness_interval_{1000};
  Clock::time_point next_check_{};

  Result<Message> decode(const std::vector<zmq::message_t>& frames) const {
    if (frames.size() != 3 || frames[0].size() != 1 ||
        !is_known_type(*frames[0].data<std::uint8_t>())) {
      return Status::Corruption(
          fmt::format("mailbox '{}': malformed message ({} frames, first frame {} bytes); expected "
                      "[type][sender][payload]",
                      id_, frames.size(), frames.empty() ? 0 : frames[0].size()));
    }
    Message m;
    m.type = static_cast<MessageType>(*frames[0].data<std::uint8_t>());
    m.from = frames[1].to_string();
    m.payload = frames[2].to_string();
    return m;
  }

  Store& store_;
  const std::string id_;
  const std::chrono::milliseconds timeout_;
  zmq::context_t ctx_{1};  // declared before the sockets: destroyed after them
  zmq::socket_t pull_;
  std::string endpoint_;
  std::mutex send_mu_;
  std::unordered_map<std::string, Peer> peers_;
};

}  // namespace

Result<std::unique_ptr<Mailbox>> Mailbox::open(Store& store, const std::string& id,
                                               const std::string& host,
                                               std::chrono::milliseconds timeout) {
  if (id.empty()) return Status::InvalidArgument("mailbox: the id must not be empty");
  if (timeout.count() <= 0) {
    return Status::InvalidArgument(
        fmt::format("mailbox '{}': timeout must be positive, got {} ms", id, timeout.count()));
  }
  std::unique_ptr<ZmqMailbox> box;
  try {
    box = std::make_unique<ZmqMailbox>(store, id, timeout);
  } catch (const zmq::error_t& e) {
    return Status::IOError(fmt::format("mailbox '{}': cannot create a socket: {}", id, e.what()));
  }
  REFIT_RETURN_IF_ERROR(box->bind_and_publish(host));
  return std::unique_ptr<Mailbox>(std::move(box));
}

}  // namespace refit
