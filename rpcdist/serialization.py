"""Pickling for the wire: code by reference, tensor and array bytes out of band.

:func:`dumps` returns a small pickle stream plus the raw memory of every tensor and numpy
array in the object (``memoryview``s of the original memory: nothing is copied here). The
transport sends those buffers as raw bytes; :func:`loads` rebuilds the objects over the
buffers it is given, so tensors come back with their dtype, shape and strides, writable and
owning their memory::

    payload, buffers = dumps({"w": torch.ones(1024)})
    obj = loads(payload, [bytearray(b) for b in buffers])

In restricted mode (``loads(..., restricted=True)``) the stream may name only globals this
process trusts: tensors, numpy arrays, Python primitives and containers, builtin exceptions,
rpcdist's own runtime messages (marked with :func:`trust`), callables exposed with
:func:`expose` and classes registered with :func:`register_safe_class`. Anything else raises
:class:`~rpcdist.errors.RestrictedError` before it is imported or called, so a pickle whose
``__reduce__`` names ``os.system`` runs nothing.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import io
import pickle
import pickletools
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from rpcdist.errors import RestrictedError, SerializationError

__all__ = [
    "dumps",
    "loads",
    "check_importable",
    "rebuild_tensor",
    "rebuild_ndarray",
    "trust",
    "expose",
    "register_safe_class",
    "resolve_allowlist",
]

T = TypeVar("T")

Buffer = memoryview | bytearray | bytes
GradReducer = Callable[[torch.Tensor, Callable[..., torch.Tensor], tuple[Any, ...]], Any]


def _dense_span(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free block of memory (any dim order, no overlap)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _covering_span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last in memory, if no two of its elements share a
    place (else, or when empty, 0). torch's strides are never negative."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    if t.numel() == 0 or any(n == 0 for _, n in dims):
        return 0
    reach = 0  # how far the dimensions with smaller strides reach
    for stride, n in dims:
        if stride <= reach:
            return 0  # overlapping (e.g. expanded): a stride of 0, or inside a smaller dim's reach
        reach += (n - 1) * stride
    return reach + 1


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.complex128: np.dtype(np.complex128),
    torch.complex64: np.dtype(np.complex64),
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}
"""dtypes numpy knows: their CPU tensors ``Tensor.numpy()`` views without a copy, and a received
one is rebuilt as numpy's view of its buffer (others, such as bfloat16, take torch's path)."""

_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: str(dtype).removeprefix("torch.") for dtype in _NUMPY_DTYPES}
_BY_NAME: dict[str, tuple[torch.dtype, np.dtype]] = {
    name: (dtype, _NUMPY_DTYPES[dtype]) for dtype, name in _DTYPE_NAMES.items()
}


def rebuild_tensor(
    buffer: Buffer,
    dtype: torch.dtype | str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    """The tensor a sender's :func:`dumps` described, over ``buffer`` (its memory, no copy).

    ``dtype`` is a torch dtype, or the name of one numpy knows too ("float32"): the common
    case travels as a name, a string in the stream, where a dtype object would be a global
    that pickling and unpickling each look up through the import system."""
    if type(dtype) is str:
        named = _BY_NAME.get(dtype)
        if named is None:
            raise SerializationError(f"a tensor arrived with an unknown dtype {dtype!r}")
        dtype, known = named
    else:
        known = _NUMPY_DTYPES.get(dtype)
    if len(memoryview(buffer)) == 0:
        if 0 not in tuple(shape):
            # only an empty tensor travels without bytes: never allocate what a message claims
            raise SerializationError(f"a tensor of shape {shape} arrived without its data")
        t = torch.empty_strided(shape, strides, dtype=dtype)
    elif known is not None:
        # One numpy call (it checks that shape and strides stay inside the buffer): 1.0-1.5 us
        # warm against 2.5-3.1 for torch's frombuffer -> view -> as_strided.
        size = known.itemsize
        byte_strides = tuple([stride * size for stride in strides])
        t = torch.from_numpy(np.ndarray(shape, known, buffer, 0, byte_strides))
    else:
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        t = flat.view(dtype).as_strided(shape, strides)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def rebuild_sparse_coo(
    indices: torch.Tensor,
    values: torch.Tensor,
    size: tuple[int, ...],
    requires_grad: bool,
    coalesced: bool,
) -> torch.Tensor:
    """A sparse COO tensor from its indices and values (which travelled as dense tensors);
    its invariants are checked, so bad indices from a peer are an error, not memory damage."""
    t = torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced, check_invariants=True)
    if requires_grad:
        t.requires_grad_(True)
    return t


_MAX_DTYPE_DEPTH = 8  # nested structured dtypes in a description


def _dtype_description(dtype: np.dtype) -> Any:
    """``dtype`` as :func:`rebuild_ndarray` takes it back: its string (``"<i8"``) for a plain
    dtype, ``(base, shape)`` for a subarray, and for a structured one numpy's dict form (names,
    formats, offsets, itemsize: padding and alignment kept), whose offsets numpy checks."""
    if dtype.fields is not None:
        names = list(dtype.names)
        fields = [dtype.fields[name] for name in names]
        description: dict[str, Any] = {
            "names": names,
            "formats": [_dtype_description(field[0]) for field in fields],
            "offsets": [field[1] for field in fields],
            "itemsize": dtype.itemsize,
        }
        if any(len(field) > 2 for field in fields):
            description["titles"] = [field[2] if len(field) > 2 else None for field in fields]
        if dtype.isalignedstruct:
            description["aligned"] = True
        return description
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return (_dtype_description(base), shape)
    return dtype.str


_STRUCT_KEYS = frozenset(("names", "formats", "offsets", "itemsize", "titles", "aligned"))


def _check_description(description: Any, depth: int = 0) -> None:
    """Only what :func:`_dtype_description` makes: strings, (base, shape) and struct dicts."""
    if type(description) is str:
        return
    if depth < _MAX_DTYPE_DEPTH and type(description) is tuple and len(description) == 2:
        _check_description(description[0], depth + 1)
        _check_shape(description[1])
        return
    if depth < _MAX_DTYPE_DEPTH and type(description) is dict and description.keys() <= _STRUCT_KEYS:
        names, formats = description.get("names"), description.get("formats")
        offsets, titles = description.get("offsets"), description.get("titles", [])
        if (
            type(names) is list
            and all(type(name) is str for name in names)
            and type(formats) is list
            and len(formats) == len(names)
            and type(offsets) is list
            and len(offsets) == len(names)
            and all(type(offset) is int for offset in offsets)
            and type(description.get("itemsize")) is int
            and type(description.get("aligned", False)) is bool
            and type(titles) is list
            and all(title is None or type(title) is str for title in titles)
        ):
            for field in formats:
                _check_description(field, depth + 1)
            return
    raise SerializationError(f"an array arrived with a malformed dtype description {description!r:.200}")


def _check_shape(shape: Any) -> None:
    if type(shape) is int:
        return
    if type(shape) is not tuple or not all(type(n) is int for n in shape):
        raise SerializationError(f"an array arrived with a malformed shape {shape!r:.200}")


_dtypes_by_string: dict[str, np.dtype] = {}


def _dtype_from(description: Any) -> np.dtype:
    """The dtype a message describes, made by numpy's constructor (which keeps its size
    consistent with its fields and shapes: never a dtype's ``__setstate__``, which takes any
    size it is told, so an array could claim memory it does not have). Object dtypes are
    refused: their elements would be pointers read from the message."""
    if type(description) is str:
        dtype = _dtypes_by_string.get(description)
        if dtype is not None:
            return dtype
    _check_description(description)
    try:
        dtype = np.dtype(description)
    except Exception as exc:  # noqa: BLE001 - numpy raises TypeError, ValueError, ...
        raise SerializationError(
            f"an array arrived with an unknown dtype {description!r:.200}: {exc}"
        ) from exc
    if dtype.hasobject:
        raise SerializationError(f"an array arrived with an object dtype {description!r:.200}")
    if type(description) is str and len(_dtypes_by_string) < 1024:
        _dtypes_by_string[description] = dtype
    return dtype


def rebuild_ndarray(buffer: Buffer, description: Any, shape: tuple[int, ...], order: str) -> np.ndarray:
    """The numpy array a sender's :func:`dumps` described, over ``buffer`` (no copy): numpy
    checks that the buffer holds a whole number of elements and that ``shape`` has as many."""
    dtype = _dtype_from(description)
    _check_shape(shape)
    if order not in ("C", "F"):
        raise SerializationError(f"an array arrived with an unknown order {order!r:.20}")
    if dtype.itemsize == 0:  # no bytes per element (np.dtype("U0")): nothing to read or allocate
        if len(memoryview(buffer)):
            raise SerializationError("an array of zero-size elements arrived with bytes")
        return np.empty(shape, dtype, order=order)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


def rebuild_numpy_scalar(description: Any, data: bytes) -> np.generic:
    """The numpy scalar (``np.float32(1.5)``) a sender's :func:`dumps` described."""
    dtype = _dtype_from(description)
    if dtype.itemsize == 0 or len(data) != dtype.itemsize:
        raise SerializationError(f"a numpy scalar of {dtype} arrived with {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype)[0]


def rebuild_numpy_dtype(description: Any) -> np.dtype:
    """A numpy dtype sent as a value."""
    return _dtype_from(description)


class _Pickler(pickle.Pickler):
    _grad_reducer: GradReducer | None = None  # set per instance by dumps()

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return self._reduce_tensor(obj)
        if cls is np.ndarray and obj.dtype.hasobject is False:
            return self._reduce_ndarray(obj)
        if issubclass(cls, np.generic) and not obj.dtype.hasobject:
            return (rebuild_numpy_scalar, (_dtype_description(obj.dtype), obj.tobytes()))
        if issubclass(cls, np.dtype) and not obj.hasobject:
            return (rebuild_numpy_dtype, (_dtype_description(obj),))
        return NotImplemented

    def _reduce_ndarray(self, a: np.ndarray) -> Any:
        # numpy's own reduction rebuilds the dtype with __setstate__, which a restricted
        # receiver cannot trust (it takes any size it is told): the dtype travels as its
        # description, the elements out of band as they are.
        if a.flags.c_contiguous:
            order = "C"
        elif a.flags.f_contiguous:
            order = "F"
        else:
            a, order = np.ascontiguousarray(a), "C"
        try:
            data = pickle.PickleBuffer(a)
        except ValueError:  # a dtype the buffer protocol cannot name (datetime64): its bytes
            data = pickle.PickleBuffer(a.reshape(-1, order="A").view(np.uint8) if a.itemsize else b"")
        return (rebuild_ndarray, (data, _dtype_description(a.dtype), a.shape, order))

    def _reduce_tensor(self, t: torch.Tensor) -> Any:
        if (
            t.is_cpu
            and t.layout is torch.strided
            and (dtype_name := _DTYPE_NAMES.get(t.dtype)) is not None
            and t.is_contiguous()
            and not (t.is_nested or t.is_conj() or t.is_neg())
        ):
            # The common case, in a few cheap calls (every call site pays for them, and on a
            # worker that has just woken each costs several times its warm price): numpy views
            # the tensor's own elements, which travel as they are.
            data = t.detach() if t.requires_grad else t
            args = (
                pickle.PickleBuffer(data.numpy()),
                dtype_name,
                tuple(t.shape),
                t.stride(),
                t.requires_grad,
                type(t) is torch.nn.Parameter,
            )
            return self._with_grad(t, rebuild_tensor, args)
        if t.layout == torch.sparse_coo and t.device.type == "cpu":
            data = t.detach()
            parts = (data._indices(), data._values(), tuple(data.shape), t.requires_grad, data.is_coalesced())
            return self._with_grad(t, rebuild_sparse_coo, parts)
        if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized or t.is_nested:
            return NotImplemented  # rare kinds: torch's own (in-band) pickling
        data = t.detach()
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        length = data.numel()
        if not _dense_span(data):
            covering = _covering_span(data)
            if covering and covering * data.element_size() <= max(4 * length * data.element_size(), 1 << 16):
                length = covering  # a view with gaps: its strides travel too, as torch's do
            else:
                # Overlapping (expanded) views, or a small view of a big storage: only its
                # elements travel, and the receiver gets memory it can write into.
                data = data.contiguous()
        span = data.as_strided((length,), (1,), data.storage_offset())
        raw = span.view(torch.uint8) if span.dtype != torch.uint8 else span
        args = (
            pickle.PickleBuffer(raw.numpy()),
            _DTYPE_NAMES.get(t.dtype, t.dtype),  # a name where numpy knows it, as above
            tuple(data.shape),
            tuple(data.stride()),
            t.requires_grad,
            type(t) is torch.nn.Parameter,
        )
        return self._with_grad(t, rebuild_tensor, args)

    def _with_grad(self, t: torch.Tensor, rebuild: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> Any:
        """``(rebuild, args)``, unless the grad reducer pickles ``t`` (requiring grad) otherwise."""
        if t.requires_grad and self._grad_reducer is not None:
            reduced = self._grad_reducer(t, rebuild, args)  # e.g. recorded as a distributed autograd send
            if reduced is not None:
                return reduced
        return (rebuild, args)


def dumps(obj: Any, grad_reducer: GradReducer | None = None) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; returns ``(payload, buffers)`` with tensor/array memory out of band.

    ``grad_reducer(tensor, rebuild, args)``, if given, may pickle a tensor requiring grad as
    another ``(callable, args)`` pair (``rebuild(*args)`` is the tensor: :func:`rebuild_tensor`,
    or :func:`rebuild_sparse_coo` for a sparse COO tensor) or return None.

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


def loads(
    payload: bytes | memoryview,
    buffers: Sequence[Buffer] = (),
    restricted: bool = False,
    allowed: dict[str, Any] | None = None,
) -> Any:
    """Rebuild what :func:`dumps` produced, over ``buffers`` (which the objects then own).

    With ``restricted=True`` only trusted globals are admitted (see the module docstring),
    plus ``allowed`` (``{"module:qualname": object}``, from :func:`resolve_allowlist`); any
    other raises :class:`~rpcdist.errors.RestrictedError`, and so does malformed input
    (restricted mode decodes bytes from untrusted peers: every failure is that one type).
    """
    if not restricted:
        return pickle.loads(payload, buffers=buffers)
    stream = io.BytesIO(payload)
    _check_declared_sizes(stream)
    stream.seek(0)
    try:
        return _RestrictedUnpickler(stream, buffers, allowed or {}).load()
    except RestrictedError:
        raise
    except RecursionError as exc:
        raise RestrictedError("restricted mode refused a message nested too deeply") from exc
    except Exception as exc:  # noqa: BLE001 - a malformed stream raises anything; say so as one type
        reason = f"{type(exc).__name__}: {exc}"
        raise RestrictedError(f"restricted mode could not decode a message: {reason}") from exc


# ---------------------------------------------------------------------------- restricted mode
_MEMO_PUTS = frozenset("pqr")  # PUT, BINPUT, LONG_BINPUT: they name the memo slot to fill


def _check_declared_sizes(stream: io.BytesIO) -> None:
    """Walk the opcodes before C pickle runs them: it allocates what an opcode declares before
    it can tell the message is shorter (BYTEARRAY8, BINBYTES8: 20 bytes could claim gigabytes),
    and a memo put grows the memo table to twice the slot it names, zeroed (an 8-byte message
    naming slot 10**9 costs 16 GB). A pickler fills slots in order, so a put may name a filled
    slot or the next free one, nothing beyond."""
    memo_size = 0
    try:
        for opcode, arg, position in pickletools.genops(stream):
            code = opcode.code
            if code == "\x94":  # MEMOIZE: the next free slot
                memo_size += 1
            elif code in _MEMO_PUTS:
                if arg > memo_size:
                    raise RestrictedError(
                        f"restricted mode refused a message whose memo put at byte {position} names "
                        f"slot {arg} with {memo_size} filled (a pickler fills slots in order)"
                    )
                memo_size = max(memo_size, arg + 1)
    except RestrictedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformation: one clear type
        raise RestrictedError(f"restricted mode refused a malformed message: {exc}") from exc


# "module:qualname" -> object, as pickle names globals (``whichmodule`` / ``__qualname__``).
_trusted: dict[str, Any] = {}
_trusted_ids: dict[int, Any] = {}  # id -> object: what a restricted ``getattr`` may return
_trusted_lock = threading.Lock()

# Only constructors that cannot allocate more than the message holds: no ``range`` (a lazy
# iterable of any length that ``set``/``list`` would expand) and no ``bytes(n)``/``bytearray(n)``
# (protocol 5 encodes those with opcodes, not by calling them).
_SAFE_BUILTINS = ("set", "frozenset", "complex", "slice")


def _pickle_name(obj: Any) -> str:
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qualname is None:
        raise TypeError(f"{_describe(obj)} has no name: only functions and classes can be trusted")
    module = pickle.whichmodule(obj, qualname)
    return f"{module}:{qualname}"


def trust(obj: T, *names: str) -> T:
    """Admit ``obj`` (a function or class) in restricted-mode messages, under the name pickle
    gives it and any extra ``"module:qualname"`` ``names``. Usable as a decorator; internal
    (users call :func:`expose` or :func:`register_safe_class`)."""
    with _trusted_lock:
        for name in (_pickle_name(obj), *names):
            _trusted[name] = obj
        _trusted_ids[id(obj)] = obj
    return obj


def expose(func: T) -> T:
    """Let peers call ``func`` on this worker in restricted mode (a decorator).

    Without restricted mode it changes nothing. The function is found by its module and
    qualified name, which the callee only looks up among exposed functions: nothing is imported
    on a caller's say-so::

        @rpcdist.rpc.expose
        def forward(x): ...
    """
    if not callable(func):
        raise TypeError(f"expose() takes a function, got {_describe(func)}")
    return trust(func)


def register_safe_class(cls: type[T]) -> type[T]:
    """Let instances of ``cls`` travel in restricted-mode messages (arguments and results).

    Decoding an instance calls ``cls``'s constructor path that pickle uses (``__reduce__``,
    ``__setstate__``), so register only classes whose unpickling runs no code you would not
    run for any caller. Usable as a decorator.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_safe_class() takes a class, got {_describe(cls)}")
    return trust(cls)


def resolve_allowlist(names: Iterable[str]) -> dict[str, Any]:
    """Import the qualified names of an allowlist (``"pkg.module.function"``, or
    ``"pkg.module:Class.method"``) and return them keyed as pickle names them.

    Raises ``ValueError`` naming an entry that does not resolve: a typo should fail at
    init, not as a refused call later.
    """
    allowed: dict[str, Any] = {}
    for name in names:
        obj = _import_qualified(name)
        if obj is None:
            raise ValueError(
                f"allowlist entry {name!r} does not name an importable function or class "
                "(write it as 'package.module.function' or 'package.module:Class.method')"
            )
        allowed[_pickle_name(obj)] = obj
        module, _, qualname = name.rpartition(":") if ":" in name else name.rpartition(".")
        allowed[f"{module}:{qualname}"] = obj
    return allowed


def _import_qualified(name: str) -> Any:
    if ":" in name:
        module_name, qualname = name.split(":", 1)
        candidates = [(module_name, qualname)]
    else:
        parts = name.split(".")
        candidates = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    for module_name, qualname in candidates:
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if callable(obj):
            return obj
    return None


def _builtin_trusted(module: str, name: str) -> Any:
    """The globals every restricted process admits (data, not code), or None."""
    if module == "builtins":
        value = getattr(builtins, name, None)
        if name in _SAFE_BUILTINS:
            return value
        if isinstance(value, type) and issubclass(value, BaseException):
            return value  # exceptions travel back to callers
        if name == "getattr":
            return _restricted_getattr
        return None
    if module == "collections" and name in ("OrderedDict", "deque", "Counter"):
        return getattr(collections, name)
    if module == "torch":
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format) or any(
            value is cls for cls in (torch.device, torch.Size)
        ):
            return value
        return None
    if module == "torch._C" and name == "_VariableFunctionsClass":
        return _loaded_attr(module, name)  # only a namespace: its functions pass _restricted_getattr
    if module.startswith("torch.optim"):
        # torch's own optimizers (for the DistributedOptimizer): they allocate only per
        # parameter the message carries. Not torch.nn layers: Linear(10**6, 10**6) would
        # allocate terabytes (allowlist or register the ones a job sends).
        value = _loaded_attr(module, name)
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            return value
        return None
    if module == "rpcdist.errors":
        value = _loaded_attr(module, name)
        return value if isinstance(value, type) and issubclass(value, BaseException) else None
    return None


def _loaded_attr(module: str, qualname: str) -> Any:
    """``module.qualname`` if the module is already imported (restricted mode imports nothing)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _restricted_getattr(owner: Any, name: str) -> Any:
    """``getattr`` as pickle uses it for methods and torch's builtin functions, admitting only
    trusted results."""
    if not isinstance(name, str) or name.startswith("__"):
        raise RestrictedError(f"restricted mode refused getattr(..., {name!r})")
    value = getattr(owner, name, None)
    if value is not None and (
        _trusted_ids.get(id(value)) is value or _current_allowed_ids().get(id(value)) is value
    ):
        return value
    raise RestrictedError(_refusal(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"))


_local = threading.local()


def _current_allowed_ids() -> dict[int, Any]:
    return getattr(_local, "allowed_ids", {})


def _refusal(what: str) -> str:
    return (
        f"restricted mode refused {what}: it is not exposed or registered on this worker (decorate a "
        f"function with @rpcdist.rpc.expose, list it in RpcBackendOptions(allowlist=[...]), or register a "
        f"class with rpcdist.rpc.register_safe_class)"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, buffers: Sequence[Buffer], allowed: dict[str, Any]) -> None:
        super().__init__(stream, buffers=buffers)
        self._allowed = allowed

    def load(self) -> Any:
        previous = getattr(_local, "allowed_ids", None)
        _local.allowed_ids = {id(v): v for v in self._allowed.values()}
        try:
            return super().load()
        finally:
            _local.allowed_ids = previous

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}:{name}"
        obj = _trusted.get(key)
        if obj is None:
            obj = self._allowed.get(key)
        if obj is None:
            obj = _builtin_trusted(module, name)
        if obj is None:
            raise RestrictedError(_refusal(f"{module}.{name}"))
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise RestrictedError("restricted mode refused a persistent id")


trust(rebuild_tensor)
trust(rebuild_sparse_coo)
trust(rebuild_ndarray)
trust(rebuild_numpy_scalar)
trust(rebuild_numpy_dtype)


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
