#!/usr/bin/env python3
"""Device test of the Python module with PyTorch + transformers: FSDP2 trainer -> HF engine.

For each case, two processes on this machine:

* trainer: an HF model (Qwen3ForCausalLM / LlamaForCausalLM from a small config, float32) wrapped
  with FSDP2 ``fully_shard`` on one GPU (a torch.distributed world of 1), trained for a few AdamW
  steps on random tokens; after each step ``refit.torch.trainer_from_fsdp(...).refit(step)``.
* engine: a second HF model instance of the same config (different random init, bfloat16, on the
  GPU) behind ``refit.torch.engine_from_hf`` (TP 1), serving the refits.

After every step the script checks that the engine model's state dict equals the trainer's
weights cast to bf16 bit for bit, that the engine's logits equal those of an HF model loaded with
those bf16 weights (same kernels), and that they agree with the trainer's float32 logits within
bf16 tolerance.

GPU tensors: in the ``qwen3``/``llama`` cases refit runs on its CPU data plane (``device: cpu``),
so the trainer's GPU shards are staged through pinned host copies refreshed before each refit, and
the engine's parameters through host staging copied to the GPU after each commit. The
``*-cuda-plane`` cases run ``device: cuda``: GPU shards are registered in place and refit's CUDA
data plane moves them (colocated, CUDA IPC). The ``*-cpu-trainer`` case keeps the trainer on the
CPU (FSDP2 over gloo), where its shards are registered zero-copy.

Needs: torch, transformers, and the refit module built for this interpreter, e.g.
    cmake -S . -B build-py -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
        -DREFIT_BUILD_TESTS=OFF && cmake --build build-py --target refit_python
The script finds build*/python/ next to it when `import refit` fails. No downloads.

Usage: python3 bench/gpu/python_device_test.py [--cases qwen3,llama,qwen3-cpu-trainer]
       [--steps 2] [--json FILE]. Exit 0 when every case passed.
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
            sys.exit(
                f"python_device_test: no refit module built for {sys.executable} "
                f"(_refit{suffix} under build*/python); build it with "
                "-DPython_EXECUTABLE=$(command -v python3) --target refit_python"
            )
    import refit

    return refit


CASES = {
    # name: (architecture, refit engine protocol, colocated, trainer device, refit device)
    "qwen3": ("Qwen3ForCausalLM", "sglang", False, "cuda", "cpu"),
    "llama": ("LlamaForCausalLM", "vllm", True, "cuda", "cpu"),
    "qwen3-cpu-trainer": ("Qwen3ForCausalLM", "sglang", False, "cpu", "cpu"),
    # refit's CUDA data plane: GPU shards registered in place, colocated over CUDA IPC (one GPU
    # cannot hold two ranks of one NCCL group, so no non-colocated cuda case here).
    "qwen3-cuda-plane": ("Qwen3ForCausalLM", "sglang", True, "cuda", "cuda"),
    "llama-cuda-plane": ("LlamaForCausalLM", "vllm", True, "cuda", "cuda"),
}
TOKENS = [[1, 17, 256, 511, 3, 999, 42, 7, 128, 64, 300, 5]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_config(arch: str):
    import transformers

    common = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
    else:  # Llama with tied embeddings: lm_head shares embed_tokens on both sides
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **common)
    cfg.architectures = [arch]
    return cfg


def build_model(arch: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, arch)
    return cls(hf_config(arch))


def step_of(version: str) -> int:
    return int(re.findall(r"\d+", version)[-1])


# ----------------------------------------------------------------------------- trainer process


def trainer_main(case: str, model_dir: str, cfg_yaml: str, port: int, steps: int, out_dir: str, q):
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        refit = import_refit()
        import refit.torch as rt

        arch, _, _, device, _ = CASES[case]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
        model = build_model(arch, seed=1).to(device)
        mesh = init_device_mesh(device, (1,))  # explicit: the default mesh would be CUDA's
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        cfg = refit.Config.from_yaml(cfg_yaml)
        trainer = rt.trainer_from_fsdp(model, cfg, 0, master_port=port)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(3)
        tokens = torch.tensor(TOKENS, device=device)
        report = {"zero_copy": len(trainer.zero_copy), "tensors": len(trainer.tensors), "steps": []}
        for step in range(1, steps + 1):
            ids = torch.randint(0, 1000, (4, 32), generator=gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            t0 = time.perf_counter()
            trainer.refit(step)  # returns once the engine committed (and copied into its model)
            wall = time.perf_counter() - t0
            with torch.no_grad():
                full = {
                    n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                    for n, p in model.named_parameters()
                }
                logits = model(input_ids=tokens).logits.float().cpu()
            torch.save(
                {
                    "bf16": {n: t.to(torch.bfloat16).cpu() for n, t in full.items()},
                    "logits_fp32": logits,
                },
                os.path.join(out_dir, f"trainer_{step}.pt"),
            )
            stats = trainer.last_stats
            report["steps"].append({"loss": float(loss), "refit_wall_s": wall, **stats})
        trainer.shutdown()
        trainer.close()
        dist.destroy_process_group()
        q.put(("trainer", "ok", report))
    except BaseException as e:  # noqa: BLE001
        q.put(("trainer", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- engine process


def engine_main(case: str, model_dir: str, cfg_yaml: str, port: int, out_dir: str, q):
    try:
        import torch

        refit = import_refit()
        import refit.torch as rt

        arch = CASES[case][0]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = build_model(arch, seed=2).to(device=device, dtype=torch.bfloat16).eval()
        cfg = refit.Config.from_yaml(cfg_yaml)
        engine = rt.engine_from_hf(model, cfg, 0, master_port=port)
        tokens = torch.tensor(TOKENS, device=device)
        events = []
        engine.on_pause(lambda: events.append(f"pause@{engine.weight_version}"))
        engine.on_resume(lambda: events.append(f"resume@{engine.weight_version}"))
        served = 0
        while engine.serve_one():  # the module holds the new weights once this returns
            served += 1
            with torch.no_grad():
                logits = model(input_ids=tokens).logits.float().cpu()
            torch.save(
                {
                    "bf16": {n: p.detach().cpu() for n, p in model.named_parameters()},
                    "logits": logits,
                    "version": engine.weight_version,
                },
                os.path.join(out_dir, f"engine_{step_of(engine.weight_version)}.pt"),
            )
        engine.close()
        q.put(("engine", "ok", {"served": served, "events": events, "plan_ops": len(engine.plan)}))
    except BaseException as e:  # noqa: BLE001
        q.put(("engine", "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ----------------------------------------------------------------------------- checks


def compare(case: str, out_dir: str, steps: int) -> list:
    import torch

    arch = CASES[case][0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problems = []
    details = []
    for step in range(1, steps + 1):
        tr = torch.load(os.path.join(out_dir, f"trainer_{step}.pt"))
        en = torch.load(os.path.join(out_dir, f"engine_{step}.pt"))
        if set(tr["bf16"]) != set(en["bf16"]):
            problems.append(
                f"step {step}: parameter names differ: trainer-only "
                f"{sorted(set(tr['bf16']) - set(en['bf16']))[:3]}, engine-only "
                f"{sorted(set(en['bf16']) - set(tr['bf16']))[:3]}"
            )
            continue
        bad = [n for n in tr["bf16"] if not torch.equal(tr["bf16"][n], en["bf16"][n])]
        if bad:
            problems.append(f"step {step}: {len(bad)} tensors differ bitwise, e.g. {bad[:3]}")
        # The same bf16 weights in a fresh HF model: identical kernels, identical logits.
        ref = build_model(arch, seed=5).to(device=device, dtype=torch.bfloat16).eval()
        missing, unexpected = ref.load_state_dict(tr["bf16"], strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # tied lm_head is not a parameter
            problems.append(f"step {step}: reference model load: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            ref_logits = ref(input_ids=torch.tensor(TOKENS, device=device)).logits.float().cpu()
        exact = torch.equal(ref_logits, en["logits"])
        max_ref = (ref_logits - en["logits"]).abs().max().item()
        max_fp32 = (tr["logits_fp32"] - en["logits"]).abs().max().item()
        scale = tr["logits_fp32"].abs().max().item()
        if max_ref > 1e-3 * max(1.0, scale):
            problems.append(f"step {step}: engine logits differ from the bf16 reference by {max_ref}")
        if not torch.allclose(en["logits"], tr["logits_fp32"], atol=5e-2 * max(1.0, scale), rtol=5e-2):
            problems.append(
                f"step {step}: engine logits differ from the fp32 trainer's by {max_fp32} "
                f"(logit scale {scale:.3f}), beyond bf16 tolerance"
            )
        details.append(
            {
                "step": step,
                "version": en["version"],
                "tensors": len(tr["bf16"]),
                "bitwise_equal": not bad,
                "logits_equal_bf16_reference": exact,
                "max_abs_diff_vs_bf16_reference": max_ref,
                "max_abs_diff_vs_fp32_trainer": max_fp32,
                "logit_scale": scale,
            }
        )
    return problems, details


def run_case(refit, case: str, steps: int) -> dict:
    arch, protocol, colocated, trainer_device, refit_device = CASES[case]
    with tempfile.TemporaryDirectory(prefix=f"refit-{case}-") as tmp:
        model_dir = os.path.join(tmp, "model")
        hf_config(arch).save_pretrained(model_dir)  # config.json only: refit reads the shapes
        cfg = refit.Config.from_dict(
            {
                "model": model_dir,
                "device": refit_device,  # cpu: host staging on refit's CPU data plane
                "policy": {"backend": "fsdp2", "world_size": 1, "dtype": "float32"},
                "generation": {"backend": protocol, "colocated": colocated, "num_engines": 1, "tp_size": 1},
                "refit": {"target_precision": "bf16", "timeout_s": 300},
            }
        )
        refit.check(cfg)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        text = cfg.to_yaml()
        procs = [
            ctx.Process(target=trainer_main, args=(case, model_dir, text, port, steps, tmp, q)),
            ctx.Process(target=engine_main, args=(case, model_dir, text, port, tmp, q)),
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results, errors = {}, []
        for _ in procs:
            try:
                role, status, payload = q.get(timeout=600)
            except Exception:  # noqa: BLE001
                errors.append("timed out waiting for the ranks")
                break
            (results.__setitem__(role, payload) if status == "ok" else errors.append(f"{role}: {payload}"))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        summary = {
            "case": case,
            "architecture": arch,
            "protocol": protocol,
            "transfer": "ipc" if colocated else "broadcast",
            "trainer_device": trainer_device,
            "seconds": time.perf_counter() - t0,
            **results,
        }
        if errors:
            summary.update(passed=False, problems=errors)
            return summary
        problems, details = compare(case, tmp, steps)
        summary.update(passed=not problems, problems=problems, checks=details)
        return summary


def main() -> int:
    parser = argparse.ArgumentParser(description="refit Python module device test")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", help="write the summaries here")
    args = parser.parse_args()
    refit = import_refit()
    import torch
    import transformers

    print(
        f"refit {refit.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"cuda {torch.cuda.is_available()}, build has CUDA {refit.accepts_device_memory(refit.Config.from_dict({'device': 'cuda'}))}",
        flush=True,
    )
    summaries = []
    for case in args.cases.split(","):
        if case not in CASES:
            sys.exit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        if CASES[case][3] == "cuda" and not torch.cuda.is_available():
            summaries.append({"case": case, "passed": False, "problems": ["no CUDA device"]})
            continue
        s = run_case(refit, case, args.steps)
        summaries.append(s)
        print(json.dumps(s, indent=2, default=str), flush=True)
        print(f"{case}: {'PASS' if s['passed'] else 'FAIL'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=2, default=str)
    failed = [s["case"] for s in summaries if not s["passed"]]
    print("python_device_test: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
