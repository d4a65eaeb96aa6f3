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
#include "common/pieces_by_tensor.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"
#include "spec/fp8.h"

namespace refit {

inline constexpr std::int64_t kEngineVocabPadding = 64;

struct EngineParam {
  std::string name;                 // engine name, e.g. model.layers.0.self_attn.qkv_proj.weight
  std::vector<std::int64_t> shape;  // shape on this TP rank
  std::vector<Piece> pieces;        // dst = this parameter
  DType dtype = DType::kBFloat16;   // what the engine stores (engine_wire_layout sets it)
  std::int64_t numel() const;
  std::int64_t bytes() const { return numel() * static_cast<std::int64_t>(dtype_size(dtype)); }
};

struct EngineShardLayout {
  int tp_size = 1;
  int tp_rank = 0;
  std::vector<EngineParam> params;
  // For each HF (wire) tensor index: (param index, piece index) of every piece that reads from
  // it, in (param, piece) order.
  PiecesByTensor pieces_by_hf;
  std::int64_t total_numel() const;
  std::int64_t total_bytes() const;
};

// Checks that TP size `tp` can shard `spec` (heads, kv heads unless replicated, intermediate
// sizes, expert intermediate size). The message names the quantity and the allowed sizes.
Status check_engine_tp(const ModelSpec& spec, int tp);

// The layout of engine TP rank `tp_rank` of `tp_size`. The engine protocol matters where vLLM's
// and SGLang's fused layouts differ (Gemma 3's embedding: vocabulary-parallel in vLLM, whole in
// SGLang).
Result<EngineShardLayout> engine_layout(const ModelSpec& spec, int tp_size, int tp_rank,
                                        EngineLayout layout, EngineProtocol protocol);

// What engine TP rank `tp_rank` stores of the wire model (spec/fp8.h): engine_layout of `model`
// with every parameter's dtype, and with FP8 one float32 scale parameter after each quantized one
// (`<name>_scale_inv` with blocks, `<name>_scale` per tensor; docs/fp8.md). Pieces index the wire
// tensors. Errors (setup): a parameter fusing a quantized tensor with one left unquantized, and,
// with blocks, a TP slice or fused piece that would cut a block (naming the parameter, the
// tensor, the rows and columns, and the block).
Result<EngineShardLayout> engine_wire_layout(const ModelSpec& model, const WireModel& wire,
                                             int tp_size, int tp_rank, EngineLayout layout,
                                             EngineProtocol protocol);

// engine_wire_layout from a config: the wire model, generation.tp_size, layout and backend.
Result<EngineShardLayout> engine_wire_layout(const Config& config, const ModelSpec& model,
                                             const WireModel& wire, int tp_rank);

}  // namespace refit
