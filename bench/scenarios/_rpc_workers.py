"""The processes the ``rpc`` scenario (``rpc.py``) starts: RPC caller/callee pairs and a raw grpc.aio pair.

Every measuring process talks to the orchestrator over a ``multiprocessing`` Pipe:

    child -> orchestrator   ("phase", name, budget_s)     a measurement starts (hang deadline)
                            ("result", name, {...})       its numbers
                            ("error", name, traceback)    it raised; the next phase still runs
                            ("idle", budget_s)            nothing in flight: measure CPU now,
                                                          then answer ("go",)
                            ("measured",)                 all phases done, shutting down
                            ("done",)                     shut down cleanly
    orchestrator -> child   ("go",)

A phase named in ``cfg["skip"]`` (it hung in an earlier round) is reported as skipped.
On a hang the orchestrator sends SIGUSR1: each child dumps every thread's stack into its
``stack_file`` (faulthandler) before it is killed.

Nothing heavy (torch, grpc) is imported at module level: the orchestrator imports this module
too, and the raw gRPC processes never import torch.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import _harness as H
from _harness import MiB

GRPC_SERVICE = "rpcbench.Raw"
GRPC_OPTIONS = [
    # Only what a 64 MB unary message needs; everything else stays at grpc's defaults so the
    # raw rows are a floor, not a tuned transport.
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


# ------------------------------------------------------------------------------------------------
# shared by every child
# ------------------------------------------------------------------------------------------------
class _Reporter:
    """Runs phases, reports them, and keeps going after a failing phase."""

    def __init__(self, conn: Any, cfg: dict[str, Any]) -> None:
        self.conn = conn
        self.cfg = cfg

    def wanted(self, name: str) -> bool:
        """Whether phase ``name`` runs (a scenario may measure only some: ``cfg["only"]``)."""
        only = self.cfg.get("only")
        return not only or name in only

    def run(self, name: str, fn: Any, *args: Any) -> None:
        if not self.wanted(name):
            return
        if name in self.cfg.get("skip", ()):
            self.conn.send(("error", name, "skipped: this phase hung in an earlier round"))
            return
        self.conn.send(("phase", name, self.cfg["phase_budget"]))
        try:
            if os.environ.get("RPCBENCH_FAIL_PHASE") == name:  # exercises the harness's error path
                raise RuntimeError(f"failure injected into phase {name!r} by RPCBENCH_FAIL_PHASE")
            result = fn(*args)
        except BaseException:
            self.conn.send(("error", name, traceback.format_exc()))
        else:
            self.conn.send(("result", name, result))

    def idle(self) -> None:
        if not self.wanted("idle"):
            return
        self.conn.send(("idle", self.cfg["idle_seconds"] + 30))
        msg = self.conn.recv()
        assert msg == ("go",), msg


# ------------------------------------------------------------------------------------------------
# torch.distributed.rpc / rpcdist: one caller (rank 0) and one callee (rank 1)
# ------------------------------------------------------------------------------------------------
CARRIERS = {"grpc": "gRPC", "tcp": "framed TCP"}
"""rpcdist's carriers on the cross-host path (``cfg["cross_host_carrier"]``), by option value."""


def add_carrier_arg(ap: Any) -> None:
    """The ``--cross-host-carrier`` flag of the scenarios that take a cross-host path."""
    ap.add_argument(
        "--cross-host-carrier",
        choices=tuple(CARRIERS),
        default="grpc",
        help="rpcdist's carrier on the cross-host path: gRPC streams (default) or framed TCP "
        "(transport='tcp')",
    )


def carrier_name(cfg: dict[str, Any]) -> str:
    """How the table names rpcdist's cross-host carrier."""
    return CARRIERS[cfg.get("cross_host_carrier", "grpc")]


def backend_options(system: str, rpc: Any, init_method: str, cfg: dict[str, Any]) -> Any:
    """``system``'s RPC backend options for ``cfg["path"]``: "same-host" (the default) is each
    system's defaults; "cross-host" is what crosses a network even on one host (torch:
    TensorPipe's uv transport and basic channel; rpcdist: gRPC, or framed TCP with
    ``cfg["cross_host_carrier"] == "tcp"``, and no shared memory). Every scenario uses this."""
    cross = cfg.get("path") == "cross-host"
    if system == "torch":
        if cross:  # what crosses a network: TCP only
            return rpc.TensorPipeRpcBackendOptions(
                init_method=init_method, _transports=["uv"], _channels=["basic"]
            )
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method)  # TensorPipe defaults
    metrics_port = 0 if cfg.get("metrics") else None  # the metrics scenario's "on" rounds
    if cross:  # gRPC (or framed TCP) links, no shared memory
        carrier = cfg.get("cross_host_carrier", "grpc")
        options = rpc.RpcBackendOptions(
            init_method=init_method, transport=carrier, shm_threshold_bytes=0, metrics_port=metrics_port
        )
    else:
        options = rpc.RpcBackendOptions(init_method=init_method, metrics_port=metrics_port)
    security = cfg.get("security")  # the security scenario: "plain", "token" or "tls"
    if security in ("token", "tls"):
        options.auth_token = cfg["auth_token"]
    if security == "tls":
        options.tls_cert, options.tls_key, options.tls_ca = cfg["tls_files"]
    return options


