"""Scenarios of the distributed autograd tests (``test_dist_autograd.py``), run by the
multi-process harness.

``_harness`` looks scenarios up on ``rpc_scenarios``; importing this module registers the ones
below there too (``test_dist_autograd`` makes every worker import it before its scenario).

Every check compares with the same model computed in one process: the models are built from
fixed seeds (``autograd_functions.build``), so the worker that checks rebuilds every remote
stage locally as its reference. Everything is float64.

- ``ag_main`` (3 workers). Rank 0 drives: split model, 3-stage chain, RRefs, reuse,
  ``retain_graph``, errors, ``DistributedOptimizer``. Then a parameter server: w0 holds the
  parameters, w1 and w2 train on them concurrently, each in its own contexts. Last, rank 0
  checks that contexts are released everywhere (1,000 iterations).
- ``ag_asyncio`` (2 workers, ``init_rpc_async``): ``backward_async`` and ``step_async``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import autograd_functions as af
import rpc_functions as rf
import rpc_scenarios
import torch
from _harness import check
from rpc_scenarios import finish, finish_async, full_text, init, options

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist import metrics
from rpcdist.autograd import _contexts
from rpcdist.optim import DistributedOptimizer

RTOL = 1e-7
ATOL = 1e-9
CALL_TIMEOUT = 60.0
WORKERS = ("w0", "w1", "w2")
LEAK_ITERATIONS = 1000
PS_ITERATIONS = 3
PS_LR = 0.1
PS_SEED = 300
TRAINERS = (1, 2)
BACKWARD_CALL = "rpcdist.autograd.backward"  # the function name of a backward pass's calls


# ============================================================================ helpers
def loss_fn(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
    return (out.pow(2) * weights).sum() + out.sum()


def reference_grads(loss: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(tensors)))


def assert_close(expected: torch.Tensor | None, actual: torch.Tensor | None, what: str) -> None:
    assert expected is not None, f"{what}: no reference"
    assert actual is not None, f"{what}: no gradient (expected {expected})"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {diff:.3g}\nexpected {expected}\ngot {actual}")


def assert_all_close(
    expected: Sequence[torch.Tensor | None], actual: Sequence[torch.Tensor | None], what: str
) -> None:
    assert len(expected) == len(actual), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert_close(e, a, f"{what}[{i}]")


def local_grads(context_id: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    found = dist_autograd.get_gradients(context_id)
    return [found.get(t) for t in tensors]


def remote_grads(worker: str, name: str, context_id: int) -> list[torch.Tensor | None]:
    """``name``'s gradients in ``context_id`` on ``worker``; its ``.grad`` must be untouched."""
    got = rpc.rpc_sync(worker, af.grads, (name, context_id), timeout=CALL_TIMEOUT)
    assert got["dot_grad_none"], f"{worker}: .grad of {name} was set by the distributed backward"
    return got["grads"]


def create(worker: str, name: str, in_features: int, out_features: int, seed: int) -> torch.nn.Module:
    """Create model ``name`` on ``worker``; returns an identical local copy (the reference)."""
    rpc.rpc_sync(worker, af.create_model, (name, in_features, out_features, seed), timeout=CALL_TIMEOUT)
    return af.build(in_features, out_features, seed)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters())


def context_counts() -> dict[str, int]:
    return {w: rpc.rpc_sync(w, af.context_count, timeout=CALL_TIMEOUT) for w in WORKERS}


def vars_of(stats: Any) -> dict[str, Any] | None:
    """A metrics record's counts, for an assertion's message."""
    return None if stats is None else {k: getattr(stats, k) for k in stats.__slots__ if k != "seconds"}


def wait_counts(expected: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
    """Poll every worker's number of contexts until it is ``expected``."""
    deadline = time.monotonic() + timeout
    seen = context_counts()
    while seen != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"contexts per worker: wanted {expected} within {timeout} s, saw {seen}")
        time.sleep(0.05)
        seen = context_counts()
    return seen


def barrier(tag: str, n: int = 2) -> None:
    """Trainers (and the parameter server) meet on w0."""
    rpc.rpc_sync("w0", af.barrier, (tag, n), timeout=0)


