"""refit.Config, refit.check, refit.model_spec: round trips and errors that name the key."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import refit

TINY = {"model": "tiny-qwen3", "policy": {"world_size": 2}, "generation": {"tp_size": 2}}


def test_from_dict_fills_defaults_and_round_trips():
    cfg = refit.Config.from_dict(TINY)
    d = cfg.to_dict()
    assert d["model"] == "tiny-qwen3"
    assert d["policy"]["backend"] == "fsdp2" and d["policy"]["world_size"] == 2
    assert d["generation"]["weight_transfer_mode"] == "broadcast"
    assert d["refit"]["target_precision"] == "bfloat16"
    assert refit.Config.from_dict(d) == cfg
    assert refit.Config.from_yaml(cfg.to_yaml()) == cfg
    assert (cfg.world_size, cfg.tp_size, cfg.engine_ranks) == (2, 2, 2)
    assert cfg.engine_protocol == "sglang" and cfg.transfer_mode == "broadcast"


def test_from_yaml_text_file_and_pathlike(tmp_path):
    text = textwrap.dedent(
        """\
        model: tiny-llama
        generation: {backend: vllm, colocated: true, tp_size: 1, num_engines: 2}
        refit: {timeout_s: 5}
        """
    )
    from_text = refit.Config.from_yaml(text)
    assert from_text.transfer_mode == "ipc"  # derived from colocated
    assert from_text.source == ""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    from_file = refit.Config.from_yaml(str(path))
    assert from_file == from_text and from_file.source == str(path)
    assert refit.Config.from_yaml(path) == from_text  # os.PathLike
    assert from_text.timeout_s == 5.0


def test_default_is_the_cli_default():
    cfg = refit.Config.default()
    assert cfg.model == "qwen2.5-0.5b" and cfg.world_size == 2 and cfg.tp_size == 2


def test_replace_merges_nested_keys():
    cfg = refit.Config.from_dict(TINY).replace({"generation": {"backend": "vllm"}})
    assert cfg.engine_protocol == "vllm" and cfg.tp_size == 2 and cfg.model == "tiny-qwen3"


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(refit.SetupError) as info:
        refit.Config.from_dict({"policy": {"world_sise": 2}})
    e = info.value
    assert isinstance(e, refit.Error) and isinstance(e, RuntimeError)
    assert e.code == "invalid_argument"
    assert "policy.world_sise" in str(e) and 'did you mean "world_size"' in str(e)
    assert str(e).startswith("invalid argument: ")  # as the CLI prints it after "refit: error:"
    assert e.message == str(e)[len("invalid argument: ") :]


def test_bad_value_names_key_value_and_allowed():
    with pytest.raises(refit.SetupError) as info:
        refit.Config.from_dict({"generation": {"backend": "trt"}})
    assert "generation.backend" in str(info.value) and "trt" in str(info.value)
    assert "sglang" in str(info.value)  # what is allowed
    with pytest.raises(refit.SetupError, match="policy.world_size"):
        refit.Config.from_dict({"policy": {"world_size": "two"}})
    with pytest.raises(refit.SetupError, match="refit.timeout_s"):
        refit.Config.from_yaml("refit:\n  timeout_s: -1\n")


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(refit.SetupError, match="nope.yaml"):
        refit.Config.from_yaml(missing)


def test_values_that_are_not_yaml_are_type_errors():
    with pytest.raises(TypeError, match="refit.timeout_s"):
        refit.Config.from_dict({"refit": {"timeout_s": object()}})
    with pytest.raises(TypeError):
        refit.Config.from_yaml(42)


def test_check_summarises_a_valid_config():
    summary = refit.check(refit.Config.from_dict(TINY))
    assert summary["cell"] == "fsdp2 -> sglang, broadcast"
    assert summary["architecture"] == "Qwen3ForCausalLM"
    assert summary["processes"] == 4
    spec = refit.model_spec("tiny-qwen3")
    assert summary["parameters"] == spec.total_parameters
    assert summary["bytes_per_refit"] == 2 * spec.total_parameters


def test_check_rejects_cross_key_errors_with_the_key(tmp_path):
    # ipc needs colocated engines; the message names the keys.
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen3", "generation": {"weight_transfer_mode": "ipc", "colocated": False}}
    )
    with pytest.raises(refit.SetupError) as info:
        refit.check(cfg)
    assert "weight_transfer_mode" in str(info.value) or "colocated" in str(info.value)
    # An engine TP size that does not divide the heads.
    with pytest.raises(refit.SetupError, match="tp_size"):
        refit.check(refit.Config.from_dict({"model": "tiny-qwen3", "generation": {"tp_size": 3}}))
    # An unknown model names itself; from a file, the file too (as `refit check` does).
    path = tmp_path / "bad.yaml"
    path.write_text("model: no-such-model\n")
    with pytest.raises(refit.SetupError) as info:
        refit.check(refit.Config.from_yaml(path))
    assert info.value.code == "not_found"
    assert "no-such-model" in str(info.value) and str(path) in str(info.value)


def test_model_spec_and_presets():
    assert "tiny-qwen3" in refit.presets()
    spec = refit.model_spec("tiny-qwen3")
    assert spec.architecture == "Qwen3ForCausalLM"
    names = [n for n, _ in spec.tensors]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" in names
    total = 0
    for _, shape in spec.tensors:
        n = 1
        for dim in shape:
            n *= dim
        total += n
    assert total == spec.total_parameters == 189824
    assert spec.config["head_dim"] == 16 and spec.config["num_kv_heads"] == 2
    with pytest.raises(refit.SetupError, match="not-a-model"):
        refit.model_spec("not-a-model")


def test_support_matrix_lists_every_cell():
    cells = refit.support_matrix()
    assert len(cells) == 8 and all(c["supported"] for c in cells)
    assert {(c["policy"], c["engine"], c["weight_transfer_mode"]) for c in cells} == {
        (p, e, m) for p in ("fsdp2", "megatron") for e in ("sglang", "vllm") for m in ("ipc", "broadcast")
    }


def test_config_and_errors_pickle():
    cfg = refit.Config.from_dict(TINY)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    try:
        refit.Config.from_dict({"nope": 1})
    except refit.SetupError as e:
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is refit.SetupError
        assert (str(again), again.code, again.message) == (str(e), e.code, e.message)


def test_import_refit_does_not_import_torch():
    code = "import sys, refit; assert 'torch' not in sys.modules; print(refit.__version__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == refit.__version__
