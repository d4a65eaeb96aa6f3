"""Helpers for the Python tests: known trainer weights, the engine layout computed independently
in NumPy (docs/design.md §6.2 and §6.4), and refits run as real processes on loopback.

The expectations here do not use refit's layout code: they follow the rules of docs/design.md §6 directly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import re
import socket
import threading
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import refit

# ---------------------------------------------------------------------------------------------
# The CLI


def refit_cli() -> Optional[str]:
    """The `refit` CLI to test: $REFIT_CLI; else the one installed with the imported package
    (refit.cli_path()); else the one of the build tree whose package is imported
    (<build>/python/refit -> <build>/src/refit); else ./build/src/refit of this checkout. None
    when none exists."""
    if os.environ.get("REFIT_CLI"):  # asked for explicitly: that one or none
        c = os.environ["REFIT_CLI"]
        return c if os.path.isfile(c) and os.access(c, os.X_OK) else None
    installed = getattr(refit, "cli_path", None)
    if installed is not None and installed() is not None:
        return installed()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    package_build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(refit.__file__))))
    for c in (os.path.join(package_build, "src", "refit"), os.path.join(root, "build", "src", "refit")):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


# ---------------------------------------------------------------------------------------------
# Known weights


def free_port() -> int:
    """A port nothing binds now, below the host's ephemeral range (as `refit run` picks one): a
    port from that range can be taken, before the store binds it, by any outgoing connection of
    the host, the ranks' own connections to the store among them."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(20000, max(low, 20001))
        if 29400 <= port < 29600:  # torchrun's and refit's default ports
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_value(index: int, shape: Sequence[int], step: int) -> np.ndarray:
    """The full HF tensor number `index` after training step `step` (float32, deterministic).

    Multiples of 1/1024 scaled by an inexact factor: most values are not bf16-representable, so
    the cast's rounding is exercised.
    """
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    k = np.arange(n, dtype=np.int64)
    raw = (k * 7919 + index * 104729 + step * 31) % 2039 - 1019
    scale = 1.0 + step / 7.0 + index / 1000.0
    return (raw.astype(np.float64) / 1024.0 * scale).astype(np.float32).reshape(tuple(shape))


