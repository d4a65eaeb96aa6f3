#include "harness/fault.h"

#include <fmt/format.h>

#include <charconv>

namespace refit {
namespace {

bool parse_int(std::string_view s, int& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out >= 0;
}

}  // namespace

Result<Fault> parse_fault(std::string_view text) {
  Fault f;
  auto bad = [&] {
    return Status::InvalidArgument(fmt::format(
        "--fault: cannot parse \"{}\"; allowed: corrupt:BUCKET[:STEP], kill-trainer:RANK:AT, "
        "kill-engine:RANK:AT, stop-trainer:RANK:AT, stop-engine:RANK:AT (AT: a bucket or round, "
        "setup or commit), fail-pause:RANK[:STEP], slow-pause:RANK[:STEP], "
        "stall-trainer:RANK[:STEP], stall-engine:RANK[:STEP], forget-base:ENGINE:TRAINER:STEP, "
        "forget-kept:TRAINER:ENGINE:STEP, plan-mismatch, version-mismatch",
        text));
  };
  if (text.empty() || text == "none") return f;
  if (text == "plan-mismatch") {
    f.kind = Fault::Kind::kPlanMismatch;
    return f;
  }
  if (text == "version-mismatch") {
    f.kind = Fault::Kind::kVersionMismatch;
    return f;
  }
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return bad();
  const std::string_view kind = text.substr(0, colon), rest = text.substr(colon + 1);
  if (kind == "corrupt") {
    f.kind = Fault::Kind::kCorrupt;
    const auto at = rest.find(':');
    if (!parse_int(rest.substr(0, at), f.bucket)) return bad();
    if (at != std::string_view::npos && (!parse_int(rest.substr(at + 1), f.step) || f.step < 1))
      return bad();
    return f;
  }
  if (kind == "fail-pause" || kind == "slow-pause" || kind == "stall-trainer" ||
      kind == "stall-engine") {
    f.kind = kind == "fail-pause"      ? Fault::Kind::kFailPause
             : kind == "slow-pause"    ? Fault::Kind::kSlowPause
             : kind == "stall-trainer" ? Fault::Kind::kStallTrainer
                                       : Fault::Kind::kStallEngine;
    const auto at = rest.find(':');
    if (!parse_int(rest.substr(0, at), f.rank)) return bad();
    if (at != std::string_view::npos && (!parse_int(rest.substr(at + 1), f.step) || f.step < 1))
      return bad();
    return f;
  }
  if (kind == "forget-base" || kind == "forget-kept") {
    f.kind = kind == "forget-base" ? Fault::Kind::kForgetBase : Fault::Kind::kForgetKept;
    const auto a = rest.find(':');
    if (a == std::string_view::npos || !parse_int(rest.substr(0, a), f.rank)) return bad();
    const std::string_view tail = rest.substr(a + 1);
    const auto b = tail.find(':');
    if (b == std::string_view::npos || !parse_int(tail.substr(0, b), f.peer) ||
        !parse_int(tail.substr(b + 1), f.step) || f.step < 1)
      return bad();
    return f;
  }
  f.stop = kind == "stop-trainer" || kind == "stop-engine";
  if (kind == "kill-trainer" || kind == "stop-trainer")
    f.kind = Fault::Kind::kKillTrainer;
  else if (kind == "kill-engine" || kind == "stop-engine")
    f.kind = Fault::Kind::kKillEngine;
  else
    return bad();
  const auto colon2 = rest.find(':');
  if (colon2 == std::string_view::npos || !parse_int(rest.substr(0, colon2), f.rank)) return bad();
  const std::string_view at = rest.substr(colon2 + 1);
  if (at == "setup")
    f.bucket = Fault::kAtSetup;
  else if (at == "commit")
    f.bucket = Fault::kAtCommit;
  else if (!parse_int(at, f.bucket))
    return bad();
  return f;
}

}  // namespace refit
