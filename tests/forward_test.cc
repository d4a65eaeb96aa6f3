// The logit check (harness/forward.h): the reference forward against values computed by hand for
// one-layer, one-head models; every engine TP size of the tiny presets against the reference,
// with the TP ranks as threads over an in-test communicator; deliberately wrong layouts caught.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "comm/communicator.h"
#include "engine/engine_layout.h"
#include "harness/forward.h"
#include "refit/model_spec.h"

// engine_layout() calls check_engine_tp(), whose definition (src/engine/tp_check.cc) arrives with
// the config branch. Until that file exists in this tree, the test links a stand-in with the same
// rules (docs/design.md §6.4); it disappears by itself once the real one is present.
#if !__has_include("engine/tp_check.cc")
#include <fmt/format.h>
namespace refit {
Status check_engine_tp(const ModelSpec& spec, int tp) {
  const ModelConfig& c = spec.config();
  bool dense = false, moe = false;
  for (std::int64_t i = 0; i < c.num_layers; ++i) (c.is_moe_layer(i) ? moe : dense) = true;
  const bool ok = tp >= 1 && c.num_heads % tp == 0 &&
                  (tp <= c.num_kv_heads ? c.num_kv_heads % tp == 0 : tp % c.num_kv_heads == 0) &&
                  (!dense || c.intermediate_size % tp == 0) &&
                  (!moe || c.moe_intermediate_size % tp == 0);
  if (ok) return Status::Ok();
  return Status::InvalidArgument(fmt::format("generation.tp_size: {} cannot shard the model", tp));
}
}  // namespace refit
#endif

namespace refit {
namespace {

using Bits = std::vector<std::uint16_t>;

// Round-to-nearest-even fp32 -> bf16 (common/convert.h is not in this tree yet; finite values
// only, which is all these tests produce).
std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float from_bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Deterministic uniform values in [-1, 1) (splitmix64), independent of the standard library.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  double uniform() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  }

 private:
  std::uint64_t s_;
};

// Random HF weights scaled so activations stay O(1): matrices U(-1,1)*sqrt(3/cols), norms
// 1 + U(-1,1)/4, biases U(-1,1)/5, embeddings U(-1,1).
std::vector<std::vector<float>> random_hf(const ModelSpec& spec, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<float>> hf;
  for (const TensorSpec& t : spec.tensors()) {
    std::vector<float> x(static_cast<std::size_t>(t.numel()));
    const MatrixShape m = matrix_shape(t.shape);
    for (float& v : x) {
      const double u = rng.uniform();
      switch (t.role) {
        case ParamRole::kEmbedding:
          v = static_cast<float>(u);
          break;
        case ParamRole::kFinalNorm:
        case ParamRole::kInputNorm:
        case ParamRole::kPostAttnNorm:
        case ParamRole::kQNorm:
        case ParamRole::kKNorm:
        case ParamRole::kPreFfnNorm:
        case ParamRole::kPostFfnNorm:
        case ParamRole::kQALayerNorm:
        case ParamRole::kKvALayerNorm:
          v = static_cast<float>(1.0 + u / 4);
          break;
        case ParamRole::kQBias:
        case ParamRole::kKBias:
        case ParamRole::kVBias:
        case ParamRole::kRouterBias:
          v = static_cast<float>(u / 5);
          break;
        case ParamRole::kLmHead:
        case ParamRole::kQProj:
        case ParamRole::kKProj:
        case ParamRole::kVProj:
        case ParamRole::kOProj:
        case ParamRole::kGateProj:
        case ParamRole::kUpProj:
        case ParamRole::kDownProj:
        case ParamRole::kRouter:
        case ParamRole::kExpertGate:
        case ParamRole::kExpertUp:
        case ParamRole::kExpertDown:
        case ParamRole::kQkvProj:
        case ParamRole::kGateUpProj:
        case ParamRole::kSharedGate:
        case ParamRole::kSharedUp:
        case ParamRole::kSharedDown:
        case ParamRole::kSharedExpertGate:
        case ParamRole::kQAProj:
        case ParamRole::kQBProj:
        case ParamRole::kKvAProj:
        case ParamRole::kKvBProj:
        case ParamRole::kOther:
          v = static_cast<float>(u * std::sqrt(3.0 / static_cast<double>(m.cols)));
          break;
      }
    }
    hf.push_back(std::move(x));
  }
  return hf;
}

