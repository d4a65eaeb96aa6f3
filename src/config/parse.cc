// parse_config / load_config_file: YAML text -> Config, key by key.
//
// Rule: absent -> default, present but invalid -> error. Every error names the dotted key, the
// value as written (with its line) and what is allowed. yaml-cpp reports problems by throwing;
// its exceptions are caught here and never leave the library.
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <utility>

#include "common/file_io.h"
#include "config/support.h"
#include "refit/config.h"

namespace refit {
namespace {

std::string join(const std::vector<std::string_view>& items, std::string_view sep = ", ") {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : std::string(sep)) + std::string(s);
  return out;
}

// " (line N)" of a parsed node, or "" for nodes without a position. An empty value's mark points
// at the next token, often on a later line, so null nodes get none.
std::string where(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return {};
  const YAML::Mark mark = node.Mark();
  if (mark.is_null() || mark.line < 0) return {};
  return fmt::format(" (line {})", mark.line + 1);
}

// A node as the user wrote it: plain scalars bare, quoted ones in quotes, collections in flow.
std::string render(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      return node.Tag() == "!" ? fmt::format("\"{}\"", node.Scalar()) : node.Scalar();
    case YAML::NodeType::Sequence:
    case YAML::NodeType::Map: {
      YAML::Emitter e;
      e << YAML::Flow << node;
      std::string text = e.c_str();
      if (text.size() > 60) text = text.substr(0, 57) + "...";
      return fmt::format("a {} {}", node.IsMap() ? "mapping" : "sequence", text);
    }
  }
  return "?";
}

Status bad_value(std::string_view key, std::string_view problem, const YAML::Node& value,
                 std::string_view allowed) {
  return Status::InvalidArgument(fmt::format("{}: {}; got {}{}; allowed: {}", key, problem,
                                             render(value), where(value), allowed));
}

std::string dotted(std::string_view prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : fmt::format("{}.{}", prefix, key);
}

// Small edit distance, for "did you mean" on unknown keys.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The keys of one YAML mapping, checked against the keys allowed at that level.
class Section {
 public:
  // `prefix` is the dotted path of the mapping ("" at the top level).
  static Result<Section> open(const YAML::Node& node, std::string prefix,
                              std::vector<std::string_view> allowed) {
    Section s;
    s.prefix_ = std::move(prefix);
    const std::string level = s.prefix_.empty() ? "at the top level" : "under " + s.prefix_;
    for (const auto& entry : node) {
      const YAML::Node k = entry.first;
      if (!k.IsScalar())
        return bad_value(s.prefix_.empty() ? "config" : s.prefix_, "keys must be plain names", k,
                         "keys " + level + ": " + join(allowed));
      const std::string name = k.Scalar();
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        std::string hint;
        for (const auto& a : allowed)
          if (edit_distance(name, a) <= std::max<std::size_t>(2, a.size() / 3) ||
              (name.size() >= 3 &&
               (a.starts_with(name) || std::string_view(name).starts_with(a)))) {
            hint = fmt::format(" (did you mean \"{}\"?)", a);
            break;
          }
        return Status::InvalidArgument(fmt::format("unknown key \"{}\"{} — allowed keys {}: {}{}",
                                                   dotted(s.prefix_, name), where(k), level,
                                                   join(allowed), hint));
      }
      for (const auto& [seen, unused] : s.entries_)
        if (seen == name)
          return Status::InvalidArgument(fmt::format(
              "duplicate key \"{}\"{}; allowed: each key once", dotted(s.prefix_, name), where(k)));
      s.entries_.emplace_back(name, entry.second);
    }
    return s;
  }

  // The value of `key`, or nullopt when absent.
  std::optional<YAML::Node> get(std::string_view key) const {
    for (const auto& [name, value] : entries_)
      if (name == key) return value;
    return std::nullopt;
  }
  std::string key(std::string_view name) const { return dotted(prefix_, name); }

 private:
  std::string prefix_;
  std::vector<std::pair<std::string, YAML::Node>> entries_;
};

