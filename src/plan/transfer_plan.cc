#include "plan/transfer_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <tuple>
#include <unordered_map>

#include "common/piece.h"

namespace refit {
namespace {

// A 64-bit hash of a stream of integers and strings (murmur3's finalizer per word).
struct Hasher {
  std::uint64_t h = 0x6a09e667f3bcc908ull;
  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
  }
  void add(std::int64_t v) {
    h = mix(h ^ (static_cast<std::uint64_t>(v) + 0x9e3779b97f4a7c15ull)) + 1;
  }
  void add(std::string_view s) {
    std::uint64_t f = 1469598103934665603ull;  // FNV-1a over the bytes
    for (char c : s) {
      f ^= static_cast<unsigned char>(c);
      f *= 1099511628211ull;
    }
    add(static_cast<std::int64_t>(f));
    add(static_cast<std::int64_t>(s.size()));
  }
};

// v >= 0 rounded up to a multiple of a > 0 (a mask for the element sizes, all powers of two: a
// division is most of the cost of placing a round of a pair's routes).
std::int64_t align_up(std::int64_t v, std::int64_t a) {
  if ((a & (a - 1)) == 0) return (v + a - 1) & ~(a - 1);
  return (v + a - 1) / a * a;
}

auto route_order(const Route& r) {
  return std::tie(r.hf_tensor, r.hf_row, r.hf_col, r.engine_param, r.engine_row, r.engine_col,
                  r.trainer_tensor, r.trainer_row, r.trainer_col);
}

// What puts two wire tensors in one group: the same kind of tensor (scale or not), shape and dtype,
// and either the same role (and, for experts, layer), or for a tensor without a role the same name
// but for its layer number.
struct GroupKey {
  enum Kind { kByName, kExpert, kLayer };
  const TensorSpec* spec = nullptr;  // the tensor: its shape
  bool scale = false;
  Kind kind = kByName;
  int role = 0;            // kExpert, kLayer
  std::int64_t layer = 0;  // kExpert: a group spans one layer's experts
  std::string name;        // kByName: the tensor's name with its layer number taken out
  int dtype = 0;
  bool operator==(const GroupKey& o) const {
    return scale == o.scale && kind == o.kind && role == o.role && layer == o.layer &&
           dtype == o.dtype && name == o.name && spec->shape == o.spec->shape;
  }
};
struct GroupKeyHash {
  std::size_t operator()(const GroupKey& k) const {
    Hasher h;
    h.add(k.scale);
    h.add(k.kind);
    h.add(k.role);
    h.add(k.layer);
    h.add(k.dtype);
    h.add(k.name);
    for (std::int64_t d : k.spec->shape) h.add(d);
    return static_cast<std::size_t>(h.h);
  }
};

// Groups of the wire model: tensors of one role, shape and dtype that differ in their expert
// index (within a layer) or, outside experts, in their layer index; cut into arithmetic runs of
// tensor indices. A tensor of a table read from safetensors headers (no roles) is grouped by its
// name with the layer number taken out. Everything else is a group of one.
std::vector<TensorGroup> make_groups(const WireModel& wire) {
  const auto& ts = wire.spec.tensors();
  std::unordered_map<GroupKey, std::vector<std::uint32_t>, GroupKeyHash> by_key;
  std::vector<TensorGroup> groups;
  for (std::uint32_t t = 0; t < ts.size(); ++t) {
    const bool scale = wire.fp8 && wire.fp8->is_scale(t);
    const TensorSpec& base = scale ? ts[static_cast<std::size_t>(wire.fp8->weight_of[t])] : ts[t];
    GroupKey key{.spec = &ts[t], .scale = scale, .dtype = static_cast<int>(wire.dtype[t])};
    if (base.role == ParamRole::kOther) {
      const std::string layer = fmt::format(".layers.{}", base.layer);
      const std::size_t at = base.layer >= 0 ? base.name.find(layer + ".") : std::string::npos;
      if (at == std::string::npos) {
        groups.push_back(TensorGroup{.first = t});
        continue;
      }
      key.name = base.name.substr(0, at) + ".layers.*" + base.name.substr(at + layer.size());
    } else if (base.expert >= 0) {
      key.kind = GroupKey::kExpert;
      key.role = static_cast<int>(base.role);
      key.layer = base.layer;
    } else if (base.layer >= 0) {
      key.kind = GroupKey::kLayer;
      key.role = static_cast<int>(base.role);
    } else {
      groups.push_back(TensorGroup{.first = t});
      continue;
    }
    by_key[key].push_back(t);
  }
  for (const auto& [key, list] : by_key) {
    for (std::size_t i = 0; i < list.size();) {
      if (i + 1 == list.size()) {
        groups.push_back(TensorGroup{.first = list[i]});
        break;
      }
      const std::int64_t stride = static_cast<std::int64_t>(list[i + 1]) - list[i];
      std::size_t j = i + 2;
      while (j < list.size() && static_cast<std::int64_t>(list[j]) - list[j - 1] == stride) ++j;
      groups.push_back(TensorGroup{.first = list[i],
                                   .stride = static_cast<std::int32_t>(stride),
                                   .count = static_cast<std::int32_t>(j - i)});
      i = j;
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const TensorGroup& a, const TensorGroup& b) { return a.first < b.first; });
  return groups;
}

// Where every piece of engine tensor `a` sits one step from its counterpart of tensor `b`.
bool engine_steps(const EngineShardLayout& lay, std::uint32_t a, std::uint32_t b,
                  std::vector<EngineStep>& out) {
  const auto& pa = lay.pieces_by_hf[a];
  const auto& pb = lay.pieces_by_hf[b];
  out.clear();
  if (pa.size() != pb.size()) return false;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const Piece& x = lay.params[pa[i].first].pieces[pa[i].second];
    const Piece& y = lay.params[pb[i].first].pieces[pb[i].second];
    if (x.src_row != y.src_row || x.src_col != y.src_col || x.rows != y.rows || x.cols != y.cols)
      return false;
    out.push_back(EngineStep{.param = static_cast<std::int64_t>(pb[i].first) - pa[i].first,
                             .dst_row = y.dst_row - x.dst_row,
                             .dst_col = y.dst_col - x.dst_col});
  }
  return true;
}

