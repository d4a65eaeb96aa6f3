"""PyTorch integration: refit ranks built from an FSDP2 trainer module and a Hugging Face engine.

``trainer_from_fsdp(module, config, rank)``
    The trainer side over a model wrapped with FSDP2 (``torch.distributed.fsdp.fully_shard``): each
    parameter's local shard (``DTensor.to_local()``, placement ``Shard(0)``) is registered under its
    HF name. CPU shards — and GPU shards with ``device: cuda`` — are registered zero-copy (refit
    reads them in place); with ``device: cpu`` GPU shards are staged through pinned host copies
    refreshed before every refit (``refit.accepts_device_memory(config)`` tells which).

``engine_from_hf(module, config, engine_rank)``
    An engine rank backed by any ``nn.Module`` whose state dict has the trainer's names (a Hugging
    Face ``transformers`` model, or anything else), with ``generation.layout: hf``: every engine
    rank receives every tensor whole under its name. Tensors whose dtype and device refit can write
    are registered in place (zero-copy); the others are staged and copied into the module by the
    engine's ``on_load_weights`` hook, or handed to a ``load_weights`` callable of your own (e.g.
    vLLM's or SGLang's ``model.load_weights``). No name matching: the names are the module's.

Both sides take the model's tensor table from their module (``tensor_table``): parameters, with a
parameter shared under two names (tied embeddings) listed once, plus floating-point persistent
buffers. ``config.model`` still names the preset or model directory whose config.json gives the
architecture; with an architecture refit knows, the module's table must be exactly its table.

Importing this module imports torch; ``import refit`` alone never does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from . import _refit
from ._common import SetupError, setup_error

__all__ = [
    "TorchTrainer",
    "HFEngine",
    "trainer_from_fsdp",
    "engine_from_hf",
    "torch_dtype",
    "module_tensors",
    "tensor_table",
]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES["float8_e4m3"] = torch.float8_e4m3fn

# Wrapper prefixes that leave the HF name underneath (torch.compile, activation checkpointing,
# DDP/FSDP1-style wrappers).
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def torch_dtype(refit_dtype: str) -> torch.dtype:
    """The torch dtype of a refit dtype name ("float32", "bfloat16", "float16", "float8_e4m3")."""
    try:
        return _DTYPES[refit_dtype]
    except KeyError:
        raise ValueError(f"refit dtype {refit_dtype!r} has no torch dtype here") from None


def _hf_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _storage_key(t: torch.Tensor) -> Tuple[int, int, Tuple[int, ...]]:
    """Where a tensor's elements live: equal keys mean one tensor under two names (ties)."""
    local = t.to_local() if _is_dtensor(t) else t
    try:
        base = local.untyped_storage().data_ptr()
    except AttributeError:  # torch < 2.0
        base = local.storage().data_ptr()
    return base, local.data_ptr(), tuple(t.shape)


def _locations(module: nn.Module, tensors: Dict[str, torch.Tensor]) -> Dict[str, Tuple[str, str]]:
    """For each name of ``module_tensors(module)``: the path of the submodule that holds it and
    its attribute there (under its first name when shared)."""
    out: Dict[str, Tuple[str, str]] = {}
    for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
        hf = _hf_name(name)
        if hf in tensors and hf not in out:
            path, _, attr = name.rpartition(".")
            out[hf] = (path, attr)
    return out


