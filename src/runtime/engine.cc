// refit::Engine: one engine rank. It sets the rank up — its core (runtime/rank_core.h), its
// weights (runtime/engine_weights.h), the executor that writes each refit into them
// (executor/executor.h) — and serves refits through its protocol (runtime/engine_protocol.h).
// The weight version moves only when the whole refit arrived.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>

#include "common/log.h"
#include "control/messages.h"
#include "engine/engine_layout.h"
#include "executor/gather_receiver.h"
#include "executor/route_receiver.h"
#include "executor/routes.h"
#include "refit/session.h"
#include "runtime/agreement.h"
#include "runtime/create.h"
#include "runtime/engine_protocol.h"
#include "runtime/engine_weights.h"
#include "runtime/rank_core.h"
#include "weights/setup.h"

namespace refit {
namespace {

class EngineImpl final : public Engine {
 public:
  EngineImpl(const Config& cfg, RankId self, const Endpoint& ep, RankServices services)
      : core_(cfg, self, ep, std::move(services)) {}
  // create_engine: the model and its layout, the shared core, the weights, the agreement with
  // trainer rank 0, the executor, and the hello its feeders wait for.
  Status init() {
    return core_.set_up([this] { return setup(); });
  }
  ~EngineImpl() override { core_.stop_watching(); }  // before the executor goes

  const std::vector<TensorSlot>& params() const override { return weights_->params().slots(); }
  Status register_param(const std::string& name, void* data, DType dtype,
                        const std::vector<std::int64_t>& shape) override {
    if (Status st = weights_->register_param(name, data, dtype, shape); !st.ok()) {
      core_.note_error(st);  // named by the peers should this process go before fixing it
      return st;
    }
    executor_->invalidate();  // copy lists hold the registered addresses
    return Status::Ok();
  }
  Result<std::vector<void*>> allocate_params() override {
    std::vector<void*> out;
    Status st = core_.guarded([&]() -> Status {
      REFIT_ASSIGN_OR_RETURN(out, weights_->allocate(core_.run_id()));
      executor_->invalidate();
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }
  void on_pause(std::function<Status()> hook) override { weights_->hooks().pause = std::move(hook); }
  void on_resume(std::function<void()> hook) override {
    weights_->hooks().resume = std::move(hook);
  }
  void on_verify(std::function<Status(int, const std::string&)> hook) override {
    weights_->hooks().verify = std::move(hook);
  }
  void on_load_weights(std::function<Status(const std::vector<ParamView>&)> hook) override {
    weights_->loader().set_hook(std::move(hook));
  }
  void on_weights_changed(std::function<Status(const std::vector<std::string>&)> hook) override {
    weights_->hooks().weights_changed = std::move(hook);
  }
  std::string weight_version() const override { return weights_->version().label(); }
  bool is_valid() const override { return weights_->version().valid(); }
  std::map<std::string, int> published() const override { return weights_->published(); }
  void note_published(const std::map<std::string, int>& published) override {
    weights_->note_published(published);
  }
  bool session_ok() const override { return core_.session_ok(); }
  Status fail(const Status& cause) override { return core_.fail(cause); }
  void note_error(const Status& error) override { core_.note_error(error); }
  const RefitStats& last_stats() const override { return protocol_->last_stats(); }

  // A refit whose bytes all landed but did not arrive intact or failed verification is a failed
  // refit, not a failed session: it is returned without going through the latch. So is one that
  // failed in flight with every rank alive, and one refused before any byte moved.
  Result<bool> serve_one() override { return serve_next(std::nullopt); }
  Result<bool> serve_one(std::chrono::milliseconds wait) override { return serve_next(wait); }

  Result<bool> serve_next(std::optional<std::chrono::milliseconds> wait) {
    EngineRefitProtocol::Served served;
    Status st = core_.guarded([&]() -> Status {
      REFIT_ASSIGN_OR_RETURN(served, protocol_->serve_one(wait, &stop_));
      return Status::Ok();
    });
    if (!st.ok()) {
      if (protocol_) protocol_->roll_back_at_the_end(st);
      return st;
    }
    if (!served.refit.ok()) return served.refit;
    // A refit committed: nothing of this rank's earlier errors is left to name.
    if (!served.shutdown && !served.stopped) core_.forget_noted_error();
    return !served.shutdown && !served.stopped;
  }

  // Any thread: the wait for the next refit sees it within EngineRefitProtocol::kStopPoll.
  void request_stop() override { stop_.store(true); }

  Status serve() override {
    while (true) {
      Result<bool> more = serve_one();
      if (!more.ok() && session_ok()) continue;  // a failed refit: serve the next one
      if (!more.ok()) return more.status();
      if (!*more) return Status::Ok();
    }
  }

 private:
  Status setup() {
    const Config& cfg = core_.config();
    const int rank = core_.self().rank;
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg));
    // What this rank stores, each parameter in its own dtype (with fp8: fp8 weights, their
    // float32 scales, bf16 for the rest; spec/fp8.h).
    REFIT_ASSIGN_OR_RETURN(const WireModel wire, wire_model(cfg, model_->spec));
    REFIT_ASSIGN_OR_RETURN(layout_,
                           engine_wire_layout(cfg, model_->spec, wire, core_.self().tp_rank()));
    std::vector<TensorSlot> slots;
    for (const EngineParam& p : layout_.params)
      slots.push_back(TensorSlot{p.name, p.shape, p.dtype});
    REFIT_RETURN_IF_ERROR(core_.connect());
    weights_ = std::make_unique<EngineWeights>(cfg, core_.self(), core_.plane(),
                                               Registry(std::move(slots), core_.id()));
    // Agree with trainer rank 0 before joining any group: a rank launched with another config (or
    // another refit) fails here naming the key, not in a group of the wrong size.
    REFIT_ASSIGN_OR_RETURN(std::string stamp, get_while_alive(core_.store(), "version/trainer/0",
                                                              core_.timeout(), core_.alive()));
    REFIT_RETURN_IF_ERROR(check_peer_versions(stamp, "trainer rank 0", core_.id()));
    REFIT_ASSIGN_OR_RETURN(auto trainer_settings, decode_stamp_settings(stamp, "trainer rank 0"));
    REFIT_RETURN_IF_ERROR(check_agreed_settings(agreed_settings(cfg, model_->spec),
                                                trainer_settings, "trainer rank 0", core_.id()));
    REFIT_RETURN_IF_ERROR(core_.executor_kind().transfer_plan ? setup_routes() : setup_gather());
    core_.adopt(*executor_);
    protocol_ = std::make_unique<EngineRefitProtocol>(core_, *executor_, *weights_);
    // Announce ourselves (with the vLLM manifest hash): the trainer's setup waits for this.
    return protocol_->announce(HelloMessage{.engine_rank = rank,
                                            .plan_hash = executor_->plan_hash(),
                                            .total_parameters = model_->spec.total_parameters(),
                                            .settings = agreed_settings(cfg, model_->spec)});
  }

