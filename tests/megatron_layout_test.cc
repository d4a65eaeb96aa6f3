// Megatron layout: every local tensor's content, built by applying its pieces to full HF tensors
// of distinct values, must equal a reference written directly from the layout facts of
// docs/megatron.md (concatenating row/column ranges of HF tensors); owned pieces must tile every
// HF tensor exactly once; vocabulary padding must stay uncovered; bad parallel sizes are errors.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "refit/model_spec.h"
#include "trainer/trainer_layout.h"

namespace refit {
namespace {

// ---------------------------------------------------------------------------------------------
// A dense row-major matrix of element ids. Tensors are seen in dim-0 terms: [n] is n rows of 1.
struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<std::int64_t> v;
  std::int64_t at(std::int64_t r, std::int64_t c) const { return v[r * cols + c]; }
};

Mat zeros(std::int64_t rows, std::int64_t cols) {
  return {rows, cols, std::vector<std::int64_t>(rows * cols, 0)};
}

Mat slice_rows(const Mat& m, std::int64_t begin, std::int64_t end) {
  Mat out = zeros(end - begin, m.cols);
  for (std::int64_t r = begin; r < end; ++r)
    for (std::int64_t c = 0; c < m.cols; ++c) out.v[(r - begin) * m.cols + c] = m.at(r, c);
  return out;
}

Mat slice_cols(const Mat& m, std::int64_t begin, std::int64_t end) {
  Mat out = zeros(m.rows, end - begin);
  for (std::int64_t r = 0; r < m.rows; ++r)
    for (std::int64_t c = begin; c < end; ++c) out.v[r * out.cols + (c - begin)] = m.at(r, c);
  return out;
}

Mat vcat(const std::vector<Mat>& parts) {
  Mat out{0, parts.at(0).cols, {}};
  for (const Mat& p : parts) {
    EXPECT_EQ(p.cols, out.cols);
    out.rows += p.rows;
    out.v.insert(out.v.end(), p.v.begin(), p.v.end());
  }
  return out;
}

// Element id of HF tensor t, flat element i: never 0, so 0 marks "no piece wrote here".
std::int64_t element_id(std::size_t t, std::int64_t i) {
  return static_cast<std::int64_t>(t + 1) * 1'000'000'000 + i + 1;
}

// ---------------------------------------------------------------------------------------------
// Reference: what rank `rank` holds, per the textual facts (docs/design.md §6.3 / docs/megatron.md).
struct Expected {
  std::vector<std::int64_t> shape;
  Mat content;
};

struct Par {
  int tp = 1, pp = 1, ep = 1, dp = 1;
  int world() const { return tp * pp * dp; }
};

class Reference {
 public:
  Reference(const ModelSpec& spec, Par par) : spec_(spec), par_(par) {}

  // Full HF tensor by name, in dim-0 terms.
  Mat hf(const std::string& name) const {
    auto idx = spec_.find(name);
    EXPECT_TRUE(idx.has_value()) << name;
    const TensorSpec& t = spec_.tensors()[*idx];
    Mat m{t.rows(), t.row_elems(), std::vector<std::int64_t>(t.numel())};
    for (std::int64_t i = 0; i < t.numel(); ++i) m.v[i] = element_id(*idx, i);
    return m;
  }