# ============================================================================ ag_main
def ag_main(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> None:
    init(rank, world_size, init_method)
    if rank == 0:
        _split()
        _chain()
        _rrefs()
        _reuse()
        _retain_graph()
        _stealing()
        _errors()
        _optimizers()
        _owner_side_stress()
        af.create_model("ps", 6, 3, PS_SEED)
        barrier("ps/go", 3)  # the trainers start
        rf.wait_arrivals("ps_done", len(TRAINERS), 150.0)
        _cleanup()
    else:
        barrier("ps/go", 3)
        _trainer(rank)
        _optimizer_stress(rank)
        rpc.rpc_sync("w0", rf.arrive, ("ps_done",), timeout=CALL_TIMEOUT)
    finish(rank, world_size)


# ---------------------------------------------------------------------------- 1. split model
def _split() -> None:
    with check("split/gradients"):
        ref2 = create("w1", "split/s2", 5, 3, 12)
        s1, ref1 = af.build(4, 5, 11), af.build(4, 5, 11)
        x = af.data(6, 4, 1, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        ref_loss = loss_fn(ref2(ref1(xr)))
        expected = reference_grads(ref_loss, [xr, *params(ref1), *params(ref2)])
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.forward, ("split/s2", s1(x)), timeout=CALL_TIMEOUT)
            loss = loss_fn(out)
            assert_close(ref_loss.detach(), loss.detach(), "loss")
            dist_autograd.backward(cid, [loss])
            here = dist_autograd.get_gradients(cid)
            there = remote_grads("w1", "split/s2", cid)
        assert_all_close(expected[:3], [here.get(t) for t in (x, *params(s1))], "w0 (input, stage 1)")
        assert_all_close(expected[3:], there, "w1 (stage 2)")
        # Only this worker's own leaves: the tensor received from w1 passed its gradient back.
        assert len(here) == 3, f"w0 holds gradients of {len(here)} tensors, expected 3"
        assert x.grad is None and all(p.grad is None for p in s1.parameters()), ".grad was set on w0"

    with check("split/backward_async_from_sync_program"):
        s1 = af.build(4, 5, 11)
        x = af.data(6, 4, 2)
        ref1 = af.build(4, 5, 11)
        expected = reference_grads(loss_fn(ref2(ref1(x))), [*params(ref1), *params(ref2)])
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.forward, ("split/s2", s1(x)), timeout=CALL_TIMEOUT)
            asyncio.run(dist_autograd.backward_async(cid, [loss_fn(out)]))
            assert_all_close(expected[:2], local_grads(cid, params(s1)), "w0")
            assert_all_close(expected[2:], remote_grads("w1", "split/s2", cid), "w1")

    with check("split/gradients_handed_back_not_called_back"):
        # w1's pass passes its gradients on to w0 only, the worker that called it: it hands
        # them back in its answer (one call per backward, blocking or async), and w0 serves no
        # backward call from w1. Counted by w0's metrics, on for this check only.
        metrics.enable(0, "127.0.0.1")
        try:
            calls, served = metrics.current.calls, metrics.current.served
            for backward in ("blocking", "async") * 3:
                with dist_autograd.context() as cid:
                    out = rpc.rpc_sync("w1", af.forward, ("split/s2", s1(x)), timeout=CALL_TIMEOUT)
                    if backward == "blocking":
                        dist_autograd.backward(cid, [loss_fn(out)])
                    else:
                        asyncio.run(dist_autograd.backward_async(cid, [loss_fn(out)]))
                    assert_all_close(expected[:2], local_grads(cid, params(s1)), f"w0 ({backward})")
                    assert_all_close(expected[2:], remote_grads("w1", "split/s2", cid), f"w1 ({backward})")
            made = calls.get((BACKWARD_CALL, "w1"))
            assert made is not None and made.started == 6 and made.finished == 6, vars_of(made)
            assert (BACKWARD_CALL, "w1") not in served, f"w0 served {vars_of(served[(BACKWARD_CALL, 'w1')])}"
        finally:
            metrics.release()


# ---------------------------------------------------------------------------- 2. 3-stage chain
def _chain_models(prefix: str) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """w0: a (4->5); w1: b (5->5) and head (5->3); w2: c (5->3). Returns w0's stage ``a`` and
    local copies of all four (the reference)."""
    b = create("w1", f"{prefix}/b", 5, 5, 32)
    head = create("w1", f"{prefix}/head", 5, 3, 33)
    c = create("w2", f"{prefix}/c", 5, 3, 34)
    return af.build(4, 5, 31), [af.build(4, 5, 31), b, head, c]


