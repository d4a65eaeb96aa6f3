// Trainer (FSDP2) and engine layouts, checked element by element: full HF tensors filled with
// distinct values are cut by each rank's pieces and compared against references written directly
// from docs/design.md §6.2 / §6.4, then the ranks' slices are reassembled into the full tensors.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <unordered_map>

#include "engine/engine_layout.h"
#include "refit/model_spec.h"
#include "trainer/trainer_layout.h"

namespace refit {
namespace {

using Tensor = std::vector<std::int64_t>;
using Shape = std::vector<std::int64_t>;

constexpr std::int64_t kValueStride = 10'000'000;  // > numel of every tiny tensor
const char* const kTinyPresets[] = {"tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-moe"};

ModelSpec load(const std::string& name) {
  auto spec = load_model_spec(name);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return spec.ok() ? std::move(spec).value() : ModelSpec();
}

std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Tensor i holds (i+1)*kValueStride + element index: every element of the model is distinct and
// nonzero, so a zero in a local tensor means "no piece wrote here".
std::vector<Tensor> fill_hf(const ModelSpec& spec) {
  std::vector<Tensor> full;
  for (std::size_t i = 0; i < spec.tensors().size(); ++i) {
    Tensor x(static_cast<std::size_t>(spec.tensors()[i].numel()));
    for (std::size_t e = 0; e < x.size(); ++e)
      x[e] = static_cast<std::int64_t>(i + 1) * kValueStride + static_cast<std::int64_t>(e);
    full.push_back(std::move(x));
  }
  return full;
}

struct Applied {
  Tensor data;              // zero where no piece wrote
  std::vector<int> writes;  // how many pieces wrote each element
};

// Copies `pieces` out of the full HF tensors into a zero tensor of `shape`, checking bounds.
Applied apply_pieces(const ModelSpec& spec, const std::vector<Tensor>& full, const Shape& shape,
                     const std::vector<Piece>& pieces, const std::string& name) {
  const MatrixShape dst = matrix_shape(shape);
  Applied a{Tensor(static_cast<std::size_t>(dst.numel()), 0),
            std::vector<int>(static_cast<std::size_t>(dst.numel()), 0)};
  for (const Piece& p : pieces) {
    if (p.hf_tensor >= spec.tensors().size()) {
      ADD_FAILURE() << name << ": piece reads HF tensor " << p.hf_tensor;
      continue;
    }
    const MatrixShape src = matrix_shape(spec.tensors()[p.hf_tensor].shape);
    const bool in_bounds = p.rows > 0 && p.cols > 0 && p.src_row >= 0 && p.src_col >= 0 &&
                           p.src_row + p.rows <= src.rows && p.src_col + p.cols <= src.cols &&
                           p.dst_row >= 0 && p.dst_col >= 0 && p.dst_row + p.rows <= dst.rows &&
                           p.dst_col + p.cols <= dst.cols;
    if (!in_bounds) {
      ADD_FAILURE() << name << ": piece out of bounds or empty (src " << p.src_row << "+" << p.rows
                    << ", " << p.src_col << "+" << p.cols << "; dst " << p.dst_row << ", "
                    << p.dst_col << ")";
      continue;
    }
    const Tensor& s = full[p.hf_tensor];
    for (std::int64_t i = 0; i < p.rows; ++i)
      for (std::int64_t j = 0; j < p.cols; ++j) {
        const auto d = static_cast<std::size_t>((p.dst_row + i) * dst.cols + p.dst_col + j);
        a.data[d] = s[static_cast<std::size_t>((p.src_row + i) * src.cols + p.src_col + j)];
        ++a.writes[d];
      }
  }
  return a;
}

// --- Reference slicing helpers (flat row-major, independent of Piece) -------------------------

Tensor rows_of(const Tensor& x, std::int64_t cols, std::int64_t r0, std::int64_t r1) {
  return Tensor(x.begin() + r0 * cols, x.begin() + r1 * cols);
}

Tensor cols_of(const Tensor& x, std::int64_t cols, std::int64_t c0, std::int64_t c1) {
  Tensor out;
  for (std::int64_t r = 0; r < static_cast<std::int64_t>(x.size()) / cols; ++r)
    for (std::int64_t c = c0; c < c1; ++c) out.push_back(x[static_cast<std::size_t>(r * cols + c)]);
  return out;
}

void append(Tensor& a, const Tensor& b) { a.insert(a.end(), b.begin(), b.end()); }

// ============================== FSDP2 ==========================================================

TEST(Fsdp2Layout, RowsFollowTorchChunk) {
  auto sizes = [](std::int64_t n, int w) {
    std::vector<std::int64_t> s;
    std::int64_t next = 0;
    for (int r = 0; r < w; ++r) {
      const RowRange rr = fsdp2_rows(n, w, r);
      EXPECT_EQ(rr.begin, rr.size() > 0 ? next : rr.begin) << "n=" << n << " w=" << w;
      next = rr.end;
      s.push_back(rr.size());
    }
    return s;
  };
  EXPECT_EQ(sizes(5, 4), (std::vector<std::int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(sizes(10, 3), (std::vector<std::int64_t>{4, 4, 2}));
  EXPECT_EQ(sizes(8, 4), (std::vector<std::int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(sizes(1, 3), (std::vector<std::int64_t>{1, 0, 0}));
  EXPECT_EQ(sizes(0, 2), (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(sizes(9, 1), (std::vector<std::int64_t>{9}));
  // ceil(7/4) = 2: rows [0,2) [2,4) [4,6) [6,7).
  EXPECT_EQ(fsdp2_rows(7, 4, 3).begin, 6);
  EXPECT_EQ(fsdp2_rows(7, 4, 3).end, 7);
}

TEST(Fsdp2Layout, ShardsMatchDim0ChunksAndTileEveryTensor) {
  for (const char* preset : kTinyPresets) {
    const ModelSpec spec = load(preset);
    const std::vector<Tensor> full = fill_hf(spec);
    const auto& hf = spec.tensors();
    for (int W : {1, 2, 3, 4, 5, 8}) {
      SCOPED_TRACE(std::string(preset) + " W=" + std::to_string(W));
      std::vector<std::vector<int>> owned_count(hf.size());
      for (std::size_t i = 0; i < hf.size(); ++i)
        owned_count[i].assign(static_cast<std::size_t>(hf[i].numel()), 0);
      for (int r = 0; r < W; ++r) {
        const TrainerShardLayout L = fsdp2_layout(spec, W, r);
        EXPECT_EQ(L.rank, r);
        EXPECT_EQ(L.world_size, W);
        ASSERT_EQ(L.tensors.size(), hf.size());
        ASSERT_EQ(L.owned_by_hf.size(), hf.size());
        for (std::size_t i = 0; i < hf.size(); ++i) {
          const LocalTensor& t = L.tensors[i];
          EXPECT_EQ(t.name, hf[i].name);
          // Reference: torch.chunk on dim 0 of a contiguous tensor is a flat element range.
          const std::int64_t n0 = hf[i].shape[0];
          const std::int64_t chunk = (n0 + W - 1) / W;
          const std::int64_t b = std::min(n0, r * chunk), e = std::min(n0, (r + 1) * chunk);
          Shape want_shape = hf[i].shape;
          want_shape[0] = e - b;
          ASSERT_EQ(t.shape, want_shape) << t.name;
          const std::int64_t row_elems = hf[i].numel() / n0;
          const Tensor want = rows_of(full[i], row_elems, b, e);
          const Applied got = apply_pieces(spec, full, t.shape, t.pieces, t.name);
          EXPECT_EQ(got.data, want) << t.name << " rank " << r;
          for (int w : got.writes) ASSERT_EQ(w, 1) << t.name << " rank " << r;
          // FSDP2 has no replicas: the rank owns every piece it holds.
          ASSERT_EQ(t.owned.size(), t.pieces.size()) << t.name;
          for (std::uint32_t k = 0; k < t.owned.size(); ++k) EXPECT_EQ(t.owned[k], k);
          for (const Piece& p : t.pieces) {
            const MatrixShape m = matrix_shape(hf[i].shape);
            for (std::int64_t a = 0; a < p.rows; ++a)
              for (std::int64_t c = 0; c < p.cols; ++c)
                ++owned_count[i]
                             [static_cast<std::size_t>((p.src_row + a) * m.cols + p.src_col + c)];
          }
          // owned_by_hf points back at exactly these pieces.
          ASSERT_EQ(L.owned_by_hf[i].size(), t.pieces.size()) << t.name;
          for (const auto& [lt, pk] : L.owned_by_hf[i]) {
            EXPECT_EQ(lt, i);
            EXPECT_EQ(L.tensors[lt].pieces[pk].hf_tensor, i);
          }
        }
      }
      for (std::size_t i = 0; i < hf.size(); ++i)
        for (int c : owned_count[i]) ASSERT_EQ(c, 1) << hf[i].name << " owned " << c << " times";
    }
  }
}

TEST(Fsdp2Layout, OneDimTensorsAreColumnRangesOfTheMatrixView) {
  const ModelSpec spec = load("tiny-qwen2");  // q_proj.bias [14 heads * 4] = [56]
  const auto i = spec.find("model.layers.0.self_attn.q_proj.bias");
  ASSERT_TRUE(i);
  const TrainerShardLayout L = fsdp2_layout(spec, 3, 2);  // chunk 19: elements [38, 56)
  const LocalTensor& t = L.tensors[*i];
  EXPECT_EQ(t.shape, (Shape{18}));
  ASSERT_EQ(t.pieces.size(), 1u);
  const Piece& p = t.pieces[0];
  EXPECT_EQ(p.src_row, 0);
  EXPECT_EQ(p.rows, 1);
  EXPECT_EQ(p.src_col, 38);
  EXPECT_EQ(p.cols, 18);
  EXPECT_EQ(p.dst_row, 0);
  EXPECT_EQ(p.dst_col, 0);
}

TEST(Fsdp2Layout, TrailingRanksMayHoldNothing) {
  const ModelSpec spec = load("tiny-qwen3");  // q_norm.weight [16]
  const auto i = spec.find("model.layers.1.self_attn.q_norm.weight");
  ASSERT_TRUE(i);
  // 16 rows over 12 ranks: chunk 2, ranks 8.. hold nothing.
  const TrainerShardLayout L = fsdp2_layout(spec, 12, 9);
  EXPECT_EQ(L.tensors[*i].shape, (Shape{0}));
  EXPECT_TRUE(L.tensors[*i].pieces.empty());
  EXPECT_TRUE(L.owned_by_hf[*i].empty());
}

TEST(Fsdp2Layout, RealModelsCountAndBuildFast) {
  for (const char* preset : {"qwen2.5-0.5b", "qwen3-8b", "qwen3-30b-a3b"}) {
    const ModelSpec spec = load(preset);
    for (int W : {1, 2, 8}) {
      SCOPED_TRACE(std::string(preset) + " W=" + std::to_string(W));
      const auto t0 = std::chrono::steady_clock::now();
      std::int64_t local = 0, owned = 0;
      for (int r = 0; r < W; ++r) {
        const TrainerShardLayout L = fsdp2_layout(spec, W, r);
        for (const LocalTensor& t : L.tensors) {
          local += numel(t.shape);
          for (auto k : t.owned) owned += t.pieces[k].rows * t.pieces[k].cols;
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_EQ(local, spec.total_parameters());
      EXPECT_EQ(owned, spec.total_parameters());
      EXPECT_LT(s, 2.0) << "layouts must build in O(tensors)";
    }
  }
}

// ============================== Engine =========================================================

struct RefParam {
  std::string name;
  Shape shape;
  Tensor data;
};

// The kv heads engine rank r of t holds (docs/design.md §6.4): a contiguous share when t <= nkv; one
// replicated head otherwise, each head shared by t/nkv consecutive ranks.
std::pair<std::int64_t, std::int64_t> ref_kv_heads(std::int64_t nkv, std::int64_t t,
                                                   std::int64_t r) {
  if (t <= nkv) return {r * (nkv / t), nkv / t};
  return {r / (t / nkv), 1};
}

std::int64_t ref_padded_vocab(std::int64_t v) { return (v + 63) / 64 * 64; }

// Engine rank r's parameters written straight from docs/design.md §6.4 by concatenating row and column
// ranges of the full HF tensors.
std::vector<RefParam> reference_engine(const ModelSpec& spec, const std::vector<Tensor>& full,
                                       std::int64_t t, std::int64_t r) {
  const ModelConfig& c = spec.config();
  const std::int64_t H = c.hidden_size, d = c.head_dim, V = c.vocab_size;
  auto T = [&](const std::string& n) -> const Tensor& {
    return full.at(spec.find(n).value_or(full.size()));
  };
  std::vector<RefParam> out;
  auto vocab = [&](const std::string& name, const Tensor& x) {
    const std::int64_t per = ref_padded_vocab(V) / t;
    Tensor y;
    for (std::int64_t g = r * per; g < (r + 1) * per; ++g)
      append(y, g < V ? rows_of(x, H, g, g + 1) : Tensor(static_cast<std::size_t>(H), 0));
    out.push_back({name, {per, H}, y});
  };
  vocab("model.embed_tokens.weight", T("model.embed_tokens.weight"));
  const std::int64_t qh = c.num_heads / t;
  const auto [kv0, kvn] = ref_kv_heads(c.num_kv_heads, t, r);
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* kind : {"weight", "bias"}) {
      const bool w = std::string(kind) == "weight";
      if (!w && !c.attention_bias) continue;
      const std::int64_t cols = w ? H : 1;  // a bias is a column of rows of one element
      const std::string sfx = std::string("_proj.") + kind;
      Tensor y = rows_of(T(p + "self_attn.q" + sfx), cols, r * qh * d, (r + 1) * qh * d);
      append(y, rows_of(T(p + "self_attn.k" + sfx), cols, kv0 * d, (kv0 + kvn) * d));
      append(y, rows_of(T(p + "self_attn.v" + sfx), cols, kv0 * d, (kv0 + kvn) * d));
      const std::int64_t n = (qh + 2 * kvn) * d;
      out.push_back({p + "self_attn.qkv_proj." + kind, w ? Shape{n, H} : Shape{n}, y});
    }
    const std::int64_t oc = c.num_heads * d / t;
    out.push_back(
        {p + "self_attn.o_proj.weight",
         {H, oc},
         cols_of(T(p + "self_attn.o_proj.weight"), c.num_heads * d, r * oc, (r + 1) * oc)});
    if (c.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {d}, T(p + "self_attn.q_norm.weight")});
      out.push_back({p + "self_attn.k_norm.weight", {d}, T(p + "self_attn.k_norm.weight")});
    }
    if (c.is_moe_layer(i)) {
      const std::int64_t E = c.num_experts, Im = c.moe_intermediate_size, I = Im / t;
      out.push_back({p + "mlp.gate.weight", {E, H}, T(p + "mlp.gate.weight")});
      Tensor w13, w2;
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        append(w13, rows_of(T(q + "gate_proj.weight"), H, r * I, (r + 1) * I));
        append(w13, rows_of(T(q + "up_proj.weight"), H, r * I, (r + 1) * I));
        append(w2, cols_of(T(q + "down_proj.weight"), Im, r * I, (r + 1) * I));
      }
      out.push_back({p + "mlp.experts.w13_weight", {E, 2 * I, H}, w13});
      out.push_back({p + "mlp.experts.w2_weight", {E, H, I}, w2});
    } else {
      const std::int64_t I = c.intermediate_size / t;
      Tensor gu = rows_of(T(p + "mlp.gate_proj.weight"), H, r * I, (r + 1) * I);
      append(gu, rows_of(T(p + "mlp.up_proj.weight"), H, r * I, (r + 1) * I));
      out.push_back({p + "mlp.gate_up_proj.weight", {2 * I, H}, gu});
      out.push_back(
          {p + "mlp.down_proj.weight",
           {H, I},
           cols_of(T(p + "mlp.down_proj.weight"), c.intermediate_size, r * I, (r + 1) * I)});
    }
    out.push_back({p + "input_layernorm.weight", {H}, T(p + "input_layernorm.weight")});
    out.push_back(
        {p + "post_attention_layernorm.weight", {H}, T(p + "post_attention_layernorm.weight")});
  }
  out.push_back({"model.norm.weight", {H}, T("model.norm.weight")});
  if (!c.tie_word_embeddings) vocab("lm_head.weight", T("lm_head.weight"));
  return out;
}

// How many engine ranks hold each element of an HF tensor.
std::int64_t expected_copies(const ModelSpec& spec, const TensorSpec& ts, std::int64_t t) {
  const std::int64_t nkv = spec.config().num_kv_heads;
  switch (ts.role) {
    case ParamRole::kQNorm:
    case ParamRole::kKNorm:
    case ParamRole::kInputNorm:
    case ParamRole::kPostAttnNorm:
    case ParamRole::kFinalNorm:
    case ParamRole::kRouter:
    case ParamRole::kPreFfnNorm:
    case ParamRole::kPostFfnNorm:
    case ParamRole::kSharedExpertGate:
    case ParamRole::kRouterBias:
    case ParamRole::kQAProj:  // MLA's a-projections and their norms are replicated
    case ParamRole::kQALayerNorm:
    case ParamRole::kKvAProj:
    case ParamRole::kKvALayerNorm:
      return t;
    case ParamRole::kQkvProj:  // q rows once, k/v rows as kKProj: no single count
      return -1;
    case ParamRole::kKProj:
    case ParamRole::kVProj:
    case ParamRole::kKBias:
    case ParamRole::kVBias:
      return t > nkv ? t / nkv : 1;
    case ParamRole::kEmbedding:
    case ParamRole::kLmHead:
    case ParamRole::kQProj:
    case ParamRole::kQBias:
    case ParamRole::kOProj:
    case ParamRole::kGateProj:
    case ParamRole::kUpProj:
    case ParamRole::kDownProj:
    case ParamRole::kExpertGate:
    case ParamRole::kExpertUp:
    case ParamRole::kExpertDown:
    case ParamRole::kGateUpProj:
    case ParamRole::kSharedGate:
    case ParamRole::kSharedUp:
    case ParamRole::kSharedDown:
    case ParamRole::kQBProj:
    case ParamRole::kKvBProj:
      return 1;
    case ParamRole::kOther:  // header tables: only the hf layout, where every rank holds all
      return t;
  }
  return -1;
}

// Rebuilds full HF tensors from the engine ranks' parameters by undoing the fusing and sharding
// of docs/design.md §6.4; an element seen on several ranks must be identical on all of them.
class Reassembler {
 public:
  Reassembler(const ModelSpec& spec) : spec_(spec) {
    for (const auto& t : spec.tensors()) {
      rebuilt_.emplace_back(static_cast<std::size_t>(t.numel()), 0);
      seen_.emplace_back(static_cast<std::size_t>(t.numel()), 0);
    }
  }

  // Block [nrows x ncols] of `local` (row length local_cols) at (lr, lc) is HF tensor `hf`'s
  // block at (hr, hc) (row length hf_cols).
  void put(const std::string& hf, std::int64_t hf_cols, std::int64_t hr, std::int64_t hc,
           std::int64_t nrows, std::int64_t ncols, const Tensor& local, std::int64_t local_cols,
           std::int64_t lr, std::int64_t lc) {
    const auto idx = spec_.find(hf);
    ASSERT_TRUE(idx) << hf;
    Tensor& out = rebuilt_[*idx];
    std::vector<char>& seen = seen_[*idx];
    for (std::int64_t i = 0; i < nrows; ++i)
      for (std::int64_t j = 0; j < ncols; ++j) {
        const auto o = static_cast<std::size_t>((hr + i) * hf_cols + hc + j);
        const std::int64_t v = local.at(static_cast<std::size_t>((lr + i) * local_cols + lc + j));
        if (seen[o]) {
          ASSERT_EQ(out[o], v) << hf << ": ranks disagree on a replicated element";
        } else {
          out[o] = v;
          seen[o] = 1;
        }
      }
  }

  void add_rank(const std::map<std::string, Tensor>& params, std::int64_t t, std::int64_t r) {
    const ModelConfig& c = spec_.config();
    const std::int64_t H = c.hidden_size, d = c.head_dim, V = c.vocab_size;
    auto P = [&](const std::string& n) -> const Tensor& { return params.at(n); };
    const std::int64_t per = ref_padded_vocab(V) / t;
    const std::int64_t real = std::max<std::int64_t>(0, std::min(V, (r + 1) * per) - r * per);
    put("model.embed_tokens.weight", H, r * per, 0, real, H, P("model.embed_tokens.weight"), H, 0,
        0);
    if (!c.tie_word_embeddings)
      put("lm_head.weight", H, r * per, 0, real, H, P("lm_head.weight"), H, 0, 0);
    put("model.norm.weight", H, 0, 0, 1, H, P("model.norm.weight"), H, 0, 0);
    const std::int64_t qh = c.num_heads / t;
    const auto [kv0, kvn] = ref_kv_heads(c.num_kv_heads, t, r);
    for (std::int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      for (const char* kind : {"weight", "bias"}) {
        const bool w = std::string(kind) == "weight";
        if (!w && !c.attention_bias) continue;
        const std::int64_t cols = w ? H : 1;
        const std::string sfx = std::string("_proj.") + kind;
        const Tensor& qkv = P(p + "self_attn.qkv_proj." + kind);
        put(p + "self_attn.q" + sfx, cols, r * qh * d, 0, qh * d, cols, qkv, cols, 0, 0);
        put(p + "self_attn.k" + sfx, cols, kv0 * d, 0, kvn * d, cols, qkv, cols, qh * d, 0);
        put(p + "self_attn.v" + sfx, cols, kv0 * d, 0, kvn * d, cols, qkv, cols, (qh + kvn) * d, 0);
      }
      const std::int64_t oc = c.num_heads * d / t;
      put(p + "self_attn.o_proj.weight", c.num_heads * d, 0, r * oc, H, oc,
          P(p + "self_attn.o_proj.weight"), oc, 0, 0);
      if (c.qk_norm)
        for (const char* n : {"self_attn.q_norm.weight", "self_attn.k_norm.weight"})
          put(p + n, d, 0, 0, 1, d, P(p + n), d, 0, 0);
      for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"})
        put(p + n, H, 0, 0, 1, H, P(p + n), H, 0, 0);
      if (c.is_moe_layer(i)) {
        const std::int64_t E = c.num_experts, Im = c.moe_intermediate_size, I = Im / t;
        put(p + "mlp.gate.weight", H, 0, 0, E, H, P(p + "mlp.gate.weight"), H, 0, 0);
        const Tensor& w13 = P(p + "mlp.experts.w13_weight");
        const Tensor& w2 = P(p + "mlp.experts.w2_weight");
        for (std::int64_t e = 0; e < E; ++e) {
          const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
          put(q + "gate_proj.weight", H, r * I, 0, I, H, w13, H, e * 2 * I, 0);
          put(q + "up_proj.weight", H, r * I, 0, I, H, w13, H, e * 2 * I + I, 0);
          put(q + "down_proj.weight", Im, 0, r * I, H, I, w2, I, e * H, 0);
        }
      } else {
        const std::int64_t I = c.intermediate_size / t;
        const Tensor& gu = P(p + "mlp.gate_up_proj.weight");
        put(p + "mlp.gate_proj.weight", H, r * I, 0, I, H, gu, H, 0, 0);
        put(p + "mlp.up_proj.weight", H, r * I, 0, I, H, gu, H, I, 0);
        put(p + "mlp.down_proj.weight", c.intermediate_size, 0, r * I, H, I,
            P(p + "mlp.down_proj.weight"), I, 0, 0);
      }
    }
  }

  void expect_complete(const std::vector<Tensor>& full) const {
    for (std::size_t i = 0; i < full.size(); ++i) {
      const std::string& name = spec_.tensors()[i].name;
      for (char s : seen_[i]) ASSERT_TRUE(s) << name << " has elements no engine rank holds";
      EXPECT_EQ(rebuilt_[i], full[i]) << name;
    }
  }

 private:
  const ModelSpec& spec_;
  std::vector<Tensor> rebuilt_;
  std::vector<std::vector<char>> seen_;
};

bool is_vocab_param(const std::string& name) {
  return name == "model.embed_tokens.weight" || name == "lm_head.weight";
}

TEST(EngineLayout, MatchesReferenceReassemblesAndPadsVocabulary) {
  int cases = 0, replicated_kv_cases = 0;
  for (const char* preset : kTinyPresets) {
    const ModelSpec spec = load(preset);
    const ModelConfig& c = spec.config();
    const std::vector<Tensor> full = fill_hf(spec);
    const auto& hf = spec.tensors();
    for (int t : {1, 2, 4, 8}) {
      if (!check_engine_tp(spec, t).ok()) {
        EXPECT_FALSE(engine_layout(spec, t, 0, EngineLayout::kFused, EngineProtocol::kVllm).ok()) << preset << " tp=" << t;
        continue;
      }
      SCOPED_TRACE(std::string(preset) + " tp=" + std::to_string(t));
      ++cases;
      if (t > c.num_kv_heads) ++replicated_kv_cases;
      Reassembler reassembled(spec);
      std::vector<std::vector<int>> copies(hf.size());
      for (std::size_t i = 0; i < hf.size(); ++i)
        copies[i].assign(static_cast<std::size_t>(hf[i].numel()), 0);
      std::int64_t padding_rows = 0;

      for (int r = 0; r < t; ++r) {
        auto L = engine_layout(spec, t, r, EngineLayout::kFused, EngineProtocol::kVllm);
        ASSERT_TRUE(L.ok()) << L.status().to_string();
        EXPECT_EQ(L->tp_size, t);
        EXPECT_EQ(L->tp_rank, r);
        const std::vector<RefParam> ref = reference_engine(spec, full, t, r);
        // (a) names, order, shapes and every element against the reference.
        ASSERT_EQ(L->params.size(), ref.size());
        std::map<std::string, Tensor> applied;
        std::int64_t numel_sum = 0;
        for (std::size_t k = 0; k < ref.size(); ++k) {
          const EngineParam& p = L->params[k];
          ASSERT_EQ(p.name, ref[k].name) << "param " << k;
          ASSERT_EQ(p.shape, ref[k].shape) << p.name;
          numel_sum += numel(p.shape);
          // (d) bounds are checked while applying; no element is written twice.
          const Applied a = apply_pieces(spec, full, p.shape, p.pieces, p.name);
          EXPECT_EQ(a.data, ref[k].data) << p.name << " rank " << r;
          const std::int64_t cols = matrix_shape(p.shape).cols;
          for (std::size_t e = 0; e < a.writes.size(); ++e) {
            // (c) vocabulary padding rows: no piece, zero. Every other element: one piece.
            const std::int64_t row = static_cast<std::int64_t>(e) / cols;
            const bool pad = is_vocab_param(p.name) && r * p.shape[0] + row >= c.vocab_size;
            ASSERT_EQ(a.writes[e], pad ? 0 : 1) << p.name << " element " << e;
            if (pad) {
              ASSERT_EQ(a.data[e], 0) << p.name << " padding element " << e;
            }
          }
          if (is_vocab_param(p.name))
            padding_rows += std::max<std::int64_t>(
                0, std::min<std::int64_t>(p.shape[0], (r + 1) * p.shape[0] - c.vocab_size));
          for (const Piece& pc : p.pieces) {
            const MatrixShape m = matrix_shape(hf[pc.hf_tensor].shape);
            for (std::int64_t i = 0; i < pc.rows; ++i)
              for (std::int64_t j = 0; j < pc.cols; ++j)
                ++copies[pc.hf_tensor]
                        [static_cast<std::size_t>((pc.src_row + i) * m.cols + pc.src_col + j)];
          }
          applied.emplace(p.name, a.data);
        }
        EXPECT_EQ(L->total_numel(), numel_sum);
        // pieces_by_hf lists every piece once, under the tensor it reads.
        ASSERT_EQ(L->pieces_by_hf.size(), hf.size());
        std::size_t listed = 0, total = 0;
        for (const auto& p : L->params) total += p.pieces.size();
        for (std::size_t i = 0; i < hf.size(); ++i)
          for (const auto& [pi, ki] : L->pieces_by_hf[i]) {
            ASSERT_LT(pi, L->params.size());
            ASSERT_LT(ki, L->params[pi].pieces.size());
            EXPECT_EQ(L->params[pi].pieces[ki].hf_tensor, i);
            ++listed;
          }
        EXPECT_EQ(listed, total);
        // (b) undo the engine's fusing/sharding from this rank's materialized parameters.
        reassembled.add_rank(applied, t, r);
      }
      reassembled.expect_complete(full);
      // (b) replicated kv heads and norms appear on the expected number of ranks.
      for (std::size_t i = 0; i < hf.size(); ++i) {
        const std::int64_t want = expected_copies(spec, hf[i], t);
        for (int n : copies[i]) ASSERT_EQ(n, want) << hf[i].name;
      }
      const std::int64_t vp = ref_padded_vocab(c.vocab_size);
      EXPECT_EQ(padding_rows, (vp - c.vocab_size) * (c.tie_word_embeddings ? 1 : 2));
    }
  }
  EXPECT_GE(cases, 10);
  EXPECT_GE(replicated_kv_cases, 2) << "kv-head replication must be exercised";
}

TEST(EngineLayout, ReplicatedKvHeadsFollowRankTimesNkvOverT) {
  const ModelSpec spec = load("tiny-qwen3");  // nq 4, nkv 2, d 16
  const auto k = spec.find("model.layers.0.self_attn.k_proj.weight");
  ASSERT_TRUE(k);
  for (int r = 0; r < 4; ++r) {
    auto L = engine_layout(spec, 4, r, EngineLayout::kFused, EngineProtocol::kVllm);
    ASSERT_TRUE(L.ok()) << L.status().to_string();
    const EngineParam& qkv = L->params[1];
    ASSERT_EQ(qkv.name, "model.layers.0.self_attn.qkv_proj.weight");
    EXPECT_EQ(qkv.shape, (Shape{(1 + 2) * 16, 64}));
    ASSERT_EQ(qkv.pieces.size(), 3u);
    EXPECT_EQ(qkv.pieces[1].hf_tensor, *k);
    EXPECT_EQ(qkv.pieces[1].src_row, (r * 2 / 4) * 16) << "rank " << r;
    EXPECT_EQ(qkv.pieces[1].dst_row, 16);
  }
}

TEST(EngineLayout, RejectsBadTpAndRank) {
  const ModelSpec spec = load("tiny-qwen2");  // 14 heads
  EXPECT_FALSE(engine_layout(spec, 4, 0, EngineLayout::kFused, EngineProtocol::kVllm).ok());
  EXPECT_FALSE(engine_layout(spec, 0, 0, EngineLayout::kFused, EngineProtocol::kVllm).ok());
  auto bad_rank = engine_layout(spec, 2, 2, EngineLayout::kFused, EngineProtocol::kVllm);
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_rank.status().message().find("tp rank 2"), std::string::npos)
      << bad_rank.status().message();
}

struct RealCase {
  const char* preset;
  int tp;
  std::size_t params;
  Shape qkv;        // layer 0
  Shape embed;      // per rank
  Shape mlp_first;  // gate_up_proj or w13_weight of layer 0
};

TEST(EngineLayout, RealModelsCountsShapesAndSpeed) {
  const RealCase cases[] = {
      // 1 + 24*(qkv w, qkv b, o, gate_up, down, 2 norms) + norm; tied: no lm_head.
      {"qwen2.5-0.5b", 2, 1 + 24 * 7 + 1, {(7 + 2) * 64, 896}, {75968, 896}, {4864, 896}},
      {"qwen3-8b", 8, 1 + 36 * 8 + 2, {(4 + 2) * 128, 4096}, {18992, 4096}, {3072, 4096}},
      // t 8 > nkv 4: one replicated kv head per rank.
      {"qwen3-30b-a3b", 8, 1 + 48 * 9 + 2, {(4 + 2) * 128, 2048}, {18992, 2048}, {128, 192, 2048}},
      {"qwen3-30b-a3b", 4, 1 + 48 * 9 + 2, {(8 + 2) * 128, 2048}, {37984, 2048}, {128, 384, 2048}},
  };
  for (const RealCase& rc : cases) {
    const ModelSpec spec = load(rc.preset);
    const ModelConfig& c = spec.config();
    SCOPED_TRACE(std::string(rc.preset) + " tp=" + std::to_string(rc.tp));
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t total = 0, piece_elems = 0;
    for (int r = 0; r < rc.tp; ++r) {
      auto L = engine_layout(spec, rc.tp, r, EngineLayout::kFused, EngineProtocol::kVllm);
      ASSERT_TRUE(L.ok()) << L.status().to_string();
      ASSERT_EQ(L->params.size(), rc.params);
      EXPECT_EQ(L->params[0].shape, rc.embed);
      EXPECT_EQ(L->params[1].shape, rc.qkv);
      for (const auto& p : L->params) {
        if (p.name == "model.layers.0.mlp.gate_up_proj.weight" ||
            p.name == "model.layers.0.mlp.experts.w13_weight") {
          EXPECT_EQ(p.shape, rc.mlp_first);
        }
        for (const Piece& pc : p.pieces) piece_elems += pc.rows * pc.cols;
      }
      total += L->total_numel();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 2.0) << "layouts must build in O(tensors)";
    std::int64_t want_pieces = 0;
    for (const auto& ts : spec.tensors())
      want_pieces += ts.numel() * expected_copies(spec, ts, rc.tp);
    const std::int64_t pad = (ref_padded_vocab(c.vocab_size) - c.vocab_size) * c.hidden_size *
                             (c.tie_word_embeddings ? 1 : 2);
    EXPECT_EQ(piece_elems, want_pieces);
    EXPECT_EQ(total, want_pieces + pad);
  }
}

}  // namespace
}  // namespace refit
