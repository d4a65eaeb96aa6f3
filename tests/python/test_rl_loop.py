"""What an RL loop meets from Python (docs/python.md, "Errors"; docs/engines.md, "Serving from the
server's own loop"): exceptions typed by what the caller does next and naming the rank a failure
started on, an engine a driver calls with a timeout, a refit that fails before any byte moved
leaving the weights valid, and registrations or version labels that would corrupt the weights
refused."""

import builtins
import pickle
import re
import threading
import time

import numpy as np
import pytest

import refit
from refit_testing import Ranks, fsdp2_shard, hf_weights


def _train(ranks: Ranks, step: int) -> None:
    full = hf_weights(refit.model_spec(ranks.cfg.model), step)
    for name, a in ranks.shards.items():
        a[...] = fsdp2_shard(full[name], 0, 1)


def _serve_in_background(engine: refit.Engine, results: list, calls: int = 1, timeout: float = 60):
    def run():
        for _ in range(calls):
            try:
                results.append(engine.serve_one(timeout=timeout))
            except refit.Error as e:  # reported to the test's thread
                results.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_every_error_class_says_what_to_do_next():
    kinds = {
        refit.SetupError: "setup",
        refit.PeerLostError: "peer_lost",
        refit.TimeoutError: "timeout",
        refit.VerificationError: "verification",
        refit.ProtocolError: "protocol",
    }
    for cls, kind in kinds.items():
        assert issubclass(cls, refit.Error)
        e = cls("x: y", "aborted", "y", 3, "engine", "engine 1 tp rank 1", True)
        assert (e.kind, e.rank, e.role, e.process, e.recoverable) == (
            kind, 3, "engine", "engine 1 tp rank 1", True)
        again = pickle.loads(pickle.dumps(e))  # across multiprocessing queues
        assert type(again) is cls
        assert (again.kind, again.rank, again.role, again.recoverable) == (kind, 3, "engine", True)
    assert issubclass(refit.TimeoutError, builtins.TimeoutError)
    assert refit.Error("x").kind == "other"


def test_a_config_error_is_a_setup_error_of_no_rank():
    with pytest.raises(refit.SetupError) as info:
        refit.Config.from_dict({"model": "tiny-qwen3", "refit": {"timeout_s": -1}})
    assert info.value.kind == "setup"
    assert info.value.rank is None and info.value.role is None
    assert info.value.recoverable is False


def _overlapping_views(a_shape, b_shape, dtype):
    """Two arrays of the given shapes sharing one element of storage."""
    na, nb = int(np.prod(a_shape)), int(np.prod(b_shape))
    backing = np.zeros(na + nb - 1, dtype)
    return backing[:na].reshape(a_shape), backing[na - 1:].reshape(b_shape)


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_registrations_that_overlap_in_memory_are_refused_naming_both(side):
    ranks = Ranks()
    try:
        obj = ranks.engine if side == "engine" else ranks.trainer
        store = ranks.params if side == "engine" else ranks.shards
        (a, a_arr), (b, b_arr) = list(store.items())[:2]
        a_view, b_view = _overlapping_views(a_arr.shape, b_arr.shape, a_arr.dtype)
        if b_arr.dtype != a_arr.dtype:
            pytest.skip("the first two tensors differ in dtype")
        obj.register(a, a_view)
        with pytest.raises(refit.SetupError) as info:
            obj.register(b, b_view)
        msg = str(info.value)
        assert a in msg and b in msg and "overlaps" in msg, msg
        assert info.value.role == side and info.value.rank == 0
        assert info.value.recoverable is True  # nothing changed: register it properly and go on
        # The refused registration left nothing behind: proper storage for both refits bit-exact.
        ranks.register_all()
        results: list = []
        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 1)
        ranks.trainer.refit(1)
        t.join(60)
        assert results == [True]
    finally:
        ranks.trainer.close()
        ranks.engine.close()


