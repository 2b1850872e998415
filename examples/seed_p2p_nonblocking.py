#!/usr/bin/env python
"""run.py: non-blocking point-to-point communication (isend / irecv, req.wait()).

From the PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html), run as written except:

* ``import rpcdist as dist`` instead of ``import torch.distributed as dist``;
* MASTER_PORT is a free ephemeral port chosen by the launcher instead of the fixed 29500,
  so that several copies (or a test suite) can run at once on one machine;
* the launcher exits non-zero if any worker process failed.

Run it with one command: ``python examples/seed_p2p_nonblocking.py``
"""
import os
import socket
import sys

import torch
from torch.multiprocessing import Process

import rpcdist as dist


def run(rank, size):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print('Rank 0 started sending')
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print('Rank 1 started receiving')
    req.wait()
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
    size = 2
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    # Added: report failure through the exit status (the tutorial ignores it).
    sys.exit(max(abs(p.exitcode) for p in processes))
