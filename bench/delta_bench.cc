// refit_delta_bench: delta refits of a config's transfer plan in one process, on its data plane
// (device: cpu or cuda), with the generated weights of `--update` (docs/delta.md, "Measured").
//
// Every trainer rank's shards and every engine rank's parameters live on this process's plane.
// Step 0 is a full refit (every route copied, cast fused) and the kept copies are captured. Then,
// per step, the shards take the weights of that step and every (trainer rank, engine rank) pair
//  - packs its routes into a staging segment (the plain cast a full p2p refit does: "cast"),
//  - encodes its delta stream (compare with the kept copy, update it, code: "encode"),
//  - applies the stream to the engine rank's parameters in place ("apply"),
//  - and, for comparison, scatters the staging segment into the parameters ("full apply").
// After each step every engine rank's parameters are verified bit-exact against the weights of
// the step, and each pair's digest against the engine's. Prints one line per step and a table:
// the changed fraction of the bf16 cast, the wire bytes against the full refit's, and the times.
//
// --staged (CPU plane): refit.staged's apply. The apply logs what it writes (its time includes
// the log), and the log is replayed onto a second copy of every engine rank's parameters, which
// held the same base ("replay": what generation pauses for), against the full apply (a copy of
// the same bytes, what a staging area's copy pauses for). The copy is verified byte for byte.
//
//   refit_delta_bench CONFIG [--update adam:LR] [--steps N] [--chunk-log2 K] [--no-verify]
//                            [--staged]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/stats.h"
#include "common/timer.h"
#include "delta/delta.h"
#include "delta/format.h"
#include "executor/delta_routes.h"
#include "executor/routes.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "weights/setup.h"

namespace refit {
namespace {

struct Args {
  std::string config;
  std::string update = "drift";
  int steps = 3;
  int chunk_log2 = 13;
  bool verify = true;
  bool entropy = false;  // step 1: the zero-order entropy of what changed, per element
  bool staged = false;   // replay each apply's log onto a second copy of the parameters
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "refit_delta_bench: %s\n", what.c_str());
  std::exit(2);
}

template <class T>
T check(Result<T> r, const char* what) {
  if (!r.ok()) die(fmt::format("{}: {}", what, r.status().to_string()));
  return std::move(r).value();
}
void check(const Status& s, const char* what) {
  if (!s.ok()) die(fmt::format("{}: {}", what, s.to_string()));
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(k + " needs a value");
      return argv[++i];
    };
    if (k == "--update") {
      a.update = value();
    } else if (k == "--steps") {
      a.steps = std::atoi(value().c_str());
    } else if (k == "--chunk-log2") {
      a.chunk_log2 = std::atoi(value().c_str());
    } else if (k == "--no-verify") {
      a.verify = false;
    } else if (k == "--entropy") {
      a.entropy = true;
    } else if (k == "--staged") {
      a.staged = true;
    } else if (!k.empty() && k[0] == '-') {
      die("unknown flag " + k);
    } else {
      a.config = k;
    }
  }
  if (a.config.empty())
    die("usage: refit_delta_bench CONFIG [--update adam:LR] [--steps N] [--chunk-log2 K] "
        "[--no-verify] [--staged]");
  if (a.steps < 1) die("--steps must be at least 1");
  return a;
}

struct Pair {
  int trainer = 0, engine = 0;
  PairDeltaRoutes trainer_side, engine_side;
  PairDeltaRoutes copy_side;  // --staged: engine_side into the second copy of the parameters
  DeltaLog log;               // --staged: what the last apply wrote
  // shards -> staging, staging -> params, shards -> params
  std::vector<CopyRun> pack, full_apply, peer;
  DType wire = DType::kBFloat16;
  std::unique_ptr<PlaneBuffer> kept, staging, stream;
  std::size_t capacity = 0;
  std::int64_t full_bytes = 0, elements = 0;
  std::uint64_t digest = 0;  // the base both sides hold
  DeltaOptions options;
};