def test_a_version_already_published_is_refused_naming_both_refits():
    ranks = Ranks()
    try:
        ranks.register_all()
        results: list = []
        t = _serve_in_background(ranks.engine, results, calls=2)
        _train(ranks, 1)
        ranks.trainer.refit(0)
        ranks.trainer.refit(1)
        first = ranks.engine.weight_version
        for step, version in [(1, None), (0, None), (7, "step-1")]:
            with pytest.raises(refit.SetupError) as info:
                ranks.trainer.refit(step, version=version)
            msg = str(info.value)
            assert "already published" in msg, msg
            assert f"refit step {1 if step != 0 else 0} already published" in msg, msg
            assert info.value.recoverable is True and ranks.trainer.session_ok
        t.join(60)
        assert results == [True, True]
        assert ranks.engine.weight_version == first  # nothing moved
        # The next new version refits normally.
        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 2)
        ranks.trainer.refit(2, verify=False)
        t.join(60)
        assert results[-1] is True
    finally:
        ranks.trainer.close()
        ranks.engine.close()


def test_an_engine_refuses_a_version_it_published_in_an_earlier_session():
    """An inference server outlives its refit session and hands the next one the labels it served
    (Engine(published=...)). The new session's trainer has never seen them: the engine refuses a
    refit that would publish one of them at another step, before any byte moves, naming the
    label, both steps and its rank; its weights stay valid and on_pause does not run. A retry of
    a step it already published may reuse that step's label, and a new label refits normally."""
    first = Ranks()
    try:
        first.register_all()
        results: list = []
        t = _serve_in_background(first.engine, results, calls=2)
        for step in (1, 2):
            _train(first, step)
            first.trainer.refit(step)
        t.join(60)
        assert results == [True, True]
        served = first.engine.published
        assert served == {"step-1": 1, "step-2": 2}, served
    finally:
        first.close()
    assert first.engine.published == served  # kept after close(), for the next session

    second = Ranks(published=served)
    try:
        second.params = first.params  # the server's storage outlives the session
        second.register_all()
        assert second.engine.published == served
        events: list = []
        second.engine.on_pause(lambda: events.append("pause"))
        before = {k: v.copy() for k, v in second.params.items()}
        results = []
        t = _serve_in_background(second.engine, results)
        _train(second, 3)
        with pytest.raises(refit.SetupError) as info:
            second.trainer.refit(3, version="step-1")
        t.join(60)
        msg = str(info.value)
        want = ("refit step 3 would publish weight version 'step-1', which this engine rank "
                "already published at refit step 1 for other weights")
        assert want in msg, msg
        assert "engine 0 tp rank 0 reported: " + want in msg, msg
        assert (info.value.role, info.value.rank) == ("engine", 0), msg
        assert info.value.recoverable is True and second.trainer.session_ok
        # The engine's own serve_one raises the same refusal; the session goes on.
        assert len(results) == 1 and type(results[0]) is refit.SetupError, results
        assert "engine 0 tp rank 0: " + want in str(results[0]), str(results[0])
        assert results[0].recoverable is True and second.engine.session_ok
        # Refused before the pause: nothing moved, the weights keep their version.
        assert events == [], events
        assert second.engine.is_valid and second.engine.weight_version == "0"
        for name, a in second.params.items():
            assert np.array_equal(a, before[name]), name
        # A retry of step 2 may reuse its label; a new step's label refits normally.
        t = _serve_in_background(second.engine, results, calls=2)
        _train(second, 2)
        second.trainer.refit(2)
        _train(second, 3)
        second.trainer.refit(3)
        t.join(60)
        assert results[1:] == [True, True], results
        assert second.engine.weight_version == "step-3"
        assert second.engine.published == {"step-1": 1, "step-2": 2, "step-3": 3}
        assert events == ["pause", "pause"], events
    finally:
        second.close()


def test_serve_one_with_a_timeout_raises_a_timeout_and_changes_nothing():
    ranks = Ranks()
    try:
        ranks.register_all()
        with pytest.raises(refit.TimeoutError) as info:
            ranks.engine.serve_one(timeout=0.3)
        assert "serve_one" in str(info.value)
        assert info.value.recoverable is True and ranks.engine.session_ok
        assert ranks.engine.is_valid and ranks.engine.weight_version == "0"
        # The engine serves the next refit as if nothing happened.
        results: list = []
        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 1)
        ranks.trainer.refit(1)
        t.join(60)
        assert results == [True]
    finally:
        ranks.trainer.close()
        ranks.engine.close()


