"""How the callee decides where a function runs (``rpcdist.agent.markers``)."""

from __future__ import annotations

import functools

import torch.distributed.rpc as torch_rpc

from rpcdist.agent import markers
from rpcdist.rpc import functions as rpc_functions


def plain(x: int) -> int:
    return x


async def coroutine(x: int) -> int:
    return x


@torch_rpc.functions.async_execution
async def torch_async(x: int) -> int:
    return x


@rpc_functions.async_execution
def rpcdist_async(x: int) -> int:
    return x


class Holder:
    def method(self) -> None: ...

    async def async_method(self) -> None: ...


def test_coroutine_functions_are_told_apart_every_time_they_are_asked() -> None:
    for _ in range(3):  # (the second and third answers come from the per-function cache)
        assert markers.runs_as_coroutine(coroutine) is True
        assert markers.runs_as_coroutine(plain) is False
        assert markers.runs_as_coroutine(torch_async) is True  # torch's wrapper of an async def
        assert markers.runs_as_coroutine(rpcdist_async) is False  # returns a Future: a thread runs it
        assert markers.runs_as_coroutine(Holder().async_method) is True
        assert markers.runs_as_coroutine(Holder().method) is False
        assert markers.runs_as_coroutine(functools.partial(coroutine, 1)) is True
        assert markers.runs_on_thread(plain) and markers.runs_on_thread(rpcdist_async)
        assert not markers.runs_on_thread(coroutine)


def test_the_cache_stays_bounded_and_answers_after_it_is_cleared() -> None:
    made = []
    for i in range(markers._COROUTINE_FUNCTIONS_MAX + 10):
        namespace: dict[str, object] = {}
        exec(f"async def f{i}():\n    return {i}\n", namespace)  # noqa: S102 - fresh functions
        made.append(namespace[f"f{i}"])
        assert markers.runs_as_coroutine(made[-1]) is True
    assert len(markers._COROUTINE_FUNCTIONS) <= markers._COROUTINE_FUNCTIONS_MAX
    assert markers.runs_as_coroutine(made[0]) is True and markers.runs_as_coroutine(plain) is False
