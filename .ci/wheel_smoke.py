"""Smoke check of an installed rpcdist wheel, run by .ci/check_wheel from outside the repository.

It fails unless rpcdist imports from site-packages (not the checkout), ships its type-hint
marker, and two processes meet (file:// rendezvous: no port to pick) and make an rpc_sync call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path


def worker(rank: int, init_method: str, results: mp.Queue) -> None:
    import torch

    import rpcdist.rpc as rpc

    opts = rpc.RpcBackendOptions(init_method=init_method, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        out = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        results.put(out.tolist())
    rpc.shutdown()


def main() -> int:
    import rpcdist

    where = Path(rpcdist.__file__).resolve()
    if "site-packages" not in where.parts:
        sys.exit(f"rpcdist was imported from {where}, not from the installed wheel")
    if not (where.parent / "py.typed").is_file():
        sys.exit("the installed rpcdist has no py.typed")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, init_method, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        codes = [p.exitcode for p in procs]
        if codes != [0, 0]:
            for p in procs:
                p.kill()
            sys.exit(f"the two workers exited with {codes}")
        got = results.get(timeout=10)
    if got != [4.0, 4.0]:
        sys.exit(f"rpc_sync(torch.add) returned {got}, expected [4.0, 4.0]")
    print(f"wheel smoke check passed: rpcdist {rpcdist.__version__} from {where.parent}, 2-process rpc_sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