  std::map<std::string, Expected> rank(int rank) const {
    const ModelConfig& c = spec_.config();
    const int tp_rank = rank % par_.tp;
    const int dp_rank = (rank / par_.tp) % par_.dp;
    const int pp_rank = rank / (par_.tp * par_.dp);
    const int ep_rank = dp_rank % par_.ep;
    const std::int64_t H = c.hidden_size, d = c.head_dim, nq = c.num_heads, nkv = c.num_kv_heads;
    std::map<std::string, Expected> out;
    auto put = [&](const std::string& name, std::vector<std::int64_t> shape, Mat m) {
      out[name] = Expected{std::move(shape), std::move(m)};
    };
    // Vocabulary padded with zero rows to a multiple of 128 * tp, split in contiguous ranges.
    const std::int64_t multiple = 128 * par_.tp;
    const std::int64_t vpad = (c.vocab_size + multiple - 1) / multiple * multiple;
    auto vocab_shard = [&](const std::string& hf_name) {
      Mat padded = vcat({hf(hf_name), zeros(vpad - c.vocab_size, H)});
      return slice_rows(padded, tp_rank * vpad / par_.tp, (tp_rank + 1) * vpad / par_.tp);
    };
    auto tp_rows = [&](const Mat& m) {  // column-parallel: this rank's contiguous dim-0 range
      return slice_rows(m, tp_rank * m.rows / par_.tp, (tp_rank + 1) * m.rows / par_.tp);
    };
    auto tp_cols = [&](const Mat& m) {  // row-parallel: this rank's contiguous column range
      return slice_cols(m, tp_rank * m.cols / par_.tp, (tp_rank + 1) * m.cols / par_.tp);
    };

    if (pp_rank == 0)
      put("embedding.word_embeddings.weight", {vpad / par_.tp, H},
          vocab_shard("model.embed_tokens.weight"));

    const std::int64_t per_stage = c.num_layers / par_.pp;
    for (std::int64_t local = 0; local < per_stage; ++local) {
      const std::int64_t layer = pp_rank * per_stage + local;
      const std::string m = fmt::format("decoder.layers.{}.", local);
      const std::string h = fmt::format("model.layers.{}.", layer);
      put(m + "self_attention.linear_qkv.layer_norm_weight", {H}, hf(h + "input_layernorm.weight"));
      // Query group g = kv head g with its nq/nkv query heads; this rank has groups
      // [tp_rank*nkv/tp, (tp_rank+1)*nkv/tp) and lays each out as [q heads ; k ; v].
      for (const char* kind : {"weight", "bias"}) {
        if (std::string(kind) == "bias" && !c.attention_bias) continue;
        const Mat q = hf(h + "self_attn.q_proj." + kind);
        const Mat k = hf(h + "self_attn.k_proj." + kind);
        const Mat v = hf(h + "self_attn.v_proj." + kind);
        const std::int64_t heads_per_group = nq / nkv;
        std::vector<Mat> parts;
        for (std::int64_t g = tp_rank * nkv / par_.tp; g < (tp_rank + 1) * nkv / par_.tp; ++g) {
          parts.push_back(slice_rows(q, g * heads_per_group * d, (g + 1) * heads_per_group * d));
          parts.push_back(slice_rows(k, g * d, (g + 1) * d));
          parts.push_back(slice_rows(v, g * d, (g + 1) * d));
        }
        Mat qkv = vcat(parts);
        std::vector<std::int64_t> shape = {(nq + 2 * nkv) * d / par_.tp};
        if (q.cols > 1) shape.push_back(H);
        put(m + "self_attention.linear_qkv." + kind, shape, std::move(qkv));
      }
      if (c.qk_norm) {
        put(m + "self_attention.q_layernorm.weight", {d}, hf(h + "self_attn.q_norm.weight"));
        put(m + "self_attention.k_layernorm.weight", {d}, hf(h + "self_attn.k_norm.weight"));
      }
      put(m + "self_attention.linear_proj.weight", {H, nq * d / par_.tp},
          tp_cols(hf(h + "self_attn.o_proj.weight")));
      if (c.is_moe_layer(layer)) {
        put(m + "pre_mlp_layernorm.weight", {H}, hf(h + "post_attention_layernorm.weight"));
        put(m + "mlp.router.weight", {c.num_experts, H}, hf(h + "mlp.gate.weight"));
        const std::int64_t local_experts = c.num_experts / par_.ep;
        const std::int64_t im = c.moe_intermediate_size / par_.tp;
        for (std::int64_t j = 0; j < local_experts; ++j) {
          const std::string e = fmt::format("{}mlp.experts.{}.", h, ep_rank * local_experts + j);
          const std::string me = fmt::format("{}mlp.experts.local_experts.{}.", m, j);
          put(me + "linear_fc1.weight", {2 * im, H},
              vcat({tp_rows(hf(e + "gate_proj.weight")), tp_rows(hf(e + "up_proj.weight"))}));
          put(me + "linear_fc2.weight", {H, im}, tp_cols(hf(e + "down_proj.weight")));
        }
      } else {
        const std::int64_t im = c.intermediate_size / par_.tp;
        put(m + "mlp.linear_fc1.layer_norm_weight", {H}, hf(h + "post_attention_layernorm.weight"));
        put(m + "mlp.linear_fc1.weight", {2 * im, H},
            vcat({tp_rows(hf(h + "mlp.gate_proj.weight")), tp_rows(hf(h + "mlp.up_proj.weight"))}));
        put(m + "mlp.linear_fc2.weight", {H, im}, tp_cols(hf(h + "mlp.down_proj.weight")));
      }
    }

    if (pp_rank == par_.pp - 1) {
      put("decoder.final_layernorm.weight", {H}, hf("model.norm.weight"));
      if (!c.tie_word_embeddings)
        put("output_layer.weight", {vpad / par_.tp, H}, vocab_shard("lm_head.weight"));
      else if (par_.pp > 1)  // the last stage's copy of the shared word embeddings
        put("output_layer.weight", {vpad / par_.tp, H}, vocab_shard("model.embed_tokens.weight"));
    }
    return out;
  }

