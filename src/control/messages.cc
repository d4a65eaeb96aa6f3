#include "control/messages.h"

#include <charconv>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "control/fields.h"

namespace refit {
namespace {

// A message this rank cannot accept: malformed, of another wire version, or saying what its
// sender cannot mean. The peer is at fault, not this rank's input (FailureKind::kProtocol).
Status protocol_error(std::string message) {
  return Status::Corruption(std::move(message)).with_kind(FailureKind::kProtocol);
}


using Json = nlohmann::json;

std::string dump(Json j) {
  j["v"] = kMessageWireVersion;
  // Error texts carry what hooks and the system said, which need not be UTF-8: replaced, not
  // thrown (an encode never fails).
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// PairSums on the wire: [sum, first, second], each below PairSums::kPrime.
Json pair_sums_json(const PairSums& s) { return Json::array({s.sum(), s.first(), s.second()}); }

Result<PairSums> pair_sums_from(const Json& j, const char* message, const std::string& field,
                                const std::string& from) {
  if (j.is_array() && j.size() == 3 && j[0].is_number_unsigned() && j[1].is_number_unsigned() &&
      j[2].is_number_unsigned()) {
    const PairSums s(j[0].get<std::uint64_t>(), j[1].get<std::uint64_t>(),
                     j[2].get<std::uint64_t>());
    if (s.valid()) return s;
  }
  return protocol_error(fmt::format(
      "{} message from {}: {} is not three checksum sums below 2^61 - 1", message, from, field));
}

Result<FailureOrigin> decode_failure_json(const Json& j, const char* message,
                                          const std::string& from);

// Reads the fields of one message; the first problem is kept and named.
class Reader {
 public:
  Reader(const std::string& payload, const char* message, const std::string& from)
      : message_(message), from_(from) {
    j_ = Json::parse(payload, nullptr, false);
    if (j_.is_discarded() || !j_.is_object()) {
      fail("is not a JSON object");
      return;
    }
    int v = 0;
    get("v", v);
    if (error_.ok() && v != kMessageWireVersion)
      fail(fmt::format("has wire version {}, this build speaks {}", v, kMessageWireVersion));
  }

  // An object nested in a message already parsed: read in place (no wire version of its own).
  struct Nested {};
  Reader(Nested, const Json& object, const char* message, const std::string& from)
      : j_(object), message_(message), from_(from) {
    if (!j_.is_object()) fail("is not a JSON object");
  }

  template <typename T>
  void get(const char* field, T& out) {
    if (!error_.ok()) return;
    auto it = j_.find(field);
    if (it == j_.end()) return fail(fmt::format("has no field '{}'", field));
    if (!type_ok(*it, out))
      return fail(fmt::format("field '{}' has the wrong type ({})", field, it->type_name()));
    out = it->get<T>();
  }
  // An optional failure record: null or absent-as-null is nullopt.
  void get_failure(const char* field, std::optional<FailureOrigin>& out) {
    if (!error_.ok()) return;
    auto it = j_.find(field);
    if (it == j_.end()) return fail(fmt::format("has no field '{}'", field));
    if (it->is_null()) {
      out.reset();
      return;
    }
    Result<FailureOrigin> f = decode_failure_json(*it, message_, from_);
    if (!f.ok()) {
      if (error_.ok()) error_ = f.status();
      return;
    }
    out = std::move(f).value();
  }
  const Json& json() const { return j_; }
  bool has(const char* field) const { return j_.contains(field) && !j_[field].is_null(); }
  Status status() const { return error_; }

 private:
  static bool type_ok(const Json& v, const bool&) { return v.is_boolean(); }
  static bool type_ok(const Json& v, const std::string&) { return v.is_string(); }
  static bool type_ok(const Json& v, const double&) { return v.is_number(); }
  static bool type_ok(const Json& v, const int&) { return v.is_number_integer(); }
  static bool type_ok(const Json& v, const std::int64_t&) { return v.is_number_integer(); }
  static bool type_ok(const Json& v, const std::uint64_t&) { return v.is_number_unsigned(); }
  static bool type_ok(const Json& v, const std::vector<std::string>&) {
    if (!v.is_array()) return false;
    for (const Json& x : v)
      if (!x.is_string()) return false;
    return true;
  }
  static bool type_ok(const Json& v, const std::map<std::string, std::string>&) {
    if (!v.is_object()) return false;
    for (const auto& [k, x] : v.items())
      if (!x.is_string()) return false;
    return true;
  }
  static bool type_ok(const Json& v, const std::vector<int>&) {
    if (!v.is_array()) return false;
    for (const Json& x : v)
      if (!x.is_number_integer()) return false;
    return true;
  }
  static bool type_ok(const Json& v, const std::vector<std::uint64_t>&) {
    if (!v.is_array()) return false;
    for (const Json& x : v)
      if (!x.is_number_unsigned()) return false;
    return true;
  }
  void fail(const std::string& what) {
    if (error_.ok())
      error_ = protocol_error(fmt::format("{} message from {} {}", message_, from_, what));
  }

  Json j_;
  const char* message_;
  const std::string& from_;
  Status error_;
};

Json failure_json(const FailureOrigin& f) {
  return {{"rank", f.rank.mailbox()},
          {"tp_size", f.rank.tp_size},
          {"code", static_cast<int>(f.code)},
          {"kind", static_cast<int>(f.kind)},
          {"error", f.error}};
}
Json failure_json(const std::optional<FailureOrigin>& f) {
  return f ? failure_json(*f) : Json(nullptr);
}

// A failure record read from `j`. What is wrong with it is said as words that follow "failure"
// ("without field 'rank'", "with unknown code 99"), so that the JSON and the compact messages
// each name it once, in their own frame.
Result<FailureOrigin> failure_from_json(const Json& j) {
  auto refuse = [](std::string what) { return protocol_error(std::move(what)); };
  if (!j.is_object()) return refuse("that is not a JSON object");
  for (const char* field : {"rank", "tp_size", "code", "kind", "error"}) {
    const auto it = j.find(field);
    if (it == j.end()) return refuse(fmt::format("without field '{}'", field));
    const bool text = field == std::string_view("rank") || field == std::string_view("error");
    if (text ? !it->is_string() : !it->is_number_integer())
      return refuse(fmt::format("whose field '{}' is a {}", field, it->type_name()));
  }
  const std::string rank = j["rank"].get<std::string>();
  const std::optional<RankId> id = RankId::from_mailbox(rank, j["tp_size"].get<int>());
  if (!id) return refuse(fmt::format("of '{}', which is no rank", rank));
  const std::int64_t code = j["code"].get<std::int64_t>();
  if (code <= static_cast<int>(StatusCode::kOk) || code > static_cast<int>(StatusCode::kInternal))
    return refuse(fmt::format("with unknown code {}", code));
  const std::int64_t kind = j["kind"].get<std::int64_t>();
  if (kind < 0 || kind > static_cast<int>(FailureKind::kProtocol))
    return refuse(fmt::format("with unknown kind {}", kind));
  return FailureOrigin{.rank = *id,
                       .code = static_cast<StatusCode>(code),
                       .kind = static_cast<FailureKind>(kind),
                       .error = j["error"].get<std::string>()};
}

Result<FailureOrigin> decode_failure_json(const Json& j, const char* message,
                                          const std::string& from) {
  Result<FailureOrigin> f = failure_from_json(j);
  if (!f.ok())
    return protocol_error(
        fmt::format("{} message from {}: failure {}", message, from, f.status().message()));
  return f;
}

}  // namespace

std::string encode_failure(const FailureOrigin& failure) { return dump(failure_json(failure)); }

Result<FailureOrigin> decode_failure(const std::string& payload, const std::string& from) {
  Reader r(payload, "failure record", from);
  if (!r.status().ok()) return r.status();
  return decode_failure_json(r.json(), "failure record", from);
}

std::string encode_version_stamp(const std::string& refit_version,
                                 const std::map<std::string, std::string>& settings) {
  return dump({{"refit_version", refit_version}, {"settings", settings}});
}

Status check_peer_versions(const std::string& payload, const std::string& from,
                           const std::string& self) {
  const Json j = Json::parse(payload, nullptr, false);
  const bool ok = !j.is_discarded() && j.is_object() && j.contains("v") &&
                  j["v"].is_number_integer() && j.contains("refit_version") &&
                  j["refit_version"].is_string();
  if (!ok)
    return Status::InvalidArgument(fmt::format(
        "setup: {} announced no refit version and wire protocol version (a refit older than "
        "0.3.0, or not refit); {} runs refit {} (wire protocol {}): every rank of a refit must run "
        "the same refit version",
        from, self, version(), kMessageWireVersion));
  const std::string& theirs = j["refit_version"].get_ref<const std::string&>();
  const int wire = j["v"].get<int>();
  if (theirs == version() && wire == kMessageWireVersion) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "setup: version mismatch: {} runs refit {} (wire protocol {}), {} runs refit {} (wire "
      "protocol {}); every rank of a refit must run the same refit version",
      from, theirs, wire, self, version(), kMessageWireVersion));
}

