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
#include "harness/forward_kernels.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "spec/fp8.h"

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
// Parameters the layout keeps in float32 (DeepSeek's correction bias, GLM's router in vLLM) as
// float32 values of their bf16 bits (two halves per element); the others as they are.
std::vector<Bits> in_layout_dtype(const EngineShardLayout& layout, const std::vector<Bits>& bits) {
  std::vector<Bits> out;
  for (std::size_t i = 0; i < bits.size(); ++i) {
    if (layout.params[i].dtype != DType::kFloat32) {
      out.push_back(bits[i]);
      continue;
    }
    Bits wide(bits[i].size() * 2);
    for (std::size_t j = 0; j < bits[i].size(); ++j) {
      const float f = from_bf16(bits[i][j]);
      std::memcpy(&wide[2 * j], &f, sizeof f);
    }
    out.push_back(std::move(wide));
  }
  return out;
}

// `absorbed`, when given, holds every rank's MLA matrices (else engine_forward derives them).
std::vector<Result<std::vector<float>>> run_engine(
    const ModelSpec& spec, const std::vector<EngineShardLayout>& layouts,
    const std::vector<std::vector<Bits>>& params, const std::vector<std::int32_t>& tokens,
    const ForwardConfig* fc = nullptr,
    const std::vector<std::vector<MlaAbsorbed>>* absorbed = nullptr) {
  const int t = static_cast<int>(layouts.size());
  ThreadGroup group(t);
  std::vector<Result<std::vector<float>>> out(
      t, Result<std::vector<float>>(Status::Internal("not run")));
  std::vector<std::thread> threads;
  for (int r = 0; r < t; ++r)
    threads.emplace_back([&, r] {
      const auto u = static_cast<std::size_t>(r);
      auto comm = t > 1 ? group.member(r) : nullptr;
      const std::vector<Bits> typed = in_layout_dtype(layouts[u], params[u]);
      std::vector<const void*> p;
      for (const Bits& b : typed) p.push_back(b.data());
      auto defaults = forward_config(spec, "{}");
      if (fc == nullptr && !defaults.ok()) {
        out[u] = defaults.status();
      } else {
        out[u] = engine_forward(spec, fc != nullptr ? *fc : *defaults, layouts[u], p, tokens,
                                comm.get(), absorbed != nullptr ? &(*absorbed)[u] : nullptr);
      }
      if (!out[u].ok()) group.abort();
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

Engine make_engine(const Model& m, int tp, EngineProtocol protocol = EngineProtocol::kVllm) {
  Engine e;
  Config cfg;
  cfg.generation.backend = protocol;
  cfg.generation.layout = EngineLayout::kFused;
  for (int r = 0; r < tp; ++r) {
    auto L = engine_layout(m.spec, tp, r, EngineLayout::kFused, protocol);
    EXPECT_TRUE(L.ok()) << L.status().to_string();
    if (!L.ok()) return {};
    // The engines' dtypes: float32 for the correction bias (and GLM's router in vLLM).
    for (EngineParam& p : L->params)
      if (!p.pieces.empty())
        p.dtype = engine_dtype(cfg, m.spec, m.spec.tensors()[p.pieces.front().hf_tensor],
                               DType::kBFloat16);
    e.params.push_back(apply_layout(m.spec, *L, m.hf_bits));
    e.layouts.push_back(std::move(L).value());
  }
  return e;
}

constexpr double kTolerance = 1e-4;
const char* const kTinyPresets[] = {"tiny-qwen3",  "tiny-qwen2",  "tiny-llama", "tiny-moe",
                                    "tiny-gemma2", "tiny-gemma3", "tiny-phi3",  "tiny-qwen2-moe"};

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
// transformers' gelu_pytorch_tanh.
double gelu_tanh(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double cap(double x, double c) { return c > 0 ? c * std::tanh(x / c) : x; }

// One layer, H = 2, one head of d = 2; each tensor is read by HF name from `w`. The forward
// config's features (Gemma's scaled embeddings, (1 + w) norms, normalized attention and MLP
// outputs, GELU, score scale, soft-capping, window; Phi-3's fused tensors; Qwen2-MoE's shared
// expert) are written out here as transformers' modeling files describe them.
class HandModel {
 public:
  HandModel(const ModelSpec& spec, const std::vector<std::vector<float>>& w,
            const ForwardConfig& fc)
      : spec_(spec), w_(w), fc_(fc) {}

  double at(const std::string& name, std::size_t i) const {
    auto idx = spec_.find(name);
    EXPECT_TRUE(idx.has_value()) << name;
    return idx ? w_[*idx][i] : 0.0;
  }
  V2 vec(const std::string& name, std::size_t row = 0) const {
    return {at(name, 2 * row), at(name, 2 * row + 1)};
  }
  // Rows [row0, row0 + 2) of a [*, 2] matrix (rows are output features) times v.
  V2 mat(const std::string& name, const V2& v, std::size_t row0 = 0) const {
    return {dot(vec(name, row0), v), dot(vec(name, row0 + 1), v)};
  }
  V2 norm(const V2& v, const std::string& name) const {
    V2 w = vec(name);
    if (fc_.offset_norms) w = {1 + w[0], 1 + w[1]};
    return rms(v, w, spec_.config().rms_norm_eps);
  }
  double act(double x) const {
    return fc_.activation == Activation::kGeluTanh ? gelu_tanh(x) : silu(x);
  }

  std::vector<double> logits(const std::vector<std::int32_t>& tokens) const {
    const ModelConfig& c = spec_.config();
    const std::string L = "model.layers.0.";
    const std::size_t T = tokens.size();
    std::vector<V2> x(T), q(T), k(T), v(T);
    for (std::size_t t = 0; t < T; ++t) {
      x[t] = vec("model.embed_tokens.weight", tokens[t]);
      x[t] = {x[t][0] * fc_.embed_scale, x[t][1] * fc_.embed_scale};
    }
    for (std::size_t t = 0; t < T; ++t) {
      const V2 h = norm(x[t], L + "input_layernorm.weight");
      if (c.fused_in_checkpoint) {  // [q; k; v] rows of one tensor
        q[t] = mat(L + "self_attn.qkv_proj.weight", h, 0);
        k[t] = mat(L + "self_attn.qkv_proj.weight", h, 2);
        v[t] = mat(L + "self_attn.qkv_proj.weight", h, 4);
      } else {
        q[t] = mat(L + "self_attn.q_proj.weight", h);
        k[t] = mat(L + "self_attn.k_proj.weight", h);
        v[t] = mat(L + "self_attn.v_proj.weight", h);
      }
      if (c.attention_bias)
        for (int j = 0; j < 2; ++j) {
          q[t][j] += at(L + "self_attn.q_proj.bias", j);
          k[t][j] += at(L + "self_attn.k_proj.bias", j);
          v[t][j] += at(L + "self_attn.v_proj.bias", j);
        }
      if (c.qk_norm) {
        q[t] = norm(q[t], L + "self_attn.q_norm.weight");
        k[t] = norm(k[t], L + "self_attn.k_norm.weight");
      }
      q[t] = rope(q[t], static_cast<double>(t) / fc_.rope_factor[0]);
      k[t] = rope(k[t], static_cast<double>(t) / fc_.rope_factor[0]);
    }
    const double scale = fc_.attn_scale > 0 ? fc_.attn_scale : 1 / std::sqrt(2.0);
    const auto window = static_cast<std::size_t>(fc_.window[0]);
    std::vector<double> out;
    for (std::size_t t = 0; t < T; ++t) {
      double z = 0;
      V2 o{0, 0};
      for (std::size_t s = 0; s <= t; ++s) {
        if (window > 0 && t - s >= window) continue;  // attends to (t - window, t]
        const double p = std::exp(cap(dot(q[t], k[s]) * scale, fc_.attn_softcap));
        z += p;
        o = {o[0] + p * v[s][0], o[1] + p * v[s][1]};
      }
      o = {o[0] / z, o[1] / z};
      V2 a = mat(L + "self_attn.o_proj.weight", o);
      V2 h;
      V2 y;
      if (fc_.sandwich_norms) {
        a = norm(a, L + "post_attention_layernorm.weight");
        y = {x[t][0] + a[0], x[t][1] + a[1]};
        h = norm(y, L + "pre_feedforward_layernorm.weight");
      } else {
        y = {x[t][0] + a[0], x[t][1] + a[1]};
        h = norm(y, L + "post_attention_layernorm.weight");
      }
      V2 m = c.num_experts > 0 ? moe(h) : dense(h, L + "mlp.");
      if (fc_.sandwich_norms) m = norm(m, L + "post_feedforward_layernorm.weight");
      y = {y[0] + m[0], y[1] + m[1]};
      const V2 f = norm(y, "model.norm.weight");
      const std::string head =
          c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
      for (std::int64_t id = 0; id < c.vocab_size; ++id)
        out.push_back(cap(dot(vec(head, id), f), fc_.final_softcap));
    }
    return out;
  }

 private:
  // gate/up [1, 2] (I = 1), down [2, 1]; Phi-3's gate_up [2, 2] holds gate in row 0, up in row 1.
  V2 dense(const V2& h, const std::string& p, bool fused_gate_up = false) const {
    const bool fused = fused_gate_up || spec_.config().fused_in_checkpoint;
    const double g = dot(vec(p + (fused ? "gate_up_proj.weight" : "gate_proj.weight"), 0), h);
    const double u =
        dot(vec(p + (fused ? "gate_up_proj.weight" : "up_proj.weight"), fused ? 1 : 0), h);
    const double a = act(g) * u;
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
    if (c.shared_expert_intermediate_size > 0) {  // sigmoid(shared_expert_gate . h) * shared MLP
      const V2 s = dense(h, "model.layers.0.mlp.shared_expert.");
      const double g =
          1 / (1 + std::exp(-dot(vec("model.layers.0.mlp.shared_expert_gate.weight"), h)));
      out = {out[0] + g * s[0], out[1] + g * s[1]};
    }
    return out;
  }

  const ModelSpec& spec_;
  const std::vector<std::vector<float>>& w_;
  const ForwardConfig& fc_;
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

// `fc` null: the defaults (forward_config(spec, "{}")).
void expect_hand_match(const ModelConfig& c, std::uint64_t seed,
                       const ForwardConfig* fc = nullptr) {
  const ModelSpec spec(c, "hand");
  const std::vector<std::vector<float>> w = random_hf(spec, seed);
  const std::vector<std::int32_t> tokens = {3, 0, 4, 3};
  auto defaults = forward_config(spec, "{}");
  ASSERT_TRUE(defaults.ok()) << defaults.status().to_string();
  const ForwardConfig& f = fc != nullptr ? *fc : *defaults;
  auto got = reference_forward(spec, f, pointers(w), tokens);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const std::vector<double> want = HandModel(spec, w, f).logits(tokens);
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

// Gemma 2 and 3 as transformers computes them: embeddings times sqrt(H), (1 + w) norms, the
// attention and MLP outputs normalized before their residual adds, GELU (tanh), scores scaled by
// query_pre_attn_scalar^-1/2 and soft-capped, a window of 2 over 4 tokens, soft-capped logits.
TEST(ForwardReference, MatchesHandComputedGemmaLayer) {
  for (const Architecture arch : {Architecture::kGemma2, Architecture::kGemma3}) {
    SCOPED_TRACE(arch == Architecture::kGemma2 ? "gemma2" : "gemma3");
    ModelConfig c = hand_config();
    c.arch = arch;
    c.feedforward_norms = true;
    c.tie_word_embeddings = true;
    c.qk_norm = arch == Architecture::kGemma3;
    const ModelSpec spec(c, "hand");
    // The defaults: transformers' for the class (Gemma 2 soft-caps at 50 and 30, windows of
    // 4096 on layer 0; Gemma 3 neither).
    auto fc = forward_config(spec, "{}");
    ASSERT_TRUE(fc.ok()) << fc.status().to_string();
    EXPECT_EQ(fc->attn_scale, 1 / 16.0);  // query_pre_attn_scalar 256
    EXPECT_EQ(fc->embed_scale, std::sqrt(2.0));
    EXPECT_EQ(fc->activation, Activation::kGeluTanh);
    EXPECT_TRUE(fc->offset_norms && fc->sandwich_norms);
    EXPECT_EQ(fc->attn_softcap, arch == Architecture::kGemma2 ? 50.0 : 0.0);
    EXPECT_EQ(fc->final_softcap, arch == Architecture::kGemma2 ? 30.0 : 0.0);
    EXPECT_EQ(fc->window, std::vector<std::int64_t>{4096});  // layer 0 slides in both
    expect_hand_match(c, 31, &*fc);
    // Caps and a window small enough to change every position past the second.
    auto small = forward_config(spec, R"({"query_pre_attn_scalar": 3, "attn_logit_softcapping": 0.5,
                                          "final_logit_softcapping": 0.75, "sliding_window": 2})");
    ASSERT_TRUE(small.ok()) << small.status().to_string();
    EXPECT_EQ(small->window, std::vector<std::int64_t>{2});
    expect_hand_match(c, 32, &*small);
  }
}

// Phi-3: q/k/v and gate/up as row ranges of the checkpoint's fused tensors.
TEST(ForwardReference, MatchesHandComputedPhi3Layer) {
  ModelConfig c = hand_config();
  c.arch = Architecture::kPhi3;
  c.fused_in_checkpoint = true;
  expect_hand_match(c, 41);
  const ModelSpec spec(c, "hand");
  auto fc = forward_config(spec, R"({"sliding_window": 2})");
  ASSERT_TRUE(fc.ok()) << fc.status().to_string();
  expect_hand_match(c, 42, &*fc);
}

// Qwen2-MoE: q/k/v bias, softmax top-2 of 4 experts plus sigmoid(gate . h) times the shared MLP.
TEST(ForwardReference, MatchesHandComputedQwen2MoeLayer) {
  ModelConfig c = hand_config();
  c.arch = Architecture::kQwen2Moe;
  c.attention_bias = true;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 1;
  c.shared_expert_intermediate_size = 1;
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "norm_topk_prob" : "raw top-k weights");
    c.norm_topk_prob = norm;
    expect_hand_match(c, 51);
  }
}

TEST(ForwardConfig, ReadsEveryArchitecturesFactsFromConfigJson) {
  // Gemma 3's layer pattern and its two RoPE bases; linear scaling on the global layers only.
  ModelConfig g3 = hand_config();
  g3.arch = Architecture::kGemma3;
  g3.num_layers = 7;
  g3.feedforward_norms = true;
  g3.qk_norm = true;
  g3.tie_word_embeddings = true;
  const ModelSpec s3(g3, "hand");
  auto f3 = forward_config(s3, R"({"sliding_window": 5, "rope_theta": 1000000,
      "rope_local_base_freq": 10000, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})");
  ASSERT_TRUE(f3.ok()) << f3.status().to_string();
  EXPECT_EQ(f3->window, (std::vector<std::int64_t>{5, 5, 5, 5, 5, 0, 5}));
  EXPECT_EQ(f3->rope_theta[0], 10000.0);
  EXPECT_EQ(f3->rope_theta[5], 1e6);
  EXPECT_EQ(f3->rope_factor[0], 1.0);
  EXPECT_EQ(f3->rope_factor[5], 8.0);
  // transformers 5's per-layer-type rope_parameters and explicit layer_types.
  auto f5 = forward_config(s3, R"({"layer_types": ["full_attention", "sliding_attention",
      "full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
      "full_attention"], "rope_parameters": {"full_attention": {"rope_type": "default",
      "rope_theta": 500000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 777.0}}})");
  ASSERT_TRUE(f5.ok()) << f5.status().to_string();
  EXPECT_EQ(f5->window, (std::vector<std::int64_t>{0, 4096, 0, 4096, 4096, 4096, 0}));
  EXPECT_EQ(f5->rope_theta[0], 500000.0);
  EXPECT_EQ(f5->rope_theta[1], 777.0);
  // Gemma 2 slides on even layers; null soft-capping turns it off.
  ModelConfig g2 = g3;
  g2.arch = Architecture::kGemma2;
  g2.qk_norm = false;
  const ModelSpec s2(g2, "hand");
  auto f2 = forward_config(s2, R"({"attn_logit_softcapping": null, "sliding_window": 9})");
  ASSERT_TRUE(f2.ok()) << f2.status().to_string();
  EXPECT_EQ(f2->window, (std::vector<std::int64_t>{9, 0, 9, 0, 9, 0, 9}));
  EXPECT_EQ(f2->attn_softcap, 0.0);
  EXPECT_EQ(f2->final_softcap, 30.0);
  // Mistral slides everywhere; Qwen2 only with use_sliding_window, from max_window_layers on.
  ModelConfig q = hand_config();
  q.num_layers = 4;
  q.arch = Architecture::kMistral;
  auto fm = forward_config(ModelSpec(q, "hand"), "{}");
  ASSERT_TRUE(fm.ok());
  EXPECT_EQ(fm->window, (std::vector<std::int64_t>{4096, 4096, 4096, 4096}));
  q.arch = Architecture::kQwen2;
  q.attention_bias = true;
  auto fq = forward_config(
      ModelSpec(q, "hand"),
      R"({"use_sliding_window": true, "max_window_layers": 2, "sliding_window": 7})");
  ASSERT_TRUE(fq.ok());
  EXPECT_EQ(fq->window, (std::vector<std::int64_t>{0, 0, 7, 7}));
  auto fq0 = forward_config(ModelSpec(q, "hand"), R"({"sliding_window": 7})");
  ASSERT_TRUE(fq0.ok());
  EXPECT_EQ(fq0->window, (std::vector<std::int64_t>{0, 0, 0, 0}));
  // Errors name the key.
  auto bad = forward_config(ModelSpec(q, "hand"), R"({"hidden_act": "relu"})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("\"relu\""), std::string::npos) << bad.status().message();
  auto bad_types = forward_config(s3, R"({"layer_types": ["full_attention"]})");
  ASSERT_FALSE(bad_types.ok());
  EXPECT_NE(bad_types.status().message().find("layer_types"), std::string::npos);
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

