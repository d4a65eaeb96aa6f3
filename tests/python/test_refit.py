"""Refits driven from Python: trainer and engine ranks as processes on loopback, NumPy storage
registered zero-copy, engine parameters checked bit for bit against the docs/design.md §6.4 layout computed
here in NumPy."""

import threading
import time

import numpy as np
import pytest

import refit
from refit_testing import (
    Ranks,
    bf16_bits,
    free_port,
    engine_expected,
    first_mismatch,
    fsdp2_shard,
    hf_weights,
    run_refit,
)


def check_engines(cfg, engines, step):
    spec = refit.model_spec(cfg.model)
    hf = {k: bf16_bits(v) for k, v in hf_weights(spec, step).items()}
    assert sorted(engines) == list(range(cfg.engine_ranks))
    for rank, result in engines.items():
        r = rank % cfg.tp_size
        assert result["params"], "engine registered no parameters"
        for name, got in result["params"].items():
            want = engine_expected(spec.config, hf, name, cfg.tp_size, r)
            assert got.dtype == np.uint16
            bad = first_mismatch(got, want)
            assert bad is None, f"engine rank {rank}: {name}: {bad}"


@pytest.mark.parametrize(
    "overrides",
    [
        # The seed's cell: FSDP2 -> SGLang, non-colocated broadcast, world size 2, TP 2.
        {"generation": {"backend": "sglang", "tp_size": 2}},
        # Colocated: shared-memory ipc, one engine rank per trainer rank, vLLM manifest.
        {"generation": {"backend": "vllm", "colocated": True, "tp_size": 2}},
    ],
    ids=["broadcast-sglang-tp2", "ipc-vllm-tp2"],
)
def test_refit_from_python_matches_the_engine_layout(overrides):
    base = {"model": "tiny-qwen3", "policy": {"world_size": 2}, "refit": {"timeout_s": 20}}
    cfg = refit.Config.from_dict(base).replace(overrides)
    steps = 2
    trainers, engines = run_refit(cfg, steps=steps, verify=True)
    # Trainer shards are torch.chunk dim-0 slices of the HF tensors (docs/design.md §6.2).
    spec = refit.model_spec(cfg.model)
    for rank, result in trainers.items():
        for name, shape in spec.tensors:
            want = fsdp2_shard(np.empty(shape), rank, cfg.world_size).shape
            assert tuple(result["shapes"][name]) == want, name
        assert len(result["stats"]) == steps
        assert all(s["bytes"] == 2 * spec.total_parameters for s in result["stats"])
    # Shard to shard: NumPy parameters cannot be mapped, so every pair went point-to-point, and
    # each engine rank of TP 2 received about half of the model (its shard), not all of it.
    traffic = trainers[0]["traffic"]
    assert [t["role"] for t in traffic] == ["trainer"] * 2 + ["engine"] * 2
    assert sum(t["p2p_pairs"] for t in traffic if t["role"] == "trainer") == 4
    assert sum(t["peer_pairs"] for t in traffic) == 0
    model_bytes = 2 * spec.total_parameters
    for t in traffic:
        if t["role"] == "engine":
            assert 0.45 * model_bytes < t["bytes_received"] < 0.55 * model_bytes, t
    assert sum(t["bytes_sent"] for t in traffic) == sum(t["bytes_received"] for t in traffic)
    # The engines hold the last step's weights, in the engine layout, bit for bit.
    check_engines(cfg, engines, steps)
    prefix = "step-" if cfg.engine_protocol == "sglang" else ""
    for rank, result in engines.items():
        assert result["served"] == steps
        assert result["version"] == f"{prefix}{steps}"
        # Hooks in order: told which parameters changed (all of them), verified every step, and
        # only then the version published and generation resumed.
        assert result["events"] == [
            "pause@0",
            "changed all",
            f"verify 1 {prefix}1",
            f"resume@{prefix}1",
            f"pause@{prefix}1",
            "changed all",
            f"verify 2 {prefix}2",
            f"resume@{prefix}2",
        ]


