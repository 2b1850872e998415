#!/usr/bin/env python
"""run.py: the tutorial's hand-written ring all-reduce, ``allreduce(send, recv)``.

From the PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html), run as written except:

* ``import rpcdist as dist`` instead of ``import torch.distributed as dist``;
* MASTER_PORT is a free ephemeral port chosen by the launcher instead of the fixed 29500,
  so that several copies (or a test suite) can run at once on one machine;
* the launcher exits non-zero if any worker process failed;
* ``run`` (the tutorial gives only ``allreduce``) calls it on a few tensors and checks the result
  against ``dist.all_reduce``'s.

Run it with one command: ``python examples/seed_ring_allreduce.py``
"""
import os
import socket
import sys

import torch
from torch.multiprocessing import Process

import rpcdist as dist

""" Implementation of a ring-reduce with addition. """
def allreduce(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run(rank, size):
    """ Not in the tutorial: use allreduce() and compare it with dist.all_reduce. """
    torch.manual_seed(rank)
    for shape in [(1,), (5,), (1000,), (64, 50)]:
        send = torch.randint(-100, 100, shape).float()  # integers: the sum is exact in any order
        recv = torch.zeros(shape)
        allreduce(send, recv)
        expected = send.clone()
        dist.all_reduce(expected, op=dist.reduce_op.SUM)
        assert torch.equal(recv, expected), (rank, shape, recv, expected)
        print('Rank ', rank, ' ring allreduce of shape ', list(shape), ' equals dist.all_reduce: ',
              torch.equal(recv, expected), ' (sum of first elements: ', recv.view(-1)[0].item(), ')')
    print('Rank ', rank, ' ring allreduce check passed')


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
    size = 4  # several processes around the ring
    processes = []
    for rank in range(size):
        p = Process(target=init_process, args=(rank, size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
    # Added: report failure through the exit status (the tutorial ignores it).
    sys.exit(max(abs(p.exitcode) for p in processes))