def rpc_worker(
    system: str, rank: int, init_method: str, conn: Any, cfg: dict[str, Any], stack_file: str, lifeline: Any
) -> None:
    """Entry point of one member of a 2-process RPC group of ``system`` ("torch" or "rpcdist")."""
    _keep = H.child_setup(stack_file, lifeline, "rpcbench")  # noqa: F841
    name = "caller" if rank == 0 else "callee"
    if system == "torch":
        import torch.distributed.rpc as rpc
    elif system == "rpcdist":
        import rpcdist.rpc as rpc
    else:
        raise ValueError(system)
    options = backend_options(system, rpc, init_method, cfg)

    if rank != 0:  # the callee only serves until the caller shuts the group down
        rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
        rpc.shutdown()
        return

    report = _Reporter(conn, cfg)
    conn.send(("phase", "init", cfg["init_budget"]))
    try:
        rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    except BaseException:
        conn.send(("error", "init", traceback.format_exc()))
        raise
    conn.send(("result", "init", {}))
    try:
        _rpc_phases(system, rpc, report, cfg)
    finally:
        conn.send(("measured",))
        conn.send(("phase", "shutdown", cfg["init_budget"]))
        rpc.shutdown()
        conn.send(("done",))


def _rpc_phases(system: str, rpc: Any, report: _Reporter, cfg: dict[str, Any]) -> None:
    import gc
    import threading

    import torch

    from scenarios import _rpc_functions as F

    peer = "callee"

    def sanity() -> dict[str, Any]:
        pid = rpc.rpc_sync(peer, F.getpid)
        if pid == os.getpid():
            raise RuntimeError("the callee runs in the caller's process")
        return {"callee_pid": pid}

    def latency() -> dict[str, Any]:
        for _ in range(cfg["warmup"]):
            rpc.rpc_sync(peer, F.noop)
        clock = time.perf_counter_ns
        samples = []
        for _ in range(cfg["lat_calls"]):
            t0 = clock()
            rpc.rpc_sync(peer, F.noop)
            samples.append(clock() - t0)
        return H.stats_ns(samples)

    def window_batch(n: int, window: int) -> float:
        """n no-op rpc_async calls with at most ``window`` outstanding; returns calls/s."""
        slots = threading.Semaphore(window)
        failures: list[BaseException] = []

        def on_done(fut: Any) -> None:
            try:
                fut.value()
            except BaseException as exc:  # recorded, raised by the caller below
                failures.append(exc)
            slots.release()

        t0 = time.perf_counter()
        for _ in range(n):
            slots.acquire()
            rpc.rpc_async(peer, F.noop).add_done_callback(on_done)
        for _ in range(window):  # wait for the tail
            slots.acquire()
        elapsed = time.perf_counter() - t0
        if failures:
            raise failures[0]
        return n / elapsed

    def calls_per_s() -> dict[str, Any]:
        window = cfg["window"]
        window_batch(max(window * 4, cfg["warmup"]), window)
        rates = [window_batch(cfg["calls_n"], window) for _ in range(cfg["calls_batches"])]
        return {"calls_per_s": statistics.median(rates), "batches": rates, "window": window}

    def one_way(size: int) -> dict[str, Any]:
        x = torch.randn(size // 4)  # float32
        for _ in range(cfg["bulk_warmup"]):
            rpc.rpc_sync(peer, F.sink, args=(x,))
        clock = time.perf_counter_ns
        samples = []
        for _ in range(cfg["bulk_iters"][str(size)]):
            t0 = clock()
            rpc.rpc_sync(peer, F.sink, args=(x,))
            samples.append(clock() - t0)
        st = H.stats_ns(samples)
        st["MBps"] = (size / MiB) / (st["median_us"] / 1e6)
        return st

    def remote() -> dict[str, Any]:
        for i in range(max(10, cfg["warmup"] // 4)):
            rpc.remote(peer, F.small, args=(i,)).to_here()
        clock = time.perf_counter_ns
        samples = []
        for i in range(cfg["remote_calls"]):
            t0 = clock()
            value = rpc.remote(peer, F.small, args=(i,)).to_here()
            samples.append(clock() - t0)
            if value != i + 1:
                raise RuntimeError(f"remote(small, {i}).to_here() gave {value!r}")
        return H.stats_ns(samples)

    def wait_created(rref: Any, deadline: float) -> None:
        """Until the owner has run the ``remote()`` that made ``rref`` (raises its error)."""
        fut = rref._get_future() if hasattr(rref, "_get_future") else getattr(rref, "_confirmed", None)
        if fut is not None:  # torch: the creating call's future; rpcdist: the same, as _confirmed
            fut.wait()
            return
        while not rref.confirmed_by_owner():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rref!r} not confirmed by its owner in time")
            time.sleep(0.001)

    def rref_call() -> dict[str, Any]:
        target = rpc.remote(peer, F.Target)  # owned by the callee, held here
        wait_created(target, time.monotonic() + 60)
        for _ in range(cfg["warmup"]):
            target.rpc_sync().noop()
        clock = time.perf_counter_ns
        samples = []
        for _ in range(cfg["rref_calls"]):
            t0 = clock()
            target.rpc_sync().noop()
            samples.append(clock() - t0)
        return H.stats_ns(samples)

    def owner_stats() -> dict[str, int]:
        return rpc.rpc_sync(peer, F.memory_stats, args=(system,))

    def settle(at_most: int, seconds: float) -> tuple[dict[str, int], float]:
        """Poll the owner until it owns at most ``at_most`` RRef values (deletions arrive
        asynchronously); returns its last stats and how long that took."""
        t0 = time.monotonic()
        while True:
            st = owner_stats()
            if st["owned"] <= at_most or time.monotonic() - t0 > seconds:
                return st, time.monotonic() - t0
            time.sleep(0.05)

    def rref_memory() -> dict[str, Any]:
        """RSS growth of the owner (callee) and the user (caller) per live RRef to a small int."""
        n, batch = cfg["rref_count"], cfg["rref_batch"]
        gc.collect()
        owner_stats()  # warm the call path
        # Earlier phases' RRefs may still be on their way out: start from an empty owner table.
        before, _ = settle(0, 10.0)
        gc.collect()
        caller_before = F.vm_rss()
        rrefs: list[Any] = []
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            chunk = [rpc.remote(peer, F.small, args=(i,)) for i in range(start, min(n, start + batch))]
            deadline = time.monotonic() + cfg["phase_budget"]
            for rref in chunk:  # at most ``batch`` creations in flight
                wait_created(rref, deadline)
            rrefs.extend(chunk)
            del chunk, rref  # ``rrefs`` must hold the only references
        create_s = time.perf_counter() - t0
        gc.collect()
        time.sleep(0.2)
        held = owner_stats()
        gc.collect()
        caller_held = F.vm_rss()
        if held["owned"] < n:
            raise RuntimeError(f"the owner owns {held['owned']} RRef values with {n} RRefs live")
        for i in (0, n - 1):  # spot-check the values (after measuring)
            if rrefs[i].to_here() != i + 1:
                raise RuntimeError(f"RRef {i} holds {rrefs[i].to_here()!r}, expected {i + 1}")
        # Drop every RRef and wait until the owner has freed the values, so the group shuts
        # down with nothing left to delete.
        t1 = time.perf_counter()
        del rrefs
        gc.collect()
        after, _ = settle(before["owned"], cfg["phase_budget"] / 2)
        release_s = time.perf_counter() - t1
        if after["owned"] > before["owned"]:
            raise RuntimeError(
                f"the owner still owns {after['owned']} RRef values {release_s:.0f} s after all "
                f"{n} RRefs were dropped (it owned {before['owned']} before)"
            )
        gc.collect()
        return {
            "count": n,
            "batch": batch,
            "owner_bytes_per_rref": (held["rss"] - before["rss"]) / n,
            "caller_bytes_per_rref": (caller_held - caller_before) / n,
            "owner_rss_before": before["rss"],
            "owner_rss_held": held["rss"],
            "owner_rss_released": after["rss"],
            "owner_owned_held": held["owned"],
            "caller_rss_before": caller_before,
            "caller_rss_held": caller_held,
            "caller_rss_released": F.vm_rss(),
            "create_s": create_s,
            "creates_per_s": n / create_s,
            "release_s": release_s,
        }

    report.run("sanity", sanity)
    report.run("latency", latency)
    report.run("calls", calls_per_s)
    for size in cfg["sizes"]:
        report.run(f"oneway_{size}", one_way, size)
    report.run("remote", remote)
    report.run("rref_call", rref_call)
    time.sleep(0.5)  # let callbacks / RRef deletions settle before "nothing in flight"
    report.idle()
    # After the idle measurement, so its 100k RRefs (and their deletion) cannot disturb it.
    report.run("rref_memory", rref_memory)


# ------------------------------------------------------------------------------------------------
# raw grpc.aio: a generic-handler server and an asyncio client, bytes in / bytes out
# ------------------------------------------------------------------------------------------------
def grpc_server(conn: Any, stack_file: str, lifeline: Any) -> None:
    _keep = H.child_setup(stack_file, lifeline, "rpcbench")  # noqa: F841
    import asyncio

    import grpc

    async def serve() -> None:
        stop = asyncio.Event()

        async def unary(request: bytes, context: Any) -> bytes:
            return b"ok"

        async def stream(requests: Any, context: Any) -> bytes:
            total = 0
            async for chunk in requests:
                total += len(chunk)
            return total.to_bytes(8, "little")

        async def stop_rpc(request: bytes, context: Any) -> bytes:
            stop.set()
            return b""

        handler = grpc.method_handlers_generic_handler(
            GRPC_SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.stream_unary_rpc_method_handler(stream),
                "Stop": grpc.unary_unary_rpc_method_handler(stop_rpc),
            },
        )
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(("port", port))
        await stop.wait()
        await server.stop(grace=1.0)

    asyncio.run(serve())


def grpc_client(port: int, conn: Any, cfg: dict[str, Any], stack_file: str, lifeline: Any) -> None:
    _keep = H.child_setup(stack_file, lifeline, "rpcbench")  # noqa: F841
    import asyncio

    import grpc

    async def main() -> None:
        loop = asyncio.get_running_loop()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        await asyncio.wait_for(channel.channel_ready(), 60)
        unary = channel.unary_unary(f"/{GRPC_SERVICE}/Unary")
        stream = channel.stream_unary(f"/{GRPC_SERVICE}/Stream")
        stop = channel.unary_unary(f"/{GRPC_SERVICE}/Stop")
        tiny = b"x" * 8
        clock = time.perf_counter_ns

        # The coroutine twin of _Reporter.run.
        async def run(name: str, coro_fn: Any, *args: Any) -> None:
            if name in cfg.get("skip", ()):
                conn.send(("error", name, "skipped: this phase hung in an earlier round"))
                return
            conn.send(("phase", name, cfg["phase_budget"]))
            try:
                result = await coro_fn(*args)
            except BaseException:
                conn.send(("error", name, traceback.format_exc()))
            else:
                conn.send(("result", name, result))

        async def latency() -> dict[str, Any]:
            for _ in range(cfg["warmup"]):
                await unary(tiny)
            samples = []
            for _ in range(cfg["lat_calls"]):
                t0 = clock()
                await unary(tiny)
                samples.append(clock() - t0)
            return H.stats_ns(samples)

        async def window_batch(n: int, window: int) -> float:
            left = n

            async def lane() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await unary(tiny)

            t0 = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(window)))
            return n / (time.perf_counter() - t0)

        async def calls_per_s() -> dict[str, Any]:
            window = cfg["window"]
            await window_batch(max(window * 4, cfg["warmup"]), window)
            rates = [await window_batch(cfg["calls_n"], window) for _ in range(cfg["calls_batches"])]
            return {"calls_per_s": statistics.median(rates), "batches": rates, "window": window}

        async def one_way(size: int) -> dict[str, Any]:
            payload = os.urandom(size)
            for _ in range(cfg["bulk_warmup"]):
                await unary(payload)
            samples = []
            for _ in range(cfg["bulk_iters"][str(size)]):
                t0 = clock()
                await unary(payload)
                samples.append(clock() - t0)
            st = H.stats_ns(samples)
            st["MBps"] = (size / MiB) / (st["median_us"] / 1e6)
            return st

        async def client_stream() -> dict[str, Any]:
            size = cfg["stream_bytes"]
            chunk = cfg["stream_chunk"]
            payload = os.urandom(size)
            chunks = [payload[i : i + chunk] for i in range(0, size, chunk)]
            for _ in range(cfg["bulk_warmup"]):
                await stream(iter(chunks))
            samples = []
            for _ in range(cfg["stream_iters"]):
                t0 = clock()
                got = await stream(iter(chunks))
                samples.append(clock() - t0)
                if int.from_bytes(got, "little") != size:
                    raise RuntimeError(f"server received {int.from_bytes(got, 'little')} of {size} bytes")
            st = H.stats_ns(samples)
            st["MBps"] = (size / MiB) / (st["median_us"] / 1e6)
            return st

        await run("latency", latency)
        await run("calls", calls_per_s)
        for size in cfg["sizes"]:
            await run(f"oneway_{size}", one_way, size)
        await run("stream", client_stream)
        await asyncio.sleep(0.5)
        conn.send(("idle", cfg["idle_seconds"] + 30))
        msg = await loop.run_in_executor(None, conn.recv)
        assert msg == ("go",), msg
        conn.send(("measured",))
        conn.send(("phase", "shutdown", cfg["init_budget"]))
        try:
            await stop(b"")
        finally:
            await channel.close()

    asyncio.run(main())
    conn.send(("done",))
