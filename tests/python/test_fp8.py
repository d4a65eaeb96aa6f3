"""FP8 refits checked against a NumPy reference quantizer (docs/fp8.md), written here from the
documented semantics alone: scale = amax / 448 per block (1 where that is 0), code =
saturate(round-to-nearest-even(x / scale)) as float8 e4m3fn, float32 arithmetic.

Each test runs `refit run --verify --dump` (real processes on loopback) and compares what the
engine ranks hold, read from the dumped safetensors, with the reference applied to the trainer's
tensors: FSDP2 chunks that cut blocks (world 3), TP slices, the HF-name layout, per-tensor scales,
a checkpoint's quantization_config with its ignore list, and a checkpoint holding NaN.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from typing import Dict, Tuple

import numpy as np
import pytest

from refit_testing import bf16_bits, refit_cli

CLI = refit_cli()
pytestmark = pytest.mark.skipif(CLI is None, reason="no refit CLI built (set REFIT_CLI)")

# ---------------------------------------------------------------------------------------------
# The reference quantizer


def _e4m3_magnitudes() -> np.ndarray:
    """The 127 finite non-negative e4m3fn values, by code 0..126 (0x7F is NaN)."""
    codes = np.arange(127)
    e, m = codes >> 3, codes & 7
    return np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))


_MAGNITUDES = _e4m3_magnitudes()


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes: nearest, ties to the even code, saturating at 448."""
    a = np.minimum(np.abs(y.astype(np.float64)), 448.0).ravel()
    hi = np.clip(np.searchsorted(_MAGNITUDES, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - _MAGNITUDES[lo], _MAGNITUDES[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    sign = np.signbit(y.ravel()).astype(np.int64) << 7
    return (pick | sign).astype(np.uint8).reshape(y.shape)


def quantize(x: np.ndarray, br: int, bc: int) -> Tuple[np.ndarray, np.ndarray]:
    """Blocks of br x bc (ragged at the ends): (codes uint8 [R, C], scales float32 [ceil, ceil])."""
    x = x.astype(np.float32)
    rows, cols = x.shape
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scales = np.empty((nbr, nbc), np.float32)
    codes = np.empty(x.shape, np.uint8)
    for i in range(nbr):
        for j in range(nbc):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = np.float32(np.max(np.abs(blk)))
            s = np.float32(amax / np.float32(448.0))
            s = np.float32(1.0) if s == 0 else s
            scales[i, j] = s
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3_codes((blk / s).astype(np.float32))
    return codes, scales


def test_reference_quantizer_rounds_ties_to_even_and_saturates():
    y = np.array([1.0625, -1.0625, 1.1875, 1.5 * 2.0**-9, 2.0**-10, 464.0, 1e9, -0.0, 0.0],
                 np.float32)
    # 1.0 is 0x38 (exponent 7, bias 7); 1.0625 ties between 1.0 and 1.125 and goes to the even
    # code, 1.1875 between 1.125 and 1.25 likewise; 2^-10 ties between 0 and 2^-9.
    assert e4m3_codes(y).tolist() == [0x38, 0xB8, 0x3A, 0x02, 0x00, 0x7E, 0x7E, 0x80, 0x00]
    codes, scales = quantize(np.zeros((4, 4), np.float32), 2, 2)
    assert scales.tolist() == [[1.0, 1.0], [1.0, 1.0]] and not codes.any()


# ---------------------------------------------------------------------------------------------
# safetensors, read and written with the standard library and NumPy

_DTYPES = {"F32": np.float32, "BF16": np.uint16, "F8_E4M3": np.uint8}


def read_safetensors(path: str) -> Dict[str, Tuple[str, np.ndarray]]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        arr = np.frombuffer(data[8 + n + lo:8 + n + hi], dtype=_DTYPES[t["dtype"]])
        out[name] = (t["dtype"], arr.reshape(t["shape"]))
    return out


def write_safetensors(path: str, tensors: Dict[str, np.ndarray]) -> None:
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---------------------------------------------------------------------------------------------
# Runs


def run_refit(tmp_path, yaml_text: str, expect_ok: bool = True) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    dump = tmp_path / "dump"
    r = subprocess.run([CLI, "run", str(cfg), "--verify", "--dump", str(dump)], capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    if expect_ok:
        assert r.returncode == 0, out
        assert "verified bit-exact against the FP8 reference quantizer" in out, out
    return out


def check_against_numpy(dump, block, ignored=()) -> int:
    """expected.safetensors (what refit's verification compares with) equals the NumPy reference
    over trainer.safetensors, tensor by tensor; returns the number of quantized weights."""
    trainer = read_safetensors(str(dump / "trainer.safetensors"))
    expected = read_safetensors(str(dump / "expected.safetensors"))
    quantized = 0
    for name, (dt, x) in trainer.items():
        if dt == "BF16":  # a bf16 trainer: its values widened exactly
            x = (x.astype(np.uint32) << 16).view(np.float32)
        else:
            assert dt == "F32", name
        linear = name.endswith("_proj.weight") and not any(i in name for i in ignored)
        edt, got = expected[name]
        if not linear:
            assert edt == "BF16", name
            np.testing.assert_array_equal(got, bf16_bits(x), err_msg=name)
            continue
        quantized += 1
        br, bc = block if block else x.shape
        codes, scales = quantize(x, br, bc)
        scale_name = name + ("_scale_inv" if block else "_scale")
        assert edt == "F8_E4M3", name
        np.testing.assert_array_equal(got, codes, err_msg=name)
        sdt, s = expected[scale_name]
        assert sdt == "F32"
        np.testing.assert_array_equal(s.reshape(-1), scales.reshape(-1), err_msg=scale_name)
    assert len(expected) == len(trainer) + quantized
    return quantized


def test_hf_layout_engines_hold_the_reference_codes_and_scales(tmp_path):
    # World 3 chunks tiny-qwen3's 64-row tensors at rows 22 and 44: they cut 16-row blocks, whose
    # amax the trainer ranks combine.
    run_refit(tmp_path, """
model: tiny-qwen3
policy: {backend: fsdp2, world_size: 3}
generation: {backend: sglang, tp_size: 2, layout: hf}
refit: {target_precision: fp8, buffer_size_bytes: 4096, fp8: {scheme: block, block: [16, 16]}}
""")
    dump = tmp_path / "dump"
    assert check_against_numpy(dump, (16, 16)) == 14
    # The engines hold the same bytes, under the checkpoint's names.
    expected = read_safetensors(str(dump / "expected.safetensors"))
    for g in range(2):
        engine = read_safetensors(str(dump / f"engine-{g}.safetensors"))
        assert set(engine) == set(expected)
        for name, (dt, a) in engine.items():
            assert dt == expected[name][0], name
            np.testing.assert_array_equal(a, expected[name][1], err_msg=f"engine {g} {name}")


def test_fused_tp_slices_and_per_tensor_scales(tmp_path):
    out = run_refit(tmp_path, """
model: tiny-moe
policy: {backend: fsdp2, world_size: 3, dtype: bfloat16}
generation: {backend: vllm, tp_size: 2}
refit: {target_precision: fp8, fp8: {scheme: tensor}}
""")
    dump = tmp_path / "dump"
    assert check_against_numpy(dump, None) > 0
    # w13 scales [E, 2] (gate, up) and qkv scales [3] (q, k, v), each the scale of its HF tensor.
    expected = read_safetensors(str(dump / "expected.safetensors"))
    engine = read_safetensors(str(dump / "engine-1.safetensors"))
    w13 = engine["model.layers.0.mlp.experts.w13_weight_scale"][1]
    for e in range(w13.shape[0]):
        for j, proj in enumerate(("gate_proj", "up_proj")):
            want = expected[f"model.layers.0.mlp.experts.{e}.{proj}.weight_scale"][1].reshape(-1)[0]
            assert w13[e, j] == want
    qkv = engine["model.layers.1.self_attn.qkv_proj.weight_scale"][1]
    for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        assert qkv[j] == expected[f"model.layers.1.self_attn.{proj}.weight_scale"][1].reshape(-1)[0]
    assert engine["model.layers.0.mlp.experts.w13_weight"][0] == "F8_E4M3"
    assert engine["model.layers.0.mlp.gate.weight"][0] == "BF16"  # the router stays bf16
    assert "weights quantized at the sender" in out


def _tiny_qwen3_dir(tmp_path, quantization, tensors) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": 1000, "tie_word_embeddings": False,
        "quantization_config": quantization}))
    write_safetensors(str(d / "model.safetensors"), tensors)
    return str(d)


def _tiny_qwen3_tensors(rng) -> Dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (1000, 64), "model.norm.weight": (64,),
              "lm_head.weight": (1000, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                       p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                       p + "mlp.down_proj.weight": (64, 96), p + "input_layernorm.weight": (64,),
                       p + "post_attention_layernorm.weight": (64,)})
    return {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in shapes.items()}


