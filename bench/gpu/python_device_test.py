#!/usr/bin/env python3
"""Device test of refit.torch with PyTorch + transformers: FSDP2 trainers -> transformers engines,
for many architectures built from config with random initialisation (docs/models.md).

For each case, W + 1 processes on this machine:

* trainer ranks (W = 2 when two GPUs are visible, else 1): a transformers model of the case's
  architecture in float32, wrapped with FSDP2 ``fully_shard`` (per decoder layer and the root) over
  W GPUs, trained a few AdamW steps on random tokens; after each step
  ``refit.torch.trainer_from_fsdp(...).refit(step)``. The tensor table comes from the module.
* engine: another instance of the same architecture (different random init, bfloat16, on GPU 0):
  - layout ``hf``: behind ``refit.torch.engine_from_hf`` (the weights by name; staged and copied
    in its on_load_weights hook with ``device: cpu``, written in place into the module with
    ``device: cuda``);
  - layout ``fused``: a plain ``refit.Engine`` with staging tensors in the vLLM layout (TP 1),
    for the architectures refit has a fused layout for.

Checks after every step: the engine's tensors equal the trainer's weights cast to bf16 bit for
bit (hf: the module's state dict; fused: the fused parameters against their expected TP-1 form),
and (hf) the engine module's logits equal transformers' own forward of a fresh model loaded with
those bf16 weights, exactly (same kernels). Architectures without a fused layout in refit
(GPT-NeoX, DeepSeek-V3) and transformers-5 MoE modules (experts fused into one tensor) run hf only.

With ``--delta on`` (or ``auto``) every refit after the first sends only what changed
(refit.delta, docs/delta.md) and the checks above hold for each step; ``--lr`` sets AdamW's
learning rate (default 1e-2; an RL run's 1e-6 to 1e-5 changes a few per cent of the bf16 values
per step), and the table adds per step the changed fraction and the wire bytes against the full
refit, from ``Trainer.traffic()``.

Usage: python3 bench/gpu/python_device_test.py [--cases a,b] [--steps 2] [--delta off|on|auto]
[--lr LR] [--json FILE]. Exit 0 when every case passed.
"""

from __future__ import annotations

import argparse
import glob
import json
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
            sys.exit(f"python_device_test: no refit module built for {sys.executable}")
    import refit

    return refit


SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)

# name: (transformers config class, model class, config kwargs, layouts, refit device)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True), ("hf", "fused"), "cpu"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False),
              ("hf", "fused"), "cpu"),
    "qwen3-cuda": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False),
                   ("hf",), "cuda"),
    # FSDP2 with CPUOffloadPolicy: the shards live in host memory; with device: cuda refit.torch
    # stages them on the GPU (none is registered in place).
    "qwen3-offload": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False),
                      ("hf",), "cuda"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=48, query_pre_attn_scalar=48),
               ("hf", "fused"), "cpu"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=32, num_key_value_heads=1), ("hf", "fused"), "cpu"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0),
             ("hf", "fused"), "cpu"),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=96, tie_word_embeddings=False), ("hf",), "cpu"),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       tie_word_embeddings=False), ("hf",), "cpu"),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=64, first_k_dense_replace=1, n_routed_experts=4,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                         q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=16, num_key_value_heads=4, tie_word_embeddings=False,
                         # as DeepSeek-V3's published config.json says (transformers 5 does not
                         # write it; refit refuses a config without it: docs/models.md)
                         topk_method="noaux_tc"), ("hf",), "cpu"),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(tie_word_embeddings=False), ("hf",), "cpu"),
}
TOKENS = [[1, 17, 256, 511, 3, 999, 42, 7, 128, 64, 300, 5]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(case: str, seed: int):
    import torch
    import transformers

    cfg_cls, model_cls, extra, _, _ = CASES[case]
    kwargs = dict(SMALL)
    kwargs.update(extra)
    if cfg_cls == "GPTNeoXConfig":
        kwargs.pop("num_key_value_heads")
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg.architectures = [model_cls]
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg)


