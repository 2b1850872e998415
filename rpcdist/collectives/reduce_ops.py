"""``ReduceOp`` and the kernels that apply it, in torch (never Python loops over elements)."""

from __future__ import annotations

import enum

import torch

__all__ = ["ReduceOp", "reduce_op", "combine", "check_op"]


class ReduceOp(enum.Enum):
    """How collectives combine tensors, as ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


class _LegacyReduceOp:
    """``dist.reduce_op.SUM``: the deprecated spelling older tutorials use."""

    SUM = ReduceOp.SUM
    PRODUCT = ReduceOp.PRODUCT
    MIN = ReduceOp.MIN
    MAX = ReduceOp.MAX


reduce_op = _LegacyReduceOp()

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_op(op: ReduceOp, dtype: torch.dtype) -> None:
    """Raise a clear error for an op that does not apply to ``dtype``."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a ReduceOp, not {op!r}")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{op!r} needs an integer or bool tensor, got {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise TypeError(f"{op!r} is not defined for complex tensors ({dtype})")


def combine(op: ReduceOp, acc: torch.Tensor, other: torch.Tensor) -> None:
    """``acc = acc (op) other`` in place. AVG accumulates a sum; :func:`finish` divides."""
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        if acc.dtype == torch.bool:
            acc.logical_or_(other)
        else:
            acc.add_(other)
    elif op is ReduceOp.PRODUCT:
        if acc.dtype == torch.bool:
            acc.logical_and_(other)
        else:
            acc.mul_(other)
    elif op is ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op is ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op is ReduceOp.BAND:
        acc.bitwise_and_(other)
    elif op is ReduceOp.BOR:
        acc.bitwise_or_(other)
    elif op is ReduceOp.BXOR:
        acc.bitwise_xor_(other)
    else:  # pragma: no cover - check_op rejects everything else
        raise TypeError(f"unknown reduce op {op!r}")


def finish(op: ReduceOp, acc: torch.Tensor, count: int) -> None:
    """Final step of a reduction over ``count`` tensors (AVG divides)."""
    if op is ReduceOp.AVG:
        if acc.dtype.is_floating_point or acc.dtype.is_complex:
            acc.div_(count)
        else:
            acc.copy_(torch.div(acc, count, rounding_mode="floor"))