int run(const Args& a) {
  const Config cfg = check(load_config_file(a.config), "config");
  if (cfg.refit.target_precision != DType::kBFloat16 &&
      cfg.refit.target_precision != DType::kFloat16)
    die("the bench measures 16-bit targets (fp8 weights are quantized, not cast: see "
        "docs/delta.md)");
  auto model = check(load_rank_model(cfg), "model");
  model->weights->set_update(check(parse_weight_update(a.update), "--update"));
  // Every rank's view of the plan, as each derives it at setup.
  const auto inputs = check(PlanInputs::create(cfg, model->spec), "transfer plan");
  std::vector<RouteSetup> trainer_setups, engine_setups;
  for (int t = 0; t < cfg.policy.world_size; ++t)
    trainer_setups.push_back(check(make_trainer_route_setup(inputs, t), "transfer plan"));
  for (int g = 0; g < cfg.engine_ranks(); ++g)
    engine_setups.push_back(check(make_engine_route_setup(inputs, g), "transfer plan"));
  const auto layout_of = [&](int g) -> const EngineShardLayout& {
    return engine_setups[static_cast<std::size_t>(g)].engine_layout(g);
  };
  auto plane = check(make_data_plane(cfg, 0), "data plane");
  const DType policy = cfg.policy.dtype;
  if (a.staged && cfg.device != Device::kCpu)
    die("--staged needs device: cpu (the CUDA plane does not log its applies)");
  // Storage: every trainer rank's shards, every engine rank's parameters.
  std::vector<std::vector<std::unique_ptr<PlaneBuffer>>> shard_mem(trainer_setups.size());
  std::vector<std::vector<void*>> shards(trainer_setups.size());
  std::vector<std::vector<PieceTarget>> shard_targets(trainer_setups.size());
  for (std::size_t t = 0; t < trainer_setups.size(); ++t)
    for (std::size_t l = 0; l < trainer_setups[t].user_tensors; ++l) {
      const LocalTensor& lt = trainer_setups[t].trainer.tensors[l];
      const auto bytes =
          static_cast<std::size_t>(matrix_shape(lt.shape).numel()) * dtype_size(policy);
      shard_mem[t].push_back(check(plane->allocate(std::max<std::size_t>(bytes, 1)), "shards"));
      shards[t].push_back(shard_mem[t].back()->data());
      shard_targets[t].push_back({&lt.pieces, lt.shape, shard_mem[t].back()->data()});
    }
  const int engine_ranks = cfg.engine_ranks();
  std::vector<std::vector<std::unique_ptr<PlaneBuffer>>> param_mem(
      static_cast<std::size_t>(engine_ranks));
  std::vector<std::vector<void*>> params(static_cast<std::size_t>(engine_ranks));
  std::vector<std::vector<PieceTarget>> param_targets(static_cast<std::size_t>(engine_ranks));
  // --staged: the second copy of every engine rank's parameters.
  std::vector<std::vector<std::unique_ptr<PlaneBuffer>>> copy_mem(
      static_cast<std::size_t>(engine_ranks));
  std::vector<std::vector<void*>> copies(static_cast<std::size_t>(engine_ranks));
  for (int g = 0; g < engine_ranks; ++g) {
    const EngineShardLayout& lay = layout_of(g);
    for (const EngineParam& p : lay.params) {
      if (a.staged) {
        copy_mem[static_cast<std::size_t>(g)].push_back(
            check(plane->allocate(std::max<std::int64_t>(p.bytes(), 1)), "parameters' copy"));
        copies[static_cast<std::size_t>(g)].push_back(
            copy_mem[static_cast<std::size_t>(g)].back()->data());
      }
      param_mem[static_cast<std::size_t>(g)].push_back(
          check(plane->allocate(std::max<std::int64_t>(p.bytes(), 1)), "parameters"));
      params[static_cast<std::size_t>(g)].push_back(
          param_mem[static_cast<std::size_t>(g)].back()->data());
      param_targets[static_cast<std::size_t>(g)].push_back(
          {&p.pieces, p.shape, param_mem[static_cast<std::size_t>(g)].back()->data()});
    }
  }
  // Pairs.
  std::vector<Pair> pairs;
  for (int t = 0; t < cfg.policy.world_size; ++t)
    for (const PairPlan& plan_pair : trainer_setups[static_cast<std::size_t>(t)].view.pairs) {
      const int g = plan_pair.engine;
      Pair p;
      p.trainer = t;
      p.engine = g;
      p.trainer_side = trainer_delta_routes(trainer_setups[static_cast<std::size_t>(t)], policy, t,
                                            g, DeltaSource::kShards,
                                            &shards[static_cast<std::size_t>(t)], nullptr, nullptr);
      const IncomingRoutes in = incoming_from_view(engine_setups[static_cast<std::size_t>(g)].view);
      p.engine_side = engine_delta_routes(in, layout_of(g), t, params[static_cast<std::size_t>(g)]);
      if (a.staged)
        p.copy_side = engine_delta_routes(in, layout_of(g), t, copies[static_cast<std::size_t>(g)]);
      const std::int64_t kept_bytes = assign_kept_offsets(p.trainer_side.routes);
      p.kept =
          check(plane->allocate(static_cast<std::size_t>(std::max<std::int64_t>(kept_bytes, 16))),
                "kept copy");
      p.full_bytes = delta_full_bytes(p.trainer_side.routes);
      p.staging =
          check(plane->allocate(static_cast<std::size_t>(std::max<std::int64_t>(p.full_bytes, 16))),
                "staging");
      p.capacity = delta_stream_capacity(p.trainer_side.routes);
      p.stream = check(plane->allocate(p.capacity), "stream");
      // The plain pack and the full apply, element for element the same routes.
      std::int64_t at = 0;
      for (std::size_t i = 0; i < p.trainer_side.routes.size(); ++i) {
        const DeltaRoute& tr = p.trainer_side.routes[i];
        const DeltaRoute& er = p.engine_side.routes[i];
        if (i > 0 && tr.wire_dtype != p.wire)
          die(
              fmt::format("pair {} -> {}: routes of several wire dtypes ({} and {}); the bench "
                          "moves one per pair",
                          t, g, dtype_name(p.wire), dtype_name(tr.wire_dtype)));
        p.wire = tr.wire_dtype;
        const std::int64_t n = tr.elements();
        p.pack.push_back(CopyRun{.src = tr.src,
                                 .dst = p.staging->data(),
                                 .block = {.src_offset = tr.block.src_offset,
                                           .src_stride = tr.block.src_stride,
                                           .dst_offset = at,
                                           .dst_stride = tr.block.cols,
                                           .rows = tr.block.rows,
                                           .cols = tr.block.cols}});
        p.full_apply.push_back(CopyRun{.src = p.staging->data(),
                                       .dst = er.dst,
                                       .block = {.src_offset = at,
                                                 .src_stride = tr.block.cols,
                                                 .dst_offset = er.block.dst_offset,
                                                 .dst_stride = er.block.dst_stride,
                                                 .rows = tr.block.rows,
                                                 .cols = tr.block.cols}});
        p.peer.push_back(CopyRun{.src = tr.src,
                                 .dst = er.dst,
                                 .block = {.src_offset = tr.block.src_offset,
                                           .src_stride = tr.block.src_stride,
                                           .dst_offset = er.block.dst_offset,
                                           .dst_stride = er.block.dst_stride,
                                           .rows = tr.block.rows,
                                           .cols = tr.block.cols}});
        at += n;
        p.elements += n;
        if (tr.tag != er.tag || tr.key != er.key || tr.elements() != er.elements())
          die(fmt::format("pair {} -> {}: the two sides' route {} differ", t, g, i));
      }
      p.options.chunk_log2 = a.chunk_log2;
      pairs.push_back(std::move(p));
    }
  for (Pair& p : pairs) p.options.describe = p.trainer_side.describe();
  auto verify = [&](int step) {
    if (!a.verify) return;
    for (int g = 0; g < engine_ranks; ++g) {
      auto bad = check(
          plane->diagnostics()->find_mismatch(*model, param_targets[static_cast<std::size_t>(g)],
                                              step, policy, cfg.refit.target_precision),
          "verify");
      if (bad)
        die(fmt::format("step {}: engine rank {} parameter {} element {} differs from the weights",
                        step, g, layout_of(g).params[bad->first].name, bad->second));
    }
    for (std::size_t g = 0; g < copies.size(); ++g)
      for (std::size_t i = 0; i < copies[g].size(); ++i)
        if (std::memcmp(
                copies[g][i], params[g][i],
                static_cast<std::size_t>(layout_of(static_cast<int>(g)).params[i].bytes())) != 0)
          die(fmt::format("step {}: engine rank {} parameter {}: the replayed copy differs", step,
                          g, layout_of(static_cast<int>(g)).params[i].name));
    for (Pair& p : pairs) {
      const std::uint64_t held = check(plane->delta_digest(p.engine_side.routes), "digest");
      if (held != p.digest)
        die(
            fmt::format("step {}: pair {} -> {}: the engine's digest {:016x} differs from the "
                        "trainer's {:016x}",
                        step, p.trainer, p.engine, held, p.digest));
    }
  };
  // Step 0: the full refit, captured.
  for (std::size_t t = 0; t < shards.size(); ++t)
    check(plane->diagnostics()->fill_weights(*model, shard_targets[t], 0, policy, policy),
          "weights");
  for (Pair& p : pairs) {
    check(plane->copy(p.peer, policy, p.wire), "full refit");
    p.digest =
        check(plane->delta_capture(p.trainer_side.routes, p.kept->data(), p.options), "capture")
            .digest_delta;
    // Warm the tables the timed steps use.
    check(plane->copy(p.pack, policy, p.wire), "pack");
    check(plane->copy(p.full_apply, p.wire, p.wire), "full apply");
  }
  for (std::size_t g = 0; g < copies.size(); ++g)  // --staged: the copy holds the base too
    for (std::size_t i = 0; i < copies[g].size(); ++i)
      std::memcpy(copies[g][i], params[g][i],
                  static_cast<std::size_t>(layout_of(static_cast<int>(g)).params[i].bytes()));
  verify(0);
  std::int64_t elements = 0, full = 0;
  for (const Pair& p : pairs) elements += p.elements, full += p.full_bytes;
  std::printf(
      "%s: %s, %s -> %s, %zu pairs, %lld elements, %.1f MB per full refit, update %s, chunks of "
      "2^%d\n",
      cfg.model.c_str(), std::string(device_name(cfg.device)).c_str(),
      std::string(dtype_name(policy)).c_str(),
      std::string(dtype_name(cfg.refit.target_precision)).c_str(), pairs.size(),
      static_cast<long long>(elements), static_cast<double>(full) / 1e6, a.update.c_str(),
      a.chunk_log2);
  std::printf("%4s %9s %11s %9s %9s %9s %7s %9s %9s %7s %9s%s\n", "step", "changed%", "wire_bytes",
              "wire/full", "pred/wire", "cast_ms", "enc_ms", "enc/cast", "apply_ms", "full_ms",
              "app/full", a.staged ? " replay_ms  rep/full" : "");
  std::vector<double> ratio_enc, ratio_app, ratio_rep;
  for (int step = 1; step <= a.steps; ++step) {
    for (std::size_t t = 0; t < shards.size(); ++t)
      check(plane->diagnostics()->fill_weights(*model, shard_targets[t], step, policy, policy),
            "weights");
    double cast_s = 0, enc_s = 0, app_s = 0, full_s = 0, rep_s = 0;
    std::int64_t changed = 0, wire = 0, predicted = 0;
    // The entropy the stream aims at: per pair, whether each element changed (a Bernoulli of the
    // pair's density) and, for those that did, the difference of their bits in ordered space.
    std::vector<std::vector<std::byte>> before;
    if (a.entropy && step == 1)
      for (Pair& p : pairs) {
        before.emplace_back(static_cast<std::size_t>(p.full_bytes + 16));
        check(plane->read(before.back().data(), p.kept->data(), before.back().size()), "kept copy");
      }
    for (Pair& p : pairs) {
      Timer tc;
      check(plane->copy(p.pack, policy, p.wire), "pack");
      cast_s += tc.seconds();
      Timer te;
      const DeltaResult e =
          check(plane->delta_encode(p.trainer_side.routes, p.kept->data(), p.stream->data(),
                                    p.capacity, p.digest, p.options),
                "encode");
      enc_s += te.seconds();
      DeltaOptions eo = p.options;
      eo.describe = p.engine_side.describe();
      if (a.staged) eo.log = &p.log;
      Timer ta;
      const DeltaResult r = check(
          plane->delta_apply(p.engine_side.routes, p.stream->data(), e.stream_bytes, p.digest, eo),
          "apply");
      app_s += ta.seconds();
      if (r.digest_delta != e.digest_delta || r.changed != e.changed)
        die(fmt::format("step {}: pair {} -> {}: apply and encode disagree", step, p.trainer,
                        p.engine));
      p.digest += e.digest_delta;
      if (a.staged) {
        DeltaOptions ro = p.options;
        ro.describe = p.copy_side.describe();
        Timer tr;
        check(plane->delta_replay(p.copy_side.routes, p.log, ro), "replay");
        rep_s += tr.seconds();
      }
      Timer tf;
      check(plane->copy(p.full_apply, p.wire, p.wire), "full apply");
      full_s += tf.seconds();
      changed += e.changed;
      wire += static_cast<std::int64_t>(e.stream_bytes);
      const double density = static_cast<double>(e.changed) /
                             static_cast<double>(std::max<std::int64_t>(p.elements, 1));
      predicted += predict_delta_bytes(p.elements, static_cast<int>(dtype_size(p.wire)),
                                       static_cast<std::int64_t>(p.trainer_side.routes.size()),
                                       density, 0.05, a.chunk_log2);
    }
    if (!before.empty()) {
      double bits = 0;
      std::int64_t all_changed = 0, exceptions = 0;
      for (std::size_t i = 0; i < pairs.size(); ++i) {
        Pair& p = pairs[i];
        std::vector<std::byte> after(before[i].size());
        check(plane->read(after.data(), p.kept->data(), after.size()), "kept copy");
        std::map<std::int64_t, std::int64_t> diffs;
        std::int64_t n_changed = 0;
        for (const DeltaRoute& r : p.trainer_side.routes) {
          const std::size_t es = dtype_size(r.wire_dtype);
          for (std::int64_t e = 0; e < r.elements(); ++e) {
            std::uint32_t o = 0, v = 0;
            std::memcpy(&o, before[i].data() + r.kept + e * static_cast<std::int64_t>(es), es);
            std::memcpy(&v, after.data() + r.kept + e * static_cast<std::int64_t>(es), es);
            if (o == v) continue;
            const std::int64_t d = delta_format::ordered_difference(o, v, static_cast<int>(8 * es));
            ++diffs[d];
            ++n_changed;
            exceptions += d > 1 || d < -1;
          }
        }
        all_changed += n_changed;
        const double q = static_cast<double>(n_changed) / static_cast<double>(p.elements);
        auto h = [](double x) {
          return x <= 0 || x >= 1 ? 0.0 : -x * std::log2(x) - (1 - x) * std::log2(1 - x);
        };
        bits += static_cast<double>(p.elements) * h(q);
        for (const auto& [d, c] : diffs)
          bits -= static_cast<double>(c) *
                  std::log2(static_cast<double>(c) / static_cast<double>(n_changed));
      }
      std::printf("step 1: zero-order entropy of the changes %.0f bytes (%.4f of the full refit); ",
                  bits / 8, bits / 8 / static_cast<double>(full));
      std::printf("the stream takes %.2fx that; %.1f %% of the changes moved more than one step\n",
                  static_cast<double>(wire) / (bits / 8),
                  100.0 * static_cast<double>(exceptions) /
                      static_cast<double>(std::max<std::int64_t>(all_changed, 1)));
    }
    verify(step);
    ratio_enc.push_back(enc_s / cast_s);
    ratio_app.push_back(app_s / full_s);
    ratio_rep.push_back(rep_s / full_s);
    std::printf("%4d %9.3f %11lld %9.4f %9.3f %9.2f %7.2f %9.2f %9.2f %7.2f %9.3f", step,
                100.0 * static_cast<double>(changed) / static_cast<double>(elements),
                static_cast<long long>(wire), static_cast<double>(wire) / static_cast<double>(full),
                static_cast<double>(predicted) / static_cast<double>(wire), cast_s * 1e3,
                enc_s * 1e3, enc_s / cast_s, app_s * 1e3, full_s * 1e3, app_s / full_s);
    if (a.staged) std::printf(" %9.2f %8.3f", rep_s * 1e3, rep_s / full_s);
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf("median encode/cast %.2f, apply/full %.3f%s%s\n", median(ratio_enc),
              median(ratio_app),
              a.staged ? fmt::format(", replay/full {:.3f}", median(ratio_rep)).c_str() : "",
              a.verify ? "; every engine element verified bit-exact after every step" : "");
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) { return refit::run(refit::parse(argc, argv)); }
