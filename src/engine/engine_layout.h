// The engine's parameter layout (docs/design.md §6.4; vLLM and SGLang share it for these models).
//
// An EngineShardLayout lists the parameters one engine TP rank stores, each built from Pieces of
// full HF tensors. With generation.layout fused: under the engine's names (fused qkv_proj /
// gate_up_proj, vocabulary-parallel embed_tokens / lm_head padded to a multiple of 64, MoE
// w13_weight / w2_weight); elements no piece covers (vocabulary padding rows) are zero. With
// generation.layout hf: every HF tensor whole, under its HF name, in the spec's order, on every
// TP rank (docs/engines.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/piece.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

inline constexpr std::int64_t kEngineVocabPadding = 64;

struct EngineParam {
  std::string name;                 // engine name, e.g. model.layers.0.self_attn.qkv_proj.weight
  std::vector<std::int64_t> shape;  // shape on this TP rank
  std::vector<Piece> pieces;        // dst = this parameter
};

struct EngineShardLayout {
  int tp_size = 1;
  int tp_rank = 0;
  std::vector<EngineParam> params;
  // For each HF tensor index: (param index, piece index) of every piece that reads from it.
  std::vector<std::vector<std::pair<std::uint32_t, std::uint32_t>>> pieces_by_hf;
  std::int64_t total_numel() const;
};

// Checks that TP size `tp` can shard `spec` (heads, kv heads unless replicated, intermediate
// sizes, expert intermediate size). The message names the quantity and the allowed sizes.
Status check_engine_tp(const ModelSpec& spec, int tp);

// The layout of engine TP rank `tp_rank` of `tp_size`. The engine protocol matters where vLLM's
// and SGLang's fused layouts differ (Gemma 3's embedding: vocabulary-parallel in vLLM, whole in
// SGLang).
Result<EngineShardLayout> engine_layout(const ModelSpec& spec, int tp_size, int tp_rank,
                                        EngineLayout layout, EngineProtocol protocol);

}  // namespace refit