 private:
  const ModelSpec& spec_;
  Par par_;
};

// Applies a local tensor's pieces to the HF element ids; fails on out-of-bounds or overlapping
// pieces. Unwritten elements stay 0.
Mat materialize(const ModelSpec& spec, const LocalTensor& t) {
  const MatrixShape ls = matrix_shape(t.shape);
  Mat out = zeros(ls.rows, ls.cols);
  for (const Piece& p : t.pieces) {
    EXPECT_LT(p.hf_tensor, spec.tensors().size());
    const MatrixShape hs = matrix_shape(spec.tensors()[p.hf_tensor].shape);
    EXPECT_GT(p.rows, 0) << t.name;
    EXPECT_GT(p.cols, 0) << t.name;
    EXPECT_TRUE(p.src_row >= 0 && p.src_col >= 0 && p.src_row + p.rows <= hs.rows &&
                p.src_col + p.cols <= hs.cols)
        << t.name << ": piece outside HF " << spec.tensors()[p.hf_tensor].name;
    EXPECT_TRUE(p.dst_row >= 0 && p.dst_col >= 0 && p.dst_row + p.rows <= ls.rows &&
                p.dst_col + p.cols <= ls.cols)
        << t.name << ": piece outside the local tensor";
    if (::testing::Test::HasFailure()) return out;
    for (std::int64_t r = 0; r < p.rows; ++r)
      for (std::int64_t c = 0; c < p.cols; ++c) {
        std::int64_t& dst = out.v[(p.dst_row + r) * ls.cols + p.dst_col + c];
        EXPECT_EQ(dst, 0) << t.name << ": pieces overlap at (" << p.dst_row + r << ", "
                          << p.dst_col + c << ")";
        dst = element_id(p.hf_tensor, (p.src_row + r) * hs.cols + p.src_col + c);
      }
  }
  return out;
}

Result<TrainerShardLayout> layout_of(const ModelSpec& spec, Par par, int rank) {
  return megatron_layout(spec, MegatronParallel{par.tp, par.pp, par.ep}, par.world(), rank);
}

struct Case {
  std::string preset;
  Par par;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << fmt::format("{} tp {} pp {} ep {} dp {}", c.preset, c.par.tp, c.par.pp, c.par.ep,
                     c.par.dp);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {1, 2})
    for (int pp : {1, 2}) {
      for (int dp : {1, 3}) out.push_back({"tiny-qwen3", {tp, pp, 1, dp}});
      out.push_back({"tiny-qwen2", {tp, pp, 1, 2}});
      for (auto [ep, dp] : {std::pair{1, 2}, {2, 2}, {2, 4}, {4, 4}})
        out.push_back({"tiny-moe", {tp, pp, ep, dp}});
    }
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2})
      for (int dp : {1, 2}) out.push_back({"tiny-llama", {tp, pp, 1, dp}});
  return out;
}

class MegatronLayoutCase : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto spec = load_model_spec(GetParam().preset);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    spec_ = std::move(spec).value();
  }
  ModelSpec spec_;
};

TEST_P(MegatronLayoutCase, LocalTensorsMatchReference) {
  const Par par = GetParam().par;
  const Reference ref(spec_, par);
  for (int rank = 0; rank < par.world(); ++rank) {
    SCOPED_TRACE(fmt::format("rank {}", rank));
    auto layout = layout_of(spec_, par, rank);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    EXPECT_EQ(layout->rank, rank);
    EXPECT_EQ(layout->world_size, par.world());
    const auto expected = ref.rank(rank);
    std::map<std::string, const LocalTensor*> got;
    for (const LocalTensor& t : layout->tensors) {
      EXPECT_TRUE(got.emplace(t.name, &t).second) << "duplicate local tensor " << t.name;
    }
    for (const auto& [name, e] : expected) EXPECT_TRUE(got.count(name)) << "missing " << name;
    for (const auto& [name, t] : got) {
      auto it = expected.find(name);
      if (it == expected.end()) {
        ADD_FAILURE() << "unexpected local tensor " << name;
        continue;
      }
      EXPECT_EQ(t->shape, it->second.shape) << name;
      const Mat m = materialize(spec_, *t);
      EXPECT_EQ(m.v, it->second.content.v) << name;
      for (std::uint32_t i : t->owned) EXPECT_LT(i, t->pieces.size()) << name;
    }
  }
}

