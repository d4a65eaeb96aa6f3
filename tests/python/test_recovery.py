"""A session whose engine rank or trainer rank died, re-created with a replacement rank
(docs/rl-loop.md, "Recovering from a dead rank"; docs/runtime.md, "Re-creating a session"): the
survivors raise naming the dead rank, and every rank — the surviving processes keeping their
storage, a new process for the dead rank — forms a new session whose first refit verifies
bit-exact."""

import multiprocessing as mp

import numpy as np
import pytest

import refit
from refit_testing import (
    free_port,
    fsdp2_shard,
    hf_weights,
    session_engine_main,
    stepping_trainer_main,
)


def _reap(procs) -> None:
    """Waits up to 20 s for each started process, then kills what is left."""
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join()


def test_a_replaced_engine_rank_re_creates_the_session():
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen3", "policy": {"world_size": 1},
         "generation": {"backend": "sglang", "tp_size": 2}, "refit": {"timeout_s": 20}}
    )
    spec = refit.model_spec(cfg.model)
    text = cfg.to_yaml()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    survivor_ports, doomed_ports, replacement_ports = ctx.Queue(), ctx.Queue(), ctx.Queue()
    survivor = ctx.Process(target=session_engine_main, args=(text, 0, survivor_ports, out))
    doomed = ctx.Process(target=session_engine_main, args=(text, 1, doomed_ports, out))
    replacement = ctx.Process(target=session_engine_main, args=(text, 1, replacement_ports, out))
    procs = [survivor, doomed, replacement]
    trainer = None
    try:
        survivor.start()
        doomed.start()
        port = free_port()
        survivor_ports.put(port)
        doomed_ports.put(port)
        trainer = refit.Trainer(cfg, 0, master_port=port)
        shards = {s.name: np.zeros(s.shape, np.float32) for s in trainer.tensors}

        def train(step):
            full = hf_weights(spec, step)
            for name, a in shards.items():
                a[...] = fsdp2_shard(full[name], 0, 1)

        for name, a in shards.items():
            trainer.register(name, a)
        train(1)
        trainer.refit(1, verify=True)

        # Engine rank 1 dies between refits: the next refit fails on the trainer naming it, and
        # the surviving engine rank's serve() ends naming it too.
        doomed.kill()
        doomed.join()
        train(2)
        with pytest.raises(refit.PeerLostError) as info:
            trainer.refit(2, verify=True)
        assert "engine 0 tp rank 1" in str(info.value)
        # Named as a process that is gone (its connections closed), not as a silent one.
        exited = "engine 0 tp rank 1: aborted: exited: its connection to the control plane closed"
        assert exited in str(info.value), str(info.value)
        assert (info.value.role, info.value.rank, info.value.process) == (
            "engine", 1, "engine 0 tp rank 1"), str(info.value)
        assert info.value.recoverable is False
        assert not trainer.session_ok
        role, rank, status, message = out.get(timeout=60)
        assert (role, rank, status) == ("engine", 0, "error"), message
        assert message.startswith("PeerLostError: "), message
        assert exited in message, message
        trainer.close()

        # The new session: a fresh store (new port), the surviving process with its storage, a
        # new process for engine rank 1, a new trainer registering the same shards.
        port = free_port()
        survivor_ports.put(port)
        replacement.start()
        replacement_ports.put(port)
        trainer = refit.Trainer(cfg, 0, master_port=port)
        for name, a in shards.items():
            trainer.register(name, a)
        trainer.refit(2, verify=True)  # the failed step again: every element, bit-exact
        train(4)
        trainer.refit(4, verify=True)
        trainer.shutdown()
        trainer.close()
        trainer = None
        reports = sorted(out.get(timeout=60) for _ in range(2))
        # The surviving process handed the labels of its first session on to the second.
        assert reports == [
            ("engine", 0, "ok", {"served": 2, "version": "step-4",
                                 "published": {"step-1": 1, "step-2": 2, "step-4": 4}}),
            ("engine", 1, "ok", {"served": 2, "version": "step-4",
                                 "published": {"step-2": 2, "step-4": 4}}),
        ], reports
    finally:
        if trainer is not None:
            trainer.close()
        for q in (survivor_ports, replacement_ports):
            q.put(None)
        _reap(procs)