def test_checkpoint_quantization_config_with_extreme_blocks(tmp_path):
    rng = np.random.default_rng(7)
    t = _tiny_qwen3_tensors(rng)
    q = t["model.layers.0.self_attn.q_proj.weight"]
    # (The trainer's value after step s is the checkpoint's plus s times at most 1/64.)
    q[0:16, 0:32] = 3.0e38 * np.sign(rng.standard_normal((16, 32)))  # a very large block
    # Magnitudes from 2^-40 to 2^20 in one block: most codes come out subnormal or zero.
    q[16:32, 0:32] = np.ldexp(1.0, rng.integers(-40, 21, (16, 32))).astype(np.float32)
    out = run_refit(tmp_path, f"""
model: {_tiny_qwen3_dir(tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [16, 32],
                                    "modules_to_not_convert": ["model.layers.1.mlp"]}, t)}
policy: {{backend: fsdp2, world_size: 3}}
generation: {{backend: vllm, tp_size: 1}}
refit: {{target_precision: fp8, buffer_size_bytes: 4096}}
""")
    dump = tmp_path / "dump"
    assert check_against_numpy(dump, (16, 32), ignored=("model.layers.1.mlp.",)) == 11
    assert "config.json quantization_config" in out
    codes = read_safetensors(str(dump / "expected.safetensors"))["model.layers.0.self_attn.q_proj.weight"][1]
    subnormal = ((codes[16:32, 0:32] & 0x78) == 0).sum()
    assert subnormal > 100, subnormal


