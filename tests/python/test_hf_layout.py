"""The engine -> Hugging Face copy plan (refit._hf_layout) that refit.torch.engine_from_hf applies:
refit into TP-1 engine storage, split it into unfused HF tensors with NumPy, compare bit for bit
with the trainer's weights cast to bf16."""

import numpy as np
import pytest

import refit
from refit._hf_layout import apply_plan, hf_copy_plan
from refit_testing import Ranks, bf16_bits, hf_weights

MODELS = ["tiny-qwen3", "tiny-qwen2", "tiny-llama", "tiny-moe"]


@pytest.fixture(scope="module", params=MODELS)
def refitted(request):
    """One refit of step 1 into a TP-1 engine: (spec, engine params, engine arrays, full HF)."""
    ranks = Ranks(model=request.param)
    try:
        ranks.register_all()
        full = hf_weights(refit.model_spec(request.param), 1)
        for name, a in ranks.shards.items():
            a[...] = full[name]  # world size 1: the shard is the whole tensor
        thread, box = ranks.serve_in_thread()
        ranks.trainer.refit(1)
        ranks.trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        yield refit.model_spec(request.param), ranks.engine.params, ranks.params, full
    finally:
        ranks.close()


def test_plan_rebuilds_every_hf_tensor_bit_exact(refitted):
    spec, params, arrays, full = refitted
    shapes = dict(spec.tensors)
    plan = hf_copy_plan(spec.config, params, shapes)
    hf = {name: np.zeros(shape, np.uint16) for name, shape in shapes.items()}
    apply_plan(plan, arrays, hf)
    for name in shapes:
        np.testing.assert_array_equal(hf[name], bf16_bits(full[name]), err_msg=name)
    # Every HF tensor is written exactly once.
    assert sorted(op.hf for op in plan) == sorted(shapes)


@pytest.mark.parametrize("refitted", ["tiny-moe"], indirect=True)
def test_plan_for_fused_hf_experts(refitted):
    spec, params, arrays, full = refitted
    # transformers >= 5 keeps experts fused: gate_up_proj [E, 2I, H] = [gate; up], down_proj [E, H, I].
    shapes = {}
    E = spec.config["num_experts"]
    for name, shape in spec.tensors:
        if ".mlp.experts." not in name:
            shapes[name] = shape
            continue
        layer = name.split(".mlp.experts.")[0]
        i, h = spec.config["moe_intermediate_size"], spec.config["hidden_size"]
        shapes[f"{layer}.mlp.experts.gate_up_proj"] = (E, 2 * i, h)
        shapes[f"{layer}.mlp.experts.down_proj"] = (E, h, i)
    plan = hf_copy_plan(spec.config, params, shapes)
    hf = {name: np.zeros(shape, np.uint16) for name, shape in shapes.items()}
    apply_plan(plan, arrays, hf)
    layer = "model.layers.1"
    for e in range(E):
        gate = bf16_bits(full[f"{layer}.mlp.experts.{e}.gate_proj.weight"])
        up = bf16_bits(full[f"{layer}.mlp.experts.{e}.up_proj.weight"])
        down = bf16_bits(full[f"{layer}.mlp.experts.{e}.down_proj.weight"])
        np.testing.assert_array_equal(hf[f"{layer}.mlp.experts.gate_up_proj"][e], np.concatenate([gate, up]))
        np.testing.assert_array_equal(hf[f"{layer}.mlp.experts.down_proj"][e], down)


def test_plan_errors_name_the_parameter(refitted):
    spec, params, _, _ = refitted
    shapes = dict(spec.tensors)
    victim = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=victim):
        hf_copy_plan(spec.config, params, {k: v for k, v in shapes.items() if k != victim})
    wrong = dict(shapes, **{victim: (shapes[victim][0] + 1, shapes[victim][1])})
    with pytest.raises(ValueError, match=victim):
        hf_copy_plan(spec.config, params, wrong)
    with pytest.raises(ValueError, match="model.extra.weight"):
        hf_copy_plan(spec.config, params, dict(shapes, **{"model.extra.weight": (3,)}))
    with pytest.raises(ValueError, match="tp_size: 1"):
        hf_copy_plan(spec.config, params, shapes, tp_size=2)
