#include "plan/transfer_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "common/piece.h"

namespace refit {
namespace {

struct Hasher {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  void add(std::int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<std::uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
};

// The rectangle both pieces read from the same HF tensor, or nothing.
void intersect(const Piece& own, const Piece& keep, int trainer, std::uint32_t trainer_tensor,
               int engine, std::uint32_t engine_param, std::vector<Route>& out) {
  const std::int64_t r0 = std::max(own.src_row, keep.src_row);
  const std::int64_t r1 = std::min(own.src_row + own.rows, keep.src_row + keep.rows);
  const std::int64_t c0 = std::max(own.src_col, keep.src_col);
  const std::int64_t c1 = std::min(own.src_col + own.cols, keep.src_col + keep.cols);
  if (r0 >= r1 || c0 >= c1) return;
  out.push_back(Route{
      .trainer = trainer,
      .engine = engine,
      .hf_tensor = own.hf_tensor,
      .trainer_tensor = trainer_tensor,
      .engine_param = engine_param,
      .rows = r1 - r0,
      .cols = c1 - c0,
      .trainer_row = own.dst_row + (r0 - own.src_row),
      .trainer_col = own.dst_col + (c0 - own.src_col),
      .engine_row = keep.dst_row + (r0 - keep.src_row),
      .engine_col = keep.dst_col + (c0 - keep.src_col),
      .hf_row = r0,
      .hf_col = c0,
  });
}

// Splits a route into pieces of at most `max_elems` elements: by rows, and a row longer than
// that by columns.
void split_route(const Route& r, std::int64_t max_elems, std::vector<Route>& out) {
  if (r.numel() <= max_elems) {
    out.push_back(r);
    return;
  }
  if (r.cols > max_elems) {
    for (std::int64_t row = 0; row < r.rows; ++row)
      for (std::int64_t c = 0; c < r.cols; c += max_elems) {
        Route p = r;
        p.rows = 1;
        p.cols = std::min(max_elems, r.cols - c);
        p.trainer_row += row;
        p.engine_row += row;
        p.hf_row += row;
        p.trainer_col += c;
        p.engine_col += c;
        p.hf_col += c;
        out.push_back(p);
      }
    return;
  }
  const std::int64_t rows_per = max_elems / r.cols;
  for (std::int64_t row = 0; row < r.rows; row += rows_per) {
    Route p = r;
    p.rows = std::min(rows_per, r.rows - row);
    p.trainer_row += row;
    p.engine_row += row;
    p.hf_row += row;
    out.push_back(p);
  }
}

}  // namespace

std::string TransferPlan::hash_hex() const { return fmt::format("{:016x}", hash); }

std::int64_t TransferPlan::pair_bytes(int trainer, int engine) const {
  return pair_bytes_[static_cast<std::size_t>(trainer) * static_cast<std::size_t>(engine_ranks) +
                     static_cast<std::size_t>(engine)];
}

std::vector<int> TransferPlan::sources_of(int engine) const {
  std::vector<int> out;
  for (int r = 0; r < trainer_ranks; ++r)
    if (pair_bytes(r, engine) > 0) out.push_back(r);
  return out;
}

std::vector<int> TransferPlan::targets_of(int trainer) const {
  std::vector<int> out;
  for (int g = 0; g < engine_ranks; ++g)
    if (pair_bytes(trainer, g) > 0) out.push_back(g);
  return out;
}

TransferPlan make_transfer_plan(const ModelSpec& spec,
                                const std::vector<TrainerShardLayout>& trainers,
                                const std::vector<EngineShardLayout>& engines, int num_engines,
                                const std::vector<DType>& dtypes, std::int64_t buffer_bytes) {
  TransferPlan plan;
  plan.trainer_ranks = static_cast<int>(trainers.size());
  const int tp = static_cast<int>(engines.size());
  plan.engine_ranks = num_engines * tp;
  plan.tensor_dtype = dtypes;
  plan.buffer_bytes = buffer_bytes;
  auto esize_of = [&](std::uint32_t t) {
    return static_cast<std::int64_t>(dtype_size(dtypes[t]));
  };

  // Every rank that holds a copy of an owned piece (data-parallel replicas, TP-replicated norms,
  // a tied embedding's second copy): the same HF rectangle, wherever it sits locally. Engine
  // replica e's TP rank k reads piece copies from holder (e + k) mod holders, which spreads the
  // sending over the replicas instead of loading every byte on the owner.
  using Rect = std::tuple<std::uint32_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  struct Copy {
    int rank;
    std::uint32_t local, piece;
  };
  std::map<Rect, std::vector<Copy>> holders;
  for (int r = 0; r < plan.trainer_ranks; ++r) {
    const TrainerShardLayout& lay = trainers[static_cast<std::size_t>(r)];
    for (std::uint32_t l = 0; l < lay.tensors.size(); ++l)
      for (std::uint32_t p = 0; p < lay.tensors[l].pieces.size(); ++p) {
        const Piece& pc = lay.tensors[l].pieces[p];
        holders[Rect{pc.hf_tensor, pc.src_row, pc.src_col, pc.rows, pc.cols}].push_back(
            Copy{r, l, p});
      }
  }

  // Routes in model order: tensor by tensor, so rounds advance through the model.
  std::vector<Route> routes, whole;
  for (std::uint32_t t = 0; t < spec.tensors().size(); ++t)
    for (int r = 0; r < plan.trainer_ranks; ++r) {
      const TrainerShardLayout& lay = trainers[static_cast<std::size_t>(r)];
      for (const auto& [local, piece] : lay.owned_by_hf[t]) {
        const Piece& own = lay.tensors[local].pieces[piece];
        const std::vector<Copy>& copies =
            holders.at(Rect{own.hf_tensor, own.src_row, own.src_col, own.rows, own.cols});
        for (int e = 0; e < num_engines; ++e)
          for (int k = 0; k < tp; ++k) {
            const Copy& from = copies[static_cast<std::size_t>(e + k) % copies.size()];
            const Piece& src = trainers[static_cast<std::size_t>(from.rank)]
                                   .tensors[from.local]
                                   .pieces[from.piece];
            const EngineShardLayout& eng = engines[static_cast<std::size_t>(k)];
            for (const auto& [param, epiece] : eng.pieces_by_hf[t]) {
              whole.clear();
              intersect(src, eng.params[param].pieces[epiece], from.rank, from.local, e * tp + k,
                        param, whole);
              for (const Route& w : whole)
                split_route(w, std::max<std::int64_t>(1, buffer_bytes / esize_of(t)), routes);
            }
          }
      }
    }

  // Rounds: greedily, in model order, while no rank exceeds the buffer.
  std::vector<std::int64_t> send(trainers.size(), 0), recv(static_cast<std::size_t>(plan.engine_ranks), 0);
  int round = 0;
  for (Route& r : routes) {
    const std::int64_t b = plan.bytes_of(r);
    auto& s = send[static_cast<std::size_t>(r.trainer)];
    auto& v = recv[static_cast<std::size_t>(r.engine)];
    if (s + b > buffer_bytes || v + b > buffer_bytes) {
      ++round;
      std::fill(send.begin(), send.end(), 0);
      std::fill(recv.begin(), recv.end(), 0);
    }
    send[static_cast<std::size_t>(r.trainer)] += b;
    recv[static_cast<std::size_t>(r.engine)] += b;
    r.round = round;
  }
  plan.rounds = routes.empty() ? 0 : round + 1;
  std::stable_sort(routes.begin(), routes.end(), [](const Route& a, const Route& b) {
    return std::tie(a.round, a.trainer, a.engine) < std::tie(b.round, b.trainer, b.engine);
  });

  // Segments, offsets, per-rank totals and the hash.
  plan.segments.assign(static_cast<std::size_t>(plan.rounds), {});
  plan.trainer_bytes.assign(trainers.size(), 0);
  plan.engine_bytes.assign(static_cast<std::size_t>(plan.engine_ranks), 0);
  plan.pair_bytes_.assign(trainers.size() * static_cast<std::size_t>(plan.engine_ranks), 0);
  Hasher h;
  h.add(plan.trainer_ranks);
  h.add(plan.engine_ranks);
  h.add(buffer_bytes);
  for (std::size_t i = 0; i < routes.size(); ++i) {
    Route& r = routes[i];
    auto& segs = plan.segments[static_cast<std::size_t>(r.round)];
    if (segs.empty() || segs.back().trainer != r.trainer || segs.back().engine != r.engine)
      segs.push_back(Segment{.trainer = r.trainer, .engine = r.engine, .first_route = i});
    Segment& seg = segs.back();
    const std::int64_t esize = esize_of(r.hf_tensor), bytes = plan.bytes_of(r);
    r.segment_offset = (seg.bytes + esize - 1) / esize * esize;  // element-aligned
    seg.bytes = r.segment_offset + bytes;
    seg.num_routes++;
    plan.trainer_bytes[static_cast<std::size_t>(r.trainer)] += bytes;
    plan.engine_bytes[static_cast<std::size_t>(r.engine)] += bytes;
    plan.pair_bytes_[static_cast<std::size_t>(r.trainer) *
                         static_cast<std::size_t>(plan.engine_ranks) +
                     static_cast<std::size_t>(r.engine)] += bytes;
    for (std::int64_t v : {std::int64_t{r.trainer}, std::int64_t{r.engine},
                           std::int64_t{r.hf_tensor}, std::int64_t{r.trainer_tensor},
                           std::int64_t{r.engine_param}, r.rows, r.cols, r.trainer_row,
                           r.trainer_col, r.engine_row, r.engine_col, std::int64_t{r.round},
                           static_cast<std::int64_t>(dtypes[r.hf_tensor])})
      h.add(v);
  }
  // Staging sizes: a rank's segments of one round laid out back to back, each aligned.
  for (const auto& segs : plan.segments) {
    std::vector<std::int64_t> s(trainers.size(), 0), v(static_cast<std::size_t>(plan.engine_ranks), 0);
    for (const Segment& seg : segs) {
      s[static_cast<std::size_t>(seg.trainer)] += aligned_segment_bytes(seg.bytes);
      v[static_cast<std::size_t>(seg.engine)] += aligned_segment_bytes(seg.bytes);
    }
    for (auto x : s) plan.max_send_bytes = std::max(plan.max_send_bytes, x);
    for (auto x : v) plan.max_recv_bytes = std::max(plan.max_recv_bytes, x);
  }
  plan.routes = std::move(routes);
  plan.hash = h.h;
  return plan;
}

}  // namespace refit
