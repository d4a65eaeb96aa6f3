// Typed control messages: every message survives encode -> decode unchanged, and a payload with a
// missing, mistyped or extra-versioned field is refused with an error naming the message, the
// sender and the field (never a silent default).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "control/message_types.h"
#include "control/messages.h"

namespace refit {
namespace {

// refit.checksum's sums (common/pair_sums.h): 300 feeders' checksums, as sent and as landed. One
// damaged pair is named whichever it is, however it changed; several are not taken for one (two
// damaged alike among them); the sums do not depend on the order of the pairs.
TEST(PairSums, NameTheOneDamagedPairAndNoPairForSeveral) {
  std::vector<std::uint64_t> checksums;
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int t = 0; t < 300; ++t) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    checksums.push_back(x);
  }
  PairSums sent, reversed;
  for (int t = 0; t < 300; ++t) sent.add(checksums[static_cast<std::size_t>(t)], t);
  for (int t = 299; t >= 0; --t) reversed.add(checksums[static_cast<std::size_t>(t)], t);
  EXPECT_EQ(sent, reversed);
  EXPECT_TRUE(sent.valid());
  EXPECT_EQ(PairSums::damaged_feeder(sent, sent), std::nullopt);
  const auto landed_with = [&](const std::map<int, std::uint64_t>& damage) {
    PairSums landed;
    for (int t = 0; t < 300; ++t) {
      const auto d = damage.find(t);
      landed.add(checksums[static_cast<std::size_t>(t)] + (d != damage.end() ? d->second : 0), t);
    }
    return landed;
  };
  for (int t : {0, 1, 137, 299})
    for (std::uint64_t by : {std::uint64_t{1}, std::uint64_t{0x12345}, ~std::uint64_t{0}}) {
      const PairSums landed = landed_with({{t, by}});
      EXPECT_NE(landed, sent);
      EXPECT_EQ(PairSums::damaged_feeder(sent, landed), std::optional<int>(t)) << t << " " << by;
    }
  // {10, 20} by the same amount: the first weighted sum alone would name trainer rank 15.
  for (const auto& several : std::vector<std::map<int, std::uint64_t>>{
           {{3, 1}, {4, 1}}, {{10, 9}, {20, 9}}, {{0, 77}, {299, 5}}, {{10, 1}, {20, 2}, {30, 3}}}) {
    const PairSums landed = landed_with(several);
    EXPECT_NE(landed, sent);
    const std::optional<int> named = PairSums::damaged_feeder(sent, landed);
    EXPECT_TRUE(!named || *named >= 300) << "several damaged pairs named trainer rank " << *named;
  }
}

