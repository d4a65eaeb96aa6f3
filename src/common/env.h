// Every environment variable refit reads, read one way: one typed accessor per variable.
// README.md "Environment variables" lists them all. Elsewhere in src/ only control/auth.cc
// (REFIT_SECRET and REFIT_SECRET_FILE, read by process_control_auth: the secret is never logged)
// and cli/cmd_run.cc (TMPDIR, where `refit run` makes its run directory) call getenv.
//
// An accessor reads its variable once, caches the result (the value, or the error) for the life
// of the process and logs the chosen value at debug level once. An empty value counts as unset.
// A bad value is an InvalidArgument Status naming the variable, the value and what is accepted;
// setup code returns it (the CLI exits 2), never falls back to the default.
//
// parse_<variable>(text) is the same parse without the environment and without the cache (tests):
// `text` is the value, nullopt when unset.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "common/log.h"
#include "refit/status.h"

namespace refit::env {

using Text = std::optional<std::string_view>;

// The raw value of `name`, nullopt when unset or empty.
std::optional<std::string> read(const char* name);

// The typed helpers every variable is parsed with.
// An integer in [lo, hi] (decimal, no sign for non-negative values, no spaces); nullopt when unset.
Result<std::optional<int>> parse_int(std::string_view name, Text text, int lo, int hi);
// The index of `text` in `words` (exact match); nullopt when unset.
Result<std::optional<int>> parse_word(std::string_view name, Text text,
                                      std::initializer_list<std::string_view> words);
// Any text; nullopt when unset.
std::optional<std::string> parse_string(Text text);

// ---- refit's own variables -------------------------------------------------------------------

// REFIT_LOG: debug | info | warn | error (default info). Read by the logger itself, so this
// accessor does not log (common/log.cc logs the level once it is set).
Result<log::Level> parse_log_level(Text text);
Result<log::Level> log_level();

// REFIT_CPU_THREADS: worker threads of the CPU data plane, 1..64 (default: the number of cores,
// at most 8).
Result<int> parse_cpu_threads(Text text);
Result<int> cpu_threads();

// REFIT_DEVICE: device: cuda — the GPU ordinal this process uses (taken modulo the visible GPUs),
// a non-negative integer; nullopt (default): the rank's placement (default_device).
Result<std::optional<int>> parse_device(Text text);
Result<std::optional<int>> device();

// REFIT_COPY_ENGINE: device: cuda — who moves uncast copy lists made of long contiguous
// stretches: 0 the copy kernel; 1 the copy engines alone; auto (default) the copy engines beside
// the kernel (each takes about half the bytes, at once) when every destination is another GPU's
// memory, else the kernel (docs/transfer-plan.md, "Copy engines beside the kernel").
enum class CopyEngineUse { kKernel, kCopyEngines, kAuto };
Result<CopyEngineUse> parse_copy_engine(Text text);
Result<CopyEngineUse> copy_engine();

// REFIT_CONTROL_SPIN_US: microseconds a rank's control thread keeps polling its mailbox without
// blocking after it last sent or received a message, 0..1000000; default 50000 on machines with
// at least 8 cores, else 0 (control/mailbox.h).
Result<int> parse_control_spin_us(Text text);
Result<int> control_spin_us();

// REFIT_HOST_ID: which host this process is on for the executor choice; nullopt (default): the
// kernel's boot id and the IPC namespace (host_identity).
std::optional<std::string> host_id();

// Which machine this process runs on, as far as shared memory, CUDA IPC and the mailboxes'
// same-host lanes are concerned: REFIT_HOST_ID when set (tests use it to split one machine into
// several "hosts"), else the kernel's boot id and this process's IPC namespace.
std::string host_identity();

// REFIT_CONTROL_LANES: 1 (default): mailboxes on one host (host_identity) exchange messages over
// Unix sockets their own threads read and write (control/lane.h); 0: every message goes through
// ZeroMQ.
Result<bool> parse_control_lanes(Text text);
Result<bool> control_lanes();

// REFIT_HOST: the address this process listens on; nullopt (default): MASTER_ADDR.
std::optional<std::string> host();

// REFIT_RUN_ID: the run's id, which names its shared-memory segments (/dev/shm/refit-<id>-…):
// 1 to 64 of [A-Za-z0-9_-]. `refit run` sets it for its ranks (and takes it from its own
// environment when set); nullopt (default): trainer rank 0 makes one from its pid and the time.
Result<std::optional<std::string>> parse_run_id(Text text);
Result<std::optional<std::string>> run_id();

// Every REFIT_* variable above: the first bad one's error, else ok. Called at setup (CLI
// commands that start ranks, Trainer/Engine creation) so a bad value is refused before anything
// starts, whether or not this run would use it.
Status check();

// ---- torchrun-style variables of `refit trainer` / `refit engine` ------------------------------

// MASTER_ADDR: trainer rank 0's address (default 127.0.0.1).
std::string master_addr();
// MASTER_PORT: torch.distributed's port, 1..65535 (default 29500). refit's store never takes it
// (store_port).
Result<int> parse_master_port(Text text);
Result<int> master_port();
// REFIT_PORT: the port of the run's store (trainer rank 0 hosts it on MASTER_ADDR), 0..65535; 0:
// trainer rank 0 binds a free port the system picks and reports it (its log, Trainer::store_port).
// nullopt when unset.
Result<std::optional<int>> parse_refit_port(Text text);
Result<std::optional<int>> refit_port();
// The store's port: REFIT_PORT when set; else MASTER_PORT + 1 when MASTER_PORT is set, so that
// it is never torch.distributed's own port (MASTER_PORT=65535 leaves none: an error asking for
// REFIT_PORT); else kDefaultStorePort.
inline constexpr int kDefaultStorePort = 29501;
Result<int> parse_store_port(Text refit_port, Text master_port);
Result<int> store_port();
// RANK: trainer rank (non-negative; unset: nullopt). refit engine falls back to it when
// ENGINE_RANK is unset.
Result<std::optional<int>> parse_rank(Text text);
Result<std::optional<int>> rank();
// WORLD_SIZE: trainer group size (positive; unset: nullopt, i.e. policy.world_size).
Result<std::optional<int>> parse_world_size(Text text);
Result<std::optional<int>> world_size();
// ENGINE_RANK: global engine rank = engine index * tp_size + tp rank (non-negative; unset:
// nullopt).
Result<std::optional<int>> parse_engine_rank(Text text);
Result<std::optional<int>> engine_rank();

}  // namespace refit::env
