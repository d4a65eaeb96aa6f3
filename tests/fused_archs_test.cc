// The fused engine layouts of Gemma 2, Gemma 3 (text), Phi-3 and Qwen2-MoE (docs/models.md),
// checked against an independent oracle written from the engines' loaders rather than from
// src/engine/engine_layout.cc: for every TP rank, what vLLM's / SGLang's load_weights would leave
// in each parameter when handed the whole HF tensors (QKVParallelLinear and
// MergedColumnParallelLinear narrow each shard to the rank's rows, a checkpoint that is already
// fused is split by output sizes first, RowParallelLinear narrows columns, VocabParallelEmbedding
// pads the vocabulary to a multiple of 64 and splits it, replicated layers copy whole). Sources:
// vllm-project/vllm: vllm/model_executor/layers/linear.py, models/{gemma2,gemma3,phi3,llama,
// qwen2_moe}.py; sgl-project/sglang: python/sglang/srt/models/{gemma2,gemma3_causal,llama,
// qwen2_moe}.py.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/piece.h"
#include "engine/engine_layout.h"
#include "refit/config.h"
#include "refit/model_spec.h"
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
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    if (c.fused_in_checkpoint) {  // loaded_shard_id None: split by output sizes, then as above
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
    out[p + "self_attn.o_proj.weight"] = cols(hf(p + "self_attn.o_proj.weight"), r * qh * d, qh * d);
    if (c.qk_norm) {
      out[p + "self_attn.q_norm.weight"] = hf(p + "self_attn.q_norm.weight");
      out[p + "self_attn.k_norm.weight"] = hf(p + "self_attn.k_norm.weight");
    }
    if (c.is_moe_layer(i)) {
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
    for (int t : {1, 2, 4}) {
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
                                           "tiny-qwen2-moe", "tiny-qwen3", "tiny-moe"),
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

// What needs facts refit lacks for them is refused: the Megatron bridge and the logit check.
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
// engines, colocated and not, bit-exact; --check-logits says plainly it has no forward for them.
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
    auto logits = testing::run_cli({"run", cfg, "--check-logits"}, 60);
    EXPECT_EQ(logits.exit_code, 2) << logits.output;
    EXPECT_NE(logits.output.find("--check-logits: refit has no reference forward for"),
              std::string::npos)
        << logits.output;
  }
}

}  // namespace
}  // namespace refit
