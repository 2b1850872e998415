"""Pickling for the wire: code by reference, tensor and array bytes out of band.

:func:`dumps` returns a small pickle stream plus the raw memory of every tensor and numpy
array in the object (``memoryview``s of the original memory: nothing is copied here). The
transport sends those buffers as raw bytes; :func:`loads` rebuilds the objects over the
buffers it is given, so tensors come back with their dtype, shape and strides, writable and
owning their memory::

    payload, buffers = dumps({"w": torch.ones(1024)})
    obj = loads(payload, [bytearray(b) for b in buffers])
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rpcdist.errors import SerializationError

__all__ = ["dumps", "loads", "check_importable", "rebuild_tensor"]

Buffer = memoryview | bytearray | bytes
GradReducer = Callable[[torch.Tensor, tuple[Any, ...]], Any]


def _dense_span(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free block of memory (any dim order, no overlap)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def rebuild_tensor(
    buffer: Buffer,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    if len(memoryview(buffer)) == 0:
        t = torch.empty_strided(shape, strides, dtype=dtype)
    else:
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        t = flat.view(dtype).as_strided(shape, strides)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


class _Pickler(pickle.Pickler):
    _grad_reducer: GradReducer | None = None  # set per instance by dumps()

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return self._reduce_tensor(obj)
        if cls is np.ndarray and obj.dtype.hasobject is False:
            if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
                obj = np.ascontiguousarray(obj)
            return obj.__reduce_ex__(5)
        return NotImplemented

    def _reduce_tensor(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized or t.is_nested:
            return NotImplemented  # rare kinds: torch's own (in-band) pickling
        data = t.detach()
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        if not _dense_span(data):
            data = data.contiguous()  # a strided view with gaps: send only its elements
        span = data.as_strided((data.numel(),), (1,), data.storage_offset())
        raw = span.view(torch.uint8) if span.dtype != torch.uint8 else span
        args = (
            pickle.PickleBuffer(raw.numpy()),
            t.dtype,
            tuple(data.shape),
            tuple(data.stride()),
            t.requires_grad,
            type(t) is torch.nn.Parameter,
        )
        if t.requires_grad and self._grad_reducer is not None:
            reduced = self._grad_reducer(t, args)  # e.g. recorded as a distributed autograd send
            if reduced is not None:
                return reduced
        return (rebuild_tensor, args)


def dumps(obj: Any, grad_reducer: GradReducer | None = None) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; returns ``(payload, buffers)`` with tensor/array memory out of band.

    ``grad_reducer(tensor, args)``, if given, may pickle a tensor requiring grad as another
    ``(callable, args)`` pair (``args`` are :func:`rebuild_tensor`'s) or return None.

    Raises :class:`SerializationError` (a ``TypeError``) naming what could not be pickled.
    """
    out_of_band: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler = _Pickler(stream, protocol=5, buffer_callback=out_of_band.append)
    if grad_reducer is not None:
        pickler._grad_reducer = grad_reducer
    try:
        pickler.dump(obj)
    except Exception as exc:  # pickle raises many types (PicklingError, TypeError, AttributeError)
        raise SerializationError(f"cannot pickle {_describe(obj)}: {exc}") from exc
    return stream.getvalue(), [b.raw() for b in out_of_band] if out_of_band else []


def loads(payload: bytes, buffers: Sequence[Buffer] = ()) -> Any:
    """Rebuild what :func:`dumps` produced, over ``buffers`` (which the objects then own)."""
    return pickle.loads(payload, buffers=buffers)


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 200 else text[:200] + "..."


def check_importable(func: Any) -> str:
    """The ``module.qualname`` of ``func``; raises if the callee could not import it by name.

    Lambdas and functions defined inside other functions cannot be found by name on another
    process, so they are refused at the caller, before anything is sent.
    """
    if not callable(func):
        raise TypeError(f"expected a callable to run remotely, got {_describe(func)}")
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    module = getattr(func, "__module__", None) or ""
    if "<lambda>" in qualname or "<locals>" in qualname:
        kind = "a lambda" if "<lambda>" in qualname else "a local function"
        raise SerializationError(
            f"{module}.{qualname} is {kind}; functions called over RPC are sent by name, so define "
            "it at module level where the callee can import it"
        )
    return f"{module}.{qualname}" if module else qualname
