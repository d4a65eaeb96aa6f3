// The sending side of a mailbox (control/mailbox_parts.h).
#include <fmt/format.h>
#include <sodium.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <zmq_addon.hpp>

#include "common/log.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/mailbox_parts.h"
#include "control/store.h"
#include "control/zmq_monitor.h"

namespace refit::mailbox_parts {
namespace {

constexpr std::chrono::milliseconds kSendLinger{2000};
// How long a probe of a peer that took no message waits for its greeting.
constexpr int kProbeWaitMs = 500;

std::string mailbox_key(const std::string& id) { return "mailbox/" + id; }

}  // namespace

Outbox::Outbox(Store& store, const MailboxOptions& options, zmq::context_t& ctx,
               std::string send_public, std::string send_secret, bool lanes)
    : store_(store),
      options_(options),
      ctx_(ctx),
      send_public_(std::move(send_public)),
      send_secret_(std::move(send_secret)),
      lanes_(lanes) {}

Outbox::~Outbox() {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.clear();  // sockets before the context (whose destruction waits for their linger)
}

void Outbox::set_liveness_check(std::function<Status()> check) {
  std::lock_guard<std::mutex> lock(mu_);
  liveness_ = std::move(check);
}

std::chrono::milliseconds Outbox::send_timeout() const {
  return std::min(options_.timeout, std::chrono::milliseconds(3000));
}

Status Outbox::send(const std::string& to, MessageType type, std::uint32_t epoch,
                    const std::string& payload) {
  // Formatted only for an error (or a first contact): a send is on every hop of every refit.
  const auto what = [&] {
    return fmt::format("mailbox '{}': send {} to '{}'", options_.id, message_type_name(type), to);
  };
  if (static_cast<std::int64_t>(payload.size()) > kMaxMailboxMessageBytes)
    return Status::InvalidArgument(
        fmt::format("{}: the message has {} bytes, more than a mailbox message may have ({}: "
                    "kMaxMailboxMessageBytes, docs/security.md)",
                    what(), payload.size(), kMaxMailboxMessageBytes));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(to);
  if (it == peers_.end()) {
    auto address = store_.get(mailbox_key(to), options_.timeout);
    if (!address.ok()) {
      return address.status().with_context(
          fmt::format("{}: the peer did not publish its mailbox within {} ms (has it started?)",
                      what(), options_.timeout.count()));
    }
    Peer peer;
    peer.address = *address;
    if (lanes_) peer.lane = open_lane(to);
    if (!peer.lane) REFIT_RETURN_IF_ERROR(open_zmq(peer, what()));
    it = peers_.emplace(to, std::move(peer)).first;
  }
  Status status;
  if (it->second.lane) {
    // A dead peer's lane fails at once (the kernel closed it); a live peer that reads nothing
    // while its socket buffer is full is waited for up to the whole timeout.
    const Status sent = lane::write_frame(*it->second.lane, static_cast<std::uint8_t>(type), epoch,
                                          payload, options_.timeout);
    if (!sent.ok())
      status = Status(sent.code(), fmt::format("{} over its same-host lane: {}; the peer closed "
                                               "it (exited?)",
                                               what(), sent.message()));
  } else {
    const std::array<std::uint8_t, 5> head{
        static_cast<std::uint8_t>(type), static_cast<std::uint8_t>(epoch),
        static_cast<std::uint8_t>(epoch >> 8), static_cast<std::uint8_t>(epoch >> 16),
        static_cast<std::uint8_t>(epoch >> 24)};
    std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(head.data(), head.size()),
                                           zmq::buffer(options_.id), zmq::buffer(payload)};
    try {
      // Multipart delivery is atomic: the first frame is the one that may time out. A peer that
      // took nothing within send_timeout() is probed: one whose port still accepts connections is
      // alive, only slow to complete its handshake (a host where many ranks start at once) or to
      // read, and is waited for up to the mailbox's whole timeout; one whose port refuses has
      // exited, and the send fails now.
      const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
      bool sent = zmq::send_multipart(it->second.socket, parts).has_value();
      // Refused, unreachable, or no address to probe: the peer is gone.
      const auto gone = [](const Status& p) {
        return p.code() == StatusCode::kNotFound || p.code() == StatusCode::kIOError ||
               p.code() == StatusCode::kInvalidArgument;
      };
      Status probe;
      Status alive;
      while (!sent) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        if (liveness_ && !(alive = liveness_()).ok()) break;  // a stopped peer's heartbeat, say
        probe = probe_peer(it->second.address);
        if (gone(probe)) break;
        it->second.socket.set(zmq::sockopt::sndtimeo,
                              static_cast<int>(std::min(left, send_timeout()).count()));
        sent = zmq::send_multipart(it->second.socket, parts).has_value();
      }
      it->second.socket.set(zmq::sockopt::sndtimeo, static_cast<int>(send_timeout().count()));
      if (!sent && !alive.ok())
        status = alive.with_context(fmt::format(
            "{} at {}: not delivered within {} ms, and stopped waiting", what(),
            it->second.address, send_timeout().count()));
      else if (!sent)
        status = Status::Timeout(
            gone(probe)
                ? fmt::format("{} at {}: not delivered within {} ms; the peer is not connected "
                              "and its port refuses connections (exited?)",
                              what(), it->second.address, send_timeout().count())
                : fmt::format("{} at {}: not delivered within {} ms; the peer's port accepts "
                              "connections, but it completed no handshake and read nothing (is "
                              "its process stopped or hung?)",
                              what(), it->second.address, options_.timeout.count()));
    } catch (const zmq::error_t& e) {
      status = Status::IOError(
          fmt::format("{} at {}: {}", what(), it->second.address, errno_text(e.num())));
    }
  }
  // Look the peer up again next time: it may have restarted under a new address.
  if (!status.ok()) peers_.erase(it);
  return status;
}