TEST(Messages, RoundTrip) {
  const BeginMessage b{.step = 7, .version = "v7", .verify = true, .raw = false, .buckets = 3};
  auto b2 = decode_begin(encode(b), "trainer/0");
  ASSERT_TRUE(b2.ok()) << b2.status().to_string();
  EXPECT_EQ(b2->step, 7);
  EXPECT_EQ(b2->version, "v7");
  EXPECT_TRUE(b2->verify);
  EXPECT_FALSE(b2->raw);
  EXPECT_EQ(b2->buckets, 3);

  PausedMessage p{.direct = ExportedParams{.handle = "abc", .bytes = 1ull << 40, .offsets = {0, 256}}};
  auto p2 = decode_paused(encode(p), "engine/1");
  ASSERT_TRUE(p2.ok()) << p2.status().to_string();
  ASSERT_TRUE(p2->direct.has_value());
  EXPECT_EQ(p2->direct->handle, "abc");
  EXPECT_EQ(p2->direct->bytes, 1ull << 40);
  EXPECT_EQ(p2->direct->offsets, (std::vector<std::uint64_t>{0, 256}));
  EXPECT_FALSE(p2->direct->elided);
  // An export left out: only its digest travels, and the digest names the export's content.
  p.direct->digest = export_digest(*p.direct);
  EXPECT_EQ(p.direct->digest.size(), 16u);
  ExportedParams moved = *p.direct;
  moved.offsets[1] = 512;
  EXPECT_NE(export_digest(moved), p.direct->digest);
  auto p4 = decode_paused(
      encode(PausedMessage{.step = 5,
                           .direct = ExportedParams{.digest = p.direct->digest, .elided = true}}),
      "engine/1");
  ASSERT_TRUE(p4.ok()) << p4.status().to_string();
  ASSERT_TRUE(p4->direct.has_value());
  EXPECT_TRUE(p4->direct->elided);
  EXPECT_EQ(p4->direct->digest, p.direct->digest);
  EXPECT_TRUE(p4->direct->handle.empty() && p4->direct->offsets.empty());
  // A refusal travels as a failure record: the rank (an engine id of its TP size), the code and
  // the error.
  const FailureOrigin hook{
      .rank = RankId::engine(5, 4), .code = StatusCode::kTimeout, .error = "hook failed"};
  auto p3 = decode_paused(encode(PausedMessage{.step = 4, .refused = hook}), "engine/1");
  ASSERT_TRUE(p3.ok()) << p3.status().to_string();
  EXPECT_FALSE(p3->direct.has_value());
  EXPECT_EQ(p3->step, 4);
  ASSERT_TRUE(p3->refused.has_value());
  EXPECT_EQ(p3->refused->rank, RankId::engine(5, 4));
  EXPECT_EQ(p3->refused->rank.name(), "engine 1 tp rank 1");
  EXPECT_EQ(p3->refused->code, StatusCode::kTimeout);
  EXPECT_EQ(p3->refused->error, "hook failed");
  // An error text that is not UTF-8 (a hook's Latin-1 path) still travels: the bad bytes are
  // replaced, and the encode does not throw.
  const FailureOrigin latin1{
      .rank = RankId::engine(5, 4), .code = StatusCode::kIOError, .error = "cannot open /d\xe9j\xe0"};
  std::string latin1_wire;
  ASSERT_NO_THROW(latin1_wire = encode(PausedMessage{.step = 4, .refused = latin1}));
  auto p5 = decode_paused(latin1_wire, "engine/1");
  ASSERT_TRUE(p5.ok()) << p5.status().to_string();
  ASSERT_TRUE(p5->refused.has_value());
  EXPECT_EQ(p5->refused->error, "cannot open /d\xef\xbf\xbdj\xef\xbf\xbd");
  auto go = decode_proceed(encode(ProceedMessage{.step = 9}), "trainer/1");
  ASSERT_TRUE(go.ok()) << go.status().to_string();
  EXPECT_EQ(go->step, 9);
  EXPECT_FALSE(go->refused.has_value());
  auto abort = decode_proceed(encode(ProceedMessage{.step = 2, .refused = hook}), "trainer/0");
  ASSERT_TRUE(abort.ok());
  ASSERT_TRUE(abort->refused.has_value());
  EXPECT_EQ(abort->refused->error, "hook failed");
  auto missing = decode_proceed(R"({"v": )" + std::to_string(kMessageWireVersion) + R"(, "step": 1})",
                                "trainer/0");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'refused'"), std::string::npos)
      << missing.status().message();
  // A failure record must name a rank and a known code.
  auto j = nlohmann::json::parse(encode(ProceedMessage{.step = 2, .refused = hook}));
  j["refused"]["rank"] = "launcher";
  auto norank = decode_proceed(j.dump(), "trainer/0");
  ASSERT_FALSE(norank.ok());
  EXPECT_NE(norank.status().message().find("failure of 'launcher', which is no rank"),
            std::string::npos)
      << norank.status().to_string();
  j["refused"]["rank"] = "engine/5";
  j["refused"]["code"] = 99;
  auto nocode = decode_proceed(j.dump(), "trainer/0");
  ASSERT_FALSE(nocode.ok());
  EXPECT_NE(nocode.status().message().find("unknown code 99"), std::string::npos)
      << nocode.status().to_string();

  auto h = decode_hello(encode(HelloMessage{.engine_rank = 3,
                                            .plan_hash = "0123456789abcdef",
                                            .routes_digest = "fedcba9876543210",
                                            .total_parameters = 8190735360}),
                        "engine/3");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->engine_rank, 3);
  EXPECT_EQ(h->plan_hash, "0123456789abcdef");
  EXPECT_EQ(h->routes_digest, "fedcba9876543210");
  EXPECT_EQ(h->total_parameters, 8190735360);

  auto c = decode_commit(encode(CommitMessage{.step = 2}), "trainer/1");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->step, 2);
  auto cd =
      decode_committed(encode(CommittedMessage{
                           .step = 2,
                           .apply_s = 0.25,
                           .checksums = encode_pair_checksums({{"trainer/1", "00000000000000ff"}}),
                           .checksum_sums = PairSums(0xff, 0x1fe, 0x3fc)}),
                       "engine/0");
  ASSERT_TRUE(cd.ok());
  EXPECT_EQ(cd->step, 2);
  EXPECT_DOUBLE_EQ(cd->apply_s, 0.25);
  EXPECT_EQ(cd->checksum_sums, std::optional<PairSums>(PairSums(0xff, 0x1fe, 0x3fc)));
  auto by_feeder = decode_pair_checksums(cd->checksums, "engine/0");
  ASSERT_TRUE(by_feeder.ok()) << by_feeder.status().to_string();
  EXPECT_EQ(*by_feeder, (std::map<std::string, std::string>{{"trainer/1", "00000000000000ff"}}));
  auto unsummed = decode_committed(encode(CommittedMessage{.step = 2}), "engine/0");
  ASSERT_TRUE(unsummed.ok()) << unsummed.status().to_string();
  EXPECT_FALSE(unsummed->checksum_sums.has_value());
  // Sums at or past 2^61 - 1 are no sums of pair checksums.
  auto past = nlohmann::json::parse(encode(CommittedMessage{.step = 2}));
  past["checksum_sums"] = {PairSums::kPrime, 1, 1};
  EXPECT_FALSE(decode_committed(past.dump(), "engine/0").ok());

  // Between trainer ranks (transfer plan).
  const FailureOrigin refused{
      .rank = RankId::engine(3, 2), .code = StatusCode::kAborted, .error = "the hook failed"};
  auto ep = decode_engines_paused(
      encode(EnginesPausedMessage{.step = 4,
                                  .refused = refused,
                                  .exports = {std::string("0123456789abcdef"), std::nullopt}}),
      "trainer/0");
  ASSERT_TRUE(ep.ok()) << ep.status().to_string();
  EXPECT_EQ(ep->step, 4);
  ASSERT_TRUE(ep->refused.has_value());
  EXPECT_EQ(ep->refused->rank, refused.rank);
  ASSERT_EQ(ep->exports.size(), 2u);
  EXPECT_EQ(ep->exports[0], std::optional<std::string>("0123456789abcdef"));
  EXPECT_FALSE(ep->exports[1].has_value());
  // An export that is neither a digest nor absent.
  auto bad_exports =
      decode_engines_paused(std::to_string(kMessageWireVersion) + " 1 - 1 3 0 0", "trainer/0");
  ASSERT_FALSE(bad_exports.ok());
  EXPECT_NE(bad_exports.status().message().find("exports"), std::string::npos);
  EXPECT_TRUE(ep->delta.empty());

  // refit.delta: an engine rank offers its bases to trainer rank 0 (a digest per point-to-point
  // feeder, trust for a peer-access one), which relays to each trainer rank its own pairs' offers.
  PausedMessage offer{.step = 6, .delta_version = "5"};
  offer.delta_bases = {DeltaBase{.rank = 0, .digest = "0123456789abcdef"},
                       DeltaBase{.rank = 3, .digest = std::nullopt}};
  auto po = decode_paused(encode(offer), "engine/1");
  ASSERT_TRUE(po.ok()) << po.status().to_string();
  EXPECT_EQ(po->delta_version, "5");
  EXPECT_EQ(po->delta_bases, offer.delta_bases);
  auto none = decode_paused(encode(PausedMessage{.step = 6}), "engine/1");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->delta_version.empty() && none->delta_bases.empty());
  auto twice = nlohmann::json::parse(encode(offer));
  twice["delta_bases"][1][0] = 0;
  auto bad_twice = decode_paused(twice.dump(), "engine/1");
  ASSERT_FALSE(bad_twice.ok());
  EXPECT_NE(bad_twice.status().message().find("names rank 0 twice"), std::string::npos);
  auto unversioned = nlohmann::json::parse(encode(offer));
  unversioned["delta_version"] = "";
  EXPECT_FALSE(decode_paused(unversioned.dump(), "engine/1").ok());
  auto mistyped = nlohmann::json::parse(encode(offer));
  mistyped["delta_bases"][0] = {"0", "0123456789abcdef"};
  auto bad_type = decode_paused(mistyped.dump(), "engine/1");
  ASSERT_FALSE(bad_type.ok());
  EXPECT_NE(bad_type.status().message().find("delta_bases"), std::string::npos);
  EnginesPausedMessage relayed{.step = 6, .exports = {std::nullopt, std::nullopt}};
  relayed.delta = {DeltaBase{.rank = 1, .digest = "00000000000000ff", .version = "5"}};
  auto er = decode_engines_paused(encode(relayed), "trainer/0");
  ASSERT_TRUE(er.ok()) << er.status().to_string();
  EXPECT_EQ(er->delta, relayed.delta);
  auto no_delta =
      decode_engines_paused(std::to_string(kMessageWireVersion) + " 6 - 2 - -", "trainer/0");
  ASSERT_FALSE(no_delta.ok());
  EXPECT_NE(no_delta.status().message().find("'delta' is missing"), std::string::npos)
      << no_delta.status().to_string();

  const PairSums top(PairSums::kPrime - 1, 7, 0);
  auto sent = decode_sent(encode(SentMessage{.step = 4, .sums = {{"engine/1", top}}}), "trainer/2");
  ASSERT_TRUE(sent.ok()) << sent.status().to_string();
  EXPECT_EQ(sent->sums.at("engine/1"), top);
  // One sum where three belong; sums at or past 2^61 - 1.
  const std::string wire = std::to_string(kMessageWireVersion);
  EXPECT_FALSE(decode_sent(wire + " 4 1 8:engine/1 5", "trainer/2").ok());
  auto past_sent = decode_sent(
      wire + " 4 1 8:engine/1 " + std::to_string(PairSums::kPrime) + " 1 1", "trainer/2");
  ASSERT_FALSE(past_sent.ok());
  EXPECT_NE(past_sent.status().message().find("below 2^61 - 1"), std::string::npos);
  auto done = decode_refit_done(
      encode(RefitDoneMessage{.step = 4, .failed = std::nullopt, .apply_s = 0.5}), "trainer/0");
  ASSERT_TRUE(done.ok()) << done.status().to_string();
  EXPECT_FALSE(done->failed.has_value());
  EXPECT_DOUBLE_EQ(done->apply_s, 0.5);
  const FailureOrigin bad{.rank = RankId::engine(0, 2), .code = StatusCode::kCorruption, .error = "bad"};
  auto v = decode_verified(encode(VerifiedMessage{.step = 3, .failed = bad}), "engine/0");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->step, 3);
  ASSERT_TRUE(v->failed.has_value());
  EXPECT_EQ(v->failed->error, "bad");
  auto ok = decode_verified(encode(VerifiedMessage{.step = 3}), "engine/0");
  ASSERT_TRUE(ok.ok());
  EXPECT_FALSE(ok->failed.has_value());
  auto o = decode_outcome(encode(OutcomeMessage{.step = 3, .failed = bad}), "trainer/1");
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE(o->failed.has_value());
  EXPECT_EQ(o->failed->rank, RankId::engine(0, 2));
  // The engine's acknowledgement of the outcome says what it holds now, in fields of its own.
  auto heard = decode_outcome_heard(
      encode(OutcomeHeardMessage{.step = 3, .valid = true, .weight_version = "step-2"}), "engine/1");
  ASSERT_TRUE(heard.ok()) << heard.status().to_string();
  EXPECT_TRUE(heard->valid);
  EXPECT_EQ(heard->weight_version, "step-2");
  auto ah = decode_abort_heard(encode(AbortHeardMessage{.step = 7}), "engine/1");
  ASSERT_TRUE(ah.ok());
  EXPECT_EQ(ah->step, 7);
  auto bk = decode_bucket(
      encode(BucketMessage{.slot = 1, .step = 2, .bucket = 5, .bytes = 1ull << 33, .meta = "m"}),
      "trainer/0");
  ASSERT_TRUE(bk.ok()) << bk.status().to_string();
  EXPECT_EQ(bk->bucket, 5);
  EXPECT_EQ(bk->bytes, 1ull << 33);
  EXPECT_EQ(bk->meta, "m");
  auto bd = decode_bucket_done(encode(BucketDoneMessage{.slot = 1, .step = 2, .bucket = 5}),
                               "engine/0");
  ASSERT_TRUE(bd.ok());
  EXPECT_EQ(bd->slot, 1);
  EXPECT_TRUE(decode_shutdown(encode(ShutdownMessage{}), "trainer/0").ok());
  EXPECT_TRUE(decode_leaving(encode(LeavingMessage{}), "engine/0").ok());
  auto f = decode_failure(encode_failure(bad), "the store");
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->rank, bad.rank);
  EXPECT_EQ(f->describe(), "engine 0 tp rank 0: bad");
}