def test_uneven_shards_and_tied_embeddings_with_bias():
    # tiny-qwen2: q/k/v bias, tied embeddings, 14 heads / 2 kv heads; 3 trainer ranks hold
    # uneven dim-0 chunks, TP 2 splits the kv heads.
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen2", "policy": {"world_size": 3}, "generation": {"tp_size": 2},
         "refit": {"timeout_s": 20, "buffer_size_bytes": 65536}}
    )
    _, engines = run_refit(cfg, steps=1, verify=True)
    check_engines(cfg, engines, 1)
    names = set(engines[0]["params"])
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.qkv_proj.bias" in names


def test_registration_errors_name_the_tensor():
    ranks = Ranks()
    try:
        t, e = ranks.trainer, ranks.engine
        name = t.tensors[1].name
        shape = t.tensors[1].shape
        with pytest.raises(refit.SetupError) as info:
            t.register(name, np.zeros((3, 5), np.float32))
        assert info.value.code == "invalid_argument"
        assert name in str(info.value) and str(list(shape)).replace(" ", "") in str(info.value)
        with pytest.raises(refit.SetupError, match=f"{name} registered as float64"):
            t.register(name, np.zeros(shape, np.float64))
        with pytest.raises(refit.SetupError, match=f"{name} is not contiguous"):
            t.register(name, np.zeros(shape[::-1], np.float32).T)
        with pytest.raises(refit.SetupError, match="no tensor named model.bogus.weight") as info:
            t.register("model.bogus.weight", np.zeros(3, np.float32))
        assert info.value.code == "not_found"
        with pytest.raises(refit.SetupError, match="not a tensor"):
            t.register(name, [1.0, 2.0])

        class FakeCuda:  # what a CUDA tensor reports, refused before any export
            def __dlpack_device__(self):
                return (2, 0)

            def __dlpack__(self, **kwargs):
                raise AssertionError("must not be exported")

        with pytest.raises(refit.SetupError) as info:
            t.register(name, FakeCuda())
        assert info.value.code == "unsupported" and "cuda:0" in str(info.value)
        assert name in str(info.value)
        assert not refit.accepts_device_memory()

        pname, pshape = e.params[0].name, e.params[0].shape
        with pytest.raises(refit.SetupError, match=f"{pname} registered as float32"):
            e.register(pname, np.zeros(pshape, np.float32))  # the engine stores bf16
        ro = np.zeros(pshape, np.uint16)
        ro.flags.writeable = False
        with pytest.raises(refit.SetupError, match=pname):
            e.register(pname, ro)  # the engine writes in place
        # A refit with tensors missing names them and changes nothing.
        assert len(t.unregistered()) == len(t.tensors)
        with pytest.raises(refit.SetupError, match="not registered"):
            t.refit(1)
    finally:
        ranks.close()


def test_zero_copy_in_place_updates_and_hooks_across_threads():
    ranks = Ranks(protocol="vllm")
    try:
        ranks.register_all()
        assert ranks.trainer.registered(ranks.trainer.tensors[0].name) is ranks.shards[
            ranks.trainer.tensors[0].name]
        versions = []
        ranks.engine.on_resume(lambda: versions.append(ranks.engine.weight_version))
        thread, box = ranks.serve_in_thread()
        norm = "model.norm.weight"
        for step, value in ((1, 1.5), (2, -0.25)):
            ranks.shards[norm][...] = value  # in place: refit reads the registered storage
            ranks.trainer.refit(step)
            # refit() returns after the engine committed: its storage already holds the values.
            assert np.all(ranks.params[norm] == bf16_bits(np.full(1, value, np.float32))[0])
            assert ranks.engine.weight_version == str(step)
        ranks.trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2 and versions == ["1", "2"]
    finally:
        ranks.close()