@pytest.mark.parametrize("world,when", [(3, "before"), (2, "in the pass")])
def test_a_checkpoint_holding_nan_is_refused_naming_the_block(tmp_path, world, when):
    """World 3 cuts v_proj's 32 rows at row 11: the NaN's block is scaled before the refit, which is
    refused before any byte moves. World 2 holds it whole: it is scaled in the quantizing pass, and
    the refit fails in flight."""
    t = _tiny_qwen3_tensors(np.random.default_rng(3))
    t["model.layers.1.self_attn.v_proj.weight"][20, 40] = np.nan
    out = run_refit(tmp_path, f"""
model: {_tiny_qwen3_dir(tmp_path, {"quant_method": "fp8", "weight_block_size": [16, 16]}, t)}
policy: {{backend: fsdp2, world_size: {world}}}
generation: {{backend: sglang, tp_size: 2}}
refit: {{target_precision: fp8, timeout_s: 10}}
""", expect_ok=False)
    assert "model.layers.1.self_attn.v_proj.weight holds NaN or inf in block (1, 2)" in out, out
    assert ("nothing was sent" if when == "before" else "the refit fails in flight") in out, out


def test_one_trainer_rank_scales_in_the_quantizing_pass(tmp_path):
    # The pair budget is buffer_size_bytes / 2 here (one trainer rank feeds both TP ranks at once):
    # 768 bytes, which keeps some blocks whole in a round (scaled in the pass) and cuts others.
    out = run_refit(tmp_path, """
model: tiny-qwen3
policy: {backend: fsdp2, world_size: 1, dtype: bfloat16}
generation: {backend: vllm, tp_size: 2}
refit: {target_precision: fp8, buffer_size_bytes: 1536, fp8: {block: [16, 16]}}
""")
    assert "scaled in the quantizing pass" in out and ", 0 scaled" not in out and ", 0 before" not in out
    check_against_numpy(tmp_path / "dump", (16, 16))


def test_a_refits_bytes_are_one_figure_everywhere(tmp_path):
    """The wire model is the one source of a refit's bytes. With fp8 they are the engine's codes,
    float32 scales and the tensors left in bfloat16: not one or two bytes per parameter. The
    figure of refit.check, of `refit check`, of the CLI's report, Trainer.bytes_per_refit and
    last_stats (the RefitStats the CLI's step line divides by the refit's seconds) is one, and it
    is what the engine rank counted arriving (world 1 -> TP 1: one copy of every parameter, less
    the vocabulary padding the engine holds and nothing writes)."""
    import threading

    import refit
    from refit_testing import free_port, fsdp2_shard, hf_weights

    yaml_text = """
model: tiny-qwen3
policy: {backend: fsdp2, world_size: 1, dtype: float32}
generation: {backend: vllm, tp_size: 1}
refit: {target_precision: fp8, timeout_s: 10, fp8: {block: [16, 16]}}
"""
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    cfg = refit.Config.from_yaml(str(path))
    figure = refit.check(cfg)["bytes_per_refit"]
    spec = refit.model_spec("tiny-qwen3")
    assert figure not in (spec.total_parameters, 2 * spec.total_parameters)

    checked = subprocess.run([CLI, "check", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f", {figure} bytes per refit," in checked.stdout, checked.stdout

    report = tmp_path / "r.json"
    ran = subprocess.run([CLI, "run", str(path), "--steps", "2", "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = json.loads(report.read_text())
    assert summary["bytes_per_refit"] == figure
    assert [r["bytes_received"] for r in summary["ranks"] if r["role"] == "engine"] == [figure]

    port = free_port()
    box = {}
    opened = threading.Thread(
        target=lambda: box.setdefault("engine", refit.Engine(cfg, 0, master_port=port)))
    opened.start()
    trainer = refit.Trainer(cfg, 0, master_port=port)
    opened.join(60)
    engine = box["engine"]
    try:
        size = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1}
        held = {p.name: np.zeros(p.shape, {1: np.uint8, 2: np.uint16, 4: np.float32}[size[p.dtype]])
                for p in engine.params}
        assert any(p.dtype == "float8_e4m3" for p in engine.params)
        assert sum(a.nbytes for a in held.values()) >= figure
        full = hf_weights(spec, 1)
        shards = {s.name: fsdp2_shard(full[s.name], 0, 1) for s in trainer.tensors}
        for name, a in shards.items():
            trainer.register(name, a)
        for name, a in held.items():
            engine.register(name, a)
        served = []
        t = threading.Thread(target=lambda: served.append(engine.serve_one(timeout=60)))
        t.start()
        trainer.refit(1)
        t.join(60)
        assert served == [True]
        assert trainer.bytes_per_refit == figure
        assert trainer.last_stats["bytes"] == figure
        assert engine.last_stats["bytes"] == figure
    finally:
        trainer.close()
        engine.close()