Status require_value(std::string_view key, const YAML::Node& v, std::string_view allowed) {
  if (v.IsNull()) return bad_value(key, "has no value", v, allowed);
  return Status::Ok();
}

// A scalar that YAML would read as a number or bool: plain, or explicitly tagged.
bool plain_scalar(const YAML::Node& v) { return v.IsScalar() && v.Tag() != "!"; }

Result<std::string> read_string(std::string_view key, const YAML::Node& v,
                                std::string_view allowed) {
  REFIT_RETURN_IF_ERROR(require_value(key, v, allowed));
  if (!v.IsScalar()) return bad_value(key, "expected a string", v, allowed);
  return v.Scalar();
}

template <typename E>
Result<E> read_enum(std::string_view key, const YAML::Node& v,
                    const std::vector<std::pair<std::string_view, E>>& names) {
  std::vector<std::string_view> spellings;
  for (const auto& [name, value] : names) spellings.push_back(name);
  const std::string allowed = join(spellings, " | ");
  REFIT_ASSIGN_OR_RETURN(std::string text, read_string(key, v, allowed));
  for (const auto& [name, value] : names)
    if (text == name) return value;
  return bad_value(key, "unknown value", v, allowed);
}

Result<std::int64_t> read_int(std::string_view key, const YAML::Node& v, const IntRule& rule) {
  REFIT_RETURN_IF_ERROR(require_value(key, v, rule.allowed));
  if (!plain_scalar(v)) return bad_value(key, "expected an integer", v, rule.allowed);
  std::string_view text = v.Scalar();
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range)
    return bad_value(key, "is out of range", v, rule.allowed);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty())
    return bad_value(key, "expected an integer", v, rule.allowed);
  REFIT_RETURN_IF_ERROR(check_int_rule(key, value, rule, where(v)));
  return value;
}

Result<bool> read_bool(std::string_view key, const YAML::Node& v) {
  constexpr std::string_view kAllowed = "true | false";
  REFIT_RETURN_IF_ERROR(require_value(key, v, kAllowed));
  if (plain_scalar(v)) {
    const std::string& t = v.Scalar();
    if (t == "true" || t == "True" || t == "TRUE") return true;
    if (t == "false" || t == "False" || t == "FALSE") return false;
  }
  return bad_value(key, "expected a boolean", v, kAllowed);
}

Result<double> read_seconds(std::string_view key, const YAML::Node& v) {
  REFIT_RETURN_IF_ERROR(require_value(key, v, kTimeoutAllowed));
  if (!plain_scalar(v)) return bad_value(key, "expected a number", v, kTimeoutAllowed);
  const std::string& t = v.Scalar();
  // Decimal notation only: no .inf / .nan / hex floats.
  const bool decimal = !t.empty() && t.find_first_not_of("0123456789.eE+-") == std::string::npos &&
                       t.find_first_of("0123456789") != std::string::npos;
  std::string_view text = t;
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (!decimal || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
    return bad_value(key, "expected a number", v, kTimeoutAllowed);
  REFIT_RETURN_IF_ERROR(check_timeout(key, value, where(v)));
  return value;
}

Result<std::uint64_t> read_seed(std::string_view key, const YAML::Node& v) {
  constexpr std::string_view kAllowed = "an integer from 0 to 18446744073709551615";
  REFIT_RETURN_IF_ERROR(require_value(key, v, kAllowed));
  if (!plain_scalar(v)) return bad_value(key, "expected a non-negative integer", v, kAllowed);
  std::string_view text = v.Scalar();
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  if (!text.empty() && text.front() == '-')
    return bad_value(key, "must be a non-negative integer", v, kAllowed);
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) return bad_value(key, "is out of range", v, kAllowed);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty())
    return bad_value(key, "expected a non-negative integer", v, kAllowed);
  return value;
}

Result<Section> open_section(const Section& parent, std::string_view name,
                             std::vector<std::string_view> allowed) {
  const std::string key = parent.key(name);
  const std::string what = "a mapping with keys " + join(allowed);
  auto node = parent.get(name);
  if (!node) return Section::open(YAML::Node(YAML::NodeType::Map), key, std::move(allowed));
  REFIT_RETURN_IF_ERROR(require_value(key, *node, what));
  if (!node->IsMap()) return bad_value(key, "expected a mapping", *node, what);
  return Section::open(*node, key, std::move(allowed));
}

