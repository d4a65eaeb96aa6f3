"""Faults of an RL loop with every rank a real process (docs/python.md, "Errors"; docs/runtime.md,
"How a failure reaches every rank"): each rank raises the root cause, naming the rank it started
on, with the exception class and attributes the caller acts on. The time to fail is bounded in
the docs (a failure recorded by its rank: within 0.5 s of the record; a process that exited:
within 0.5 s of its exit), not asserted here: these machines are noisy."""

import multiprocessing as mp
import queue

import numpy as np
import pytest

import refit
from refit_testing import (
    failing_trainer_main,
    faulty_engine_main,
    free_port,
    fsdp2_shard,
    hf_weights,
    setup_trainer_main,
)

WAIT_S = 60  # the most any queue read or join below waits


def _config(world_size=1, **refit_keys):
    return refit.Config.from_dict(
        {"model": "tiny-qwen3", "policy": {"world_size": world_size},
         "generation": {"backend": "sglang", "tp_size": 1},
         "refit": {"timeout_s": 20, **refit_keys}}
    )


def _stop(procs):
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=WAIT_S)
        if p.is_alive():
            p.kill()
            p.join()


def _trainer_refits(cfg, port):
    """Trainer rank 0 in this process: set up, register, one refit. Returns the trainer (the
    caller closes it) or raises what the refit raised."""
    holder = {}
    try:
        holder["t"] = refit.Trainer(cfg, 0, master_port=port)
        t = holder["t"]
        full = hf_weights(refit.model_spec(cfg.model), 1)
        for s in t.tensors:
            t.register(s.name, np.ascontiguousarray(fsdp2_shard(full[s.name], 0, 1)))
        t.refit(1)
        return t
    finally:
        if "t" in holder and not holder["t"].session_ok:
            holder["t"].close()


@pytest.mark.parametrize("fault", ["register_in_with", "register_then_crash"])
def test_an_engines_registration_error_reaches_the_trainer_naming_it(fault):
    """An engine's register() refuses a float32 array for a bf16 parameter. Inside a with block the
    SetupError is recorded as that rank's failure: the trainer raises SetupError with its text.
    A process that dies without handling it (os._exit) kept the error where its peers read it: the
    trainer raises PeerLostError, "exited after its error: ..."."""
    cfg = _config()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    engine = ctx.Process(target=faulty_engine_main, args=(cfg.to_yaml(), port, fault, out))
    try:
        engine.start()
        with pytest.raises(refit.Error) as info:
            _trainer_refits(cfg, port)
        role, rank, status, engine_message = out.get(timeout=WAIT_S)
        assert (role, rank, status) == ("engine", 0, "error"), engine_message
        assert engine_message.startswith("SetupError: "), engine_message
        assert "registered as float32" in engine_message, engine_message
        cause = engine_message[len("SetupError: "):]
        e = info.value
        msg = str(e)
        # The root cause, named: the engine's own message, on the trainer.
        assert cause.split(": ", 1)[1] in msg, msg
        assert (e.role, e.rank, e.process) == ("engine", 0, "engine 0 tp rank 0"), msg
        assert e.recoverable is False
        if fault == "register_in_with":
            assert type(e) is refit.SetupError, msg
            assert "aborted because engine 0 tp rank 0: invalid argument: " in msg, msg
        else:
            assert type(e) is refit.PeerLostError, msg
            assert "engine 0 tp rank 0: aborted: exited after its error: " in msg, msg
            assert "its connection to the control plane closed without leaving" in msg, msg
        assert "no heartbeat" not in msg, msg
        print(f"trainer raised {type(e).__name__}: {msg}")
    finally:
        _stop([engine])


def test_an_engine_killed_during_a_refit_is_named_as_exited():
    """SIGKILL in the engine's pause hook, with the trainer inside refit(): the trainer raises
    PeerLostError naming the engine rank as exited (its connections closed), not as silent."""
    cfg = _config()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    engine = ctx.Process(target=faulty_engine_main,
                         args=(cfg.to_yaml(), port, "killed_in_refit", out))
    try:
        engine.start()
        with pytest.raises(refit.PeerLostError) as info:
            _trainer_refits(cfg, port)
        engine.join(timeout=WAIT_S)
        assert engine.exitcode == -9, engine.exitcode  # it did die in the hook
        e = info.value
        msg = str(e)
        assert "engine 0 tp rank 0: aborted: exited: its connection to the control plane closed" \
            in msg, msg
        assert (e.role, e.rank, e.process) == ("engine", 0, "engine 0 tp rank 0"), msg
        assert e.recoverable is False
        with pytest.raises(queue.Empty):
            out.get(timeout=0.1)  # the engine reported nothing: it was killed
    finally:
        _stop([engine])


def test_trainer_rank_0_failing_gives_the_engines_its_cause():
    """Trainer rank 0 raises in its training step inside `with refit.Trainer(...)`: the engine
    raises the trainer's exception, naming trainer rank 0, not "lost the control plane" (the
    store it hosts stays up until the engine read why)."""
    cfg = _config()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    trainer = ctx.Process(target=failing_trainer_main, args=(cfg.to_yaml(), 0, port, out))
    engine = None
    try:
        trainer.start()
        with pytest.raises(refit.Error) as info:
            engine = refit.Engine(cfg, 0, master_port=port)
            for p in engine.params:
                engine.register(p.name, np.zeros(p.shape, np.uint16))
            engine.serve_one(timeout=WAIT_S)
        role, rank, status, message = out.get(timeout=WAIT_S)
        assert (role, rank, status) == ("trainer", 0, "error"), message
        assert message == "RuntimeError: the loss diverged at step 3", message
        e = info.value
        msg = str(e)
        assert type(e) is refit.Error, msg  # the trainer's own error: kind "other"
        assert "trainer rank 0: RuntimeError: the loss diverged at step 3" in msg, msg
        assert "lost the control plane" not in msg, msg
        assert (e.role, e.rank, e.process) == ("trainer", 0, "trainer rank 0"), msg
        assert e.recoverable is False
    finally:
        if engine is not None:
            engine.close()
        _stop([trainer])


def test_trainer_ranks_with_different_buffer_sizes_name_the_key_on_every_rank():
    """Trainer rank 1 runs with another refit.buffer_size_bytes: every rank raises naming the key,
    and none blames authentication (no run secret is in use)."""
    cfg = _config(world_size=2, buffer_size_bytes=1 << 20)
    other = cfg.replace({"refit": {"buffer_size_bytes": 1 << 19}})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=setup_trainer_main, args=(c.to_yaml(), r, port, out))
        for r, c in ((0, cfg), (1, other))
    ]
    engine = None
    try:
        for p in trainers:
            p.start()
        with pytest.raises(refit.Error) as info:
            engine = refit.Engine(cfg, 0, master_port=port)
            for p in engine.params:
                engine.register(p.name, np.zeros(p.shape, np.uint16))
            engine.serve_one(timeout=WAIT_S)
        reports = sorted(out.get(timeout=WAIT_S) for _ in trainers)
        messages = {"engine": (type(info.value).__name__, str(info.value))}
        for role, rank, status, payload in reports:
            assert status == "error", (role, rank, payload)
            messages[f"trainer {rank}"] = payload[:2]
        for who, (cls, msg) in messages.items():
            assert "buffer_size_bytes" in msg, (who, msg)
            assert "secret" not in msg, (who, msg)
            assert cls == "SetupError", (who, cls, msg)
    finally:
        if engine is not None:
            engine.close()
        _stop(trainers)
