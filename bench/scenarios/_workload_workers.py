"""The processes the ``workloads`` scenario (``workloads.py``) starts, and what they call on each other.

One group is one workload of one system ("torch": ``torch.distributed.rpc`` / ``.autograd`` /
``.optim``; "rpcdist": ``rpcdist.rpc`` / ``.autograd`` / ``.optim``); the code is the same for both,
only the modules differ. Rank 0 drives (except in "scale", where every rank works):

  "rl<n>"        rank 0 "agent" owns a small policy MLP; ranks 1..n "observer<k>" (made with
                 ``rpc.remote`` by the agent) each run episodes of a synthetic fixed-cost
                 environment: every step is ``agent_rref.rpc_sync().select_action(...)`` (the
                 autograd graph stays on the agent); after each episode the agent runs REINFORCE.
  "pipeline<s>"  rank 0 "driver" holds RRefs to ``s`` stages, one per rank "stage<k>" (made with
                 ``rpc.remote``); a batch is cut into micro-batches that flow through the stages as
                 RRefs (``remote().forward`` then ``rpc_async().forward`` on the last), under
                 distributed autograd, with a ``DistributedOptimizer`` over every stage's parameters.
  "rref"         rank 0 "owner"; ranks "user<k>": (1) every user runs RRef lifecycles against the
                 owner (``remote()`` -> proxy call -> ``to_here()`` -> drop), (2) the owner fans one
                 RRef out to every user, each forks it on to the next user, who calls through it;
                 then the owner waits until it owns no RRef value any more.
  "scale<w>"     ranks "w<k>", all alike: all-to-all ``rpc_async`` no-ops with a window of calls in
                 flight, all starting at one instant, then an idle spell measured by the orchestrator.

Messages to the orchestrator are ``_autograd_workers``' (phase / result / error / measured / done)
plus ("ready",) -> ("go", t0, window) to start "scale" ranks together and ("idle",) -> ("go",)
around the idle spell. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import _harness as H

from scenarios import _rpc_functions as RF
from scenarios._autograd_workers import _modules, _Phases
from scenarios._rpc_workers import backend_options


def kind_of(workload: str) -> tuple[str, int]:
    """("rl", 8) from "rl8", ("rref", 0) from "rref"."""
    head = workload.rstrip("0123456789")
    return head, int(workload[len(head) :] or 0)


def world_of(workload: str, cfg: dict[str, Any]) -> int:
    kind, n = kind_of(workload)
    if kind == "rref":
        return 1 + cfg["rref_users"]
    return n if kind == "scale" else 1 + n


def worker_name(workload: str, rank: int) -> str:
    kind, _ = kind_of(workload)
    if kind == "scale":
        return f"w{rank}"
    if rank == 0:
        return {"rl": "agent", "pipeline": "driver", "rref": "owner"}[kind]
    return {"rl": "observer", "pipeline": "stage", "rref": "user"}[kind] + str(rank)


def serves(workload: str, rank: int) -> bool:
    """Whether ``rank`` only answers calls (and so waits in shutdown while the driver works)."""
    return rank != 0 and kind_of(workload)[0] != "scale"


def _spin(seconds: float) -> None:
    """Burn ``seconds`` of CPU: the synthetic environment's fixed cost per step."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _mlp(dims: list[int], seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    for i in range(len(dims) - 1):
        layers += [torch.nn.Linear(dims[i], dims[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


# ------------------------------------------------------------------------------------------------
# RL actor/observer: what runs on the agent and on the observers
# ------------------------------------------------------------------------------------------------
class Agent:
    """On the agent: the policy; ``select_action`` records each observer's log-probabilities."""

    def __init__(self, cfg: dict[str, Any], observers: int) -> None:
        import torch

        self.policy = _mlp([cfg["rl_obs_dim"], cfg["rl_hidden"], cfg["rl_actions"]], cfg["seed"])
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg["rl_lr"])
        self.gamma = cfg["rl_gamma"]
        self.log_probs: dict[int, list[Any]] = {k: [] for k in range(1, observers + 1)}

    def select_action(self, observer: int, state: Any) -> int:
        import torch

        probs = torch.softmax(self.policy(state.unsqueeze(0)), dim=1)
        dist = torch.distributions.Categorical(probs)
        action = dist.sample()
        self.log_probs[observer].append(dist.log_prob(action))
        return int(action)

    def finish_episode(self, rewards: dict[int, list[float]]) -> float:
        """REINFORCE over every observer's episode: normalised discounted returns."""
        import torch

        log_probs, returns = [], []
        for observer, rs in rewards.items():
            r, acc = 0.0, []
            for reward in reversed(rs):
                r = reward + self.gamma * r
                acc.append(r)
            returns += reversed(acc)
            log_probs += self.log_probs[observer]
            self.log_probs[observer] = []
        if len(log_probs) != len(returns):
            raise RuntimeError(f"{len(log_probs)} actions recorded on the agent for {len(returns)} rewards")
        ret = torch.tensor(returns)
        ret = (ret - ret.mean()) / (ret.std() + 1e-8)
        loss = -(torch.cat(log_probs) * ret).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss)


class Observer:
    """On an observer: a synthetic environment with a fixed CPU cost per step."""

    def __init__(self, index: int, cfg: dict[str, Any]) -> None:
        import torch

        self.index = index
        self.cost = cfg["rl_env_step_us"] / 1e6
        self.state = torch.zeros(cfg["rl_obs_dim"])
        self.gen = torch.Generator().manual_seed(index)

    def run_episode(self, agent_rref: Any, steps: int) -> tuple[list[float], list[int]]:
        """``steps`` environment steps, each one ``rpc_sync`` into the agent's RRef; the rewards
        and each step's call time (ns)."""
        import torch

        clock = time.perf_counter_ns
        state = torch.randn(self.state.shape, generator=self.gen)
        rewards: list[float] = []
        call_ns: list[int] = []
        for _ in range(steps):
            a = clock()
            action = agent_rref.rpc_sync().select_action(self.index, state)
            call_ns.append(clock() - a)
            _spin(self.cost)
            state = 0.9 * state + 0.1 * torch.randn(state.shape, generator=self.gen)
            rewards.append(1.0 if (action == 1) == bool(state[0] > 0) else 0.0)
        return rewards, call_ns


def _rl_agent(system: str, rpc: Any, observers: int, phases: _Phases, cfg: dict[str, Any]) -> None:
    agent_rref = rpc.RRef(Agent(cfg, observers))
    agent = agent_rref.local_value()
    obs = [rpc.remote(f"observer{k}", Observer, args=(k, cfg)) for k in range(1, observers + 1)]
    steps = cfg["rl_steps"]

    def episode() -> tuple[list[int], float]:
        futs = [ob.rpc_async().run_episode(agent_rref, steps) for ob in obs]
        outs = [f.wait() for f in futs]
        loss = agent.finish_episode({k + 1: out[0] for k, out in enumerate(outs)})
        return [ns for out in outs for ns in out[1]], loss

    def warmup() -> dict[str, Any]:
        if rpc.rpc_sync("observer1", RF.getpid) == os.getpid():
            raise RuntimeError("observer1 runs in the agent's process")
        for _ in range(cfg["rl_warmup_episodes"]):
            episode()
        return {}

    def measure() -> dict[str, Any]:
        call_ns: list[int] = []
        losses: list[float] = []
        start = time.monotonic()
        episodes = 0
        while episodes < cfg["rl_min_episodes"] or time.monotonic() - start < cfg["window"]:
            ns, loss = episode()
            call_ns += ns
            losses.append(loss)
            episodes += 1
        took = time.monotonic() - start
        s = sorted(call_ns)
        return {
            "episodes": episodes,
            "env_steps": len(call_ns),
            "env_steps_per_s": len(call_ns) / took,
            "step_p50_us": s[len(s) // 2] / 1e3,
            "step_p99_us": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3,
            "loss_last": losses[-1],
        }

    phases.run("rl_warmup", warmup)
    phases.run("rl", measure, budget=cfg["window"] + cfg["phase_budget"])


# ------------------------------------------------------------------------------------------------
# pipeline-parallel: stages held through RRefs
# ------------------------------------------------------------------------------------------------
class Stage:
    """On a stage worker: one slice of the model; ``forward`` fetches its input through an RRef."""

    def __init__(self, system: str, dims: list[int], seed: int) -> None:
        import threading

        self.system = system
        self.net = _mlp(dims, seed)
        self.lock = threading.Lock()  # micro-batches arrive concurrently

    def forward(self, x_rref: Any) -> Any:
        x = x_rref.to_here()
        with self.lock:
            return self.net(x)

    def parameter_rrefs(self) -> list[Any]:
        rpc = _modules(self.system)[0]
        return [rpc.RRef(p) for p in self.net.parameters()]


def _pipeline_driver(
    system: str,
    stages: int,
    rpc: Any,
    dist_autograd: Any,
    DistributedOptimizer: Any,
    phases: _Phases,
    cfg: dict[str, Any],
) -> None:
    import torch
    import torch.nn.functional as F

    if system == "torch":
        from torch.futures import wait_all
    else:
        from rpcdist.futures import wait_all
    width, batch = cfg["pipe_width"], cfg["pipe_batch"]
    # every stage: width -> width -> width (two Linear layers); the last ends in 10 classes
    dims = [[width, width, width] for _ in range(stages)]
    dims[-1][-1] = 10
    refs = [
        rpc.remote(f"stage{k + 1}", Stage, args=(system, dims[k], cfg["seed"] + k)) for k in range(stages)
    ]
    params = [p for ref in refs for p in ref.rpc_sync().parameter_rrefs()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=cfg["pipe_lr"])
    g = torch.Generator().manual_seed(cfg["seed"])
    data = [
        (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(4)
    ]

    def step(i: int, micro: int) -> float:
        x, y = data[i % len(data)]
        with dist_autograd.context() as context_id:
            futures = []
            for mb in x.split(batch // micro):
                ref = rpc.RRef(mb)
                for stage in refs[:-1]:
                    ref = stage.remote().forward(ref)
                futures.append(refs[-1].rpc_async().forward(ref))
            loss = F.cross_entropy(torch.cat(wait_all(futures)), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        return float(loss)

    def measure(micro: int) -> dict[str, Any]:
        losses = [step(i, micro) for i in range(cfg["pipe_warmup"])]
        start = time.monotonic()
        i = 0
        while i < cfg["pipe_min_iters"] or time.monotonic() - start < cfg["window"]:
            losses.append(step(i, micro))
            i += 1
        took = time.monotonic() - start
        return {
            "iters": i,
            "samples_per_s": i * batch / took,
            "loss_first": losses[0],
            "loss_last": losses[-1],
        }

    for micro in cfg["pipe_micro"]:
        phases.run(f"mb{micro}", measure, micro, budget=cfg["window"] + cfg["phase_budget"])


# ------------------------------------------------------------------------------------------------
# RRef lifecycles and fan-out
# ------------------------------------------------------------------------------------------------
class Box:
    """The value an RRef points at."""

    def __init__(self, value: int) -> None:
        self.value = value

    def get(self) -> int:
        return self.value


def run_lifecycles(system: str, t0: float, window: float) -> dict[str, Any]:
    """On a user: ``remote()`` -> proxy call -> ``to_here()`` -> drop, from ``t0`` for ``window`` s."""
    rpc = _modules(system)[0]
    delay = t0 - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < window:
        rref = rpc.remote("owner", Box, args=(n,))
        if rref.rpc_sync().get() != n or rref.to_here().value != n:
            raise RuntimeError(f"RRef lifecycle {n} saw the wrong value")
        del rref
        n += 1
    return {"lifecycles": n, "start": start, "end": time.monotonic()}


def fork_on(system: str, rref: Any, to: str) -> int:
    """On a user: hand ``rref`` on to user ``to``, who calls through it."""
    return _modules(system)[0].rpc_sync(to, call_through, args=(rref,))


def call_through(rref: Any) -> int:
    return rref.rpc_sync().get()


def _rref_owner(system: str, rpc: Any, users: int, phases: _Phases, cfg: dict[str, Any]) -> None:
    names = [f"user{k}" for k in range(1, users + 1)]

    def lifecycles() -> dict[str, Any]:
        for name in names:  # warm every user's path to the owner
            rpc.rpc_sync(name, run_lifecycles, args=(system, 0.0, 0.2))
        t0 = time.monotonic() + 0.1
        futs = [rpc.rpc_async(n, run_lifecycles, args=(system, t0, cfg["window"])) for n in names]
        outs = [f.wait() for f in futs]
        took = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        total = sum(o["lifecycles"] for o in outs)
        return {"lifecycles": total, "lifecycles_per_s": total / took}

    def fanout() -> dict[str, Any]:
        start = time.monotonic()
        n = 0
        while n < 5 or time.monotonic() - start < cfg["window"]:
            rref = rpc.RRef(Box(n))
            futs = [
                rpc.rpc_async(names[k], fork_on, args=(system, rref, names[(k + 1) % users]))
                for k in range(users)
            ]
            if any(f.wait() != n for f in futs):
                raise RuntimeError(f"fan-out {n}: a user saw the wrong value")
            del rref, futs
            n += 1
        return {"fanouts": n, "fanouts_per_s": n / (time.monotonic() - start)}

    def release() -> dict[str, Any]:
        """Until this owner owns no RRef value (every user's deletion has arrived), bounded."""
        gc.collect()
        start = time.monotonic()
        owned = RF.owned_rrefs(system)
        while owned and time.monotonic() - start < cfg["release_budget"]:
            time.sleep(0.05)
            gc.collect()
            owned = RF.owned_rrefs(system)
        return {"owned_after": owned, "release_s": time.monotonic() - start}

    phases.run("lifecycles", lifecycles, budget=cfg["window"] + cfg["phase_budget"])
    phases.run("fanout", fanout, budget=cfg["window"] + cfg["phase_budget"])
    phases.run("release", release, budget=cfg["release_budget"] + cfg["phase_budget"])


# ------------------------------------------------------------------------------------------------
# scale: all-to-all rpc_async
# ------------------------------------------------------------------------------------------------
def _scale_rank(rpc: Any, rank: int, world: int, phases: _Phases, cfg: dict[str, Any]) -> None:
    peers = [f"w{k}" for k in range(world) if k != rank] or [f"w{rank}"]

    def setup() -> dict[str, Any]:
        for p in peers:  # every link up before the clock starts
            rpc.rpc_sync(p, RF.noop)
        return {}

    phases.run("scale_setup", setup)
    phases.conn.send(("ready",))
    msg = phases.conn.recv()
    if msg[0] != "go":
        os._exit(1)
    t0, window = msg[1], msg[2]

    def all_to_all() -> dict[str, Any]:
        delay = t0 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = time.monotonic()
        inflight: list[Any] = []
        limit, n, sent = cfg["scale_inflight"], 0, 0
        while time.monotonic() - start < window:
            for _ in range(16):  # check the clock every few calls
                if len(inflight) >= limit:
                    inflight.pop(0).wait()
                    n += 1
                inflight.append(rpc.rpc_async(peers[sent % len(peers)], RF.noop))
                sent += 1
        for f in inflight:
            f.wait()
            n += 1
        end = time.monotonic()
        return {"calls": n, "start": start, "end": end, "calls_per_s": n / (end - start)}

    phases.run("all_to_all", all_to_all, budget=window + cfg["phase_budget"])
    time.sleep(0.5)  # let the last replies and acks settle before "nothing in flight"
    phases.conn.send(("idle",))
    if phases.conn.recv()[0] != "go":
        os._exit(1)


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def rank_main(
    system: str,
    workload: str,
    rank: int,
    world: int,
    init_method: str,
    cfg: dict[str, Any],
    conn: Any,
    stack_file: str,
    lifeline: Any,
) -> None:
    """Entry point of rank ``rank`` of a ``world``-process group of ``system`` running ``workload``."""
    _keep = H.child_setup(stack_file, lifeline, "wlbench")  # noqa: F841
    import torch

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 with several processes per machine
    rpc, dist_autograd, DistributedOptimizer = _modules(system)
    phases = _Phases(system, rank, world, conn, cfg)
    kind, n = kind_of(workload)

    def init() -> dict[str, Any]:
        options = backend_options(system, rpc, init_method, cfg)
        rpc.init_rpc(worker_name(workload, rank), rank=rank, world_size=world, rpc_backend_options=options)
        return {}

    phases.run("init", init, budget=cfg["init_budget"])
    if kind == "scale":
        _scale_rank(rpc, rank, world, phases, cfg)
    elif rank == 0 and kind == "rl":
        _rl_agent(system, rpc, n, phases, cfg)
    elif rank == 0 and kind == "pipeline":
        _pipeline_driver(system, n, rpc, dist_autograd, DistributedOptimizer, phases, cfg)
    elif rank == 0 and kind == "rref":
        _rref_owner(system, rpc, world - 1, phases, cfg)
    # the others serve until the driver shuts the group down (bounded by the orchestrator)
    conn.send(("measured",))
    phases.run("shutdown", rpc.shutdown, budget=cfg["serve_budget"] if serves(workload, rank) else None)
    conn.send(("done",))
