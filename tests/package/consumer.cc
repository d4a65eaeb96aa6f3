// A program outside refit, built against the installed package (tests/package/run.sh): one
// trainer rank and one engine rank in two threads of this process, one verified refit of the
// tiny-qwen3 preset. Every trainer element is 1.5, so every engine element must be bf16 1.5
// (0x3FC0) — or 0 in vocabulary padding rows. Prints "consumer: ok <version> <elements>".
#include <refit/config.h>
#include <refit/session.h>
#include <refit/version.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int fail(const std::string& what, const refit::Status& s) {
  std::fprintf(stderr, "consumer: %s: %s\n", what.c_str(), s.to_string().c_str());
  return 1;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return 29517;
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

}  // namespace

int main() {
  if (std::strcmp(refit::version(), REFIT_VERSION_STRING) != 0 ||
      refit::wire_version() != REFIT_WIRE_VERSION) {
    std::fprintf(stderr, "consumer: headers say refit %s (wire %d), the library %s (wire %d)\n",
                 REFIT_VERSION_STRING, REFIT_WIRE_VERSION, refit::version(), refit::wire_version());
    return 1;
  }
  auto config = refit::parse_config(R"(
model: tiny-qwen3
device: cpu
policy: {backend: fsdp2, world_size: 1, dtype: float32}
generation: {backend: sglang, colocated: false, num_engines: 1, tp_size: 1}
refit: {target_precision: bf16, timeout_s: 30}
)");
  if (!config.ok()) return fail("parse_config", config.status());
  refit::Endpoint ep;
  ep.master_port = free_port();

  // The engine rank: its own storage, a verification hook over every element.
  refit::Status engine_status;
  std::int64_t engine_ones = 0;
  std::thread engine_thread([&] {
    auto engine = refit::Engine::create(*config, 0, ep);
    if (!engine.ok()) {
      engine_status = engine.status();
      return;
    }
    std::vector<std::vector<std::uint16_t>> storage;
    for (const refit::TensorSlot& p : (*engine)->params()) {
      storage.emplace_back(static_cast<std::size_t>(p.numel()), 0);
      engine_status = (*engine)->register_param(p.name, storage.back().data(), p.dtype, p.shape);
      if (!engine_status.ok()) return;
    }
    (*engine)->on_verify([&](int, const std::string&) {
      engine_ones = 0;
      for (const auto& param : storage)
        for (std::uint16_t bits : param) {
          if (bits == 0x3FC0) ++engine_ones;
          else if (bits != 0) return refit::Status::Corruption("an element is neither 1.5 nor 0");
        }
      return refit::Status::Ok();
    });
    engine_status = (*engine)->serve();
  });

  // The trainer rank: every element 1.5.
  auto trainer = refit::Trainer::create(*config, 0, ep);
  if (!trainer.ok()) {
    engine_thread.join();
    return fail("Trainer::create", trainer.status());
  }
  std::vector<std::vector<float>> shards;
  std::int64_t trainer_elements = 0;
  for (const refit::TensorSlot& t : (*trainer)->tensors()) {
    shards.emplace_back(static_cast<std::size_t>(t.numel()), 1.5f);
    trainer_elements += t.numel();
    refit::Status s = (*trainer)->register_tensor(t.name, shards.back().data(), t.dtype, t.shape);
    if (!s.ok()) return fail("register_tensor " + t.name, s);
  }
  refit::Status s = (*trainer)->refit(1, "v1", /*verify=*/true);
  refit::Status down = (*trainer)->shutdown();
  engine_thread.join();
  if (!s.ok()) return fail("refit", s);
  if (!down.ok()) return fail("shutdown", down);
  if (!engine_status.ok()) return fail("engine", engine_status);
  if (engine_ones < trainer_elements) {
    std::fprintf(stderr, "consumer: %lld engine elements are 1.5, the trainer sent %lld\n",
                 static_cast<long long>(engine_ones), static_cast<long long>(trainer_elements));
    return 1;
  }
  std::printf("consumer: ok %s %lld\n", refit::version(), static_cast<long long>(engine_ones));
  return 0;
}
