"""refit: push a sharded trainer's weights into inference engines after every RL step.

The Python face of the refit C++ library (include/refit/session.h). One process is one rank:

* a trainer rank creates ``refit.Trainer(config, rank, ...)``, registers the storage of every local
  tensor once (zero-copy, through DLPack: NumPy arrays, torch CPU tensors) and calls
  ``trainer.refit(step)`` after every training step;
* an engine rank creates ``refit.Engine(config, engine_rank, ...)``, registers its parameters (the
  vLLM/SGLang layout), sets its pause/resume/verify hooks and serves refits.

``refit.torch`` (imported on first use; ``import refit`` never needs torch) builds both sides from
PyTorch modules: ``trainer_from_fsdp`` over an FSDP2 model, ``engine_from_hf`` over a Hugging Face
model. See docs/python.md and docs/rl-loop.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._cli import cli_path
from ._common import (
    Error,
    PeerLostError,
    ProtocolError,
    SetupError,
    TensorSlot,
    TimeoutError,
    VerificationError,
)
from ._refit import (
    Config,
    Engine,
    ModelSpec,
    Trainer,
    __version__,
    __wire_version__,
    accepts_device_memory,
    check,
    model_spec,
    presets,
    support_matrix,
)

if TYPE_CHECKING:  # pragma: no cover
    from . import torch

__all__ = [
    "Config",
    "Engine",
    "Error",
    "ModelSpec",
    "PeerLostError",
    "ProtocolError",
    "SetupError",
    "TensorSlot",
    "TimeoutError",
    "Trainer",
    "VerificationError",
    "__version__",
    "__wire_version__",
    "accepts_device_memory",
    "check",
    "cli_path",
    "model_spec",
    "presets",
    "support_matrix",
    "torch",
]


def __getattr__(name: str):
    # refit.torch imports torch: load it only when asked for.
    if name == "torch":
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")