// Every message type has one row in the table: its name, the one role that sends it, its phase.
TEST(Messages, TableNamesEveryTypeAndItsSender) {
  EXPECT_STREQ(message_type_name(MessageType::kOutcomeHeard), "outcome-heard");
  EXPECT_EQ(message_info(MessageType::kOutcome).sender, Role::kTrainer);
  EXPECT_EQ(message_info(MessageType::kOutcomeHeard).sender, Role::kEngine);
  EXPECT_EQ(message_info(MessageType::kProceed).sender, Role::kTrainer);
  EXPECT_EQ(message_info(MessageType::kAbortHeard).sender, Role::kEngine);
  EXPECT_EQ(message_info(MessageType::kShutdown).sender, Role::kTrainer);
  EXPECT_EQ(message_info(MessageType::kLeaving).sender, Role::kEngine);
  EXPECT_EQ(message_info(MessageType::kHello).phase, Phase::kSetup);
  EXPECT_FALSE(is_message_type(0));
  EXPECT_EQ(message_info(MessageType::kEnginesPaused).sender, Role::kTrainer);
  EXPECT_EQ(message_info(MessageType::kSent).sender, Role::kTrainer);
  EXPECT_STREQ(message_type_name(MessageType::kRefitDone), "refit-done");
  EXPECT_STREQ(message_type_name(MessageType::kRelayed), "relayed");
  EXPECT_TRUE(is_message_type(static_cast<std::uint8_t>(MessageType::kRelayed)));
  EXPECT_FALSE(is_message_type(static_cast<std::uint8_t>(MessageType::kRelayed) + 1));
}