// The route moving what holder `h` and engine piece `q` (of parameter `param` of engine rank
// `engine`) share, over run `run` of group `g` (`piece`: q's place among the pieces reading the
// run's first tensor); false when they share nothing.
bool make_route(const Holder& h, int engine, std::uint32_t param, const Piece& q,
                const TensorGroup& g, const GroupRun& run, std::size_t piece, Route& out) {
  const Piece& p = h.rect;
  const std::int64_t r0 = std::max(p.src_row, q.src_row);
  const std::int64_t r1 = std::min(p.src_row + p.rows, q.src_row + q.rows);
  const std::int64_t c0 = std::max(p.src_col, q.src_col);
  const std::int64_t c1 = std::min(p.src_col + p.cols, q.src_col + q.cols);
  if (r0 >= r1 || c0 >= c1) return false;
  out = Route{.trainer = h.rank,
              .engine = engine,
              .hf_tensor = p.hf_tensor,
              .trainer_tensor = h.local,
              .engine_param = param,
              .rows = r1 - r0,
              .cols = c1 - c0,
              .trainer_row = p.dst_row + (r0 - p.src_row),
              .trainer_col = p.dst_col + (c0 - p.src_col),
              .engine_row = q.dst_row + (r0 - q.src_row),
              .engine_col = q.dst_col + (c0 - q.src_col),
              .hf_row = r0,
              .hf_col = c0,
              .count = run.end - run.begin};
  if (out.count > 1) {
    const EngineStep& e = run.engine[piece];
    out.step = RouteStep{.hf_tensor = g.stride,
                         .trainer_tensor = static_cast<std::int32_t>(run.trainer.local),
                         .engine_param = static_cast<std::int32_t>(e.param),
                         .trainer_row = run.trainer.dst_row,
                         .trainer_col = run.trainer.dst_col,
                         .engine_row = e.dst_row,
                         .engine_col = e.dst_col};
  }
  return true;
}