std::string encode(const HelloMessage& m) {
  return dump({{"refit_version", m.refit_version},
               {"engine_rank", m.engine_rank},
               {"plan_hash", m.plan_hash},
               {"routes_digest", m.routes_digest},
               {"total_parameters", m.total_parameters},
               {"settings", m.settings}});
}

std::string encode(const BeginMessage& m) {
  return dump({{"step", m.step},
               {"version", m.version},
               {"verify", m.verify},
               {"raw", m.raw},
               {"buckets", m.buckets}});
}

std::string encode(const PausedMessage& m) {
  Json bases = Json::array();
  for (const DeltaBase& b : m.delta_bases)
    bases.push_back(Json::array({b.rank, b.digest ? Json(*b.digest) : Json()}));
  Json j = {{"step", m.step},
            {"refused", failure_json(m.refused)},
            {"delta_version", m.delta_version},
            {"delta_bases", std::move(bases)}};
  if (m.direct && m.direct->elided)
    j["direct"] = {{"digest", m.direct->digest}, {"elided", true}};
  else if (m.direct)
    j["direct"] = {{"handle", m.direct->handle},
                   {"bytes", m.direct->bytes},
                   {"offsets", m.direct->offsets},
                   {"handles", m.direct->handles},
                   {"digest", m.direct->digest},
                   {"elided", false}};
  else
    j["direct"] = nullptr;
  return dump(std::move(j));
}

