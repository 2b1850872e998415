"""``rpcdist.optim``: optimizers for models whose parameters live on several workers."""

from rpcdist.optim.distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
