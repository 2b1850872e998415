"""``rpcdist.rpc.constants``: the defaults torch users read from ``torch.distributed.rpc.constants``."""

from rpcdist.agent.options import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT

DEFAULT_RPC_TIMEOUT_SEC: float = DEFAULT_RPC_TIMEOUT  # default timeout of a call, seconds
UNSET_RPC_TIMEOUT: float = -1.0  # "use the default" (the timeout= of rpc_sync & co.)

__all__ = ["DEFAULT_INIT_METHOD", "DEFAULT_RPC_TIMEOUT_SEC", "UNSET_RPC_TIMEOUT"]
