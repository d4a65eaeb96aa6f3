#include "control/store_lanes.h"

#include <fmt/format.h>
#include <poll.h>
#include <sodium.h>
#include <sys/epoll.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "common/log.h"
#include "common/log_throttle.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/store.h"

namespace refit::store_lanes {
namespace {

using Clock = std::chrono::steady_clock;
using store_wire::Op;
using store_wire::Reply;

// The id every store gate answers to.
constexpr char kReceiver[] = "store";

std::string encode_request(Op op, const std::vector<std::string>& args) {
  std::string s(1, static_cast<char>(op));
  for (const std::string& a : args) {
    lane::put_u32(s, static_cast<std::uint32_t>(a.size()));
    s += a;
  }
  return s;
}

bool decode_request(std::string_view s, Op* op, std::vector<std::string>* args) {
  if (s.empty()) return false;
  *op = static_cast<Op>(static_cast<std::uint8_t>(s[0]));
  args->clear();
  std::size_t at = 1;
  while (at < s.size()) {
    if (s.size() - at < 4) return false;
    const std::uint32_t n = lane::get_u32(s.data() + at);
    at += 4;
    if (n > s.size() - at) return false;
    args->emplace_back(s.substr(at, n));
    at += n;
  }
  return true;
}

}  // namespace

Server::Server(std::string who, std::unique_ptr<lane::Gate> gate, lane::Fd epoll,
               log::Throttle& throttle)
    : who_(std::move(who)), gate_(std::move(gate)), epoll_(std::move(epoll)), throttle_(throttle) {}

Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::open(const std::string& who,
                                             const std::string& host_identity,
                                             const ControlAuth* auth, log::Throttle& throttle) {
  lane::GateOptions g{.who = who,
                      .receiver = kReceiver,
                      .host_identity = host_identity,
                      .limits = {},
                      .keys = {},
                      .throttle = &throttle};
  if (auth != nullptr) {
    // Every member proves the key pair it derives from the run secret, whatever id it names.
    std::array<unsigned char, 32> member{};
    if (!lane::z85_key(auth->member_public(), member.data()))
      return Status::Internal(fmt::format("{}: the members' public key is malformed", who));
    g.keys = [member](const std::string&) -> Result<std::array<unsigned char, 32>> {
      return member;
    };
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<lane::Gate> gate, lane::Gate::open(std::move(g)));
  REFIT_ASSIGN_OR_RETURN(lane::Fd epoll, lane::ready_set(*gate, who));
  return std::unique_ptr<Server>(new Server(who, std::move(gate), std::move(epoll), throttle));
}

void Server::serve(const Handler& handle, const std::function<void(std::int64_t)>& closed) {
  std::array<epoll_event, 64> ready{};
  const int n = ::epoll_wait(epoll_.get(), ready.data(), static_cast<int>(ready.size()), 0);
  for (int i = 0; i < n; ++i) {
    const int fd = ready[static_cast<std::size_t>(i)].data.fd;
    if (fd == gate_->ready_fd()) {
      take_lanes();
      continue;
    }
    const auto it = lanes_.find(fd);
    if (it == lanes_.end() || serve_lane(it->second, handle)) continue;
    closed(it->second.connection);
    lanes_.erase(it);  // closing the descriptor takes it out of the epoll set
  }
}

void Server::take_lanes() {
  for (lane::Accepted& a : gate_->take()) {
    const int fd = a.fd.get();
    epoll_event ev{.events = EPOLLIN, .data = {.fd = fd}};
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      log::warn_throttled(throttle_, "{}: cannot serve the lane of '{}': epoll_ctl: {}", who_,
                          log::escape(a.from), errno_text(errno));
      continue;
    }
    log::debug("{}: '{}' beats over a same-host lane", who_, log::escape(a.from));
    lanes_.emplace(fd, Lane{lane::Reader(std::move(a.fd), std::move(a.seal)), std::move(a.answers),
                            std::move(a.from), next_connection_++});
  }
}

