"""Engine layout -> Hugging Face parameters, for an engine backed by an unfused HF module.

vLLM and SGLang store attention and MLP projections fused (docs/design.md §6.4): ``qkv_proj`` = [q; k; v]
rows, ``gate_up_proj`` = [gate; up] rows, MoE ``w13_weight`` [E, 2*I, H] = [gate; up] per expert and
``w2_weight`` [E, H, I], and ``embed_tokens`` / ``lm_head`` padded to a multiple of 64 rows. A Hugging
Face module keeps each projection as its own parameter. ``hf_copy_plan`` lists, for tensor
parallelism 1, which block of which engine parameter becomes which HF parameter.

Pure Python on shapes and names: no torch needed (refit.torch applies the plan to tensors; the
tests apply it to NumPy arrays).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, List, Mapping, NamedTuple, Sequence, Tuple, Union

Index = Tuple[Union[int, slice], ...]

__all__ = ["CopyOp", "hf_copy_plan", "apply_plan"]


class CopyOp(NamedTuple):
    """``hf_param[...] = engine_param[index]`` (shapes equal)."""

    engine: str
    index: Index
    hf: str


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _shape_of(shape: Sequence[int], index: Index) -> Tuple[int, ...]:
    """Shape of ``array[index]`` for an index of ints and unit-step slices."""
    out: List[int] = []
    for dim, size in enumerate(shape):
        if dim >= len(index):
            out.append(size)
            continue
        ix = index[dim]
        if isinstance(ix, int):
            continue
        start, stop, _ = ix.indices(size)
        out.append(max(0, stop - start))
    return tuple(out)


def hf_copy_plan(
    model_config: Mapping[str, Any],
    engine_params: Iterable[Any],
    hf_shapes: Mapping[str, Sequence[int]],
    tp_size: int = 1,
) -> List[CopyOp]:
    """The copies that turn TP-1 engine parameters into the parameters of an HF module.

    Args:
        model_config: ``refit.model_spec(model).config``.
        engine_params: ``Engine.params`` (objects with ``name`` and ``shape``).
        hf_shapes: the HF module's parameters, name -> shape (``named_parameters()``; tied
            ``lm_head.weight`` is absent there and needs no copy).
        tp_size: ``generation.tp_size``; only 1 is supported (one engine rank holds everything).

    Raises:
        ValueError: naming the parameter, when tp_size != 1, an HF parameter is missing or of
            another shape, or an HF parameter would not be fed by any engine parameter.
    """
    if tp_size != 1:
        raise ValueError(
            f"generation.tp_size is {tp_size}: an engine backed by a Hugging Face module holds the "
            "whole model, so it needs generation.tp_size: 1"
        )
    c = model_config
    d = int(c["head_dim"])
    q_rows = int(c["num_heads"]) * d
    kv_rows = int(c["num_kv_heads"]) * d
    inter = int(c["intermediate_size"])
    moe_inter = int(c.get("moe_intermediate_size", 0))
    vocab = int(c["vocab_size"])
    fused_experts = any(name.endswith("mlp.experts.gate_up_proj") for name in hf_shapes)

    ops: List[CopyOp] = []
    engine_shapes = {}
    for p in engine_params:
        name, shape = p.name, tuple(p.shape)
        engine_shapes[name] = shape
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            ops.append(CopyOp(name, (slice(0, vocab),), name))  # drop the padding rows
            continue
        m = _LAYER.match(name)
        rest = m.group(2) if m else ""
        prefix = f"model.layers.{m.group(1)}." if m else ""
        if rest in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
            kind = rest.rsplit(".", 1)[1]
            for proj, lo, hi in (
                ("q_proj", 0, q_rows),
                ("k_proj", q_rows, q_rows + kv_rows),
                ("v_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
            ):
                ops.append(CopyOp(name, (slice(lo, hi),), f"{prefix}self_attn.{proj}.{kind}"))
        elif rest == "mlp.gate_up_proj.weight":
            ops.append(CopyOp(name, (slice(0, inter),), f"{prefix}mlp.gate_proj.weight"))
            ops.append(CopyOp(name, (slice(inter, 2 * inter),), f"{prefix}mlp.up_proj.weight"))
        elif rest == "mlp.experts.w13_weight":
            if fused_experts:  # transformers >= 5 keeps experts fused as [E, 2*I, H] = [gate; up]
                ops.append(CopyOp(name, (), f"{prefix}mlp.experts.gate_up_proj"))
            else:
                for e in range(shape[0]):
                    base = f"{prefix}mlp.experts.{e}."
                    ops.append(CopyOp(name, (e, slice(0, moe_inter)), base + "gate_proj.weight"))
                    ops.append(
                        CopyOp(name, (e, slice(moe_inter, 2 * moe_inter)), base + "up_proj.weight")
                    )
        elif rest == "mlp.experts.w2_weight":
            if fused_experts:
                ops.append(CopyOp(name, (), f"{prefix}mlp.experts.down_proj"))
            else:
                for e in range(shape[0]):
                    ops.append(CopyOp(name, (e,), f"{prefix}mlp.experts.{e}.down_proj.weight"))
        else:  # o_proj, down_proj, norms, router: the same tensor under the same name
            ops.append(CopyOp(name, (), name))

    fed = set()
    for op in ops:
        if op.hf not in hf_shapes:
            raise ValueError(
                f"engine parameter {op.engine} feeds {op.hf}, which the Hugging Face module does "
                "not have; the module must be the architecture of the refit model "
                f"({c.get('architecture', '?')})"
            )
        want = tuple(hf_shapes[op.hf])
        got = _shape_of(engine_shapes[op.engine], op.index)
        if want != got:
            raise ValueError(
                f"{op.hf} has shape {list(want)} in the Hugging Face module, but the refit model's "
                f"layout gives it {list(got)} (from {op.engine}); both must be the same model config"
            )
        fed.add(op.hf)
    unfed = [n for n in hf_shapes if n not in fed]
    if unfed:
        more = f" and {len(unfed) - 3} more" if len(unfed) > 3 else ""
        raise ValueError(
            "Hugging Face module parameters no engine parameter feeds: "
            + ", ".join(unfed[:3])
            + more
            + "; the module must be the architecture of the refit model"
        )
    return ops


def apply_plan(plan: Iterable[CopyOp], engine: Mapping[str, Any], hf: Mapping[str, Any]) -> None:
    """NumPy version of the copy: ``hf[op.hf][...] = engine[op.engine][op.index]``."""
    for op in plan:
        hf[op.hf][...] = engine[op.engine][op.index]
