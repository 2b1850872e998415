"""``rpcdist.autograd``: distributed autograd, as ``torch.distributed.autograd``."""

from rpcdist.autograd.api import backward, backward_async, context, get_gradients

__all__ = ["backward", "backward_async", "context", "get_gradients"]
