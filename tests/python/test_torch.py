"""refit.torch on CPU with plain (non-DTensor) modules, world size 1: zero-copy and staged trainer
registration, and an engine backed by an unfused HF-style module. Runs where torch is installed
(FSDP2 DTensors and GPUs: bench/gpu/python_device_test.py)."""

import os
import threading

import numpy as np
import pytest

if os.environ.get("REFIT_EXPECT_TORCH") == "1":  # CTest found torch at configure time
    import torch
else:
    torch = pytest.importorskip("torch")

import refit  # noqa: E402
from refit_testing import bf16_bits, free_port, hf_weights  # noqa: E402

rt = pytest.importorskip("refit.torch")


def module_from_spec(spec, dtype, step=None):
    """An nn.Module with exactly the HF parameter names and shapes of `spec` (values of `step`)."""
    root = torch.nn.Module()
    values = hf_weights(spec, step) if step is not None else None
    for name, shape in spec.tensors:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        t = torch.from_numpy(values[name]).to(dtype) if values else torch.zeros(shape, dtype=dtype)
        mod.register_parameter(leaf, torch.nn.Parameter(t))
    return root


def config(model):
    return refit.Config.from_dict(
        {"model": model, "policy": {"world_size": 1}, "generation": {"tp_size": 1},
         "refit": {"timeout_s": 10}}
    )


def start(trainer_module, engine_module, cfg):
    port = free_port()
    box = {}

    def make_engine():
        try:
            box["engine"] = rt.engine_from_hf(engine_module, cfg, 0, master_port=port)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=make_engine)
    thread.start()
    try:
        trainer = rt.trainer_from_fsdp(trainer_module, cfg, 0, master_port=port)
    finally:
        thread.join(timeout=30)
    assert "error" not in box, box.get("error")
    return trainer, box["engine"]


def serve(engine, box):
    def run():
        try:
            box["served"] = engine.serve()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def assert_module_is_bf16_of(engine_module, values):
    for name, p in engine_module.named_parameters():
        got = p.detach().view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(got, bf16_bits(values[name]), err_msg=name)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen2"])
def test_trainer_module_to_hf_engine_module(model):
    spec = refit.model_spec(model)
    trainer_module = module_from_spec(spec, torch.float32, step=1)
    # One non-contiguous parameter takes the staged path (copied before every refit).
    emb = trainer_module.model.embed_tokens
    emb.weight = torch.nn.Parameter(emb.weight.detach().t().contiguous().t())
    assert not emb.weight.is_contiguous()
    engine_module = module_from_spec(spec, torch.bfloat16)
    cfg = config(model)
    trainer, engine = start(trainer_module, engine_module, cfg)
    try:
        assert len(trainer.zero_copy) == len(trainer.tensors) - 1
        assert "model.embed_tokens.weight" not in trainer.zero_copy
        resumed = []
        engine.on_resume(lambda: resumed.append(engine.weight_version))
        box = {}
        thread = serve(engine, box)
        trainer.refit(1)
        # refit() returned after the engine copied the staging into its module.
        assert_module_is_bf16_of(engine_module, hf_weights(spec, 1))
        # Training updates the trainer's parameters in place (zero-copy) and by reassignment.
        step2 = hf_weights(spec, 2)
        with torch.no_grad():
            for name, p in trainer_module.named_parameters():
                if name != "model.norm.weight":
                    p.copy_(torch.from_numpy(step2[name]))
        norm = trainer_module.model.norm  # a new Parameter object with new storage
        norm.weight = torch.nn.Parameter(torch.from_numpy(step2["model.norm.weight"]).clone())
        trainer.refit(2)
        assert_module_is_bf16_of(engine_module, step2)
        assert resumed == ["step-1", "step-2"] and engine.weight_version == "step-2"
        trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2
    finally:
        trainer.close()
        engine.close()


def test_module_errors_name_the_parameter():
    spec = refit.model_spec("tiny-qwen3")
    cfg = config("tiny-qwen3")
    extra = module_from_spec(spec, torch.float32)
    extra.register_parameter("value_head", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(refit.SetupError, match="value_head"):
        rt.trainer_from_fsdp(extra, cfg, 0, master_port=free_port())  # before any rank starts
    with pytest.raises(refit.SetupError, match="tp_size"):
        rt.engine_from_hf(module_from_spec(spec, torch.bfloat16),
                          cfg.replace({"generation": {"tp_size": 2}}), 0, master_port=free_port())
    # Wrong dtype: policy.dtype is float32, the module is bf16.
    with pytest.raises(refit.SetupError, match="policy.dtype"):
        start(module_from_spec(spec, torch.bfloat16), module_from_spec(spec, torch.bfloat16), cfg)
