#include "weights/setup.h"

#include <fmt/format.h>

#include <filesystem>

#include "common/log.h"

namespace refit {
namespace {

// DeepSeek-V3's and GLM-4.5's MTP layers (model.layers.{num_hidden_layers}...) are in the
// checkpoint but not in the table: the engines' main models skip them, and their speculative
// decoding drafts load them on their own (docs/models.md, "MTP layers").
void log_mtp_layers(const ModelSpec& spec, const Checkpoint& ckpt) {
  const ModelConfig& c = spec.config();
  if (c.num_nextn_predict_layers <= 0) return;
  std::size_t n = 0;
  for (const std::string& name : ckpt.tensor_names())
    if (layer_of_name(name) >= c.num_layers) ++n;
  if (n > 0)
    log::info(
        "{}: the checkpoint's {} tensor(s) of its {} MTP layer(s) (model.layers.{}.*) are "
        "not part of the refit: the engines' main models skip them, and a speculative "
        "decoding draft loads them itself (docs/models.md, \"MTP layers\")",
        spec.source(), n, c.num_nextn_predict_layers, c.num_layers);
}

}  // namespace

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
      log_mtp_layers(m.spec, *m.checkpoint);
    }
  }
  REFIT_ASSIGN_OR_RETURN(m.plan,
                         make_bucket_plan(m.spec, config.refit.target_precision,
                                          config.refit.buffer_size_bytes, kBucketAlignment));
  m.weights = std::make_unique<WeightSource>(m.spec, config.seed, m.checkpoint.get());
  if (!m.weights->status().ok()) return m.weights->status().with_context(config.model);
  return holder;
}

std::string ipc_segment_prefix(const std::string& run_id, int rank) {
  return fmt::format("/refit-{}-t{}", run_id, rank);
}

}  // namespace refit
