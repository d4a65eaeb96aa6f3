// The Gloo backend of Communicator: TCP transport, its pairs connected through the refit store.
//
// Gloo reports failures by throwing (gloo::IoException, gloo::EnforceNotMet, ...). Every Gloo
// call runs inside run(), which turns any exception into a Status naming the group, the
// operation, this rank and the sizes. After a failure the Gloo context is unusable (Gloo closes
// its pairs), so every later call fails at once with the first cause.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/allgatherv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "comm/communicator.h"
#include "comm/gloo/gloo_store.h"
#include "common/log.h"

namespace refit {
namespace {

// abort() must wake a call blocked inside Gloo. Gloo 2022 has no abort, but its unbound buffers
// have abortWaitRecv/abortWaitSend, which make a pending wait return false. Every buffer refit
// hands to Gloo is wrapped in an AbortableBuffer that registers itself in the communicator's
// AbortState and turns an aborted wait (or any call after abort) into a gloo::IoException, which
// unwinds the collective. abort() first closes the pairs (so Gloo's event loop no longer touches
// the caller's memory, and peers see the connection drop), then wakes the registered buffers.
struct AbortState {
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::unordered_set<::gloo::transport::UnboundBuffer*> active;  // the wrapped buffers
};

class AbortableBuffer final : public ::gloo::transport::UnboundBuffer {
 public:
  AbortableBuffer(AbortState& state, std::unique_ptr<::gloo::transport::UnboundBuffer> inner)
      : ::gloo::transport::UnboundBuffer(inner->ptr, inner->size),
        state_(state),
        inner_(std::move(inner)) {
    std::lock_guard<std::mutex> lock(state_.mu);
    state_.active.insert(inner_.get());
  }
  ~AbortableBuffer() override {
    std::lock_guard<std::mutex> lock(state_.mu);
    state_.active.erase(inner_.get());
  }

  using ::gloo::transport::UnboundBuffer::recv;
  using ::gloo::transport::UnboundBuffer::waitRecv;
  using ::gloo::transport::UnboundBuffer::waitSend;

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override {
    throw_if_aborted();
    if (!inner_->waitRecv(rank, timeout) || state_.aborted.load()) throw_aborted();
    return true;
  }
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override {
    throw_if_aborted();
    if (!inner_->waitSend(rank, timeout) || state_.aborted.load()) throw_aborted();
    return true;
  }
  void abortWaitRecv() override { inner_->abortWaitRecv(); }
  void abortWaitSend() override { inner_->abortWaitSend(); }
  void send(int dst, uint64_t slot, size_t offset, size_t nbytes) override {
    throw_if_aborted();
    inner_->send(dst, slot, offset, nbytes);
  }
  void recv(int src, uint64_t slot, size_t offset, size_t nbytes) override {
    throw_if_aborted();
    inner_->recv(src, slot, offset, nbytes);
  }
  void recv(std::vector<int> srcs, uint64_t slot, size_t offset, size_t nbytes) override {
    throw_if_aborted();
    inner_->recv(std::move(srcs), slot, offset, nbytes);
  }

 private:
  [[noreturn]] static void throw_aborted() { throw ::gloo::IoException("aborted by abort()"); }
  void throw_if_aborted() const {
    if (state_.aborted.load()) throw_aborted();
  }

  AbortState& state_;
  std::unique_ptr<::gloo::transport::UnboundBuffer> inner_;
};

// gloo::barrier creates its own (empty) buffer; this lets it use an AbortableBuffer instead.
struct AbortableBarrierOptions : ::gloo::BarrierOptions {
  using ::gloo::BarrierOptions::BarrierOptions;
  void wrap_buffer(AbortState& state) {
    buffer = std::make_unique<AbortableBuffer>(state, std::move(buffer));
  }
};

void ignore_sigpipe_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  });
}

bool looks_like_timeout(const char* what) {
  return std::strstr(what, "Timed out") != nullptr || std::strstr(what, "timeout") != nullptr;
}

