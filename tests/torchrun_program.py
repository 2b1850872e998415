"""A program written for torch.distributed with its imports swapped to rpcdist, started by torch's
own launcher (``torchrun``) in the tests: RPC, then a process group, on whatever store torchrun's
agent serves. Writes what it saw to ``<out_dir>/rank<N>.json``."""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch

import rpcdist as dist
import rpcdist.rpc as rpc
from rpcdist.agent import current_agent


def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def main() -> None:
    out_dir = sys.argv[1]
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the launcher, with stacks
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)  # env://, as torchrun set it
    peer = (rank + 1) % world
    got = rpc.rpc_sync(f"worker{peer}", square, args=(torch.tensor([rank + 2.0]),)).item()
    colocated = current_agent().is_colocated(peer)
    rpc.shutdown()
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    result = {
        "rank": rank,
        "world": world,
        "rpc": got,
        "all_reduce": t.item(),
        "peer_colocated": colocated,
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