def test_staged_refits_pause_generation_only_to_apply():
    """refit.staged: the bytes land in the engine's staging area, so when the pause hook runs the
    registered parameters still hold the previous version; after the refit they hold the new one.
    Both sides report the pause (last_stats["pause_s"]), which lies inside the refit."""
    ranks = Ranks(protocol="vllm", staged=True)
    try:
        ranks.register_all()
        norm = "model.norm.weight"
        seen_at_pause = []
        ranks.engine.on_pause(lambda: seen_at_pause.append(int(ranks.params[norm][0])))
        thread, box = ranks.serve_in_thread()
        old = int(ranks.params[norm][0])
        for step, value in ((1, 1.5), (2, -0.25)):
            ranks.shards[norm][...] = value
            ranks.trainer.refit(step)
            assert seen_at_pause[-1] == old, "the parameters changed before generation paused"
            new = int(bf16_bits(np.full(1, value, np.float32))[0])
            assert np.all(ranks.params[norm] == new)
            old = new
            stats = ranks.trainer.last_stats
            assert 0 < stats["pause_s"] < stats["seconds"], stats
        ranks.trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2 and len(seen_at_pause) == 2
        assert ranks.engine.last_stats["pause_s"] == ranks.trainer.last_stats["pause_s"]
    finally:
        ranks.close()


@pytest.mark.parametrize("keep_previous", [False, True], ids=["invalid", "keep_previous"])
def test_a_failed_verification_fails_the_refit_not_the_session(keep_previous):
    # The verification hook fails step 2: refit() raises on the trainer with the engine's message,
    # nothing publishes "v2", and step 3 of the same session succeeds. Without keep_previous the
    # weights are invalid in between (generation paused); with it the engine restored v1's bytes.
    ranks = Ranks(keep_previous=keep_previous, checksum=True)
    try:
        ranks.register_all()
        verdicts = {"v1": None, "v2": "norm looks wrong at v2", "v3": None}
        ranks.engine.on_verify(lambda step, version: verdicts[version])
        resumed = []
        ranks.engine.on_resume(lambda: resumed.append(ranks.engine.weight_version))
        assert ranks.engine.is_valid and ranks.engine.weight_version == "0"
        thread, box = ranks.serve_in_thread()
        rng = np.random.default_rng(3)

        def train():
            for a in ranks.shards.values():
                a[...] = rng.standard_normal(a.shape, dtype=np.float32)

        train()
        ranks.trainer.refit(1, version="v1", verify=True)
        v1 = {k: a.copy() for k, a in ranks.params.items()}
        train()
        with pytest.raises(refit.Error) as info:
            ranks.trainer.refit(2, version="v2", verify=True)
        assert info.value.code == "corruption"
        message = str(info.value)
        assert "norm looks wrong at v2" in message and "engine 0 tp rank 0" in message
        assert "did not publish version 'v2'" in message
        assert ranks.trainer.session_ok and ranks.engine.session_ok
        # The engine settles step 2 (rollback, or invalid weights) on its serving thread after it
        # reported the failure, which may be after refit() raised here: wait for it, bounded.
        deadline = time.monotonic() + 20
        settled = (lambda: len(resumed) == 2) if keep_previous else (
            lambda: ranks.engine.weight_version != "v1")
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        if keep_previous:
            assert ranks.engine.weight_version == "v1" and ranks.engine.is_valid
            assert all(np.array_equal(ranks.params[k], v1[k]) for k in v1), "rollback not bit-exact"
            assert resumed == ["v1", "v1"]
        else:
            assert ranks.engine.weight_version == "" and not ranks.engine.is_valid
            assert resumed == ["v1"]
        train()
        ranks.trainer.refit(3, version="v3", verify=True)
        assert ranks.engine.weight_version == "v3" and ranks.engine.is_valid
        ranks.trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2  # steps 1 and 3; serve() went on past step 2
    finally:
        ranks.close()


def test_engines_wait_between_refits_as_long_as_the_trainer_lives():
    # timeout_s bounds a refit in flight, not the gap between refits (a rollout and a training
    # step): gaps of three timeouts leave the session usable.
    ranks = Ranks(timeout_s=1)
    try:
        ranks.register_all()
        thread, box = ranks.serve_in_thread()
        for step in (1, 2):
            time.sleep(3.0)
            ranks.trainer.refit(step, verify=False)
            assert ranks.engine.weight_version == f"step-{step}" and ranks.engine.is_valid
        ranks.trainer.shutdown()
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2
    finally:
        ranks.close()