// Orders a pair's routes, places them in rounds and segments, and hashes them.
void finish_pair(PairPlan& pair, const PlanView& view) {
  std::sort(pair.routes.begin(), pair.routes.end(),
            [](const Route& a, const Route& b) { return route_order(a) < route_order(b); });
  pair.routes.shrink_to_fit();
  const std::vector<DType>& dtypes = *view.dtypes;
  place_routes(
      pair.routes,
      [&](const Route& r) { return static_cast<std::int64_t>(dtype_size(dtypes[r.hf_tensor])); },
      view.pair_budget, pair.round_bytes, pair.bytes);
  Hasher h;
  h.add(static_cast<std::int64_t>(view.identity));
  h.add(pair.trainer);
  h.add(pair.engine);
  h.add(static_cast<std::int64_t>(pair.routes.size()));
  for (const Route& r : pair.routes)
    for (std::int64_t v : {std::int64_t{r.hf_tensor},
                           std::int64_t{r.trainer_tensor},
                           std::int64_t{r.engine_param},
                           r.rows,
                           r.cols,
                           r.trainer_row,
                           r.trainer_col,
                           r.engine_row,
                           r.engine_col,
                           r.hf_row,
                           r.hf_col,
                           std::int64_t{r.round},
                           r.segment_offset,
                           std::int64_t{r.count},
                           std::int64_t{r.step.hf_tensor},
                           std::int64_t{r.step.trainer_tensor},
                           std::int64_t{r.step.engine_param},
                           r.step.trainer_row,
                           r.step.trainer_col,
                           r.step.engine_row,
                           r.step.engine_col,
                           static_cast<std::int64_t>(view.dtype_of(r))})
      h.add(v);
  pair.digest = h.h;
}

// The view's pairs from routes collected per peer, and its totals.
void finish_view(PlanView& view, std::vector<std::vector<Route>>& by_peer) {
  for (std::size_t peer = 0; peer < by_peer.size(); ++peer) {
    if (by_peer[peer].empty()) continue;
    PairPlan pair;
    pair.trainer = view.trainer_side ? view.rank : static_cast<int>(peer);
    pair.engine = view.trainer_side ? static_cast<int>(peer) : view.rank;
    pair.routes = std::move(by_peer[peer]);
    finish_pair(pair, view);
    view.bytes += pair.bytes;
    view.rounds = std::max(view.rounds, pair.rounds());
    view.pairs.push_back(std::move(pair));
  }
  view.pairs.shrink_to_fit();
  std::vector<std::int64_t> stage(static_cast<std::size_t>(view.rounds), 0);
  for (const PairPlan& p : view.pairs)
    for (std::size_t k = 0; k < p.round_bytes.size(); ++k)
      stage[k] += aligned_segment_bytes(p.round_bytes[k]);
  for (std::int64_t s : stage) view.max_stage_bytes = std::max(view.max_stage_bytes, s);
}

PlanView empty_view(const PlanInputs& in, bool trainer_side, int rank) {
  PlanView v;
  v.trainer_side = trainer_side;
  v.rank = rank;
  v.trainer_ranks = in.trainer_ranks();
  v.engine_ranks = in.engine_ranks();
  v.pair_budget = in.pair_budget();
  v.identity = in.identity();
  v.dtypes = in.dtypes();
  return v;
}

}  // namespace

Route Route::members(std::int32_t first, std::int32_t n) const {
  Route r = *this;
  r.count = n;
  r.hf_tensor =
      static_cast<std::uint32_t>(hf_tensor + static_cast<std::int64_t>(first) * step.hf_tensor);
  r.trainer_tensor = static_cast<std::uint32_t>(trainer_tensor + static_cast<std::int64_t>(first) *
                                                                     step.trainer_tensor);
  r.engine_param = static_cast<std::uint32_t>(engine_param +
                                              static_cast<std::int64_t>(first) * step.engine_param);
  r.trainer_row += first * step.trainer_row;
  r.trainer_col += first * step.trainer_col;
  r.engine_row += first * step.engine_row;
  r.engine_col += first * step.engine_col;
  if (n == 1) r.step = RouteStep{};
  return r;
}

std::string PairPlan::digest_hex() const { return fmt::format("{:016x}", digest); }