// A relay's message carries each answer with its own sender, type and payload; anything else in
// it is refused naming the relay.
TEST(Messages, RelayedAnswersRoundTripAndMalformedOnesAreRefused) {
  const RelayedMessage m{
      .answers = {{.from = "engine/4", .type = MessageType::kPaused, .payload = "{}"},
                  {.from = "engine/5", .type = MessageType::kVerified, .payload = "x"}}};
  auto r = decode_relayed(encode(m), "engine/4");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->answers.size(), 2u);
  EXPECT_EQ(r->answers[1].from, "engine/5");
  EXPECT_EQ(r->answers[1].type, MessageType::kVerified);
  EXPECT_EQ(r->answers[1].payload, "x");
  const std::string v = std::to_string(kMessageWireVersion);
  for (const char* answers : {R"([["engine/5", 99, "x"]])", R"([["engine/5", 4]])",
                              R"([[5, 4, "x"]])", R"({"a": 1})", R"([["engine/5", 0, "x"]])"}) {
    auto bad = decode_relayed(R"({"v":)" + v + R"(,"answers":)" + answers + "}", "engine/4");
    ASSERT_FALSE(bad.ok()) << answers;
    EXPECT_NE(bad.status().message().find("engine/4"), std::string::npos)
        << bad.status().to_string();
  }
}

