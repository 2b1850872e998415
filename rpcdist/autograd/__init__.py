"""``rpcdist.autograd``: distributed autograd, as ``torch.distributed.autograd``."""

from rpcdist.autograd.api import (
    DistAutogradContext,
    backward,
    backward_async,
    context,
    get_gradients,
    is_available,
)

__all__ = ["DistAutogradContext", "backward", "backward_async", "context", "get_gradients", "is_available"]
