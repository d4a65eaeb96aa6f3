// Typed control messages of a refit: the payload of each message type of control/message_types.h.
//
// Each message is one struct with one encoder and one decoder. Payloads are JSON objects that
// carry the wire version `v`; decoding checks the version, every field's presence and type, and
// returns kCorruption naming the message, the sender and the field — never a silent default, and
// never an exception on the caller's thread. docs/protocol.md lists them with their phases.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/pair_sums.h"
#include "control/message_types.h"
#include "refit/status.h"
#include "refit/version.h"

namespace refit {

inline constexpr int kMessageWireVersion = REFIT_WIRE_VERSION;

// A failure as it travels between ranks and as the store records it (runtime/failure.h).
std::string encode_failure(const FailureOrigin& failure);
// `from` names the sender in errors.
Result<FailureOrigin> decode_failure(const std::string& payload, const std::string& from);

// engine -> each feeder, once at setup: the engine joined. Its `v` (wire version) and
// `refit_version` keep their names and meaning in every refit version, so a rank of another
// version is reported as such (check_peer_versions), never misparsed.
struct HelloMessage {
  std::string refit_version = version();  // the sender's refit (REFIT_VERSION_STRING)
  int engine_rank = 0;
  std::string plan_hash;              // the plan the engine derived (vLLM: must equal the trainer's)
  // Transfer plan: the digest of the routes of the pair this hello goes to, as the engine derived
  // them (the trainer rank compares its own).
  std::string routes_digest;
  std::int64_t total_parameters = 0;  // of the model the engine loaded
  // Every setting both sides must agree on, by config key (runtime/agreement.h).
  std::map<std::string, std::string> settings;
};

// The versions a rank announces: its hello, and (trainer ranks) the store key `version/<id>`,
// which also carries the trainer rank's agreed settings.
std::string encode_version_stamp(const std::string& refit_version,
                                 const std::map<std::string, std::string>& settings = {});
// The settings of a version stamp (after check_peer_versions passed on it).
Result<std::map<std::string, std::string>> decode_stamp_settings(const std::string& payload,
                                                                 const std::string& from);
// Compares the refit and wire versions in `payload` (a hello or a version stamp from `from`) with
// this build's; InvalidArgument naming both sides (`from` and `self`) when they differ.
Status check_peer_versions(const std::string& payload, const std::string& from,
                           const std::string& self);

// trainer -> engine, once at setup (SGLang protocol): every route the trainer rank will send
// this engine rank, in the engine's terms — the engine places bytes as this says.
struct RouteMetadata {
  int round = 0;
  std::string param;  // engine parameter name
  std::int64_t row = 0, col = 0;  // top-left in the parameter
  std::int64_t rows = 0, cols = 0;
  std::int64_t offset = 0;  // bytes from the start of its segment
  // Members of a compact route: member j writes parameter (param's index + j * param_step) at
  // (row + j * row_step, col + j * col_step), right after member j - 1.
  std::int64_t count = 1;
  std::int64_t param_step = 0, row_step = 0, col_step = 0;
};
struct RoutesMessage {
  std::vector<RouteMetadata> routes;
};

// trainer -> engine: a refit starts.
struct BeginMessage {
  int step = 0;
  std::string version;  // the weight version the engine publishes on commit
  bool verify = false;  // run the verification hook after the commit
  bool raw = false;     // bench: bare transport pass, nothing is applied or published
  int buckets = 0;      // gather executor: buckets that follow (0 with the transfer plan)
};

// Parameters an engine exported for peer access, either as one region — `handle` maps `bytes`
// of memory and parameter i starts `offsets[i]` bytes into it (Engine::allocate_params) — or, for
// registered CUDA storage, one handle per parameter in `handles` (each maps that parameter).
// `digest` names the export (export_digest); `elided`: the fields are left out — a paused message
// carries the digest alone, and the full export lies in the store under export_key().
struct ExportedParams {
  std::string handle;
  std::uint64_t bytes = 0;
  std::vector<std::uint64_t> offsets;
  std::vector<std::string> handles;
  std::string digest;
  bool elided = false;
};
// A digest of the export's handles and offsets (16 hex digits).
std::string export_digest(const ExportedParams& e);
// The store key of engine `mailbox`'s export of digest `digest`: the engine sets it (an encoded
// PausedMessage carrying the full export) before it answers with that digest, once per digest.
std::string export_key(const std::string& mailbox, const std::string& digest);

// refit.delta: a base an engine rank holds of what one feeder sent it (PausedMessage), or, as
// trainer rank 0 relays it (EnginesPausedMessage), one engine rank's offer to the recipient.
struct DeltaBase {
  int rank = 0;                       // paused: the feeder's trainer rank; relayed: the engine rank
  std::optional<std::string> digest;  // point to point: its digest; nullopt: peer access (trusted)
  std::string version;                // relayed only: the weight version it holds complete
  bool operator==(const DeltaBase&) const = default;
};

// engine -> trainer rank 0 (transfer plan): the answer to step `step`'s begin. Generation is
// paused and parameters may be written once trainer rank 0 said to proceed — or, with `refused`
// set (the pause hook failed, or took longer than refit.timeout_s), this engine rank refuses the
// refit and nothing may be written.
struct PausedMessage {
  int step = 0;
  std::optional<ExportedParams> direct;   // set when the engine's parameters are exported
  std::optional<FailureOrigin> refused;   // this engine rank's refusal
  // refit.delta (docs/delta.md): the bases this engine rank offers. `delta_version`: the weight
  // version it holds complete ("" for none: it offers nothing); `delta_bases`: per feeder whose
  // base it holds of that version, the digest of what it holds from it (point to point, 16 hex
  // digits), or nullopt where it trusts the trainer rank's (peer access: it cannot read the
  // change). Each trainer rank decides per pair whether to send a delta.
  std::string delta_version;
  std::vector<DeltaBase> delta_bases;
};

// trainer rank 0 -> engine (transfer plan), after every engine rank answered the begin of step
// `step`: write this refit, or abort it before any byte is written because of `refused` (the
// lowest engine rank's refusal).
struct ProceedMessage {
  int step = 0;
  std::optional<FailureOrigin> refused;  // unset: go
};

// trainer rank 0 -> every other trainer rank (transfer plan; through its group's relay,
// runtime/relay.h), with the proceed: what every engine
// rank answered the begin of step `step`. `exports`: per engine rank, in engine rank order, the
// digest of its exported parameters (nullopt: not exported); `refused`: as in ProceedMessage.
struct EnginesPausedMessage {
  int step = 0;
  std::optional<FailureOrigin> refused;
  std::vector<std::optional<std::string>> exports;
  // refit.delta: the offers of the engine ranks the recipient feeds, for its pairs only (one
  // entry per engine rank that offered the recipient a base; DeltaBase::rank the engine rank).
  std::vector<DeltaBase> delta;
  // To a trainer relay (runtime/relay.h): `delta` of each other trainer rank of its group, by
  // trainer rank, for the relay to hand on; empty otherwise.
  std::map<int, std::vector<DeltaBase>> group_delta;
};

// refit.checksum's checksums of the pairs of one engine rank as they travel without the transfer
// plan (CommittedMessage, to its feeders): "<peer mailbox id>=<16 hex digits>" joined by ','.
std::string encode_pair_checksums(const std::map<std::string, std::string>& by_peer);
Result<std::map<std::string, std::string>> decode_pair_checksums(const std::string& encoded,
                                                                 const std::string& from);

// trainer rank -> trainer rank 0 (transfer plan; through its group's relay): every byte this rank
// sends in refit `step` moved. With refit.checksum, `sums` holds per target the PairSums of its
// checksums of what it sent there — a trainer relay's, of its whole group's pairs, and none in
// the members' sent it hands on — which trainer rank 0 compares with each engine rank's.
struct SentMessage {
  int step = 0;
  std::map<std::string, PairSums> sums;
};

// trainer rank 0 -> every other trainer rank (transfer plan): refit `step` is over on every
// engine rank: published, or failed with `failed` (the first checksum mismatch or failed
// verification; the engines did not publish). `apply_s`: the slowest engine rank's apply time.
struct RefitDoneMessage {
  int step = 0;
  std::optional<FailureOrigin> failed;
  double apply_s = 0;
  double pause_s = 0;  // the longest pause of generation on an engine rank
};

// engine -> feeder: an aborted refit's proceed was heard; nothing was written.
struct AbortHeardMessage {
  int step = 0;
};

// trainer -> engine (gather): the header of the bucket now in `slot` (SGLang: the metadata of
// its tensors, `meta`).
struct BucketMessage {
  int slot = 0;
  int step = 0;
  int bucket = 0;
  std::uint64_t bytes = 0;
  std::string meta;
};
// engine -> trainer (gather, ipc): bucket `bucket` of step `step` was applied; `slot` is free.
struct BucketDoneMessage {
  int slot = 0;
  int step = 0;
  int bucket = 0;
};

// trainer -> engine: every byte of refit `step` moved (gather: every byte of the sending rank;
// transfer plan, from trainer rank 0: every byte of every trainer rank).
struct CommitMessage {
  int step = 0;
};

// engine -> its control peer (gather: each feeder; transfer plan: trainer rank 0): every byte of
// refit `step` landed.
struct CommittedMessage {
  int step = 0;
  double apply_s = 0;  // seconds the engine spent applying
  // Seconds generation has been paused in this refit so far (complete when the engine published
  // at its commit; else the outcome-heard carries the whole pause).
  double pause_s = 0;
  // refit.checksum: this engine rank's checksums (common/checksum.h) of the bytes each feeder sent
  // it in this refit, added up (PairSums; unset when checksums are off), which trainer rank 0
  // compares with the feeders' (SentMessage) under the transfer plan; without it, the checksums
  // themselves by feeder mailbox id (encode_pair_checksums; empty with the transfer plan), which
  // each feeder compares with its own.
  std::string checksums;
  std::optional<PairSums> checksum_sums;
};

// engine -> feeder: the verification verdict of refit `step`.
struct VerifiedMessage {
  int step = 0;
  std::optional<FailureOrigin> failed;  // unset: verified
};

// trainer -> engine, when the refit checks its bytes (refit.checksum) or verifies: whether every
// engine rank of the refit got every byte intact and passed verification, as every trainer rank
// agreed. Engines publish only without `failed`, so the ranks of one engine never hold two
// versions.
struct OutcomeMessage {
  int step = 0;
  std::optional<FailureOrigin> failed;  // the first failure; unset: publish
};

// engine -> feeder: the outcome of refit `step` was applied: the weights are `valid` at
// `weight_version` now (the refit's, or, rolled back, the previous one's).
struct OutcomeHeardMessage {
  int step = 0;
  bool valid = false;
  std::string weight_version;
  double pause_s = 0;  // seconds generation was paused in this refit
};

// trainer -> engine: no refit follows. engine -> feeder: heard; leaving.
struct ShutdownMessage {};
struct LeavingMessage {};

// A relay -> the rank it answers to (transfer plan: an engine's TP rank 0 -> trainer rank 0;
// docs/protocol.md, "Relays"): answers of one phase from the ranks of the relay's group, its own
// included, each with its own sender and payload. The receiving Inbox hands each on as if its
// sender had sent it, and accepts only those of the relay's own group.
struct RelayedAnswer {
  std::string from;  // the answering rank's mailbox id
  MessageType type = MessageType::kPaused;
  std::string payload;
};
struct RelayedMessage {
  std::vector<RelayedAnswer> answers;
};

std::string encode(const HelloMessage& m);
std::string encode(const RoutesMessage& m);
std::string encode(const BeginMessage& m);
std::string encode(const PausedMessage& m);
std::string encode(const ProceedMessage& m);
std::string encode(const EnginesPausedMessage& m);
std::string encode(const SentMessage& m);
std::string encode(const RefitDoneMessage& m);
std::string encode(const AbortHeardMessage& m);
std::string encode(const BucketMessage& m);
std::string encode(const BucketDoneMessage& m);
std::string encode(const CommitMessage& m);
std::string encode(const CommittedMessage& m);
std::string encode(const VerifiedMessage& m);
std::string encode(const OutcomeMessage& m);
std::string encode(const OutcomeHeardMessage& m);
std::string encode(const ShutdownMessage& m);
std::string encode(const LeavingMessage& m);
std::string encode(const RelayedMessage& m);

// `from` names the sender in errors.
Result<HelloMessage> decode_hello(const std::string& payload, const std::string& from);
Result<RoutesMessage> decode_routes(const std::string& payload, const std::string& from);
Result<BeginMessage> decode_begin(const std::string& payload, const std::string& from);
Result<PausedMessage> decode_paused(const std::string& payload, const std::string& from);
Result<ProceedMessage> decode_proceed(const std::string& payload, const std::string& from);
Result<EnginesPausedMessage> decode_engines_paused(const std::string& payload,
                                                   const std::string& from);
Result<SentMessage> decode_sent(const std::string& payload, const std::string& from);
Result<RefitDoneMessage> decode_refit_done(const std::string& payload, const std::string& from);
Result<AbortHeardMessage> decode_abort_heard(const std::string& payload, const std::string& from);
Result<BucketMessage> decode_bucket(const std::string& payload, const std::string& from);
Result<BucketDoneMessage> decode_bucket_done(const std::string& payload, const std::string& from);
Result<CommitMessage> decode_commit(const std::string& payload, const std::string& from);
Result<CommittedMessage> decode_committed(const std::string& payload, const std::string& from);
Result<VerifiedMessage> decode_verified(const std::string& payload, const std::string& from);
Result<OutcomeMessage> decode_outcome(const std::string& payload, const std::string& from);
Result<OutcomeHeardMessage> decode_outcome_heard(const std::string& payload,
                                                 const std::string& from);
Result<ShutdownMessage> decode_shutdown(const std::string& payload, const std::string& from);
Result<LeavingMessage> decode_leaving(const std::string& payload, const std::string& from);
Result<RelayedMessage> decode_relayed(const std::string& payload, const std::string& from);

// A message of refit step `got` from `from` reached `who` while refit step `step` is in flight:
// OK when they agree, else a protocol violation (kCorruption, FailureKind::kProtocol) naming
// both ranks, `what` the message carried ("the proceed") and both steps.
Status check_step(const std::string& who, const std::string& from, std::string_view what, int got,
                  int step);

}  // namespace refit
