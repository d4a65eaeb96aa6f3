"""Pure-Python pieces of the refit module: exceptions, TensorSlot, and the dict -> YAML writer.

The extension module (refit._refit) imports this module to raise its exceptions, so it must not
import the extension itself.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from typing import Any, Mapping, NamedTuple, Tuple

__all__ = [
    "ERROR_CLASSES",
    "Error",
    "PeerLostError",
    "ProtocolError",
    "SetupError",
    "TimeoutError",
    "VerificationError",
    "TensorSlot",
    "dict_to_yaml",
    "merge_dicts",
    "replace_config_dict",
    "setup_error",
]


class Error(RuntimeError):
    """A refit call failed.

    ``str(error)`` is the text the ``refit`` CLI prints after ``refit: error:`` — the status code
    name, then a message naming what failed and where (rank, peer, bucket, tensor, key). A failure
    that started on another rank names that rank and its own error (the root cause).

    The class says what to do next (``kind``):

    * ``SetupError`` — refused: a config value, an input, a registration or a version label. Fix
      it; the session, if one exists, is unchanged.
    * ``PeerLostError`` — a rank this one depends on exited, stopped or was cut off. Close every
      rank and build the session anew (docs/rl-loop.md, "Recovering from a dead rank").
    * ``TimeoutError`` — a bounded wait ran out while the peers were alive (also a
      ``builtins.TimeoutError``).
    * ``VerificationError`` — the bytes arrived but failed the verification hook or
      ``refit.checksum``; the engines did not publish the version.
    * ``ProtocolError`` — a peer sent what this rank cannot accept (a message out of order or
      malformed: mixed refit versions, or a bug).
    * ``Error`` itself — anything else (a hook's own error, an I/O error, a bug in refit).

    Attributes:
        code: the status code as an identifier: ``"invalid_argument"``, ``"not_found"``,
            ``"corruption"``, ``"io_error"``, ``"timeout"``, ``"aborted"``, ``"unsupported"``
            or ``"internal"``.
        message: the message without the code name.
        kind: ``"setup"``, ``"peer_lost"``, ``"timeout"``, ``"verification"``, ``"protocol"``
            or ``"other"`` (the class, as a string).
        rank: the rank the failure started on (the root cause): a trainer rank, or the engine rank
            *g* = engine index × tp_size + TP rank; ``None`` when no rank was involved (a config
            error before any rank existed).
        role: ``"trainer"``, ``"engine"`` or ``None``, with ``rank``.
        process: that rank's name (``"engine 0 tp rank 1"``), or ``None``.
        recoverable: whether the object that raised can go on (its ``session_ok`` still holds:
            the next ``refit()`` / ``serve_one()`` runs normally).
    """

    kind_name = "other"

    def __init__(
        self,
        text: str,
        code: str = "internal",
        message: str | None = None,
        rank: int | None = None,
        role: str | None = None,
        process: str | None = None,
        recoverable: bool = False,
    ) -> None:
        super().__init__(text)
        self.code = code
        self.message = text if message is None else message
        self.kind = self.kind_name
        self.rank = rank
        self.role = role
        self.process = process
        self.recoverable = recoverable

    def __reduce__(self):  # keeps every attribute across pickling (multiprocessing)
        return (
            type(self),
            (str(self), self.code, self.message, self.rank, self.role, self.process, self.recoverable),
        )


class SetupError(Error):
    """Refused: a bad config value, an unknown model or tensor, an unsupported combination, a bad
    registration (shape, dtype, device, storage that overlaps another tensor's) or a version label
    already published.

    The CLI exits 2 on these at setup (``invalid_argument``, ``not_found``, ``unsupported``).
    """

    kind_name = "setup"


class PeerLostError(Error):
    """A rank this one depends on exited, stopped or was cut off; ``rank`` / ``role`` name it.
    The session is over: close every rank and build it anew."""

    kind_name = "peer_lost"


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - refit.TimeoutError on purpose
    """A bounded wait ran out while the peers were alive (``refit.timeout_s``, or the ``timeout``
    of ``Engine.serve_one``). Also a ``builtins.TimeoutError``."""

    kind_name = "timeout"


class VerificationError(Error):
    """The bytes arrived but failed the verification hook or ``refit.checksum`` on the rank
    named; the engines did not publish the version (with ``refit.keep_previous`` they rolled
    back). The session goes on."""

    kind_name = "verification"


class ProtocolError(Error):
    """A peer sent what this rank cannot accept: a message out of order or malformed (mixed refit
    versions, or a bug in refit)."""

    kind_name = "protocol"


ERROR_CLASSES = {
    cls.kind_name: cls for cls in (Error, SetupError, PeerLostError, TimeoutError, VerificationError, ProtocolError)
}


_CODE_NAMES = {
    "invalid_argument": "invalid argument",
    "not_found": "not found",
    "corruption": "corruption",
    "io_error": "I/O error",
    "timeout": "timeout",
    "aborted": "aborted",
    "unsupported": "unsupported",
    "internal": "internal error",
}


def setup_error(message: str, code: str = "invalid_argument") -> SetupError:
    """A SetupError raised from Python, worded like the library's (``"<code name>: <message>"``)."""
    return SetupError(f"{_CODE_NAMES.get(code, code)}: {message}", code, message)


class TensorSlot(NamedTuple):
    """One tensor a rank must register: its name, local shape and refit dtype name.

    ``dtype`` is ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"float8_e4m3"``. A NumPy array
    registered for a 16- or 8-bit slot may be ``uint16`` / ``uint8`` holding the bit patterns.
    """

    name: str
    shape: Tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# YAML plain scalars that would not read back as the same string.
_PLAIN = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_./+-]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~", ".inf", ".nan"}


def _scalar(value: Any, key: str) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value)  # a JSON string is a YAML double-quoted scalar
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v, key) for v in value) + "]"
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            items.append(f"{_key(k, key)}: {_scalar(v, key + '.' + str(k))}")
        return "{" + ", ".join(items) + "}"
    raise TypeError(
        f"config key {key}: a {type(value).__name__} cannot be written as YAML; "
        "allowed: None, bool, int, float, str, list, dict"
    )


