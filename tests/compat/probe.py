"""A suite written the way torch writes its suites, run by the harness like them, whose tests
check from inside the workers that torch's names are rpcdist's and that the calls torch's
tests make go through rpcdist's agent, never torch's.

Like torch's suite modules, this one is imported by the workers after the substitution (see
``worker.py``): its module-level ``import torch.distributed.rpc as rpc`` gets what torch's
suites get.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.testing._internal.dist_utils as dist_utils
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.testing._internal.distributed.nn.api import remote_module_test
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

import rpcdist.agent
import rpcdist.autograd
import rpcdist.nn
import rpcdist.optim
import rpcdist.rpc
from compat import substitution
from rpcdist.agent.core import Agent


def serving_agents() -> tuple[str, bool]:
    """Run by RPC: the name of the rpcdist agent serving this call, and whether torch's own RPC
    agent exists in this process."""
    return rpcdist.agent.current_agent().info.name, torch._C._distributed_rpc._is_current_rpc_agent_set()


@contextmanager
def counting_submits() -> Iterator[list[str]]:
    """Within: every call this process sends through rpcdist's agent (``Agent.submit``) is
    recorded in the yielded list, by function name."""
    submitted: list[str] = []
    real_submit = Agent.submit

    def submit(self: Agent, to: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        submitted.append(getattr(func, "__name__", repr(func)))
        return real_submit(self, to, func, *args, **kwargs)

    Agent.submit = submit  # type: ignore[method-assign]
    try:
        yield submitted
    finally:
        Agent.submit = real_submit  # type: ignore[method-assign]


class SubstitutionProbe(RpcAgentTestFixture):
    """Checks of the substitution, in the harness's workers."""

    @property
    def world_size(self) -> int:
        return 2

    def assert_torch_agent_never_started(self) -> None:
        """torch's own RPC agent does not exist in this process."""
        self.assertFalse(torch._C._distributed_rpc._is_current_rpc_agent_set())
        torch_rpc_api = substitution.original("torch.distributed.rpc.api")
        with self.assertRaisesRegex(RuntimeError, "Current RPC agent is not set"):
            torch_rpc_api._get_current_rpc_agent()

    @dist_utils.dist_init
    def test_torch_names_are_rpcdist(self) -> None:
        self.assertTrue(substitution.installed())
        # What torch's suites and dist_utils (which starts and stops RPC) hold.
        for module in (rpc, dist_utils.rpc, remote_module_test.rpc):
            for name in ("init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef", "WorkerInfo"):
                self.assertIs(getattr(module, name), getattr(rpcdist.rpc, name), name)
        self.assertIs(remote_module_test.RemoteModule, rpcdist.nn.RemoteModule)
        self.assertIs(remote_module_test._RemoteModule, rpcdist.nn.api.remote_module._RemoteModule)
        self.assertIs(RemoteModule, rpcdist.nn.RemoteModule)
        self.assertIs(DistributedOptimizer, rpcdist.optim.DistributedOptimizer)
        for name in ("context", "backward", "get_gradients"):
            self.assertIs(getattr(dist_autograd, name), getattr(rpcdist.autograd, name), name)
        # A torch name rpcdist does not have: no fallback to torch's.
        with self.assertRaises(substitution.NoCounterpartError):
            rpc._rref_context_get_debug_info()
        # rpcdist's agent is the one running, under the name dist_init gave it.
        self.assertEqual(rpcdist.agent.current_agent().info.name, f"worker{self.rank}")
        self.assertEqual(rpc.get_worker_info().name, f"worker{self.rank}")
        self.assert_torch_agent_never_started()

    @dist_utils.dist_init
    def test_calls_go_through_rpcdist_agent(self) -> None:
        if self.rank == 0:
            with counting_submits() as submitted:
                self.assertEqual(rpc.rpc_sync("worker1", serving_agents), ("worker1", False))
                self.assertEqual(rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1)).wait()[0], 2.0)
            self.assertEqual(submitted, ["serving_agents", "add"])

            before = rpcdist.rpc.debug_info()["user_rrefs"]
            rref = rpc.remote("worker1", torch.ones, args=(3,))
            self.assertEqual(rpcdist.rpc.debug_info()["user_rrefs"], before + 1)
            self.assertEqual(rref.to_here().sum().item(), 3.0)

            # RemoteModule, distributed autograd and DistributedOptimizer: each step sends calls.
            with counting_submits() as created:
                linear = RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))
            with counting_submits() as forwarded:
                before_step = linear(torch.ones(1, 2)).sum().item()
            with counting_submits() as optimizer_made:
                optimizer = DistributedOptimizer(torch.optim.SGD, linear.remote_parameters(), lr=0.1)
            with counting_submits() as trained, dist_autograd.context() as context_id:
                loss = linear(torch.ones(1, 2)).sum()
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            for stage, calls in [("create", created), ("forward", forwarded), ("optimizer", optimizer_made)]:
                self.assertTrue(calls, f"{stage}: no call went through rpcdist's agent")
            self.assertGreaterEqual(len(trained), 2, trained)  # forward, then backward and step
            self.assertNotAlmostEqual(linear(torch.ones(1, 2)).sum().item(), before_step)  # the step moved it
        self.assert_torch_agent_never_started()