std::string export_digest(const ExportedParams& e) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&](std::string_view bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xFF) * 1099511628211ull;  // field separator
  };
  mix(e.handle);
  mix(std::to_string(e.bytes));
  for (std::uint64_t o : e.offsets) mix(std::to_string(o));
  for (const std::string& x : e.handles) mix(x);
  return fmt::format("{:016x}", h);
}

std::string export_key(const std::string& mailbox, const std::string& digest) {
  return fmt::format("export/{}/{}", mailbox, digest);
}

std::string encode(const ProceedMessage& m) {
  return dump({{"step", m.step}, {"refused", failure_json(m.refused)}});
}
namespace {

// The compact messages (control/fields.h): a failure travels as its JSON record, in a text.
void put_failure(FieldWriter& w, const std::optional<FailureOrigin>& f) {
  if (!f) {
    w.maybe_text(std::nullopt);
    return;
  }
  w.text(std::string_view(failure_json(*f).dump(-1, ' ', false, Json::error_handler_t::replace)));
}
bool get_failure(FieldReader& r, const char* field, std::optional<FailureOrigin>& out) {
  std::optional<std::string> text;
  if (!r.maybe_text(field, text)) return false;
  out.reset();
  if (!text) return true;
  const Json j = Json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return r.fail(field, "is not a failure record");
  Result<FailureOrigin> f = failure_from_json(j);
  if (!f.ok()) return r.fail(field, fmt::format("is a failure {}", f.status().message()));
  out = std::move(f).value();
  return true;
}

// engines-paused's offers: the count, then per offer the engine rank, the weight version and the
// digest (or - for peer access).
void put_offers(FieldWriter& w, const std::vector<DeltaBase>& offers) {
  w.natural(offers.size());
  for (const DeltaBase& b : offers) w.integer(b.rank).text(b.version).maybe_text(b.digest);
}
bool get_offers(FieldReader& r, const char* field, std::vector<DeltaBase>& out) {
  std::size_t n = 0;
  if (!r.count(field, n)) return false;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    DeltaBase b;
    if (!r.integer(field, b.rank) || !r.text(field, b.version) || !r.maybe_text(field, b.digest))
      return false;
    for (const DeltaBase& x : out)
      if (x.rank == b.rank) return r.fail(field, fmt::format("names engine rank {} twice", b.rank));
    out.push_back(std::move(b));
  }
  return true;
}

}  // namespace