// The forward config of a preset, from its config.json; with `tight`, every sliding window cut
// to 3 tokens and soft-capping made strong, so that both change the logits of 8 tokens.
ForwardConfig preset_forward_config(const ModelSpec& spec, const std::string& preset, bool tight) {
  auto json = model_config_json(preset);
  EXPECT_TRUE(json.ok()) << json.status().to_string();
  auto fc = forward_config(spec, json.ok() ? *json : "{}");
  EXPECT_TRUE(fc.ok()) << fc.status().to_string();
  ForwardConfig f = fc.ok() ? *fc : ForwardConfig{};
  if (tight) {
    for (auto& w : f.window) w = w > 0 ? 3 : 0;
    if (f.attn_softcap > 0) f.attn_softcap = 0.7;
    if (f.final_softcap > 0) f.final_softcap = 1.5;
  }
  return f;
}

TEST(ForwardEngine, MatchesReferenceForEveryTpSizeOfTinyPresets) {
  int cases = 0;
  for (const char* preset : kTinyPresets) {
    const Model m = make_model(preset, 7);
    const std::vector<std::int32_t> tokens = logit_check_tokens(m.spec, 8);
    const bool gemma = m.spec.config().feedforward_norms;
    for (const bool tight : {false, true}) {
      if (tight && !gemma) continue;
      const ForwardConfig fc = preset_forward_config(m.spec, preset, tight);
      auto want = reference_forward(m.spec, fc, pointers(m.hf), tokens);
      ASSERT_TRUE(want.ok()) << preset << ": " << want.status().to_string();
      for (const EngineProtocol protocol : {EngineProtocol::kVllm, EngineProtocol::kSglang}) {
        // The engines' layouts differ for Gemma 3 only (SGLang's whole embedding).
        if (protocol == EngineProtocol::kSglang && m.spec.config().arch != Architecture::kGemma3)
          continue;
        for (int tp : {1, 2, 4}) {
          if (!check_engine_tp(m.spec, tp).ok()) continue;
          SCOPED_TRACE(std::string(preset) + " tp=" + std::to_string(tp) + (tight ? " tight" : "") +
                       (protocol == EngineProtocol::kSglang ? " sglang" : " vllm"));
          ++cases;
          const Engine e = make_engine(m, tp, protocol);
          ASSERT_EQ(e.layouts.size(), static_cast<std::size_t>(tp));
          auto got = run_engine(m.spec, e.layouts, e.params, tokens, &fc);
          for (int r = 0; r < tp; ++r) {
            ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status().to_string();
            const Status s = compare_logits(*got[r], *want, m.spec.config().vocab_size, kTolerance);
            EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
            // Partials are summed in rank order on every rank: identical bits everywhere.
            EXPECT_EQ(*got[r], *got[0]) << "rank " << r;
          }
        }
      }
    }
  }
  // qwen3 1,2,4 (4 replicates kv heads); qwen2 1,2; llama 1,2,4; moe 1,2,4; gemma2 1,2,4 twice;
  // gemma3 1,2,4 twice for each engine; phi3 1,2; qwen2-moe 1,2,4.
  EXPECT_EQ(cases, 11 + 6 + 12 + 2 + 3);
}