const PairPlan* PlanView::pair_with(int peer) const {
  auto it = std::lower_bound(pairs.begin(), pairs.end(), peer, [&](const PairPlan& p, int x) {
    return (trainer_side ? p.engine : p.trainer) < x;
  });
  if (it == pairs.end() || (trainer_side ? it->engine : it->trainer) != peer) return nullptr;
  return &*it;
}

std::vector<int> PlanView::peers() const {
  std::vector<int> out;
  out.reserve(pairs.size());
  for (const PairPlan& p : pairs) out.push_back(trainer_side ? p.engine : p.trainer);
  return out;
}

std::size_t PlanView::routes() const {
  std::size_t n = 0;
  for (const PairPlan& p : pairs) n += p.routes.size();
  return n;
}

std::size_t PlanView::heap_bytes() const {
  std::size_t n = pairs.capacity() * sizeof(PairPlan);
  for (const PairPlan& p : pairs)
    n += p.routes.capacity() * sizeof(Route) + p.round_bytes.capacity() * sizeof(std::int64_t);
  return n;
}

std::string PlanView::identity_hex() const { return fmt::format("{:016x}", identity); }

void for_each_slice(const PlanView& view, const PairPlan& pair,
                    const std::function<void(const Route&)>& f) {
  const std::vector<DType>& dtypes = *view.dtypes;
  for_each_slice(
      pair.routes,
      [&](const Route& r) { return static_cast<std::int64_t>(dtype_size(dtypes[r.hf_tensor])); },
      view.pair_budget, f);
}

namespace {

// One slice of a pair's routes: members [first, first + n) of routes[route], or (part) rows
// [row, row + rows) x cols [col, col + cols) of member `first` alone; in `round` at `offset`.
struct SliceRef {
  std::size_t route = 0;
  std::int32_t first = 0, n = 0;
  bool part = false;
  std::int64_t row = 0, rows = 0, col = 0, cols = 0;
  int round = 0;
  std::int64_t offset = 0, bytes = 0;
};

// The slicing rule (transfer_plan.h, "Rounds"): whole members while they fit the round, then the
// next round; a member larger than the budget by rows, a row larger than it by columns, each part
// in the current round if it fits, else in the next (alone when it exceeds the budget by itself:
// an element larger than the budget). f(SliceRef) for every slice, in order.
template <class F>
void slice_routes(const std::vector<Route>& routes,
                  const std::function<std::int64_t(const Route&)>& esize_of, std::int64_t budget,
                  F&& f) {
  int round = 0;
  std::int64_t used = 0;  // bytes of the current round's segment
  for (std::size_t i = 0; i < routes.size(); ++i) {
    const Route& r = routes[i];
    const std::int64_t esize = esize_of(r);
    const std::int64_t m = r.member_numel() * esize;
    if (m <= 0) continue;
    if (m <= budget) {
      const std::int64_t whole_round = budget / m;  // members that fit an empty segment
      for (std::int32_t j = 0; j < r.count;) {
        const std::int64_t off = align_up(used, esize);
        const std::int64_t fit = off >= budget || budget - off < m ? 0
                                 : off == 0                        ? whole_round
                                                                   : (budget - off) / m;
        if (fit == 0) {
          ++round;
          used = 0;
          continue;
        }
        const auto k = static_cast<std::int32_t>(std::min<std::int64_t>(fit, r.count - j));
        f(SliceRef{.route = i,
                   .first = j,
                   .n = k,
                   .rows = r.rows,
                   .cols = r.cols,
                   .round = round,
                   .offset = off,
                   .bytes = k * m});
        used = off + k * m;
        j += k;
      }
      continue;
    }
    auto place = [&](SliceRef s) {
      std::int64_t off = align_up(used, esize);
      if (used > 0 && off + s.bytes > budget) {
        ++round;
        off = 0;
      }
      s.round = round;
      s.offset = off;
      used = off + s.bytes;
      f(s);
    };
    const std::int64_t max_elems = std::max<std::int64_t>(1, budget / esize);
    for (std::int32_t j = 0; j < r.count; ++j) {
      if (r.cols <= max_elems) {
        const std::int64_t rows_per = max_elems / r.cols;
        for (std::int64_t row = 0; row < r.rows; row += rows_per) {
          const std::int64_t rows = std::min(rows_per, r.rows - row);
          place(SliceRef{.route = i,
                         .first = j,
                         .n = 1,
                         .part = true,
                         .row = row,
                         .rows = rows,
                         .cols = r.cols,
                         .bytes = rows * r.cols * esize});
        }
        continue;
      }
      for (std::int64_t row = 0; row < r.rows; ++row)
        for (std::int64_t c = 0; c < r.cols; c += max_elems) {
          const std::int64_t cols = std::min(max_elems, r.cols - c);
          place(SliceRef{.route = i,
                         .first = j,
                         .n = 1,
                         .part = true,
                         .row = row,
                         .rows = 1,
                         .col = c,
                         .cols = cols,
                         .bytes = cols * esize});
        }
    }
  }
}

}  // namespace