std::string encode(const EnginesPausedMessage& m) {
  FieldWriter w(kMessageWireVersion);
  w.integer(m.step);
  put_failure(w, m.refused);
  w.natural(m.exports.size());
  for (const std::optional<std::string>& e : m.exports) w.maybe_text(e);
  put_offers(w, m.delta);
  w.natural(m.group_delta.size());
  for (const auto& [rank, offers] : m.group_delta) {
    w.integer(rank);
    put_offers(w, offers);
  }
  return w.take();
}
std::string encode(const SentMessage& m) {
  FieldWriter w(kMessageWireVersion);
  w.integer(m.step).natural(m.sums.size());
  for (const auto& [target, s] : m.sums)
    w.text(target).natural(s.sum()).natural(s.first()).natural(s.second());
  return w.take();
}
std::string encode(const RefitDoneMessage& m) {
  FieldWriter w(kMessageWireVersion);
  w.integer(m.step);
  put_failure(w, m.failed);
  w.real(m.apply_s).real(m.pause_s);
  return w.take();
}
std::string encode(const AbortHeardMessage& m) { return dump({{"step", m.step}}); }
std::string encode(const BucketMessage& m) {
  return dump({{"slot", m.slot},
               {"step", m.step},
               {"bucket", m.bucket},
               {"bytes", m.bytes},
               {"meta", m.meta}});
}
std::string encode(const BucketDoneMessage& m) {
  return dump({{"slot", m.slot}, {"step", m.step}, {"bucket", m.bucket}});
}
std::string encode(const CommitMessage& m) { return dump({{"step", m.step}}); }
std::string encode(const CommittedMessage& m) {
  return dump({{"step", m.step},
               {"apply_s", m.apply_s},
               {"pause_s", m.pause_s},
               {"checksums", m.checksums},
               {"checksum_sums", m.checksum_sums ? pair_sums_json(*m.checksum_sums) : Json()}});
}
std::string encode(const VerifiedMessage& m) {
  return dump({{"step", m.step}, {"failed", failure_json(m.failed)}});
}
std::string encode(const OutcomeMessage& m) {
  return dump({{"step", m.step}, {"failed", failure_json(m.failed)}});
}
std::string encode(const OutcomeHeardMessage& m) {
  return dump({{"step", m.step},
               {"valid", m.valid},
               {"weight_version", m.weight_version},
               {"pause_s", m.pause_s}});
}
std::string encode(const ShutdownMessage&) { return dump(Json::object()); }
std::string encode(const LeavingMessage&) { return dump(Json::object()); }
std::string encode(const RelayedMessage& m) {
  Json answers = Json::array();
  for (const RelayedAnswer& a : m.answers)
    answers.push_back(Json::array({a.from, static_cast<int>(a.type), a.payload}));
  return dump({{"answers", std::move(answers)}});
}

std::string encode(const RoutesMessage& m) {
  Json routes = Json::array();
  for (const RouteMetadata& r : m.routes)
    routes.push_back(Json::array({r.round, r.param, r.row, r.col, r.rows, r.cols, r.offset, r.count,
                                  r.param_step, r.row_step, r.col_step}));
  return dump({{"routes", std::move(routes)}});
}

Result<RoutesMessage> decode_routes(const std::string& payload, const std::string& from) {
  Reader r(payload, "routes", from);
  if (!r.status().ok()) return r.status();
  auto it = r.json().find("routes");
  if (it == r.json().end() || !it->is_array())
    return protocol_error(fmt::format("routes message from {} has no array 'routes'", from));
  RoutesMessage m;
  for (std::size_t i = 0; i < it->size(); ++i) {
    const Json& e = (*it)[i];
    bool ok = e.is_array() && e.size() == 11 && e[0].is_number_integer() && e[1].is_string();
    for (std::size_t k = 2; ok && k < 11; ++k)
      ok = e[k].is_number_integer() && (k >= 8 || e[k].get<std::int64_t>() >= 0);
    if (!ok || e[0].get<std::int64_t>() < 0)
      return protocol_error(fmt::format(
          "routes message from {}: route {} is not [round, param, row, col, rows, cols, offset, "
          "count, param_step, row_step, col_step] with integers (non-negative up to count)",
          from, i));
    m.routes.push_back(RouteMetadata{.round = e[0].get<int>(),
                                     .param = e[1].get<std::string>(),
                                     .row = e[2].get<std::int64_t>(),
                                     .col = e[3].get<std::int64_t>(),
                                     .rows = e[4].get<std::int64_t>(),
                                     .cols = e[5].get<std::int64_t>(),
                                     .offset = e[6].get<std::int64_t>(),
                                     .count = e[7].get<std::int64_t>(),
                                     .param_step = e[8].get<std::int64_t>(),
                                     .row_step = e[9].get<std::int64_t>(),
                                     .col_step = e[10].get<std::int64_t>()});
  }
  return m;
}