def _chain_forward(prefix: str, a: torch.nn.Module, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
    return rpc.rpc_sync(
        "w1",
        af.chain_mid,
        (a(x), f"{prefix}/b", f"{prefix}/head", "w2", f"{prefix}/c", fail),
        timeout=CALL_TIMEOUT,
    )


def _chain_reference(models: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    a, b, head, c = models
    hb = b(a(x))
    return c(hb) + head(hb)


def _chain() -> None:
    with check("chain/gradients"):
        a, refs = _chain_models("chain")
        x = af.data(7, 4, 3)
        ref_loss = loss_fn(_chain_reference(refs, x))
        expected = reference_grads(ref_loss, [p for m in refs for p in m.parameters()])
        with dist_autograd.context() as cid:
            loss = loss_fn(_chain_forward("chain", a, x))
            assert_close(ref_loss.detach(), loss.detach(), "loss")
            dist_autograd.backward(cid, [loss])
            got = [
                *local_grads(cid, params(a)),
                *remote_grads("w1", "chain/b", cid),
                *remote_grads("w1", "chain/head", cid),
                *remote_grads("w2", "chain/c", cid),
            ]
        assert_all_close(expected, got, "w0 a, w1 b, w1 head, w2 c")

    with check("chain/micro_batches_one_backward_call_per_worker"):
        # A pipeline's shape: 4 micro-batches go through w1 (and on to w2) concurrently; the
        # loss depends on all 4 answers. w0's pass sends the 4 gradients to w1 in one call
        # (one local pass there over all 4, which calls w2 once and hands w0's part back), so
        # w0 makes one backward call per backward, whatever the number of micro-batches.
        a, refs = _chain_models("micro")
        x = af.data(8, 4, 5)
        ref_loss = loss_fn(_chain_reference(refs, x))
        expected = reference_grads(ref_loss, [p for m in refs for p in m.parameters()])
        metrics.enable(0, "127.0.0.1")
        try:
            calls = metrics.current.calls
            for _ in range(3):
                with dist_autograd.context() as cid:
                    futures = [
                        rpc.rpc_async(
                            "w1",
                            af.chain_mid,
                            (a(mb), "micro/b", "micro/head", "w2", "micro/c"),
                            timeout=CALL_TIMEOUT,
                        )
                        for mb in x.split(2)
                    ]
                    loss = loss_fn(torch.cat([f.wait() for f in futures]))
                    dist_autograd.backward(cid, [loss])
                    got = [
                        *local_grads(cid, params(a)),
                        *remote_grads("w1", "micro/b", cid),
                        *remote_grads("w1", "micro/head", cid),
                        *remote_grads("w2", "micro/c", cid),
                    ]
                assert_all_close(expected, got, "w0 a, w1 b, w1 head, w2 c (4 micro-batches)")
            made = calls.get((BACKWARD_CALL, "w1"))
            assert made is not None and made.started == 3 and made.finished == 3, vars_of(made)
        finally:
            metrics.release()


# ---------------------------------------------------------------------------- 4. RRefs
def _rrefs() -> None:
    s1, ref1 = af.build(4, 5, 41), af.build(4, 5, 41)
    ref_stage = af.build(5, 3, 42)
    x = af.data(6, 4, 4)
    expected = reference_grads(loss_fn(ref_stage(ref1(x))), [*params(ref1), *params(ref_stage)])
    stage = rpc.remote("w1", af.Stage, (5, 3, 42), timeout=CALL_TIMEOUT)

    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "proxy_rpc_sync": lambda h: stage.rpc_sync(timeout=CALL_TIMEOUT).forward(h),
        "proxy_rpc_async": lambda h: stage.rpc_async(timeout=CALL_TIMEOUT).forward(h).wait(),
        "proxy_remote": lambda h: stage.remote(timeout=CALL_TIMEOUT).forward(h).to_here(CALL_TIMEOUT),
    }
    for way, call in ways.items():
        with check(f"rref/{way}"):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [loss_fn(call(s1(x)))])
                there = stage.rpc_sync(timeout=CALL_TIMEOUT).grads(cid)
                assert_all_close(expected[:2], local_grads(cid, params(s1)), "w0")
                assert_all_close(expected[2:], there, "w1 (module behind the RRef)")

    with check("rref/remote_then_to_here"):
        rpc.rpc_sync("w2", af.create_model, ("rref/c", 5, 3, 42), timeout=CALL_TIMEOUT)
        with dist_autograd.context() as cid:
            result = rpc.remote("w2", af.forward, ("rref/c", s1(x)), timeout=CALL_TIMEOUT)
            out = result.to_here(CALL_TIMEOUT)
            dist_autograd.backward(cid, [loss_fn(out)])
            assert_all_close(expected[:2], local_grads(cid, params(s1)), "w0")
            assert_all_close(expected[2:], remote_grads("w2", "rref/c", cid), "w2 (remote() owner)")


# ---------------------------------------------------------------------------- 5. reuse
def _reuse() -> None:
    s1, ref1 = af.build(4, 5, 51), af.build(4, 5, 51)
    x = af.data(6, 4, 5)
    ref2 = create("w1", "reuse/s2", 5, 3, 52)
    all_ref = [*params(ref1), *params(ref2)]

    def run(name: str, forward: Callable[[], torch.Tensor]) -> list[torch.Tensor | None]:
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [forward()])
            return [*local_grads(cid, params(s1)), *remote_grads("w1", name, cid)]

    with check("reuse/sent_twice"):
        h_ref = ref1(x)
        expected = reference_grads(loss_fn(ref2(h_ref)) + loss_fn(ref2(h_ref) * 2), all_ref)

        def sent_twice() -> torch.Tensor:
            h = s1(x)  # one tensor, in two calls
            first = rpc.rpc_sync("w1", af.forward, ("reuse/s2", h), timeout=CALL_TIMEOUT)
            second = rpc.rpc_sync("w1", af.forward, ("reuse/s2", h), timeout=CALL_TIMEOUT)
            return loss_fn(first) + loss_fn(second * 2)

        assert_all_close(expected, run("reuse/s2", sent_twice), "w0 s1, w1 s2")

    with check("reuse/same_tensor_twice_in_one_call"):
        h_ref = ref1(x)
        expected = reference_grads(loss_fn(af.add_products(h_ref, h_ref)), params(ref1))
        with dist_autograd.context() as cid:
            h = s1(x)
            out = rpc.rpc_sync("w1", af.add_products, (h, h), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [loss_fn(out)])
            assert_all_close(expected, local_grads(cid, params(s1)), "w0 s1")

    with check("reuse/parameter_sent_itself"):
        bias, ref_bias = s1[0].bias, ref1[0].bias  # a leaf, sent as such, also used locally
        expected = reference_grads(
            loss_fn(af.add_products(ref_bias, ref_bias).unsqueeze(0)) + loss_fn(ref1(x)), params(ref1)
        )
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.add_products, (bias, bias), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [loss_fn(out.unsqueeze(0)) + loss_fn(s1(x))])
            assert_all_close(expected, local_grads(cid, params(s1)), "w0 s1")
        assert bias.grad is None, ".grad of the sent parameter was set"

    with check("reuse/used_locally_and_sent"):
        h_ref = ref1(x)
        expected = reference_grads(loss_fn(ref2(h_ref)) + loss_fn(h_ref), all_ref)

        def local_and_sent() -> torch.Tensor:
            h = s1(x)
            return loss_fn(rpc.rpc_sync("w1", af.forward, ("reuse/s2", h), timeout=CALL_TIMEOUT)) + loss_fn(h)

        assert_all_close(expected, run("reuse/s2", local_and_sent), "w0 s1, w1 s2")

    with check("reuse/remote_parameters_used_twice"):
        h_ref = ref1(x)
        expected = reference_grads(loss_fn(ref2(h_ref) * ref2(h_ref.flip(0))), all_ref)

        def twice_there() -> torch.Tensor:
            return loss_fn(rpc.rpc_sync("w1", af.forward_twice, ("reuse/s2", s1(x)), timeout=CALL_TIMEOUT))

        assert_all_close(expected, run("reuse/s2", twice_there), "w0 s1, w1 s2")


