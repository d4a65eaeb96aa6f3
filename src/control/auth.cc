// Control-plane authentication: keys derived from the run secret, and the ZAP handler.
#include "control/auth.h"

#include <fmt/format.h>
#include <sodium.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/file_io.h"
#include "common/log.h"
#include "common/log_throttle.h"

namespace refit {
namespace {

constexpr std::size_t kMinSecretBytes = 16;
constexpr std::size_t kMaxSecretBytes = 4096;

Status sodium_ready() {
  static const int rc = sodium_init();
  if (rc < 0) return Status::Internal("libsodium failed to initialise");
  return Status::Ok();
}

std::string z85(const unsigned char* key) {
  std::array<char, 41> text{};
  zmq_z85_encode(text.data(), key, 32);
  return std::string(text.data(), 40);
}

// An X25519 key pair (Z85) from the run key and a label naming its role.
std::pair<std::string, std::string> derive_pair(const unsigned char* run_key, const char* label) {
  unsigned char seed[crypto_box_SEEDBYTES];
  crypto_generichash(seed, sizeof seed, reinterpret_cast<const unsigned char*>(label),
                     std::char_traits<char>::length(label), run_key, crypto_generichash_KEYBYTES);
  unsigned char pk[crypto_box_PUBLICKEYBYTES], sk[crypto_box_SECRETKEYBYTES];
  crypto_box_seed_keypair(pk, sk, seed);
  auto pair = std::make_pair(z85(pk), z85(sk));
  sodium_memzero(seed, sizeof seed);
  sodium_memzero(sk, sizeof sk);
  return pair;
}

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "::1" || host == "localhost" ||
         host == "[::1]";
}

Result<std::shared_ptr<const ControlAuth>> load_process_auth() {
  const char* inline_secret = std::getenv("REFIT_SECRET");
  const char* file = std::getenv("REFIT_SECRET_FILE");
  const bool has_inline = inline_secret != nullptr && *inline_secret != '\0';
  const bool has_file = file != nullptr && *file != '\0';
  if (has_inline && has_file)
    return Status::InvalidArgument(
        "REFIT_SECRET and REFIT_SECRET_FILE are both set: set one of them");
  std::string secret;
  if (has_inline) {
    secret = inline_secret;
  } else if (has_file) {
    REFIT_ASSIGN_OR_RETURN(const int fd, open_regular_file(file, "REFIT_SECRET_FILE"));
    struct stat st {};
    const int rc = ::fstat(fd, &st);
    ::close(fd);
    if (rc != 0) return Status::IOError(fmt::format("REFIT_SECRET_FILE {}: cannot stat it", file));
    if ((st.st_mode & 077) != 0)
      return Status::InvalidArgument(fmt::format(
          "REFIT_SECRET_FILE {}: other users can read it (mode {:o}); chmod 600 it", file,
          st.st_mode & 0777));
    REFIT_ASSIGN_OR_RETURN(secret, read_regular_file(file, "REFIT_SECRET_FILE", kMaxSecretBytes));
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  } else {
    return std::shared_ptr<const ControlAuth>();
  }
  auto auth = ControlAuth::from_secret(secret);
  sodium_memzero(secret.data(), secret.size());
  if (!auth.ok())
    return auth.status().with_context(has_inline ? "REFIT_SECRET"
                                                 : fmt::format("REFIT_SECRET_FILE {}", file));
  return std::shared_ptr<const ControlAuth>(std::make_shared<ControlAuth>(std::move(auth).value()));
}

class ZmqZapHandler final : public ZapHandler {
 public:
  ZmqZapHandler(void* ctx, std::function<bool(const std::string&)> accept, std::string who,
                log::Throttle& throttle)
      : handle_(zmq_socket(ctx, ZMQ_REP)),
        accept_(std::move(accept)),
        who_(std::move(who)),
        throttle_(throttle),
        wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~ZmqZapHandler() override {
    stop_.store(true);
    if (wake_ >= 0) {
      const std::uint64_t one = 1;
      (void)!::write(wake_, &one, sizeof one);
    }
    if (thread_.joinable()) thread_.join();
    if (wake_ >= 0) ::close(wake_);
    if (handle_ != nullptr) zmq_close(handle_);
  }

  std::uint64_t wakeups() const override { return wakeups_.load(); }

