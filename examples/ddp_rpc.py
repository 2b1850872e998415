"""DistributedDataParallel and RPC in one program: torch's "Combining DDP with Distributed RPC"
tutorial on rpcdist.

Run it with one command; there is no server to start and nothing to configure::

    python examples/ddp_rpc.py [--epochs 10] [--quick]

It starts 4 processes on this machine (the launcher picks free ports):

- the **parameter server** (``ps``, rank 3) holds an embedding table (``nn.EmbeddingBag``,
  100 items x 16), created there by the master as a ``rpcdist.nn.RemoteModule``;
- two **trainers** (``trainer0``, ``trainer1``, ranks 0 and 1) each hold a replica of a dense
  layer (``nn.Linear``) wrapped in ``torch.nn.parallel.DistributedDataParallel``. The two form
  a torch process group of their own on the ``"rpcdist"`` backend::

      torch.distributed.init_process_group("rpcdist", init_method="tcp://...", rank=r, world_size=2)
      fc = DistributedDataParallel(nn.Linear(16, 8))   # its gradients allreduce over rpcdist

- the **master** (rank 2) creates the remote table and has each trainer train on its own data
  (``rpc_async(trainer, run_trainer, args=(remote_emb_module, rank, config))``).

A trainer's step looks up the embeddings through the RemoteModule (an RPC to the server, in a
distributed autograd context), runs its DDP layer, and sends the gradients back: DDP averages
the dense layer's gradients across the trainers, distributed autograd takes the table's to the
server, a ``DistributedOptimizer`` updates the table there and a local SGD the dense layer
(see ``ddp_rpc_functions.run_trainer``). The loss falls on both trainers, and at the end their
dense layers are identical.

The functions live in ``ddp_rpc_functions.py``: rpcdist sends them by name, so every worker
must be able to import them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import rpcdist  # noqa: F401 - registers the "rpcdist" backend with torch.distributed
import rpcdist.rpc as rpc
from rpcdist.nn import RemoteModule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ddp_rpc_functions, also under `python -m`
import _launch  # noqa: E402
import ddp_rpc_functions as fn  # noqa: E402

TRAINERS = 2
MASTER_RANK, PS_RANK = 2, 3
WORLD_SIZE = 4
EPOCHS, QUICK_EPOCHS = 10, 4


def say(text: str) -> None:
    print(text, flush=True)


def worker_name(rank: int) -> str:
    if rank == MASTER_RANK:
        return "master"
    if rank == PS_RANK:
        return "ps"
    return f"trainer{rank}"


def run_master(args: argparse.Namespace) -> None:
    """Create the table on the server, have every trainer train, report."""
    remote_emb_module = RemoteModule(
        "ps/cpu",
        nn.EmbeddingBag,
        args=(fn.NUM_EMBEDDINGS, fn.EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )
    config = {
        "epochs": args.epochs,
        "batches": args.batches,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
    }
    say(
        f"master: EmbeddingBag({fn.NUM_EMBEDDINGS}, {fn.EMBEDDING_DIM}) on ps, "
        f"DDP(Linear({fn.EMBEDDING_DIM}, {fn.NUM_CLASSES})) on {TRAINERS} trainers; "
        f"{args.epochs} epochs of {args.batches} batches of {args.batch_size}, SGD lr={args.lr}"
    )
    table_rref = remote_emb_module.remote_parameters()[0]
    table_before = table_rref.to_here().detach()
    start = time.perf_counter()
    futures = [
        rpc.rpc_async(worker_name(r), fn.run_trainer, args=(remote_emb_module, r, config), timeout=0)
        for r in range(TRAINERS)
    ]
    results: list[dict[str, Any]] = [f.wait() for f in futures]
    say(f"training done in {time.perf_counter() - start:.1f} s")
    moved = float((table_rref.to_here().detach() - table_before).norm())
    say(f"ps: the embedding table moved by {moved:.4f} (L2; distributed autograd + DistributedOptimizer)")
    for r, result in enumerate(results):
        losses = result["losses"]
        say(f"trainer{r}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    in_sync = all(result["in_sync"] for result in results)
    say(f"dense layers identical on every trainer (DDP over rpcdist): {in_sync}")
    first = sum(result["losses"][0] for result in results) / TRAINERS
    last = sum(result["losses"][-1] for result in results) / TRAINERS
    ok = last < first and in_sync and moved > 0
    verdict = "it fell" if ok else "it did not fall, the replicas differ or the table did not train"
    say(f"result: first loss {first:.4f}, last loss {last:.4f}: {verdict}")


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """The body of each worker process."""
    torch.set_num_threads(1)  # several small processes share the cores
    if rank < TRAINERS:
        # The trainers' own process group, on rpcdist's backend (its own port, as the tutorial's).
        dist.init_process_group(
            "rpcdist", init_method=f"tcp://127.0.0.1:{args.pg_port}", rank=rank, world_size=TRAINERS
        )
    # env://: MASTER_ADDR and MASTER_PORT come from the environment the launcher set up.
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=WORLD_SIZE)
    try:
        if rank == MASTER_RANK:
            run_master(args)
    finally:
        # Waits for every worker: the server and the trainers serve until the master is done.
        rpc.shutdown(timeout=args.timeout)
        if rank < TRAINERS:
            dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=None, help=f"epochs per trainer (default {EPOCHS})")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_EPOCHS} epochs")
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch and trainer (default 16)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the dense layer")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up and kill the workers after this (s)"
    )
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    if args.epochs < 1 or args.batches < 1 or args.batch_size < 1:
        parser.error("--epochs, --batches and --batch-size must be positive")
    if args.timeout is None:
        args.timeout = 180.0 if args.quick else 600.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = _launch.use_local_store()
    args.pg_port = _launch.free_port()
    say(
        f"starting {WORLD_SIZE} workers: trainer0, trainer1 (their process group on 127.0.0.1:"
        f"{args.pg_port}), master, ps; trainer0 hosts the RPC store on 127.0.0.1:{port}"
    )
    return _launch.run_workers(run_worker, WORLD_SIZE, args, args.timeout, say)


if __name__ == "__main__":
    sys.exit(main())
