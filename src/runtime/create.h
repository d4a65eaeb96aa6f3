// Trainer and Engine with the components a caller chooses (runtime/rank_core.h, RankServices):
// what Trainer::create and Engine::create do with default_services(), for the harness (a fault
// probe) and for tests (components of their own, ranks on threads of one process).
#pragma once

#include <memory>

#include "refit/session.h"
#include "runtime/rank_core.h"

namespace refit {

// What create_trainer and create_engine share: checks that `self` exists in `config`, makes the
// rank and runs its setup (its init(): RankCore::set_up).
template <typename Public, typename Impl>
Result<std::unique_ptr<Public>> set_up_rank(const Config& config, const RankId& self,
                                            const Endpoint& endpoint, RankServices services) {
  REFIT_RETURN_IF_ERROR(check_rank_in_config(config, self));
  auto rank = std::make_unique<Impl>(config, self, endpoint, std::move(services));
  REFIT_RETURN_IF_ERROR(rank->init());
  return std::unique_ptr<Public>(std::move(rank));
}

Result<std::unique_ptr<Trainer>> create_trainer(const Config& config, int rank,
                                                const Endpoint& endpoint, RankServices services);
Result<std::unique_ptr<Engine>> create_engine(const Config& config, int engine_rank,
                                              const Endpoint& endpoint, RankServices services);

// bench: one pass of the bare moves over the same bytes as a refit (no unshard, cast or apply).
// The bytes are not the weights: with peer access they land in the engines' parameters (which
// keep their published version), so run a refit after it before generating again. Collective
// over the trainer ranks, like refit().
Result<double> raw_transport_pass(Trainer& trainer);

// Trainer rank 0, after shutdown(): the session's control-plane work (ControlTraffic), every
// rank's as it reported it just before its last message (one store request). kUnsupported on
// other ranks or before the shutdown.
Result<ControlTraffic> control_traffic(Trainer& trainer);

}  // namespace refit
