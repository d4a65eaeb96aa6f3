// The fused engine layouts of Gemma 2, Gemma 3 (text), Phi-3, Qwen2-MoE, DeepSeek-V3 (MLA) and
// GLM-4.5 (docs/models.md),
// checked against an independent oracle written from the engines' loaders rather than from
// src/engine/engine_layout.cc: for every TP rank, what vLLM's / SGLang's load_weights would leave
// in each parameter when handed the whole HF tensors (QKVParallelLinear and
// MergedColumnParallelLinear narrow each shard to the rank's rows, a checkpoint that is already
// fused is split by output sizes first, RowParallelLinear narrows columns, VocabParallelEmbedding
// pads the vocabulary to a multiple of 64 and splits it, replicated layers copy whole). Sources:
// vllm-project/vllm: vllm/model_executor/layers/linear.py, models/{gemma2,gemma3,phi3,llama,
// qwen2_moe,deepseek_v2,glm4_moe}.py; sgl-project/sglang: python/sglang/srt/models/{gemma2,
// gemma3_causal,llama,qwen2_moe,deepseek_v2,glm4_moe}.py and
// models/deepseek_common/deepseek_weight_loader.py.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/piece.h"
#include "engine/engine_layout.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "spec/fp8.h"
#include "test_util.h"