// Pair checksums travel as one string; a malformed one is refused naming its sender.
TEST(Messages, PairChecksumsRoundTripAndMalformedOnesAreRefused) {
  const std::map<std::string, std::string> pairs{{"engine/0", "0123456789abcdef"},
                                                 {"engine/12", "fedcba9876543210"}};
  auto back = decode_pair_checksums(encode_pair_checksums(pairs), "trainer/3");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, pairs);
  EXPECT_TRUE(decode_pair_checksums("", "trainer/3")->empty());
  for (const char* bad : {"engine/0", "=ff", "engine/0=", "engine/0=1,engine/0=2", "a=1,,b=2"}) {
    auto r = decode_pair_checksums(bad, "trainer/3");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("trainer/3"), std::string::npos) << r.status().to_string();
  }
}

// To a trainer relay, engines-paused carries the offers of each rank of its group as well.
TEST(Messages, EnginesPausedCarriesAGroupsOffers) {
  EnginesPausedMessage m{.step = 2, .exports = {std::nullopt}};
  m.delta = {DeltaBase{.rank = 0, .digest = "00000000000000aa", .version = "1"}};
  m.group_delta[5] = {DeltaBase{.rank = 0, .digest = std::nullopt, .version = "1"}};
  m.group_delta[6] = {};
  auto r = decode_engines_paused(encode(m), "trainer/0");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->delta, m.delta);
  EXPECT_EQ(r->group_delta, m.group_delta);
  auto refused = decode_engines_paused(std::to_string(kMessageWireVersion) + " 2 - 1 - 0 1 five 0",
                                       "trainer/0");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'five'"), std::string::npos)
      << refused.status().to_string();
}

