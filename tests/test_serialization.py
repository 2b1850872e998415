"""Tensors through ``rpcdist.serialization`` (in process): every kind comes back equal, with
its dtype, shape, requires_grad and class, and only its own elements travel."""

from __future__ import annotations

import pickle
import pickletools

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