bool Server::serve_lane(Lane& lane, const Handler& handle) {
  const auto broke = [&](const std::string& why) {
    ++broken_;
    log::warn_throttled(throttle_, "{}: closed the same-host lane of '{}': {}", who_,
                        log::escape(lane.from), why);
    return false;
  };
  // The requests written before the client closed its end are still answered.
  const bool open = lane.reader.fill();
  std::vector<std::string> args;
  for (;;) {
    Result<std::optional<lane::Frame>> next = lane.reader.next(kMaxRequestBytes);
    if (!next.ok()) return broke(next.status().message());
    if (!next->has_value()) break;
    const lane::Frame& f = **next;
    Op op{};
    if (f.type != kRequestFrame || !decode_request(f.payload, &op, &args))
      return broke(
          fmt::format("a malformed request (frame type {}, {} bytes)", f.type, f.payload.size()));
    ++requests_;
    const Answer a = handle(op, args, lane.connection);
    std::string payload(1, static_cast<char>(a.code));
    payload += a.payload;
    // A client waits for each answer before it asks again: one that does not fit the socket's
    // buffer at once is a client that stopped reading, and never holds up the store.
    const Status sent = lane::write_frame(lane.reader.fd(), lane.answers, kAnswerFrame, f.epoch,
                                          payload, std::chrono::milliseconds(0));
    if (!sent.ok())
      return broke(fmt::format("its answer could not be written: {}", sent.message()));
  }
  if (!open && lane.reader.buffered() > 0)
    return broke(fmt::format("it ended in the middle of a frame ({} byte(s) of it)",
                             lane.reader.buffered()));
  return open;
}

Result<std::unique_ptr<Client>> Client::open(const std::string& published,
                                             const std::string& host_identity,
                                             const std::string& id, const ControlAuth* auth,
                                             std::chrono::milliseconds timeout) {
  const std::optional<lane::Address> a = lane::parse_address(published, host_identity);
  if (!a) return std::unique_ptr<Client>();  // another host, or a store without lanes
  unsigned char sk[32];
  if (auth != nullptr && !lane::z85_key(auth->member_secret(), sk))
    return Status::Internal("the members' secret key is malformed");
  Result<lane::Outgoing> out =
      lane::connect(*a, id, kReceiver, auth != nullptr ? sk : nullptr, timeout);
  sodium_memzero(sk, sizeof sk);
  if (!out.ok()) return out.status();
  return std::make_unique<Client>(lane::Reader(std::move(out->fd), std::move(out->answers)),
                                  std::move(out->seal));
}

Result<Answer> Client::exchange(Op op, const std::vector<std::string>& args,
                                Clock::time_point deadline, const std::function<bool()>& stop) {
  const std::uint32_t number = ++number_;
  // A request written in part leaves the lane unusable, so a write that fails breaks it, late or
  // not.
  if (Status sent = lane::write_frame(reader_.fd(), seal_, kRequestFrame, number,
                                      encode_request(op, args), std::chrono::milliseconds(1000));
      !sent.ok())
    return Status::IOError(sent.message());
  bool ended = false;
  for (;;) {
    // Answers arrive in the order of the requests: one to an earlier request that timed out is
    // skipped. Whole answers that arrived before the store closed its end are still read.
    for (;;) {
      REFIT_ASSIGN_OR_RETURN(std::optional<lane::Frame> f, reader_.next(kMaxControlFrameBytes));
      if (!f) break;
      if (f->type != kAnswerFrame || f->payload.empty())
        return Status::Corruption(fmt::format("a malformed answer (frame type {}, {} bytes)",
                                              f->type, f->payload.size()));
      if (f->epoch != number) continue;
      return Answer{.code = static_cast<Reply>(static_cast<std::uint8_t>(f->payload[0])),
                    .payload = f->payload.substr(1)};
    }
    if (ended) return Status::IOError("the store closed the lane");
    if (stop()) return Status::Aborted("stopped");
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Status::Timeout("no answer in time");
    pollfd p{reader_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long long>(left, 100))) <= 0) continue;
    ended = !reader_.fill();
  }
}

}  // namespace refit::store_lanes