def step_of(version: str) -> int:
    return int(re.findall(r"\d+", version)[-1])


def decoder_layers(model):
    for name in ("model", "gpt_neox"):
        inner = getattr(model, name, None)
        if inner is not None and hasattr(inner, "layers"):
            return inner.layers
    raise RuntimeError("no decoder layers found")


def expected_fused(state, name, shape):
    """The TP-1 vLLM form of fused parameter `name` from the HF state dict (test oracle)."""
    import torch

    def get(n):
        return state[n]

    if name.endswith("qkv_proj.weight") and name not in state:
        p = name[: -len("qkv_proj.weight")]
        return torch.cat([get(p + "q_proj.weight"), get(p + "k_proj.weight"), get(p + "v_proj.weight")])
    if name.endswith("qkv_proj.bias") and name not in state:
        p = name[: -len("qkv_proj.bias")]
        return torch.cat([get(p + "q_proj.bias"), get(p + "k_proj.bias"), get(p + "v_proj.bias")])
    if name.endswith("gate_up_proj.weight") and name not in state:
        p = name[: -len("gate_up_proj.weight")]
        return torch.cat([get(p + "gate_proj.weight"), get(p + "up_proj.weight")])
    t = get(name)
    if tuple(t.shape) != tuple(shape):  # vocabulary padded to a multiple of 64
        out = torch.zeros(shape, dtype=t.dtype)
        out[: t.shape[0]] = t
        return out
    return t


# ----------------------------------------------------------------------------- trainer ranks