# ---------------------------------------------------------------------------- 6. retain_graph
def _retain_graph() -> None:
    with check("retain_graph/twice_accumulates"):
        s1, ref1 = af.build(4, 5, 61), af.build(4, 5, 61)
        ref2 = create("w1", "retain/s2", 5, 3, 62)
        x = af.data(6, 4, 6)
        expected = reference_grads(loss_fn(ref2(ref1(x))), [*params(ref1), *params(ref2)])
        with dist_autograd.context() as cid:
            loss = loss_fn(rpc.rpc_sync("w1", af.forward, ("retain/s2", s1(x)), timeout=CALL_TIMEOUT))
            dist_autograd.backward(cid, [loss], retain_graph=True)
            once = [*local_grads(cid, params(s1)), *remote_grads("w1", "retain/s2", cid)]
            once = [None if g is None else g.clone() for g in once]
            dist_autograd.backward(cid, [loss], retain_graph=True)
            twice = [*local_grads(cid, params(s1)), *remote_grads("w1", "retain/s2", cid)]
        assert_all_close(expected, once, "after one backward")
        assert_all_close([2 * g for g in expected], twice, "after two backwards")


# ---------------------------------------------------------------------------- 7. no gradient copy
def _stealing() -> None:
    """torch's gradient stealing on the worker that calls backward: a leaf's first gradient in a
    context is the very buffer the pass computed when nothing else holds it, a copy otherwise;
    the values are right either way, and accumulating never writes into someone else's buffer."""
    with check("steal/own_buffer_kept"):
        w = af.data(3, 4, 71, requires_grad=True)
        remote_part = af.data(3, 4, 72, requires_grad=True)
        af.PassThrough.buffers.clear()
        with dist_autograd.context() as cid:
            # w's gradient is computed locally (and its buffer nobody else's); remote_part's
            # comes through w1 and back
            y = rpc.rpc_sync("w1", torch.mul, (remote_part, 3.0), timeout=CALL_TIMEOUT)
            loss = (af.PassThrough.apply(w) * 2.0 + y).sum()
            dist_autograd.backward(cid, [loss], retain_graph=True)
            grads = dist_autograd.get_gradients(cid)
            kept = grads[w].data_ptr()
            assert kept == af.PassThrough.buffers[-1], "w's gradient was copied"
            assert_close(torch.full_like(w, 2.0), grads[w], "w")
            assert_close(torch.full_like(remote_part, 3.0), grads[remote_part], "remote_part")
            assert w.grad is None and remote_part.grad is None, ".grad was touched"
            dist_autograd.backward(cid, [loss], retain_graph=True)  # accumulates in place
            grads = dist_autograd.get_gradients(cid)
            assert grads[w].data_ptr() == kept, "the kept gradient was replaced, not accumulated"
            assert_close(torch.full_like(w, 4.0), grads[w], "w after two backwards")
            assert_close(torch.full_like(remote_part, 6.0), grads[remote_part], "remote_part after two")

    with check("steal/pass_through_buffer_kept"):
        a = af.data(5, 6, 73, requires_grad=True)
        af.PassThrough.buffers.clear()
        with dist_autograd.context() as cid:
            loss = af.PassThrough.apply(a)[1][0]  # backward: a fresh one-hot gradient buffer
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[a]
            assert grad.data_ptr() == af.PassThrough.buffers[-1], "the gradient was copied"
            expected = torch.zeros_like(a)
            expected[1][0] = 1.0
            assert_close(expected, grad, "a")

    with check("steal/shared_buffer_copied"):
        a, b = af.data(5, 6, 74, requires_grad=True), af.data(5, 6, 75, requires_grad=True)
        af.SameGradTwice.buffers.clear()
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [af.SameGradTwice.apply(a, b)[1][0]])
            grads = dist_autograd.get_gradients(cid)
            shared = af.SameGradTwice.buffers[-1]
            assert grads[a].data_ptr() != grads[b].data_ptr(), "two leaves share one gradient buffer"
            kept = (grads[a].data_ptr(), grads[b].data_ptr())
            assert shared not in kept, "a buffer given to two leaves was kept for one of them"
            expected = torch.zeros_like(a)
            expected[1][0] = 1.0
            assert_close(expected, grads[a], "a")
            assert_close(expected, grads[b], "b")

    with check("steal/non_contiguous_copied"):
        a = af.data(5, 6, 76, requires_grad=True)
        af.PassThrough.buffers.clear()
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [af.PassThrough.apply(a).sum()])  # an expanded gradient
            grad = dist_autograd.get_gradients(cid)[a]
            assert grad.is_contiguous(), "an expanded (non-contiguous) gradient was kept as is"
            assert grad.data_ptr() != af.PassThrough.buffers[-1], "an expanded gradient was kept"
            assert_close(torch.ones_like(a), grad, "a")


