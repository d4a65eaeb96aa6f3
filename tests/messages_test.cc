// Typed control messages: every message survives encode -> decode unchanged, and a payload with a
// missing, mistyped or extra-versioned field is refused with an error naming the message, the
// sender and the field (never a silent default).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "control/messages.h"

namespace refit {
namespace {

TEST(Messages, RoundTrip) {
  const BeginMessage b{.step = 7,
                       .version = "v7",
                       .verify = true,
                       .raw = false,
                       .buckets = 3,
                       .offer_direct = true,
                       .export_held = "00ff00ff00ff00ff"};
  auto b2 = decode_begin(encode(b), "trainer/0");
  ASSERT_TRUE(b2.ok()) << b2.status().to_string();
  EXPECT_EQ(b2->step, 7);
  EXPECT_EQ(b2->version, "v7");
  EXPECT_TRUE(b2->verify);
  EXPECT_FALSE(b2->raw);
  EXPECT_EQ(b2->buckets, 3);
  EXPECT_TRUE(b2->offer_direct);
  EXPECT_EQ(b2->export_held, "00ff00ff00ff00ff");

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
  auto p3 = decode_paused(encode(PausedMessage{.step = 4, .refused = "hook failed"}), "engine/1");
  ASSERT_TRUE(p3.ok());
  EXPECT_FALSE(p3->direct.has_value());
  EXPECT_EQ(p3->step, 4);
  EXPECT_EQ(p3->refused, "hook failed");
  auto go = decode_proceed(encode(ProceedMessage{.step = 9, .go = true}), "trainer/1");
  ASSERT_TRUE(go.ok()) << go.status().to_string();
  EXPECT_EQ(go->step, 9);
  EXPECT_TRUE(go->go);
  auto abort = decode_proceed(encode(ProceedMessage{.step = 2, .go = false, .error = "x: y"}),
                              "trainer/0");
  ASSERT_TRUE(abort.ok());
  EXPECT_FALSE(abort->go);
  EXPECT_EQ(abort->error, "x: y");
  auto missing = decode_proceed(R"({"v": )" + std::to_string(kMessageWireVersion) + R"(, "step": 1})",
                                "trainer/0");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'go'"), std::string::npos) << missing.status().message();

  auto h = decode_hello(encode(HelloMessage{.engine_rank = 3, .protocol = "vllm",
                                            .plan_hash = "0123456789abcdef",
                                            .total_parameters = 8190735360}),
                        "engine/3");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->engine_rank, 3);
  EXPECT_EQ(h->protocol, "vllm");
  EXPECT_EQ(h->plan_hash, "0123456789abcdef");
  EXPECT_EQ(h->total_parameters, 8190735360);

  auto c = decode_commit(encode(CommitMessage{.step = 2}), "trainer/1");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->step, 2);
  auto cd = decode_committed(
      encode(CommittedMessage{.version = "2", .apply_s = 0.25, .bytes_received = 123456789012}),
      "engine/0");
  ASSERT_TRUE(cd.ok());
  EXPECT_EQ(cd->version, "2");
  EXPECT_DOUBLE_EQ(cd->apply_s, 0.25);
  EXPECT_EQ(cd->bytes_received, 123456789012);
  auto v = decode_verified(encode(VerifiedMessage{.verified = false, .error = "bad"}), "engine/0");
  ASSERT_TRUE(v.ok());
  EXPECT_FALSE(v->verified);
  EXPECT_EQ(v->error, "bad");
}

TEST(Messages, RoutesRoundTripAndRefusal) {
  RoutesMessage m;
  m.routes.push_back(RouteMetadata{.round = 3, .param = "model.layers.0.self_attn.qkv_proj.weight",
                                   .row = 1, .col = 2, .rows = 3, .cols = 4, .offset = 5});
  auto r = decode_routes(encode(m), "trainer/1");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->routes.size(), 1u);
  EXPECT_EQ(r->routes[0].round, 3);
  EXPECT_EQ(r->routes[0].param, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(r->routes[0].row, 1);
  EXPECT_EQ(r->routes[0].offset, 5);
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
  j["bytes_received"] = "many";
  auto r = decode_committed(j.dump(), "engine/2");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("field 'bytes_received' has the wrong type (string)"),
            std::string::npos)
      << r.status().to_string();
  auto k = nlohmann::json::parse(encode(PausedMessage{.direct = ExportedParams{}}));
  k["direct"]["offsets"] = {1, -2};
  auto r2 = decode_paused(k.dump(), "engine/2");
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("'offsets'"), std::string::npos) << r2.status().to_string();
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