Status Outbox::open_zmq(Peer& peer, const std::string& what) {
  try {
    peer.socket = zmq::socket_t(ctx_, zmq::socket_type::push);
    peer.socket.set(zmq::sockopt::linger, static_cast<int>(kSendLinger.count()));
    peer.socket.set(zmq::sockopt::immediate, 1);
    peer.socket.set(zmq::sockopt::sndtimeo, static_cast<int>(send_timeout().count()));
    peer.socket.set(zmq::sockopt::handshake_ivl, static_cast<int>(kZmqHandshakeIvl.count()));
    if (options_.auth) {
      peer.socket.set(zmq::sockopt::curve_serverkey, options_.auth->server_public());
      peer.socket.set(zmq::sockopt::curve_publickey, send_public_);
      peer.socket.set(zmq::sockopt::curve_secretkey, send_secret_);
    }
    peer.socket.connect(peer.address);
  } catch (const zmq::error_t& e) {
    return Status::IOError(
        fmt::format("{}: cannot connect to {}: {}", what, peer.address, errno_text(e.num())));
  }
  return Status::Ok();
}

// Whether the process behind a peer's ZeroMQ address ("tcp://HOST:PORT") still listens
// (probe_zmtp: kNotFound when its port refuses connections).
Status Outbox::probe_peer(const std::string& address) {
  const std::size_t colon = address.rfind(':');
  const std::size_t scheme = address.find("://");
  if (colon == std::string::npos || scheme == std::string::npos || colon < scheme + 3)
    return Status::InvalidArgument("not a tcp://HOST:PORT address: " + address);
  return probe_zmtp(address.substr(scheme + 3, colon - scheme - 3),
                    std::atoi(address.c_str() + colon + 1), kProbeWaitMs);
}

// A lane to `to` when it published one for this host identity, else nullopt (ZeroMQ carries the
// messages).
std::optional<lane::Outgoing> Outbox::open_lane(const std::string& to) {
  Result<std::optional<std::string>> published = store_.try_get("lane/" + to);
  if (!published.ok() || !published->has_value()) return std::nullopt;
  const std::optional<lane::Address> a =
      lane::parse_address(**published, options_.settings.host_identity);
  if (!a) return std::nullopt;  // another host
  unsigned char sk[32];
  const bool keyed = options_.auth != nullptr;
  if (keyed && !lane::z85_key(send_secret_, sk)) return std::nullopt;
  Result<lane::Outgoing> out =
      lane::connect(*a, options_.id, to, keyed ? sk : nullptr, send_timeout());
  sodium_memzero(sk, sizeof sk);
  if (!out.ok()) {
    // A peer in another network namespace refuses at once (debug); one whose gate does not answer
    // in time (flooded, busy) is worth a line.
    const std::string line =
        fmt::format("mailbox '{}': no same-host lane to '{}' ({}); ZeroMQ carries its messages",
                    options_.id, to, out.status().message());
    if (out.status().code() == StatusCode::kTimeout)
      log::info("{}", line);
    else
      log::debug("{}", line);
    return std::nullopt;
  }
  log::debug("mailbox '{}': sends to '{}' over its same-host lane", options_.id, to);
  return std::move(out).value();
}

}  // namespace refit::mailbox_parts