Result<HelloMessage> decode_hello(const std::string& payload, const std::string& from) {
  Reader r(payload, "hello", from);
  HelloMessage m;
  r.get("refit_version", m.refit_version);
  r.get("engine_rank", m.engine_rank);
  r.get("plan_hash", m.plan_hash);
  r.get("routes_digest", m.routes_digest);
  r.get("total_parameters", m.total_parameters);
  r.get("settings", m.settings);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<std::map<std::string, std::string>> decode_stamp_settings(const std::string& payload,
                                                                 const std::string& from) {
  Reader r(payload, "version stamp", from);
  std::map<std::string, std::string> settings;
  r.get("settings", settings);
  if (!r.status().ok()) return r.status();
  return settings;
}

Result<BeginMessage> decode_begin(const std::string& payload, const std::string& from) {
  Reader r(payload, "begin", from);
  BeginMessage m;
  r.get("step", m.step);
  r.get("version", m.version);
  r.get("verify", m.verify);
  r.get("raw", m.raw);
  r.get("buckets", m.buckets);
  if (!r.status().ok()) return r.status();
  return m;
}

namespace {

// refit.delta's bases in a paused message: an array of [trainer rank, digest | null], each rank
// at most once.
Status decode_delta_bases(const Json& j, const char* field, const std::string& from,
                          std::vector<DeltaBase>& out) {
  auto bad = [&](const std::string& what) {
    return protocol_error(fmt::format("paused message from {}: field '{}' {}", from, field, what));
  };
  const auto it = j.find(field);
  if (it == j.end())
    return protocol_error(fmt::format("paused message from {} has no field '{}'", from, field));
  if (!it->is_array()) return bad("is not an array");
  for (const Json& e : *it) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() || e[0].get<int>() < 0 ||
        !(e[1].is_null() || e[1].is_string()))
      return bad("has an entry other than [trainer rank, digest or null]");
    DeltaBase b{.rank = e[0].get<int>()};
    if (e[1].is_string()) b.digest = e[1].get<std::string>();
    for (const DeltaBase& x : out)
      if (x.rank == b.rank) return bad(fmt::format("names rank {} twice", b.rank));
    out.push_back(std::move(b));
  }
  return Status::Ok();
}

}  // namespace

Status check_step(const std::string& who, const std::string& from, std::string_view what, int got,
                  int step) {
  if (got == step) return Status::Ok();
  return protocol_error(
      fmt::format("{}: {} sent {} of refit step {} in step {}", who, from, what, got, step));
}

Result<PausedMessage> decode_paused(const std::string& payload, const std::string& from) {
  Reader r(payload, "paused", from);
  PausedMessage m;
  r.get("step", m.step);
  r.get_failure("refused", m.refused);
  r.get("delta_version", m.delta_version);
  if (r.status().ok())
    REFIT_RETURN_IF_ERROR(
        decode_delta_bases(r.json(), "delta_bases", from, m.delta_bases));
  if (r.status().ok() && m.delta_version.empty() && !m.delta_bases.empty())
    return protocol_error(
        fmt::format("paused message from {} offers delta bases of no weight version", from));
  if (r.status().ok() && !r.json().contains("direct"))
    return protocol_error(fmt::format("paused message from {} has no field 'direct'", from));
  if (r.status().ok() && r.has("direct")) {
    const Json& direct = r.json()["direct"];
    if (!direct.is_object())
      return protocol_error(
          fmt::format("paused message from {}: field 'direct' is not an object", from));
    Reader d(Reader::Nested{}, direct, "paused.direct", from);
    ExportedParams e;
    d.get("digest", e.digest);
    d.get("elided", e.elided);
    if (!e.elided) {
      d.get("handle", e.handle);
      d.get("bytes", e.bytes);
      d.get("offsets", e.offsets);
      d.get("handles", e.handles);
    }
    if (!d.status().ok()) return d.status();
    m.direct = std::move(e);
  }
  if (!r.status().ok()) return r.status();
  return m;
}