TEST(Messages, RoutesRoundTripAndRefusal) {
  RoutesMessage m;
  m.routes.push_back(RouteMetadata{.round = 3,
                                   .param = "model.layers.0.self_attn.qkv_proj.weight",
                                   .row = 1,
                                   .col = 2,
                                   .rows = 3,
                                   .cols = 4,
                                   .offset = 5,
                                   .count = 128,
                                   .param_step = 0,
                                   .row_step = 6,
                                   .col_step = -1});
  auto r = decode_routes(encode(m), "trainer/1");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->routes.size(), 1u);
  EXPECT_EQ(r->routes[0].round, 3);
  EXPECT_EQ(r->routes[0].param, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(r->routes[0].row, 1);
  EXPECT_EQ(r->routes[0].offset, 5);
  EXPECT_EQ(r->routes[0].count, 128);
  EXPECT_EQ(r->routes[0].row_step, 6);
  EXPECT_EQ(r->routes[0].col_step, -1);
  auto j = nlohmann::json::parse(encode(m));
  j["routes"][0][4] = -3;
  auto bad = decode_routes(j.dump(), "trainer/1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("routes message from trainer/1: route 0"),
            std::string::npos)
      << bad.status().to_string();
}

TEST(Messages, MissingFieldIsNamed) {
  auto j = nlohmann::json::parse(encode(BeginMessage{.step = 1}));
  j.erase("version");
  auto r = decode_begin(j.dump(), "trainer/3");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_NE(r.status().message().find("begin message from trainer/3 has no field 'version'"),
            std::string::npos)
      << r.status().to_string();
}

