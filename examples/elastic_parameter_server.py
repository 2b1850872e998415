"""A parameter server on an elastic group: trainers join and leave while training goes on.

Run it under the launcher (the normal case) or on its own::

    rpcdist-run --standalone --nproc-per-node 4 examples/elastic_parameter_server.py [--quick]
    python examples/elastic_parameter_server.py [--trainers 3] [--quick]

Every process joins a *dynamic* group (``rpc.init_rpc(name, world_size=None)``): there is no
fixed size to wait for, a worker joins whenever it is ready and ``rpc.shutdown()`` leaves the
group while the others go on. Rank 0 is the **server** (``ps``); the others are **trainers**
that come and go on a schedule:

- trainer1 joins as soon as the server is up and trains from start to end;
- trainer2 joins once trainer1 has trained ``--lead-epochs`` epochs, trains ``--visit-epochs``
  epochs alongside trainer1 and leaves;
- trainer3 joins once trainer2 has left (and so on, one visitor after another);
- once the last visitor has left, trainer1 finishes its epoch (at least ``--epochs``) and leaves.

Under rpcdist-run the launcher's RANK picks each process's role (0: the server, k: trainerk)
and the launcher's store (MASTER_ADDR:MASTER_PORT) holds the group; its WORLD_SIZE is dropped
before ``init_rpc``, which would otherwise take it as the size of a fixed group (see
:func:`launched_role`). Run on its own, the script spawns ``1 + --trainers`` processes and the
server hosts the store.

A trainer that waits for its turn is not in the group yet: it waits for its cue, a key the
server sets in the rendezvous store (the store rpcdist-run serves, or the one the server hosts
when run on its own). The server hears every join and leave through ``rpc.on_membership_change``
and logs it, then reports the test accuracy of its parameters on scikit-learn's digits.

Training is parameter_server.py's: each trainer's forward pass is an RPC to the server, inside a
distributed autograd context, and a ``DistributedOptimizer`` over RRefs to the server's
parameters updates them there (asynchronous SGD: the trainers present do not wait for one
another). Each trainer asks the server for the training set when it joins (only the server
loads scikit-learn) and goes over all of it every epoch, in its own order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import rpcdist
import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist.optim import DistributedOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # elastic_functions, also under `python -m`
import _launch  # noqa: E402
import elastic_functions as ef  # noqa: E402

SERVER_NAME = "ps"
EPOCHS, QUICK_EPOCHS = 6, 3  # trainer1's least number of epochs
VISIT_EPOCHS, QUICK_VISIT_EPOCHS = 4, 2


def say(text: str) -> None:
    # One write per line: the group's processes share this output, and a line written in
    # two pieces (as print() does on unbuffered streams) can be split by another's.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def open_store(timeout: float) -> rpcdist.GrpcStore:
    """The group's rendezvous store at MASTER_ADDR:MASTER_PORT (the cues live there)."""
    # Before the server is up (run without a launcher, it hosts the store) this waits for it.
    return rpcdist.GrpcStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout)


def serve(args: argparse.Namespace) -> None:
    """The server: join, cue trainer1, log the trainers coming and going until all have left."""
    store = open_store(args.timeout)
    server = ef.start_server(
        args.trainers, args.lead_epochs, args.epochs, args.seed, lambda k: store.set(ef.cue_key(k), b"1"), say
    )
    # rank 0: run without a launcher, it hosts the store, and its shutdown() would serve it until
    # the others have left; under rpcdist-run the launcher serves the store and rank 0 hosts none.
    rpc.init_rpc(SERVER_NAME, rank=0, world_size=None)
    rpc.on_membership_change(server.on_membership_change)
    say(f"ps: serving the model; {args.trainers} trainers will come and go; cueing trainer1")
    store.set(ef.cue_key(1), b"1")
    try:
        if not server.all_left.wait(args.timeout):
            raise TimeoutError(f"ps: the trainers did not all come and go within {args.timeout:g} s")
    finally:
        rpc.shutdown()
        store.close()
    say(f"ps: membership changes heard: {' '.join(server.events)}")
    say("ps: steps served: " + ", ".join(f"{name} {n}" for name, n in sorted(server.steps.items())))
    for name, after in server.steps_after_leaving().items():  # the others went on after a trainer left
        if after:
            say(f"ps: steps after {name} left: {', '.join(f'{other} {n}' for other, n in after.items())}")
    accuracy = server.test_accuracy()
    say(f"result: test accuracy {accuracy:.4f} on {len(server.y_test)} digits (chance is 0.1)")


def train(trainer: int, args: argparse.Namespace) -> None:
    """Trainer number ``trainer``: wait for the cue, join, train, leave."""
    name = ef.trainer_name(trainer)
    store = open_store(args.timeout)
    try:
        store.wait([ef.cue_key(trainer)])
    finally:
        store.close()
    rpc.init_rpc(name, world_size=None)  # no rank asked: the group gives a free one
    try:
        epochs = train_in_group(name, trainer, args)
    finally:
        rpc.shutdown()  # leaves the group: the others go on
    say(f"{name}: left the group after {epochs} epochs")