std::vector<const float*> pointers(const std::vector<std::vector<float>>& v) {
  std::vector<const float*> p;
  for (const auto& x : v) p.push_back(x.data());
  return p;
}

// Every TP rank's parameters, built by applying the layout's pieces to the bf16 HF tensors.
std::vector<Bits> apply_layout(const ModelSpec& spec, const EngineShardLayout& layout,
                               const std::vector<Bits>& hf) {
  std::vector<Bits> params;
  for (const EngineParam& p : layout.params) {
    const MatrixShape dst = matrix_shape(p.shape);
    Bits out(static_cast<std::size_t>(dst.numel()), 0);
    for (const Piece& pc : p.pieces) {
      const MatrixShape src = matrix_shape(spec.tensors()[pc.hf_tensor].shape);
      for (std::int64_t i = 0; i < pc.rows; ++i)
        for (std::int64_t j = 0; j < pc.cols; ++j)
          out[static_cast<std::size_t>((pc.dst_row + i) * dst.cols + pc.dst_col + j)] =
              hf[pc.hf_tensor]
                [static_cast<std::size_t>((pc.src_row + i) * src.cols + pc.src_col + j)];
    }
    params.push_back(std::move(out));
  }
  return params;
}

// N ranks as threads: all_gather_v / broadcast through shared memory between two barriers.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(20))
      : size_(size), timeout_(timeout), sends_(static_cast<std::size_t>(size)) {}

  class Member : public Communicator {
   public:
    Member(ThreadGroup& g, int rank) : g_(g), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return g_.size_; }
    std::string_view backend() const override { return "threads"; }

    Status all_gather_v(const void* send, void* recv,
                        const std::vector<std::size_t>& counts) override {
      if (counts.size() != static_cast<std::size_t>(g_.size_))
        return Status::InvalidArgument("all_gather_v: counts size != group size");
      g_.sends_[static_cast<std::size_t>(rank_)] = send;
      REFIT_RETURN_IF_ERROR(g_.wait("all_gather_v", rank_));
      auto* out = static_cast<char*>(recv);
      for (std::size_t r = 0; r < counts.size(); ++r) {
        if (counts[r] > 0) std::memcpy(out, g_.sends_[r], counts[r]);
        out += counts[r];
      }
      return g_.wait("all_gather_v", rank_);  // peers may reuse `send` after this
    }
    Status exchange(const std::vector<P2POp>&) override {
      return Status::Unsupported("exchange: not used by the forward pass");
    }
    Status broadcast(void* buf, std::size_t bytes, int root) override {
      if (rank_ == root) g_.sends_[static_cast<std::size_t>(root)] = buf;
      REFIT_RETURN_IF_ERROR(g_.wait("broadcast", rank_));
      if (rank_ != root) std::memcpy(buf, g_.sends_[static_cast<std::size_t>(root)], bytes);
      return g_.wait("broadcast", rank_);
    }
    Status barrier() override { return g_.wait("barrier", rank_); }
    void abort() override { g_.abort(); }

   private:
    ThreadGroup& g_;
    int rank_;
  };

  std::unique_ptr<Communicator> member(int rank) { return std::make_unique<Member>(*this, rank); }

  void abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  Status wait(const char* op, int rank) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) return Status::Aborted(std::string(op) + ": group aborted");
    const std::uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return Status::Ok();
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || aborted_; }))
      return Status::Timeout(std::string(op) + ": rank " + std::to_string(rank) + " timed out");
    if (generation_ == gen) return Status::Aborted(std::string(op) + ": group aborted");
    return Status::Ok();
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::vector<const void*> sends_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
};