namespace refit {
namespace {

// A tensor of element tags: tag = (hf tensor index + 1) << 32 | element index; 0 = padding.
struct Tagged {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> v;
  std::int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  std::int64_t row_len() const { return v.size() / std::max<std::int64_t>(rows(), 1); }
};

Tagged hf_tensor(const ModelSpec& spec, std::size_t i) {
  const TensorSpec& t = spec.tensors()[i];
  Tagged out{t.shape, std::vector<std::int64_t>(static_cast<std::size_t>(t.numel()))};
  for (std::size_t k = 0; k < out.v.size(); ++k)
    out.v[k] = (static_cast<std::int64_t>(i + 1) << 32) | static_cast<std::int64_t>(k);
  return out;
}

// Rows [r0, r0 + n) of a tensor (dim 0; a 1-D tensor's elements).
Tagged rows(const Tagged& t, std::int64_t r0, std::int64_t n) {
  Tagged out{t.shape, {}};
  out.shape[0] = n;
  const std::int64_t len = t.row_len();
  out.v.assign(t.v.begin() + r0 * len, t.v.begin() + (r0 + n) * len);
  return out;
}

// Columns [c0, c0 + n) of a 2-D tensor.
Tagged cols(const Tagged& t, std::int64_t c0, std::int64_t n) {
  Tagged out{{t.shape[0], n}, {}};
  for (std::int64_t r = 0; r < t.shape[0]; ++r)
    for (std::int64_t c = 0; c < n; ++c) out.v.push_back(t.v[r * t.shape[1] + c0 + c]);
  return out;
}

// Dim-0 concatenation.
Tagged cat(const std::vector<Tagged>& parts) {
  Tagged out = parts.at(0);
  out.shape[0] = 0;
  out.v.clear();
  for (const auto& p : parts) {
    out.shape[0] += p.shape.empty() ? 1 : p.shape[0];
    out.v.insert(out.v.end(), p.v.begin(), p.v.end());
  }
  return out;
}

// Stacks equally shaped tensors along a new dim 0 ([E, ...]).
Tagged stack(const std::vector<Tagged>& parts) {
  Tagged out = cat(parts);
  out.shape = parts.at(0).shape;
  out.shape.insert(out.shape.begin(), static_cast<std::int64_t>(parts.size()));
  return out;
}

// What the engines' loaders leave on TP rank r of t (the oracle).
std::map<std::string, Tagged> loader_oracle(const ModelSpec& spec, std::int64_t t, std::int64_t r,
                                            EngineProtocol protocol) {
  const ModelConfig& c = spec.config();
  auto hf = [&](const std::string& name) { return hf_tensor(spec, *spec.find(name)); };
  const std::int64_t d = c.head_dim, nq = c.num_heads, nkv = c.num_kv_heads;
  std::map<std::string, Tagged> out;
  auto vocab_parallel = [&](const std::string& name) {
    const Tagged w = hf(name);
    const std::int64_t padded = (c.vocab_size + 63) / 64 * 64, per = padded / t, lo = r * per;
    Tagged p{{per, c.hidden_size}, std::vector<std::int64_t>(per * c.hidden_size, 0)};
    const std::int64_t real = std::max<std::int64_t>(0, std::min(lo + per, c.vocab_size) - lo);
    for (std::int64_t k = 0; k < real * c.hidden_size; ++k) p.v[k] = w.v[lo * c.hidden_size + k];
    out[name] = p;
  };
  if (c.arch == Architecture::kGemma3 && protocol == EngineProtocol::kSglang)
    out["model.embed_tokens.weight"] = hf("model.embed_tokens.weight");  // nn.Embedding
  else
    vocab_parallel("model.embed_tokens.weight");
  if (!c.tie_word_embeddings) vocab_parallel("lm_head.weight");
  out["model.norm.weight"] = hf("model.norm.weight");
  // QKVParallelLinear: q heads split; kv heads split, or replicated with rank r reading head
  // r / (t / nkv) when t > nkv.
  const std::int64_t qh = nq / t, kvh = t <= nkv ? nkv / t : 1, kv0 = t <= nkv ? r * kvh : r / (t / nkv);
  auto qkv_shard = [&](const Tagged& q, const Tagged& k, const Tagged& v) {
    return cat({rows(q, r * qh * d, qh * d), rows(k, kv0 * d, kvh * d), rows(v, kv0 * d, kvh * d)});
  };
  auto merged = [&](const Tagged& gate, const Tagged& up, std::int64_t I) {
    return cat({rows(gate, r * I / t, I / t), rows(up, r * I / t, I / t)});
  };
  // ColumnParallelLinear narrows the output dim to the rank's 1/t, RowParallelLinear the input.
  auto column = [&](const Tagged& w) { return rows(w, r * w.rows() / t, w.rows() / t); };
  auto row_parallel = [&](const Tagged& w) { return cols(w, r * w.shape[1] / t, w.shape[1] / t); };
  const bool deepseek_moe = c.arch == Architecture::kDeepseekV3 || c.arch == Architecture::kGlm4Moe;
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    if (c.arch == Architecture::kDeepseekV3) {  // MLA: models/deepseek_v2.py of both engines
      const std::string a = p + "self_attn.";
      if (c.q_lora_rank > 0) {
        // vLLM: fused_qkv_a_proj, MergedColumnParallelLinear([q_lora_rank, kv_lora_rank + rope],
        // disable_tp) with q_a_proj as shard 0 and kv_a_proj_with_mqa as shard 1; SGLang:
        // fused_qkv_a_proj_with_mqa, a ReplicatedLinear given torch.cat([q_a, kv_a], dim=0).
        const std::string fused = protocol == EngineProtocol::kSglang
                                      ? "fused_qkv_a_proj_with_mqa.weight"
                                      : "fused_qkv_a_proj.weight";
        out[a + fused] = cat({hf(a + "q_a_proj.weight"), hf(a + "kv_a_proj_with_mqa.weight")});
        out[a + "q_a_layernorm.weight"] = hf(a + "q_a_layernorm.weight");
        out[a + "q_b_proj.weight"] = column(hf(a + "q_b_proj.weight"));
      } else {
        out[a + "q_proj.weight"] = column(hf(a + "q_proj.weight"));
        out[a + "kv_a_proj_with_mqa.weight"] = hf(a + "kv_a_proj_with_mqa.weight");
      }
      out[a + "kv_a_layernorm.weight"] = hf(a + "kv_a_layernorm.weight");
      out[a + "kv_b_proj.weight"] = column(hf(a + "kv_b_proj.weight"));
      out[a + "o_proj.weight"] = row_parallel(hf(a + "o_proj.weight"));
    } else if (c.fused_in_checkpoint) {  // loaded_shard_id None: split by output sizes, then as
                                         // above
      const Tagged qkv = hf(p + "self_attn.qkv_proj.weight");
      out[p + "self_attn.qkv_proj.weight"] =
          qkv_shard(rows(qkv, 0, nq * d), rows(qkv, nq * d, nkv * d), rows(qkv, (nq + nkv) * d, nkv * d));
    } else {
      out[p + "self_attn.qkv_proj.weight"] =
          qkv_shard(hf(p + "self_attn.q_proj.weight"), hf(p + "self_attn.k_proj.weight"),
                    hf(p + "self_attn.v_proj.weight"));
      if (c.attention_bias)
        out[p + "self_attn.qkv_proj.bias"] =
            qkv_shard(hf(p + "self_attn.q_proj.bias"), hf(p + "self_attn.k_proj.bias"),
                      hf(p + "self_attn.v_proj.bias"));
    }
    if (c.arch != Architecture::kDeepseekV3)
      out[p + "self_attn.o_proj.weight"] =
          cols(hf(p + "self_attn.o_proj.weight"), r * qh * d, qh * d);
    if (c.qk_norm) {
      out[p + "self_attn.q_norm.weight"] = hf(p + "self_attn.q_norm.weight");
      out[p + "self_attn.k_norm.weight"] = hf(p + "self_attn.k_norm.weight");
    }
    if (deepseek_moe && i >= c.first_k_dense_replace) {
      // DeepseekV2MoE / Glm4MoE (vLLM) and DeepseekV2MoE / Glm4MoeSparseMoeBlock (SGLang): the
      // gate module holds the router weight and e_score_correction_bias, FusedMoE w13 / w2, and
      // every shared expert in one MLP (mlp.shared_experts, moe_intermediate_size *
      // n_shared_experts rows).
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size;
      out[p + "mlp.gate.weight"] = hf(p + "mlp.gate.weight");
      out[p + "mlp.gate.e_score_correction_bias"] = hf(p + "mlp.gate.e_score_correction_bias");
      std::vector<Tagged> w13, w2;
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        w13.push_back(merged(hf(q + "gate_proj.weight"), hf(q + "up_proj.weight"), I));
        w2.push_back(row_parallel(hf(q + "down_proj.weight")));
      }
      out[p + "mlp.experts.w13_weight"] = stack(w13);
      out[p + "mlp.experts.w2_weight"] = stack(w2);
      const std::int64_t S = I * c.n_shared_experts;
      out[p + "mlp.shared_experts.gate_up_proj.weight"] =
          merged(hf(p + "mlp.shared_experts.gate_proj.weight"),
                 hf(p + "mlp.shared_experts.up_proj.weight"), S);
      out[p + "mlp.shared_experts.down_proj.weight"] =
          row_parallel(hf(p + "mlp.shared_experts.down_proj.weight"));
    } else if (!deepseek_moe && c.is_moe_layer(i)) {
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size;
      out[p + "mlp.gate.weight"] = hf(p + "mlp.gate.weight");
      std::vector<Tagged> w13, w2;
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        w13.push_back(merged(hf(q + "gate_proj.weight"), hf(q + "up_proj.weight"), I));
        w2.push_back(cols(hf(q + "down_proj.weight"), r * I / t, I / t));
      }
      out[p + "mlp.experts.w13_weight"] = stack(w13);
      out[p + "mlp.experts.w2_weight"] = stack(w2);
      if (c.shared_expert_intermediate_size > 0) {
        const std::int64_t S = c.shared_expert_intermediate_size;
        out[p + "mlp.shared_expert.gate_up_proj.weight"] =
            merged(hf(p + "mlp.shared_expert.gate_proj.weight"),
                   hf(p + "mlp.shared_expert.up_proj.weight"), S);
        out[p + "mlp.shared_expert.down_proj.weight"] =
            cols(hf(p + "mlp.shared_expert.down_proj.weight"), r * S / t, S / t);
        out[p + "mlp.shared_expert_gate.weight"] = hf(p + "mlp.shared_expert_gate.weight");
      }
    } else {
      const std::int64_t I = c.intermediate_size;
      if (c.fused_in_checkpoint) {
        const Tagged gu = hf(p + "mlp.gate_up_proj.weight");
        out[p + "mlp.gate_up_proj.weight"] = merged(rows(gu, 0, I), rows(gu, I, I), I);
      } else {
        out[p + "mlp.gate_up_proj.weight"] =
            merged(hf(p + "mlp.gate_proj.weight"), hf(p + "mlp.up_proj.weight"), I);
      }
      out[p + "mlp.down_proj.weight"] = cols(hf(p + "mlp.down_proj.weight"), r * I / t, I / t);
    }
    for (const char* norm : {"input_layernorm", "post_attention_layernorm"})
      out[p + norm + ".weight"] = hf(p + norm + ".weight");
    if (c.feedforward_norms)
      for (const char* norm : {"pre_feedforward_layernorm", "post_feedforward_layernorm"})
        out[p + norm + ".weight"] = hf(p + norm + ".weight");
  }
  return out;
}

