"""A parameter server with rpcdist: one server holds the model, several trainers train it.

Run it with one command; there is no server to start and nothing to configure::

    python examples/parameter_server.py [--trainers 2] [--epochs 12] [--quick] [--plot PATH]

It starts ``1 + trainers`` processes on this machine that meet through ``env://`` (the
launcher picks a free port for MASTER_PORT; the server, rank 0, hosts the store):

- the **server** (``ps``) holds the model, an MLP for scikit-learn's digits (8x8 images, 10
  classes), inside a ``ParameterServer`` object. It runs no loop of its own: it serves the
  trainers' calls until they are done, then reports the test accuracy of its parameters.
- each **trainer** holds a ``TrainerNet``, whose forward pass is an RPC to the server
  (``server_rref.rpc_sync().forward(x)``) and whose parameters are RRefs to the server's.
  It trains on its own shard of the training set, concurrently with the other trainers::

      with dist_autograd.context() as context_id:
          loss = F.nll_loss(model(x), y)
          dist_autograd.backward(context_id, [loss])   # gradients reach the server
          optimizer.step(context_id)                   # the server updates its parameters

  with ``optimizer = DistributedOptimizer(torch.optim.SGD, model.get_global_param_rrefs(), lr=...)``.

The trainers do not wait for one another: each step updates the server's parameters as soon
as its gradients are in (asynchronous SGD, as in torch's parameter-server tutorial).

While it runs, each trainer shows a progress bar (tqdm, on stderr) and prints a line per
epoch; at the end the server writes the curves (every trainer's loss and train accuracy, and
the test accuracy of the server's parameters after each epoch) to a PNG, ``--plot PATH``
(default ``parameter_server.png`` in the current directory), and prints its path.

The classes live in ``ps_functions.py``: rpcdist sends them by name, so every worker must be
able to import them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import rpcdist.autograd as dist_autograd
import rpcdist.rpc as rpc
from rpcdist.optim import DistributedOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ps_functions, also under `python -m`
import _launch  # noqa: E402
import _plot  # noqa: E402
import ps_functions  # noqa: E402

SERVER_NAME = "ps"
EPOCHS, QUICK_EPOCHS = 12, 3
DEFAULT_PLOT = "parameter_server.png"  # in the current directory


def say(text: str) -> None:
    print(text, flush=True)


def trainer_name(rank: int) -> str:
    return f"trainer{rank}"


def train(rank: int, args: argparse.Namespace) -> None:
    """What trainer ``rank`` does: SGD on its shard, every step through the server."""
    name = trainer_name(rank)
    x_train, y_train, _, _ = ps_functions.load_data()
    shard = slice(rank - 1, None, args.trainers)  # trainer k takes every k-th example
    x, y = x_train[shard], y_train[shard]
    model = ps_functions.TrainerNet(SERVER_NAME, seed=args.seed)
    optimizer = DistributedOptimizer(torch.optim.SGD, model.get_global_param_rrefs(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + rank)
    steps_per_epoch = -(-len(x) // args.batch_size)
    # One bar per trainer, on its own line of the terminal (stderr; stdout keeps the epoch lines).
    progress = tqdm(
        total=args.epochs * steps_per_epoch, desc=name, position=rank - 1, unit="step", mininterval=0.5
    )
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        total_loss, correct, steps = 0.0, 0, 0
        for batch in torch.randperm(len(x), generator=generator).split(args.batch_size):
            with dist_autograd.context() as context_id:
                output = model(x[batch])
                loss = F.nll_loss(output, y[batch])
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total_loss += loss.item()
            correct += int((output.detach().argmax(dim=1) == y[batch]).sum())
            steps += 1
            progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", refresh=False)
            progress.update()
        mean_loss, accuracy = total_loss / steps, correct / len(x)
        test_accuracy = model.server_rref.rpc_sync().record_epoch(name, epoch, mean_loss, accuracy)
        progress.write(
            f"epoch {epoch:2d}/{args.epochs}  {name}  loss {mean_loss:.4f}  train accuracy {accuracy:.3f}"
            f"  server test accuracy {test_accuracy:.3f}"
            f"  ({steps} steps, {time.perf_counter() - start:5.1f} s)",
            file=sys.stdout,
        )
        sys.stdout.flush()
    progress.close()


def report(args: argparse.Namespace) -> None:
    """On the server, once every trainer is done: the test accuracy of its parameters."""
    server = ps_functions.local_parameter_server()
    if server is None:
        raise RuntimeError("no trainer reached the parameter server")
    _, _, x_test, y_test = ps_functions.load_data()
    accuracy = server.accuracy(x_test, y_test)
    say(
        f"{SERVER_NAME}: {server.forwards} forward passes served; "
        f"test accuracy of the server's parameters on {len(x_test)} digits: {accuracy:.3f}"
    )
    say(f"result: test accuracy {accuracy:.4f} (chance is 0.1)")
    path = plot(server.history, accuracy, args)
    say(f"curve: {path}")


def plot(
    history: list[tuple[str, int, float, float, float]], accuracy: float, args: argparse.Namespace
) -> Path:
    """The PNG of the run: per trainer its loss and train accuracy per epoch, and the test
    accuracy of the server's parameters each time a trainer finished an epoch."""
    losses: dict[str, tuple[list[int], list[float]]] = {}
    accuracies: dict[str, tuple[list[int], list[float]]] = {}
    for trainer, epoch, loss, train_accuracy, _ in sorted(history):
        for lines, value in ((losses, loss), (accuracies, train_accuracy)):
            xs, ys = lines.setdefault(trainer, ([], []))
            xs.append(epoch)
            ys.append(value)
    # the server's test accuracy, in the order the epochs ended, at the epoch's fraction of the run
    done = {t: 0 for t in losses}
    test_x, test_y = [], []
    for trainer, _, _, _, test_accuracy in history:
        done[trainer] += 1
        test_x.append(sum(done.values()) / len(done))
        test_y.append(test_accuracy)
    accuracies["test (server's parameters)"] = (test_x, test_y)
    title = (
        f"parameter server + {args.trainers} trainers on digits, distributed autograd (rpcdist); "
        f"final test accuracy {accuracy:.3f}"
    )
    return _plot.save_curves(
        args.plot,
        title,
        [
            ("training loss", "epoch", "mean NLL loss", losses),
            ("accuracy", "epoch", "accuracy", accuracies),
        ],
    )


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """The body of each worker process."""
    torch.set_num_threads(1)  # several small processes share the cores
    name = SERVER_NAME if rank == 0 else trainer_name(rank)
    # env://: MASTER_ADDR and MASTER_PORT come from the environment the launcher set up.
    rpc.init_rpc(name, rank=rank, world_size=args.trainers + 1)
    try:
        if rank > 0:
            train(rank, args)
    finally:
        # Waits for every worker to get here: the server serves until the trainers are done.
        rpc.shutdown(timeout=args.timeout)
    if rank == 0:
        report(args)  # the parameters stay in this process after RPC is shut down


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trainers", type=int, default=2, help="trainer processes (default 2)")
    parser.add_argument("--epochs", type=int, default=None, help=f"epochs per trainer (default {EPOCHS})")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_EPOCHS} epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the shuffling")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up and kill the workers after this (s)"
    )
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        help=f"where to write the curves' PNG (default {DEFAULT_PLOT} in the current directory)",
    )
    args = parser.parse_args(argv)
    if args.trainers < 1:
        parser.error("--trainers must be at least 1")
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    if args.timeout is None:
        args.timeout = 180.0 if args.quick else 600.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = args.trainers + 1
    port = _launch.use_local_store()
    trainers = f"{args.trainers} trainer{'s' if args.trainers != 1 else ''}"
    say(
        f"starting {world_size} workers: {SERVER_NAME} (rank 0, hosts the store on 127.0.0.1:{port}) "
        f"and {trainers}; digits MLP, SGD lr={args.lr}, batch {args.batch_size}, {args.epochs} epochs"
    )
    return _launch.run_workers(run_worker, world_size, args, args.timeout, say)


if __name__ == "__main__":
    sys.exit(main())