// The window and the soft-capping change the logits: the tight config differs from the preset's.
TEST(ForwardEngine, WindowsAndSoftCappingChangeTheLogits) {
  for (const char* preset : {"tiny-gemma2", "tiny-gemma3"}) {
    SCOPED_TRACE(preset);
    const Model m = make_model(preset, 9);
    const auto tokens = logit_check_tokens(m.spec, 8);
    auto loose = reference_forward(m.spec, preset_forward_config(m.spec, preset, false),
                                   pointers(m.hf), tokens);
    ForwardConfig windowed = preset_forward_config(m.spec, preset, false);
    for (auto& w : windowed.window) w = w > 0 ? 3 : 0;
    auto tight = reference_forward(m.spec, windowed, pointers(m.hf), tokens);
    ASSERT_TRUE(loose.ok() && tight.ok());
    const std::int64_t V = m.spec.config().vocab_size;
    // Positions 0..2 see at most 3 tokens either way; position 3 on do not.
    for (std::int64_t i = 0; i < 3 * V; ++i) EXPECT_EQ((*loose)[i], (*tight)[i]) << i;
    EXPECT_FALSE(compare_logits(*tight, *loose, V, kTolerance).ok());
  }
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

// DeepSeek-V3 (q_lora_rank set and null) and GLM-4.5: every engine TP size and both protocols
// (the fused a-projection's name and GLM's float32 router differ) against the reference. The
// engine pass runs MLA absorbed (W_UK_T / W_UV), the reference expands keys and values through
// kv_b_proj as transformers does.
TEST(ForwardEngine, MatchesReferenceForMlaAndGlm) {
  int cases = 0;
  for (const char* preset : {"tiny-deepseek", "tiny-deepseek-lite", "tiny-glm4-moe"}) {
    const Model m = make_model(preset, 21);
    const std::vector<std::int32_t> tokens = logit_check_tokens(m.spec, 8);
    const ForwardConfig fc = preset_forward_config(m.spec, preset, false);
    auto want = reference_forward(m.spec, fc, pointers(m.hf), tokens);
    ASSERT_TRUE(want.ok()) << preset << ": " << want.status().to_string();
    for (const EngineProtocol protocol : {EngineProtocol::kVllm, EngineProtocol::kSglang})
      for (int tp : {1, 2, 4}) {
        SCOPED_TRACE(std::string(preset) + " tp=" + std::to_string(tp) +
                     (protocol == EngineProtocol::kSglang ? " sglang" : " vllm"));
        ASSERT_TRUE(check_engine_tp(m.spec, tp).ok());
        ++cases;
        const Engine e = make_engine(m, tp, protocol);
        ASSERT_EQ(e.layouts.size(), static_cast<std::size_t>(tp));
        auto got = run_engine(m.spec, e.layouts, e.params, tokens, &fc);
        for (int r = 0; r < tp; ++r) {
          ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status().to_string();
          const Status s = compare_logits(*got[r], *want, m.spec.config().vocab_size, kTolerance);
          EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
          EXPECT_EQ(*got[r], *got[0]) << "rank " << r;
        }
      }
  }
  EXPECT_EQ(cases, 3 * 2 * 3);
}

// The rank's kv_b_proj of `params` (layout `layout`) turned into the absorbed matrices, per layer.
std::vector<MlaAbsorbed> absorb(const Model& m, const EngineShardLayout& layout,
                                const std::vector<Bits>& params, int tp) {
  std::vector<MlaAbsorbed> out;
  for (std::int64_t l = 0; l < m.spec.config().num_layers; ++l) {
    const std::string name = "model.layers." + std::to_string(l) + ".self_attn.kv_b_proj.weight";
    for (std::size_t i = 0; i < layout.params.size(); ++i)
      if (layout.params[i].name == name)
        out.push_back(derive_mla(m.spec.config(), tp, params[i].data()));
  }
  return out;
}

// The absorbed matrices must come from the weights of this refit: derived from the rank's own
// kv_b_proj the logits are those engine_forward derives itself (bit for bit); derived from the
// previous step's kv_b_proj (an engine nobody told that the weights changed) they fail the check.
TEST(ForwardEngine, StaleMlaMatricesFailTheCheck) {
  for (const char* preset : {"tiny-deepseek", "tiny-deepseek-lite"}) {
    SCOPED_TRACE(preset);
    const Model now = make_model(preset, 31), before = make_model(preset, 32);
    const auto tokens = logit_check_tokens(now.spec, 8);
    const ForwardConfig fc = preset_forward_config(now.spec, preset, false);
    auto want = reference_forward(now.spec, fc, pointers(now.hf), tokens);
    ASSERT_TRUE(want.ok()) << want.status().to_string();
    const int tp = 2;
    const Engine e = make_engine(now, tp, EngineProtocol::kSglang);
    const Engine old = make_engine(before, tp, EngineProtocol::kSglang);
    std::vector<std::vector<MlaAbsorbed>> fresh, stale;
    for (int r = 0; r < tp; ++r) {
      fresh.push_back(absorb(now, e.layouts[r], e.params[r], tp));
      stale.push_back(absorb(before, old.layouts[r], old.params[r], tp));
      ASSERT_EQ(fresh.back().size(), static_cast<std::size_t>(now.spec.config().num_layers));
      // w_uk_t[n, p, l] = kv_b[n (P + V) + p, l]; w_uv[n, l, v] = kv_b[n (P + V) + P + v, l].
      const ModelConfig& c = now.spec.config();
      const std::int64_t P = c.qk_nope_head_dim, Vd = c.v_head_dim, L = c.kv_lora_rank;
      std::size_t kv_b = 0;
      for (std::size_t i = 0; i < e.layouts[r].params.size(); ++i)
        if (e.layouts[r].params[i].name == "model.layers.0.self_attn.kv_b_proj.weight") kv_b = i;
      const Bits& w = e.params[r][kv_b];
      const MlaAbsorbed& a = fresh.back()[0];
      EXPECT_EQ(a.w_uk_t[(1 * P + 2) * L + 3], w[(1 * (P + Vd) + 2) * L + 3]);
      EXPECT_EQ(a.w_uv[(1 * L + 3) * Vd + 4], w[(1 * (P + Vd) + P + 4) * L + 3]);
    }
    auto derived = run_engine(now.spec, e.layouts, e.params, tokens, &fc);
    auto given = run_engine(now.spec, e.layouts, e.params, tokens, &fc, &fresh);
    auto old_state = run_engine(now.spec, e.layouts, e.params, tokens, &fc, &stale);
    for (int r = 0; r < tp; ++r) {
      ASSERT_TRUE(derived[r].ok() && given[r].ok() && old_state[r].ok());
      EXPECT_EQ(*given[r], *derived[r]);
      EXPECT_TRUE(compare_logits(*given[r], *want, now.spec.config().vocab_size, kTolerance).ok());
      const Status s =
          compare_logits(*old_state[r], *want, now.spec.config().vocab_size, kTolerance);
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.to_string();
    }
  }
}

// DeepSeek-V3's router: sigmoid scores, the bias choosing, two of four groups eligible.
TEST(ForwardHelpers, SigmoidRouterLimitsGroupsAndScales) {
  ForwardConfig fc;
  fc.sigmoid_router = true;
  fc.n_group = 4;
  fc.topk_group = 2;
  fc.routed_scaling = 2.5;
  // logit 0 -> score 0.5. Groups {0,1} {2,3} {4,5} {6,7}; the bias lifts expert 7's choice, so
  // group 3 ranks first (0.5 + 0.9 + 0.5), then group 1 (expert 2's logit 2).
  const float logits[8] = {0, 0, 2, 0, -3, -3, 0, 0};
  const float bias[8] = {0, 0, 0, 0, 0, 0, 0, 0.4f};
  auto r = fwd::route_token_sigmoid(logits, bias, 8, 2, true, fc);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].first, 7);  // choice 0.9
  EXPECT_EQ(r[1].first, 2);  // choice sigmoid(2) = 0.881
  const double s2 = 1 / (1 + std::exp(-2.0));
  // Weights are the scores (not the choices), renormalised, times the scaling.
  EXPECT_NEAR(r[0].second, 0.5 / (0.5 + s2) * 2.5, 1e-6);
  EXPECT_NEAR(r[1].second, s2 / (0.5 + s2) * 2.5, 1e-6);
  // One eligible group (group 3) leaves experts 7 and 6; unnormalised weights are the scores.
  fc.topk_group = 1;
  auto one = fwd::route_token_sigmoid(logits, bias, 8, 2, false, fc);
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[0].first, 7);
  EXPECT_EQ(one[1].first, 6);
  EXPECT_NEAR(one[1].second, 0.5 * 2.5, 1e-6);
}

