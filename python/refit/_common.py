"""Pure-Python pieces of the refit module: exceptions, TensorSlot, and the dict -> YAML writer.

The extension module (refit._refit) imports this module to raise its exceptions, so it must not
import the extension itself.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, NamedTuple, Tuple

__all__ = ["Error", "SetupError", "TensorSlot", "dict_to_yaml", "merge_dicts", "replace_config_dict", "setup_error"]


class Error(RuntimeError):
    """A refit call failed.

    ``str(error)`` is the text the ``refit`` CLI prints after ``refit: error:`` — the status code
    name, then a message naming what failed and where (rank, peer, bucket, tensor, key).

    Attributes:
        code: the status code as an identifier: ``"invalid_argument"``, ``"not_found"``,
            ``"corruption"``, ``"io_error"``, ``"timeout"``, ``"aborted"``, ``"unsupported"``
            or ``"internal"``.
        message: the message without the code name.
    """

    def __init__(self, text: str, code: str = "internal", message: str | None = None) -> None:
        super().__init__(text)
        self.code = code
        self.message = text if message is None else message

    def __reduce__(self):  # keeps code and message across pickling (multiprocessing)
        return (type(self), (str(self), self.code, self.message))


class SetupError(Error):
    """A setup error: bad config value, unknown model or tensor, unsupported combination.

    The CLI exits 2 on these (``invalid_argument``, ``not_found``, ``unsupported``).
    """


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