Result<int> read_count(const Section& s, std::string_view name, int fallback, const IntRule& rule) {
  auto v = s.get(name);
  if (!v) return fallback;
  REFIT_ASSIGN_OR_RETURN(std::int64_t value, read_int(s.key(name), *v, rule));
  return static_cast<int>(value);
}

Status parse_policy(const Section& top, PolicyConfig& p) {
  REFIT_ASSIGN_OR_RETURN(
      Section s, open_section(top, "policy", {"backend", "world_size", "dtype", "megatron"}));
  if (auto v = s.get("backend")) {
    REFIT_ASSIGN_OR_RETURN(
        p.backend, read_enum<PolicyBackend>(
                       s.key("backend"), *v,
                       {{"fsdp2", PolicyBackend::kFsdp2}, {"megatron", PolicyBackend::kMegatron}}));
  }
  REFIT_ASSIGN_OR_RETURN(p.world_size, read_count(s, "world_size", p.world_size, kRankCountRule));
  if (auto v = s.get("dtype")) {
    REFIT_ASSIGN_OR_RETURN(p.dtype, read_enum<DType>(s.key("dtype"), *v,
                                                     {{"float32", DType::kFloat32},
                                                      {"fp32", DType::kFloat32},
                                                      {"bfloat16", DType::kBFloat16},
                                                      {"bf16", DType::kBFloat16}}));
  }
  if (s.get("megatron")) {
    REFIT_ASSIGN_OR_RETURN(Section m, open_section(s, "megatron", {"tp", "pp", "ep"}));
    auto& par = p.megatron;
    REFIT_ASSIGN_OR_RETURN(par.tp, read_count(m, "tp", par.tp, kRankCountRule));
    REFIT_ASSIGN_OR_RETURN(par.pp, read_count(m, "pp", par.pp, kRankCountRule));
    REFIT_ASSIGN_OR_RETURN(par.ep, read_count(m, "ep", par.ep, kRankCountRule));
    // With fsdp2 the block is tolerated only as the no-op {tp: 1, pp: 1, ep: 1} (the design
    // example carries it); anything else would be silently ignored, so it is an error.
    if (p.backend != PolicyBackend::kMegatron) {
      using Named = std::pair<const char*, int>;
      for (auto [name, value] :
           std::initializer_list<Named>{{"tp", par.tp}, {"pp", par.pp}, {"ep", par.ep}}) {
        if (value == 1) continue;
        return bad_value(
            m.key(name),
            fmt::format("only used with policy.backend: megatron (policy.backend is {})",
                        policy_backend_name(p.backend)),
            *m.get(name), "1, or remove policy.megatron, or set policy.backend: megatron");
      }
    }
  }
  return Status::Ok();
}

Status parse_generation(const Section& top, GenerationConfig& g) {
  REFIT_ASSIGN_OR_RETURN(Section s, open_section(top, "generation",
                                                 {"backend", "colocated", "weight_transfer_mode",
                                                  "num_engines", "tp_size", "layout"}));
  if (auto v = s.get("backend")) {
    REFIT_ASSIGN_OR_RETURN(
        g.backend, read_enum<EngineProtocol>(
                       s.key("backend"), *v,
                       {{"sglang", EngineProtocol::kSglang}, {"vllm", EngineProtocol::kVllm}}));
  }
  if (auto v = s.get("colocated")) {
    REFIT_ASSIGN_OR_RETURN(g.colocated, read_bool(s.key("colocated"), *v));
  }
  if (auto v = s.get("weight_transfer_mode")) {
    REFIT_ASSIGN_OR_RETURN(g.weight_transfer_mode,
                           read_enum<TransferMode>(s.key("weight_transfer_mode"), *v,
                                                   {{"broadcast", TransferMode::kBroadcast},
                                                    {"ipc", TransferMode::kIpc}}));
  } else {
    g.weight_transfer_mode = g.colocated ? TransferMode::kIpc : TransferMode::kBroadcast;
  }
  REFIT_ASSIGN_OR_RETURN(g.num_engines,
                         read_count(s, "num_engines", g.num_engines, kRankCountRule));
  REFIT_ASSIGN_OR_RETURN(g.tp_size, read_count(s, "tp_size", g.tp_size, kRankCountRule));
  if (auto v = s.get("layout")) {
    REFIT_ASSIGN_OR_RETURN(g.layout, read_enum<EngineLayout>(s.key("layout"), *v,
                                                             {{"fused", EngineLayout::kFused},
                                                              {"hf", EngineLayout::kHf}}));
  }
  return Status::Ok();
}