TEST(ForwardConfig, ReadsDeepseekAndGlmFacts) {
  const ModelSpec ds = load("tiny-deepseek"), glm = load("tiny-glm4-moe");
  auto d = forward_config(ds, R"({"n_routed_experts": 8})");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE(d->rope_interleaved);
  EXPECT_TRUE(d->sigmoid_router);
  EXPECT_EQ(d->n_group, 8);  // DeepseekV3Config's defaults
  EXPECT_EQ(d->topk_group, 4);
  EXPECT_EQ(d->routed_scaling, 2.5);
  auto d2 = forward_config(ds, R"({"rope_interleave": false, "n_group": 2, "topk_group": 1,
      "routed_scaling_factor": 1.5})");
  ASSERT_TRUE(d2.ok());
  EXPECT_FALSE(d2->rope_interleaved);
  EXPECT_EQ(d2->n_group, 2);
  EXPECT_EQ(d2->routed_scaling, 1.5);
  auto g = forward_config(glm, "{}");
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_FALSE(g->rope_interleaved);
  EXPECT_EQ(g->rotary_dim, 6);  // partial_rotary_factor 0.5 of head_dim 12
  EXPECT_EQ(g->n_group, 1);
  EXPECT_EQ(g->routed_scaling, 1.0);
  auto bad = forward_config(ds, R"({"n_group": 3})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("\"n_group\""), std::string::npos)
      << bad.status().message();
  EXPECT_TRUE(has_reference_forward(Architecture::kDeepseekV3));
  EXPECT_TRUE(has_reference_forward(Architecture::kGlm4Moe));
  EXPECT_FALSE(has_reference_forward(Architecture::kOther));
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
