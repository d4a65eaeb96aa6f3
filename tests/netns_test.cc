// Two real hosts on one machine: network namespaces joined by a veth pair, each with its own
// address and its own IPC namespace (so refit sees two hosts). Trainer ranks 0 and 1 and engine
// TP rank 0 run on host A, engine TP rank 1 on host B; every process listens on its own host's
// address and the store lives on A's. With executor auto the pairs within A use peer access
// (shared memory) and the pairs across the link use point-to-point over Gloo/TCP between the two
// addresses. Needs root (CI runs as root); skips with the reason otherwise. Traffic stays on the
// namespaces' own addresses. The control plane is authenticated (a secret file readable only by
// its owner, given to every rank); a rank started without it on a non-loopback address is refused
// at setup.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "test_util.h"

namespace refit {
namespace {

using testing::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(NetworkNamespaces, PeerWithinAHostAndP2pAcrossTheLink) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  TempDir dir;
  const int id = static_cast<int>(getpid() % 200) + 20;
  const std::string a = fmt::format("refit-a{}", getpid()), b = fmt::format("refit-b{}", getpid());
  const std::string ip_a = fmt::format("10.231.{}.1", id), ip_b = fmt::format("10.231.{}.2", id);
  const std::string cfg = dir.write(
      "c.yaml",
      "model: tiny-qwen3\nseed: 11\npolicy: {backend: fsdp2, world_size: 2, dtype: float32}\n"
      "generation: {backend: vllm, num_engines: 1, tp_size: 2}\n"
      "refit: {buffer_size_bytes: 8192, timeout_s: 20, executor: auto}\n");
  const std::string cfg1 = dir.write(
      "c1.yaml",
      "model: tiny-qwen3\npolicy: {backend: fsdp2, world_size: 1}\n"
      "generation: {backend: vllm, num_engines: 1, tp_size: 1}\nrefit: {timeout_s: 5}\n");
  const std::string exe = REFIT_CLI_PATH;
  const std::string setup = fmt::format(
      "command -v unshare && ip netns add {a} && ip netns add {b} && "
      "ip link add {a}v type veth peer name {b}v && "
      "ip link set {a}v netns {a} && ip link set {b}v netns {b} && "
      "ip -n {a} addr add {ipa}/24 dev {a}v && ip -n {b} addr add {ipb}/24 dev {b}v && "
      "ip -n {a} link set {a}v up && ip -n {b} link set {b}v up && "
      "ip -n {a} link set lo up && ip -n {b} link set lo up",
      fmt::arg("a", a), fmt::arg("b", b), fmt::arg("ipa", ip_a), fmt::arg("ipb", ip_b));
  if (std::system((setup + " > " + dir.path() + "/setup.log 2>&1").c_str()) != 0) {
    std::system(fmt::format("ip netns del {} 2>/dev/null; ip netns del {} 2>/dev/null", a, b).c_str());
    GTEST_SKIP() << "cannot create network namespaces here: " << slurp(dir.path() + "/setup.log");
  }
  // One shell per host, each in a new IPC namespace: its processes share it, the hosts do not.
  const std::string secret = dir.write("secret", "netns-test-secret-0123456789abcdef\n");
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  const std::string env =
      fmt::format("MASTER_ADDR={} REFIT_PORT=29633 REFIT_SECRET_FILE={}", ip_a, secret);
  const std::string host_a = fmt::format(
      "cd {d}; export {env} REFIT_HOST={ipa}; "
      "RANK=0 WORLD_SIZE=2 {exe} trainer {cfg} --steps 2 --verify > t0.log 2>&1 & "
      "RANK=1 WORLD_SIZE=2 {exe} trainer {cfg} --steps 2 --verify > t1.log 2>&1 & "
      "ENGINE_RANK=0 {exe} engine {cfg} > e0.log 2>&1 & "
      "for p in $(jobs -p); do wait $p; echo $? >> codes-a; done",
      fmt::arg("d", dir.path()), fmt::arg("env", env), fmt::arg("ipa", ip_a), fmt::arg("exe", exe),
      fmt::arg("cfg", cfg));
  const std::string host_b = fmt::format(
      "cd {d}; export {env} REFIT_HOST={ipb}; ENGINE_RANK=1 {exe} engine {cfg} > e1.log 2>&1; "
      "echo $? >> codes-b",
      fmt::arg("d", dir.path()), fmt::arg("env", env), fmt::arg("ipb", ip_b), fmt::arg("exe", exe),
      fmt::arg("cfg", cfg));
  const std::string run = fmt::format(
      "timeout -k 5 90 ip netns exec {a} unshare --ipc bash -c '{ha}' & "
      "timeout -k 5 90 ip netns exec {b} unshare --ipc bash -c '{hb}' & wait",
      fmt::arg("a", a), fmt::arg("b", b), fmt::arg("ha", host_a), fmt::arg("hb", host_b));
  const int rc = std::system(run.c_str());
  // Without the secret, on host A's address: refused at setup (exit 2), naming the variable.
  const int refused = std::system(
      fmt::format("cd {d}; timeout -k 5 60 ip netns exec {a} env MASTER_ADDR={ipa} REFIT_PORT=29634 "
                  "REFIT_HOST={ipa} RANK=0 WORLD_SIZE=1 {exe} trainer {cfg1} > bare.log 2>&1; "
                  "echo $? > bare-code",
                  fmt::arg("d", dir.path()), fmt::arg("a", a), fmt::arg("ipa", ip_a),
                  fmt::arg("exe", exe), fmt::arg("cfg1", cfg1))
          .c_str());
  std::system(fmt::format("ip netns del {}; ip netns del {}", a, b).c_str());
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(refused, 0);
  EXPECT_EQ(slurp(dir.path() + "/bare-code"), "2\n") << slurp(dir.path() + "/bare.log");
  EXPECT_NE(slurp(dir.path() + "/bare.log")
                .find(fmt::format("listening on {} (not a loopback address) needs an "
                                  "authenticated control plane: set REFIT_SECRET",
                                  ip_a)),
            std::string::npos)
      << slurp(dir.path() + "/bare.log");
  const std::string out = slurp(dir.path() + "/t0.log") + slurp(dir.path() + "/t1.log") +
                          slurp(dir.path() + "/e0.log") + slurp(dir.path() + "/e1.log");
  EXPECT_EQ(slurp(dir.path() + "/codes-a"), "0\n0\n0\n") << out;
  EXPECT_EQ(slurp(dir.path() + "/codes-b"), "0\n") << out;
  EXPECT_NE(out.find("verified bit-exact"), std::string::npos) << out;
  EXPECT_NE(out.find("pairs by executor: peer 2, p2p 2"), std::string::npos) << out;
  EXPECT_NE(out.find("authenticated (CURVE, keys from the run secret)"), std::string::npos) << out;
}

}  // namespace
}  // namespace refit
