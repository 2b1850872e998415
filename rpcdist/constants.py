"""Default timeouts, as ``torch.distributed.constants`` (``dist.constants`` after
``import rpcdist as dist``).

- ``default_pg_timeout``: the process-group timeout when ``init_process_group``/``new_group``
  get none (30 minutes, torch's value for its non-NCCL backends and rpcdist's).
- ``default_pg_nccl_timeout``: torch's default for NCCL groups; ``None`` when this torch has no
  NCCL (rpcdist itself never runs NCCL; the name is here so torch code reading it works).
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["default_pg_timeout", "default_pg_nccl_timeout"]

default_pg_timeout: timedelta = timedelta(minutes=30)


def _torch_nccl_timeout() -> timedelta | None:
    try:
        from torch.distributed import constants as torch_constants
    except ImportError:  # torch built without distributed support
        return None
    return getattr(torch_constants, "default_pg_nccl_timeout", None)


default_pg_nccl_timeout: timedelta | None = _torch_nccl_timeout()
