"""Tensors through ``rpcdist.serialization`` (in process): every kind comes back equal, with
its dtype, shape, requires_grad and class, and only its own elements travel."""

from __future__ import annotations

import pickle
import pickletools

import numpy as np
import pytest
import torch

from rpcdist import serialization
from rpcdist.errors import RestrictedError

pytestmark = pytest.mark.timeout(60)

CASES = {
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 4),
    "contiguous": lambda: torch.randn(32, 10),
    "slice of a bigger storage": lambda: torch.arange(1000.0)[500:510],
    "transposed": lambda: torch.randn(3, 4).t(),
    "every other row": lambda: torch.randn(6, 5)[::2],
    "expanded": lambda: torch.randn(1, 3).expand(4, 3),
    "requires grad": lambda: torch.randn(3, 4, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.randn(2, 2)),
    "conjugate view": lambda: torch.randn(2, 3, dtype=torch.complex64).conj(),
    "negative view": lambda: torch._neg_view(torch.randn(4)),
    "bfloat16": lambda: torch.randn(4, dtype=torch.bfloat16),
    "float16": lambda: torch.randn(3, dtype=torch.float16),
    "bool": lambda: torch.tensor([True, False, True]),
    "uint8": lambda: torch.randint(0, 255, (7,), dtype=torch.uint8),
    "int64": lambda: torch.randint(-(2**40), 2**40, (5,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tensor_comes_back_as_it_left(case: str) -> None:
    sent = CASES[case]()
    payload, buffers = serialization.dumps({"t": sent, "n": 1})
    got = serialization.loads(payload, buffers)["t"]
    assert type(got) is type(sent)
    assert got.dtype == sent.dtype and got.shape == sent.shape
    assert got.requires_grad == sent.requires_grad
    assert not got.is_conj() and not got.is_neg()  # (the bits resolved: the values are plain)
    assert torch.equal(got.detach(), sent.detach().resolve_conj().resolve_neg())


def test_a_small_slice_of_a_big_tensor_carries_only_its_elements() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    _, buffers = serialization.dumps(big[1000:1010])
    assert sum(len(b) for b in buffers) == 10 * 4
    _, buffers = serialization.dumps(big.view(1000, 1000)[3:5, 10:20])  # not contiguous
    assert sum(len(b) for b in buffers) <= 2 * 1000 * 4


def test_sending_never_copies_a_contiguous_tensor() -> None:
    sent = torch.randn(64, 64)
    _, buffers = serialization.dumps(sent)
    (buffer,) = buffers
    assert torch.frombuffer(buffer, dtype=torch.float32).data_ptr() == sent.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bfloat16])
def test_a_received_tensor_is_its_buffers_memory_and_never_reaches_past_it(dtype: torch.dtype) -> None:
    buffer = memoryview(bytearray(16 * 2))
    rebuilt = serialization.rebuild_tensor(buffer, dtype, (2, 4), (1, 2), False, False)  # a transposed view
    assert rebuilt.dtype == dtype and rebuilt.shape == (2, 4) and rebuilt.stride() == (1, 2)
    rebuilt.fill_(1)  # writable, and the buffer's own memory (no copy)
    assert bytes(buffer[: 8 * rebuilt.element_size()]) != bytes(8 * rebuilt.element_size())
    with pytest.raises((ValueError, RuntimeError)):  # claims more elements than the buffer holds
        serialization.rebuild_tensor(buffer, dtype, (64,), (1,), False, False)
    with pytest.raises((ValueError, RuntimeError)):  # a stride that walks out of it
        serialization.rebuild_tensor(buffer, dtype, (4,), (100,), False, False)