void for_each_slice(const std::vector<Route>& routes,
                    const std::function<std::int64_t(const Route&)>& esize_of, std::int64_t budget,
                    const std::function<void(const Route&)>& f) {
  slice_routes(routes, esize_of, budget, [&](const SliceRef& s) {
    Route p = routes[s.route].members(s.first, s.n);
    if (s.part) {
      p.rows = s.rows;
      p.cols = s.cols;
      p.trainer_row += s.row;
      p.engine_row += s.row;
      p.hf_row += s.row;
      p.trainer_col += s.col;
      p.engine_col += s.col;
      p.hf_col += s.col;
    }
    p.round = s.round;
    p.segment_offset = s.offset;
    f(p);
  });
}

void place_routes(std::vector<Route>& routes,
                  const std::function<std::int64_t(const Route&)>& esize_of, std::int64_t budget,
                  std::vector<std::int64_t>& round_bytes, std::int64_t& bytes) {
  round_bytes.clear();
  bytes = 0;
  std::size_t placed = routes.size();  // the last route whose first slice was seen
  // Inlined: a pair of a large plan has thousands of rounds, each a slice or more.
  slice_routes(
      routes, esize_of, budget, [&](const SliceRef& s) __attribute__((always_inline)) {
        if (s.route != placed) {
          placed = s.route;
          routes[s.route].round = s.round;
          routes[s.route].segment_offset = s.offset;
        }
        if (static_cast<std::size_t>(s.round) == round_bytes.size())  // rounds follow one another
          round_bytes.push_back(0);
        else if (static_cast<std::size_t>(s.round) > round_bytes.size())
          round_bytes.resize(static_cast<std::size_t>(s.round) + 1, 0);
        round_bytes[static_cast<std::size_t>(s.round)] = s.offset + s.bytes;
        bytes += s.bytes;
      });
}

Result<std::shared_ptr<PlanInputs>> PlanInputs::create(const Config& config,
                                                       const ModelSpec& model) {
  std::shared_ptr<PlanInputs> in(new PlanInputs());
  in->config_ = config;
  in->model_ = &model;
  REFIT_ASSIGN_OR_RETURN(WireModel wire, wire_model(config, model));
  in->wire_ = std::make_unique<const WireModel>(std::move(wire));
  REFIT_ASSIGN_OR_RETURN(in->index_, TrainerIndex::create(config, model, *in->wire_));
  in->dtypes_ = std::make_shared<const std::vector<DType>>(in->wire_->dtype);
  in->groups_ = make_groups(*in->wire_);
  in->copies_.resize(in->wire_->spec.tensors().size());
  for (std::uint32_t t = 0; t < in->copies_.size(); ++t) in->copies_[t] = in->index_->has_copies(t);
  in->trainer_steps_.resize(in->groups_.size());
  for (std::size_t g = 0; g < in->groups_.size(); ++g) {
    const TensorGroup& G = in->groups_[g];
    auto& steps = in->trainer_steps_[g];
    for (std::int32_t j = 0; j + 1 < G.count; ++j)
      steps.push_back(in->index_->step(G.member(j), G.member(j + 1)));
  }
  in->engines_.resize(static_cast<std::size_t>(std::max(config.generation.tp_size, 0)));
  const std::int64_t fan = std::max(config.policy.world_size, config.engine_ranks());
  std::int64_t b =
      std::max<std::int64_t>(1, config.refit.buffer_size_bytes / std::max<std::int64_t>(fan, 1));
  if (b >= kSegmentAlignment) b = b / kSegmentAlignment * kSegmentAlignment;
  in->pair_budget_ = b;

  Hasher h;
  h.add(kPlanAlgorithmVersion);
  const auto& ts = in->wire_->spec.tensors();
  h.add(static_cast<std::int64_t>(ts.size()));
  for (std::size_t t = 0; t < ts.size(); ++t) {
    h.add(ts[t].name);
    h.add(static_cast<std::int64_t>(ts[t].shape.size()));
    for (std::int64_t d : ts[t].shape) h.add(d);
    h.add(static_cast<std::int64_t>(in->wire_->dtype[t]));
  }
  const auto& p = config.policy;
  for (std::int64_t v :
       {std::int64_t{static_cast<int>(p.backend)}, std::int64_t{p.world_size},
        std::int64_t{p.megatron.tp}, std::int64_t{p.megatron.pp}, std::int64_t{p.megatron.ep}})
    h.add(v);
  const auto& gen = config.generation;
  for (std::int64_t v :
       {std::int64_t{gen.num_engines}, std::int64_t{gen.tp_size},
        std::int64_t{static_cast<int>(gen.layout)}, std::int64_t{static_cast<int>(gen.backend)},
        config.refit.buffer_size_bytes, in->pair_budget_})
    h.add(v);
  in->identity_ = h.h;
  return in;
}

