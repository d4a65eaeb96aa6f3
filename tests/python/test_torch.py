"""refit.torch on CPU with plain (non-DTensor) modules: zero-copy and staged trainer registration,
tables from the modules' state dicts (tied weights, persistent buffers, an architecture refit does
not know), and engines that take the weights by name (generation.layout: hf) in place, staged, or
through a load_weights callable. Runs where torch is installed, Debian's torch 1.13 in CI (FSDP2
DTensors and GPUs: bench/gpu/python_device_test.py)."""

import os
import threading

import numpy as np
import pytest

if os.environ.get("REFIT_EXPECT_TORCH") == "1":  # CTest found torch at configure time
    import torch
else:
    torch = pytest.importorskip("torch")

import refit  # noqa: E402
from refit_testing import bf16_bits, free_port, hf_weights  # noqa: E402

rt = pytest.importorskip("refit.torch")


def module_from_spec(spec, dtype, step=None):
    """An nn.Module with exactly the HF parameter names and shapes of `spec` (values of `step`)."""
    root = torch.nn.Module()
    values = hf_weights(spec, step) if step is not None else None
    for name, shape in spec.tensors:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        t = torch.from_numpy(values[name]).to(dtype) if values else torch.zeros(shape, dtype=dtype)
        mod.register_parameter(leaf, torch.nn.Parameter(t))
    return root


def config(model, world_size=1, tp_size=1):
    return refit.Config.from_dict(
        {"model": model, "policy": {"world_size": world_size},
         "generation": {"tp_size": tp_size, "layout": "hf"}, "refit": {"timeout_s": 10}}
    )


def start(trainer_module, engine_module, cfg, load_weights=None):
    port = free_port()
    box = {}

    def make_engine():
        try:
            box["engine"] = rt.engine_from_hf(engine_module, cfg, 0, master_port=port,
                                              load_weights=load_weights)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=make_engine)
    thread.start()
    try:
        trainer = rt.trainer_from_fsdp(trainer_module, cfg, 0, master_port=port)
    finally:
        thread.join(timeout=30)
    assert "error" not in box, box.get("error")
    return trainer, box["engine"]


def serve(engine, box, one=False):
    """engine.serve() (or serve_one()) on a thread of its own; its result or error lands in box."""
    def run():
        try:
            box["served"] = engine.serve_one() if one else engine.serve()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def shut_down(trainer, thread, box, served):
    """The trainer shuts the engine down; its serve() returns the refits it served."""
    trainer.shutdown()
    thread.join(timeout=20)
    assert "error" not in box, box.get("error")
    assert box["served"] == served


def assert_module_is_bf16_of(engine_module, values):
    for name, p in engine_module.named_parameters():
        got = p.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(got, bf16_bits(values[name]), err_msg=name)


