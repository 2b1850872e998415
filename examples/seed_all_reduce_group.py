#!/usr/bin/env python
"""run.py: all-reduce within a group (dist.new_group([0, 1]), dist.reduce_op.SUM).

From the PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html), run as written except:

* ``import rpcdist as dist`` instead of ``import torch.distributed as dist``;
* MASTER_PORT is a free ephemeral port chosen by the launcher instead of the fixed 29500,
  so that several copies (or a test suite) can run at once on one machine;
* the launcher exits non-zero if any worker process failed.

Run it with one command: ``python examples/seed_all_reduce_group.py``
"""
import os
import socket
import sys

import torch
from torch.multiprocessing import Process

import rpcdist as dist


def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.reduce_op.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


def init_process(rank, size, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    # MASTER_PORT: set by the launcher below (a free port) instead of '29500'.
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


def free_port():
    """Changed from the tutorial: a free ephemeral port (bind to port 0) instead of 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


if __name__ == "__main__":
    os.environ['MASTER_PORT'] = free_port()  # inherited by the worker processes
    # 4 processes, as in the tutorial's figure: ranks 2 and 3 are outside the group [0, 1], so
    # (as with torch.distributed) they get a warning and their tensor is left alone.
    size = 4
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    # Added: report failure through the exit status (the tutorial ignores it).
    sys.exit(max(abs(p.exitcode) for p in processes))
