"""Pipeline parallelism with rpcdist: a model split into stages on different workers.

Run it with one command; there is no server to start and nothing to configure::

    python examples/pipeline_parallel.py [--stages 2] [--steps 60] [--quick] [--plot PATH]

It starts ``1 + stages`` processes on this machine that meet through ``env://`` (the launcher
picks a free port for MASTER_PORT; the master, rank 0, hosts the store):

- the **master** holds the data and drives training, but no layer of the model: it creates
  each stage of the model (an MLP, cut into consecutive ``Stage`` modules) on its own worker
  with ``rpc.remote`` and keeps only RRefs to them;
- **worker1 .. workerN** each hold one stage.

Each batch is split into micro-batches, and every micro-batch is sent down the pipeline at
once without waiting for the previous one (as in torch's "distributed pipeline parallelism
using RPC" tutorial)::

    for x in batch.split(split_size):
        y_rref = stage1_rref.remote().forward(RRef(x))          # output stays on worker1
        futures.append(stage2_rref.rpc_async().forward(y_rref))  # worker2 fetches it there
    output = torch.cat(wait_all(futures))

so while worker2 works on micro-batch ``i``, worker1 already works on ``i + 1``. The whole
step runs in a distributed autograd context: ``dist_autograd.backward`` sends the gradients
back through every stage, and a ``DistributedOptimizer`` (over the RRefs of every stage's
parameters) has each worker update its own. The task is a synthetic regression (MSE loss).

``--remote-modules`` builds the same stages as ``rpcdist.nn.RemoteModule`` objects instead (torch's
``RemoteModule`` API) and gathers the micro-batches with ``torch.futures.wait_all``.

While it trains, the master shows a progress bar (tqdm, on stderr) and prints a line per
step; at the end it writes the loss curve (training loss per step, test loss every few steps)
to a PNG, ``--plot PATH`` (default ``pipeline_parallel.png`` in the current directory), and
prints its path.

The classes live in ``pipeline_functions.py``: rpcdist sends them by name, so every worker
must be able to import them.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pipeline_functions, also under `python -m`
import _launch  # noqa: E402
import _plot  # noqa: E402
import pipeline_functions as pf  # noqa: E402

MASTER_NAME = "master"
STEPS, QUICK_STEPS = 60, 20
SIZES = [pf.N_FEATURES, 64, 64, 64, 1]  # the MLP's widths, input to output
N_TRAIN, N_TEST = 2048, 512
TEST_POINTS = 10  # how many times the test loss is measured during training
DEFAULT_PLOT = "pipeline_parallel.png"  # in the current directory


def say(text: str) -> None:
    print(text, flush=True)


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def train(args: argparse.Namespace) -> None:
    """What the master does once the group has formed."""
    x, y = pf.make_data(N_TRAIN + N_TEST, seed=args.seed)
    x_train, y_train, x_test, y_test = x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]
    workers = [worker_name(rank) for rank in range(1, args.stages + 1)]
    net = pf.RemoteModulePipeline if args.remote_modules else pf.PipelineNet
    model = net(workers, SIZES, split_size=args.split_size, seed=args.seed)
    param_rrefs = model.parameter_rrefs()
    optimizer = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=args.lr, momentum=0.9)
    n_micro = -(-args.batch_size // args.split_size)
    say(
        f"master: MLP {' -> '.join(map(str, SIZES))} in {args.stages} stages on "
        f"{', '.join(model.stage_names())} ({len(param_rrefs)} parameter tensors); batches of "
        f"{args.batch_size} in {n_micro} micro-batches of {args.split_size}; SGD lr={args.lr}"
    )
    test_steps, test_losses = [0], [F.mse_loss(model(x_test), y_test).item()]
    say(f"test loss before training: {test_losses[0]:.4f}")
    every = max(1, args.steps // TEST_POINTS)
    generator = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    progress = tqdm(total=args.steps, desc="master", unit="step", mininterval=0.5)  # on stderr
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, N_TRAIN, (args.batch_size,), generator=generator)
        with dist_autograd.context() as context_id:
            output = model(x_train[batch])
            loss = F.mse_loss(output, y_train[batch])
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.item())
        if step % every == 0 and step < args.steps:  # the last step's test loss is measured below
            with torch.no_grad():
                test_steps.append(step)
                test_losses.append(F.mse_loss(model(x_test), y_test).item())
        progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        progress.update()
        progress.write(
            f"step {step:3d}/{args.steps}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:5.1f} s)",
            file=sys.stdout,
        )
        sys.stdout.flush()
    progress.close()
    elapsed = time.perf_counter() - start
    say(f"{args.steps} steps in {elapsed:.1f} s ({1000 * elapsed / args.steps:.0f} ms per step)")
    test_steps.append(args.steps)
    test_losses.append(F.mse_loss(model(x_test), y_test).item())
    say(f"test loss after training: {test_losses[-1]:.4f}")
    verdict = "it fell" if losses[-1] < losses[0] else "it did not fall"
    say(f"result: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}: {verdict}")
    kind = "RemoteModules" if args.remote_modules else "RRefs"
    path = _plot.save_curves(
        args.plot,
        f"an MLP in {args.stages} pipeline stages on rpcdist ({kind}), micro-batches of {args.split_size}",
        [
            (
                "MSE loss",
                "step",
                "loss",
                {
                    "training (batch)": (range(1, len(losses) + 1), losses),
                    "test": (test_steps, test_losses),
                },
            )
        ],
    )
    say(f"curve: {path}")


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """The body of each worker process."""
    torch.set_num_threads(1)  # several small processes share the cores
    name = MASTER_NAME if rank == 0 else worker_name(rank)
    # env://: MASTER_ADDR and MASTER_PORT come from the environment the launcher set up.
    rpc.init_rpc(name, rank=rank, world_size=args.stages + 1)
    try:
        if rank == 0:
            train(args)
    finally:
        # Waits for every worker to get here, so the stages serve until the master is done.
        rpc.shutdown(timeout=args.timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stages", type=int, default=2, help=f"stages, one worker each (2 to {len(SIZES) - 1}; default 2)"
    )
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {STEPS})")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_STEPS} steps")
    parser.add_argument("--batch-size", type=int, default=128, help="examples per step (default 128)")
    parser.add_argument("--split-size", type=int, default=32, help="examples per micro-batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument(
        "--remote-modules",
        action="store_true",
        help="build the stages as rpcdist.nn.RemoteModule and gather with torch.futures.wait_all",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up and kill the workers after this (s)"
    )
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        help=f"where to write the loss curve's PNG (default {DEFAULT_PLOT} in the current directory)",
    )
    args = parser.parse_args(argv)
    if not 2 <= args.stages <= len(SIZES) - 1:
        parser.error(f"--stages must be between 2 and {len(SIZES) - 1}")
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else STEPS
    if args.steps < 1 or args.batch_size < 1 or args.split_size < 1:
        parser.error("--steps, --batch-size and --split-size must be positive")
    if args.timeout is None:
        args.timeout = 180.0 if args.quick else 600.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = args.stages + 1
    port = _launch.use_local_store()
    say(f"starting {world_size} workers; {MASTER_NAME} (rank 0) hosts the store on 127.0.0.1:{port}")
    return _launch.run_workers(run_worker, world_size, args, args.timeout, say)


if __name__ == "__main__":
    sys.exit(main())