def test_an_engine_waiting_for_a_refit_fails_when_the_trainer_goes():
    # The wait between refits ends with the trainer: closing it takes the store away, and the
    # engine's liveness check (every 500 ms) ends the wait naming the lost control plane.
    ranks = Ranks(timeout_s=30)
    try:
        ranks.register_all()
        thread, box = ranks.serve_in_thread()
        time.sleep(1.0)
        start = time.monotonic()
        ranks.trainer.close()
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert time.monotonic() - start < 10, "the wait outlived the trainer by far"
        assert isinstance(box.get("error"), refit.Error), box
        assert "lost the control plane" in str(box["error"]), box["error"]
    finally:
        ranks.close()


def test_ranks_take_torchrun_variables_when_arguments_are_left_out(monkeypatch):
    # RANK / ENGINE_RANK, MASTER_ADDR, MASTER_PORT; the listening address follows MASTER_ADDR
    # (loopback here).
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("ENGINE_RANK", raising=False)
    monkeypatch.delenv("REFIT_HOST", raising=False)
    cfg = refit.Config.from_dict({"model": "tiny-qwen3", "policy": {"world_size": 1},
                                  "generation": {"backend": "vllm", "tp_size": 1},
                                  "refit": {"timeout_s": 10}})
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("engine", refit.Engine(cfg)))
    t.start()
    trainer = refit.Trainer(cfg)
    t.join()
    engine = box["engine"]
    try:
        assert engine.engine_rank == 0
        shards = {s.name: np.full(s.shape, 0.5, np.float32) for s in trainer.tensors}
        params = {p.name: np.zeros(p.shape, np.uint16) for p in engine.params}
        for name, a in shards.items():
            trainer.register(name, a)
        for name, a in params.items():
            engine.register(name, a)
        served = threading.Thread(target=engine.serve_one)
        served.start()
        trainer.refit(1)
        served.join(timeout=20)
        assert engine.weight_version == "1"
        # Every element the trainer sent (the vocabulary padding rows of embed_tokens/lm_head
        # keep what was registered).
        want = bf16_bits(np.full(1, 0.5, np.float32))[0]
        rows = dict(refit.model_spec(cfg.model).tensors)
        for name, a in params.items():
            sent = a[: rows[name][0]] if name in ("model.embed_tokens.weight", "lm_head.weight") else a
            assert (sent == want).all(), name
    finally:
        trainer.close()
        engine.close()
    # Without RANK (and without the argument) the rank is unknown: a setup error naming it.
    monkeypatch.delenv("RANK")
    with pytest.raises(refit.SetupError, match="RANK"):
        refit.Trainer(cfg)
    monkeypatch.setenv("MASTER_PORT", "not-a-port")
    with pytest.raises(refit.SetupError, match="MASTER_PORT"):
        refit.Trainer(cfg, 0)


def test_a_keyboard_interrupt_in_a_hook_reaches_the_caller_as_raised():
    # Ctrl-C while the pause hook drains requests: the refit is aborted as for any exception, but
    # serve() does not take the interrupt for a failed refit and go on serving; it raises it.
    ranks = Ranks()
    try:
        ranks.register_all()

        def interrupted():
            raise KeyboardInterrupt

        ranks.engine.on_pause(interrupted)
        ranks.engine.on_verify(None)
        result = {}

        def train():
            try:
                ranks.trainer.refit(1)
            except refit.Error as e:
                result["t"] = e

        thread = threading.Thread(target=train)
        thread.start()
        # Bounded: were the interrupt swallowed, serve() would wait for a refit that never comes.
        stopper = threading.Timer(30, ranks.engine.request_stop)
        stopper.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ranks.engine.serve()
        finally:
            stopper.cancel()
        thread.join(timeout=30)
        assert isinstance(result.get("t"), refit.Error), result
        assert result["t"].code == "aborted"
        assert ranks.engine.session_ok and ranks.engine.weight_version == "0"
    finally:
        ranks.close()


