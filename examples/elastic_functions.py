"""The parameter server's side of elastic_parameter_server.py, and the calls trainers make to it.

rpcdist sends functions by name (``elastic_functions.forward``), so every worker must be able to
import them: that is why they live here rather than in the script. The model (``Net``) and the
data (``load_data``) are parameter_server.py's, from ``ps_functions.py``; only the server
imports it (and scikit-learn): a trainer asks the server for the training set when it joins.

One :class:`ElasticParameterServer` lives in the server process (:func:`start_server`). It

- holds the data and the model, and runs its forward pass for whichever trainers are present
  (:func:`training_data`, :func:`forward`, :func:`parameter_rrefs`), counting each trainer's
  steps;
- hears the group's membership changes (its :meth:`~ElasticParameterServer.on_membership_change`
  is registered with ``rpc.on_membership_change``) and logs them;
- cues the trainers that wait outside the group (a key in the rendezvous store, see
  :func:`cue_key`), which makes the example's schedule the same on every run: trainer1 is
  cued once the server is up; trainer2 once trainer1 has trained ``lead_epochs`` epochs; every
  later one once the one before it has left; trainer1 is told to stop (the answer of
  :func:`epoch_done`) once every other trainer has come and gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

import rpcdist.rpc as rpc
from rpcdist.rpc import WorkerInfo

__all__ = [
    "ElasticParameterServer",
    "cue_key",
    "epoch_done",
    "forward",
    "local_server",
    "parameter_rrefs",
    "start_server",
    "trainer_name",
    "training_data",
]

CUE_PREFIX = "elastic_ps/cue/"


def cue_key(trainer: int) -> str:
    """The store key that tells trainer number ``trainer`` to join the group."""
    return f"{CUE_PREFIX}{trainer}"


def trainer_name(trainer: int) -> str:
    """The worker name of trainer number ``trainer`` (its rank under the launcher)."""
    return f"trainer{trainer}"


class ElasticParameterServer:
    """The model, the trainers' step counts and the membership log of the server.

    ``trainers`` trainer processes take part: trainer1 trains from start to end, trainers
    2..``trainers`` visit one after another. ``cue(k)`` lets trainer ``k`` join; ``say``
    prints a line. Every method may run on several of rpcdist's threads at once.
    """

    def __init__(
        self,
        trainers: int,
        lead_epochs: int,
        min_epochs: int,
        seed: int,
        cue: Callable[[int], None],
        say: Callable[[str], None],
    ) -> None:
        from ps_functions import Net, load_data  # here: scikit-learn is for the server only

        self.x_train, self.y_train, self.x_test, self.y_test = load_data()
        torch.manual_seed(seed)
        self.model = Net()
        self.trainers = trainers
        self.lead_epochs = lead_epochs
        self.min_epochs = min_epochs
        self.steps: dict[str, int] = {}
        self.events: list[str] = []  # "+trainer1", "-trainer2", ... in the order heard
        self._when_left: dict[str, tuple[dict[str, int], set[str]]] = {}  # name -> (steps, gone) then
        self.all_left = threading.Event()
        self._cue = cue
        self._say = say
        self._lock = threading.Lock()
        self._visitors_done = trainers < 2

    # -- the trainers' calls ---------------------------------------------------------------
    def forward(self, trainer: str, x: torch.Tensor) -> torch.Tensor:
        """The model's output for ``trainer``'s batch, on a snapshot of the parameters (as
        ps_functions.ParameterServer.forward: another trainer's step may change them before
        this pass's backward)."""
        with self._lock:
            self.steps[trainer] = self.steps.get(trainer, 0) + 1
        return self.model(x, snapshot=True)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to the parameters (owned here), for a trainer's DistributedOptimizer."""
        return [rpc.RRef(p) for p in self.model.parameters()]

    def epoch_done(self, trainer: str, epoch: int) -> bool:
        """``trainer`` finished ``epoch``; returns whether trainer1 should go on (the others
        train a fixed number of epochs)."""
        if trainer == trainer_name(1) and epoch == self.lead_epochs and self.trainers >= 2:
            self._say(f"ps: {trainer} finished epoch {epoch}: cueing {trainer_name(2)}")
            self._cue(2)
        with self._lock:
            return not (self._visitors_done and epoch >= self.min_epochs)

    # -- the group -------------------------------------------------------------------------
    def on_membership_change(self, event: str, info: WorkerInfo) -> None:
        """The listener for ``rpc.on_membership_change``: log the change; when a visitor left,
        cue the next one (or, after the last, let trainer1 finish)."""
        members = ", ".join(w.name for w in rpc.get_worker_infos())
        with self._lock:
            self.events.append(("+" if event == "joined" else "-") + info.name)
            steps = self.steps.get(info.name, 0)
            left = {e[1:] for e in self.events if e.startswith("-")}
            if event == "left":
                self._when_left[info.name] = (dict(self.steps), left)
        if event == "joined":
            self._say(f"ps: {info.name} joined (rank {info.id}); members: {members}")
            return
        self._say(f"ps: {info.name} left (rank {info.id}) after {steps} steps; members: {members}")
        number = int(info.name.removeprefix("trainer")) if info.name.startswith("trainer") else 0
        if number >= 2:  # a visitor: the next one's turn, or trainer1 may finish
            if number < self.trainers:
                self._say(f"ps: cueing {trainer_name(number + 1)}")
                self._cue(number + 1)
            else:
                with self._lock:
                    self._visitors_done = True
                self._say(f"ps: every visitor has come and gone; {trainer_name(1)} may finish")
        if left >= {trainer_name(k) for k in range(1, self.trainers + 1)}:
            self.all_left.set()

    def steps_after_leaving(self) -> dict[str, dict[str, int]]:
        """For each trainer that left: the steps every trainer not gone by then took after it."""
        with self._lock:
            steps = sorted(self.steps.items())
            return {
                name: {other: n - then.get(other, 0) for other, n in steps if other not in gone}
                for name, (then, gone) in self._when_left.items()
            }

    @torch.no_grad()
    def test_accuracy(self) -> float:
        """The fraction of the test set the current parameters classify correctly."""
        return (self.model(self.x_test).argmax(dim=1) == self.y_test).float().mean().item()


_server: ElasticParameterServer | None = None


def start_server(
    trainers: int,
    lead_epochs: int,
    min_epochs: int,
    seed: int,
    cue: Callable[[int], None],
    say: Callable[[str], None],
) -> ElasticParameterServer:
    """Make this process's server (in the server process, before it joins the group)."""
    global _server
    _server = ElasticParameterServer(trainers, lead_epochs, min_epochs, seed, cue, say)
    return _server


def local_server() -> ElasticParameterServer:
    """This process's server (the functions below run on the server only)."""
    if _server is None:
        raise RuntimeError("no parameter server in this process: call it on the server's worker")
    return _server


# -- what the trainers call on the server, by name ---------------------------------------------
def forward(trainer: str, x: torch.Tensor) -> torch.Tensor:
    """The model's log-probabilities for ``x`` (recorded by distributed autograd)."""
    return local_server().forward(trainer, x)


def training_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The training set, ``(x, y)``: scikit-learn's digits less the server's test set."""
    server = local_server()
    return server.x_train, server.y_train


def parameter_rrefs() -> list[rpc.RRef[torch.Tensor]]:
    """RRefs to the server's parameters."""
    return local_server().parameter_rrefs()


def epoch_done(trainer: str, epoch: int) -> bool:
    """Report an epoch; returns whether trainer1 should go on."""
    return local_server().epoch_done(trainer, epoch)