Status PlanInputs::prepare_engine(int k) {
  if (k < 0 || k >= tp_size())
    return Status::Internal(fmt::format("plan: engine tp rank {} outside [0, {})", k, tp_size()));
  EngineSide& side = engines_[static_cast<std::size_t>(k)];
  if (side.ready) return Status::Ok();
  REFIT_ASSIGN_OR_RETURN(side.layout, engine_wire_layout(config_, *model_, *wire_, k));
  side.runs.assign(groups_.size(), {});
  std::vector<EngineStep> steps, next;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const TensorGroup& G = groups_[g];
    const auto& ts = trainer_steps_[g];
    auto& runs = side.runs[g];
    for (std::int32_t j = 0; j < G.count;) {
      GroupRun run{.begin = j, .end = j + 1};
      if (j + 1 < G.count && ts[static_cast<std::size_t>(j)] &&
          engine_steps(side.layout, G.member(j), G.member(j + 1), steps)) {
        run.trainer = *ts[static_cast<std::size_t>(j)];
        run.engine = steps;
        run.end = j + 2;
        while (run.end < G.count) {
          const auto& t = ts[static_cast<std::size_t>(run.end - 1)];
          if (!t || *t != run.trainer ||
              !engine_steps(side.layout, G.member(run.end - 1), G.member(run.end), next) ||
              next != run.engine)
            break;
          ++run.end;
        }
      }
      j = run.end;
      runs.push_back(std::move(run));
    }
  }
  side.ready = true;
  return Status::Ok();
}

bool PlanInputs::has_engine(int k) const {
  return k >= 0 && k < tp_size() && engines_[static_cast<std::size_t>(k)].ready;
}

const EngineShardLayout& PlanInputs::engine(int k) const {
  return engines_[static_cast<std::size_t>(k)].layout;
}

const std::vector<GroupRun>& PlanInputs::runs(std::size_t group, int k) const {
  return engines_[static_cast<std::size_t>(k)].runs[group];
}

