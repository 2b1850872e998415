"""What ddp_rpc.py runs on its trainers: the data, the hybrid model and the training loop.

rpcdist sends functions by name (``ddp_rpc_functions.run_trainer``), so every worker must be
able to import them: that is why they live here rather than in the script.

The model, as in torch's "Combining Distributed DataParallel with Distributed RPC Framework"
tutorial: an embedding table (``nn.EmbeddingBag``) on the parameter server, reached through a
:class:`~rpcdist.nn.RemoteModule`, followed by a dense layer (``nn.Linear``) that every trainer
holds a replica of, wrapped in ``DistributedDataParallel`` over the ``"rpcdist"`` backend.

The task: bags of item ids (1 to 5 of :data:`NUM_EMBEDDINGS`) labelled with one of
:data:`NUM_CLASSES` classes by a fixed random "teacher" of the same shape, so the model can
learn it exactly and the loss falls.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import rpcdist.autograd as dist_autograd
from rpcdist.nn import RemoteModule
from rpcdist.optim import DistributedOptimizer
from rpcdist.rpc import RRef

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
MAX_BAG = 5
TEACHER_SEED = 1234


def make_batches(
    trainer_rank: int, n_batches: int, batch_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``n_batches`` of ``(indices, offsets, target)`` for one trainer (its own samples)."""
    teacher = torch.Generator().manual_seed(TEACHER_SEED)
    table = torch.randn(NUM_EMBEDDINGS, EMBEDDING_DIM, generator=teacher)
    weight = torch.randn(NUM_CLASSES, EMBEDDING_DIM, generator=teacher)
    g = torch.Generator().manual_seed(seed * 1000 + trainer_rank)
    batches = []
    for _ in range(n_batches):
        lengths = torch.randint(1, MAX_BAG + 1, (batch_size,), generator=g)
        indices = torch.randint(0, NUM_EMBEDDINGS, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        bags = nn.functional.embedding_bag(indices, table, offsets, mode="sum")
        batches.append((indices, offsets, (bags @ weight.T).argmax(dim=1)))
    return batches


class HybridModel(nn.Module):
    """The remote embedding table, then the local dense layer (a DDP replica on every trainer)."""

    def __init__(self, remote_emb_module: RemoteModule, seed: int) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(seed)  # the same initial dense layer everywhere (DDP broadcasts rank 0's anyway)
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES))  # process_group: torch's default, "rpcdist"

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The logits: embeddings looked up on the parameter server, then the DDP layer."""
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def run_trainer(
    remote_emb_module: RemoteModule, trainer_rank: int, config: dict[str, float]
) -> dict[str, object]:
    """Called by the master over RPC on each trainer: train; returns the mean loss of each epoch
    (``losses``) and whether the trainers' dense layers ended up identical (``in_sync``).

    One step, as in torch's tutorial::

        with dist_autograd.context() as context_id:
            logits = model(indices, offsets)        # RPC to the PS, then the DDP layer
            loss = criterion(logits, target)
            dist_autograd.backward(context_id, [loss])  # DDP allreduces the dense layer's
                                                        # gradients over "rpcdist"; the table's
                                                        # gradient goes back to the PS
            opt.step(context_id)                    # the PS its table, each trainer its
                                                    # (identical) dense layer
    """
    epochs, n_batches, batch_size = int(config["epochs"]), int(config["batches"]), int(config["batch_size"])
    model = HybridModel(remote_emb_module, seed=int(config["seed"]))
    # The table's parameters (on the PS) and the dense layer's (here), as RRefs.
    param_rrefs = remote_emb_module.remote_parameters() + [RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=config["lr"])
    criterion = nn.CrossEntropyLoss()
    batches = make_batches(trainer_rank, n_batches, batch_size, int(config["seed"]))
    losses: list[float] = []
    # A progress bar per trainer, each on its own terminal line (stderr; stdout keeps the epochs).
    progress = tqdm(
        total=epochs * len(batches),
        desc=f"trainer{trainer_rank}",
        position=trainer_rank,
        unit="step",
        mininterval=0.5,
    )
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        total = 0.0
        for indices, offsets, target in batches:
            with dist_autograd.context() as context_id:
                logits = model(indices, offsets)
                loss = criterion(logits, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            total += loss.item()
            progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", refresh=False)
            progress.update()
        losses.append(total / len(batches))
        line = f"epoch {epoch:2d}/{epochs}  trainer{trainer_rank}  loss {losses[-1]:.4f}"
        with tqdm.external_write_mode(file=sys.stdout):  # the bars step aside for the line
            sys.stdout.write(f"{line}  ({time.perf_counter() - start:5.1f} s)\n")  # one write: whole lines
            sys.stdout.flush()
    progress.close()
    return {"losses": losses, "in_sync": dense_layer_in_sync(model.fc.module)}


def dense_layer_in_sync(layer: nn.Module) -> bool:
    """Whether every trainer's dense layer is the same (gathered with torch's all_gather)."""
    flat = torch.cat([p.detach().flatten() for p in layer.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])