Status parse_refit(const Section& top, RefitConfig& r) {
  REFIT_ASSIGN_OR_RETURN(Section s, open_section(top, "refit",
                                                 {"target_precision", "buffer_size_bytes",
                                                  "num_buffers", "timeout_s", "executor",
                                                  "checksum", "keep_previous", "delta", "staged",
                                                  "fp8"}));
  if (auto v = s.get("target_precision")) {
    REFIT_ASSIGN_OR_RETURN(r.target_precision,
                           read_enum<DType>(s.key("target_precision"), *v,
                                            {{"bf16", DType::kBFloat16},
                                             {"bfloat16", DType::kBFloat16},
                                             {"fp8", DType::kFloat8E4M3},
                                             {"float8_e4m3", DType::kFloat8E4M3}}));
  }
  if (auto v = s.get("buffer_size_bytes")) {
    REFIT_ASSIGN_OR_RETURN(r.buffer_size_bytes,
                           read_int(s.key("buffer_size_bytes"), *v, kBufferSizeRule));
  }
  REFIT_ASSIGN_OR_RETURN(r.num_buffers,
                         read_count(s, "num_buffers", r.num_buffers, kNumBuffersRule));
  if (auto v = s.get("timeout_s")) {
    REFIT_ASSIGN_OR_RETURN(r.timeout_s, read_seconds(s.key("timeout_s"), *v));
  }
  if (auto v = s.get("executor")) {
    REFIT_ASSIGN_OR_RETURN(r.executor, read_enum<Executor>(s.key("executor"), *v,
                                                           {{"auto", Executor::kAuto},
                                                            {"peer", Executor::kPeer},
                                                            {"p2p", Executor::kP2p},
                                                            {"gather", Executor::kGather}}));
  }
  if (auto v = s.get("checksum")) {
    REFIT_ASSIGN_OR_RETURN(r.checksum, read_bool(s.key("checksum"), *v));
  }
  if (auto v = s.get("keep_previous")) {
    REFIT_ASSIGN_OR_RETURN(r.keep_previous, read_bool(s.key("keep_previous"), *v));
  }
  if (auto v = s.get("delta")) {
    REFIT_ASSIGN_OR_RETURN(r.delta, read_enum<DeltaMode>(s.key("delta"), *v,
                                                         {{"off", DeltaMode::kOff},
                                                          {"on", DeltaMode::kOn},
                                                          {"auto", DeltaMode::kAuto}}));
  }
  if (auto v = s.get("staged")) {
    REFIT_ASSIGN_OR_RETURN(r.staged, read_bool(s.key("staged"), *v));
  }
  if (s.get("fp8")) {
    REFIT_ASSIGN_OR_RETURN(Section f, open_section(s, "fp8", {"scheme", "block"}));
    r.fp8.given = true;
    if (auto v = f.get("scheme")) {
      REFIT_ASSIGN_OR_RETURN(r.fp8.scheme,
                             read_enum<Fp8Scheme>(f.key("scheme"), *v,
                                                  {{"block", Fp8Scheme::kBlock},
                                                   {"tensor", Fp8Scheme::kTensor}}));
    }
    if (auto v = f.get("block")) {
      constexpr std::string_view kAllowed = "two positive integers [rows, cols], e.g. [128, 128]";
      if (!v->IsSequence() || v->size() != 2)
        return bad_value(f.key("block"), "expected a list of two integers", *v, kAllowed);
      for (int i = 0; i < 2; ++i) {
        REFIT_ASSIGN_OR_RETURN(const std::int64_t n,
                               read_int(f.key("block"), (*v)[i], kFp8BlockRule));
        (i == 0 ? r.fp8.block_rows : r.fp8.block_cols) = n;
      }
    }
  }
  return Status::Ok();
}