// What refit's layout puts in each parameter: its pieces applied to the tagged HF tensors.
std::map<std::string, Tagged> refit_layout(const ModelSpec& spec, const EngineShardLayout& L) {
  std::map<std::string, Tagged> out;
  for (const EngineParam& p : L.params) {
    const MatrixShape dst = matrix_shape(p.shape);
    Tagged t{p.shape, std::vector<std::int64_t>(static_cast<std::size_t>(dst.numel()), 0)};
    for (const Piece& pc : p.pieces) {
      const Tagged src = hf_tensor(spec, pc.hf_tensor);
      const MatrixShape m = matrix_shape(src.shape);
      for (std::int64_t i = 0; i < pc.rows; ++i)
        for (std::int64_t j = 0; j < pc.cols; ++j)
          t.v[(pc.dst_row + i) * dst.cols + pc.dst_col + j] =
              src.v[(pc.src_row + i) * m.cols + pc.src_col + j];
    }
    EXPECT_TRUE(out.emplace(p.name, std::move(t)).second) << "duplicate parameter " << p.name;
  }
  return out;
}

class FusedArchs : public ::testing::TestWithParam<const char*> {};

TEST_P(FusedArchs, EveryRankMatchesWhatTheEnginesLoadersLeave) {
  auto spec = load_model_spec(GetParam());
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  int checked = 0;
  for (EngineProtocol protocol : {EngineProtocol::kVllm, EngineProtocol::kSglang}) {
    for (int t : {1, 2, 4, 8}) {
      if (!check_engine_tp(*spec, t).ok()) continue;
      for (int r = 0; r < t; ++r) {
        SCOPED_TRACE(fmt::format("{} {} tp {} rank {}", GetParam(),
                                 engine_protocol_name(protocol), t, r));
        auto L = engine_layout(*spec, t, r, EngineLayout::kFused, protocol);
        ASSERT_TRUE(L.ok()) << L.status().to_string();
        const auto want = loader_oracle(*spec, t, r, protocol);
        const auto got = refit_layout(*spec, *L);
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, w] : want) {
          auto it = got.find(name);
          ASSERT_NE(it, got.end()) << name;
          EXPECT_EQ(it->second.shape, w.shape) << name;
          EXPECT_EQ(it->second.v, w.v) << name;
        }
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 6);  // TP 1 and 2 at least, for both engines
}

