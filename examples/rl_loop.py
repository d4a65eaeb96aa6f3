#!/usr/bin/env python3
"""A toy RL loop wired through refit: train step -> refit -> generate -> rollouts -> train step.

Every rank is a process on this machine, as in a real job:

* 2 trainer ranks hold FSDP2-style float32 shards (dim-0 chunks) of the tiny-qwen3 preset in
  NumPy arrays, registered with refit once (zero-copy). Each step they update the shards in place
  from the rollouts (a REINFORCE-like nudge of lm_head), then call ``trainer.refit(step)``.
* 1 engine (TP 1) holds the parameters in the engine layout as bf16 bit patterns (uint16 arrays)
  and serves refits; after each one it "generates" with the new weights (greedy decoding of a
  bigram model: embed_tokens then lm_head) and sends the rollouts, tagged with its weight
  version, back to the trainers.

Run it with an interpreter that has refit and NumPy (docs/rl-loop.md), e.g. after
``python3 -m venv --system-site-packages .venv && .venv/bin/python -m pip install .``:
``.venv/bin/python examples/rl_loop.py --steps 3``. No GPU needed. With PyTorch the same wiring is ``refit.torch.trainer_from_fsdp`` on the trainer side and
``refit.torch.engine_from_hf`` (or your engine's own parameters) on the engine side; see
docs/rl-loop.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys

try:
    import numpy as np
except ImportError:
    sys.exit(f"examples/rl_loop.py needs NumPy, which {sys.executable} does not have: run it with "
             "an interpreter that has NumPy and refit, e.g. a venv made with "
             "`python3 -m venv --system-site-packages .venv` from Debian's /usr/bin/python3 "
             "(python3-numpy) and `.venv/bin/python -m pip install .` (docs/rl-loop.md)")

try:
    import refit
except ImportError:
    sys.exit(f"examples/rl_loop.py needs refit, which {sys.executable} cannot import: install it "
             "with `python -m pip install .` from the refit checkout (docs/python.md)")

MODEL = "tiny-qwen3"
PROMPTS = [3, 14, 15, 92, 65, 35, 89, 79]  # first token of each rollout
NEW_TOKENS = 4
LEARNING_RATE = 0.5


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reward(token: int) -> float:
    """The toy task: emit even token ids."""
    return 1.0 if token % 2 == 0 else 0.0


# ----------------------------------------------------------------------------- trainer rank


def trainer_rank(cfg_yaml: str, rank: int, port: int, steps: int, rollouts, log) -> None:
    cfg = refit.Config.from_yaml(cfg_yaml)
    spec = refit.model_spec(cfg.model)
    full_shapes = dict(spec.tensors)
    rng = np.random.default_rng(1234)  # same initial policy on every rank
    with refit.Trainer(cfg, rank, master_port=port) as trainer:
        shards = {}
        for slot in trainer.tensors:
            full = (rng.standard_normal(full_shapes[slot.name]) * 0.1).astype(np.float32)
            chunk = -(-full.shape[0] // cfg.world_size)  # FSDP2: torch.chunk over dim 0
            shards[slot.name] = np.ascontiguousarray(full[rank * chunk : rank * chunk + slot.shape[0]])
            trainer.register(slot.name, shards[slot.name])  # once; refit reads it in place
        head = shards["lm_head.weight"]
        lo = rank * (-(-full_shapes["lm_head.weight"][0] // cfg.world_size))
        for step in range(1, steps + 1):
            trainer.refit(step)  # push the current policy; returns once the engine committed
            if rank == 0:
                stats = trainer.last_stats
                log.put(f"step {step}: refit {stats['bytes']} bytes in {stats['seconds'] * 1e3:.1f} ms")
            batch = rollouts[rank].get(timeout=cfg.timeout_s)  # generated with these weights
            assert batch["version"] == f"step-{step}", batch["version"]
            rewards = np.array([reward(t) for t in batch["tokens"]], np.float32)
            advantage = rewards - rewards.mean()
            # The "training step": in place, on this rank's rows of lm_head.
            for h, token, adv in zip(batch["hidden"], batch["tokens"], advantage):
                if lo <= token < lo + head.shape[0]:
                    head[token - lo] += LEARNING_RATE * adv * h
            if rank == 0:
                log.put(
                    f"step {step}: rollouts of weight version {batch['version']}: "
                    f"mean reward {rewards.mean():.3f}"
                )


# ----------------------------------------------------------------------------- engine rank


def generate(params, vocab: int):
    """Greedy decoding of a bigram model made of the engine's embed_tokens and lm_head."""
    embed = bf16_to_f32(params["model.embed_tokens.weight"][:vocab])
    head = bf16_to_f32(params["lm_head.weight"][:vocab])  # rows past vocab are padding
    tokens, hidden = [], []
    for token in PROMPTS:
        for _ in range(NEW_TOKENS):
            h = embed[token]
            token = int(np.argmax(head @ h))
            tokens.append(token)
            hidden.append(h)
    return tokens, hidden


def engine_rank(cfg_yaml: str, rank: int, port: int, rollouts, log) -> None:
    cfg = refit.Config.from_yaml(cfg_yaml)
    vocab = refit.model_spec(cfg.model).config["vocab_size"]
    with refit.Engine(cfg, rank, master_port=port) as engine:
        params = {p.name: np.zeros(p.shape, np.uint16) for p in engine.params}  # bf16 bits
        for name, a in params.items():
            engine.register(name, a)  # refit writes here during each refit
        engine.on_pause(lambda: log.put("engine: pause generation"))
        engine.on_resume(lambda: log.put(f"engine: resume at weight version {engine.weight_version}"))
        while engine.serve_one():  # False once the trainers shut down
            tokens, hidden = generate(params, vocab)
            for q in rollouts:
                q.put({"version": engine.weight_version, "tokens": tokens, "hidden": hidden})
    log.put("engine: trainers shut down")


# ----------------------------------------------------------------------------- launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    cfg = refit.Config.from_dict(
        {
            "model": MODEL,
            "policy": {"backend": "fsdp2", "world_size": 2, "dtype": "float32"},
            "generation": {"backend": "sglang", "colocated": False, "num_engines": 1, "tp_size": 1},
            "refit": {"target_precision": "bf16", "timeout_s": 30},
        }
    )
    print(f"config: {cfg}")
    print(f"check: {refit.check(cfg)['cell']}")
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    rollouts = [ctx.Queue() for _ in range(cfg.world_size)]
    port = free_port()
    text = cfg.to_yaml()
    procs = [
        ctx.Process(target=trainer_rank, args=(text, r, port, args.steps, rollouts, log))
        for r in range(cfg.world_size)
    ] + [ctx.Process(target=engine_rank, args=(text, 0, port, rollouts, log))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    while not log.empty():
        print(log.get())
    failed = [p for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        print(f"rl_loop: {len(failed)} rank(s) failed", file=sys.stderr)
        return 1
    print(f"rl_loop: ok, {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