def test_a_common_tensor_names_its_dtype_as_data_not_as_a_global() -> None:
    """Each global in a stream is an import-system lookup on both sides: the dtype of a
    tensor numpy knows travels as a name, and an unknown name is refused, never guessed."""
    payload, buffers = serialization.dumps(torch.randn(4, 3))
    globals_named = [
        arg for op, arg, _ in pickletools.genops(payload) if op.name in ("STACK_GLOBAL", "GLOBAL")
    ]
    strings = [arg for op, arg, _ in pickletools.genops(payload) if "UNICODE" in op.name]
    assert "float32" in strings and "torch" not in strings and len(globals_named) == 1  # rebuild_tensor

    class Claim:
        def __reduce__(self) -> object:
            return (serialization.rebuild_tensor, (bytearray(16), "float33", (4,), (1,), False, False))

    claim = Claim()
    with pytest.raises(serialization.SerializationError, match="unknown dtype 'float33'"):
        serialization.loads(pickle.dumps(claim, protocol=5))
    with pytest.raises(RestrictedError):
        serialization.loads(pickle.dumps(claim, protocol=5), restricted=True)


# ---------------------------------------------------------------------------- numpy
ARRAYS = {
    "int big-endian 2-d": lambda: np.arange(6, dtype=">i4").reshape(2, 3),
    "float Fortran order": lambda: np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "strided view": lambda: np.arange(12)[::3],
    "0-d": lambda: np.array(3.5),
    "empty": lambda: np.zeros((0, 4)),
    "structured with a subarray field": lambda: np.array(
        [("x", 1.5, [1, 2])], dtype=[("n", "U3"), ("v", "<f8"), ("w", "<i2", (2,))]
    ),
    "aligned struct with padding": lambda: np.array(
        [(1, 2.5)], dtype=np.dtype([("a", "i1"), ("b", "<f8")], align=True)
    ),
    "struct with titles": lambda: np.array([(3,)], dtype=[(("the a", "a"), "<i4")]),
    "unicode": lambda: np.array(["ab", "c"]),
    "bytes": lambda: np.array([b"q"]),
    "bool": lambda: np.array([True, False]),
    "datetime64 (no buffer format)": lambda: np.array(["2020-01-01", "2021-02-03"], dtype="datetime64[ns]"),
    "complex": lambda: np.array([1 + 2j]),
    "zero-size elements": lambda: np.empty(3, "U0"),
}
NUMPY_VALUES = {
    "float32 scalar": lambda: np.float32(1.5),
    "int64 scalar": lambda: np.int64(-3),
    "str_ scalar": lambda: np.str_("hé"),
    "datetime64 scalar": lambda: np.datetime64("2020-01-01"),
    "plain dtype": lambda: np.dtype(">u2"),
    "structured dtype": lambda: np.dtype([("a", "<i8"), ("b", "<f4", (2,))]),
    "subarray dtype": lambda: np.dtype(("<i8", (2,))),
}


@pytest.mark.parametrize("restricted", [False, True], ids=["open", "restricted"])
@pytest.mark.parametrize("case", sorted(ARRAYS))
def test_a_numpy_array_comes_back_as_it_left_writable(case: str, restricted: bool) -> None:
    sent = ARRAYS[case]()
    payload, buffers = serialization.dumps({"a": sent})
    got = serialization.loads(payload, [bytearray(b) for b in buffers], restricted=restricted)["a"]
    assert type(got) is np.ndarray and got.dtype == sent.dtype and got.shape == sent.shape
    assert (got == sent).all()
    assert got.flags.writeable or got.size == 0


@pytest.mark.parametrize("restricted", [False, True], ids=["open", "restricted"])
@pytest.mark.parametrize("case", sorted(NUMPY_VALUES))
def test_numpy_scalars_and_dtypes_come_back_equal(case: str, restricted: bool) -> None:
    sent = NUMPY_VALUES[case]()
    payload, buffers = serialization.dumps([sent])
    (got,) = serialization.loads(payload, buffers, restricted=restricted)
    assert type(got) is type(sent) and got == sent


def test_a_numpy_array_travels_without_a_copy_or_numpys_own_globals() -> None:
    sent = np.arange(1024, dtype=np.float32)
    payload, (buffer,) = serialization.dumps(sent)
    assert np.shares_memory(np.frombuffer(buffer, dtype=np.float32), sent)
    names = [arg for op, arg, _ in pickletools.genops(payload) if op.name in ("SHORT_BINUNICODE", "GLOBAL")]
    assert not any("numpy" in str(name) for name in names), names