# ---------------------------------------------------------------------------- 8. errors
def _expect_backward_error(forward: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """Backward from ``forward()`` must raise, with the remote error's text."""
    start = time.monotonic()
    with dist_autograd.context() as cid:
        loss = forward()
        try:
            dist_autograd.backward(cid, [loss])
        except Exception as exc:  # noqa: BLE001 - the type is reported, the text asserted
            text = full_text(exc)
            assert af.FAILING_BACKWARD_TEXT in text, f"{type(exc).__name__} lacks the remote text: {text}"
            return {
                "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "remote_worker": getattr(exc, "remote_worker", None),
                "seconds": round(time.monotonic() - start, 3),
            }
    raise AssertionError("backward did not raise")


def _errors() -> None:
    s1 = af.build(4, 5, 81)
    x = af.data(6, 4, 8)
    rpc.rpc_sync("w1", af.create_model, ("err/s2", 5, 3, 82), timeout=CALL_TIMEOUT)

    with check("error/remote_backward") as c:
        c.value = _expect_backward_error(
            lambda: loss_fn(rpc.rpc_sync("w1", af.failing_stage, ("err/s2", s1(x)), timeout=CALL_TIMEOUT))
        )

    with check("error/nested_remote_backward") as c:
        a, _ = _chain_models("err/chain")
        c.value = _expect_backward_error(lambda: loss_fn(_chain_forward("err/chain", a, x, fail=True)))

    with check("error/later_backward_works"):
        ref1, ref2 = af.build(4, 5, 81), af.build(5, 3, 82)
        expected = reference_grads(loss_fn(ref2(ref1(x))), [*params(ref1), *params(ref2)])
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.forward, ("err/s2", s1(x)), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [loss_fn(out)])
            got = [*local_grads(cid, params(s1)), *remote_grads("w1", "err/s2", cid)]
        assert_all_close(expected, got, "w0 s1, w1 s2")


# ---------------------------------------------------------------------------- 9. optimizers
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
}
OPTIM_STEPS = 4


def _optimizers() -> None:
    for kind, (optimizer_class, hyper) in OPTIMIZERS.items():
        with check(f"optim/{kind}"):
            prefix = f"optim/{kind}"
            a, refs = _chain_models(prefix)
            remote_names = [("w1", f"{prefix}/b"), ("w1", f"{prefix}/head"), ("w2", f"{prefix}/c")]
            rrefs = [rpc.RRef(p) for p in a.parameters()]
            for worker, name in remote_names:
                rrefs += rpc.rpc_sync(worker, af.param_rrefs, (name,), timeout=CALL_TIMEOUT)
            opt = DistributedOptimizer(optimizer_class, rrefs, **hyper)
            ref_params = [p for m in refs for p in m.parameters()]
            ref_opt = optimizer_class(ref_params, **hyper)
            for step in range(OPTIM_STEPS):
                x = af.data(5, 4, 90 + step)
                ref_opt.zero_grad()
                loss_fn(_chain_reference(refs, x)).backward()
                ref_opt.step()
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [loss_fn(_chain_forward(prefix, a, x))])
                    opt.step(cid)
            got = params(a)
            for worker, name in remote_names:
                got += rpc.rpc_sync(worker, af.params, (name,), timeout=CALL_TIMEOUT)
                assert rpc.rpc_sync(worker, af.dot_grads_none, (name,), timeout=CALL_TIMEOUT), (
                    f"{worker}: .grad of {name} left set after step"
                )
            assert_all_close([p.detach() for p in ref_params], [p.detach() for p in got], "parameters")
            assert all(p.grad is None for p in a.parameters()), ".grad left set on w0 after step"


# ---------------------------------------------------------------------------- stress: owner-side RRefs
STRESS_ROUNDS = 200


def _owner_side_stress() -> None:
    """remote() to this worker, then at once local_value()/to_here() here, over and over."""
    with check("stress/remote_then_local_value_on_owner") as c:
        start = time.monotonic()
        for i in range(STRESS_ROUNDS):
            made = rpc.remote("w0", af.data, (2, 3, i))
            assert made.local_value().shape == (2, 3)
            fetched = rpc.remote("w0", af.data, (3, 2, i))
            assert fetched.to_here(timeout=CALL_TIMEOUT).shape == (3, 2)
        c.value = round(time.monotonic() - start, 2)


def _optimizer_stress(rank: int) -> None:
    """Both trainers at once: build a DistributedOptimizer over the parameter server's
    parameters and drop the parameter RRefs at once (so this trainer's forks may be released
    while the owner builds its local optimizer from them); and remote() on the owner followed
    at once by local_value() there. No stall, no error."""
    with check(f"stress/optimizers_from_trainers/{rank}") as c:
        start = time.monotonic()
        for i in range(STRESS_ROUNDS):
            rrefs = rpc.rpc_sync("w0", af.param_rrefs, ("ps",), timeout=CALL_TIMEOUT)
            opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.0)
            del rrefs
            for local_optimizer in opt.remote_optimizers:
                assert rpc.rpc_sync("w0", af.local_ready, (local_optimizer,), timeout=CALL_TIMEOUT)
            made = rpc.remote("w0", af.data, (2, 2, i))
            assert rpc.rpc_sync("w0", af.local_ready, (made,), timeout=CALL_TIMEOUT), i
        c.value = round(time.monotonic() - start, 2)


