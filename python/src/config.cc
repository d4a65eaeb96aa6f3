// refit.Config, refit.check, refit.model_spec, refit.presets, refit.support_matrix.
#include <pybind11/stl.h>

#include <algorithm>
#include <filesystem>

#include "binding.h"
#include "errors.h"
#include "refit/model_spec.h"

namespace py = pybind11;

namespace refit::python {
namespace {

PyConfig parse_text(const std::string& text) {
  auto cfg = parse_config(text);
  raise_if_error(cfg.status());
  return PyConfig{std::move(cfg).value(), ""};
}

PyConfig parse_file(const std::string& path) {
  auto cfg = load_config_file(path);
  raise_if_error(cfg.status());
  return PyConfig{std::move(cfg).value(), path};
}

bool looks_like_path(const std::string& s) {
  if (s.find('\n') != std::string::npos) return false;
  std::error_code ec;
  if (std::filesystem::is_regular_file(s, ec)) return true;
  return s.ends_with(".yaml") || s.ends_with(".yml");
}

PyConfig from_yaml(const py::object& source) {
  if (py::isinstance<py::str>(source)) {
    const auto s = source.cast<std::string>();
    return looks_like_path(s) ? parse_file(s) : parse_text(s);
  }
  if (py::hasattr(source, "__fspath__"))
    return parse_file(py::module_::import("os").attr("fspath")(source).cast<std::string>());
  throw py::type_error(cat("Config.from_yaml takes YAML text or a path (str or os.PathLike), got ",
                           std::string(py::str(source.get_type().attr("__name__")))));
}

PyConfig from_dict(const py::object& d) {
  auto yaml = py::module_::import("refit._common").attr("dict_to_yaml")(d).cast<std::string>();
  return parse_text(yaml);
}

py::object to_dict(const PyConfig& c) {
  return py::module_::import("json").attr("loads")(config_to_json(c.config));
}

std::string transfer_label(const Config& c) {
  return std::string(transfer_mode_name(c.generation.weight_transfer_mode));
}

std::string repr(const PyConfig& c) {
  const Config& k = c.config;
  return cat("refit.Config(model='", k.model, "', ", policy_backend_name(k.policy.backend), " x",
             k.policy.world_size, " ", dtype_name(k.policy.dtype), " -> ",
             engine_protocol_name(k.generation.backend), " ", k.generation.num_engines, " x tp",
             k.generation.tp_size, ", ", transfer_label(k), ", ",
             dtype_name(k.refit.target_precision), ", ", device_name(k.device), ")");
}

ModelSpec load_spec(const PyConfig& c) {
  auto spec = config_model_spec(c.config);
  if (!spec.ok())
    raise_status(spec.status().with_context(c.source.empty() ? "model" : c.source + ": model"));
  return std::move(spec).value();
}

py::dict check(const PyConfig& c) {
  const ModelSpec spec = load_spec(c);
  const Status valid = validate_config(c.config, spec);
  if (!valid.ok()) raise_status(c.source.empty() ? valid : valid.with_context(c.source));
  const Config& k = c.config;
  py::dict out;
  out["supported"] = true;
  out["cell"] = cat(policy_backend_name(k.policy.backend), " -> ",
                    engine_protocol_name(k.generation.backend), ", ", transfer_label(k));
  std::string note;
  for (const MatrixCell& cell : support_matrix())
    if (cell.policy == k.policy.backend && cell.engine == k.generation.backend &&
        cell.mode == k.generation.weight_transfer_mode)
      note = cell.note;
  out["note"] = note;
  out["model"] = k.model;
  out["architecture"] = spec.config().architecture;
  out["tensors"] = spec.tensors().size();
  out["parameters"] = spec.total_parameters();
  out["trainer_ranks"] = k.policy.world_size;
  out["engine_ranks"] = k.engine_ranks();
  out["processes"] = k.policy.world_size + k.engine_ranks();
  out["bytes_per_refit"] = value_or_raise(bytes_per_refit(k, spec));
  return out;
}

py::dict model_config_dict(const ModelConfig& c) {
  py::dict d;
  d["architecture"] = c.architecture;
  d["hidden_size"] = c.hidden_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["intermediate_size"] = c.intermediate_size;
  d["vocab_size"] = c.vocab_size;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["attention_bias"] = c.attention_bias;
  d["qk_norm"] = c.qk_norm;
  d["num_experts"] = c.num_experts;
  d["num_experts_per_tok"] = c.num_experts_per_tok;
  d["moe_intermediate_size"] = c.moe_intermediate_size;
  d["decoder_sparse_step"] = c.decoder_sparse_step;
  d["mlp_only_layers"] = c.mlp_only_layers;
  d["norm_topk_prob"] = c.norm_topk_prob;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["rope_theta"] = c.rope_theta;
  return d;
}

}  // namespace

void bind_config(py::module_& m) {
  py::class_<PyConfig>(m, "Config", R"doc(
A resolved refit configuration (the YAML contract of docs/design.md §5.1, docs/config.md).

Build one with Config.from_yaml(path_or_text), Config.from_dict(d) or Config.default(); every
key is optional (absent -> default, present but invalid -> refit.SetupError naming the key, the
value and what is allowed). A Config is an immutable value: replace() returns a new one.
)doc")
      .def_static("from_yaml", &from_yaml, py::arg("source"), R"doc(
Parses a config from a YAML file or YAML text.

`source` is an os.PathLike, or a str: a str naming an existing file, or ending in .yaml/.yml
without a newline, is read as a file (errors name the path); any other str is YAML text.
Raises refit.SetupError on any invalid key or value.
)doc")
      .def_static("from_dict", &from_dict, py::arg("d"), R"doc(
Builds a config from a nested dict with the same keys as the YAML file, e.g.
{"model": "tiny-qwen3", "policy": {"world_size": 2}, "generation": {"tp_size": 2}}.
Raises refit.SetupError naming the key on an invalid value, TypeError on a value that is not
None/bool/int/float/str/list/dict.
)doc")
      .def_static(
          "default", [] { return parse_text(std::string(default_config_yaml())); },
          "The embedded default config of `refit run` (CPU, qwen2.5-0.5b, 2 FSDP2 trainer ranks, "
          "one "
          "SGLang engine with TP 2, broadcast).")
      .def("to_dict", &to_dict, "Every key, defaults filled in, as a nested dict.")
      .def(
          "to_yaml", [](const PyConfig& c) { return config_to_yaml(c.config); },
          "Every key, defaults filled in, as YAML text (what `refit check --print-config` prints).")
      .def(
          "replace",
          [](const PyConfig& c, const py::object& overrides) {
            py::object merged = py::module_::import("refit._common")
                                    .attr("replace_config_dict")(to_dict(c), overrides);
            PyConfig out = from_dict(merged);
            out.config.tensor_table = c.config.tensor_table;  // not a YAML key: carried over
            return out;
          },
          py::arg("overrides"),
          "A new Config: this one with the keys of the nested dict `overrides` replaced (a new "
          "generation.colocated without weight_transfer_mode derives the transfer mode again).")
      .def(
          "check", [](const PyConfig& c) { return check(c); }, "Same as refit.check(self).")
      .def_property_readonly(
          "source", [](const PyConfig& c) { return c.source; },
          "The file it was read from, or '' for YAML text and dicts.")
      .def_property_readonly(
          "model", [](const PyConfig& c) { return c.config.model; },
          "Preset name or HF model directory.")
      .def_property_readonly(
          "device", [](const PyConfig& c) { return std::string(device_name(c.config.device)); },
          "'cpu' or 'cuda'.")
      .def_property_readonly(
          "policy_backend",
          [](const PyConfig& c) {
            return std::string(policy_backend_name(c.config.policy.backend));
          },
          "'fsdp2' or 'megatron'.")
      .def_property_readonly(
          "world_size", [](const PyConfig& c) { return c.config.policy.world_size; },
          "Trainer ranks (policy.world_size).")
      .def_property_readonly(
          "policy_dtype",
          [](const PyConfig& c) { return std::string(dtype_name(c.config.policy.dtype)); },
          "Trainer master dtype: 'float32' or 'bfloat16'.")
      .def_property_readonly(
          "engine_protocol",
          [](const PyConfig& c) {
            return std::string(engine_protocol_name(c.config.generation.backend));
          },
          "'sglang' or 'vllm' (generation.backend).")
      .def_property_readonly(
          "transfer_mode", [](const PyConfig& c) { return transfer_label(c.config); },
          "'broadcast' (non-colocated) or 'ipc' (colocated).")
      .def_property_readonly(
          "colocated", [](const PyConfig& c) { return c.config.generation.colocated; },
          "generation.colocated.")
      .def_property_readonly(
          "num_engines", [](const PyConfig& c) { return c.config.generation.num_engines; },
          "generation.num_engines.")
      .def_property_readonly(
          "tp_size", [](const PyConfig& c) { return c.config.generation.tp_size; },
          "Engine tensor parallelism (generation.tp_size).")
      .def_property_readonly(
          "engine_ranks", [](const PyConfig& c) { return c.config.engine_ranks(); },
          "num_engines * tp_size.")
      .def_property_readonly(
          "target_precision",
          [](const PyConfig& c) {
            return std::string(dtype_name(c.config.refit.target_precision));
          },
          "Engine parameter dtype (refit.target_precision).")
      .def_property_readonly(
          "timeout_s", [](const PyConfig& c) { return c.config.refit.timeout_s; },
          "Bound on every wait (refit.timeout_s).")
      .def_property_readonly(
          "layout",
          [](const PyConfig& c) { return std::string(engine_layout_name(c.config.generation.layout)); },
          "Engine layout (generation.layout): 'fused' (the engine's own TP-sharded parameters) or "
          "'hf' (every tensor whole under its Hugging Face name, on every TP rank).")
      .def_property_readonly(
          "tensor_table",
          [](const PyConfig& c) {
            py::list out;
            for (const auto& [name, shape] : c.config.tensor_table)
              out.append(py::make_tuple(name, py::tuple(py::cast(shape))));
            return out;
          },
          "The explicit tensor table [(name, shape), ...] (with_tensor_table), or [] when the "
          "model's own table is used.")
      .def(
          "with_tensor_table",
          [](const PyConfig& c, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& table) {
            PyConfig out = c;
            out.config.tensor_table = table;
            return out;
          },
          py::arg("table"), R"doc(
A copy of this config whose model tensors are `table`: [(name, global shape), ...], e.g. a module's
state dict (refit.torch does this). `model` still names the preset or config.json (architecture,
tie_word_embeddings): with an architecture refit knows the table must list exactly its tensors;
with any other it is the table (natural name order; a tied lm_head.weight is left out). Every rank
of a refit must use the same table (compared at setup).
)doc")
      .def("__repr__", &repr)
      .def("__eq__",
           [](const PyConfig& a, const py::object& b) {
             if (!py::isinstance<PyConfig>(b)) return false;
             const Config& o = b.cast<const PyConfig&>().config;
             return config_to_json(a.config) == config_to_json(o) &&
                    a.config.tensor_table == o.tensor_table;
           })
      .def("__hash__",
           [](const PyConfig& c) {
             return py::hash(py::make_tuple(py::str(config_to_json(c.config)),
                                            c.config.tensor_table.size()));
           })
      .def(py::pickle(
          [](const PyConfig& c) {
            return py::make_tuple(config_to_yaml(c.config), c.source,
                                  py::cast(c.config.tensor_table));
          },
          [](const py::tuple& t) {
            PyConfig c = parse_text(t[0].cast<std::string>());
            c.source = t[1].cast<std::string>();
            if (t.size() > 2)
              c.config.tensor_table =
                  t[2].cast<std::vector<std::pair<std::string, std::vector<std::int64_t>>>>();
            return c;
          }));

  m.def("check", &check, py::arg("config"), R"doc(
Validates a config at setup, as `refit check` does: the model (preset or directory), every
cross-key rule and the support matrix. Returns a summary dict (cell, note, model, architecture,
tensors, parameters, trainer_ranks, engine_ranks, processes, bytes_per_refit); raises
refit.SetupError with the CLI's message otherwise.
)doc");

  py::class_<ModelSpec>(m, "ModelSpec", R"doc(
The Hugging Face parameter table of a model (docs/design.md §6.1): HF names and shapes in state_dict order.
)doc")
      .def_property_readonly(
          "architecture",
          [](const ModelSpec& s) { return s.config().architecture; },
          "HF architecture, e.g. 'Qwen3ForCausalLM'.")
      .def_property_readonly(
          "source", [](const ModelSpec& s) { return s.source(); },
          "Preset name or model directory.")
      .def_property_readonly(
          "config", [](const ModelSpec& s) { return model_config_dict(s.config()); },
          "The parsed config.json as a dict (hidden_size, num_layers, num_heads, num_kv_heads, "
          "head_dim, intermediate_size, vocab_size, tie_word_embeddings, num_experts, ...).")
      .def_property_readonly(
          "tensors",
          [](const ModelSpec& s) {
            py::list out;
            for (const TensorSpec& t : s.tensors())
              out.append(py::make_tuple(t.name, py::tuple(py::cast(t.shape))));
            return out;
          },
          "[(name, shape), ...] in HF state_dict order.")
      .def_property_readonly("total_parameters", &ModelSpec::total_parameters)
      .def("__len__", [](const ModelSpec& s) { return s.tensors().size(); })
      .def("__repr__", [](const ModelSpec& s) {
        return cat("refit.ModelSpec('", s.source(), "', ", s.config().architecture, ", ",
                   s.tensors().size(), " tensors, ", s.total_parameters(), " parameters)");
      });

  m.def(
      "model_spec",
      [](const py::object& model) {
        if (py::isinstance<PyConfig>(model)) return load_spec(model.cast<const PyConfig&>());
        auto spec = load_model_spec(model.cast<std::string>());
        raise_if_error(spec.status());
        return std::move(spec).value();
      },
      py::arg("model"),
      "The parameter table of a preset name or an HF model directory (like `refit spec`), or of "
      "a Config (its tensor_table when it has one).");

  m.def("presets", &preset_names, "Names of the built-in model presets, sorted.");

  m.def(
      "support_matrix",
      [] {
        py::list out;
        for (const MatrixCell& c : support_matrix()) {
          py::dict d;
          d["policy"] = std::string(policy_backend_name(c.policy));
          d["engine"] = std::string(engine_protocol_name(c.engine));
          d["weight_transfer_mode"] = std::string(transfer_mode_name(c.mode));
          d["colocated"] = c.mode == TransferMode::kIpc;
          d["supported"] = c.supported;
          d["note"] = c.note;
          out.append(d);
        }
        return out;
      },
      "The support matrix as this build knows it (`refit matrix --json` cells).");
}

}  // namespace refit::python
