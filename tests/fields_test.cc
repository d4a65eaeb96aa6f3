// The compact payload of engines-paused, sent and refit-done (control/fields.h).
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "control/fields.h"
#include "control/messages.h"

namespace refit {
namespace {

TEST(Fields, EveryKindOfFieldReadsBackExactly) {
  const std::string from = "trainer/3";
  FieldWriter w(7);
  w.integer(-42)
      .natural(std::numeric_limits<std::uint64_t>::max())
      .real(0.1)
      .real(1e-300)
      .text("a text: with spaces, colons and 12:34")
      .text("")
      .maybe_text(std::nullopt)
      .maybe_text(std::string("-"));
  const std::string payload = w.take();
  FieldReader r(payload, "test", from, 7);
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double a = 0, b = 0;
  std::string t1, t2;
  std::optional<std::string> absent = "x", dash;
  EXPECT_TRUE(r.integer("i", i, -100, 100));
  EXPECT_TRUE(r.natural("u", u));
  EXPECT_TRUE(r.real("a", a));
  EXPECT_TRUE(r.real("b", b));
  EXPECT_TRUE(r.text("t1", t1));
  EXPECT_TRUE(r.text("t2", t2));
  EXPECT_TRUE(r.maybe_text("absent", absent));
  EXPECT_TRUE(r.maybe_text("dash", dash));
  ASSERT_TRUE(r.finish().ok()) << r.status().to_string();
  EXPECT_EQ(i, -42);
  EXPECT_EQ(u, std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(a, 0.1);  // bit for bit: the shortest text that reads back to the same double
  EXPECT_EQ(b, 1e-300);
  EXPECT_EQ(t1, "a text: with spaces, colons and 12:34");
  EXPECT_EQ(t2, "");
  EXPECT_FALSE(absent.has_value());
  EXPECT_EQ(dash, std::optional<std::string>("-"));
}

// Each malformed payload is refused, naming the message, its sender and the field.
TEST(Fields, MalformedPayloadsAreRefusedNamingTheField) {
  std::string text;
  std::int64_t i = 0;
  std::size_t n = 0;
  const auto none = [](FieldReader&) {};
  const auto step = [&](FieldReader& r) { r.integer("step", i, 0, 9); };
  const auto name = [&](FieldReader& r) { r.text("name", text); };
  const auto exports = [&](FieldReader& r) { r.count("exports", n); };
  const auto step_then_name = [&](FieldReader& r) { step(r), name(r); };
  const struct {
    std::string payload;
    std::function<void(FieldReader&)> read;
    std::string says;
  } cases[] = {
      {R"({"v":7,"step":1})", none, "no wire version"},
      {"3 1", none, "has wire version 3, this build speaks 7"},
      {"7 1 2", step, "2 byte(s) after its last field"},
      {"7 10:abc", name, "field 'name' claims 10 bytes, 3 are left"},
      {"7 1000000 1 2", exports, "field 'exports' claims 1000000 entries"},
      {"7  1", step, "field 'step' is missing"},
      {"7 12", step, "field 'step' is 12, outside [0, 9]"},
      {"7 x1", step, "field 'step' is not an integer ('x1')"},
      {"7 abc", name, "field 'name' is neither a text"},
      {"7 -", name, "field 'name' is absent"},
      {"7 1", step_then_name, "field 'name' is missing (the message ends before it)"},
  };
  for (const auto& c : cases) {
    FieldReader r(c.payload, "test", "trainer/3", 7);
    c.read(r);
    const Status s = r.finish();
    ASSERT_FALSE(s.ok()) << c.payload;
    EXPECT_EQ(s.kind(), FailureKind::kProtocol) << s.to_string();
    EXPECT_NE(s.message().find("test message from trainer/3"), std::string::npos) << s.to_string();
    EXPECT_NE(s.message().find(c.says), std::string::npos) << c.payload << ": " << s.to_string();
  }
}

// A failure record travels inside refit-done's text field, whatever its error says.
TEST(Fields, RefitDoneCarriesAFailureAndExactTimes) {
  RefitDoneMessage m{.step = 9,
                     .failed = FailureOrigin{.rank = RankId::engine(2, 4),
                                             .code = StatusCode::kCorruption,
                                             .error = "checksum mismatch: \"a\" b:c\n 7 - 3"},
                     .apply_s = 0.123456789012345,
                     .pause_s = 2.5e-7};
  auto r = decode_refit_done(encode(m), "trainer/0");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->step, 9);
  ASSERT_TRUE(r->failed.has_value());
  EXPECT_EQ(r->failed->rank, m.failed->rank);
  EXPECT_EQ(r->failed->error, m.failed->error);
  EXPECT_EQ(r->apply_s, m.apply_s);
  EXPECT_EQ(r->pause_s, m.pause_s);
  const std::string v = std::to_string(kMessageWireVersion);
  // The examples of docs/protocol.md, "Encoding".
  EXPECT_EQ(encode(RefitDoneMessage{.step = 7, .apply_s = 0.0012}), v + " 7 - 0.0012 0");
  EXPECT_EQ(encode(SentMessage{.step = 7, .sums = {{"engine/3", PairSums(1234, 5678, 9012)}}}),
            v + " 7 1 8:engine/3 1234 5678 9012");
  auto bad = decode_refit_done(v + " 9 7:{\"a\":1} 0 0", "trainer/0");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(
                "refit-done message from trainer/0: field 'failed' is a failure without field "
                "'rank'"),
            std::string::npos)
      << bad.status().to_string();
  // A record that names no rank is refused once, in the compact message's words.
  const std::string record = R"({"rank":"launcher","tp_size":1,"code":3,"kind":0,"error":"x"})";
  auto norank = decode_refit_done(
      fmt::format("{} 9 {}:{} 0 0", v, record.size(), record), "trainer/0");
  ASSERT_FALSE(norank.ok());
  EXPECT_EQ(norank.status().message(),
            "refit-done message from trainer/0: field 'failed' is a failure of 'launcher', which "
            "is no rank")
      << norank.status().to_string();
}

// A trainer relay hands its group's sent on inside its relayed message (JSON): the compact
// payloads are text, and arrive as they were written.
TEST(Fields, RelayedMessagesCarryCompactPayloads) {
  SentMessage sent{.step = 3, .sums = {{"engine/0", PairSums(1, 2, 3)}, {"engine 1", PairSums()}}};
  const std::string payload = encode(sent);
  RelayedMessage relayed{.answers = {RelayedAnswer{.from = "trainer/5",
                                                   .type = MessageType::kSent,
                                                   .payload = payload}}};
  auto back = decode_relayed(encode(relayed), "trainer/4");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(back->answers.size(), 1u);
  EXPECT_EQ(back->answers[0].payload, payload);
  auto s = decode_sent(back->answers[0].payload, "trainer/5");
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->sums, sent.sums);
}

}  // namespace
}  // namespace refit