// Runs engine_forward on every TP rank of `layouts` (one thread each) and returns every rank's
// logits; a failing rank aborts the group so its peers return promptly.
std::vector<Result<std::vector<float>>> run_engine(const ModelSpec& spec,
                                                   const std::vector<EngineShardLayout>& layouts,
                                                   const std::vector<std::vector<Bits>>& params,
                                                   const std::vector<std::int32_t>& tokens) {
  const int t = static_cast<int>(layouts.size());
  ThreadGroup group(t);
  std::vector<Result<std::vector<float>>> out(
      t, Result<std::vector<float>>(Status::Internal("not run")));
  std::vector<std::thread> threads;
  for (int r = 0; r < t; ++r)
    threads.emplace_back([&, r] {
      auto comm = t > 1 ? group.member(r) : nullptr;
      std::vector<const std::uint16_t*> p;
      for (const Bits& b : params[static_cast<std::size_t>(r)]) p.push_back(b.data());
      out[static_cast<std::size_t>(r)] =
          engine_forward(spec, layouts[static_cast<std::size_t>(r)], p, tokens, comm.get());
      if (!out[static_cast<std::size_t>(r)].ok()) group.abort();
    });
  for (auto& th : threads) th.join();
  return out;
}

ModelSpec load(const std::string& name) {
  auto spec = load_model_spec(name);
  EXPECT_TRUE(spec.ok()) << spec.status().to_string();
  return spec.ok() ? std::move(spec).value() : ModelSpec();
}

// A preset with random weights cast to bf16: the HF tensors as bf16 bits and as their fp32 values.
struct Model {
  ModelSpec spec;
  std::vector<Bits> hf_bits;
  std::vector<std::vector<float>> hf;  // bf16 values widened to fp32
};

Model make_model(const std::string& preset, std::uint64_t seed) {
  Model m{load(preset), {}, {}};
  for (const auto& x : random_hf(m.spec, seed)) {
    Bits b(x.size());
    std::vector<float> f(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      b[i] = to_bf16(x[i]);
      f[i] = from_bf16(b[i]);
    }
    m.hf_bits.push_back(std::move(b));
    m.hf.push_back(std::move(f));
  }
  return m;
}

struct Engine {
  std::vector<EngineShardLayout> layouts;
  std::vector<std::vector<Bits>> params;
};

Engine make_engine(const Model& m, int tp) {
  Engine e;
  for (int r = 0; r < tp; ++r) {
    auto L = engine_layout(m.spec, tp, r, EngineLayout::kFused, EngineProtocol::kVllm);
    EXPECT_TRUE(L.ok()) << L.status().to_string();
    if (!L.ok()) return {};
    e.params.push_back(apply_layout(m.spec, *L, m.hf_bits));
    e.layouts.push_back(std::move(L).value());
  }
  return e;
}

constexpr double kTolerance = 1e-4;
const char* const kTinyPresets[] = {"tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-moe"};

// --- reference_forward against hand computation ------------------------------------------------

using V2 = std::array<double, 2>;

double dot(const V2& a, const V2& b) { return a[0] * b[0] + a[1] * b[1]; }
V2 rms(const V2& v, const V2& w, double eps) {
  const double s = 1.0 / std::sqrt((v[0] * v[0] + v[1] * v[1]) / 2 + eps);
  return {v[0] * s * w[0], v[1] * s * w[1]};
}
// head_dim 2: one rotation pair (0, 1) with inverse frequency theta^0 = 1, so the angle is pos.
V2 rope(const V2& v, double pos) {
  return {v[0] * std::cos(pos) - v[1] * std::sin(pos), v[1] * std::cos(pos) + v[0] * std::sin(pos)};
}
double silu(double x) { return x / (1 + std::exp(-x)); }