# ---------------------------------------------------------------------------- 3. parameter server
def _trainer(rank: int) -> None:  # noqa: C901 - one training run with its checks
    """Trainer ``rank`` of the parameter server on w0. Both trainers run their forwards and
    backwards at the same time (each in its own context); their steps go in a fixed order
    (w1, then w2), so the result is that of the sequential single-process reference."""
    local = af.build(4, 6, 400 + rank)
    refs = {t: af.build(4, 6, 400 + t) for t in TRAINERS}
    ref_ps = af.build(6, 3, PS_SEED)
    ps_rrefs = rpc.rpc_sync("w0", af.param_rrefs, ("ps",), timeout=CALL_TIMEOUT)
    opt = DistributedOptimizer(
        torch.optim.SGD, [rpc.RRef(p) for p in local.parameters()] + ps_rrefs, lr=PS_LR
    )
    problems: list[str] = []

    def reference_step(i: int) -> dict[int, list[torch.Tensor]]:
        grads = {}
        for t in TRAINERS:
            out = ref_ps(refs[t](af.data(5, 4, 1000 * t + i)))
            grads[t] = reference_grads(loss_fn(out), [*params(refs[t]), *params(ref_ps)])
        return grads

    def apply(grads: dict[int, list[torch.Tensor]]) -> None:
        with torch.no_grad():
            for t in TRAINERS:
                for p, g in zip([*params(refs[t]), *params(ref_ps)], grads[t], strict=True):
                    p -= PS_LR * g

    def compare(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor | None], what: str) -> None:
        try:
            assert_all_close(expected, got, what)
        except AssertionError as exc:
            problems.append(str(exc))

    def train(i: int, optimizer: DistributedOptimizer, ordered: bool) -> dict[int, list[torch.Tensor]]:
        expected = reference_step(i)
        barrier(f"ps/{i}/start")
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync(
                "w0", af.forward, ("ps", local(af.data(5, 4, 1000 * rank + i))), timeout=CALL_TIMEOUT
            )
            barrier(f"ps/{i}/forward")  # both contexts hold a graph on w0 now
            dist_autograd.backward(cid, [loss_fn(out)])
            got = local_grads(cid, params(local)) + remote_grads("w0", "ps", cid)
            compare(expected[rank], got, f"iteration {i}: gradients in w{rank}'s context (local, ps)")
            barrier(f"ps/{i}/backward")
            if ordered:
                for t in TRAINERS:
                    if t == rank:
                        optimizer.step(cid)
                    barrier(f"ps/{i}/step{t}")
            else:
                optimizer.step(cid)
                barrier(f"ps/{i}/step")
        return expected

    with check("ps/gradients_per_context") as c:
        for i in range(PS_ITERATIONS):
            apply(train(i, opt, ordered=True))
        c.value = problems[:]
        assert not problems, "\n".join(problems)

    with check("ps/parameters_after_steps"):
        ps_now = rpc.rpc_sync("w0", af.params, ("ps",), timeout=CALL_TIMEOUT)
        assert_all_close([p.detach() for p in params(ref_ps)], ps_now, "parameter server")
        assert_all_close([p.detach() for p in params(refs[rank])], params(local), f"w{rank}'s own stage")

    with check("ps/concurrent_steps_serialized"):
        # Both trainers step at once, through their own optimizers over the same parameters
        # (whose steps would overlap, were they not serialized). torch serializes concurrent
        # steps on each worker; neither update may be lost.
        slow = DistributedOptimizer(af.OverlappingSGD, ps_rrefs, lr=PS_LR)
        problems.clear()
        expected = train(PS_ITERATIONS, slow, ordered=False)
        barrier("ps/slow/end")
        before = [p.detach().clone() for p in params(ref_ps)]
        with torch.no_grad():
            for t in TRAINERS:
                for p, g in zip(params(ref_ps), expected[t][2:], strict=True):
                    p -= PS_LR * g
        ps_now = rpc.rpc_sync("w0", af.params, ("ps",), timeout=CALL_TIMEOUT)
        assert not problems, "\n".join(problems)
        for k1, k2 in itertools.product(range(3), repeat=2):  # diagnosis: which updates landed?
            moved = [
                b - PS_LR * (k1 * g1 + k2 * g2)
                for b, g1, g2 in zip(before, expected[1][2:], expected[2][2:], strict=True)
            ]
            if (k1, k2) != (1, 1) and all(
                torch.allclose(m, n, rtol=RTOL, atol=ATOL) for m, n in zip(moved, ps_now, strict=True)
            ):
                raise AssertionError(
                    f"the parameter server applied w1's update {k1} time(s) and w2's {k2} time(s) "
                    "(each should land exactly once)"
                )
        assert_all_close(
            [p.detach() for p in params(ref_ps)], ps_now, "parameter server after concurrent steps"
        )