TEST_P(MegatronLayoutCase, OwnedPiecesTileEveryHfTensorOnce) {
  const Par par = GetParam().par;
  const auto& ts = spec_.tensors();
  std::vector<std::vector<int>> hits(ts.size());
  for (std::size_t t = 0; t < ts.size(); ++t) hits[t].assign(ts[t].numel(), 0);
  for (int rank = 0; rank < par.world(); ++rank) {
    auto layout = layout_of(spec_, par, rank);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    ASSERT_EQ(layout->owned_by_hf.size(), ts.size());
    std::size_t owned_total = 0;
    for (const LocalTensor& t : layout->tensors) {
      owned_total += t.owned.size();
      for (std::uint32_t i : t.owned) {
        const Piece& p = t.pieces.at(i);
        const std::int64_t cols = matrix_shape(ts[p.hf_tensor].shape).cols;
        for (std::int64_t r = 0; r < p.rows; ++r)
          for (std::int64_t c = 0; c < p.cols; ++c)
            ++hits[p.hf_tensor][(p.src_row + r) * cols + p.src_col + c];
      }
    }
    std::size_t indexed = 0;
    for (std::size_t h = 0; h < ts.size(); ++h)
      for (auto [t, i] : layout->owned_by_hf[h]) {
        ++indexed;
        EXPECT_EQ(layout->tensors.at(t).pieces.at(i).hf_tensor, h);
      }
    EXPECT_EQ(indexed, owned_total) << "rank " << rank;
  }
  for (std::size_t t = 0; t < ts.size(); ++t) {
    std::int64_t wrong = 0, first = -1;
    for (std::int64_t i = 0; i < ts[t].numel(); ++i)
      if (hits[t][i] != 1 && wrong++ == 0) first = i;
    EXPECT_EQ(wrong, 0) << ts[t].name << ": element " << first << " owned " << hits[t][first]
                        << " times";
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, MegatronLayoutCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           const Case& c = info.param;
                           std::string n = fmt::format("{}_tp{}_pp{}_ep{}_dp{}", c.preset, c.par.tp,
                                                       c.par.pp, c.par.ep, c.par.dp);
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// ---------------------------------------------------------------------------------------------

const LocalTensor* find_local(const TrainerShardLayout& l, const std::string& name) {
  for (const auto& t : l.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

ModelSpec load(const char* preset) {
  auto spec = load_model_spec(preset);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return spec.ok() ? std::move(spec).value() : ModelSpec();
}

TEST(MegatronLayout, VocabPaddingRowsHaveNoPiece) {
  // tiny-qwen3: V = 1000, tp 2 -> padded to 1024, 512 rows per rank; rank 1 holds HF rows
  // [512, 1000) and 24 padding rows with no piece.
  const ModelSpec spec = load("tiny-qwen3");
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    auto l1 = megatron_layout(spec, {2, 1, 1}, 2, 1);
    ASSERT_TRUE(l1.ok());
    const LocalTensor* t = find_local(*l1, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, (std::vector<std::int64_t>{512, 64}));
    ASSERT_EQ(t->pieces.size(), 1u);
    EXPECT_EQ(t->pieces[0].src_row, 512);
    EXPECT_EQ(t->pieces[0].rows, 488);
    EXPECT_EQ(t->pieces[0].dst_row, 0);
    const Mat m = materialize(spec, *t);
    for (std::int64_t r = 488; r < 512; ++r)
      for (std::int64_t c = 0; c < 64; ++c) ASSERT_EQ(m.at(r, c), 0) << name << " row " << r;
  }
  // tiny-moe: V = 300, tp 2 -> 512 padded, 256 per rank: rank 1 holds 44 real rows.
  const ModelSpec moe = load("tiny-moe");
  auto l = megatron_layout(moe, {2, 1, 1}, 2, 1);
  ASSERT_TRUE(l.ok());
  const LocalTensor* e = find_local(*l, "embedding.word_embeddings.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape[0], 256);
  ASSERT_EQ(e->pieces.size(), 1u);
  EXPECT_EQ(e->pieces[0].rows, 44);
}

TEST(MegatronLayout, VocabShardEntirelyPaddingHasNoPieces) {
  // V = 700, tp 4 -> padded to 1024, 256 rows per rank: rank 3's range [768, 1024) is all
  // padding, so its embedding and output shards have no piece at all.
  auto c = parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":16,
    "intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":4,"vocab_size":700})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const ModelSpec spec(*c);
  auto l = megatron_layout(spec, {4, 1, 1}, 4, 3);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    const LocalTensor* t = find_local(*l, name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, (std::vector<std::int64_t>{256, 16}));
    EXPECT_TRUE(t->pieces.empty()) << name;
    EXPECT_TRUE(t->owned.empty()) << name;
  }
}

TEST(MegatronLayout, RankOrderIsTpThenDpThenPp) {
  // tp 2, pp 2, dp 2: rank 5 = tp_rank 1 + 2 * (dp_rank 0 + 2 * pp_rank 1).
  const ModelSpec spec = load("tiny-qwen3");
  auto l = megatron_layout(spec, {2, 2, 1}, 8, 5);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(find_local(*l, "embedding.word_embeddings.weight"), nullptr);
  EXPECT_NE(find_local(*l, "decoder.final_layernorm.weight"), nullptr);
  EXPECT_EQ(find_local(*l, "decoder.layers.1.self_attention.linear_qkv.weight"), nullptr);
  const LocalTensor* qkv = find_local(*l, "decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  // Local layer 0 of stage 1 is HF layer 1; tp_rank 1 holds query group 1 (heads 2, 3).
  ASSERT_EQ(qkv->pieces.size(), 3u);
  EXPECT_EQ(spec.tensors()[qkv->pieces[0].hf_tensor].name,
            "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(qkv->pieces[0].src_row, 32);
  EXPECT_EQ(spec.tensors()[qkv->pieces[1].hf_tensor].name,
            "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(qkv->pieces[1].src_row, 16);
  EXPECT_EQ(qkv->pieces[1].dst_row, 32);
  EXPECT_EQ(qkv->pieces[2].dst_row, 48);
  EXPECT_FALSE(qkv->owned.empty()) << "dp_rank 0 owns its TP slice";
  const LocalTensor* norm = find_local(*l, "decoder.final_layernorm.weight");
  EXPECT_TRUE(norm->owned.empty()) << "only tp_rank 0 owns replicated norms";
  // rank 6 = tp 0, dp 1, pp 1: a data-parallel replica owns nothing.
  auto r6 = megatron_layout(spec, {2, 2, 1}, 8, 6);
  ASSERT_TRUE(r6.ok());
  for (const auto& t : r6->tensors) EXPECT_TRUE(t.owned.empty()) << t.name;
}

TEST(MegatronLayout, TiedEmbeddingsLastStageCopyIsOutputLayerOwnedByFirstStage) {
  const ModelSpec spec = load("tiny-qwen2");
  const auto emb = *spec.find("model.embed_tokens.weight");
  auto first = megatron_layout(spec, {1, 2, 1}, 2, 0);
  auto last = megatron_layout(spec, {1, 2, 1}, 2, 1);
  ASSERT_TRUE(first.ok() && last.ok());
  const LocalTensor* e = find_local(*first, "embedding.word_embeddings.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->owned.size(), 1u);
  EXPECT_EQ(find_local(*first, "output_layer.weight"), nullptr);
  EXPECT_EQ(find_local(*last, "embedding.word_embeddings.weight"), nullptr);
  const LocalTensor* o = find_local(*last, "output_layer.weight");
  ASSERT_NE(o, nullptr);
  ASSERT_EQ(o->pieces.size(), 1u);
  EXPECT_EQ(o->pieces[0].hf_tensor, emb);
  EXPECT_TRUE(o->owned.empty());
  EXPECT_TRUE(last->owned_by_hf[emb].empty());
  // pp 1: one tensor serves both, no output_layer.weight.
  auto single = megatron_layout(spec, {1, 1, 1}, 1, 0);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(find_local(*single, "output_layer.weight"), nullptr);
}

TEST(MegatronLayout, ExpertsSplitOverEpAndOwnedByLowestReplica) {
  // tiny-moe, tp 1, pp 1, dp 4, ep 2: dp ranks 0,2 hold experts 0-3 and 1,3 hold 4-7;
  // dp ranks 0 and 1 own them.
  const ModelSpec spec = load("tiny-moe");
  for (int rank = 0; rank < 4; ++rank) {
    auto l = megatron_layout(spec, {1, 1, 2}, 4, rank);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    const LocalTensor* fc1 =
        find_local(*l, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
    ASSERT_NE(fc1, nullptr);
    EXPECT_EQ(find_local(*l, "decoder.layers.1.mlp.experts.local_experts.4.linear_fc1.weight"),
              nullptr);
    const int expert = (rank % 2) * 4 + 3;
    EXPECT_EQ(spec.tensors()[fc1->pieces[0].hf_tensor].name,
              fmt::format("model.layers.1.mlp.experts.{}.gate_proj.weight", expert));
    EXPECT_EQ(fc1->owned.empty(), rank >= 2) << "rank " << rank;
    const LocalTensor* router = find_local(*l, "decoder.layers.1.mlp.router.weight");
    ASSERT_NE(router, nullptr);
    EXPECT_EQ(router->owned.empty(), rank != 0);
  }
}

TEST(MegatronLayout, RealMoePresetOwnsEveryParameterOnce) {
  // Qwen3-30B-A3B with tp 4, pp 2, ep 8, dp 8 (64 ranks): owned elements add up to the model.
  const ModelSpec spec = load("qwen3-30b-a3b");
  const MegatronParallel par{4, 2, 8};
  std::int64_t owned = 0;
  for (int rank = 0; rank < 64; ++rank) {
    auto l = megatron_layout(spec, par, 64, rank);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    for (const auto& t : l->tensors)
      for (std::uint32_t i : t.owned) owned += t.pieces[i].rows * t.pieces[i].cols;
    if (rank == 9) {  // tp 1, dp 2 (ep_rank 2), pp 0: experts 32..47 of HF layer 23
      const LocalTensor* fc2 =
          find_local(*l, "decoder.layers.23.mlp.experts.local_experts.15.linear_fc2.weight");
      ASSERT_NE(fc2, nullptr);
      EXPECT_EQ(fc2->shape, (std::vector<std::int64_t>{2048, 192}));
      EXPECT_EQ(spec.tensors()[fc2->pieces[0].hf_tensor].name,
                "model.layers.23.mlp.experts.47.down_proj.weight");
      EXPECT_EQ(fc2->pieces[0].src_col, 192);
      EXPECT_FALSE(fc2->owned.empty());
    }
  }
  EXPECT_EQ(owned, spec.total_parameters());
}

// ---------------------------------------------------------------------------------------------

void expect_invalid(const Result<TrainerShardLayout>& r, std::vector<std::string> needles) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  for (const auto& n : needles)
    EXPECT_NE(r.status().message().find(n), std::string::npos)
        << "message \"" << r.status().message() << "\" lacks \"" << n << "\"";
}

TEST(MegatronLayout, ParallelSizesThatDoNotDivideAreErrors) {
  const ModelSpec qwen3 = load("tiny-qwen3");
  const ModelSpec moe = load("tiny-moe");
  const ModelSpec llama = load("tiny-llama");
  expect_invalid(megatron_layout(qwen3, {4, 1, 1}, 4, 0),
                 {"policy.megatron.tp", "4", "num_key_value_heads", "2"});
  expect_invalid(megatron_layout(qwen3, {3, 1, 1}, 3, 0),
                 {"policy.megatron.tp", "3", "num_attention_heads", "4"});
  expect_invalid(megatron_layout(qwen3, {2, 2, 1}, 6, 0), {"policy.world_size", "6", "tp*pp"});
  expect_invalid(megatron_layout(qwen3, {1, 4, 1}, 4, 0),
                 {"policy.megatron.pp", "4", "num_hidden_layers", "2"});
  expect_invalid(megatron_layout(llama, {1, 1, 2}, 2, 0), {"policy.megatron.ep", "2", "dense"});
  expect_invalid(megatron_layout(moe, {1, 1, 3}, 3, 0),
                 {"policy.megatron.ep", "3", "num_experts", "8"});
  expect_invalid(megatron_layout(moe, {1, 1, 2}, 3, 0),
                 {"policy.megatron.ep", "2", "data-parallel size 3"});
  expect_invalid(megatron_layout(qwen3, {0, 1, 1}, 1, 0), {"policy.megatron.tp", "0"});
  expect_invalid(megatron_layout(qwen3, {1, 0, 1}, 1, 0), {"policy.megatron.pp", "0"});
  expect_invalid(megatron_layout(qwen3, {1, 1, 0}, 1, 0), {"policy.megatron.ep", "0"});
  expect_invalid(megatron_layout(qwen3, {1, 1, 1}, 0, 0), {"policy.world_size", "0"});
  expect_invalid(megatron_layout(qwen3, {1, 1, 1}, 2, 2), {"rank 2", "policy.world_size 2"});

  auto dense = parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":32,
    "intermediate_size":50,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":4,"vocab_size":100})");
  ASSERT_TRUE(dense.ok()) << dense.status().to_string();
  expect_invalid(megatron_layout(ModelSpec(*dense), {4, 1, 1}, 4, 0),
                 {"policy.megatron.tp", "intermediate_size", "50"});
  auto sparse = parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,
    "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":4,"head_dim":8,"vocab_size":100,"num_experts":4,
    "num_experts_per_tok":1,"moe_intermediate_size":10})");
  ASSERT_TRUE(sparse.ok()) << sparse.status().to_string();
  expect_invalid(megatron_layout(ModelSpec(*sparse), {4, 1, 1}, 4, 0),
                 {"policy.megatron.tp", "moe_intermediate_size", "10"});
}

// ---------------------------------------------------------------------------------------------

bool same_layout(const TrainerShardLayout& a, const TrainerShardLayout& b) {
  if (a.rank != b.rank || a.world_size != b.world_size || a.tensors.size() != b.tensors.size())
    return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const auto &x = a.tensors[i], &y = b.tensors[i];
    if (x.name != y.name || x.shape != y.shape || x.owned != y.owned ||
        x.pieces.size() != y.pieces.size())
      return false;
    for (std::size_t j = 0; j < x.pieces.size(); ++j) {
      const Piece &p = x.pieces[j], &q = y.pieces[j];
      if (std::tie(p.hf_tensor, p.src_row, p.src_col, p.rows, p.cols, p.dst_row, p.dst_col) !=
          std::tie(q.hf_tensor, q.src_row, q.src_col, q.rows, q.cols, q.dst_row, q.dst_col))
        return false;
    }
  }
  return a.owned_by_hf == b.owned_by_hf;
}

TEST(TrainerLayout, DispatchesOnPolicyBackend) {
  const ModelSpec spec = load("tiny-moe");
  PolicyConfig policy;
  policy.backend = PolicyBackend::kFsdp2;
  policy.world_size = 3;
  policy.megatron = {2, 1, 1};  // ignored by fsdp2
  auto f = trainer_layout(spec, policy, 2);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(same_layout(*f, fsdp2_layout(spec, 3, 2)));
  EXPECT_NE(find_local(*f, "model.embed_tokens.weight"), nullptr);

  policy.backend = PolicyBackend::kMegatron;
  policy.world_size = 8;
  policy.megatron = {2, 2, 2};
  auto m = trainer_layout(spec, policy, 7);
  auto direct = megatron_layout(spec, policy.megatron, 8, 7);
  ASSERT_TRUE(m.ok() && direct.ok()) << m.status().to_string();
  EXPECT_TRUE(same_layout(*m, *direct));
  EXPECT_NE(find_local(*m, "output_layer.weight"), nullptr);
}

TEST(TrainerLayout, ReportsErrors) {
  const ModelSpec spec = load("tiny-qwen3");
  PolicyConfig policy;
  policy.backend = PolicyBackend::kMegatron;
  policy.world_size = 4;
  policy.megatron = {4, 1, 1};
  expect_invalid(trainer_layout(spec, policy, 0), {"policy.megatron.tp", "num_key_value_heads"});
  policy.backend = PolicyBackend::kFsdp2;
  expect_invalid(trainer_layout(spec, policy, 4), {"rank 4", "policy.world_size 4"});
  policy.world_size = 0;
  expect_invalid(trainer_layout(spec, policy, 0), {"policy.world_size", "0"});
}

}  // namespace
}  // namespace refit