// One Gloo TCP device per address and process, shared by every group formed on it while any of
// them lives. A device is an event-loop thread that wakes every 10 ms whether or not its pairs
// have anything to do; with a few hundred ranks on one host each extra loop is CPU taken from the
// refit.
std::shared_ptr<::gloo::transport::Device> shared_device(const ::gloo::transport::tcp::attr& attr) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<::gloo::transport::Device>> devices;
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<::gloo::transport::Device>& slot = devices[attr.hostname];
  if (auto device = slot.lock()) return device;
  auto device = ::gloo::transport::tcp::CreateDevice(attr);
  slot = device;
  return device;
}

// A group's connect ended because the liveness check failed (a peer died, or the run failed).
class ConnectAborted : public std::runtime_error {
 public:
  explicit ConnectAborted(Status why)
      : std::runtime_error(why.to_string()), status(std::move(why)) {}
  Status status;
};

// While a group's pairs connect, asks `alive` every 100 ms; once it fails, closes every pair, and
// again on each later tick (a pair the connecting thread reached after a close is closed anew).
// Gloo waits up to 5 x the group's timeout for a peer to take its pair's connection, and a peer
// that died after the address exchange never does; closing the pair is the one way to wake it.
class ConnectWatch {
 public:
  ConnectWatch(std::function<Status()> alive, std::vector<::gloo::transport::Pair*> pairs)
      : alive_(std::move(alive)), pairs_(std::move(pairs)) {
    if (alive_) thread_ = std::thread([this] { run(); });
  }
  ConnectWatch(const ConnectWatch&) = delete;
  ConnectWatch& operator=(const ConnectWatch&) = delete;
  ~ConnectWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Throws ConnectAborted once the check failed.
  void check() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) throw ConnectAborted(failure_);
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return done_; })) {
      if (failure_.ok()) {
        lock.unlock();
        Status why = alive_();
        lock.lock();
        if (why.ok()) continue;
        failure_ = std::move(why);
      }
      lock.unlock();
      for (::gloo::transport::Pair* pair : pairs_) pair->close();
      lock.lock();
    }
  }

  const std::function<Status()> alive_;
  const std::vector<::gloo::transport::Pair*> pairs_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status failure_;
  std::thread thread_;
};

// Connects a group's pairs. Every rank first creates its pairs and publishes their addresses,
// then connects each pair to the address its peer made for it; unlike connectFullMesh, the connect
// ends within 100 ms of `alive` failing. A group formed connected publishes one key per rank with
// all its pairs' addresses: a group used only point to point connects the pairs that exchange
// bytes, any other every pair (N - 1 connections and keys per rank, as Gloo's connectFullMesh). A
// group that connects on first use publishes one key per pair, as its pairs come.
class PeerContext final : public ::gloo::rendezvous::Context {
 public:
  using ::gloo::rendezvous::Context::Context;