Result<ProceedMessage> decode_proceed(const std::string& payload, const std::string& from) {
  Reader r(payload, "proceed", from);
  ProceedMessage m;
  r.get("step", m.step);
  r.get_failure("refused", m.refused);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<EnginesPausedMessage> decode_engines_paused(const std::string& payload,
                                                   const std::string& from) {
  FieldReader r(payload, "engines-paused", from, kMessageWireVersion);
  EnginesPausedMessage m;
  std::size_t n = 0;
  if (r.integer("step", m.step) && get_failure(r, "refused", m.refused) &&
      r.count("exports", n)) {
    m.exports.reserve(n);
    for (std::size_t i = 0; i < n && r.maybe_text("exports", m.exports.emplace_back()); ++i) {
    }
  }
  if (r.status().ok() && get_offers(r, "delta", m.delta) && r.count("group_delta", n)) {
    for (std::size_t i = 0; i < n; ++i) {
      int rank = 0;
      if (!r.integer("group_delta", rank)) break;
      if (m.group_delta.contains(rank)) {
        r.fail("group_delta", fmt::format("names trainer rank {} twice", rank));
        break;
      }
      if (!get_offers(r, "group_delta", m.group_delta[rank])) break;
    }
  }
  REFIT_RETURN_IF_ERROR(r.finish());
  return m;
}

Result<SentMessage> decode_sent(const std::string& payload, const std::string& from) {
  FieldReader r(payload, "sent", from, kMessageWireVersion);
  SentMessage m;
  std::size_t n = 0;
  if (r.integer("step", m.step) && r.count("sums", n)) {
    for (std::size_t i = 0; i < n; ++i) {
      std::string target;
      std::uint64_t sum = 0, first = 0, second = 0;
      if (!r.text("sums", target) || !r.natural("sums", sum) || !r.natural("sums", first) ||
          !r.natural("sums", second))
        break;
      const PairSums sums(sum, first, second);
      if (!sums.valid()) {
        r.fail("sums", fmt::format("of '{}' are not three checksum sums below 2^61 - 1", target));
        break;
      }
      if (!m.sums.emplace(std::move(target), sums).second) {
        r.fail("sums", "names one target twice");
        break;
      }
    }
  }
  REFIT_RETURN_IF_ERROR(r.finish());
  return m;
}

Result<RefitDoneMessage> decode_refit_done(const std::string& payload, const std::string& from) {
  FieldReader r(payload, "refit-done", from, kMessageWireVersion);
  RefitDoneMessage m;
  // After the first problem every read fails: no need to test each.
  r.integer("step", m.step);
  get_failure(r, "failed", m.failed);
  r.real("apply_s", m.apply_s);
  r.real("pause_s", m.pause_s);
  REFIT_RETURN_IF_ERROR(r.finish());
  return m;
}

Result<AbortHeardMessage> decode_abort_heard(const std::string& payload, const std::string& from) {
  Reader r(payload, "abort-heard", from);
  AbortHeardMessage m;
  r.get("step", m.step);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<BucketMessage> decode_bucket(const std::string& payload, const std::string& from) {
  Reader r(payload, "bucket", from);
  BucketMessage m;
  r.get("slot", m.slot);
  r.get("step", m.step);
  r.get("bucket", m.bucket);
  r.get("bytes", m.bytes);
  r.get("meta", m.meta);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<BucketDoneMessage> decode_bucket_done(const std::string& payload, const std::string& from) {
  Reader r(payload, "bucket-done", from);
  BucketDoneMessage m;
  r.get("slot", m.slot);
  r.get("step", m.step);
  r.get("bucket", m.bucket);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<CommitMessage> decode_commit(const std::string& payload, const std::string& from) {
  Reader r(payload, "commit", from);
  CommitMessage m;
  r.get("step", m.step);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<CommittedMessage> decode_committed(const std::string& payload, const std::string& from) {
  Reader r(payload, "committed", from);
  CommittedMessage m;
  r.get("step", m.step);
  r.get("apply_s", m.apply_s);
  r.get("pause_s", m.pause_s);
  r.get("checksums", m.checksums);
  if (!r.status().ok()) return r.status();
  const auto sums = r.json().find("checksum_sums");
  if (sums == r.json().end())
    return protocol_error(
        fmt::format("committed message from {} has no field 'checksum_sums'", from));
  if (!sums->is_null()) {
    REFIT_ASSIGN_OR_RETURN(PairSums s,
                           pair_sums_from(*sums, "committed", "checksum_sums", from));
    m.checksum_sums = s;
  }
  return m;
}

Result<VerifiedMessage> decode_verified(const std::string& payload, const std::string& from) {
  Reader r(payload, "verified", from);
  VerifiedMessage m;
  r.get("step", m.step);
  r.get_failure("failed", m.failed);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<OutcomeMessage> decode_outcome(const std::string& payload, const std::string& from) {
  Reader r(payload, "outcome", from);
  OutcomeMessage m;
  r.get("step", m.step);
  r.get_failure("failed", m.failed);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<OutcomeHeardMessage> decode_outcome_heard(const std::string& payload,
                                                 const std::string& from) {
  Reader r(payload, "outcome-heard", from);
  OutcomeHeardMessage m;
  r.get("step", m.step);
  r.get("valid", m.valid);
  r.get("weight_version", m.weight_version);
  r.get("pause_s", m.pause_s);
  if (!r.status().ok()) return r.status();
  return m;
}

Result<ShutdownMessage> decode_shutdown(const std::string& payload, const std::string& from) {
  Reader r(payload, "shutdown", from);
  if (!r.status().ok()) return r.status();
  return ShutdownMessage{};
}

Result<LeavingMessage> decode_leaving(const std::string& payload, const std::string& from) {
  Reader r(payload, "leaving", from);
  if (!r.status().ok()) return r.status();
  return LeavingMessage{};
}

Result<RelayedMessage> decode_relayed(const std::string& payload, const std::string& from) {
  Reader r(payload, "relayed", from);
  if (!r.status().ok()) return r.status();
  const auto it = r.json().find("answers");
  if (it == r.json().end() || !it->is_array())
    return protocol_error(fmt::format("relayed message from {} has no array 'answers'", from));
  RelayedMessage m;
  for (const Json& e : *it) {
    if (!e.is_array() || e.size() != 3 || !e[0].is_string() || !e[1].is_number_unsigned() ||
        e[1].get<std::uint64_t>() > 255 ||
        !is_message_type(static_cast<std::uint8_t>(e[1].get<std::uint64_t>())) || !e[2].is_string())
      return protocol_error(fmt::format(
          "relayed message from {}: an entry of 'answers' is not [sender, message type, payload]",
          from));
    m.answers.push_back(RelayedAnswer{.from = e[0].get<std::string>(),
                                      .type = static_cast<MessageType>(e[1].get<std::uint64_t>()),
                                      .payload = e[2].get<std::string>()});
  }
  return m;
}

std::string encode_pair_checksums(const std::map<std::string, std::string>& by_peer) {
  std::string out;
  for (const auto& [peer, sum] : by_peer) {
    if (!out.empty()) out += ',';
    out += peer;
    out += '=';
    out += sum;
  }
  return out;
}

Result<std::map<std::string, std::string>> decode_pair_checksums(const std::string& encoded,
                                                                 const std::string& from) {
  std::map<std::string, std::string> out;
  std::size_t at = 0;
  while (at < encoded.size()) {
    std::size_t end = encoded.find(',', at);
    if (end == std::string::npos) end = encoded.size();
    const std::string_view one(encoded.data() + at, end - at);
    const std::size_t eq = one.rfind('=');
    if (eq == std::string_view::npos || eq == 0 || eq + 1 == one.size() ||
        !out.emplace(std::string(one.substr(0, eq)), std::string(one.substr(eq + 1))).second)
      return protocol_error(
          fmt::format("checksums from {}: '{}' is not one <peer>=<checksum> of a peer named once",
                      from, log::escape(std::string(one.substr(0, 80)))));
    at = end + 1;
  }
  return out;
}

}  // namespace refit
