"""The torch test classes this harness runs: one line each, ``"<module>:<class>"``.

Each is one of the generic suites torch runs against every agent (``GENERIC_TESTS`` in
``torch/testing/_internal/distributed/rpc_utils.py``), from torch's wheel. Adding a suite is
adding its line (and, if some of its tests need torch internals, their entries in
``skips.py``); ``test_torch_suites.py`` makes the test classes from this list.

Not here: the agent-specific classes of ``rpc_test.py`` (``TensorPipeAgentRpcTest``,
``TensorPipeAgentCudaRpcTest``, ``CudaRpcTest``, ``FaultyAgentRpcTest``) and torch's CUDA and
faulty-agent autograd classes (``CudaDistAutogradTest``, ``FaultyAgentDistAutogradTest``,
``TensorPipeCudaDistAutogradTest``): they test TensorPipe, CUDA or TensorPipe's faulty agent.
"""

from __future__ import annotations

import importlib

SUITES: list[str] = [
    "torch.testing._internal.distributed.nn.api.remote_module_test:RemoteModuleTest",
    "torch.testing._internal.distributed.nn.api.remote_module_test:ThreeWorkersRemoteModuleTest",
    "torch.testing._internal.distributed.rpc.dist_optimizer_test:DistOptimizerTest",
    "torch.testing._internal.distributed.rpc.examples.parameter_server_test:ParameterServerTest",
    "torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test:ReinforcementLearningRpcTest",
    "torch.testing._internal.distributed.rpc.dist_autograd_test:DistAutogradTest",
    "torch.testing._internal.distributed.rpc.dist_autograd_test:TensorPipeAgentDistAutogradTest",
    "torch.testing._internal.distributed.rpc.rpc_test:RpcTest",
]


def load() -> list[type]:
    """The suite classes of :data:`SUITES` (importing their modules)."""
    classes = []
    for entry in SUITES:
        module_name, _, class_name = entry.partition(":")
        classes.append(getattr(importlib.import_module(module_name), class_name))
    return classes