  // Gather: the whole buckets the trainer ranks deliver.
  Status setup_gather() {
    REFIT_ASSIGN_OR_RETURN(executor_, GatherReceiver::create(GatherReceiverOptions{
                                          .config = &core_.config(),
                                          .engine_rank = core_.self().rank,
                                          .who = core_.id(),
                                          .model = model_.get(),
                                          .layout = &layout_,
                                          .rank_links = core_.gather_links()}));
    return Status::Ok();
  }

  // The transfer plan: the trainer ranks that feed this rank, where they run, and the
  // point-to-point group.
  Status setup_routes() {
    RouteReceiverOptions o;
    o.config = &core_.config();
    o.engine_rank = core_.self().rank;
    o.who = core_.id();
    REFIT_ASSIGN_OR_RETURN(RouteSetup s,
                           make_engine_route_setup(*o.config, model_->spec, o.engine_rank));
    routes_ = std::make_unique<RouteSetup>(std::move(s));
    log::debug(
        "{}: transfer plan view: {} routes from {} trainer rank(s) in {} round(s), {} bytes held, "
        "derived in {:.3f} s",
        o.who, routes_->view.routes(), routes_->view.pairs.size(), routes_->view.rounds,
        routes_->view.heap_bytes(), routes_->seconds);
    o.setup = routes_.get();
    o.plane = &core_.plane();
    o.sources = control_sources(*routes_);
    std::vector<RankId> feeders;
    for (int r : o.sources) feeders.push_back(RankId::trainer(r));
    REFIT_ASSIGN_OR_RETURN(o.source_same_host, core_.same_host(feeders));
    std::vector<RankId> byte_peers;
    for (int r : routes_->view.peers()) byte_peers.push_back(RankId::trainer(r));
    REFIT_ASSIGN_OR_RETURN(o.p2p, core_.join_p2p(byte_peers));
    o.incoming = incoming_from_view(routes_->view);
    REFIT_ASSIGN_OR_RETURN(executor_, RouteReceiver::create(o));
    return Status::Ok();
  }

  RankCore core_;
  std::unique_ptr<RankModel> model_;
  EngineShardLayout layout_;
  std::unique_ptr<EngineWeights> weights_;  // on core_'s plane
  std::unique_ptr<RouteSetup> routes_;  // the transfer plan (before the executor that uses it)
  std::unique_ptr<EngineExecutor> executor_;
  std::unique_ptr<EngineRefitProtocol> protocol_;
  std::atomic<bool> stop_{false};  // request_stop(), until a wait for the next refit saw it
};

}  // namespace

Result<std::unique_ptr<Engine>> create_engine(const Config& config, int engine_rank,
                                              const Endpoint& endpoint, RankServices services) {
  return set_up_rank<Engine, EngineImpl>(config,
                                         RankId::engine(engine_rank, config.generation.tp_size),
                                         endpoint, std::move(services));
}

Result<std::unique_ptr<Engine>> Engine::create(const Config& config, int engine_rank,
                                               const Endpoint& endpoint) {
  REFIT_ASSIGN_OR_RETURN(RankServices services, services_from_environment());
  return create_engine(config, engine_rank, endpoint, std::move(services));
}

}  // namespace refit