def test_a_replaced_trainer_rank_re_creates_the_session():
    """docs/rl-loop.md, "Recovering from a dead rank", after a dead trainer rank: trainer rank 1
    (a process) is SIGKILLed between refits. Trainer rank 0 (this process) and the engine (a
    process that outlives the session) raise PeerLostError naming trainer rank 1. Then, per the
    recipe, the survivors close their sessions, a new process replaces trainer rank 1, and every
    rank joins a new store on a new port: the failed step's refit and a new step's verify
    bit-exact, and the engine carried the labels of the first session into the second."""
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen3", "policy": {"world_size": 2},
         "generation": {"backend": "sglang", "tp_size": 1}, "refit": {"timeout_s": 20}}
    )
    spec = refit.model_spec(cfg.model)
    text = cfg.to_yaml()
    ctx = mp.get_context("spawn")
    out, engine_ports = ctx.Queue(), ctx.Queue()
    doomed_steps, replacement_steps = ctx.Queue(), ctx.Queue()
    # The doomed process reports on a queue of its own: a process killed while it holds a queue's
    # write lock would block every later writer of that queue.
    doomed_out = ctx.Queue()
    port = free_port()
    engine = ctx.Process(target=session_engine_main, args=(text, 0, engine_ports, out))
    doomed = ctx.Process(target=stepping_trainer_main,
                         args=(text, 1, port, doomed_steps, doomed_out))
    procs = [engine, doomed]
    trainer = None
    try:
        engine.start()
        doomed.start()
        engine_ports.put(port)
        trainer = refit.Trainer(cfg, 0, master_port=port)
        shards = {s.name: np.zeros(s.shape, np.float32) for s in trainer.tensors}
        for name, a in shards.items():
            trainer.register(name, a)

        def refit_both(step, steps):
            full = hf_weights(spec, step)
            for name, a in shards.items():
                a[...] = fsdp2_shard(full[name], 0, 2)
            steps.put(step)
            trainer.refit(step, verify=True)

        refit_both(1, doomed_steps)
        assert doomed_out.get(timeout=60) == ("trainer", 1, "refit", 1)

        # Trainer rank 1 dies between refits: trainer rank 0's next refit raises naming it, and
        # so does the engine's serve().
        doomed.kill()
        doomed.join()
        assert doomed.exitcode == -9, doomed.exitcode
        full = hf_weights(spec, 2)
        for name, a in shards.items():
            a[...] = fsdp2_shard(full[name], 0, 2)
        with pytest.raises(refit.PeerLostError) as info:
            trainer.refit(2, verify=True)
        msg = str(info.value)
        # Named as a process that is gone (its connections closed), not as a silent one.
        exited = "trainer rank 1: aborted: exited: its connection to the control plane closed"
        assert exited in msg, msg
        assert (info.value.role, info.value.rank, info.value.process) == (
            "trainer", 1, "trainer rank 1"), msg
        assert info.value.recoverable is False and not trainer.session_ok
        role, rank, status, message = out.get(timeout=60)
        assert (role, rank, status) == ("engine", 0, "error"), message
        assert message.startswith("PeerLostError: "), message
        assert exited in message, message
        print(f"trainer rank 0 raised {msg}\nthe engine raised {message}")

        # The recipe: the survivors closed (the engine's with block did), a new process for
        # trainer rank 1, a new store on a new port, the failed step again, then a new one.
        trainer.close()
        trainer = None
        port = free_port()
        replacement = ctx.Process(target=stepping_trainer_main,
                                  args=(text, 1, port, replacement_steps, out))
        procs.append(replacement)
        replacement.start()
        engine_ports.put(port)
        trainer = refit.Trainer(cfg, 0, master_port=port)
        for name, a in shards.items():
            trainer.register(name, a)
        refit_both(2, replacement_steps)
        refit_both(3, replacement_steps)
        replacement_steps.put(None)
        trainer.shutdown()
        trainer.close()
        trainer = None
        reports = sorted(out.get(timeout=60) for _ in range(4))
        assert reports == [
            ("engine", 0, "ok", {"served": 2, "version": "step-3",
                                 "published": {"step-1": 1, "step-2": 2, "step-3": 3}}),
            ("trainer", 1, "ok", None),
            ("trainer", 1, "refit", 2),
            ("trainer", 1, "refit", 3),
        ], reports
    finally:
        if trainer is not None:
            trainer.close()
        engine_ports.put(None)
        for q in (doomed_steps, replacement_steps):
            q.put(None)
        _reap(procs)


def test_a_trainer_rank_late_to_its_refit_fails_that_refit_and_the_session_goes_on():
    """docs/runtime.md, "A refit that fails in flight": trainer rank 1 calls refit() 1.75 x
    timeout_s after rank 0 (a slow training step). Rank 0's wait times out with every rank alive:
    both ranks raise `aborted` ("failed in flight"), the engine catches up between refits, every
    rank forms its groups anew, and the next refit of the same session verifies bit-exact."""
    import threading
    import time

    timeout_s = 2
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen3", "policy": {"world_size": 2},
         "generation": {"backend": "sglang", "tp_size": 1}, "refit": {"timeout_s": timeout_s}}
    )
    spec = refit.model_spec(cfg.model)
    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=session_engine_main, args=(cfg.to_yaml(), 0, ports, out))
    engine.start()
    port = free_port()
    ports.put(port)
    trainers = [None, None]
    errors = {}

    def rank_main(r, plan):
        try:
            t = refit.Trainer(cfg, r, master_port=port)
            trainers[r] = t
            shards = {s.name: np.zeros(s.shape, np.float32) for s in t.tensors}
            for name, a in shards.items():
                t.register(name, a)
            for step, delay in plan:
                full = hf_weights(spec, step)
                for name, a in shards.items():
                    a[...] = fsdp2_shard(full[name], r, 2)
                time.sleep(delay)
                try:
                    t.refit(step, verify=True)
                    errors[(r, step)] = None
                except refit.Error as e:  # noqa: PERF203
                    errors[(r, step)] = e
            t.shutdown()
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[(r, "fatal")] = e

    try:
        plans = [[(1, 0), (2, 0), (3, 0)], [(1, 0), (2, 1.75 * timeout_s), (3, 0)]]
        threads = [threading.Thread(target=rank_main, args=(r, plans[r])) for r in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads)
        assert (0, "fatal") not in errors and (1, "fatal") not in errors, errors
        for r in (0, 1):
            assert errors[(r, 1)] is None and errors[(r, 3)] is None, errors
            e = errors[(r, 2)]
            assert isinstance(e, refit.Error), errors
            assert e.code == "aborted", e
            assert "refit step 2 (version 'step-2') failed in flight: trainer rank 0 reported" in str(e)
            assert trainers[r].session_ok
        report = out.get(timeout=60)
        assert report == ("engine", 0, "ok", {"served": 2, "version": "step-3",
                                              "published": {"step-1": 1, "step-3": 3}}), report
    finally:
        for t in trainers:
            if t is not None:
                t.close()
        ports.put(None)
        engine.join(timeout=20)
        if engine.is_alive():
            engine.kill()
            engine.join()