// One layer, H = 2, one head of d = 2; each tensor is read by HF name from `w`.
class HandModel {
 public:
  HandModel(const ModelSpec& spec, const std::vector<std::vector<float>>& w) : spec_(spec), w_(w) {}

  double at(const std::string& name, std::size_t i) const {
    auto idx = spec_.find(name);
    EXPECT_TRUE(idx.has_value()) << name;
    return idx ? w_[*idx][i] : 0.0;
  }
  V2 vec(const std::string& name, std::size_t row = 0) const {
    return {at(name, 2 * row), at(name, 2 * row + 1)};
  }
  // [2, 2] matrix (rows are output features) times v.
  V2 mat(const std::string& name, const V2& v) const {
    return {dot(vec(name, 0), v), dot(vec(name, 1), v)};
  }

  std::vector<double> logits(const std::vector<std::int32_t>& tokens) const {
    const ModelConfig& c = spec_.config();
    const double eps = c.rms_norm_eps;
    const std::string L = "model.layers.0.";
    const std::size_t T = tokens.size();
    std::vector<V2> x(T), q(T), k(T), v(T);
    for (std::size_t t = 0; t < T; ++t) x[t] = vec("model.embed_tokens.weight", tokens[t]);
    for (std::size_t t = 0; t < T; ++t) {
      const V2 h = rms(x[t], vec(L + "input_layernorm.weight"), eps);
      q[t] = mat(L + "self_attn.q_proj.weight", h);
      k[t] = mat(L + "self_attn.k_proj.weight", h);
      v[t] = mat(L + "self_attn.v_proj.weight", h);
      if (c.attention_bias)
        for (int j = 0; j < 2; ++j) {
          q[t][j] += at(L + "self_attn.q_proj.bias", j);
          k[t][j] += at(L + "self_attn.k_proj.bias", j);
          v[t][j] += at(L + "self_attn.v_proj.bias", j);
        }
      if (c.qk_norm) {
        q[t] = rms(q[t], vec(L + "self_attn.q_norm.weight"), eps);
        k[t] = rms(k[t], vec(L + "self_attn.k_norm.weight"), eps);
      }
      q[t] = rope(q[t], static_cast<double>(t));
      k[t] = rope(k[t], static_cast<double>(t));
    }
    std::vector<double> out;
    for (std::size_t t = 0; t < T; ++t) {
      double z = 0;
      V2 o{0, 0};
      for (std::size_t s = 0; s <= t; ++s) {
        const double p = std::exp(dot(q[t], k[s]) / std::sqrt(2.0));
        z += p;
        o = {o[0] + p * v[s][0], o[1] + p * v[s][1]};
      }
      o = {o[0] / z, o[1] / z};
      const V2 a = mat(L + "self_attn.o_proj.weight", o);
      V2 y{x[t][0] + a[0], x[t][1] + a[1]};
      const V2 h = rms(y, vec(L + "post_attention_layernorm.weight"), eps);
      const V2 m = c.num_experts > 0 ? moe(h) : dense(h, L + "mlp.");
      y = {y[0] + m[0], y[1] + m[1]};
      const V2 f = rms(y, vec("model.norm.weight"), eps);
      const std::string head =
          c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
      for (std::int64_t id = 0; id < c.vocab_size; ++id) out.push_back(dot(vec(head, id), f));
    }
    return out;
  }