Result<Config> parse_document(const YAML::Node& root) {
  Config c;
  // An empty document is a config with every key absent.
  if (root.IsNull()) return c;
  if (!root.IsMap())
    return bad_value("config", "expected a mapping at the top level", root,
                     "a mapping with keys model, device, seed, policy, generation, refit");
  REFIT_ASSIGN_OR_RETURN(
      Section top,
      Section::open(root, "", {"model", "device", "seed", "policy", "generation", "refit"}));
  if (auto v = top.get("model")) {
    constexpr std::string_view kAllowed = "a built-in preset name or an HF model directory";
    REFIT_ASSIGN_OR_RETURN(c.model, read_string("model", *v, kAllowed));
    if (c.model.empty()) return bad_value("model", "must not be empty", *v, kAllowed);
  }
  if (auto v = top.get("device")) {
    REFIT_ASSIGN_OR_RETURN(
        c.device,
        read_enum<Device>("device", *v, {{"cpu", Device::kCpu}, {"cuda", Device::kCuda}}));
  }
  if (auto v = top.get("seed")) {
    REFIT_ASSIGN_OR_RETURN(c.seed, read_seed("seed", *v));
  }
  REFIT_RETURN_IF_ERROR(parse_policy(top, c.policy));
  REFIT_RETURN_IF_ERROR(parse_generation(top, c.generation));
  REFIT_RETURN_IF_ERROR(parse_refit(top, c.refit));
  return c;
}

}  // namespace

Status check_int_rule(std::string_view key, std::int64_t value, const IntRule& rule,
                      std::string_view where) {
  if (value >= rule.min && value <= rule.max) return Status::Ok();
  // Open-ended rules ("must be >= 1") would read wrong for a value above the type's limit.
  const std::string problem = value > rule.max && rule.max >= kIntMax
                                  ? fmt::format("is too large (at most {})", rule.max)
                                  : std::string(rule.problem);
  return Status::InvalidArgument(
      fmt::format("{}: {}; got {}{}; allowed: {}", key, problem, value, where, rule.allowed));
}

Status check_timeout(std::string_view key, double value, std::string_view where) {
  if (std::isfinite(value) && value > 0 && value <= kMaxTimeoutS) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{}: must be > 0 and <= {} seconds; got {}{}; allowed: {}", key, kMaxTimeoutS,
                  value, where, kTimeoutAllowed));
}

Result<Config> parse_config(std::string_view yaml_text) {
  try {
    const YAML::Node root = YAML::Load(std::string(yaml_text));
    return parse_document(root);
  } catch (const YAML::Exception& e) {
    // Syntax errors (and anything else yaml-cpp throws) carry a position.
    if (!e.mark.is_null())
      return Status::InvalidArgument(fmt::format("config: invalid YAML at line {}, column {}: {}",
                                                 e.mark.line + 1, e.mark.column + 1, e.msg));
    return Status::InvalidArgument(fmt::format("config: invalid YAML: {}", e.msg));
  }
}

// A refit config is a few hundred bytes; anything past this is not one.
constexpr std::size_t kMaxConfigBytes = std::size_t{16} << 20;

Result<Config> load_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return Status::InvalidArgument(
        fmt::format("config file {} is a directory; allowed: a YAML file", path));
  auto text = read_regular_file(path, "config file", kMaxConfigBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound)
      return Status::NotFound(
          fmt::format("config file {} cannot be opened (missing or unreadable)", path));
    return text.status();
  }
  auto config = parse_config(*text);
  if (!config.ok()) return config.status().with_context(path);
  return config;
}

}  // namespace refit
