#!/usr/bin/env python
"""train_dist.py: distributed synchronous SGD.

From the PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html, code at
https://github.com/seba-1511/dist_tuto.pth/), run as written except:

* ``import rpcdist as dist`` instead of ``import torch.distributed as dist``;
* MASTER_PORT is a free ephemeral port chosen by the launcher instead of the fixed 29500;
* the data: instead of downloading MNIST (28x28), scikit-learn's bundled handwritten digits
  (``load_digits``: 1,797 images of 8x8, no download), so ``Net`` is the fully connected part
  of the tutorial's MNIST network on the 64 pixels;
* ``bsz = 128 // size``: the tutorial's ``128 / float(size)`` is a float, which current
  ``DataLoader`` rejects (upstream's tutorial now uses ``//`` too);
* the launcher exits non-zero if any worker process failed.

Each rank trains on its own half of the data; ``average_gradients`` all-reduces the gradients
so both replicas take identical steps. Run it: ``python examples/seed_sync_sgd.py``
"""
import os
import socket
import sys
from math import ceil
from random import Random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.multiprocessing import Process

import rpcdist as dist


class Net(nn.Module):
    """ The tutorial's network (pytorch/examples' MNIST Net) for 8x8 images: its fully
    connected layers (fc1 -> 50 -> dropout -> fc2 -> 10 classes) on the 64 pixels. The MNIST
    convolutions are left out: on 8x8 they would add little but all-reduce calls. """

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = x.view(-1, 64)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


""" Dataset partitioning helper """
class Partition(object):  # noqa: UP004 (as in the tutorial)

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):  # noqa: UP004 (as in the tutorial)

    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):  # noqa: B006 (as in the tutorial)
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def digits_dataset():
    """ Stands in for datasets.MNIST(...) with ToTensor() and Normalize((mean,), (std,)). """
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # ToTensor: [0, 1]
    mean, std = images.mean().item(), images.std().item()  # MNIST's (0.1307,), (0.3081,) here
    images = (images - mean) / std
    targets = torch.tensor(digits.target, dtype=torch.long)
    return torch.utils.data.TensorDataset(images, targets)


""" Partitioning the dataset """
def partition_dataset():
    dataset = digits_dataset()
    size = dist.get_world_size()
    bsz = 128 // size  # the tutorial: 128 / float(size)
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition,
                                            batch_size=bsz,
                                            shuffle=True)
    return train_set, bsz


""" Gradient averaging. """
def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.reduce_op.SUM)
        param.grad.data /= size


""" Distributed Synchronous SGD Example """
def run(rank, size):
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(),
                          lr=0.01, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    for epoch in range(10):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print('Rank ', dist.get_rank(), ', epoch ',
              epoch, ': ', epoch_loss / num_batches)


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