class _Reduced:
    """Pickles as ``func(*args)`` (a hand-made message)."""

    def __init__(self, func: object, args: tuple[object, ...], state: object = None) -> None:
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self) -> object:
        return self.reduced


def test_restricted_mode_refuses_numpys_dtype_state_which_could_claim_memory() -> None:
    """Found by the fuzzer (a segfault): numpy's own array pickles rebuild the dtype with
    ``__setstate__``, which takes any subarray shape it is told, so 64 bytes could become an
    array of 8 x 2**40 elements reaching past them. Restricted mode no longer admits numpy's
    globals; rpcdist's own pickles describe the dtype for numpy's constructor instead."""
    subarray_state = (3, "|", (np.dtype("<i8"), (1 << 40,)), None, None, -1, -1, 0)
    claim = _Reduced(np.dtype, ("i8", False, True), subarray_state)
    with pytest.raises(RestrictedError, match="refused numpy"):
        serialization.loads(pickle.dumps(claim, protocol=5), restricted=True)
    for protocol in (2, 5):  # numpy's own pickles of an array
        with pytest.raises(RestrictedError, match="refused numpy"):
            serialization.loads(pickle.dumps(np.arange(3), protocol=protocol), restricted=True)


@pytest.mark.parametrize(
    "description, shape, message",
    [
        (("<i8", (1 << 20,)), (8,), "multiple of element size"),  # a subarray bigger than the bytes
        (("<i8", (1 << 40,)), (8,), "does not fit"),
        ("O", (8,), "object dtype"),  # pointers read from the message
        ({"names": ["a"], "formats": ["O"], "offsets": [0], "itemsize": 8}, (8,), "object dtype"),
        ({"names": ["a"], "formats": ["<i8"], "offsets": [1 << 40], "itemsize": 8}, (1,), "unknown dtype"),
        ({"names": ["a"], "formats": ["<i8"], "offsets": [4], "itemsize": 8}, (8,), "unknown dtype"),
        ({"names": ["a"], "formats": [1.5], "offsets": [0], "itemsize": 8}, (8,), "malformed dtype"),
        ([("a", "<i8")], (8,), "malformed dtype"),
        ("<i8", (9,), "reshape|size"),  # more elements than the bytes hold
        ("<i8", [8], "malformed shape"),
        ("not a dtype", (8,), "unknown dtype"),
    ],
    ids=[
        "subarray-claim",
        "subarray-overflow",
        "object",
        "object-field",
        "offset-overflow",
        "field-past-itemsize",
        "number-format",
        "list-form",
        "too-many-elements",
        "list-shape",
        "unknown",
    ],
)
def test_restricted_mode_refuses_an_array_description_that_does_not_fit_its_bytes(
    description: object, shape: object, message: str
) -> None:
    data_buffer = pickle.PickleBuffer(bytearray(64))
    claim = _Reduced(serialization.rebuild_ndarray, (data_buffer, description, shape, "C"))
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(claim, protocol=5, buffer_callback=buffers.append)
    with pytest.raises(RestrictedError, match=message):
        serialization.loads(data, [bytearray(b.raw()) for b in buffers], restricted=True)


def test_a_plain_notice_pickles_as_rpcdist_pickles_it_and_loads_restricted() -> None:
    """``Caller.notify(plain=True)`` pickles rpcdist's own notices (an RRef's deletion or
    registration, a context's release) with the standard pickler: the bytes must be the ones
    rpcdist's pickler writes, and a restricted receiver must accept them."""
    from rpcdist.autograd.api import _release
    from rpcdist.rpc.rref import _child_accepted, _register, _user_deleted

    notices = [
        (_user_deleted, ((3, 1, 17), 1, 2), {}),
        (_register, ((0, 2, 5), 1, 2, 9), {}),
        (_child_accepted, (12,), {}),
        (_release, (40, (0, 1, 2)), {}),
    ]
    for notice in notices:
        plain = pickle.dumps(notice, protocol=5)
        ours, buffers = serialization.dumps(notice)
        assert plain == ours and buffers == [], notice[0].__name__
        assert serialization.loads(plain, restricted=True) == notice