 private:
  // gate/up [1, 2] (I = 1), down [2, 1].
  V2 dense(const V2& h, const std::string& p) const {
    const double g = dot(vec(p + "gate_proj.weight"), h), u = dot(vec(p + "up_proj.weight"), h);
    const double a = silu(g) * u;
    return {at(p + "down_proj.weight", 0) * a, at(p + "down_proj.weight", 1) * a};
  }
  V2 moe(const V2& h) const {
    const ModelConfig& c = spec_.config();
    const auto E = static_cast<std::size_t>(c.num_experts);
    std::vector<double> p(E);
    double z = 0;
    for (std::size_t e = 0; e < E; ++e)
      z += p[e] = std::exp(dot(vec("model.layers.0.mlp.gate.weight", e), h));
    for (double& x : p) x /= z;
    // top-2 by selection
    std::size_t a = 0;
    for (std::size_t e = 1; e < E; ++e)
      if (p[e] > p[a]) a = e;
    std::size_t b = a == 0 ? 1 : 0;
    for (std::size_t e = 0; e < E; ++e)
      if (e != a && p[e] > p[b]) b = e;
    double wa = p[a], wb = p[b];
    if (c.norm_topk_prob) {
      wa = p[a] / (p[a] + p[b]);
      wb = p[b] / (p[a] + p[b]);
    }
    V2 out{0, 0};
    for (auto [e, w] : {std::pair{a, wa}, std::pair{b, wb}})
      out = {out[0] + w * dense(h, "model.layers.0.mlp.experts." + std::to_string(e) + ".")[0],
             out[1] + w * dense(h, "model.layers.0.mlp.experts." + std::to_string(e) + ".")[1]};
    return out;
  }

  const ModelSpec& spec_;
  const std::vector<std::vector<float>>& w_;
};

ModelConfig hand_config() {
  ModelConfig c;
  c.hidden_size = 2;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.intermediate_size = 1;
  c.vocab_size = 5;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  return c;
}

