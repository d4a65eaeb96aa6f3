// The trainer side of executor gather (executor.h): for every bucket of the bucket plan, each
// trainer rank casts its owned blocks, the trainer group all-gathers them, and the feeding rank(s)
// scatter the contributions into a transport slot that delivers the whole bucket — trainer rank 0
// broadcasting to every engine rank (broadcast), or each trainer rank to its colocated engine rank
// (ipc). Every rank takes part in every bucket's collective, owning something of it or not.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "executor/executor.h"
#include "plan/gather_schedule.h"
#include "transport/transport.h"
#include "weights/setup.h"

namespace refit {

class Store;

struct GatherSenderOptions {
  const Config* config = nullptr;
  int rank = 0;
  const RankModel* model = nullptr;
  Communicator* trainer_group = nullptr;  // null with one trainer rank
  GatherLinks rank_links;                 // the rank's control plane, data plane and groups
};

class GatherSender final : public TrainerExecutor {
 public:
  static Result<std::unique_ptr<GatherSender>> create(const GatherSenderOptions& options);

  const std::vector<RankId>& targets() const override { return fed_; }
  const std::vector<RankId>& answers_from() const override {
    static const std::vector<RankId> none;
    return none;
  }
  std::string plan_hash() const override { return o_.model->plan.hash_hex(); }
  int rounds() const override { return static_cast<int>(o_.model->plan.buckets.size()); }
  void targets_attached() override;
  void prepare_begin(std::size_t i, BeginMessage& begin) const override;
  Status send(const BeginMessage& begin, const std::vector<void*>& shards,
              TransferTimes& times) override;
  void invalidate() override { bucket_runs_.clear(); }
  RankTraffic traffic() const override {
    RankTraffic t = traffic_;
    t.setup_seconds = setup_seconds_;
    return t;
  }
  void abort() override;

 private:
  explicit GatherSender(const GatherSenderOptions& o) : o_(o) {}
  Status setup();
  bool feeds() const { return !fed_.empty(); }

  // The copy lists of bucket b, built on first use (storage is registered by then and never
  // moves): pack (this rank's shards → the bucket, or its send buffer, with the cast) and scatter
  // (everyone's gathered contributions → the bucket). `dst` is the bucket's transport slot (fixed
  // per bucket: slot = bucket % num_buffers), null when this rank does not feed engines.
  struct BucketRuns {
    bool built = false;
    std::vector<CopyRun> pack, scatter;
  };
  const BucketRuns& runs_of(std::size_t b, const std::vector<void*>& shards, std::byte* dst);
  // Unshards bucket b; when `dst` is set, the full bucket lands there.
  Status unshard(std::size_t b, const std::vector<void*>& shards, std::byte* dst,
                 TransferTimes& times);

  GatherSenderOptions o_;
  std::vector<BucketGather> gather_;
  std::vector<RankId> fed_;
  std::unique_ptr<Communicator> update_;  // broadcast: trainer rank 0 and every engine rank
  std::unique_ptr<BucketSender> sender_;
  std::unique_ptr<PlaneBuffer> send_, stage_;  // unshard: this rank's part, everyone's parts
  std::vector<BucketRuns> bucket_runs_;
  RankTraffic traffic_;
  bool progress_ = false;
};

}  // namespace refit
