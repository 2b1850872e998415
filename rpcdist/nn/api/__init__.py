"""``rpcdist.nn.api``: the module APIs of :mod:`rpcdist.nn` (``remote_module``), at the paths
of ``torch.distributed.nn.api``."""