  // Every pair of `peers` at once, through one key per rank.
  void connect_peers(::gloo::rendezvous::Store& store,
                     std::shared_ptr<::gloo::transport::Device>& device,
                     const std::vector<int>& peers, const std::function<Status()>& alive) {
    const std::vector<::gloo::transport::Pair*> pairs = create_pairs(device, peers);
    std::vector<char> mine;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const std::string address = address_of(*pairs[i]);
      append(mine, peers[i]);
      append(mine, static_cast<std::int32_t>(address.size()));
      mine.insert(mine.end(), address.begin(), address.end());
    }
    store.set(key(rank), mine);
    connect_pairs(pairs, peers, alive, [&](int peer) {
      store.wait({key(peer)}, getTimeout());
      return address_for(store.get(key(peer)), peer);
    });
    device_ = device;
  }

  // Pairs with `peers`, none of which this context has yet, through one key per pair. `created`
  // runs under no lock once the pairs exist, before anything waits (the caller's abort() closes
  // them from then on).
  void connect_more(::gloo::rendezvous::Store& store,
                    std::shared_ptr<::gloo::transport::Device>& device,
                    const std::vector<int>& peers, const std::function<Status()>& alive,
                    const std::function<void(const std::vector<::gloo::transport::Pair*>&)>&
                        created) {
    const std::vector<::gloo::transport::Pair*> pairs = create_pairs(device, peers);
    created(pairs);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const std::string address = address_of(*pairs[i]);
      store.set(pair_key(rank, peers[i]), std::vector<char>(address.begin(), address.end()));
    }
    // One deadline for the whole batch's waits: peers that each come just within the timeout
    // do not add up to several.
    const auto deadline = std::chrono::steady_clock::now() + getTimeout();
    connect_pairs(pairs, peers, alive, [&](int peer) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      store.wait({pair_key(peer, rank)}, std::max(left, std::chrono::milliseconds(1)));
      return store.get(pair_key(peer, rank));
    });
    device_ = device;
  }

 private:
  std::vector<::gloo::transport::Pair*> create_pairs(
      std::shared_ptr<::gloo::transport::Device>& device, const std::vector<int>& peers) {
    if (!transportContext_) {
      transportContext_ = device->createContext(rank, size);
      transportContext_->setTimeout(getTimeout());
    }
    std::vector<::gloo::transport::Pair*> pairs;
    for (int peer : peers) pairs.push_back(transportContext_->createPair(peer).get());
    return pairs;
  }

  static std::string address_of(::gloo::transport::Pair& pair) {
    const std::vector<char> raw = pair.address().bytes();
    std::string address(raw.begin(), raw.end());
    gloo_backend::scrub_tcp_addresses(address);
    return address;
  }

  // Connects pairs[i] to theirs(peers[i]), in order, while a ConnectWatch closes them all once
  // `alive` fails.
  static void connect_pairs(const std::vector<::gloo::transport::Pair*>& pairs,
                            const std::vector<int>& peers, const std::function<Status()>& alive,
                            const std::function<std::vector<char>(int)>& theirs) {
    const ConnectWatch watch(alive, pairs);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const std::vector<char> address = theirs(peers[i]);
      watch.check();
      pairs[i]->connect(address);
      watch.check();
    }
  }

  static std::string key(int r) { return "peers/" + std::to_string(r); }
  static std::string pair_key(int from, int to) {
    return fmt::format("pair/{}/{}", from, to);
  }
  static void append(std::vector<char>& out, std::int32_t v) {
    const char* b = reinterpret_cast<const char*>(&v);
    out.insert(out.end(), b, b + sizeof v);
  }
  // The address `peer` made for this rank's pair, from its key.
  std::vector<char> address_for(const std::vector<char>& entries, int peer) const {
    std::size_t at = 0;
    while (at + 8 <= entries.size()) {
      std::int32_t r = 0, n = 0;
      std::memcpy(&r, entries.data() + at, 4);
      std::memcpy(&n, entries.data() + at + 4, 4);
      at += 8;
      if (n < 0 || at + static_cast<std::size_t>(n) > entries.size()) break;
      if (r == rank) return {entries.begin() + static_cast<std::ptrdiff_t>(at),
                             entries.begin() + static_cast<std::ptrdiff_t>(at) + n};
      at += static_cast<std::size_t>(n);
    }
    throw std::runtime_error(fmt::format(
        "rank {} does not list rank {} among its peers (the group's peer lists disagree)", peer,
        rank));
  }
};

// What a failed connect means: the liveness check's failure, the store's first error, or Gloo's
// exception (a timeout or an I/O error), each naming `op`.
Status connect_failure(const std::string& op, const std::string& host,
                       const gloo_backend::GlooStoreAdapter& adapter) {
  try {
    throw;
  } catch (const ConnectAborted& e) {
    return e.status.with_context(fmt::format("{} to its peers", op));
  } catch (const std::exception& e) {
    const Status store_error = adapter.last_error();
    if (!store_error.ok()) return store_error.with_context(fmt::format("{} via the store", op));
    return Status(looks_like_timeout(e.what()) ? StatusCode::kTimeout : StatusCode::kIOError,
                  fmt::format("{} on {}: {}", op, host, e.what()));
  } catch (...) {
    return Status::Internal(op + ": unknown exception");
  }
}