def test_an_engine_late_to_a_refit_keeps_its_weights_and_resumes():
    """The engine calls serve_one after the trainer stopped waiting for its pause: the trainer's
    refit fails naming the engine rank that did not pause, and the engine's weights stay valid
    under their version, with on_resume run for them; the next refit goes through."""
    ranks = Ranks(timeout_s=1)
    try:
        ranks.register_all()
        events: list = []
        ranks.engine.on_pause(lambda: events.append("pause"))
        ranks.engine.on_resume(lambda: events.append("resume"))
        results: list = []
        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 1)
        ranks.trainer.refit(1)
        t.join(60)
        assert results == [True]
        events.clear()

        failed: list = []

        def late_refit():
            try:
                _train(ranks, 2)
                ranks.trainer.refit(2)
                failed.append(None)
            except refit.Error as e:
                failed.append(e)

        trainer_thread = threading.Thread(target=late_refit)
        trainer_thread.start()
        # Longer than the trainer waits for the engines' pause (2 x refit.timeout_s + 5 s).
        time.sleep(9)
        with pytest.raises(refit.Error) as engine_side:
            ranks.engine.serve_one(timeout=30)
        trainer_thread.join(60)
        assert failed and isinstance(failed[0], refit.Error), failed
        assert "engine 0 tp rank 0" in str(failed[0]), str(failed[0])
        # The origin is the rank whose wait ran out (trainer rank 0, which recorded the refit's
        # failure in flight); the text names the engine rank that did not pause.
        assert (failed[0].role, failed[0].rank) == ("trainer", 0), str(failed[0])
        assert type(failed[0]) is refit.TimeoutError, (type(failed[0]), str(failed[0]))
        assert "waiting for the engines' pause from engine 0 tp rank 0" in str(failed[0])
        assert failed[0].recoverable is True and ranks.trainer.session_ok
        assert engine_side.value.recoverable is True and ranks.engine.session_ok
        assert ranks.engine.is_valid, "no byte was written, yet the weights were called invalid"
        assert ranks.engine.weight_version == "step-1"
        assert events[-1:] == ["resume"], events

        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 3)
        ranks.trainer.refit(3)
        t.join(60)
        assert results[-1] is True and ranks.engine.weight_version == "step-3"
    finally:
        ranks.trainer.close()
        ranks.engine.close()


def test_engine_last_stats_gives_the_engine_side_of_the_last_refit():
    ranks = Ranks()
    try:
        ranks.register_all()
        results: list = []
        t = _serve_in_background(ranks.engine, results)
        _train(ranks, 1)
        ranks.trainer.refit(1)
        t.join(60)
        stats = ranks.engine.last_stats
        assert stats["bytes"] == ranks.trainer.bytes_per_refit
        assert stats["seconds"] > 0
        assert set(stats) >= {"seconds", "apply_s", "bytes", "checksums_matched"}
    finally:
        ranks.trainer.close()
        ranks.engine.close()


def test_store_port_0_picks_a_free_port_reported_as_property_and_log(capfd):
    """master_port=0 on trainer rank 0: the system picks the port; rank 0 logs it (the line a
    launcher reads to start the other ranks) and `store_port` returns it."""
    cfg = refit.Config.from_dict(
        {"model": "tiny-qwen3", "policy": {"world_size": 1},
         "generation": {"backend": "sglang", "tp_size": 1}, "refit": {"timeout_s": 20}}
    )
    box: dict = {}

    def trainer_rank_0():
        try:
            box["trainer"] = refit.Trainer(cfg, 0, master_port=0)
        except refit.Error as e:  # reported to the test's thread
            box["error"] = e

    t = threading.Thread(target=trainer_rank_0)
    t.start()
    engine = None
    try:
        # Rank 0 waits for its engine; the engine needs the port from rank 0's log line.
        logged = ""
        port = None
        for _ in range(300):  # at most 30 s
            logged += capfd.readouterr().err
            m = re.search(r"give the other ranks REFIT_PORT=(\d+)\)", logged)
            if m:
                port = int(m.group(1))
                break
            time.sleep(0.1)
        assert port is not None, logged
        assert f"store on 127.0.0.1:{port} (port 0: the system chose it" in logged, logged
        engine = refit.Engine(cfg, 0, master_port=port)
        t.join(60)
        assert "error" not in box, box.get("error")
        assert box["trainer"].store_port == port != 0
    finally:
        t.join(60)
        if "trainer" in box:
            box["trainer"].close()
        if engine is not None:
            engine.close()
