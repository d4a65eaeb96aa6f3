#include "weights/setup.h"

#include <fmt/format.h>

#include <filesystem>

namespace refit {

Result<std::unique_ptr<RankModel>> load_rank_model(const Config& config) {
  auto holder = std::make_unique<RankModel>();
  RankModel& m = *holder;
  REFIT_ASSIGN_OR_RETURN(m.spec, config_model_spec(config));
  REFIT_RETURN_IF_ERROR(validate_config(config, m.spec));
  std::error_code ec;
  if (std::filesystem::is_directory(config.model, ec)) {
    REFIT_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::open(config.model));
    if (m.checkpoint->empty()) {
      m.checkpoint.reset();
    } else {
      REFIT_RETURN_IF_ERROR(m.checkpoint->check_against_spec(m.spec));
    }
  }
  REFIT_ASSIGN_OR_RETURN(m.plan,
                         make_bucket_plan(m.spec, config.refit.target_precision,
                                          config.refit.buffer_size_bytes, kBucketAlignment));
  m.weights = std::make_unique<WeightSource>(m.spec, config.seed, m.checkpoint.get());
  return holder;
}

std::string ipc_segment_prefix(const std::string& run_id, int rank) {
  return fmt::format("/refit-{}-t{}", run_id, rank);
}

}  // namespace refit