def test_a_raising_pause_hook_aborts_the_refit_before_any_byte_is_written():
    # The refit fails on both sides before any byte is written; the session stays usable and the
    # next refit publishes.
    ranks = Ranks()
    try:
        ranks.register_all()
        for a in ranks.shards.values():
            a.fill(1.0)

        def boom():
            raise ValueError("generation did not pause")

        ranks.engine.on_pause(boom)
        ranks.engine.on_verify(None)
        result = {}

        def train():
            try:
                ranks.trainer.refit(1)
                result["t"] = "returned"
            except refit.Error as e:  # noqa: PERF203
                result["t"] = e

        thread = threading.Thread(target=train)
        thread.start()
        with pytest.raises(refit.Error, match="the pause hook failed") as info:
            ranks.engine.serve_one()
        assert isinstance(info.value.__cause__, ValueError)
        assert "generation did not pause" in str(info.value)
        thread.join(timeout=30)
        # The trainer's refit fails too, naming the engine.
        assert isinstance(result.get("t"), refit.Error), result
        assert "engine 0 tp rank 0" in str(result["t"])
        assert result["t"].code == "aborted"
        assert "did not publish version 'step-1'" in str(result["t"])
        assert "the pause hook failed" in str(result["t"])
        # Nothing was written: the weights keep their version and validity.
        assert ranks.engine.weight_version == "0" and ranks.engine.is_valid
        assert all(not a.any() for a in ranks.params.values())
        assert ranks.trainer.session_ok and ranks.engine.session_ok
        # The next refit of the same session writes and publishes.
        ranks.engine.on_pause(None)
        thread = threading.Thread(target=lambda: result.update(t=ranks.trainer.refit(2)))
        thread.start()
        assert ranks.engine.serve_one() is True
        thread.join(timeout=30)
        assert result["t"] is None
        assert ranks.engine.weight_version == "step-2" and ranks.engine.is_valid
        assert all(a.any() for a in ranks.params.values() if a.size)
    finally:
        ranks.close()


def test_a_raising_resume_hook_surfaces_after_the_refit():
    ranks = Ranks()
    try:
        ranks.register_all()

        def boom():
            raise ValueError("generation did not resume")

        ranks.engine.on_resume(boom)
        ranks.engine.on_verify(None)
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("t", ranks.trainer.refit(1)))
        thread.start()
        with pytest.raises(ValueError, match="generation did not resume"):
            ranks.engine.serve_one()
        thread.join(timeout=20)
        assert "t" in result  # the trainer's refit completed
        assert ranks.engine.weight_version == "step-1"
    finally:
        ranks.close()


def test_one_thread_at_a_time_and_closed_objects():
    ranks = Ranks()
    ranks.close()
    with pytest.raises(RuntimeError, match="after close"):
        ranks.trainer.refit(1)
    with pytest.raises(RuntimeError, match="after close"):
        ranks.engine.serve_one()


def test_request_stop_from_another_thread_ends_serve_between_refits():
    # serve() on its thread publishes a refit, then returns for request_stop() from this thread
    # with the refits it published, without a shutdown; the session serves the next refit.
    ranks = Ranks()
    try:
        ranks.register_all()
        thread, box = ranks.serve_in_thread()
        for a in ranks.shards.values():
            a.fill(1.0)
        ranks.trainer.refit(1)  # served by the serve() running on the thread
        ranks.engine.request_stop()
        thread.join(timeout=60)  # a bound against a hang only
        assert not thread.is_alive(), "serve() did not return after request_stop()"
        assert "error" not in box, box.get("error")
        assert box["served"] == 1
        assert ranks.engine.session_ok
        assert ranks.engine.weight_version == "step-1"
        # The request was used up: the next refit is served.
        served = threading.Thread(target=ranks.engine.serve_one)
        served.start()
        for a in ranks.shards.values():
            a.fill(2.0)
        ranks.trainer.refit(2)
        served.join(timeout=60)
        assert ranks.engine.weight_version == "step-2"
    finally:
        ranks.close()