# ---------------------------------------------------------------------------- 7. cleanup
def _cleanup() -> None:
    with check("cleanup/1000_iterations") as c:
        rpc.rpc_sync("w1", af.create_model, ("leak/b", 3, 3, 71), timeout=CALL_TIMEOUT)
        rpc.rpc_sync("w1", af.create_model, ("leak/head", 3, 2, 72), timeout=CALL_TIMEOUT)
        rpc.rpc_sync("w2", af.create_model, ("leak/c", 3, 2, 73), timeout=CALL_TIMEOUT)
        a = af.build(2, 3, 70)
        x = af.data(2, 2, 7)
        start = time.monotonic()
        for i in range(LEAK_ITERATIONS):
            kind = i % 10
            try:
                with dist_autograd.context() as cid:
                    if kind == 0:  # through w1 to w2 and back
                        out = rpc.rpc_sync(
                            "w1",
                            af.chain_mid,
                            (a(x), "leak/b", "leak/head", "w2", "leak/c"),
                            timeout=CALL_TIMEOUT,
                        )
                    else:
                        out = rpc.rpc_sync("w1", af.forward, ("leak/b", a(x)), timeout=CALL_TIMEOUT)
                    if kind == 1:
                        continue  # no backward
                    if kind == 2:
                        raise KeyError("leaves the context with an error")
                    dist_autograd.backward(cid, [out.sum()])
            except KeyError:
                pass
        c.value = {
            "ms_per_iteration": round(1000 * (time.monotonic() - start) / LEAK_ITERATIONS, 3),
            "counts": wait_counts(dict.fromkeys(WORKERS, 0)),
        }

    with check("cleanup/release_travels_ahead_of_the_next_call") as c:
        # A context's release is kept to go out with the next message to each worker it
        # reached: the very next call finds it released there; and when nothing follows, it
        # goes out on its own within the caller's next sweep (0.1 s).
        before = context_counts()
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.forward, ("leak/b", a(x)), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [out.sum()])
        first = rpc.rpc_sync("w1", af.context_count, timeout=CALL_TIMEOUT)
        assert first == before["w1"], f"w1 still held the context at the next call: {first}"
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync("w1", af.forward, ("leak/b", a(x)), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [out.sum()])
        asked_by_w2 = rpc.rpc_sync("w2", af.context_count_of, ("w1",), timeout=CALL_TIMEOUT)
        deadline = time.monotonic() + 3.0
        while asked_by_w2 != before["w1"] and time.monotonic() < deadline:
            time.sleep(0.05)
            asked_by_w2 = rpc.rpc_sync("w2", af.context_count_of, ("w1",), timeout=CALL_TIMEOUT)
        c.value = asked_by_w2
        assert asked_by_w2 == before["w1"], f"w1 holds {asked_by_w2} contexts, {before['w1']} before"

    with check("cleanup/releases_keep_pace_with_a_loop_that_never_leaves_a_context") as c:
        # A training loop whose every call is made inside a context: each release is encoded
        # after the next step's first call and rides ahead of the call after, where the peer
        # runs it once it has answered that call. So a peer never holds more than the current
        # context and the one before, and the last goes out with the sweep.
        before = context_counts()
        held = []
        for _ in range(60):
            with dist_autograd.context() as cid:
                out = rpc.rpc_sync("w1", af.forward, ("leak/b", a(x)), timeout=CALL_TIMEOUT)
                dist_autograd.backward(cid, [out.sum()])
                held.append(rpc.rpc_sync("w1", af.context_count, timeout=CALL_TIMEOUT) - before["w1"])
        c.value = {"most_held_on_w1": max(held), "counts": wait_counts(before, timeout=3.0)}
        assert max(held) <= 2, f"w1 held up to {max(held)} contexts of this loop: {held}"
        assert held[-1] >= 1, f"the call in a context ran outside it: {held}"

    with check("cleanup/rpc_without_grad_tensors_in_context") as c:
        before = context_counts()
        with dist_autograd.context():
            assert rpc.rpc_sync("w2", af.no_tensors, (1, 2), timeout=CALL_TIMEOUT) == 3
            total = rpc.rpc_sync("w1", torch.add, (torch.ones(2), 1), timeout=CALL_TIMEOUT)
            assert total.tolist() == [2.0, 2.0]
        c.value = wait_counts(before, timeout=3.0)


