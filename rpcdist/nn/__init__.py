"""``rpcdist.nn``: modules whose computation runs on other workers, as ``torch.distributed.nn``.

    from rpcdist.nn import RemoteModule
    linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
    out = linear(torch.randn(128, 20))          # forward runs on worker1

(torch's functional collectives, ``torch.distributed.nn.functional``, are not part of it.)
"""

from rpcdist.nn.api.remote_module import RemoteModule

__all__ = ["RemoteModule"]
