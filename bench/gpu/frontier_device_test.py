#!/usr/bin/env python3
"""Device test of the DeepSeek-V3 (MLA) and GLM-4.5 fused layouts with PyTorch + transformers.

For each case, transformers' DeepseekV3ForCausalLM or Glm4MoeForCausalLM is built from a small
config with random initialisation (float32, GPU 0), wrapped with FSDP2 ``fully_shard`` (world 1),
trained two AdamW steps, and refitted after each into one engine rank in the fused layout of vLLM
or SGLang (TP 1, colocated, ``device: cuda``), in bf16 or fp8 (128 x 128 blocks). Then:

* **bit-exact**: every engine parameter equals what the engines' loaders make of the trainer's
  weights (fused a-projection, qkv, gate_up, experts as w13 / w2, vocabulary padding), cast to
  bf16, kept in float32 where the engines keep it (the router's correction bias, GLM's router
  weight in vLLM), or quantized by torch's float8_e4m3fn (blocks: amax / 448, as
  bench/gpu/fp8_torch.py) with its scales;
* **the hook**: the engine's ``on_weights_changed`` hook hears every parameter name once per
  refit, and derives W_UK_T / W_UV from kv_b_proj there (as vLLM's process_weights_after_loading
  does);
* **logits**: a forward written here from the engine's parameters and those derived matrices, MLA
  in the absorbed form the engines decode with, against transformers' own forward of the same weights
  (the engine's bf16 values, fp8 dequantized as code x scale), in float32: relative error at most
  1e-4 of the largest logit (refit's --check-logits rule).

One trainer process and one engine process run every case in turn (one refit session each).
Usage: python3 bench/gpu/frontier_device_test.py [--cases a,b] [--json FILE]. Exit 0 when every
case passed.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import multiprocessing as mp
import os
import re
import socket
import sys
import sysconfig
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOLERANCE = 1e-4
TOKENS = [[1, 17, 256, 511, 3, 1000, 42, 7, 128, 64, 300, 5]]

_DS = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256,
           intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
           routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
           scoring_func="sigmoid", kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, vocab_size=1024, rope_theta=10000.0, rope_scaling=None,
           rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=256,
           tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0,
           hidden_act="silu")
_GLM = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=256,
            intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128, attention_bias=True,
            use_qk_norm=True, partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=1024, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
            num_nextn_predict_layers=0, hidden_act="silu")
# name: (config.json, engine protocol, target precision)
CASES = {
    "deepseek-vllm-bf16": (dict(_DS, q_lora_rank=128), "vllm", "bf16"),
    "deepseek-sglang-bf16": (dict(_DS, q_lora_rank=128), "sglang", "bf16"),
    "deepseek-vllm-fp8": (dict(_DS, q_lora_rank=128), "vllm", "fp8"),
    "deepseek-sglang-fp8": (dict(_DS, q_lora_rank=128), "sglang", "fp8"),
    "deepseek-lite-vllm-bf16": (dict(_DS, q_lora_rank=None), "vllm", "bf16"),
    "glm4-moe-vllm-bf16": (_GLM, "vllm", "bf16"),
    "glm4-moe-sglang-bf16": (_GLM, "sglang", "bf16"),
    "glm4-moe-vllm-fp8": (_GLM, "vllm", "fp8"),
}


def import_refit():
    try:
        import refit  # noqa: F401
    except ImportError:
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        env = os.environ.get("REFIT_PYTHONPATH")
        dirs = ([env] if env else []) + sorted(glob.glob(os.path.join(ROOT, "build*", "python")))
        for d in dirs:
            if glob.glob(os.path.join(d, "refit", "_refit" + suffix)):
                sys.path.insert(0, d)
                os.environ["PYTHONPATH"] = d + os.pathsep + os.environ.get("PYTHONPATH", "")
                break
        else:
            sys.exit(f"frontier_device_test: no refit module built for {sys.executable}")
    import refit

    return refit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(cfg_json: dict, seed: int):
    import torch
    import transformers

    cls = getattr(transformers, cfg_json["architectures"][0])
    cfg = cls.config_class.from_dict(dict(cfg_json))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    # The correction bias is a zero buffer after init: random values make it matter.
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def module_view(state: dict, name: str, experts: dict):
    """The tensor of HF name `name` from a module's tensors: itself, or (transformers 5 fuses
    the experts into mlp.experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]) its view."""
    if name in state:
        return state[name]
    m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    if not m:
        raise KeyError(f"the module has no tensor for {name}")
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":
        return experts[prefix + ".down_proj"][e]
    gate_up = experts[prefix + ".gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if kind == "gate" else gate_up[half:]


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ----------------------------------------------------------------------------- trainer


def trainer_main(cases, cfgs, ports, out_dir, q):
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        refit = import_refit()
        import refit.torch as rt

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        report = {}
        for case in cases:
            cfg_json = CASES[case][0]
            model = build_model(cfg_json, seed=1).to("cuda")
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            cfg = refit.Config.from_yaml(cfgs[case])
            trainer = refit.Trainer(cfg, 0, master_port=ports[case])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(3)

            def views():
                params = rt.module_tensors(model)
                state = {n: local(t).detach() for n, t in params.items()}
                experts = {n: v for n, v in state.items() if n.endswith((".gate_up_proj", ".down_proj"))}
                return {s.name: module_view(state, s.name, experts) for s in trainer.tensors}

            registered = views()
            for name, t in registered.items():
                trainer.register(name, t)
            steps = []
            for step in (1, 2):
                ids = torch.randint(0, cfg_json["vocab_size"], (2, 16), generator=gen).to("cuda")
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                now = views()
                moved = [n for n in now if now[n].data_ptr() != registered[n].data_ptr()]
                if moved:
                    raise RuntimeError(f"parameter storage moved after a step: {moved[:3]}")
                torch.cuda.synchronize()
                trainer.refit(step)
                torch.save({n: t.detach().float().cpu().clone() for n, t in now.items()},
                           os.path.join(out_dir, f"{case}-trainer-{step}.pt"))
                steps.append({"loss": float(loss), **trainer.last_stats})
            trainer.shutdown()
            trainer.close()
            report[case] = {"tensors": len(registered), "steps": steps}
            del model, opt
            torch.cuda.empty_cache()
        dist.destroy_process_group()
        q.put(("trainer", "ok", report))
    except BaseException as e:  # noqa: BLE001
        q.put(("trainer", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- engine


def engine_main(cases, cfgs, ports, out_dir, q):
    try:
        import torch

        refit = import_refit()
        import refit.torch as rt

        torch.cuda.set_device(0)
        report = {}
        for case in cases:
            cfg = refit.Config.from_yaml(cfgs[case])
            engine = refit.Engine(cfg, 0, master_port=ports[case])
            params = {}
            for slot in engine.params:
                params[slot.name] = torch.zeros(tuple(slot.shape), dtype=rt.torch_dtype(slot.dtype),
                                                device="cuda")
                engine.register(slot.name, params[slot.name])
            # What the engines derive after loading, redone in the weights_changed hook: MLA's
            # W_UK_T / W_UV from each layer's kv_b_proj (dequantized with fp8), as vLLM's
            # process_weights_after_loading does.
            derived, heard = {}, []
            mla = "kv_lora_rank" in CASES[case][0]

            def changed(names, params=params, derived=derived, heard=heard, mla=mla):
                heard.append(len(names) if list(names) == list(params) else -1)
                if not mla:
                    return
                deq = dequantized({n: params[n] for n in names if "kv_b_proj" in n})
                for n, w in deq.items():
                    derived[n] = absorb(w, CASES[case][0])

            engine.on_weights_changed(changed)
            served = 0
            while engine.serve_one():
                served += 1
                step = int(re.findall(r"\d+", engine.weight_version)[-1])
                torch.cuda.synchronize()
                torch.save({n: t.cpu().clone() for n, t in params.items()},
                           os.path.join(out_dir, f"{case}-engine-{step}.pt"))
                torch.save({n: (a.cpu().clone(), b.cpu().clone()) for n, (a, b) in derived.items()},
                           os.path.join(out_dir, f"{case}-derived-{step}.pt"))
            engine.close()
            report[case] = {"served": served, "params": len(params), "hook_names": heard}
        q.put(("engine", "ok", report))
    except BaseException as e:  # noqa: BLE001
        q.put(("engine", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- the oracle


def quantize(x, br=128, bc=128):
    from fp8_torch import torch_quantize

    if x.dim() == 3:  # experts: each expert's [rows, cols] on its own
        qs = [torch_quantize(x[e].cuda(), br, bc) for e in range(x.shape[0])]
        import torch

        return torch.stack([a for a, _ in qs]).cpu(), torch.stack([b for _, b in qs]).cpu()
    codes, scales = torch_quantize(x.cuda(), br, bc)
    return codes.cpu(), scales.cpu()


def expected_params(hf: dict, cfg_json: dict, protocol: str):
    """{engine name: float32 tensor} at TP 1, as vLLM's / SGLang's loaders lay the HF tensors out
    (models/deepseek_v2.py, glm4_moe.py; docs/models.md), before any cast."""
    import torch

    out = {}
    pad = lambda t: torch.cat([t, t.new_zeros(-(-t.shape[0] // 64) * 64 - t.shape[0], t.shape[1])])
    out["model.embed_tokens.weight"] = pad(hf["model.embed_tokens.weight"])
    out["lm_head.weight"] = pad(hf["lm_head.weight"])
    out["model.norm.weight"] = hf["model.norm.weight"]
    mla = "kv_lora_rank" in cfg_json
    for i in range(cfg_json["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
        a = p + "self_attn."
        if mla:
            if cfg_json.get("q_lora_rank"):
                fused = "fused_qkv_a_proj_with_mqa" if protocol == "sglang" else "fused_qkv_a_proj"
                out[a + fused + ".weight"] = torch.cat([hf[a + "q_a_proj.weight"],
                                                        hf[a + "kv_a_proj_with_mqa.weight"]])
                for n in ("q_a_layernorm.weight", "q_b_proj.weight"):
                    out[a + n] = hf[a + n]
            else:
                for n in ("q_proj.weight", "kv_a_proj_with_mqa.weight"):
                    out[a + n] = hf[a + n]
            for n in ("kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"):
                out[a + n] = hf[a + n]
        else:
            out[a + "qkv_proj.weight"] = torch.cat([hf[a + f"{x}_proj.weight"] for x in "qkv"])
            if cfg_json.get("attention_bias"):
                out[a + "qkv_proj.bias"] = torch.cat([hf[a + f"{x}_proj.bias"] for x in "qkv"])
            out[a + "o_proj.weight"] = hf[a + "o_proj.weight"]
            if cfg_json.get("use_qk_norm"):
                for n in ("q_norm.weight", "k_norm.weight"):
                    out[a + n] = hf[a + n]
        m = p + "mlp."
        if i < cfg_json["first_k_dense_replace"]:
            out[m + "gate_up_proj.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
            out[m + "down_proj.weight"] = hf[m + "down_proj.weight"]
            continue
        E = cfg_json["n_routed_experts"]
        out[m + "gate.weight"] = hf[m + "gate.weight"]
        out[m + "gate.e_score_correction_bias"] = hf[m + "gate.e_score_correction_bias"]
        out[m + "experts.w13_weight"] = torch.stack(
            [torch.cat([hf[f"{m}experts.{e}.gate_proj.weight"], hf[f"{m}experts.{e}.up_proj.weight"]])
             for e in range(E)])
        out[m + "experts.w2_weight"] = torch.stack([hf[f"{m}experts.{e}.down_proj.weight"] for e in range(E)])
        s = m + "shared_experts."
        out[s + "gate_up_proj.weight"] = torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]])
        out[s + "down_proj.weight"] = hf[s + "down_proj.weight"]
    return out


QUANTIZED = re.compile(r"(proj|w13_weight|w2_weight)(\.weight)?$")


def check_state(engine: dict, hf: dict, cfg_json: dict, protocol: str, precision: str):
    """Bit-exact comparison of every engine parameter; returns (problems, checked)."""
    import torch

    problems, checked = [], 0
    want = expected_params(hf, cfg_json, protocol)
    names = set(engine) - {n for n in engine if n.endswith("_scale_inv")}
    if names != set(want):
        return [f"engine parameters differ from the oracle's: {sorted(names ^ set(want))[:6]}"], 0
    for name, x in want.items():
        got = engine[name]
        checked += 1
        if got.dtype == torch.float32:
            ok = torch.equal(got, x)
        elif got.dtype == torch.bfloat16:
            ok = torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
        else:
            codes, scales = quantize(x)
            ok = torch.equal(got.view(torch.uint8), codes.view(torch.uint8))
            ok = ok and torch.equal(engine[name + "_scale_inv"], scales)
            checked += 1
        if not ok:
            problems.append(f"{name} ({got.dtype}) differs")
        if precision == "fp8" and got.dtype != torch.float8_e4m3fn and QUANTIZED.search(name) \
                and "gate.weight" not in name:
            problems.append(f"{name} is {got.dtype}, expected float8 with fp8")
    return problems, checked


def absorb(kv_b, cfg_json: dict):
    """W_UK_T [N, nope, L] and W_UV [N, L, v] from kv_b_proj [N (nope + v), L] (float32)."""
    N, Pn, Vd, L = (cfg_json["num_attention_heads"], cfg_json["qk_nope_head_dim"],
                    cfg_json["v_head_dim"], cfg_json["kv_lora_rank"])
    wkv = kv_b.float().T.reshape(L, N, Pn + Vd)
    return wkv[..., :Pn].permute(1, 2, 0).contiguous(), wkv[..., Pn:].transpose(0, 1).contiguous()


def dequantized(engine: dict):
    """Every engine parameter as float32: bf16 and float32 as they are, fp8 as code x scale."""
    import torch

    out = {}
    for name, t in engine.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.float()
            continue
        s = engine[name + "_scale_inv"].float()
        x = t.float()
        rep = s.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
        rep = rep[..., : x.shape[-2], : x.shape[-1]]
        out[name] = (x * rep).to(torch.bfloat16).float()
    return out


def hf_from_engine(p: dict, cfg_json: dict, protocol: str):
    """The HF tensors an engine's TP-1 parameters hold (the inverse of expected_params)."""
    out = {}
    V = cfg_json["vocab_size"]
    out["model.embed_tokens.weight"] = p["model.embed_tokens.weight"][:V]
    out["lm_head.weight"] = p["lm_head.weight"][:V]
    out["model.norm.weight"] = p["model.norm.weight"]
    mla = "kv_lora_rank" in cfg_json
    for i in range(cfg_json["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[pre + n] = p[pre + n]
        a = pre + "self_attn."
        if mla:
            Lq = cfg_json.get("q_lora_rank")
            if Lq:
                fused = p[a + ("fused_qkv_a_proj_with_mqa" if protocol == "sglang" else "fused_qkv_a_proj") + ".weight"]
                out[a + "q_a_proj.weight"], out[a + "kv_a_proj_with_mqa.weight"] = fused[:Lq], fused[Lq:]
                for n in ("q_a_layernorm.weight", "q_b_proj.weight"):
                    out[a + n] = p[a + n]
            else:
                for n in ("q_proj.weight", "kv_a_proj_with_mqa.weight"):
                    out[a + n] = p[a + n]
            for n in ("kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"):
                out[a + n] = p[a + n]
        else:
            d, nq, nkv = cfg_json["head_dim"], cfg_json["num_attention_heads"], cfg_json["num_key_value_heads"]
            sizes = [nq * d, nkv * d, nkv * d]
            for x, t in zip("qkv", p[a + "qkv_proj.weight"].split(sizes)):
                out[a + f"{x}_proj.weight"] = t
            for x, t in zip("qkv", p[a + "qkv_proj.bias"].split(sizes)):
                out[a + f"{x}_proj.bias"] = t
            out[a + "o_proj.weight"] = p[a + "o_proj.weight"]
            for n in ("q_norm.weight", "k_norm.weight"):
                out[a + n] = p[a + n]
        m = pre + "mlp."
        if i < cfg_json["first_k_dense_replace"]:
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = p[m + "gate_up_proj.weight"].chunk(2)
            out[m + "down_proj.weight"] = p[m + "down_proj.weight"]
            continue
        out[m + "gate.weight"] = p[m + "gate.weight"]
        out[m + "gate.e_score_correction_bias"] = p[m + "gate.e_score_correction_bias"]
        for e in range(cfg_json["n_routed_experts"]):
            g, u = p[m + "experts.w13_weight"][e].chunk(2)
            out[f"{m}experts.{e}.gate_proj.weight"], out[f"{m}experts.{e}.up_proj.weight"] = g, u
            out[f"{m}experts.{e}.down_proj.weight"] = p[m + "experts.w2_weight"][e]
        s = m + "shared_experts."
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = p[s + "gate_up_proj.weight"].chunk(2)
        out[s + "down_proj.weight"] = p[s + "down_proj.weight"]
    return out


# ----------------------------------------------------------------------------- the two forwards


def transformers_logits(cfg_json: dict, hf: dict):
    """transformers' forward (float32, eager attention) with the module's tensors set to `hf`."""
    import torch
    import refit.torch as rt

    model = build_model(cfg_json, seed=9).to("cuda").eval()
    tensors = rt.module_tensors(model)
    experts = {n: t for n, t in tensors.items() if n.endswith((".gate_up_proj", ".down_proj"))}
    with torch.no_grad():
        for name, value in hf.items():
            module_view(tensors, name, experts).copy_(value.to("cuda"))
        return model(input_ids=torch.tensor(TOKENS, device="cuda")).logits[0].float()


def rms(x, w, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def rope_tables(dim, theta, positions):
    import torch

    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cuda") / dim)
    ang = positions[:, None].double() * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rotate(x, cos, sin, interleaved):
    """RoPE over the last dim of x [T, ..., rd]: pairs (2i, 2i+1) or (i, i + rd/2), freq i."""
    import torch

    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
    c, s = cos.view(shape), sin.view(shape)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def causal_softmax(scores):
    import torch

    T = scores.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def route(logits, bias, cfg_json):
    """Sigmoid scores, corrected choice, group-limited top-k (transformers' DeepseekV3TopkRouter)."""
    import torch

    E, G, K = cfg_json["n_routed_experts"], cfg_json["n_group"], cfg_json["num_experts_per_tok"]
    scores = logits.sigmoid()
    choice = scores + bias
    group = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(cfg_json["topk_group"], dim=-1)[1], 1)
    keep = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
    idx = choice.masked_fill(~keep, 0.0).topk(K, dim=-1)[1]
    w = scores.gather(1, idx)
    if cfg_json.get("norm_topk_prob", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg_json["routed_scaling_factor"]


def engine_logits(p: dict, cfg_json: dict, protocol: str, derived: dict):
    """The forward from the engine's own TP-1 parameters (float32), MLA absorbed with the
    matrices its weights_changed hook derived (`derived`: kv_b_proj name -> (W_UK_T, W_UV))."""
    import torch

    c = cfg_json
    P = {n: t.to("cuda") for n, t in p.items()}
    tok = torch.tensor(TOKENS[0], device="cuda")
    T = tok.numel()
    pos = torch.arange(T, device="cuda")
    eps = c["rms_norm_eps"]
    x = P["model.embed_tokens.weight"][tok]
    mla = "kv_lora_rank" in c
    for i in range(c["num_hidden_layers"]):
        pre, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = rms(x, P[pre + "input_layernorm.weight"], eps)
        if mla:
            N, Pn, R, Vd, L = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                               c["v_head_dim"], c["kv_lora_rank"])
            Lq = c.get("q_lora_rank")
            if Lq:
                fused = P[a + ("fused_qkv_a_proj_with_mqa" if protocol == "sglang" else "fused_qkv_a_proj") + ".weight"]
                qkv_a = h @ fused.T
                q = rms(qkv_a[:, :Lq], P[a + "q_a_layernorm.weight"], eps) @ P[a + "q_b_proj.weight"].T
                kv = qkv_a[:, Lq:]
            else:
                q = h @ P[a + "q_proj.weight"].T
                kv = h @ P[a + "kv_a_proj_with_mqa.weight"].T
            q = q.view(T, N, Pn + R)
            latent = rms(kv[:, :L], P[a + "kv_a_layernorm.weight"], eps)
            cos, sin = rope_tables(R, c["rope_theta"], pos)
            k_pe = rotate(kv[:, L:], cos, sin, c.get("rope_interleave", True))
            q_pe = rotate(q[..., Pn:], cos, sin, c.get("rope_interleave", True))
            # The engine's derived state, from its weights_changed hook after this refit.
            w_uk_t, w_uv = (t.to("cuda") for t in derived[a + "kv_b_proj.weight"])
            ql = torch.einsum("tnp,npl->tnl", q[..., :Pn], w_uk_t)
            scores = (torch.einsum("tnl,sl->nts", ql, latent) + torch.einsum("tnr,sr->nts", q_pe, k_pe))
            prob = causal_softmax(scores * (Pn + R) ** -0.5)
            o = torch.einsum("nts,sl->tnl", prob, latent)
            v = torch.einsum("tnl,nlv->tnv", o, w_uv).reshape(T, N * Vd)
            attn = v @ P[a + "o_proj.weight"].T
        else:
            d, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
            qkv = h @ P[a + "qkv_proj.weight"].T + P[a + "qkv_proj.bias"]
            q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            q = rms(q.view(T, nq, d), P[a + "q_norm.weight"], eps)
            k = rms(k.view(T, nkv, d), P[a + "k_norm.weight"], eps)
            rd = int(d * c["partial_rotary_factor"])
            cos, sin = rope_tables(rd, c["rope_theta"], pos)
            q = torch.cat([rotate(q[..., :rd], cos, sin, False), q[..., rd:]], -1)
            k = torch.cat([rotate(k[..., :rd], cos, sin, False), k[..., rd:]], -1)
            k = k.repeat_interleave(nq // nkv, dim=1)
            v = v.view(T, nkv, d).repeat_interleave(nq // nkv, dim=1)
            prob = causal_softmax(torch.einsum("tnd,snd->nts", q, k) * d ** -0.5)
            attn = torch.einsum("nts,snd->tnd", prob, v).reshape(T, nq * d) @ P[a + "o_proj.weight"].T
        x = x + attn
        h = rms(x, P[pre + "post_attention_layernorm.weight"], eps)
        m = pre + "mlp."

        def mlp(hh, gate_up, down):
            g, u = (hh @ gate_up.T).chunk(2, dim=-1)
            return (torch.nn.functional.silu(g) * u) @ down.T

        if i < c["first_k_dense_replace"]:
            x = x + mlp(h, P[m + "gate_up_proj.weight"], P[m + "down_proj.weight"])
            continue
        idx, w = route(h @ P[m + "gate.weight"].T, P[m + "gate.e_score_correction_bias"], c)
        out = torch.zeros_like(h)
        for t_ in range(T):
            for j in range(idx.shape[1]):
                e = int(idx[t_, j])
                out[t_] += w[t_, j] * mlp(h[t_:t_ + 1], P[m + "experts.w13_weight"][e],
                                          P[m + "experts.w2_weight"][e])[0]
        s = m + "shared_experts."
        x = x + out + mlp(h, P[s + "gate_up_proj.weight"], P[s + "down_proj.weight"])
    x = rms(x, P["model.norm.weight"], eps)
    return (x @ P["lm_head.weight"].T)[:, : c["vocab_size"]]


# ----------------------------------------------------------------------------- driver


def config_yaml(refit, model_dir: str, protocol: str, precision: str) -> str:
    refit_keys = {"target_precision": precision, "timeout_s": 300}
    if precision == "fp8":
        refit_keys["fp8"] = {"scheme": "block", "block": [128, 128]}
    cfg = refit.Config.from_dict({
        "model": model_dir, "device": "cuda",
        "policy": {"backend": "fsdp2", "world_size": 1, "dtype": "float32"},
        "generation": {"backend": protocol, "colocated": True, "num_engines": 1, "tp_size": 1,
                       "layout": "fused"},
        "refit": refit_keys,
    })
    return cfg.to_yaml()


def main() -> int:
    parser = argparse.ArgumentParser(description="DeepSeek-V3 / GLM-4.5 fused layouts on the GPU")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json")
    args = parser.parse_args()
    refit = import_refit()
    import torch
    import transformers

    print(f"refit {refit.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, GPUs {torch.cuda.device_count()}", flush=True)
    cases = args.cases.split(",")
    summaries = []
    with tempfile.TemporaryDirectory(prefix="refit-frontier-") as tmp:
        cfgs, ports = {}, {}
        for case in cases:
            cfg_json, protocol, precision = CASES[case]
            model_dir = os.path.join(tmp, case)
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(cfg_json, f)
            cfgs[case] = config_yaml(refit, model_dir, protocol, precision)
            ports[case] = free_port()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = [ctx.Process(target=engine_main, args=(cases, cfgs, ports, tmp, q)),
                 ctx.Process(target=trainer_main, args=(cases, cfgs, ports, tmp, q))]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results, errors = {}, []
        for _ in procs:
            try:
                role, status, payload = q.get(timeout=540)
            except Exception:  # noqa: BLE001
                errors.append("timed out waiting for the ranks")
                break
            (results.__setitem__(role, payload) if status == "ok" else errors.append(f"{role}: {payload}"))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        print(f"ranks done in {time.perf_counter() - t0:.1f} s", flush=True)
        for case in cases:
            cfg_json, protocol, precision = CASES[case]
            s = {"case": case, "protocol": protocol, "precision": precision, "problems": list(errors)}
            s.update(results.get("trainer", {}).get(case, {}), **results.get("engine", {}).get(case, {}))
            for step in (1, 2):
                ep, tp = (os.path.join(tmp, f"{case}-{r}-{step}.pt") for r in ("engine", "trainer"))
                if not (os.path.exists(ep) and os.path.exists(tp)):
                    s["problems"].append(f"step {step}: no state saved")
                    continue
                engine, hf = torch.load(ep), torch.load(tp)
                derived = torch.load(os.path.join(tmp, f"{case}-derived-{step}.pt"))
                problems, checked = check_state(engine, hf, cfg_json, protocol, precision)
                s["problems"] += [f"step {step}: {p}" for p in problems]
                weights = hf_from_engine(dequantized(engine), cfg_json, protocol)
                with torch.no_grad():
                    want = transformers_logits(cfg_json, weights)
                    got = engine_logits(dequantized(engine), cfg_json, protocol, derived)
                err = ((got - want).abs().max() / (want.abs().max() + 1e-6)).item()
                if not math.isfinite(err) or err > TOLERANCE:
                    s["problems"].append(f"step {step}: logits differ by {err:.3g} (relative)")
                s[f"step{step}"] = {"checked": checked, "logit_error": err}
            # The hook heard every parameter once per refit (-1: other names).
            if s.get("hook_names") != [s.get("params")] * 2:
                s["problems"].append(f"weights_changed hook heard {s.get('hook_names')}, want "
                                     f"{s.get('params')} names per refit, twice")
            s["passed"] = not s["problems"]
            summaries.append(s)
            print(json.dumps(s, default=str), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2, default=str)
    print(f"{'case':24} {'params':>6} {'checked':>7} {'hook':>5} {'logit error':>11} result")
    for s in summaries:
        last = s.get("step2", {})
        hook = "ok" if s.get("hook_names") == [s.get("params")] * 2 else "BAD"
        print(f"{s['case']:24} {s.get('params', ''):>6} {last.get('checked', ''):>7} {hook:>5} "
              f"{last.get('logit_error', float('nan')):11.2e} {'PASS' if s['passed'] else 'FAIL'}")
    failed = [s["case"] for s in summaries if not s["passed"]]
    print("frontier_device_test: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