class GlooCommunicator final : public Communicator {
 public:
  // `device` null: a group that connects on first use, through `store` (which must outlive it).
  GlooCommunicator(GlooOptions options, std::shared_ptr<::gloo::transport::Device> device,
                   std::shared_ptr<PeerContext> context, Store* store)
      : options_(std::move(options)),
        device_(std::move(device)),
        context_(std::move(context)),
        store_(store),
        allowed_(options_.peers ? std::unordered_set<int>(options_.peers->begin(),
                                                          options_.peers->end())
                                : std::unordered_set<int>{}) {
    if (!options_.connect_on_first_use) linked_ = allowed_;
  }

  ~GlooCommunicator() override {
    // Context (and its pairs) before the device whose event loop serves them.
    context_.reset();
    device_.reset();
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  std::string_view backend() const override { return "gloo"; }

  Status all_gather_v(const void* send, void* recv,
                      const std::vector<std::size_t>& counts) override {
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const std::string op = fmt::format("all_gather_v ({}, {} bytes in all)", where(), total);
    if (counts.size() != static_cast<std::size_t>(options_.size)) {
      return Status::InvalidArgument(
          fmt::format("{}{}: {} counts given, expected one per rank ({})", prefix(), op,
                      counts.size(), options_.size));
    }
    const std::size_t mine = counts[options_.rank];
    if ((mine > 0 && send == nullptr) || (total > 0 && recv == nullptr)) {
      return Status::InvalidArgument(fmt::format("{}{}: null {} buffer for {} bytes", prefix(), op,
                                                 send == nullptr ? "send" : "receive",
                                                 send == nullptr ? mine : total));
    }
    REFIT_RETURN_IF_ERROR(usable(op));
    REFIT_RETURN_IF_ERROR(whole_mesh(op));
    if (total == 0) return Status::Ok();

    std::vector<std::size_t> offsets(counts.size(), 0);
    for (std::size_t r = 1; r < counts.size(); ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
    auto* out = static_cast<char*>(recv);
    // Gloo's in-place form: this rank's bytes already sit at its offset of the output.
    if (mine > 0 && out + offsets[options_.rank] != send) {
      std::memmove(out + offsets[options_.rank], send, mine);
    }
    if (total <= options_.max_chunk_bytes) {
      return run(op, [&] {
        ::gloo::AllgathervOptions o(context_);
        o.setOutput<char>(wrap(out, total), counts);
        o.setTag(next_tag());
        o.setTimeout(options_.timeout);
        ::gloo::allgatherv(o);
      });
    }
    // Too large for one transfer: each rank broadcasts its own part, chunk by chunk.
    return run(op, [&] {
      for (int r = 0; r < options_.size; ++r) broadcast_chunks(out + offsets[r], counts[r], r);
    });
  }

  Status broadcast(void* buf, std::size_t bytes, int root) override {
    const std::string op = fmt::format("broadcast ({}, root {}, {} bytes)", where(), root, bytes);
    if (root < 0 || root >= options_.size) {
      return Status::InvalidArgument(
          fmt::format("{}{}: root must be in [0, {})", prefix(), op, options_.size));
    }
    if (buf == nullptr && bytes > 0) {
      return Status::InvalidArgument(fmt::format("{}{}: null buffer", prefix(), op));
    }
    REFIT_RETURN_IF_ERROR(usable(op));
    REFIT_RETURN_IF_ERROR(whole_mesh(op));
    if (bytes == 0) return Status::Ok();
    return run(op, [&] { broadcast_chunks(static_cast<char*>(buf), bytes, root); });
  }

  Status barrier() override {
    const std::string op = fmt::format("barrier ({})", where());
    REFIT_RETURN_IF_ERROR(usable(op));
    REFIT_RETURN_IF_ERROR(whole_mesh(op));
    return run(op, [&] {
      AbortableBarrierOptions o(context_);
      o.wrap_buffer(abort_);
      o.setTag(next_tag());
      o.setTimeout(options_.timeout);
      ::gloo::barrier(o);
    });
  }

  Status exchange(const std::vector<P2POp>& ops) override {
    std::size_t total = 0;
    for (const P2POp& o : ops) {
      REFIT_RETURN_IF_ERROR(among_peers("exchange", o.peer));
      total += o.bytes;
    }
    const std::string op = fmt::format("exchange ({}, {} ops, {} bytes)", where(), ops.size(), total);
    REFIT_RETURN_IF_ERROR(usable(op));
    if (options_.connect_on_first_use) {
      std::vector<int> peers;
      for (const P2POp& o : ops)
        if (!linked_.count(o.peer)) peers.push_back(o.peer);
      REFIT_RETURN_IF_ERROR(connect(peers));
    }
    return run(op, [&] {
      // Slots pair the k-th send of a rank to a peer with that peer's k-th receive from it.
      std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> bufs;
      bufs.reserve(ops.size());
      for (const P2POp& o : ops) {
        if (o.bytes == 0) continue;
        const bool send = o.kind == P2POp::Kind::kSend;
        auto& seq = send ? sent_[o.peer] : received_[o.peer];
        const std::uint64_t slot = kP2PSlotPrefix | seq++;
        bufs.push_back(wrap(static_cast<char*>(o.buf), o.bytes));
        if (send)
          bufs.back()->send(o.peer, slot);
        else
          bufs.back()->recv(o.peer, slot);
      }
      std::size_t i = 0;
      for (const P2POp& o : ops) {
        if (o.bytes == 0) continue;
        if (o.kind == P2POp::Kind::kSend)
          bufs[i++]->waitSend(options_.timeout);
        else
          bufs[i++]->waitRecv(options_.timeout);
      }
    });
  }

  Status connect(const std::vector<int>& peers) override {
    for (int peer : peers) REFIT_RETURN_IF_ERROR(among_peers("connect", peer));
    if (!options_.connect_on_first_use) return Status::Ok();  // connected when formed
    std::vector<int> fresh;
    for (int peer : peers)
      if (!linked_.count(peer)) fresh.push_back(peer);
    std::sort(fresh.begin(), fresh.end());
    fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
    if (fresh.empty()) return Status::Ok();
    const std::string op = fmt::format(
        "gloo[{}] connect (rank {} of {}, {} more pair(s): with rank(s) {})", options_.name,
        options_.rank, options_.size, fresh.size(), fmt::join(fresh, ", "));
    REFIT_RETURN_IF_ERROR(usable(op));
    // Its waits for the peers' addresses end within 500 ms of abort() or of the liveness check
    // failing, its pair connects within 100 ms (ConnectWatch).
    const std::function<Status()> alive = [this] {
      if (abort_.aborted.load()) return Status::Aborted("the communicator was aborted");
      return options_.liveness ? options_.liveness() : Status::Ok();
    };
    gloo_backend::GlooStoreAdapter adapter(*store_, options_.timeout, alive);
    Status status;
    try {
      if (!device_) {
        ::gloo::transport::tcp::attr attr;
        attr.hostname = options_.hostname;
        device_ = shared_device(attr);
      }
      ::gloo::rendezvous::PrefixStore prefixed("gloo/" + options_.name, adapter);
      context_->connect_more(prefixed, device_, fresh, alive,
                             [this](const std::vector<::gloo::transport::Pair*>& pairs) {
                               std::lock_guard<std::mutex> lock(abort_.mu);
                               created_.insert(created_.end(), pairs.begin(), pairs.end());
                               if (abort_.aborted.load())  // abort() ran before they existed
                                 for (::gloo::transport::Pair* pair : pairs) pair->close();
                             });
    } catch (...) {
      status = connect_failure(op, options_.hostname, adapter);
    }
    // abort() closes a pair that waits for its peer, and Gloo counts a closed pair as done.
    if (status.ok() && abort_.aborted.load())
      status = Status::Aborted(op + ": the communicator was aborted");
    if (!status.ok()) {
      // A failed liveness check is already kAborted, naming its origin: kept as it is.
      if (abort_.aborted.load() && status.code() != StatusCode::kAborted)
        status = Status::Aborted(status.message());
      if (broken_.ok()) broken_ = status;
      return status;
    }
    linked_.insert(fresh.begin(), fresh.end());
    log::debug("gloo[{}] rank {} of {}: connected {} more pair(s) on first use, {} of its {} "
               "peer(s) now",
               options_.name, options_.rank, options_.size, fresh.size(), linked_.size(),
               allowed_.size());
    return Status::Ok();
  }

  void abort() override {
    if (abort_.aborted.exchange(true)) return;
    if (!options_.connect_on_first_use) {
      for (int peer = 0; peer < options_.size; ++peer) {
        if (peer == options_.rank) continue;
        try {
          auto& pair = context_->getPair(peer);
          if (pair) pair->close();
        } catch (const std::exception&) {
          // Best effort: a pair that cannot be closed is left to the timeout.
        }
      }
    }
    std::lock_guard<std::mutex> lock(abort_.mu);
    // A group that connects on first use closes the pairs it made so far (connect() closes
    // those it makes after this).
    for (::gloo::transport::Pair* pair : created_) {
      try {
        pair->close();
      } catch (const std::exception&) {
        // Best effort, as above.
      }
    }
    for (auto* buffer : abort_.active) {
      buffer->abortWaitRecv();
      buffer->abortWaitSend();
    }
  }

 private:
  std::string prefix() const { return fmt::format("gloo[{}] ", options_.name); }
  std::string where() const { return fmt::format("rank {} of {}", options_.rank, options_.size); }

  // `peer` is a member this rank may exchange with: any other member, or one of its peers.
  Status among_peers(const char* what, int peer) const {
    if (peer < 0 || peer >= options_.size || peer == options_.rank)
      return Status::InvalidArgument(fmt::format("{}{} ({}): peer {} is not another rank",
                                                 prefix(), what, where(), peer));
    if (options_.peers && !allowed_.count(peer))
      return Status::InvalidArgument(fmt::format(
          "{}{} ({}): rank {} is not among this rank's peers ({}); the group connects only the "
          "pairs that exchange bytes",
          prefix(), what, where(), peer, fmt::join(*options_.peers, ", ")));
    return Status::Ok();
  }

  // Collectives need every pair.
  Status whole_mesh(const std::string& op) const {
    if (!options_.peers) return Status::Ok();
    return Status::InvalidArgument(fmt::format(
        "{}{}: this group connects only this rank's peers ({}), for point-to-point exchanges; a "
        "collective needs every member connected",
        prefix(), op, fmt::join(*options_.peers, ", ")));
  }

  std::uint32_t next_tag() { return tag_++; }

  Status usable(const std::string& op) const {
    if (abort_.aborted.load()) {
      return Status::Aborted(fmt::format("{}{}: the communicator was aborted", prefix(), op));
    }
    if (!broken_.ok()) {
      return broken_.with_context(fmt::format("{}{}: the group failed earlier", prefix(), op));
    }
    return Status::Ok();
  }

  std::unique_ptr<::gloo::transport::UnboundBuffer> wrap(char* ptr, std::size_t bytes) {
    return std::make_unique<AbortableBuffer>(abort_, context_->createUnboundBuffer(ptr, bytes));
  }

  // Every chunk is its own Gloo broadcast with its own tag and timeout.
  void broadcast_chunks(char* buf, std::size_t bytes, int root) {
    const std::size_t chunk = std::max<std::size_t>(options_.max_chunk_bytes, 1);
    for (std::size_t offset = 0; offset < bytes; offset += chunk) {
      ::gloo::BroadcastOptions o(context_);
      o.setOutput<char>(wrap(buf + offset, std::min(chunk, bytes - offset)));
      o.setRoot(root);
      o.setTag(next_tag());
      o.setTimeout(options_.timeout);
      ::gloo::broadcast(o);
    }
  }

  template <typename F>
  Status run(const std::string& op, F&& body) {
    Status status;
    try {
      body();
      return Status::Ok();
    } catch (const ::gloo::IoException& e) {
      status = Status(looks_like_timeout(e.what()) ? StatusCode::kTimeout : StatusCode::kIOError,
                      e.what());
    } catch (const ::gloo::EnforceNotMet& e) {
      status = Status::Internal(e.what());
    } catch (const std::exception& e) {
      status = Status::IOError(e.what());
    } catch (...) {
      status = Status::Internal("unknown exception");
    }
    if (abort_.aborted.load()) status = Status::Aborted(status.message());
    status = Status(status.code(), fmt::format("{}{}: {}", prefix(), op, status.message()));
    if (broken_.ok()) broken_ = status;
    return status;
  }

  const GlooOptions options_;
  std::shared_ptr<::gloo::transport::Device> device_;  // null until a pair connects on first use
  std::shared_ptr<PeerContext> context_;
  Store* const store_;  // connect_on_first_use
  AbortState abort_;
  std::vector<::gloo::transport::Pair*> created_;  // connect_on_first_use; under abort_.mu
  Status broken_;  // the first failure; the context is unusable after it
  std::uint32_t tag_ = 0;
  // Point-to-point sequence numbers per peer; the slot prefix keeps them apart from the slots
  // Gloo's collectives derive from tags.
  static constexpr std::uint64_t kP2PSlotPrefix = std::uint64_t{0x7e} << 56;
  std::unordered_map<int, std::uint64_t> sent_, received_;
  const std::unordered_set<int> allowed_;  // options_.peers
  std::unordered_set<int> linked_;         // the peers whose pairs are connected
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_communicator(Store& store,
                                                             const GlooOptions& options) {
  const std::string op =
      fmt::format("gloo[{}] connect (rank {} of {})", options.name, options.rank, options.size);
  if (options.name.empty()) return Status::InvalidArgument(op + ": the group name is empty");
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return Status::InvalidArgument(op + ": need size >= 1 and 0 <= rank < size");
  }
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument(
        fmt::format("{}: timeout must be positive, got {} ms", op, options.timeout.count()));
  }
  if (options.max_chunk_bytes == 0) return Status::InvalidArgument(op + ": max_chunk_bytes is 0");
  if (options.peers) {
    std::unordered_set<int> seen;
    for (int p : *options.peers)
      if (p < 0 || p >= options.size || p == options.rank || !seen.insert(p).second)
        return Status::InvalidArgument(fmt::format(
            "{}: peer {} is not another member of the group, or is listed twice", op, p));
  }
  if (options.connect_on_first_use && !options.peers)
    return Status::InvalidArgument(op + ": connect_on_first_use needs the list of peers");
  ignore_sigpipe_once();
  if (options.connect_on_first_use) {
    auto context = std::make_shared<PeerContext>(options.rank, options.size);
    context->setTimeout(options.timeout);
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(options, nullptr, std::move(context), &store));
  }

  gloo_backend::GlooStoreAdapter adapter(store, options.timeout, options.liveness);
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<::gloo::transport::Device> device = shared_device(attr);
    auto context = std::make_shared<PeerContext>(options.rank, options.size);
    context->setTimeout(options.timeout);
    ::gloo::rendezvous::PrefixStore prefixed("gloo/" + options.name, adapter);
    std::vector<int> peers;
    if (options.peers) {
      peers = *options.peers;
    } else {  // a full mesh: every other member
      for (int r = 0; r < options.size; ++r)
        if (r != options.rank) peers.push_back(r);
    }
    context->connect_peers(prefixed, device, peers, options.liveness);
    if (options.peers)
      log::debug("gloo[{}] rank {} of {}: connected to its {} peer(s) only", options.name,
                 options.rank, options.size, options.peers->size());
    return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(
        options, std::move(device), std::move(context), nullptr));
  } catch (...) {
    return connect_failure(op, options.hostname, adapter);
  }
}

}  // namespace refit