TEST(Messages, MistypedFieldIsNamed) {
  auto j = nlohmann::json::parse(encode(CommittedMessage{}));
  j["apply_s"] = "many";
  auto r = decode_committed(j.dump(), "engine/2");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("field 'apply_s' has the wrong type (string)"),
            std::string::npos)
      << r.status().to_string();
  auto k = nlohmann::json::parse(encode(PausedMessage{.direct = ExportedParams{}}));
  k["direct"]["offsets"] = {1, -2};
  auto r2 = decode_paused(k.dump(), "engine/2");
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("'offsets'"), std::string::npos) << r2.status().to_string();
}

// A message of another refit step than the one in flight is a protocol violation naming both
// ranks, what it carried and both steps.
TEST(Messages, AnotherStepIsAProtocolViolationNamingBothRanks) {
  EXPECT_TRUE(check_step("trainer 0", "engine/3", "the commit acknowledgement", 7, 7).ok());
  const Status st = check_step("trainer 0", "engine/3", "the commit acknowledgement", 6, 7);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_EQ(st.kind(), FailureKind::kProtocol);
  EXPECT_EQ(st.message(),
            "trainer 0: engine/3 sent the commit acknowledgement of refit step 6 in step 7");
}

TEST(Messages, OtherWireVersionOrGarbageIsRefused) {
  auto j = nlohmann::json::parse(encode(CommitMessage{.step = 1}));
  j["v"] = kMessageWireVersion + 1;
  auto r = decode_commit(j.dump(), "trainer/0");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("wire version"), std::string::npos);
  for (const char* bad : {"", "[]", "{", "\x01\x02", "null", "{\"v\": \"1\"}"}) {
    auto g = decode_verified(bad, "engine/9");
    ASSERT_FALSE(g.ok()) << bad;
    EXPECT_NE(g.status().message().find("verified message from engine/9"), std::string::npos);
  }
}

// Hellos and version stamps name the refit and wire versions; another version on either is
// refused naming both sides, as is a peer that announces none.
TEST(Messages, PeerVersionsAreCheckedNamingBothSides) {
  EXPECT_TRUE(check_peer_versions(encode(HelloMessage{}), "engine/0", "trainer rank 0").ok());
  EXPECT_TRUE(check_peer_versions(encode_version_stamp(version()), "trainer rank 1",
                                  "trainer rank 0")
                  .ok());
  auto hello = decode_hello(encode(HelloMessage{.engine_rank = 3}), "engine/3");
  ASSERT_TRUE(hello.ok()) << hello.status().to_string();
  EXPECT_EQ(hello->refit_version, version());

  const Status other =
      check_peer_versions(encode_version_stamp("9.9.9"), "trainer rank 1", "trainer rank 0");
  EXPECT_EQ(other.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other.message().find(fmt::format("trainer rank 1 runs refit 9.9.9 (wire protocol {})",
                                             kMessageWireVersion)),
            std::string::npos)
      << other.to_string();
  EXPECT_NE(other.message().find(fmt::format("trainer rank 0 runs refit {} (wire protocol {})",
                                             version(), kMessageWireVersion)),
            std::string::npos)
      << other.to_string();

  auto j = nlohmann::json::parse(encode(HelloMessage{}));
  j["v"] = kMessageWireVersion + 1;
  const Status wire = check_peer_versions(j.dump(), "engine/1", "trainer rank 0");
  EXPECT_NE(wire.message().find(fmt::format("runs refit {} (wire protocol {})", version(),
                                            kMessageWireVersion + 1)),
            std::string::npos)
      << wire.to_string();
  const Status none = check_peer_versions("{\"v\": 1}", "engine/2", "trainer rank 0");
  EXPECT_NE(none.message().find("engine/2 announced no refit version"), std::string::npos)
      << none.to_string();
}

}  // namespace
}  // namespace refit
