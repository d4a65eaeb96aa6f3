#include "harness/fault_probe.h"

#include <fmt/format.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/log.h"
#include "runtime/create.h"

namespace refit {
namespace {

class FaultProbe final : public RefitProbe {
 public:
  FaultProbe(const Fault& f, bool trainer, int rank) : f_(f), trainer_(trainer), rank_(rank) {}

  void before_hello(HelloMessage& hello) override {
    if (trainer_) return;
    if (f_.kind == Fault::Kind::kVersionMismatch) hello.refit_version += "+mismatch";
    if (f_.kind == Fault::Kind::kPlanMismatch) {
      hello.plan_hash = "0000000000000000";
      // The transfer plan: a wrong digest of every pair's routes too.
      if (!hello.routes_digest.empty()) hello.routes_digest = "0000000000000000";
    }
  }

  void at_setup() override {
    if (!mine() || f_.bucket != Fault::kAtSetup) return;
    log::info("fault injection: {} myself at setup", f_.stop ? "stopping" : "killing");
    raise(f_.stop ? SIGSTOP : SIGKILL);
  }

  void before_commit(int step) override {
    if (!trainer_ && f_.kind == Fault::Kind::kStallEngine && f_.rank == rank_ && step == f_.step) {
      stall("before its commit");
      return;
    }
    if (step != 1 || !mine() || f_.bucket != Fault::kAtCommit) return;
    log::info("fault injection: {} myself at the commit", f_.stop ? "stopping" : "killing");
    raise(f_.stop ? SIGSTOP : SIGKILL);
  }

  void before_round(int step, int round) override {
    if (trainer_ && f_.kind == Fault::Kind::kStallTrainer && f_.rank == rank_ &&
        step == f_.step && !stalled_) {
      stalled_ = true;  // before the first round it moves
      stall(round == kEveryRound ? "before writing the engines' parameters"
                                 : fmt::format("before round {}", round));
      return;
    }
    if (step != 1 || !mine() || f_.bucket < 0) return;
    const char* how = f_.stop ? "stopping" : "killing";
    if (round == kEveryRound) {
      log::info("fault injection: {} myself while {} the engines' parameters", how,
                trainer_ ? "writing" : "peers write");
      raise(f_.stop ? SIGSTOP : SIGKILL);
    } else if (round >= f_.bucket) {  // the first round from K on that this rank moves
      log::info("fault injection: {} myself at round {}", how, round);
      raise(f_.stop ? SIGSTOP : SIGKILL);
    }
  }

  bool forget_delta_base(int step, int peer) override {
    const Fault::Kind kind = trainer_ ? Fault::Kind::kForgetKept : Fault::Kind::kForgetBase;
    return f_.kind == kind && f_.rank == rank_ && f_.peer == peer && f_.step == step;
  }

  Status after_write(int step, int round, DataPlane& plane, const std::vector<CopyRun>& written,
                     DType dtype) override {
    if (step != f_.step || !trainer_ || f_.kind != Fault::Kind::kCorrupt || written.empty())
      return Status::Ok();
    if (round != kEveryRound && round != f_.bucket) return Status::Ok();
    const CopyRun& r =
        written[round == kEveryRound
                    ? std::min<std::size_t>(written.size() - 1, static_cast<std::size_t>(f_.bucket))
                    : 0];
    if (round == kEveryRound)
      log::info("fault injection: corrupting a parameter written in place");
    else
      log::info("fault injection: corrupting round {} in flight", round);
    const auto at = (r.block.dst_offset + r.block.cols / 2) * static_cast<std::int64_t>(dtype_size(dtype));
    return plane.diagnostics()->corrupt_byte(r.dst + at);
  }

 private:
  // Alive but stuck (its heartbeat thread goes on): for 2.5 x refit.timeout_s, so that the
  // other ranks time out even when scheduling on a loaded machine delays them by a whole timeout.
  void stall(const std::string& where) {
    log::info("fault injection: stalling for {} ms {}", f_.stall_ms, where);
    std::this_thread::sleep_for(std::chrono::milliseconds(f_.stall_ms));
    log::info("fault injection: the stall ended");
  }

  // A kill or stop fault aimed at this rank.
  bool mine() const {
    const Fault::Kind kill = trainer_ ? Fault::Kind::kKillTrainer : Fault::Kind::kKillEngine;
    return f_.kind == kill && f_.rank == rank_;
  }

  const Fault f_;
  const bool trainer_;
  const int rank_;
  bool stalled_ = false;
};

}  // namespace

std::shared_ptr<RefitProbe> make_fault_probe(const Fault& fault, bool trainer, int rank) {
  return std::make_shared<FaultProbe>(fault, trainer, rank);
}

namespace {

Result<RankServices> armed(const Config& config, Fault fault, bool trainer, int rank) {
  REFIT_ASSIGN_OR_RETURN(RankServices services, default_services());
  fault.stall_ms = static_cast<int>(config.refit.timeout_s * 2500);
  services.probe = make_fault_probe(fault, trainer, rank);
  return services;
}

}  // namespace

Result<std::unique_ptr<Trainer>> create_trainer_with_fault(const Config& config, int rank,
                                                           const Endpoint& endpoint,
                                                           const Fault& fault) {
  REFIT_ASSIGN_OR_RETURN(RankServices services, armed(config, fault, true, rank));
  return create_trainer(config, rank, endpoint, std::move(services));
}

Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault) {
  REFIT_ASSIGN_OR_RETURN(RankServices services, armed(config, fault, false, engine_rank));
  return create_engine(config, engine_rank, endpoint, std::move(services));
}

}  // namespace refit