void expect_hand_match(const ModelConfig& c, std::uint64_t seed) {
  const ModelSpec spec(c, "hand");
  const std::vector<std::vector<float>> w = random_hf(spec, seed);
  const std::vector<std::int32_t> tokens = {3, 0, 4, 3};
  auto got = reference_forward(spec, pointers(w), tokens);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const std::vector<double> want = HandModel(spec, w).logits(tokens);
  ASSERT_EQ(got->size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR((*got)[i], want[i], 1e-5 * (1 + std::fabs(want[i])))
        << "position " << i / 5 << " vocab " << i % 5;
}

TEST(ForwardReference, MatchesHandComputedDenseLayer) {
  ModelConfig c = hand_config();
  c.arch = Architecture::kLlama;
  expect_hand_match(c, 11);
  // Qwen2 flavour: q/k/v bias, tied embeddings; Qwen3 flavour: per-head q/k norm.
  c.arch = Architecture::kQwen2;
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  expect_hand_match(c, 12);
  c.arch = Architecture::kQwen3;
  c.attention_bias = false;
  c.tie_word_embeddings = false;
  c.qk_norm = true;
  expect_hand_match(c, 13);
}

TEST(ForwardReference, MatchesHandComputedMoeLayer) {
  ModelConfig c = hand_config();
  c.arch = Architecture::kQwen3Moe;
  c.qk_norm = true;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 1;
  for (bool norm : {true, false}) {
    SCOPED_TRACE(norm ? "norm_topk_prob" : "raw top-k weights");
    c.norm_topk_prob = norm;
    expect_hand_match(c, 21);
  }
}

TEST(ForwardReference, RejectsBadInputs) {
  const Model m = make_model("tiny-llama", 1);
  auto bad_token = reference_forward(m.spec, pointers(m.hf), {1, 777});
  ASSERT_FALSE(bad_token.ok());
  EXPECT_NE(bad_token.status().message().find("token 777 at position 1"), std::string::npos)
      << bad_token.status().message();
  std::vector<const float*> few = pointers(m.hf);
  few.pop_back();
  EXPECT_EQ(reference_forward(m.spec, few, {1}).status().code(), StatusCode::kInvalidArgument);
}

// --- engine_forward against reference_forward -------------------------------------------------

TEST(ForwardEngine, MatchesReferenceForEveryTpSizeOfTinyPresets) {
  int cases = 0;
  for (const char* preset : kTinyPresets) {
    const Model m = make_model(preset, 7);
    const std::vector<std::int32_t> tokens = logit_check_tokens(m.spec, 8);
    auto want = reference_forward(m.spec, pointers(m.hf), tokens);
    ASSERT_TRUE(want.ok()) << preset << ": " << want.status().to_string();
    for (int tp : {1, 2, 4}) {
      if (!check_engine_tp(m.spec, tp).ok()) continue;
      SCOPED_TRACE(std::string(preset) + " tp=" + std::to_string(tp));
      ++cases;
      const Engine e = make_engine(m, tp);
      ASSERT_EQ(e.layouts.size(), static_cast<std::size_t>(tp));
      auto got = run_engine(m.spec, e.layouts, e.params, tokens);
      for (int r = 0; r < tp; ++r) {
        ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status().to_string();
        const Status s = compare_logits(*got[r], *want, m.spec.config().vocab_size, kTolerance);
        EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
        // Partials are summed in rank order on every rank: identical bits everywhere.
        EXPECT_EQ(*got[r], *got[0]) << "rank " << r;
      }
    }
  }
  // qwen3 1,2,4 (4 replicates kv heads); qwen2 1,2; llama 1,2,4; moe 1,2,4.
  EXPECT_EQ(cases, 11);
}

// Swaps the destination rows of pieces `a` and `b` of parameter `name` on every rank (their row
// counts must match): the bytes all arrive, but in the wrong place.
void swap_pieces(Engine& e, const Model& m, const std::string& name, std::size_t a, std::size_t b) {
  for (std::size_t r = 0; r < e.layouts.size(); ++r) {
    bool found = false;
    for (EngineParam& p : e.layouts[r].params)
      if (p.name == name) {
        ASSERT_GT(p.pieces.size(), std::max(a, b)) << name;
        ASSERT_EQ(p.pieces[a].rows, p.pieces[b].rows) << name;
        std::swap(p.pieces[a].dst_row, p.pieces[b].dst_row);
        found = true;
      }
    ASSERT_TRUE(found) << name;
    // Build the wrong bytes with the tampered layout, then run with the true layout's meaning.
    std::vector<Bits> wrong = apply_layout(m.spec, e.layouts[r], m.hf_bits);
    e.params[r] = std::move(wrong);
  }
}

Status check_engine(const Model& m, const Engine& e, const std::vector<std::int32_t>& tokens) {
  auto want = reference_forward(m.spec, pointers(m.hf), tokens);
  if (!want.ok()) return want.status();
  auto got = run_engine(m.spec, e.layouts, e.params, tokens);
  for (auto& g : got)
    if (!g.ok()) return g.status();
  return compare_logits(*got[0], *want, m.spec.config().vocab_size, kTolerance);
}

TEST(ForwardEngine, DetectsSwappedKAndVRows) {
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE("tp=" + std::to_string(tp));
    const Model m = make_model("tiny-qwen3", 3);
    const auto tokens = logit_check_tokens(m.spec, 8);
    Engine e = make_engine(m, tp);
    ASSERT_TRUE(check_engine(m, e, tokens).ok());
    // qkv_proj pieces are [q, k, v]; swap k and v in layer 1.
    swap_pieces(e, m, "model.layers.1.self_attn.qkv_proj.weight", 1, 2);
    const Status s = check_engine(m, e, tokens);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kCorruption);
    EXPECT_NE(s.message().find("exceeds the tolerance"), std::string::npos) << s.message();
  }
}

TEST(ForwardEngine, DetectsSwappedGateAndUpOfExperts) {
  const Model m = make_model("tiny-moe", 4);
  const auto tokens = logit_check_tokens(m.spec, 8);
  Engine e = make_engine(m, 2);
  ASSERT_TRUE(check_engine(m, e, tokens).ok());
  // w13 pieces alternate gate/up per expert: swap gate and up of every expert of layer 0.
  for (std::size_t x = 0; x < 8; ++x)
    swap_pieces(e, m, "model.layers.0.mlp.experts.w13_weight", 2 * x, 2 * x + 1);
  const Status s = check_engine(m, e, tokens);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.to_string();
}

