// The engine side of executor gather (executor.h): every bucket of the bucket plan arrives whole
// from one feeder — trainer rank 0 over the update group's broadcast, or the colocated trainer
// rank through its exported slots (ipc) — and is applied on the apply thread while the next one
// arrives. vLLM: the bucket's entries come from the plan both sides derived at setup; SGLang: from
// the metadata that travels with the bucket (executor/bucket_meta.h).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine_layout.h"
#include "executor/applier.h"
#include "executor/executor.h"
#include "plan/gather_schedule.h"
#include "transport/transport.h"
#include "weights/setup.h"

namespace refit {

class Store;

struct GatherReceiverOptions {
  const Config* config = nullptr;
  int engine_rank = 0;
  std::string who;  // "engine I tp rank T", for errors
  const RankModel* model = nullptr;
  const EngineShardLayout* layout = nullptr;  // this rank's TP shard
  GatherLinks rank_links;                     // the rank's control plane, data plane and groups
};

class GatherReceiver final : public EngineExecutor {
 public:
  static Result<std::unique_ptr<GatherReceiver>> create(const GatherReceiverOptions& options);

  const std::vector<RankId>& feeders() const override { return feeders_; }
  bool pause_handshake() const override { return false; }
  std::string plan_hash() const override { return o_.model->plan.hash_hex(); }
  Status receive(const BeginMessage& begin, const std::vector<void*>& params) override;
  void invalidate() override {
    plan_runs_.clear();
    sglang_runs_.clear();
  }
  RankTraffic traffic() const override {
    return RankTraffic{.role = "engine",
                       .rank = o_.engine_rank,
                       .bytes_received = o_.model->plan.payload_bytes,
                       .setup_seconds = setup_seconds_};
  }
  double apply_seconds() const override { return apply_seconds_; }
  void abort() override;

 private:
  explicit GatherReceiver(const GatherReceiverOptions& o) : o_(o) {}
  Status setup();
  bool vllm() const { return o_.config->generation.backend == EngineProtocol::kVllm; }
  // Apply runs as copies into the registered parameters (the source is the slot, per call).
  std::vector<CopyRun> copy_runs(const std::vector<ApplyRun>& runs,
                                 const std::vector<void*>& params) const;
  Status apply(const IncomingBucket& in, bool raw, const std::vector<void*>& params);

  GatherReceiverOptions o_;
  std::vector<RankId> feeders_;
  std::unique_ptr<Communicator> update_;  // broadcast
  std::unique_ptr<BucketReceiver> receiver_;
  std::vector<std::vector<CopyRun>> plan_runs_;  // vLLM: per bucket of the manifest
  std::map<int, std::pair<std::string, std::vector<CopyRun>>> sglang_runs_;  // bucket: meta, runs
  std::unique_ptr<PlaneBuffer> scratch_;  // raw passes over ipc: the bare copy's destination
  std::mutex apply_mu_;
  double apply_seconds_ = 0;
  int applied_ = 0;
  Applier applier_;
};

}  // namespace refit
