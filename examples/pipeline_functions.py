"""The classes pipeline_parallel.py places on its workers: the stages of a split model.

rpcdist sends classes by name (``pipeline_functions.Stage``), so every worker must be able to
import them: that is why they live here rather than in the script.

The model is an MLP for a synthetic regression, cut into consecutive :class:`Stage` modules,
each created on its own worker with ``rpc.remote``. The master, which holds only RRefs to the
stages, runs :class:`PipelineNet`: it feeds the micro-batches of a batch through the stages so
that, while one stage works on micro-batch ``i``, the stage before it already works on ``i + 1``.

:class:`RemoteModulePipeline` is the same model built from ``rpcdist.nn.RemoteModule`` stages
(``--remote-modules``), its micro-batches gathered with ``torch.futures.wait_all`` as in torch's
own RemoteModule tutorials.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import rpcdist.rpc as rpc
from rpcdist.futures import wait_all
from rpcdist.nn import RemoteModule

N_FEATURES = 16


def make_data(n: int, seed: int, noise: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression: ``y`` is a fixed random "teacher" network of ``x`` (16 features ->
    8 tanh units -> 1), plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w1 = torch.randn(N_FEATURES, 8, generator=g) / N_FEATURES**0.5
    w2 = 2.0 * torch.randn(8, 1, generator=g) / 8**0.5
    y = torch.tanh(x @ w1) @ w2
    return x, y + noise * torch.randn(n, 1, generator=g)


class Stage(nn.Module):
    """Consecutive layers of the model: ``Linear`` + ``Tanh`` blocks, the last one maybe without
    its ``Tanh`` (the output layer of the model).

    ``forward`` takes an RRef to its input (the master's micro-batch, or the output of the
    previous stage, left on that stage's worker) and fetches it with ``to_here()``.
    """

    def __init__(self, sizes: list[int], last: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            layers.append(nn.Linear(n_in, n_out))
            if not (last and i == len(sizes) - 2):
                layers.append(nn.Tanh())
        self.layers = nn.Sequential(*layers)
        self._lock = threading.Lock()

    def forward(self, x_rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
        x = x_rref.to_here()  # inside a distributed autograd context, this fetch is recorded
        with self._lock:  # one micro-batch at a time per stage, as on a device
            return self.layers(x)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to this stage's parameters (owned here), for the DistributedOptimizer."""
        return [rpc.RRef(p) for p in self.parameters()]


class TensorStage(Stage):
    """A :class:`Stage` that takes its input tensor itself (what a RemoteModule's ``forward``
    is given)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        with self._lock:
            return self.layers(x)


def _cut(sizes: list[int], n: int) -> list[tuple[list[int], bool]]:
    """Cut ``sizes`` (the widths from input to output) into ``n`` consecutive stages."""
    n_layers = len(sizes) - 1
    bounds = [round(k * n_layers / n) for k in range(n + 1)]
    return [(sizes[bounds[k] : bounds[k + 1] + 1], k == n - 1) for k in range(n)]


class RemoteModulePipeline(nn.Module):
    """On the master: the model as one ``RemoteModule`` per worker.

    Every micro-batch is started on the first stage at once; as each one comes back it goes on
    to the next stage, so the stages work on different micro-batches at the same time::

        futures = [first.forward_async(x) for x in xs.split(n)]
        for stage in rest:
            futures = [stage.forward_async(f.wait()) for f in futures]
        torch.cat(torch.futures.wait_all(futures))
    """

    def __init__(self, workers: list[str], sizes: list[int], split_size: int, seed: int) -> None:
        super().__init__()
        self.split_size = split_size
        self.stages = [
            RemoteModule(f"{worker}/cpu", TensorStage, args=(stage_sizes, last, seed + k))
            for k, (worker, (stage_sizes, last)) in enumerate(
                zip(workers, _cut(sizes, len(workers)), strict=True)
            )
        ]

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        futures = [self.stages[0].forward_async(x) for x in xs.split(self.split_size)]
        for stage in self.stages[1:]:
            futures = [stage.forward_async(fut.wait()) for fut in futures]
        return torch.cat(torch.futures.wait_all(futures))

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return [p for stage in self.stages for p in stage.remote_parameters()]

    def stage_names(self) -> list[str]:
        return [stage.get_module_rref().owner_name() for stage in self.stages]


class PipelineNet(nn.Module):
    """On the master: the model, as RRefs to its stages, one per worker."""

    def __init__(self, workers: list[str], sizes: list[int], split_size: int, seed: int) -> None:
        super().__init__()
        self.split_size = split_size
        self.stage_rrefs: list[rpc.RRef[Stage]] = [
            rpc.remote(worker, Stage, args=(stage_sizes, last, seed + k))
            for k, (worker, (stage_sizes, last)) in enumerate(
                zip(workers, _cut(sizes, len(workers)), strict=True)
            )
        ]

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        futures = []
        for x in xs.split(self.split_size):
            ref = rpc.RRef(x)
            for stage in self.stage_rrefs[:-1]:
                # Starts this stage on micro-batch x and returns at once: its output stays on
                # that worker; the next stage fetches it from there.
                ref = stage.remote().forward(ref)
            futures.append(self.stage_rrefs[-1].rpc_async().forward(ref))
        # Every micro-batch is in flight now; the stages work on different ones at once.
        return torch.cat(wait_all(futures))

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        rrefs: list[rpc.RRef[torch.Tensor]] = []
        for stage in self.stage_rrefs:
            rrefs.extend(stage.rpc_sync().parameter_rrefs())
        return rrefs

    def stage_names(self) -> list[str]:
        return [stage.owner_name() for stage in self.stage_rrefs]