def hf_weights(spec: refit.ModelSpec, step: int) -> Dict[str, np.ndarray]:
    return {name: hf_value(i, shape, step) for i, (name, shape) in enumerate(spec.tensors)}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (no NaNs in these tests)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def fsdp2_shard(full: np.ndarray, rank: int, world: int) -> np.ndarray:
    """torch.chunk semantics over dim 0 (docs/design.md §6.2)."""
    n = full.shape[0]
    chunk = -(-n // world)
    lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
    return full[lo:hi]


# ---------------------------------------------------------------------------------------------
# Engine layout, from docs/design.md §6.4

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


# What the test engines fill their parameters with before the first refit. Refit never writes the
# vocabulary padding rows (they keep this value); any other element still holding it was missed.
ENGINE_FILL = 0xFFFF


def engine_expected(
    cfg: Dict[str, Any], hf: Dict[str, np.ndarray], name: str, tp: int, r: int, pad: Any = ENGINE_FILL
) -> np.ndarray:
    """Engine parameter `name` of TP rank r of tp, from full HF tensors (any dtype); vocabulary
    padding rows hold `pad`."""
    d, nq, nkv = cfg["head_dim"], cfg["num_heads"], cfg["num_kv_heads"]
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vp = -(-V // 64) * 64
        padded = np.full((vp, H), pad, hf[name].dtype)
        padded[:V] = hf[name]
        per = vp // tp
        return padded[r * per : (r + 1) * per]
    m = _LAYER.match(name)
    if not m:
        return hf[name]  # model.norm.weight
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    q_rows = nq // tp * d
    if tp <= nkv:
        kv_lo, kv_rows = r * (nkv // tp) * d, (nkv // tp) * d
    else:  # replicated kv heads: rank r holds head r*nkv/tp
        kv_lo, kv_rows = (r * nkv // tp) * d, d
    if rest.startswith("self_attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        q = hf[f"{p}self_attn.q_proj.{kind}"][r * q_rows : (r + 1) * q_rows]
        k = hf[f"{p}self_attn.k_proj.{kind}"][kv_lo : kv_lo + kv_rows]
        v = hf[f"{p}self_attn.v_proj.{kind}"][kv_lo : kv_lo + kv_rows]
        return np.concatenate([q, k, v], axis=0)
    if rest == "self_attn.o_proj.weight":
        cols = nq * d // tp
        return hf[p + rest][:, r * cols : (r + 1) * cols]
    if rest == "mlp.gate_up_proj.weight":
        i = cfg["intermediate_size"] // tp
        gate = hf[p + "mlp.gate_proj.weight"][r * i : (r + 1) * i]
        up = hf[p + "mlp.up_proj.weight"][r * i : (r + 1) * i]
        return np.concatenate([gate, up], axis=0)
    if rest == "mlp.down_proj.weight":
        i = cfg["intermediate_size"] // tp
        return hf[p + rest][:, r * i : (r + 1) * i]
    if rest == "mlp.experts.w13_weight":
        i, E = cfg["moe_intermediate_size"] // tp, cfg["num_experts"]
        return np.stack(
            [
                np.concatenate(
                    [
                        hf[f"{p}mlp.experts.{e}.gate_proj.weight"][r * i : (r + 1) * i],
                        hf[f"{p}mlp.experts.{e}.up_proj.weight"][r * i : (r + 1) * i],
                    ]
                )
                for e in range(E)
            ]
        )
    if rest == "mlp.experts.w2_weight":
        i, E = cfg["moe_intermediate_size"] // tp, cfg["num_experts"]
        return np.stack(
            [hf[f"{p}mlp.experts.{e}.down_proj.weight"][:, r * i : (r + 1) * i] for e in range(E)]
        )
    return hf[p + rest]  # norms, q_norm/k_norm, router: replicated


def first_mismatch(got: np.ndarray, want: np.ndarray) -> Optional[str]:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size == 0:
        return None
    k = int(bad[0])
    return (
        f"{bad.size} elements differ, first at flat index {k}: "
        f"0x{int(got.reshape(-1)[k]):04x} != 0x{int(want.reshape(-1)[k]):04x}"
    )


# ---------------------------------------------------------------------------------------------
# Ranks as processes


def _register_shards(trainer: refit.Trainer) -> Dict[str, np.ndarray]:
    """The trainer's own storage: its FSDP2 shards, zeroed, each registered once."""
    shards = {s.name: np.zeros(s.shape, np.float32) for s in trainer.tensors}
    for name, a in shards.items():
        trainer.register(name, a)
    return shards


def _trainer_main(cfg_yaml: str, rank: int, port: int, steps: int, verify: bool, out) -> None:
    try:
        cfg = refit.Config.from_yaml(cfg_yaml)
        spec = refit.model_spec(cfg.model)
        with refit.Trainer(cfg, rank, master_port=port) as trainer:
            shards = _register_shards(trainer)
            stats = []
            for step in range(1, steps + 1):
                full = hf_weights(spec, step)  # "training": new values, written in place
                for name, a in shards.items():
                    a[...] = fsdp2_shard(full[name], rank, cfg.world_size)
                trainer.refit(step, verify=verify)
                stats.append(trainer.last_stats)
            result = {
                "shapes": {s.name: s.shape for s in trainer.tensors},
                "stats": stats,
                "traffic": trainer.traffic(),
            }
        out.put(("trainer", rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("trainer", rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _verifier(spec: refit.ModelSpec, params: Dict[str, np.ndarray], tp: int, r: int):
    """An on_verify hook: every parameter against the engine layout of step's weights, in NumPy."""

    def verify(step: int, version: str):
        hf = {k: bf16_bits(v) for k, v in hf_weights(spec, step).items()}
        for name, a in params.items():
            bad = first_mismatch(a, engine_expected(spec.config, hf, name, tp, r))
            if bad:
                return f"{name}: {bad}"
        return None

    return verify


def session_engine_main(cfg_yaml: str, engine_rank: int, ports, out) -> None:
    """An engine rank that serves one session per port it takes from `ports` (None: exit), with the
    same parameter storage in every session and the version labels it published handed on to the
    next (Engine(published=...)), as a serving process that outlives a failed session does.
    Reports ("engine", rank, "ok" | "error", {served, version, published} | message) per
    session."""
    cfg = refit.Config.from_yaml(cfg_yaml)
    spec = refit.model_spec(cfg.model)
    params: Optional[Dict[str, np.ndarray]] = None
    published: Dict[str, int] = {}
    while True:
        port = ports.get(timeout=120)
        if port is None:
            return
        engine = None
        try:
            with refit.Engine(cfg, engine_rank, master_port=port, published=published) as engine:
                if params is None:
                    params = {p.name: np.full(p.shape, ENGINE_FILL, np.uint16) for p in engine.params}
                for name, a in params.items():
                    engine.register(name, a)
                engine.on_verify(_verifier(spec, params, cfg.tp_size, engine_rank % cfg.tp_size))
                served = engine.serve()
            out.put(("engine", engine_rank, "ok",
                     {"served": served, "version": engine.weight_version,
                      "published": engine.published}))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out.put(("engine", engine_rank, "error", f"{type(e).__name__}: {e}"))
        finally:
            if engine is not None:
                published = engine.published  # kept after close()


def stepping_trainer_main(cfg_yaml: str, rank: int, port: int, steps, out) -> None:
    """Trainer rank `rank` that registers its FSDP2 shards, then per step it takes from `steps`
    trains (hf_weights of that step) and runs refit(step, verify=True), reporting ("trainer", rank,
    "refit", step); None: shutdown, ("trainer", rank, "ok", None), exit. Any error is reported as
    ("trainer", rank, "error", message)."""
    try:
        cfg = refit.Config.from_yaml(cfg_yaml)
        spec = refit.model_spec(cfg.model)
        with refit.Trainer(cfg, rank, master_port=port) as trainer:
            shards = _register_shards(trainer)
            while (step := steps.get(timeout=120)) is not None:
                full = hf_weights(spec, step)
                for name, a in shards.items():
                    a[...] = fsdp2_shard(full[name], rank, cfg.world_size)
                trainer.refit(step, verify=True)
                out.put(("trainer", rank, "refit", step))
            trainer.shutdown()
        out.put(("trainer", rank, "ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("trainer", rank, "error", f"{type(e).__name__}: {e}"))


def _engine_main(cfg_yaml: str, engine_rank: int, port: int, out) -> None:
    try:
        cfg = refit.Config.from_yaml(cfg_yaml)
        spec = refit.model_spec(cfg.model)
        tp, r = cfg.tp_size, engine_rank % cfg.tp_size
        with refit.Engine(cfg, engine_rank, master_port=port) as engine:
            # The engine's parameters: bf16 bit patterns in uint16 arrays.
            params = {p.name: np.full(p.shape, ENGINE_FILL, np.uint16) for p in engine.params}
            for name, a in params.items():
                engine.register(name, a)
            events: List[str] = []
            engine.on_pause(lambda: events.append(f"pause@{engine.weight_version}"))
            engine.on_resume(lambda: events.append(f"resume@{engine.weight_version}"))
            names = [p.name for p in engine.params]

            def changed(got: List[str]) -> None:
                # Every parameter of the rank, in layout order, once per refit.
                events.append("changed all" if got == names else f"changed {len(got)}: {got[:3]}")

            engine.on_weights_changed(changed)

            check = _verifier(spec, params, tp, r)

            def verify(step: int, version: str):
                events.append(f"verify {step} {version}")
                return check(step, version)

            engine.on_verify(verify)
            served = engine.serve()
            result = {
                "params": {k: v.copy() for k, v in params.items()},
                "events": events,
                "served": served,
                "version": engine.weight_version,
            }
        out.put(("engine", engine_rank, "ok", result))
    except BaseException as e:  # noqa: BLE001
        out.put(("engine", engine_rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_refit(
    cfg: refit.Config, steps: int = 1, verify: bool = False, wait_s: float = 60.0
) -> Tuple[Dict[int, Any], Dict[int, Any]]:
    """Runs every trainer and engine rank of `cfg` as a process on loopback; returns their results.

    Raises AssertionError with every failing rank's message.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    text = cfg.to_yaml()
    procs = [
        ctx.Process(target=_trainer_main, args=(text, r, port, steps, verify, out))
        for r in range(cfg.world_size)
    ] + [ctx.Process(target=_engine_main, args=(text, e, port, out)) for e in range(cfg.engine_ranks)]
    for p in procs:
        p.start()
    results: Dict[Tuple[str, int], Any] = {}
    errors: List[str] = []
    try:
        for _ in procs:
            role, rank, status, payload = out.get(timeout=wait_s)
            if status == "ok":
                results[(role, rank)] = payload
            else:
                errors.append(f"{role} {rank}: {payload}")
    except queue.Empty:
        errors.append(f"timed out after {wait_s} s waiting for the ranks")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not errors, "\n".join(errors)
    trainers = {r: v for (role, r), v in results.items() if role == "trainer"}
    engines = {r: v for (role, r), v in results.items() if role == "engine"}
    return trainers, engines


class Ranks:
    """One trainer rank and one engine rank (world 1, TP 1) in this process, the engine serving on
    a thread: the GIL is released while either side blocks."""

    def __init__(self, model="tiny-qwen3", protocol="sglang", timeout_s=10, published=None,
                 **refit_keys):
        self.cfg = refit.Config.from_dict(
            {"model": model, "policy": {"world_size": 1},
             "generation": {"backend": protocol, "tp_size": 1},
             "refit": {"timeout_s": timeout_s, **refit_keys}}
        )
        port = free_port()
        box = {}
        t = threading.Thread(
            target=lambda: box.setdefault(
                "engine", refit.Engine(self.cfg, 0, master_port=port, published=published))
        )
        t.start()
        self.trainer = refit.Trainer(self.cfg, 0, master_port=port)
        t.join()
        self.engine = box["engine"]
        self.shards = {s.name: np.zeros(s.shape, np.float32) for s in self.trainer.tensors}
        self.params = {p.name: np.zeros(p.shape, np.uint16) for p in self.engine.params}

    def register_all(self):
        for name, a in self.shards.items():
            self.trainer.register(name, a)
        for name, a in self.params.items():
            self.engine.register(name, a)

    def serve_in_thread(self):
        box = {}

        def run():
            try:
                box["served"] = self.engine.serve()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        return thread, box

    def close(self):
        self.trainer.close()
        self.engine.close()


# ---------------------------------------------------------------------------------------------
# Ranks that fail on their own, as real processes (tests/python/test_faults.py). Each reports
# (role, rank, "error" | "ok", message) on `out` before it goes.


def faulty_engine_main(cfg_yaml: str, port: int, fault: str, out) -> None:
    """Engine rank 0 that registers its parameters and then:
    - "register_in_with": registers one of them as float32 inside `with refit.Engine(...)`: the
      SetupError leaves the block (recorded as this rank's failure) and the process ends;
    - "register_then_crash": registers one as float32 outside any with block, then the process
      dies on the spot (os._exit), as a script whose exception was not handled;
    - "killed_in_refit": SIGKILLs itself in its pause hook, during the first refit."""
    import signal

    cfg = refit.Config.from_yaml(cfg_yaml)
    try:
        if fault == "register_then_crash":
            engine = refit.Engine(cfg, 0, master_port=port)
            p = engine.params[0]
            try:
                engine.register(p.name, np.zeros(p.shape, np.float32))
            except refit.Error as e:
                out.put(("engine", 0, "error", f"{type(e).__name__}: {e}"))
            out.close()
            out.join_thread()  # the report is sent before the process dies
            os._exit(3)
        with refit.Engine(cfg, 0, master_port=port) as engine:
            params = {p.name: np.zeros(p.shape, np.uint16) for p in engine.params}
            if fault == "register_in_with":
                params[engine.params[0].name] = np.zeros(engine.params[0].shape, np.float32)
            for name, a in params.items():
                engine.register(name, a)
            if fault == "killed_in_refit":
                engine.on_pause(lambda: os.kill(os.getpid(), signal.SIGKILL))
            engine.serve()
        out.put(("engine", 0, "ok", ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("engine", 0, "error", f"{type(e).__name__}: {e}"))


def failing_trainer_main(cfg_yaml: str, rank: int, port: int, out) -> None:
    """Trainer rank `rank` that registers its shards and then raises in its own training step,
    inside `with refit.Trainer(...)`: the exception is recorded as this rank's failure."""
    cfg = refit.Config.from_yaml(cfg_yaml)
    try:
        with refit.Trainer(cfg, rank, master_port=port) as trainer:
            for s in trainer.tensors:
                trainer.register(s.name, np.zeros(s.shape, np.float32))
            raise RuntimeError("the loss diverged at step 3")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("trainer", rank, "error", f"{type(e).__name__}: {e}"))


def setup_trainer_main(cfg_yaml: str, rank: int, port: int, out) -> None:
    """Trainer rank `rank` that sets up, registers and runs one refit; reports the exception it
    raised as (class name, message, rank, role)."""
    cfg = refit.Config.from_yaml(cfg_yaml)
    try:
        with refit.Trainer(cfg, rank, master_port=port) as trainer:
            for s in trainer.tensors:
                trainer.register(s.name, np.zeros(s.shape, np.float32))
            trainer.refit(1)
        out.put(("trainer", rank, "ok", None))
    except refit.Error as e:
        out.put(("trainer", rank, "error", (type(e).__name__, str(e), e.rank, e.role)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("trainer", rank, "error", (type(e).__name__, str(e), None, None)))