def trainer_main(case, rank, world, cfg_yaml, port, steps, lr, delta, out_dir, q):
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        refit = import_refit()
        import refit.torch as rt

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        model = build_model(case, seed=1).to("cuda")
        mesh = init_device_mesh("cuda", (world,))
        shard = dict(mesh=mesh)
        if case.endswith("-offload"):
            shard.update(offload_policy=CPUOffloadPolicy())
        for layer in decoder_layers(model):
            fully_shard(layer, **shard)
        fully_shard(model, **shard)
        cfg = refit.Config.from_yaml(cfg_yaml)
        trainer = rt.trainer_from_fsdp(model, cfg, rank, master_port=port)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(3)
        report = {"zero_copy": len(trainer.zero_copy), "tensors": len(trainer.tensors), "steps": []}
        for step in range(1, steps + 1):
            ids = torch.randint(0, 1000, (4, 32), generator=gen).to("cuda")
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()
            trainer.refit(step)
            wall = time.perf_counter() - t0
            with torch.no_grad():
                full = {}
                for n, t in rt.module_tensors(model).items():
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t
                    full[n] = t.detach().to(torch.bfloat16).cpu()
            if rank == 0:
                torch.save({"bf16": full}, os.path.join(out_dir, f"trainer_{step}.pt"))
            entry = {"loss": float(loss.detach()), "refit_wall_s": wall}
            if rank == 0 and delta != "off":
                trainers = [t for t in trainer.traffic() if t["role"] == "trainer"]
                elements = sum(t["delta_elements"] for t in trainers)
                entry.update(
                    delta_pairs=sum(t["delta_pairs"] for t in trainers),
                    wire_bytes=sum(t["bytes_sent"] for t in trainers),
                    full_bytes=sum(t["full_bytes"] for t in trainers),
                    changed_fraction=(sum(t["delta_changed"] for t in trainers) / elements
                                      if elements else 0.0))
            report["steps"].append(entry)
        trainer.shutdown()
        trainer.close()
        dist.destroy_process_group()
        q.put((f"trainer{rank}", "ok", report))
    except BaseException as e:  # noqa: BLE001
        q.put((f"trainer{rank}", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- engine


def engine_main(case, layout, cfg_yaml, port, out_dir, q):
    try:
        import torch

        refit = import_refit()
        import refit.torch as rt

        torch.cuda.set_device(0)
        model = build_model(case, seed=2).to(device="cuda", dtype=torch.bfloat16).eval()
        cfg = refit.Config.from_yaml(cfg_yaml)
        tokens = torch.tensor(TOKENS, device="cuda")
        info = {}
        if layout == "hf":
            engine = rt.engine_from_hf(model, cfg, 0, master_port=port)
            info.update(zero_copy=len(engine.zero_copy), staged=len(engine.staging))
            serve = engine
        else:  # fused: refit's vLLM layout into staging tensors
            cfg = cfg.with_tensor_table(rt.tensor_table(rt.module_tensors(model)))
            serve = refit.Engine(cfg, 0, master_port=port)
            staging = {}
            for slot in serve.params:
                staging[slot.name] = torch.zeros(tuple(slot.shape), dtype=torch.bfloat16)
                serve.register(slot.name, staging[slot.name])
            info.update(fused_params=len(staging))
        served = 0
        while serve.serve_one():
            served += 1
            step = step_of(serve.weight_version)
            if layout == "hf":
                with torch.no_grad():
                    logits = model(input_ids=tokens).logits.float().cpu()
                state = {n: t.detach().cpu() for n, t in rt.module_tensors(model).items()}
                torch.save({"bf16": state, "logits": logits}, os.path.join(out_dir, f"engine_{step}.pt"))
            else:
                torch.save({"fused": {n: t.clone() for n, t in staging.items()}},
                           os.path.join(out_dir, f"engine_{step}.pt"))
        serve.close()
        q.put(("engine", "ok", {"served": served, **info}))
    except BaseException as e:  # noqa: BLE001
        q.put(("engine", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- checks


def compare(case, layout, out_dir, steps):
    import torch

    problems, details = [], []
    for step in range(1, steps + 1):
        tr = torch.load(os.path.join(out_dir, f"trainer_{step}.pt"))["bf16"]
        en = torch.load(os.path.join(out_dir, f"engine_{step}.pt"))
        if layout == "fused":
            bad = []
            for name, got in en["fused"].items():
                want = expected_fused(tr, name, got.shape)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    bad.append(name)
            if bad:
                problems.append(f"step {step}: {len(bad)} fused parameters differ, e.g. {bad[:3]}")
            details.append({"step": step, "fused_params": len(en["fused"]), "bitwise_equal": not bad})
            continue
        got = en["bf16"]
        if set(tr) != set(got):
            problems.append(f"step {step}: names differ: {sorted(set(tr) ^ set(got))[:4]}")
            continue
        bad = [n for n in tr if not torch.equal(tr[n].view(torch.int16), got[n].view(torch.int16))]
        if bad:
            problems.append(f"step {step}: {len(bad)} tensors differ bitwise, e.g. {bad[:3]}")
        ref = build_model(case, seed=5).to(device="cuda", dtype=torch.bfloat16).eval()
        missing, unexpected = ref.load_state_dict(tr, strict=False)
        tied = {"lm_head.weight", "embed_out.weight"}
        if unexpected or set(missing) - tied:
            problems.append(f"step {step}: reference load: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            ref_logits = ref(input_ids=torch.tensor(TOKENS, device="cuda")).logits.float().cpu()
        diff = (ref_logits - en["logits"]).abs().max().item()
        if not torch.equal(ref_logits, en["logits"]):
            problems.append(f"step {step}: engine logits differ from transformers' forward by {diff}")
        details.append({"step": step, "tensors": len(tr), "bitwise_equal": not bad,
                        "logits_equal": torch.equal(ref_logits, en["logits"]), "max_logit_diff": diff})
    return problems, details


def run_case(refit, case, layout, steps, world, delta="off", lr=1e-2):
    import torch

    _, model_cls, _, _, device = CASES[case]
    with tempfile.TemporaryDirectory(prefix=f"refit-{case}-") as tmp:
        model_dir = os.path.join(tmp, "model")
        # config.json only: the architecture and its sizes; the tables come from the modules.
        build_model(case, 0).config.save_pretrained(model_dir)
        w = 1 if device == "cuda" else world  # cuda: colocated, trainer and engine on GPU 0
        cfg = refit.Config.from_dict({
            "model": model_dir, "device": device,
            "policy": {"backend": "fsdp2", "world_size": w, "dtype": "float32"},
            "generation": {"backend": "vllm", "colocated": device == "cuda", "num_engines": 1,
                           "tp_size": 1, "layout": layout},
            "refit": {"target_precision": "bf16", "timeout_s": 300, "delta": delta},
        })
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port, text = free_port(), cfg.to_yaml()
        dist_port = free_port()
        procs = [ctx.Process(target=engine_main, args=(case, layout, text, port, tmp, q))]
        for r in range(w):
            procs.append(ctx.Process(target=trainer_main,
                                     args=(case, r, w, text, port, steps, lr, delta, tmp, q)))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results, errors = {}, []
        for _ in procs:
            try:
                role, status, payload = q.get(timeout=300)
            except Exception:  # noqa: BLE001
                errors.append("timed out waiting for the ranks")
                break
            (results.__setitem__(role, payload) if status == "ok" else errors.append(f"{role}: {payload}"))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        summary = {"case": case, "layout": layout, "device": device, "world": w,
                   "seconds": round(time.perf_counter() - t0, 1), **results}
        if errors:
            summary.update(passed=False, problems=errors)
            return summary
        problems, details = compare(case, layout, tmp, steps)
        if case.endswith("-offload") and results.get("trainer0", {}).get("zero_copy") != 0:
            problems.append("host shards of a device: cuda trainer were registered in place "
                            f"({results.get('trainer0', {}).get('zero_copy')} of them)")
        summary.update(passed=not problems, problems=problems, checks=details)
        return summary


def main() -> int:
    parser = argparse.ArgumentParser(description="refit.torch device test over many architectures")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--delta", default="off", choices=("off", "on", "auto"))
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--json")
    args = parser.parse_args()
    refit = import_refit()
    import torch
    import transformers

    world = min(2, torch.cuda.device_count())
    print(f"refit {refit.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, GPUs {torch.cuda.device_count()}, trainer world {world}",
          flush=True)
    summaries = []
    for case in args.cases.split(","):
        for layout in CASES[case][3]:
            s = run_case(refit, case, layout, args.steps, world, args.delta, args.lr)
            summaries.append(s)
            print(json.dumps(s, default=str), flush=True)
            print(f"{case} {layout}: {'PASS' if s['passed'] else 'FAIL'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2, default=str)
    print(f"{'case':14} {'layout':6} {'device':6} {'world':5} {'tensors':>7} {'bit-exact':>9} {'logits':>7} result")
    for s in summaries:
        c = (s.get("checks") or [{}])[-1]
        print(f"{s['case']:14} {s['layout']:6} {s.get('device', ''):6} {s.get('world', ''):5} "
              f"{c.get('tensors', c.get('fused_params', '')):>7} {str(c.get('bitwise_equal', '')):>9} "
              f"{str(c.get('logits_equal', '-')):>7} {'PASS' if s['passed'] else 'FAIL'}")
    if args.delta != "off":
        print(f"refit.delta {args.delta}, AdamW lr {args.lr}: per step, trainer rank 0's view of "
              "every trainer rank")
        print(f"{'case':14} {'layout':6} {'step':>4} {'pairs':>5} {'changed':>8} {'wire_bytes':>11} "
              f"{'full_bytes':>11} {'wire/full':>9} {'bit-exact':>9}")
        for s in summaries:
            checks = {c["step"]: c for c in s.get("checks", [])}
            for i, st in enumerate(s.get("trainer0", {}).get("steps", []), 1):
                if "wire_bytes" not in st:
                    continue
                print(f"{s['case']:14} {s['layout']:6} {i:>4} {st['delta_pairs']:>5} "
                      f"{100 * st['changed_fraction']:>7.3f}% {st['wire_bytes']:>11} "
                      f"{st['full_bytes']:>11} {st['wire_bytes'] / max(1, st['full_bytes']):>9.4f} "
                      f"{str(checks.get(i, {}).get('bitwise_equal', '')):>9}")
    failed = [f"{s['case']}/{s['layout']}" for s in summaries if not s["passed"]]
    print("python_device_test: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