def _key(k: Any, where: str) -> str:
    if not isinstance(k, str):
        raise TypeError(f"config key under {where or 'the top level'}: keys must be str, got {k!r}")
    return k if _PLAIN.match(k) else json.dumps(k)


def dict_to_yaml(d: Mapping[str, Any]) -> str:
    """The YAML text of a (nested) dict of config values, block style, one key per line."""
    if not isinstance(d, Mapping):
        raise TypeError(f"a config dict must be a mapping, got {type(d).__name__}")
    lines: list[str] = []

    def emit(m: Mapping[str, Any], indent: int, prefix: str) -> None:
        for k, v in m.items():
            dotted = f"{prefix}.{k}" if prefix else str(k)
            name = _key(k, prefix)
            if isinstance(v, Mapping) and v:
                lines.append(" " * indent + f"{name}:")
                emit(v, indent + 2, dotted)
            else:
                lines.append(" " * indent + f"{name}: {_scalar(v, dotted)}")

    emit(d, 0, "")
    return "\n".join(lines) + "\n"


def merge_dicts(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """`base` with `overrides` applied key by key; nested mappings merge, other values replace."""
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping, got {type(overrides).__name__}")
    out = dict(base)
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge_dicts(out[k], v)
        else:
            out[k] = v
    return out


def replace_config_dict(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """Config.replace: merge_dicts, and a new generation.colocated re-derives the transfer mode.

    The resolved dict always carries weight_transfer_mode (derived from colocated when the YAML
    left it out); overriding colocated alone must derive it again rather than conflict with it.
    """
    base = merge_dicts(base, {})
    gen = overrides.get("generation") if isinstance(overrides, Mapping) else None
    if isinstance(gen, Mapping) and "colocated" in gen and "weight_transfer_mode" not in gen:
        base["generation"] = {
            k: v for k, v in base.get("generation", {}).items() if k != "weight_transfer_mode"
        }
    return merge_dicts(base, overrides)