  Status bind() {
    const int linger = 0;
    if (handle_ == nullptr || zmq_setsockopt(handle_, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_bind(handle_, "inproc://zeromq.zap.01") != 0)
      return Status::IOError(fmt::format("{}: cannot start the ZAP handler: {}", who_,
                                         zmq_strerror(zmq_errno())));
    socket_ = zmq::socket_ref(zmq::from_handle, handle_);
    thread_ = std::thread([this] { serve(); });
    return Status::Ok();
  }

 private:
  // Sleeps until a request or the destructor's wake-up (without an eventfd, it looks every
  // 100 ms): an idle process's handler costs no wake-ups.
  void serve() {
    while (!stop_.load()) {
      std::array<zmq_pollitem_t, 2> items{zmq_pollitem_t{socket_.handle(), 0, ZMQ_POLLIN, 0},
                                          zmq_pollitem_t{nullptr, wake_, ZMQ_POLLIN, 0}};
      const int ready = zmq_poll(items.data(), wake_ >= 0 ? 2 : 1, wake_ >= 0 ? -1 : 100);
      wakeups_.fetch_add(1);
      if (ready <= 0 || (items[0].revents & ZMQ_POLLIN) == 0) continue;
      std::vector<zmq::message_t> req;
      try {
        if (!zmq::recv_multipart(socket_, std::back_inserter(req), zmq::recv_flags::dontwait))
          continue;
        answer(req);
      } catch (const zmq::error_t& e) {
        log::warn("{}: ZAP handler: {}", who_, e.what());
      }
    }
  }

  // Request: version, request id, domain, address, routing id, mechanism, credentials...
  void answer(const std::vector<zmq::message_t>& req) {
    const std::string request_id = req.size() > 1 ? req[1].to_string() : std::string();
    std::string status = "400", text = "malformed ZAP request", user;
    if (req.size() >= 6 && req[0].to_string() == "1.0") {
      const std::string address = req[3].to_string();
      const std::string mechanism = req[5].to_string();
      if (mechanism != "CURVE" || req.size() != 7 || req[6].size() != 32) {
        text = "CURVE required";
        log::warn_throttled(throttle_, "{}: refused a {} connection from {} (not CURVE)", who_,
                            log::escape(mechanism), log::escape(address));
      } else {
        const std::string key = z85(req[6].data<unsigned char>());
        if (accept_(key)) {
          status = "200";
          text = "OK";
          user = key;
        } else {
          text = "unknown key";
          log::warn_throttled(throttle_,
                              "{}: refused a connection from {}: its key is not a "
                              "member's",
                              who_, log::escape(address));
        }
      }
    }
    std::array<zmq::const_buffer, 6> reply{zmq::str_buffer("1.0"), zmq::buffer(request_id),
                                           zmq::buffer(status),     zmq::buffer(text),
                                           zmq::buffer(user),       zmq::str_buffer("")};
    zmq::send_multipart(socket_, reply);
  }

  void* handle_;
  zmq::socket_ref socket_;
  std::function<bool(const std::string&)> accept_;
  std::string who_;
  log::Throttle& throttle_;  // the owner's
  const int wake_;           // an eventfd the destructor writes to end serve(), or -1
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> wakeups_{0};
  std::thread thread_;
};

}  // namespace

Result<ControlAuth> ControlAuth::from_secret(std::string_view secret) {
  REFIT_RETURN_IF_ERROR(sodium_ready());
  if (secret.size() < kMinSecretBytes)
    return Status::InvalidArgument(fmt::format(
        "the run secret has {} bytes; it needs at least {} (refit run makes one: 64 hex digits)",
        secret.size(), kMinSecretBytes));
  unsigned char run_key[crypto_generichash_KEYBYTES];
  crypto_generichash(run_key, sizeof run_key, reinterpret_cast<const unsigned char*>(secret.data()),
                     secret.size(), reinterpret_cast<const unsigned char*>("refit run secret"),
                     16);
  ControlAuth a;
  std::tie(a.server_public_, a.server_secret_) = derive_pair(run_key, "refit/control/server");
  std::tie(a.member_public_, a.member_secret_) = derive_pair(run_key, "refit/control/member");
  sodium_memzero(run_key, sizeof run_key);
  return a;
}

std::string ControlAuth::generate_secret() {
  (void)sodium_ready();
  unsigned char raw[32];
  randombytes_buf(raw, sizeof raw);
  char hex[65];
  sodium_bin2hex(hex, sizeof hex, raw, sizeof raw);
  sodium_memzero(raw, sizeof raw);
  return std::string(hex, 64);
}

Result<std::shared_ptr<const ControlAuth>> process_control_auth() {
  static std::once_flag once;
  static Result<std::shared_ptr<const ControlAuth>> cached = Status::Internal("unset");
  std::call_once(once, [] { cached = load_process_auth(); });
  return cached;
}

Status check_listen_address(const std::string& host, const ControlAuth* auth,
                            const std::string& who) {
  if (auth != nullptr || is_loopback(host)) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{}: listening on {} (not a loopback address) needs an authenticated control plane: set "
      "REFIT_SECRET, or REFIT_SECRET_FILE, to the same secret on every rank (docs/security.md)",
      who, host));
}

std::pair<std::string, std::string> curve_keypair() {
  std::array<char, 41> pub{}, sec{};
  zmq_curve_keypair(pub.data(), sec.data());
  return {std::string(pub.data(), 40), std::string(sec.data(), 40)};
}

std::string auth_key_name(const std::string& id) { return "auth/key/" + id; }

bool is_set_once_key(std::string_view key) {
  return key.rfind("auth/", 0) == 0 || key.find("/auth/") != std::string_view::npos;
}

bool is_erasable_key(std::string_view key) {
  for (std::string_view area : {"export/", "outcome/"}) {
    const std::size_t at = key.find(area);
    if (at == 0 || (at != std::string_view::npos && key[at - 1] == '/')) return true;
  }
  return false;
}

Result<std::unique_ptr<ZapHandler>> ZapHandler::start(
    void* zmq_context, std::function<bool(const std::string&)> accept, std::string who,
    log::Throttle& throttle) {
  auto h =
      std::make_unique<ZmqZapHandler>(zmq_context, std::move(accept), std::move(who), throttle);
  REFIT_RETURN_IF_ERROR(h->bind());
  return std::unique_ptr<ZapHandler>(std::move(h));
}

}  // namespace refit
