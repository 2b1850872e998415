"""A distributed backward pass keeps the gradients torch's engine made for it without a copy
(torch's gradient stealing), and copies every other: accumulating into a context never writes
into memory someone else sees (a tensor a backward function saved or returned from elsewhere,
a gradient given to the pass, another leaf's gradient)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from rpcdist.autograd import _contexts
from rpcdist.autograd.engine import _local_gradients

KEPT = torch.full((3,), 5.0)  # returned as a gradient by a backward function below
KEPT_WIDE = torch.full((3, 2), 5.0)
KEPT_NUMPY = np.full(3, 5.0, dtype=np.float32)


def _returning(make: Callable[[torch.Tensor, Any], torch.Tensor]) -> Any:
    class Returning(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(torch.full_like(x, 2.0))
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return make(grad, ctx)

    return Returning.apply


def _linear() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weight, bias = torch.randn(4, 3, requires_grad=True), torch.randn(4, requires_grad=True)
    return [torch.nn.functional.linear(torch.randn(2, 3), weight, bias)], [torch.ones(2, 4)]


def _mlp() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    return [net(torch.randn(4, 3))], [torch.ones(4, 2)]


def _product() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    return [a * b], [torch.ones(2, 3)]


def _sum() -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # both leaves get the very same tensor
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    return [a + b], [torch.ones(3)]


def _view() -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # the leaf's gradient: a view of the one given
    leaf = torch.randn(6, requires_grad=True)
    return [leaf.view(2, 3)], [torch.ones(2, 3)]


def _leaf_itself() -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # the gradient given, as it is
    return [torch.randn(6, requires_grad=True)], [torch.ones(6)]


def _concatenated() -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # views of one buffer
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    return [torch.cat([a, b])], [torch.ones(4, 3)]


def _through(make: Callable[[torch.Tensor, Any], torch.Tensor]) -> Any:
    def case() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [_returning(make)(torch.randn(3, requires_grad=True))], [torch.ones(3)]

    return case


@pytest.mark.parametrize(
    "case, owned",
    [
        (_linear, [True, True]),
        (_mlp, [True, True, True, True]),
        (_product, [True, True]),
        (_sum, [False, False]),
        (_view, [False]),
        (_leaf_itself, [False]),
        (_concatenated, [False, False]),
        (_through(lambda grad, ctx: ctx.saved_tensors[0]), [False]),
        (_through(lambda grad, ctx: KEPT), [False]),
        (_through(lambda grad, ctx: KEPT_WIDE[:, 0]), [False]),
        (_through(lambda grad, ctx: torch.from_numpy(KEPT_NUMPY)), [False]),
        (_through(lambda grad, ctx: grad * 3), [True]),
    ],
    ids=[
        "linear",
        "mlp",
        "product",
        "sum_same_tensor",
        "view_of_given",
        "leaf_itself",
        "views_of_one_buffer",
        "saved_tensor",
        "module_tensor",
        "view_of_module_tensor",
        "numpy_memory",
        "made_in_backward",
    ],
)
def test_a_pass_owns_only_the_gradients_made_for_it(case: Any, owned: list[bool]) -> None:
    outputs, given = case()
    assert [mine for _, _, mine in _local_gradients(outputs, given)] == owned


@pytest.mark.parametrize(
    "make",
    [
        lambda grad, ctx: KEPT,
        lambda grad, ctx: KEPT_WIDE[:, 0],
        lambda grad, ctx: torch.from_numpy(KEPT_NUMPY),
    ],
    ids=["module_tensor", "view_of_module_tensor", "numpy_memory"],
)
def test_accumulating_twice_never_writes_into_a_tensor_a_backward_function_returned(make: Any) -> None:
    leaf = torch.randn(3, requires_grad=True)
    out = _returning(make)(leaf)
    context = _contexts.DistAutogradContext(1 << 50)
    for _ in range(2):  # (a second backward pass through the kept graph adds to the first)
        for got, grad, mine in _local_gradients([out], [torch.ones(3)]):
            context.accumulate(got, grad, mine)
    assert KEPT.tolist() == [5.0] * 3 and KEPT_WIDE.flatten().tolist() == [5.0] * 6
    assert KEPT_NUMPY.tolist() == [5.0] * 3
    assert context.local_gradients()[leaf].tolist() == [10.0] * 3


def test_a_kept_gradient_accumulates_in_place_to_the_right_sum() -> None:
    (out,), (given,) = _linear()
    context = _contexts.DistAutogradContext(1 << 51)
    first = _local_gradients([out], [given])
    assert all(mine for _, _, mine in first)
    for got, grad, mine in first:
        context.accumulate(got, grad, mine)
    kept = {id(leaf): grad for leaf, grad, _ in first}
    for got, grad, mine in _local_gradients([out], [given * 2]):
        context.accumulate(got, grad, mine)
    for leaf, total in context.local_gradients().items():
        assert torch.allclose(total, kept[id(leaf)])  # the kept buffer itself, now 1x + 2x
        assert total.data_ptr() == kept[id(leaf)].data_ptr()
    weight = next(leaf for leaf in context.local_gradients() if leaf.dim() == 2)
    assert torch.allclose(context.local_gradients()[weight], 3 * (given.t() @ out.grad_fn._saved_mat1))
