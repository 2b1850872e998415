"""The rpcdist agent fixture, as torch's ``TensorPipeRpcAgentTestFixture``.

torch's suites are written against the abstract ``RpcAgentTestFixture``; a concrete fixture
says which backend ``dist_utils.dist_init`` starts (``rpc_backend``, ``rpc_backend_options``)
and what the backend's errors look like (``get_shutdown_error_regex``,
``get_timeout_error_regex``). This one names rpcdist's, with the file:// rendezvous of
``self.init_method`` (the file ``MultiProcessTestCase`` makes for each test).
"""

from __future__ import annotations

from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

import rpcdist.rpc
from compat import substitution

RPCDIST_STORE_SUFFIX = ".rpcdist"  # rpcdist's FileStore file: <MultiProcessTestCase file>.rpcdist

# What rpcdist says when a call fails because its peer shut down or is gone
# (rpcdist.agent: WorkerDiedError, WorkerUnavailableError, RpcError of a closing agent).
_SHUTDOWN_ERRORS = (
    r"is gone: lost the connection",
    r"cannot reach",
    r"shut down",
    r"is shutting down",
    r"RPC agent is gone",
)


class RpcdistRpcAgentTestFixture(RpcAgentTestFixture):
    """torch's ``RpcAgentTestFixture``, made concrete with rpcdist's agent."""

    @property
    def rpc_backend(self) -> rpcdist.rpc.BackendType:
        """rpcdist's backend (``dist_init`` passes it to ``init_rpc``, which takes rpcdist's)."""
        if not substitution.installed():  # a worker that runs torch's suites against torch
            raise RuntimeError(
                "torch.distributed.rpc is torch's own in this process: the worker was not started "
                "by tests/compat/launcher.py (whose fork server installs the substitution)"
            )
        return rpcdist.rpc.BackendType.GRPC

    @property
    def init_method(self) -> str:
        """rpcdist's file:// rendezvous: a file next to ``self.file_name``, not that file itself.

        torch's fixtures rendezvous RPC on ``file_init_method`` and some tests start a gloo group
        (``dist.init_process_group``) on that same file, which works because both are torch's
        FileStore. rpcdist's FileStore has a file format of its own, so it gets its own file.
        """
        return f"file://{self.file_name}{RPCDIST_STORE_SUFFIX}"

    @property
    def rpc_backend_options(self) -> rpcdist.rpc.RpcBackendOptions:
        """rpcdist's options, rendezvous through ``self.init_method`` (file:// by default)."""
        return rpcdist.rpc.construct_rpc_backend_options(self.rpc_backend, init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        """Any of the errors of a call whose peer shut down or went away."""
        return "|".join(f"({error})" for error in _SHUTDOWN_ERRORS)

    def get_timeout_error_regex(self) -> str:
        """rpcdist's timeout messages: ``rpc_sync``/``rpc_async``/``to_here`` ("... timed out
        after 1 s ...") and ``remote`` ("... was cancelled after 1 s ...")."""
        return r"timed out after|was cancelled after"
