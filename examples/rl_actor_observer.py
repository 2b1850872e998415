"""Reinforcement learning with rpcdist: one agent, several observers, CartPole, REINFORCE.

Run it with one command; there is no server to start and nothing to configure::

    python examples/rl_actor_observer.py [--observers 2] [--episodes 120] [--quick]

It starts ``1 + observers`` processes on this machine that meet through ``env://`` (the
launcher picks a free port for MASTER_PORT; the agent, rank 0, hosts the store):

- the **agent** owns the policy network (a small MLP) and its optimiser;
- each **observer** owns a gymnasium ``CartPole-v1`` environment, inside an ``Observer``
  object the agent creates there with ``rpc.remote(name, Observer, ...)``: the agent only ever
  holds RRefs to the observers.

Each round, the agent starts ``ob_rref.rpc_async().run_episode(agent_rref, n_steps)`` on every
observer at once. The observers step their environments and, for every step, call back into
the agent through the RRef they were given (``agent_rref.rpc_sync().select_action(...)``), so
the policy's forward passes and their autograd graph stay on the agent; at the end of its
episode each observer reports its rewards the same way. When every observer has finished, the
agent trains on all their steps with REINFORCE (discounted, normalised returns; Adam). An
"episode" below is one such round. Everything is seeded, so a run repeats exactly.

The classes live in ``rl_functions.py``: rpcdist sends them by name, so every worker must be
able to import them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import rpcdist.rpc as rpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rl_functions, also under `python -m`
import _launch  # noqa: E402
import rl_functions  # noqa: E402

AGENT_NAME = "agent"
EPISODES, MAX_STEPS = 120, 500  # CartPole-v1's own limit is 500 steps
QUICK_EPISODES, QUICK_MAX_STEPS = 60, 200
RUNNING_DECAY = 0.05  # running = 0.05 * episode reward + 0.95 * running


def say(text: str) -> None:
    print(text, flush=True)


def observer_name(rank: int) -> str:
    return f"observer{rank}"


def train(args: argparse.Namespace) -> None:
    """What the agent does once the group has formed."""
    names = [observer_name(rank) for rank in range(1, args.observers + 1)]
    agent = rl_functions.Agent(names, seed=args.seed, lr=args.lr, gamma=args.gamma)
    say(
        f"agent: {len(names)} observers ({', '.join(names)}), CartPole-v1, REINFORCE, lr={args.lr}, "
        f"{args.episodes} episodes of at most {args.max_steps} steps"
    )
    rewards: list[float] = []  # per episode: the mean over the observers of their total reward
    running = 0.0
    progress = tqdm(total=args.episodes, desc=AGENT_NAME, unit="episode", mininterval=0.5)  # on stderr
    start = time.perf_counter()
    for episode in range(1, args.episodes + 1):
        totals = agent.run_round(args.max_steps)
        agent.finish_round()
        reward = statistics.fmean(totals)
        rewards.append(reward)
        running = reward if episode == 1 else RUNNING_DECAY * reward + (1 - RUNNING_DECAY) * running
        progress.set_postfix(reward=f"{reward:.1f}", running=f"{running:.1f}", refresh=False)
        progress.update()
        if episode % args.log_interval == 0 or episode == args.episodes:
            with tqdm.external_write_mode(file=sys.stdout):  # the bar steps aside for the line
                say(
                    f"episode {episode:4d}  last reward {reward:6.1f}  running reward {running:6.1f}"
                    f"  ({time.perf_counter() - start:5.1f} s)"
                )
    progress.close()
    n = min(10, len(rewards))
    first, last = statistics.fmean(rewards[:n]), statistics.fmean(rewards[-n:])
    rose = last >= 1.5 * first and running >= 1.5 * first
    verdict = "it clearly rose" if rose else "it did not clearly rise"
    say(f"final running reward {running:.1f} (the first {n} episodes averaged {first:.1f}): {verdict}")
    say(f"result: first-{n} mean {first:.1f}, last-{n} mean {last:.1f}")


def run_worker(rank: int, args: argparse.Namespace) -> None:
    """The body of each worker process."""
    torch.set_num_threads(1)  # several small processes share the cores
    name = AGENT_NAME if rank == 0 else observer_name(rank)
    # env://: MASTER_ADDR and MASTER_PORT come from the environment the launcher set up.
    rpc.init_rpc(name, rank=rank, world_size=args.observers + 1)
    try:
        if rank == 0:
            train(args)
    finally:
        # Waits for every worker to get here, so the observers serve until the agent is done.
        # The timeout covers the whole run: by default rpcdist waits only the RPC timeout.
        rpc.shutdown(timeout=args.timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--observers", type=int, default=2, help="observer processes (default 2)")
    parser.add_argument("--episodes", type=int, default=None, help=f"training episodes (default {EPISODES})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: {QUICK_EPISODES} episodes of at most {QUICK_MAX_STEPS} steps, under a minute",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help=f"step cap per episode (default {MAX_STEPS})"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    parser.add_argument("--gamma", type=float, default=0.99, help="discount factor (default 0.99)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the policy, sampling and envs")
    parser.add_argument("--log-interval", type=int, default=None, help="episodes between progress lines")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up and kill the workers after this (s)"
    )
    args = parser.parse_args(argv)
    if args.observers < 1:
        parser.error("--observers must be at least 1")
    if args.episodes is None:
        args.episodes = QUICK_EPISODES if args.quick else EPISODES
    if args.max_steps is None:
        args.max_steps = QUICK_MAX_STEPS if args.quick else MAX_STEPS
    if args.log_interval is None:
        args.log_interval = 10
    if args.timeout is None:
        args.timeout = 180.0 if args.quick else 900.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = args.observers + 1
    port = _launch.use_local_store()
    say(f"starting {world_size} workers; {AGENT_NAME} (rank 0) hosts the store on 127.0.0.1:{port}")
    return _launch.run_workers(run_worker, world_size, args, args.timeout, say)


if __name__ == "__main__":
    sys.exit(main())