def test_replicated_trainer_ranks_register_views_of_their_chunks():
    """docs/rl-loop.md, "Without FSDP2": every trainer rank holds the whole module (DDP, or torch
    older than 2.4) and registers views of the dim-0 chunks an FSDP2 rank would hold; an optimizer
    step in place on the replicas is what the next refit brings to the engine, bit for bit."""
    spec = refit.model_spec("tiny-qwen3")
    world = 2
    replicas = [module_from_spec(spec, torch.float32, step=1) for _ in range(world)]
    engine_module = module_from_spec(spec, torch.bfloat16)
    cfg = config("tiny-qwen3", world_size=world)
    port = free_port()
    box, trainers, registered = {}, [None] * world, [{} for _ in range(world)]

    def make_engine():
        try:
            box["engine"] = rt.engine_from_hf(engine_module, cfg, 0, master_port=port)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    def make_trainer(rank):
        # The docs' pattern, as written there.
        try:
            tensors = rt.module_tensors(replicas[rank])
            c = cfg.with_tensor_table(rt.tensor_table(tensors))
            trainer = refit.Trainer(c, rank, master_port=port)
            for slot in trainer.tensors:
                t = tensors[slot.name].detach()
                rows = -(-t.shape[0] // world)
                view = t[rank * rows: rank * rows + slot.shape[0]]
                trainer.register(slot.name, view)
                registered[rank][slot.name] = (view, t)
            trainers[rank] = trainer
        except BaseException as e:  # noqa: BLE001
            box[f"error-{rank}"] = e

    threads = [threading.Thread(target=make_engine),
               threading.Thread(target=make_trainer, args=(1,))]
    for t in threads:
        t.start()
    make_trainer(0)
    for t in threads:
        t.join(timeout=30)
    assert not [k for k in box if k.startswith("error")], box
    engine = box["engine"]

    def on_every_rank(call):
        """`call(trainer)` on every trainer rank at once (refit and shutdown are collective)."""
        errors = []

        def one(rank):
            try:
                call(trainers[rank])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
        assert not errors, errors

    try:
        # Views, not copies: each shares its parameter's storage, contiguous, at the chunk's rows.
        for rank in range(world):
            for name, (view, whole) in registered[rank].items():
                assert view.is_contiguous(), name
                assert view.numel() == 0 or (
                    view.data_ptr() == whole.data_ptr() + rank * -(-whole.shape[0] // world)
                    * whole[0:1].numel() * whole.element_size()), name
        thread = serve(engine, box)
        on_every_rank(lambda t: t.refit(1))
        assert_module_is_bf16_of(engine_module, hf_weights(spec, 1))
        # An optimizer step, in place and the same on every replica (what DDP's all-reduce gives).
        for module in replicas:
            opt = torch.optim.SGD(module.parameters(), lr=0.25)
            for p in module.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        stepped = {name: p.detach().numpy().copy() for name, p in replicas[0].named_parameters()}
        assert not np.array_equal(stepped["model.norm.weight"], hf_weights(spec, 1)["model.norm.weight"])
        on_every_rank(lambda t: t.refit(2))
        assert_module_is_bf16_of(engine_module, stepped)
        assert engine.weight_version == "step-2"
        on_every_rank(lambda t: t.shutdown())
        thread.join(timeout=20)
        assert "error" not in box, box.get("error")
        assert box["served"] == 2
    finally:
        for t in trainers:
            t.close()
        engine.close()


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen2"])
def test_trainer_module_to_hf_engine_module(model):
    spec = refit.model_spec(model)
    trainer_module = module_from_spec(spec, torch.float32, step=1)
    # One non-contiguous parameter takes the staged path (copied before every refit).
    emb = trainer_module.model.embed_tokens
    emb.weight = torch.nn.Parameter(emb.weight.detach().t().contiguous().t())
    assert not emb.weight.is_contiguous()
    engine_module = module_from_spec(spec, torch.bfloat16)
    cfg = config(model)
    trainer, engine = start(trainer_module, engine_module, cfg)
    try:
        assert len(trainer.zero_copy) == len(trainer.tensors) - 1
        assert "model.embed_tokens.weight" not in trainer.zero_copy
        resumed = []
        engine.on_resume(lambda: resumed.append(engine.weight_version))
        box = {}
        thread = serve(engine, box)
        trainer.refit(1)
        # refit() returned after the engine copied the staging into its module.
        assert_module_is_bf16_of(engine_module, hf_weights(spec, 1))
        # Training updates the trainer's parameters in place (zero-copy) and by reassignment.
        step2 = hf_weights(spec, 2)
        with torch.no_grad():
            for name, p in trainer_module.named_parameters():
                if name != "model.norm.weight":
                    p.copy_(torch.from_numpy(step2[name]))
        norm = trainer_module.model.norm  # a new Parameter object with new storage
        norm.weight = torch.nn.Parameter(torch.from_numpy(step2["model.norm.weight"]).clone())
        trainer.refit(2)
        assert_module_is_bf16_of(engine_module, step2)
        assert resumed == ["step-1", "step-2"] and engine.weight_version == "step-2"
        shut_down(trainer, thread, box, served=2)
    finally:
        trainer.close()
        engine.close()


def test_engine_module_that_replaced_a_parameter_gets_every_refit():
    """A module may replace a parameter's storage after engine_from_hf registered it in place
    (`p.data = ...`, a new Parameter, `load_state_dict(assign=True)`, `.to(...)`). The next refit
    still reaches the module (a copy after every byte landed, before verification), and the one
    after writes the new storage in place where it can; a new dtype keeps taking the copy."""
    spec = refit.model_spec("tiny-qwen3")
    trainer_module = module_from_spec(spec, torch.float32, step=1)
    engine_module = module_from_spec(spec, torch.bfloat16)
    cfg = config("tiny-qwen3")
    trainer, engine = start(trainer_module, engine_module, cfg)

    def owner(name):
        *path, leaf = name.split(".")
        return engine_module.get_submodule(".".join(path)), leaf

    def refit_step(step):
        values = hf_weights(spec, step)
        with torch.no_grad():
            for name, p in trainer_module.named_parameters():
                p.copy_(torch.from_numpy(values[name]))
        box = {}
        thread = serve(engine, box, one=True)
        trainer.refit(step)
        thread.join(timeout=30)
        assert "error" not in box, box.get("error")
        assert box["served"] is True
        assert_module_is_bf16_of(engine_module, values)

    try:
        assert sorted(engine.zero_copy) == sorted(n for n, _ in spec.tensors)
        refit_step(1)
        norm = "model.norm.weight"
        q = next(n for n, _ in spec.tensors if n.endswith("q_proj.weight"))
        # Same Parameter, new storage (in place again from the refit after next).
        mod, leaf = owner(norm)
        getattr(mod, leaf).data = getattr(mod, leaf).data.clone()
        new_norm = getattr(mod, leaf)
        # A new Parameter of another dtype (never in place: copied after every refit).
        mod, leaf = owner(q)
        setattr(mod, leaf, torch.nn.Parameter(getattr(mod, leaf).detach().float()))
        new_q = getattr(mod, leaf)
        assert engine.engine.registered(norm).data_ptr() != new_norm.data_ptr()
        refit_step(2)  # before: the module kept step 1 in both
        assert new_norm.dtype == torch.bfloat16 and new_q.dtype == torch.float32
        refit_step(3)
        assert engine.engine.registered(norm).data_ptr() == new_norm.data_ptr()
        assert engine.engine.registered(q).data_ptr() != new_q.data_ptr()
        refit_step(4)
        assert engine.weight_version == "step-4"
    finally:
        trainer.close()
        engine.close()


def test_module_errors_name_the_parameter():
    spec = refit.model_spec("tiny-qwen3")
    cfg = config("tiny-qwen3")
    extra = module_from_spec(spec, torch.float32)
    extra.register_parameter("value_head", torch.nn.Parameter(torch.zeros(3)))
    # The fused layout needs Qwen3's own table: the extra tensor is named before any rank starts.
    fused = cfg.replace({"generation": {"layout": "fused"}})
    with pytest.raises(refit.SetupError, match="value_head is not a tensor of Qwen3ForCausalLM"):
        rt.trainer_from_fsdp(extra, fused, 0, master_port=free_port())
    # With the hf layout a module's own names are taken as given; the two sides' tables must
    # agree, which the ranks check when they meet.
    with pytest.raises(refit.Error, match="disagree on model"):
        start(extra, module_from_spec(spec, torch.bfloat16), cfg)
    with pytest.raises(refit.SetupError, match="generation.layout: hf"):
        rt.engine_from_hf(module_from_spec(spec, torch.bfloat16),
                          cfg.replace({"generation": {"layout": "fused"}}), 0,
                          master_port=free_port())
    # Wrong dtype: policy.dtype is float32, the module is bf16.
    with pytest.raises(refit.SetupError, match="policy.dtype"):
        start(module_from_spec(spec, torch.bfloat16), module_from_spec(spec, torch.bfloat16), cfg)


class NeoxLike(torch.nn.Module):
    """A made-up architecture refit has no facts about (GPT-NeoX-like names, odd shapes), with a
    tied output head, a persistent float buffer and a non-persistent one."""

    def __init__(self, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))

        self.embed_in = w(37, 24)
        self.layers = torch.nn.ModuleList()
        for _ in range(3):
            layer = torch.nn.Module()
            layer.qkv = w(72, 24)
            layer.qkv_bias = w(72)
            layer.dense = w(24, 53)
            self.layers.append(layer)
        self.embed_out = self.embed_in  # tied: sent once, under the first name
        self.register_buffer("scale", torch.randn(5, 3, generator=g).to(dtype))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def neox_model_dir(tmp_path):
    d = tmp_path / "neox"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    return str(d)


def test_module_tables_tie_weights_and_keep_persistent_buffers():
    m = NeoxLike(torch.float32, 0)
    tensors = rt.module_tensors(m)
    assert "embed_out" not in tensors and "embed_in" in tensors  # tied: once
    assert "scale" in tensors and "cache" not in tensors
    assert rt.tensor_table(tensors)[0] == ("embed_in", (37, 24))
    # A second Parameter over the same storage is a tie too.
    m2 = NeoxLike(torch.float32, 0)
    m2.embed_out = torch.nn.Parameter(m2.embed_in.data)
    assert "embed_out" not in rt.module_tensors(m2)


@pytest.mark.parametrize("mode", ["in_place", "staged", "load_weights"])
def test_unknown_architecture_from_module_to_module_by_name(tmp_path, mode):
    """A model refit has no table for: both sides take it from their modules; the engine module
    gets every tensor bit-exact in the engine dtype (bf16), written in place, staged and copied
    (an fp32 module), or through a load_weights callable."""
    cfg = config(neox_model_dir(tmp_path))
    trainer_module = NeoxLike(torch.float32, 1)
    engine_module = NeoxLike(torch.float32 if mode == "staged" else torch.bfloat16, 2)
    batches = []

    def load_weights(batch):
        batches.append([name for name, _ in batch])
        with torch.no_grad():
            targets = rt.module_tensors(engine_module)
            for name, t in batch:
                targets[name].copy_(t)

    trainer, engine = start(trainer_module, engine_module, cfg,
                            load_weights if mode == "load_weights" else None)
    try:
        if mode == "in_place":
            assert len(engine.zero_copy) == len(rt.module_tensors(engine_module))
            assert not engine.staging
        else:
            assert not engine.zero_copy
        box = {}
        thread = serve(engine, box)
        for step in (1, 2):
            with torch.no_grad():
                for p in trainer_module.parameters():
                    p.add_(0.25 * step)
                trainer_module.scale.mul_(-1.5)
            trainer.refit(step)
            want = rt.module_tensors(trainer_module)
            got = rt.module_tensors(engine_module)
            assert set(got) == set(want)
            for name, t in want.items():
                exp = t.detach().to(torch.bfloat16).view(torch.int16)
                have = got[name].detach().to(torch.bfloat16).view(torch.int16)
                assert torch.equal(have, exp), name
            # The tied head follows the embedding it shares storage with.
            assert engine_module.embed_out is engine_module.embed_in
        if mode == "load_weights":
            # Whole tensors by name, every tensor once per refit, no layer split across calls.
            per_refit = [n for b in batches for n in b]
            assert sorted(per_refit) == sorted(list(rt.module_tensors(engine_module)) * 2)
            for b in batches:
                for i in {n.split(".")[1] for n in b if n.startswith("layers.")}:
                    assert sum(n.startswith(f"layers.{i}.") for n in b) == 3, (i, b)
        shut_down(trainer, thread, box, served=2)
    finally:
        trainer.close()
        engine.close()


def test_load_weights_that_raises_ends_the_session_naming_it(tmp_path):
    cfg = config(neox_model_dir(tmp_path))

    def load_weights(batch):
        raise ValueError("engine refused " + batch[0][0])

    trainer, engine = start(NeoxLike(torch.float32, 1), NeoxLike(torch.bfloat16, 2), cfg,
                            load_weights)
    try:
        box = {}
        thread = serve(engine, box)
        with pytest.raises(refit.Error):
            trainer.refit(1)
        thread.join(timeout=30)
        err = box.get("error")
        assert isinstance(err, refit.Error), box
        assert "load_weights hook raised" in str(err)
        assert isinstance(err.__cause__, ValueError) and "engine refused" in str(err.__cause__)
        assert not engine.engine.session_ok
    finally:
        trainer.close()
        engine.close()
