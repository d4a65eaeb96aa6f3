"""PyTorch integration: refit ranks built from an FSDP2 trainer module and a Hugging Face engine.

``trainer_from_fsdp(module, config, rank)``
    The trainer side over a model wrapped with FSDP2 (``torch.distributed.fsdp.fully_shard``): each
    parameter's local shard (``DTensor.to_local()``, placement ``Shard(0)``) is registered under its
    HF name. CPU shards — and GPU shards with ``device: cuda`` — are registered zero-copy (refit
    reads them in place); with ``device: cpu`` GPU shards are staged through pinned host copies
    refreshed before every refit (``refit.accepts_device_memory(config)`` tells which).

``engine_from_hf(module, config, engine_rank)``
    An engine backed by a Hugging Face ``nn.Module`` (``Qwen3ForCausalLM``, ``LlamaForCausalLM``,
    ...). HF keeps q/k/v, gate/up and experts unfused while the engine layout is fused, so refit
    writes into staging tensors in the engine layout, and after each committed refit they are
    copied into the module's parameters (fused rows split per docs/design.md §6.4). Tensor parallelism 1
    only: the module holds the whole model. A real vLLM/SGLang engine registers its own fused
    parameters with ``refit.Engine`` instead, with no staging.

Importing this module imports torch; ``import refit`` alone never does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from . import _refit
from ._common import setup_error
from ._hf_layout import CopyOp, hf_copy_plan

__all__ = ["TorchTrainer", "HFEngine", "trainer_from_fsdp", "engine_from_hf", "torch_dtype"]

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


def _named_parameters(module: nn.Module) -> Dict[str, nn.Parameter]:
    out: Dict[str, nn.Parameter] = {}
    for name, p in module.named_parameters():  # tied parameters appear once
        out[_hf_name(name)] = p
    return out


def _summarize(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and hasattr(p, "placements") and hasattr(p, "device_mesh")


def _local_shard(name: str, p: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rank's dim-0 shard of `p` (a DTensor sharded Shard(0), or a plain tensor at world 1)."""
    if not _is_dtensor(p):
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
        self.config = config
        self.rank = rank
        params = _named_parameters(module)
        # Check names before the collective create, so a wrong model fails fast on this rank.
        spec_names = {n for n, _ in _refit.model_spec(config.model).tensors}
        extra = set(params) - spec_names
        if extra:
            raise setup_error(
                f"trainer rank {rank}: module parameters that are not parameters of "
                f"{config.model}: {_summarize(extra)}",
                "invalid_argument",
            )
        self.trainer = _refit.Trainer(
            config, rank, master_addr=master_addr, master_port=master_port, host=host
        )
        slots = {s.name: s for s in self.trainer.tensors}
        missing = set(slots) - set(params)
        if missing:
            self.trainer.close()
            raise setup_error(
                f"trainer rank {rank}: the module lacks tensors refit expects: "
                f"{_summarize(missing)}",
                "invalid_argument",
            )
        self._params = params
        self._direct: Dict[str, Tuple[nn.Parameter, torch.Tensor]] = {}
        self._staged: Dict[str, Tuple[nn.Parameter, torch.Tensor]] = {}
        self.zero_copy: List[str] = []
        try:
            direct_ok = _refit.accepts_device_memory(config)
            for name, slot in slots.items():
                p = params[name]
                local = _local_shard(name, p, rank, config.world_size)
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
                if (local.device.type == "cpu" or direct_ok) and local.is_contiguous():
                    self.trainer.register(name, local)
                    self._direct[name] = (p, local)
                    self.zero_copy.append(name)
                else:
                    pin = local.device.type == "cuda"
                    staging = torch.empty(tuple(slot.shape), dtype=want, pin_memory=pin)
                    self.trainer.register(name, staging)
                    self._staged[name] = (p, staging)
        except BaseException:
            self.trainer.close()
            raise

    @property
    def tensors(self) -> List[Any]:
        return self.trainer.tensors

    @property
    def last_stats(self) -> Dict[str, float]:
        return self.trainer.last_stats

    def _refresh(self) -> None:
        """Brings the registered storage up to date with the module's current shards."""
        world = self.config.world_size
        params = _named_parameters(self.module)  # parameters may have been replaced since
        with torch.no_grad():
            for name, (p, local) in list(self._direct.items()):
                now = _local_shard(name, params[name], self.rank, world)
                if now.data_ptr() != local.data_ptr() or now.shape != local.shape:
                    if not now.is_contiguous() or not (now.device.type == "cpu" or _refit.accepts_device_memory(self.config)):
                        raise setup_error(
                            f"trainer rank {self.rank}: parameter {name} was replaced by a "
                            f"{'non-contiguous' if not now.is_contiguous() else now.device.type} "
                            "tensor after registration; keep its storage contiguous on the device "
                            "it was registered on"
                        )
                    self.trainer.register(name, now)  # the module swapped its storage
                    self._direct[name] = (params[name], now)
            devices = set()
            for name, (p, staging) in self._staged.items():
                src = _local_shard(name, params[name], self.rank, world)
                staging.copy_(src, non_blocking=True)
                if src.device.type == "cuda":
                    devices.add(src.device)
            for dev in devices:
                torch.cuda.synchronize(dev)

    def refit(self, step: int, version: Optional[str] = None, verify: bool = False) -> None:
        """Copies GPU shards to their host staging (if any), then ``Trainer.refit``."""
        self._refresh()
        self.trainer.refit(step, version, verify)

    def shutdown(self) -> None:
        self.trainer.shutdown()

    def close(self) -> None:
        self.trainer.close()

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
    """A refit engine rank whose parameters live in a Hugging Face module (see ``engine_from_hf``).

    Attributes:
        engine: the underlying ``refit.Engine``.
        module: the HF module updated after every committed refit.
        staging: engine-layout tensors refit writes into (host memory), by engine name.
        plan: the copies from staging into the module (``refit._hf_layout.CopyOp``).
    """

    def __init__(
        self,
        module: nn.Module,
        config: _refit.Config,
        engine_rank: int = 0,
        *,
        master_addr: Optional[str] = None,
        master_port: Optional[int] = None,
        host: Optional[str] = None,
    ) -> None:
        self.module = module
        self.config = config
        if config.tp_size != 1:
            raise setup_error(
                f"engine_from_hf: generation.tp_size is {config.tp_size}; an engine backed by a "
                "Hugging Face module holds the whole model and needs generation.tp_size: 1",
                "unsupported",
            )
        self._params = _named_parameters(module)
        spec = _refit.model_spec(config.model)
        self.engine = _refit.Engine(
            config, engine_rank, master_addr=master_addr, master_port=master_port, host=host
        )
        try:
            self.plan: List[CopyOp] = hf_copy_plan(
                spec.config,
                self.engine.params,
                {n: tuple(p.shape) for n, p in self._params.items()},
            )
            pin = any(p.device.type == "cuda" for p in self._params.values())
            # device: cuda — the staging (in the engine layout) lives on the module's GPU and
            # refit writes it there; otherwise pinned host memory, copied up after each commit.
            on_gpu = _refit.accepts_device_memory(config)
            gpu = next((p.device for p in self._params.values() if p.device.type == "cuda"), None)
            self.staging: Dict[str, torch.Tensor] = {}
            for slot in self.engine.params:
                if on_gpu and gpu is not None:
                    t = torch.zeros(tuple(slot.shape), dtype=torch_dtype(slot.dtype), device=gpu)
                else:
                    t = torch.zeros(tuple(slot.shape), dtype=torch_dtype(slot.dtype), pin_memory=pin)
                self.engine.register(slot.name, t)
                self.staging[slot.name] = t
        except ValueError as e:
            self.engine.close()
            raise setup_error(f"engine_from_hf: {e}") from e
        except BaseException:
            self.engine.close()
            raise
        self._resume: Optional[Callable[[], None]] = None
        self.engine.on_resume(self._after_commit)

    def load_staging(self) -> None:
        """Copies the staging tensors into the module's parameters (done after every commit)."""
        devices = set()
        params = _named_parameters(self.module)  # parameters may have been replaced since
        with torch.no_grad():
            for op in self.plan:
                dst = params[op.hf]
                dst.copy_(self.staging[op.engine][op.index], non_blocking=True)
                if dst.device.type == "cuda":
                    devices.add(dst.device)
        for dev in devices:
            torch.cuda.synchronize(dev)

    def _after_commit(self) -> None:
        # On the serving thread, after the commit and before the trainer's refit() returns.
        self.load_staging()
        if self._resume is not None:
            self._resume()

    def on_pause(self, hook: Optional[Callable[[], None]]) -> None:
        """hook() before any parameter changes (pause generation). If it raises, or returns after
        more than timeout_s, the refit is refused before anything is written; the session goes
        on."""
        self.engine.on_pause(hook)

    def on_resume(self, hook: Optional[Callable[[], None]]) -> None:
        """hook() after the module holds the new weights (resume generation)."""
        self._resume = hook

    def on_verify(self, hook: Optional[Callable[[int, str], Any]]) -> None:
        """hook(step, version) after the module holds the new weights; see Engine.on_verify."""
        self.engine.on_verify(hook)

    def serve_one(self) -> bool:
        return self.engine.serve_one()

    def serve(self) -> int:
        return self.engine.serve()

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def is_valid(self) -> bool:
        """False when a failed refit may have torn the module's weights (weight_version is "")."""
        return self.engine.is_valid

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "HFEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False


def engine_from_hf(
    module: nn.Module,
    config: _refit.Config,
    engine_rank: int = 0,
    *,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    host: Optional[str] = None,
) -> HFEngine:
    """A refit engine rank (generation.tp_size 1) that keeps `module`'s parameters up to date.

    The module must be the HF architecture of ``config.model`` (same config). Its parameters may
    be on any device and in any dtype; they equal the trainer's weights bit for bit when their
    dtype is ``refit.target_precision`` (bf16), otherwise they are the bf16 values converted.
    """
    return HFEngine(
        module, config, engine_rank, master_addr=master_addr, master_port=master_port, host=host
    )