INSTANTIATE_TEST_SUITE_P(Tiny, FusedArchs,
                         ::testing::Values("tiny-gemma2", "tiny-gemma3", "tiny-phi3",
                                           "tiny-qwen2-moe", "tiny-qwen3", "tiny-moe",
                                           "tiny-deepseek", "tiny-deepseek-lite", "tiny-glm4-moe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// Gemma 3's embedding differs between the engines: whole on every SGLang rank, split in vLLM.
TEST(FusedArchsFacts, Gemma3EmbeddingIsWholeInSglangAndSplitInVllm) {
  auto spec = load_model_spec("tiny-gemma3");
  ASSERT_TRUE(spec.ok());
  auto sg = engine_layout(*spec, 2, 1, EngineLayout::kFused, EngineProtocol::kSglang);
  auto vl = engine_layout(*spec, 2, 1, EngineLayout::kFused, EngineProtocol::kVllm);
  ASSERT_TRUE(sg.ok() && vl.ok());
  EXPECT_EQ(sg->params[0].shape, (std::vector<std::int64_t>{401, 40}));
  EXPECT_EQ(vl->params[0].shape, (std::vector<std::int64_t>{224, 40}));  // 448 / 2
}

Config engine_config(const std::string& model, EngineProtocol protocol, int tp) {
  Config c;
  c.model = model;
  c.generation.backend = protocol;
  c.generation.tp_size = tp;
  return c;
}

// The dtype of every engine parameter: the router correction bias float32 in both engines,
// GLM-4.5's router weight float32 in vLLM (nn.Linear(..., dtype=torch.float32) in glm4_moe.py)
// and in the model dtype in SGLang (Glm4MoeGate), DeepSeek-V3's router in the model dtype in both
// (vLLM's GateLinear without params_dtype, SGLang's MoEGate); everything else bf16.
TEST(FusedArchsFacts, EngineDtypesFollowEachEnginesParameters) {
  int checked = 0;
  for (const char* model : {"tiny-deepseek", "tiny-deepseek-lite", "tiny-glm4-moe"}) {
    auto spec = load_model_spec(model);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    for (EngineProtocol protocol : {EngineProtocol::kVllm, EngineProtocol::kSglang}) {
      const Config cfg = engine_config(model, protocol, 2);
      auto wire = wire_model(cfg, *spec);
      ASSERT_TRUE(wire.ok()) << wire.status().to_string();
      auto L = engine_wire_layout(cfg, *spec, *wire, 1);
      ASSERT_TRUE(L.ok()) << L.status().to_string();
      const bool glm_vllm =
          spec->config().arch == Architecture::kGlm4Moe && protocol == EngineProtocol::kVllm;
      for (const EngineParam& p : L->params) {
        SCOPED_TRACE(fmt::format("{} {} {}", model, engine_protocol_name(protocol), p.name));
        const bool bias = p.name.ends_with("mlp.gate.e_score_correction_bias");
        const bool router = p.name.ends_with("mlp.gate.weight");
        EXPECT_EQ(p.dtype, bias || (router && glm_vllm) ? DType::kFloat32 : DType::kBFloat16);
        checked += bias;
      }
    }
  }
  EXPECT_EQ(checked, 2 * (2 + 2 + 2));  // MoE layers: tiny-deepseek 2, lite 2, glm 2; two engines
}

// The published models at TP 8, as vLLM and SGLang shape them (per-partition sizes of the
// engines' ColumnParallelLinear / RowParallelLinear / FusedMoE).
TEST(FusedArchsFacts, PublishedMoeModelsAtTp8) {
  struct Want {
    const char* model;
    EngineProtocol protocol;
    std::string name;
    std::vector<std::int64_t> shape;
  };
  const std::string l3 = "model.layers.3.", l1 = "model.layers.1.";
  const std::vector<Want> wants = {
      {"deepseek-v3",
       EngineProtocol::kVllm,
       l3 + "self_attn.fused_qkv_a_proj.weight",
       {2112, 7168}},
      {"deepseek-v3",
       EngineProtocol::kSglang,
       l3 + "self_attn.fused_qkv_a_proj_with_mqa.weight",
       {2112, 7168}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "self_attn.q_b_proj.weight", {16 * 192, 1536}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "self_attn.kv_b_proj.weight", {16 * 256, 512}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "self_attn.o_proj.weight", {7168, 16 * 128}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "mlp.experts.w13_weight", {256, 512, 7168}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "mlp.experts.w2_weight", {256, 7168, 256}},
      {"deepseek-v3",
       EngineProtocol::kVllm,
       l3 + "mlp.shared_experts.gate_up_proj.weight",
       {512, 7168}},
      {"deepseek-v3", EngineProtocol::kVllm, l3 + "mlp.gate.e_score_correction_bias", {256}},
      {"deepseek-v3",
       EngineProtocol::kVllm,
       "model.layers.2.mlp.gate_up_proj.weight",
       {4608, 7168}},
      {"kimi-k2", EngineProtocol::kSglang, l3 + "self_attn.q_b_proj.weight", {8 * 192, 1536}},
      {"kimi-k2", EngineProtocol::kSglang, l3 + "mlp.experts.w13_weight", {384, 512, 7168}},
      {"kimi-k2", EngineProtocol::kSglang, "lm_head.weight", {20480, 7168}},
      {"glm-4.5-air", EngineProtocol::kVllm, l1 + "self_attn.qkv_proj.weight", {1536 + 256, 4096}},
      {"glm-4.5-air", EngineProtocol::kVllm, l1 + "self_attn.qkv_proj.bias", {1536 + 256}},
      {"glm-4.5-air", EngineProtocol::kVllm, l1 + "mlp.experts.w13_weight", {128, 352, 4096}},
      {"glm-4.5-air",
       EngineProtocol::kVllm,
       l1 + "mlp.shared_experts.down_proj.weight",
       {4096, 176}},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(fmt::format("{} {} {}", w.model, engine_protocol_name(w.protocol), w.name));
    auto spec = load_model_spec(w.model);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    auto L = engine_layout(*spec, 8, 5, EngineLayout::kFused, w.protocol);
    ASSERT_TRUE(L.ok()) << L.status().to_string();
    const auto it = std::find_if(L->params.begin(), L->params.end(),
                                 [&](const EngineParam& p) { return p.name == w.name; });
    ASSERT_NE(it, L->params.end());
    EXPECT_EQ(it->shape, w.shape);
  }
}

// FP8 as DeepSeek-V3 and Kimi-K2 ship (block 128 x 128 weight_scale_inv): every quantized linear
// of the engine layout has its scale under the engine's name, the router, its bias and the norms
// stay unquantized, and no TP slice of either model cuts a block up to TP 8.
TEST(FusedArchsFacts, DeepseekFp8ScalesCarryTheEnginesNames) {
  for (const char* model : {"deepseek-v3", "kimi-k2"})
    for (EngineProtocol protocol : {EngineProtocol::kVllm, EngineProtocol::kSglang})
      for (int tp : {1, 2, 4, 8}) {
        SCOPED_TRACE(fmt::format("{} {} tp {}", model, engine_protocol_name(protocol), tp));
        auto spec = load_model_spec(model);
        ASSERT_TRUE(spec.ok());
        Config cfg = engine_config(model, protocol, tp);
        cfg.refit.target_precision = DType::kFloat8E4M3;
        auto wire = wire_model(cfg, *spec);
        ASSERT_TRUE(wire.ok()) << wire.status().to_string();
        auto L = engine_wire_layout(cfg, *spec, *wire, tp - 1);
        ASSERT_TRUE(L.ok()) << L.status().to_string();
        if (std::string(model) != "deepseek-v3" || tp != 8) continue;
        std::map<std::string, const EngineParam*> by_name;
        for (const EngineParam& p : L->params) by_name[p.name] = &p;
        const std::string a = "model.layers.5.self_attn.", m = "model.layers.5.mlp.";
        const std::string fused = protocol == EngineProtocol::kSglang
                                      ? "fused_qkv_a_proj_with_mqa.weight"
                                      : "fused_qkv_a_proj.weight";
        using S = std::vector<std::int64_t>;
        const std::vector<std::pair<std::string, S>> scales = {
            {a + fused + "_scale_inv", {17, 56}},  // 12 blocks of q_a, 5 of kv_a (576 rows)
            {a + "q_b_proj.weight_scale_inv", {24, 12}},
            {a + "kv_b_proj.weight_scale_inv", {32, 4}},
            {a + "o_proj.weight_scale_inv", {56, 16}},
            {m + "experts.w13_weight_scale_inv", {256, 4, 56}},
            {m + "experts.w2_weight_scale_inv", {256, 56, 2}},
            {m + "shared_experts.gate_up_proj.weight_scale_inv", {4, 56}},
            {m + "shared_experts.down_proj.weight_scale_inv", {56, 2}},
            {"model.layers.0.mlp.gate_up_proj.weight_scale_inv", {36, 56}},
            {"model.layers.0.mlp.down_proj.weight_scale_inv", {56, 18}}};
        for (const auto& [name, shape] : scales) {
          ASSERT_TRUE(by_name.count(name)) << name;
          EXPECT_EQ(by_name[name]->shape, shape) << name;
          EXPECT_EQ(by_name[name]->dtype, DType::kFloat32) << name;
          EXPECT_EQ(by_name[name.substr(0, name.size() - std::string("_scale_inv").size())]->dtype,
                    DType::kFloat8E4M3)
              << name;
        }
        EXPECT_EQ(by_name[m + "gate.weight"]->dtype, DType::kBFloat16);
        EXPECT_EQ(by_name[m + "gate.e_score_correction_bias"]->dtype, DType::kFloat32);
        EXPECT_EQ(by_name[a + "kv_a_layernorm.weight"]->dtype, DType::kBFloat16);
        EXPECT_FALSE(by_name.count(m + "gate.weight_scale_inv"));
        EXPECT_FALSE(by_name.count(a + "q_a_layernorm.weight_scale_inv"));
      }
}

// A block the fused a-projection would cut is refused at setup, naming the parameter and the
// tensor: with 16-row blocks, kv_a_proj_with_mqa starts at row 24 of fused_qkv_a_proj (tiny
// q_lora_rank 24), so its first block would share a scale with q_a_proj's last.
TEST(FusedArchsFacts, Fp8BlockCutByTheFusedAProjectionIsRefused) {
  auto spec = load_model_spec("tiny-deepseek");
  ASSERT_TRUE(spec.ok());
  Config cfg = engine_config("tiny-deepseek", EngineProtocol::kVllm, 1);
  cfg.refit.target_precision = DType::kFloat8E4M3;
  cfg.refit.fp8 = Fp8Config{.block_rows = 16, .block_cols = 16, .given = true};
  auto wire = wire_model(cfg, *spec);
  ASSERT_TRUE(wire.ok()) << wire.status().to_string();
  auto L = engine_wire_layout(cfg, *spec, *wire, 0);
  ASSERT_FALSE(L.ok());
  EXPECT_NE(L.status().message().find(
                "parameter model.layers.0.self_attn.fused_qkv_a_proj.weight takes rows [0, 24) x "
                "cols [0, 48) of model.layers.0.self_attn.q_a_proj.weight [24, 48] at row 0, col "
                "0 of its [52, 48]; that cuts a 16 x 16 block"),
            std::string::npos)
      << L.status().message();
  cfg.refit.fp8.block_rows = cfg.refit.fp8.block_cols = 8;  // 24 = 3 blocks: every piece fits
  auto wire8 = wire_model(cfg, *spec);
  ASSERT_TRUE(wire8.ok());
  EXPECT_TRUE(engine_wire_layout(cfg, *spec, *wire8, 0).ok());
}

// GLM-4.5-Air's dense MLP (intermediate_size 10944, 85.5 blocks of 128) cannot be block-quantized
// as one gate_up_proj at any TP size: gate's last block would share its scale with up's first.
TEST(FusedArchsFacts, Glm45AirDenseMlpCutsA128Block) {
  auto spec = load_model_spec("glm-4.5-air");
  ASSERT_TRUE(spec.ok());
  Config cfg = engine_config("glm-4.5-air", EngineProtocol::kVllm, 1);
  cfg.refit.target_precision = DType::kFloat8E4M3;
  auto wire = wire_model(cfg, *spec);
  ASSERT_TRUE(wire.ok());
  auto L = engine_wire_layout(cfg, *spec, *wire, 0);
  ASSERT_FALSE(L.ok());
  EXPECT_NE(L.status().message().find("parameter model.layers.0.mlp.gate_up_proj.weight takes rows "
                                      "[0, 10944) x cols [0, 4096) of "
                                      "model.layers.0.mlp.gate_proj.weight"),
            std::string::npos)
      << L.status().message();
}

// The new architectures parse with the flags their forward and layouts need; an untied Gemma 2 is
// refused, naming the key.
TEST(FusedArchsFacts, NewArchitecturesParseWithTheirFlags) {
  auto g2 = load_model_spec("tiny-gemma2");
  ASSERT_TRUE(g2.ok());
  EXPECT_TRUE(g2->config().tie_word_embeddings);
  EXPECT_TRUE(g2->config().feedforward_norms);
  EXPECT_FALSE(g2->find("lm_head.weight"));
  EXPECT_TRUE(g2->find("model.layers.1.pre_feedforward_layernorm.weight"));
  auto phi = load_model_spec("tiny-phi3");
  ASSERT_TRUE(phi.ok());
  EXPECT_TRUE(phi->find("model.layers.0.self_attn.qkv_proj.weight"));
  EXPECT_FALSE(phi->find("model.layers.0.self_attn.q_proj.weight"));
  auto moe = load_model_spec("tiny-qwen2-moe");
  ASSERT_TRUE(moe.ok());
  EXPECT_TRUE(moe->find("model.layers.0.mlp.shared_expert_gate.weight"));
  EXPECT_FALSE(moe->find("model.layers.1.mlp.gate.weight"));  // mlp_only_layers: [1]
  EXPECT_TRUE(moe->find("model.layers.0.self_attn.q_proj.bias"));
  auto untied = parse_hf_config(
      R"({"architectures": ["Gemma2ForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
          "tie_word_embeddings": false})");
  ASSERT_FALSE(untied.ok());
  EXPECT_NE(untied.status().message().find("tie_word_embeddings"), std::string::npos);
}

// End to end across real processes: FSDP2 world 3 (uneven chunks) into the fused layouts, both
// engines, colocated and not, bit-exact; and --check-logits from every engine rank's shards.
TEST(FusedArchsRuntime, Fsdp2IntoEveryNewFusedLayoutBitExact) {
  testing::TempDir dir;
  struct Cell {
    const char* model;
    const char* engine;
    bool colocated;
    int world;
  };
  for (const Cell& c : {Cell{"tiny-gemma2", "vllm", false, 3}, Cell{"tiny-gemma3", "sglang", false, 3},
                        Cell{"tiny-phi3", "vllm", true, 2}, Cell{"tiny-qwen2-moe", "sglang", false, 3}}) {
    SCOPED_TRACE(c.model);
    const std::string cfg = dir.write(
        "c.yaml", fmt::format("model: {}\npolicy: {{world_size: {}}}\ngeneration: {{backend: {}, "
                              "colocated: {}, num_engines: {}, tp_size: 2}}\nrefit: "
                              "{{buffer_size_bytes: 4096, timeout_s: 30}}\n",
                              c.model, c.world, c.engine, c.colocated ? "true" : "false",
                              c.colocated ? 1 : 2));
    auto r = testing::run_cli({"run", cfg, "--steps", "2", "--verify"}, 180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos)
        << r.output;
    auto logits = testing::run_cli({"run", cfg, "--check-logits"}, 120);
    EXPECT_EQ(logits.exit_code, 0) << logits.output;
    EXPECT_NE(logits.output.find("from the engine's TP shards match the reference forward"),
              std::string::npos)
        << logits.output;
  }
}

}  // namespace
}  // namespace refit