# ============================================================================ ag_asyncio
async def ag_asyncio(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> None:
    await rpc.init_rpc_async(
        f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options(init_method)
    )
    if rank == 0:
        await _asyncio_checks()
    await finish_async(rank, world_size)


async def _remote_grads_async(name: str, context_id: int) -> list[torch.Tensor | None]:
    got = await rpc.rpc_async("w1", af.grads, (name, context_id), timeout=CALL_TIMEOUT)
    assert got["dot_grad_none"], f".grad of {name} was set by the distributed backward"
    return got["grads"]


async def _asyncio_checks() -> None:
    await rpc.rpc_async("w1", af.create_model, ("aio/s2", 5, 3, 112), timeout=CALL_TIMEOUT)

    with check("asyncio/backward_async"):
        s1, ref1, ref2 = af.build(4, 5, 111), af.build(4, 5, 111), af.build(5, 3, 112)
        x = af.data(6, 4, 11)
        expected = reference_grads(loss_fn(ref2(ref1(x))), [*params(ref1), *params(ref2)])
        with dist_autograd.context() as cid:
            out = await rpc.rpc_async("w1", af.forward, ("aio/s2", s1(x)), timeout=CALL_TIMEOUT)
            await dist_autograd.backward_async(cid, [loss_fn(out)])
            assert_all_close(expected[:2], local_grads(cid, params(s1)), "w0")
            assert_all_close(expected[2:], await _remote_grads_async("aio/s2", cid), "w1")

    for kind, (optimizer_class, hyper) in OPTIMIZERS.items():
        with check(f"asyncio/step_async/{kind}"):
            name = f"aio/{kind}/s2"
            await rpc.rpc_async("w1", af.create_model, (name, 5, 3, 122), timeout=CALL_TIMEOUT)
            s1, ref1, ref2 = af.build(4, 5, 121), af.build(4, 5, 121), af.build(5, 3, 122)
            remote_rrefs = await rpc.rpc_async("w1", af.param_rrefs, (name,), timeout=CALL_TIMEOUT)
            opt = DistributedOptimizer(
                optimizer_class, [rpc.RRef(p) for p in s1.parameters()] + remote_rrefs, **hyper
            )
            ref_params = [*params(ref1), *params(ref2)]
            ref_opt = optimizer_class(ref_params, **hyper)
            for step in range(OPTIM_STEPS):
                x = af.data(5, 4, 130 + step)
                ref_opt.zero_grad()
                loss_fn(ref2(ref1(x))).backward()
                ref_opt.step()
                with dist_autograd.context() as cid:
                    out = await rpc.rpc_async("w1", af.forward, (name, s1(x)), timeout=CALL_TIMEOUT)
                    await dist_autograd.backward_async(cid, [loss_fn(out)])
                    await opt.step_async(cid)
            got = params(s1) + await rpc.rpc_async("w1", af.params, (name,), timeout=CALL_TIMEOUT)
            assert_all_close([p.detach() for p in ref_params], [p.detach() for p in got], "parameters")

    with check("asyncio/contexts_released") as c:
        deadline = time.monotonic() + 5.0
        while True:
            seen = {
                "w0": _contexts.count(),
                "w1": await rpc.rpc_async("w1", af.context_count, timeout=CALL_TIMEOUT),
            }
            if seen == {"w0": 0, "w1": 0}:
                break
            assert time.monotonic() < deadline, f"contexts left after 5 s: {seen}"
            await asyncio.sleep(0.05)
        c.value = seen


# ============================================================================ owner shutting down
OWNER_EXIT_ROUNDS = 50


def ag_owner_exits_first(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> None:
    """The shape of most parameter-server programs: the PS (w0) has nothing to drive and calls
    ``shutdown()`` at once, while two trainers fetch its parameter RRefs and build
    DistributedOptimizers over them, round after round. Its graceful shutdown must keep every
    value a trainer is about to register for (the forks of its own RRefs in flight)."""
    if rank == 0:
        af.create_model("ps", 4, 3, 0)  # before joining: the trainers call at once
    init(rank, world_size, init_method, rpc_timeout=CALL_TIMEOUT)
    if rank != 0:
        with check(f"owner_exits/optimizers/{rank}") as c:
            start = time.monotonic()
            for i in range(OWNER_EXIT_ROUNDS):
                rrefs = rpc.rpc_sync("w0", af.param_rrefs, ("ps",), timeout=CALL_TIMEOUT)
                opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.0)
                assert len(opt.remote_optimizers) == 1, i
            c.value = round(time.monotonic() - start, 2)
    rpc.shutdown()


# ============================================================================ registration
# ============================================================================ concurrent passes
CONCURRENT_THREADS = 8
CONCURRENT_POOL = 2  # each worker's num_worker_threads: far fewer than the passes in flight


def ag_concurrent(rank: int, world_size: int, init_method: str, workdir: str, **_: Any) -> None:
    """torch's test_async_dist_autograd with small pools: rank 0 runs many backward passes at
    once, each bouncing between w0 and w1 several times; no pool thread may wait for a nested
    pass (a pass coming back needs one), or the passes deadlock."""
    init(rank, world_size, init_method, num_worker_threads=CONCURRENT_POOL)
    if rank == 0:
        with check("concurrent/backward_passes_finish") as c:
            results: dict[int, Any] = {}
            threads = [
                threading.Thread(target=_concurrent_workload, args=(i, results), daemon=True)
                for i in range(CONCURRENT_THREADS)
            ]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 60.0
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            stuck = sum(thread.is_alive() for thread in threads)
            c.value = {"threads": CONCURRENT_THREADS, "stuck": stuck}
            assert not stuck, f"{stuck} of {CONCURRENT_THREADS} backward passes never finished (deadlock)"
            errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
            assert not errors, errors
            assert sorted(results) == list(range(CONCURRENT_THREADS)), sorted(results)
    finish(rank, world_size)


def _concurrent_workload(seed: int, results: dict[int, Any]) -> None:
    """One pass (torch's _workload_thread), checked against the same ops run locally."""
    try:
        gen = torch.Generator().manual_seed(seed)
        t1 = torch.rand((3, 3), generator=gen, dtype=af.DTYPE, requires_grad=True)
        t2 = torch.rand((3, 3), generator=gen, dtype=af.DTYPE, requires_grad=True)
        with dist_autograd.context() as cid:
            t3 = rpc.rpc_sync("w1", torch.add, (t1, t2), timeout=CALL_TIMEOUT)
            t4 = rpc.rpc_sync("w1", torch.mul, (t2, t3), timeout=CALL_TIMEOUT)
            t5 = rpc.rpc_sync("w1", torch.matmul, (t3, t4), timeout=CALL_TIMEOUT)
            t6 = rpc.rpc_sync("w1", torch.add, (t4, t5), timeout=CALL_TIMEOUT)
            dist_autograd.backward(cid, [t6.sum()])
            got = local_grads(cid, [t1, t2])
        r3 = t1 + t2
        r4 = t2 * r3
        expected = reference_grads((r4 + r3 @ r4).sum(), [t1, t2])
        assert_all_close(expected, got, f"pass {seed}")
        results[seed] = True
    except BaseException as exc:  # noqa: BLE001 - reported by the check
        results[seed] = exc


SCENARIOS = ("ag_main", "ag_asyncio", "ag_owner_exits_first", "ag_concurrent")


def _register() -> None:
    """Make the scenarios findable where ``_harness`` looks them up (``rpc_scenarios``)."""
    for name in SCENARIOS:
        setattr(rpc_scenarios, name, globals()[name])


_register()