Result<PlanView> trainer_view(PlanInputs& in, int rank) {
  if (rank < 0 || rank >= in.trainer_ranks())
    return Status::InvalidArgument(
        fmt::format("trainer rank {} is outside policy.world_size {}", rank, in.trainer_ranks()));
  const int tp = in.tp_size();
  for (int k = 0; k < tp; ++k) REFIT_RETURN_IF_ERROR(in.prepare_engine(k));
  PlanView view = empty_view(in, true, rank);
  const TrainerIndex& index = in.trainers();
  const int replicas = in.config().generation.num_engines;
  std::vector<std::vector<Route>> by_engine(static_cast<std::size_t>(in.engine_ranks()));
  std::vector<Holder> own, copies;
  Route route;
  for (std::size_t gi = 0; gi < in.groups().size(); ++gi) {
    const TensorGroup& G = in.groups()[gi];
    for (int k = 0; k < tp; ++k) {
      const EngineShardLayout& eng = in.engine(k);
      for (const GroupRun& run : in.runs(gi, k)) {
        const std::uint32_t t = G.member(run.begin);
        const auto& keep = eng.pieces_by_hf[t];
        if (keep.empty()) continue;
        own.clear();
        index.pieces_of(rank, t, own);
        const bool copies_of_t = in.has_copies(t);
        for (const Holder& h : own) {
          // This piece's place among the copies of its block, in rank order (a tensor without
          // copies: each block's one holder).
          std::size_t n = 1, mine = 0;
          if (copies_of_t) {
            copies.clear();
            index.holders(t, Box::of(h.rect), copies);
            n = 0;
            for (const Holder& c : copies) {
              if (!same_block(c.rect, h.rect)) continue;
              if (c.rank == h.rank && c.local == h.local && c.piece == h.piece) mine = n;
              ++n;
            }
          }
          for (int e = 0; e < replicas; ++e) {
            if (n == 0 || static_cast<std::size_t>(e + k) % n != mine) continue;
            const int g = e * tp + k;
            for (std::size_t i = 0; i < keep.size(); ++i) {
              const auto [param, piece] = keep[i];
              if (make_route(h, g, param, eng.params[param].pieces[piece], G, run, i, route))
                by_engine[static_cast<std::size_t>(g)].push_back(route);
            }
          }
        }
      }
    }
  }
  finish_view(view, by_engine);
  return view;
}

Result<PlanView> engine_view(PlanInputs& in, int engine_rank) {
  if (engine_rank < 0 || engine_rank >= in.engine_ranks())
    return Status::InvalidArgument(
        fmt::format("engine rank {} is outside generation.num_engines x tp_size = {}", engine_rank,
                    in.engine_ranks()));
  const int tp = in.tp_size(), k = engine_rank % tp, e = engine_rank / tp;
  REFIT_RETURN_IF_ERROR(in.prepare_engine(k));
  PlanView view = empty_view(in, false, engine_rank);
  const TrainerIndex& index = in.trainers();
  const EngineShardLayout& eng = in.engine(k);
  std::vector<std::vector<Route>> by_trainer(static_cast<std::size_t>(in.trainer_ranks()));
  std::vector<Holder> holders;
  Route route;
  for (std::size_t gi = 0; gi < in.groups().size(); ++gi) {
    const TensorGroup& G = in.groups()[gi];
    for (const GroupRun& run : in.runs(gi, k)) {
      const std::uint32_t t = G.member(run.begin);
      const auto& keep = eng.pieces_by_hf[t];
      for (std::size_t i = 0; i < keep.size(); ++i) {
        const auto [param, piece] = keep[i];
        const Piece& q = eng.params[param].pieces[piece];
        holders.clear();
        index.holders(t, Box::of(q), holders);
        // Each block's copies lie together, in rank order: this replica and TP rank read one.
        for (std::size_t a = 0; a < holders.size();) {
          std::size_t b = a + 1;
          while (b < holders.size() && same_block(holders[b].rect, holders[a].rect)) ++b;
          const Holder& from = holders[a + static_cast<std::size_t>(e + k) % (b - a)];
          if (make_route(from, engine_rank, param, q, G, run, i, route))
            by_trainer[static_cast<std::size_t>(from.rank)].push_back(route);
          a = b;
        }
      }
    }
  }
  finish_view(view, by_trainer);
  return view;
}

Status for_each_trainer_view(PlanInputs& in, const std::function<Status(const PlanView&)>& f) {
  for (int r = 0; r < in.trainer_ranks(); ++r) {
    REFIT_ASSIGN_OR_RETURN(const PlanView view, trainer_view(in, r));
    REFIT_RETURN_IF_ERROR(f(view));
  }
  return Status::Ok();
}

Result<int> plan_rounds(PlanInputs& in) {
  int rounds = 0;
  REFIT_RETURN_IF_ERROR(for_each_trainer_view(in, [&](const PlanView& v) {
    rounds = std::max(rounds, v.rounds);
    return Status::Ok();
  }));
  return rounds;
}

}  // namespace refit