def train_in_group(name: str, trainer: int, args: argparse.Namespace) -> int:
    """SGD through the server until this trainer's turn is over; returns the number of epochs
    it trained."""
    say(f"{name}: joined as rank {rpc.get_worker_info().id}; members: {members()}")
    x, y = rpc.rpc_sync(SERVER_NAME, ef.training_data)  # the whole training set, from the server
    parameters = rpc.rpc_sync(SERVER_NAME, ef.parameter_rrefs)  # RRefs to the server's parameters
    optimizer = DistributedOptimizer(torch.optim.SGD, parameters, lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + trainer)
    # No total: how long a trainer stays is up to the server. One line per trainer, on stderr,
    # and only on a terminal: under rpcdist-run stderr is a pipe the launcher copies line by
    # line with a [rankN]: prefix, where a bar redrawn in place is noise.
    progress = tqdm(desc=name, position=trainer - 1, unit="step", mininterval=0.5, disable=None)
    start = time.perf_counter()
    epoch = 0
    while True:
        epoch += 1
        total_loss, correct, steps = 0.0, 0, 0
        for batch in torch.randperm(len(x), generator=generator).split(args.batch_size):
            with dist_autograd.context() as context_id:
                output = rpc.rpc_sync(SERVER_NAME, ef.forward, args=(name, x[batch]))
                loss = F.nll_loss(output, y[batch])
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total_loss += loss.item()
            correct += int((output.detach().argmax(dim=1) == y[batch]).sum())
            steps += 1
            progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", refresh=False)
            progress.update()
        go_on = rpc.rpc_sync(SERVER_NAME, ef.epoch_done, args=(name, epoch))
        with tqdm.external_write_mode(file=sys.stdout):  # the bar steps aside for the line
            say(
                f"{name}: epoch {epoch:2d}  loss {total_loss / steps:.4f}"
                f"  train accuracy {correct / len(x):.3f}"
                f"  ({time.perf_counter() - start:5.1f} s)  members: {members()}"
            )
        if (trainer == 1 and (not go_on or epoch >= args.max_epochs)) or (
            trainer > 1 and epoch >= args.visit_epochs
        ):
            progress.close()
            return epoch


def members() -> str:
    """The names of the group's members now, as this worker knows them."""
    return ",".join(w.name for w in rpc.get_worker_infos())


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """The body of each worker process: rank 0 serves, the others train."""
    torch.set_num_threads(1)  # several small processes share the cores
    if rank == 0:
        serve(args)
    else:
        train(rank, args)


def launched_role() -> tuple[int, int]:
    """Under rpcdist-run: this process's rank and the number of processes, from the launcher.

    They only choose this process's role (rank 0 serves, the others train, in turn). WORLD_SIZE
    is then removed from the environment: rpcdist reads it as the size of a *fixed* group, so
    ``init_rpc(name, world_size=None)`` with WORLD_SIZE set would wait for all the launcher's
    processes at once instead of joining a dynamic group. (RANK may stay: a dynamic group gives
    out its own ranks and does not read it. The store stays the launcher's: MASTER_ADDR and
    MASTER_PORT point to it, and rank 0 hosts none.)
    """
    return int(os.environ["RANK"]), int(os.environ.pop("WORLD_SIZE"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--trainers", type=int, default=3, help="trainer processes when run without a launcher (default 3)"
    )
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument(
        "--epochs", type=int, default=None, help=f"trainer1's least number of epochs (default {EPOCHS})"
    )
    parser.add_argument(
        "--visit-epochs", type=int, default=None, help=f"epochs of each later trainer ({VISIT_EPOCHS})"
    )
    parser.add_argument(
        "--lead-epochs", type=int, default=1, help="trainer1's epochs before trainer2 joins (default 1)"
    )
    parser.add_argument("--max-epochs", type=int, default=200, help="trainer1 stops after this many at most")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the shuffling")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this (s)")
    args = parser.parse_args(argv)
    if args.trainers < 1:
        parser.error("--trainers must be at least 1")
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    if args.visit_epochs is None:
        args.visit_epochs = QUICK_VISIT_EPOCHS if args.quick else VISIT_EPOCHS
    if args.timeout is None:
        args.timeout = 180.0 if args.quick else 600.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if rpcdist.is_launched():  # rpcdist-run started this process, and the others
        rank, world_size = launched_role()
        if world_size < 2:
            raise SystemExit("run it with at least 2 processes: a server and a trainer")
        args.trainers = world_size - 1
        run_worker(rank, args)
        return 0
    port = _launch.use_local_store()
    say(
        f"starting {args.trainers + 1} workers: {SERVER_NAME} (rank 0, hosts the store on 127.0.0.1:{port}) "
        f"and {args.trainers} trainers that come and go"
    )
    return _launch.run_workers(run_worker, args.trainers + 1, args, args.timeout, say)


if __name__ == "__main__":
    sys.exit(main())