def module_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's weights by HF name (wrapper prefixes dropped), in registration order.

    Parameters, with a tensor shared under two names (tied embeddings: the same Parameter, or the
    same storage) listed once under its first name, then the floating-point persistent buffers
    (those ``state_dict()`` holds). Under FSDP2 the parameters are DTensors.
    """
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, p in module.named_parameters():  # the same Parameter twice appears once
        key = _storage_key(p)
        if p.numel() > 0 and key in seen:
            continue
        seen.add(key)
        out[_hf_name(name)] = p
    persistent = {_hf_name(k) for k in module.state_dict().keys()}
    for name, b in module.named_buffers():
        hf = _hf_name(name)
        if hf in persistent and hf not in out and b.is_floating_point():
            out[hf] = b
    return out


def tensor_table(tensors: Dict[str, torch.Tensor]) -> List[Tuple[str, Tuple[int, ...]]]:
    """[(name, global shape), ...] of ``module_tensors(...)``: what ``Config.with_tensor_table``
    takes."""
    return [(name, tuple(int(d) for d in t.shape)) for name, t in tensors.items()]


def _with_module_table(config: _refit.Config, tensors: Dict[str, torch.Tensor], who: str):
    """`config` with the module's tensor table, checked against config.model before any rank
    starts (an error names the tensors)."""
    cfg = config.with_tensor_table(tensor_table(tensors))
    try:
        _refit.model_spec(cfg)
    except SetupError as e:
        raise setup_error(f"{who}: the module's tensors: {e.message}", e.code) from e
    return cfg


def _summarize(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and hasattr(p, "placements") and hasattr(p, "device_mesh")


def _local_shard(
    name: str, p: torch.Tensor, rank: int, world_size: int, replicated: bool = False
) -> torch.Tensor:
    """The rank's dim-0 shard of `p`: a DTensor sharded Shard(0), a plain tensor at world 1, or a
    replicated buffer (every rank holds it whole: this rank's torch.chunk of it)."""
    if not _is_dtensor(p):
        if replicated and world_size != 1:
            chunks = torch.chunk(p.detach(), world_size, 0) if p.dim() > 0 else (p.detach(),)
            if rank < len(chunks):
                return chunks[rank]
            return p.detach()[p.shape[0]:]  # past the last chunk: no rows
        if world_size != 1:
            raise setup_error(
                f"trainer rank {rank}: parameter {name} is a plain tensor, not a DTensor; with "
                f"policy.world_size {world_size} every parameter must be sharded by fully_shard",
                "invalid_argument",
            )
        return p.detach()
    placements = tuple(p.placements)
    if len(placements) != 1 or not placements[0].is_shard(0):
        raise setup_error(
            f"trainer rank {rank}: parameter {name} has placements {placements}; refit's fsdp2 "
            "backend reads dim-0 shards over a 1-D mesh (placements (Shard(0),), as fully_shard "
            "makes them); HSDP and other layouts are not supported",
            "unsupported",
        )
    mesh = p.device_mesh
    if mesh.size() != world_size:
        raise setup_error(
            f"trainer rank {rank}: parameter {name} is sharded over {mesh.size()} ranks but "
            f"policy.world_size is {world_size}",
            "invalid_argument",
        )
    if mesh.get_local_rank() != rank:
        raise setup_error(
            f"trainer rank {rank}: this process holds shard {mesh.get_local_rank()} of {name}; "
            "pass the process's rank in the FSDP mesh as the refit trainer rank",
            "invalid_argument",
        )
    return p.to_local().detach()


class TorchTrainer:
    """A refit trainer rank over the parameters of a PyTorch module (see ``trainer_from_fsdp``).

    Attributes:
        trainer: the underlying ``refit.Trainer``.
        module: the module whose parameters are refit.
        zero_copy: names registered in place (CPU shards); the others are staged.
    """

    def __init__(
        self,
        module: nn.Module,
        config: _refit.Config,
        rank: int,
        *,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        host: Optional[str] = None,
    ) -> None:
        self.module = module
        self.rank = rank
        params = module_tensors(module)
        self._buffers = {n for n, t in params.items() if not isinstance(t, nn.Parameter)}
        # The table from the module, checked before the collective create, so that a wrong model
        # fails fast on this rank.
        config = _with_module_table(config, params, f"trainer rank {rank}")
        self.config = config
        self.trainer = _refit.Trainer(
            config, rank, master_addr=master_addr, master_port=master_port, host=host
        )
        self._on_gpu = _refit.accepts_device_memory(config)
        slots = {s.name: s for s in self.trainer.tensors}
        missing = set(slots) - set(params)
        if missing:
            error = setup_error(
                f"trainer rank {rank}: the module lacks tensors refit expects: "
                f"{_summarize(missing)}",
                "invalid_argument",
            )
            self.trainer.close(error)  # the peers learn why, not only that this rank left
            raise error
        self._params = params
        self._direct: Dict[str, Tuple[nn.Parameter, torch.Tensor]] = {}
        self._staged: Dict[str, Tuple[nn.Parameter, torch.Tensor]] = {}
        self.zero_copy: List[str] = []
        try:
            direct_ok = self._on_gpu
            for name, slot in slots.items():
                p = params[name]
                local = _local_shard(name, p, rank, config.world_size, name in self._buffers)
                want = torch_dtype(slot.dtype)
                if local.dtype != want:
                    raise setup_error(
                        f"trainer rank {rank}: parameter {name} is {local.dtype}, but "
                        f"policy.dtype is {slot.dtype}",
                        "invalid_argument",
                    )
                if tuple(local.shape) != tuple(slot.shape):
                    raise setup_error(
                        f"trainer rank {rank}: the local shard of {name} has shape "
                        f"{list(local.shape)}, refit expects {list(slot.shape)} (dim-0 chunks "
                        "with torch.chunk semantics over policy.world_size ranks)",
                        "invalid_argument",
                    )
                if self._in_place(local):
                    self.trainer.register(name, local)
                    self._direct[name] = (p, local)
                    self.zero_copy.append(name)
                elif direct_ok:
                    # device: cuda with a host shard (FSDP2's CPU offload) or a non-contiguous
                    # one: staged on the GPU the shard is on, else the current one.
                    gpu = local.device if local.device.type == "cuda" else torch.device(
                        "cuda", torch.cuda.current_device())
                    staging = torch.empty(tuple(slot.shape), dtype=want, device=gpu)
                    self.trainer.register(name, staging)
                    self._staged[name] = (p, staging)
                else:
                    pin = local.device.type == "cuda"
                    staging = torch.empty(tuple(slot.shape), dtype=want, pin_memory=pin)
                    self.trainer.register(name, staging)
                    self._staged[name] = (p, staging)
        except BaseException as error:
            self.trainer.close(error)  # the peers learn why, not only that this rank left
            raise

    def _in_place(self, local: torch.Tensor) -> bool:
        """Whether refit reads this shard itself: contiguous, on the device this config reads
        (host memory with ``device: cpu``, a GPU with ``device: cuda``)."""
        return local.is_contiguous() and local.device.type == ("cuda" if self._on_gpu else "cpu")

    @property
    def tensors(self) -> List[Any]:
        return self.trainer.tensors

    @property
    def last_stats(self) -> Dict[str, float]:
        return self.trainer.last_stats

    def _refresh(self) -> None:
        """Brings the registered storage up to date with the module's current shards."""
        world = self.config.world_size
        params = module_tensors(self.module)  # parameters may have been replaced since
        # refit's kernels run on streams of their own: the optimizer's work queued on torch's
        # streams must be done before they read a shard registered in place.
        devices = set()
        with torch.no_grad():
            for name, (p, local) in list(self._direct.items()):
                now = _local_shard(name, params[name], self.rank, world, name in self._buffers)
                if now.data_ptr() != local.data_ptr() or now.shape != local.shape:
                    if not self._in_place(now):
                        raise setup_error(
                            f"trainer rank {self.rank}: parameter {name} was replaced by a "
                            f"{'non-contiguous' if not now.is_contiguous() else now.device.type} "
                            "tensor after registration; keep its storage contiguous on the device "
                            "it was registered on"
                        )
                    self.trainer.register(name, now)  # the module swapped its storage
                    self._direct[name] = (params[name], now)
                if now.device.type == "cuda":
                    devices.add(now.device)
            for name, (p, staging) in self._staged.items():
                src = _local_shard(name, params[name], self.rank, world, name in self._buffers)
                staging.copy_(src, non_blocking=True)
                for t in (src, staging):
                    if t.device.type == "cuda":
                        devices.add(t.device)
            for dev in devices:
                torch.cuda.synchronize(dev)

    def refit(self, step: int, version: Optional[str] = None, verify: bool = False) -> None:
        """Copies GPU shards to their host staging (if any), then ``Trainer.refit``."""
        self._refresh()
        self.trainer.refit(step, version, verify)

    def traffic(self) -> List[Dict[str, object]]:
        """refit.Trainer.traffic: every rank's traffic in the last refit."""
        return self.trainer.traffic()

    def shutdown(self) -> None:
        self.trainer.shutdown()

    def close(self, error: Optional[BaseException] = None) -> None:
        """refit.Trainer.close: with `error`, first recorded as this rank's failure."""
        self.trainer.close(error)

    def __enter__(self) -> "TorchTrainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return self.trainer.__exit__(exc_type, exc, tb)


def trainer_from_fsdp(
    module: nn.Module,
    config: _refit.Config,
    rank: int,
    *,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    host: Optional[str] = None,
) -> TorchTrainer:
    """A refit trainer rank over an FSDP2 (``fully_shard``) module.

    Every parameter must be a DTensor with placements ``(Shard(0),)`` over a mesh of
    ``policy.world_size`` ranks (or a plain tensor when the world size is 1), named by its HF name
    (wrapper prefixes such as ``_orig_mod.`` are dropped), in ``policy.dtype``. Collective: every
    trainer and engine rank of the refit must be starting at the same time. ``rank`` is this
    process's rank in the FSDP mesh; ``master_port`` must differ from torch.distributed's.
    """
    return TorchTrainer(
        module, config, rank, master_addr=master_addr, master_port=master_port, host=host
    )


class HFEngine:
    """A refit engine rank whose weights live in a PyTorch module (see ``engine_from_hf``).

    Attributes:
        engine: the underlying ``refit.Engine``.
        module: the module updated by every committed refit.
        zero_copy: names registered in place (refit writes the module's own storage).
        staging: the other names' staging tensors, copied into the module (or handed to
            ``load_weights``) by the engine's ``on_load_weights`` hook.
    """

    def __init__(
        self,
        module: nn.Module,
        config: _refit.Config,
        engine_rank: int = 0,
        *,
        load_weights: Optional[Callable[[List[Tuple[str, torch.Tensor]]], Any]] = None,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        host: Optional[str] = None,
    ) -> None:
        self.module = module
        who = self._who = f"engine rank {engine_rank}"
        if config.layout != "hf":
            raise setup_error(
                f"engine_from_hf: {who}: generation.layout is {config.layout}; a module takes "
                "the weights by name: set generation.layout: hf (an engine with fused, TP-sharded "
                "parameters, such as vLLM's or SGLang's, registers them with refit.Engine "
                "instead; docs/engines.md)",
                "unsupported",
            )
        tensors = module_tensors(module)
        config = _with_module_table(config, tensors, who)
        self.config = config
        self._load_weights = load_weights
        self.engine = _refit.Engine(
            config, engine_rank, master_addr=master_addr, master_port=master_port, host=host
        )
        self.zero_copy: List[str] = []
        self.staging: Dict[str, torch.Tensor] = {}
        # Where each tensor lives in the module (its submodule's path and attribute): a refit
        # writes the module's tensors as they are then, not as they were at construction.
        self._where = _locations(module, tensors)
        self._registered: Dict[str, torch.Tensor] = {}  # in place: the storage refit writes
        self._swapped: Dict[str, torch.Tensor] = {}  # in place, replaced in the module since
        self._on_gpu = False
        try:
            on_gpu = self._on_gpu = _refit.accepts_device_memory(config)
            for slot in self.engine.params:
                target = tensors[slot.name]
                want = torch_dtype(slot.dtype)
                if load_weights is None and self._in_place(target, want):
                    self.engine.register(slot.name, target.detach())
                    self._registered[slot.name] = target.detach()
                    self.zero_copy.append(slot.name)
                    continue
                device = target.device if on_gpu and target.device.type == "cuda" else None
                if device is not None:
                    t = torch.zeros(tuple(slot.shape), dtype=want, device=device)
                else:
                    pin = target.device.type == "cuda" and torch.cuda.is_available()
                    t = torch.zeros(tuple(slot.shape), dtype=want, pin_memory=pin)
                self.engine.register(slot.name, t)
                self.staging[slot.name] = t
        except BaseException as error:
            self.engine.close(error)  # the peers learn why, not only that this rank left
            raise
        if self.staging or load_weights is not None:
            self.engine.on_load_weights(self._load)
        if self.zero_copy:
            self.engine.on_weights_changed(self._follow_swaps)

    def _in_place(self, t: torch.Tensor, want: torch.dtype) -> bool:
        """Whether refit can write `t` itself: the target precision, contiguous, on a device
        this config writes."""
        writable = t.device.type == "cuda" if self._on_gpu else t.device.type == "cpu"
        return not _is_dtensor(t) and t.dtype == want and writable and t.is_contiguous()

    def _current(self, name: str) -> torch.Tensor:
        """The module's tensor `name` now (a parameter may have been replaced since)."""
        path, attr = self._where[name]
        owner = self.module.get_submodule(path) if path else self.module
        return getattr(owner, attr)

    def _follow_swaps(self, names: List[str]) -> None:
        # After every byte of a refit (or a rollback) landed in the registered storage, before
        # verification: a tensor registered in place whose storage the module replaced since
        # (`load_state_dict(assign=True)`, `p.data = ...`, `module.to(...)`) takes a copy of it,
        # so that the module never keeps stale weights. serve_one() re-registers it in place.
        devices = set()
        with torch.no_grad():
            for name in self.zero_copy:
                registered = self._registered[name]
                now = self._current(name)
                if now.data_ptr() == registered.data_ptr() and now.dtype == registered.dtype:
                    continue
                if tuple(now.shape) != tuple(registered.shape):
                    raise setup_error(
                        f"{self._who}: parameter {name} was replaced by a "
                        f"tensor of shape {list(now.shape)} after registration; refit writes "
                        f"{list(registered.shape)}",
                        "invalid_argument",
                    )
                now.copy_(registered, non_blocking=True)
                self._swapped[name] = now
                for t in (now, registered):
                    if t.device.type == "cuda":
                        devices.add(t.device)
        for dev in devices:
            torch.cuda.synchronize(dev)

    def _register_swapped(self) -> None:
        """Between refits: registers in place again the tensors the module replaced, where refit
        can write the new storage (the next refit sends them in full); the others keep being
        copied after every refit."""
        for name in list(self._swapped):
            now = self._current(name)
            del self._swapped[name]
            if self._in_place(now, self._registered[name].dtype):
                self.engine.register(name, now.detach())
                self._registered[name] = now.detach()

    def _load(self, batch: List[Tuple[str, torch.Tensor]]) -> None:
        # On the serving thread, after every byte of the refit landed and before it is verified
        # or published: whole tensors, a decoder layer never split across calls.
        if self._load_weights is not None:
            self._load_weights(batch)
            return
        devices = set()
        with torch.no_grad():
            for name, staged in batch:
                if name not in self.staging:  # registered in place: already there
                    continue
                target = self._current(name)
                target.copy_(staged, non_blocking=True)
                if target.device.type == "cuda":
                    devices.add(target.device)
        for dev in devices:
            torch.cuda.synchronize(dev)

    def on_pause(self, hook: Optional[Callable[[], None]]) -> None:
        """hook() before any parameter changes (pause generation). If it raises, or returns after
        more than timeout_s, the refit is refused before anything is written; the session goes
        on."""
        self.engine.on_pause(hook)

    def on_resume(self, hook: Optional[Callable[[], None]]) -> None:
        """hook() after the module holds the new weights (resume generation)."""
        self.engine.on_resume(hook)

    def on_verify(self, hook: Optional[Callable[[int, str], Any]]) -> None:
        """hook(step, version) after the module holds the new weights; see Engine.on_verify."""
        self.engine.on_verify(hook)

    def serve_one(self) -> bool:
        self._register_swapped()
        return self.engine.serve_one()

    def serve(self) -> int:
        self._register_swapped()
        return self.engine.serve()

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def is_valid(self) -> bool:
        """False when a failed refit may have torn the module's weights (weight_version is "")."""
        return self.engine.is_valid

    def close(self, error: Optional[BaseException] = None) -> None:
        """refit.Engine.close: with `error`, first recorded as this rank's failure."""
        self.engine.close(error)

    def __enter__(self) -> "HFEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exc)
        return False


def engine_from_hf(
    module: nn.Module,
    config: _refit.Config,
    engine_rank: int = 0,
    *,
    load_weights: Optional[Callable[[List[Tuple[str, torch.Tensor]]], Any]] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    host: Optional[str] = None,
) -> HFEngine:
    """A refit engine rank (``generation.layout: hf``, any TP size) that keeps `module` up to date.

    The module's state dict names the tensors (``module_tensors``), as the trainer's does; with
    an architecture refit knows they must be its HF tensors. Tensors in
    ``refit.target_precision`` on a device refit writes (host memory; CUDA with ``device: cuda``)
    are written in place; the others are staged and copied in (``copy_`` converts the dtype)
    after every byte of a refit landed, before verification. With ``load_weights``, every tensor
    is staged and each batch ``[(name, tensor), ...]`` goes to it instead (for instance
    ``model.load_weights`` of an inference engine); copy what must outlive the call.
    """
    return HFEngine(
        module,
        config,
        engine_rank,
        load_weights=load_weights,
        master_addr=master_addr,
        master_port=master_port,
        host=host,
    )