TEST(ForwardEngine, DetectsSwappedTpRanks) {
  for (const char* preset : {"tiny-qwen2", "tiny-moe"}) {
    SCOPED_TRACE(preset);
    const Model m = make_model(preset, 5);
    const auto tokens = logit_check_tokens(m.spec, 8);
    Engine e = make_engine(m, 2);
    ASSERT_TRUE(check_engine(m, e, tokens).ok());
    std::swap(e.params[0], e.params[1]);  // every shape matches; the meaning does not
    const Status s = check_engine(m, e, tokens);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.to_string();
  }
}

TEST(ForwardEngine, RejectsInconsistentInputs) {
  const Model m = make_model("tiny-qwen3", 6);
  const auto tokens = logit_check_tokens(m.spec, 4);
  Engine e = make_engine(m, 2);
  std::vector<const std::uint16_t*> p;
  for (const Bits& b : e.params[1]) p.push_back(b.data());
  // tp_size 2 without a group.
  auto no_group = engine_forward(m.spec, e.layouts[1], p, tokens, nullptr);
  ASSERT_FALSE(no_group.ok());
  EXPECT_NE(no_group.status().message().find("tp rank 1/2"), std::string::npos)
      << no_group.status().message();
  // A group whose rank disagrees with the layout.
  ThreadGroup group(2);
  auto member0 = group.member(0);
  auto wrong_rank = engine_forward(m.spec, e.layouts[1], p, tokens, member0.get());
  EXPECT_EQ(wrong_rank.status().code(), StatusCode::kInvalidArgument);
  // Too few parameter buffers.
  p.pop_back();
  auto member1 = group.member(1);
  auto few = engine_forward(m.spec, e.layouts[1], p, tokens, member1.get());
  ASSERT_FALSE(few.ok());
  EXPECT_NE(few.status().message().find("parameter buffers"), std::string::npos)
      << few.status().message();
  // A parameter with the wrong shape is named.
  Engine e1 = make_engine(m, 1);
  EngineShardLayout bad = e1.layouts[0];
  bad.params[1].shape[0] -= 1;
  std::vector<const std::uint16_t*> p1;
  for (const Bits& b : e1.params[0]) p1.push_back(b.data());
  auto shape = engine_forward(m.spec, bad, p1, tokens, nullptr);
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find(bad.params[1].name), std::string::npos)
      << shape.status().message();
}

// --- helpers ----------------------------------------------------------------------------------

TEST(ForwardHelpers, LogitCheckTokensAreFixedAndCoverBothVocabularyEnds) {
  const ModelSpec spec = load("tiny-qwen2");
  const auto a = logit_check_tokens(spec, 8);
  EXPECT_EQ(a, logit_check_tokens(spec, 8));
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a[0], 514);
  EXPECT_EQ(a[1], 0);
  for (auto t : a) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, 515);
  }
  EXPECT_TRUE(logit_check_tokens(spec, 0).empty());
}

TEST(ForwardHelpers, CompareLogitsNamesTheWorstElement) {
  const std::vector<float> want = {1, -4, 2, 0.5f, 3, -1};  // [T=2, V=3], max|want| = 4
  std::vector<float> got = want;
  EXPECT_TRUE(compare_logits(got, want, 3, 1e-6).ok());
  got[4] += 0.002f;  // 5e-4 relative
  got[1] += 0.001f;
  EXPECT_TRUE(compare_logits(got, want, 3, 1e-3).ok());
  const Status s = compare_logits(got, want, 3, 1e-4);
  ASSERT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("position 1 vocab index 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tolerance 0.0001"), std::string::npos) << s.message();
  got = want;
  got[2] = std::nanf("");
  const Status nan = compare_logits(got, want, 3, 1.0);
  ASSERT_EQ(nan.code(), StatusCode::kCorruption);
  EXPECT_NE(nan.message().find("position 0 vocab index 2"), std::string::npos) << nan.message();
  EXPECT_EQ(compare_logits({1, 2}, want, 3, 1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit
