"""The classes and functions parameter_server.py places on its workers.

rpcdist sends classes and functions by name (``ps_functions.get_parameter_server``), so every
worker must be able to import them: that is why they live here rather than in the script.

- :class:`ParameterServer` lives on the server. It holds the model (:class:`Net`) and runs
  its forward pass for the trainers. One instance per server process, made on first use by
  :func:`get_parameter_server`, whichever trainer asks first.
- :class:`TrainerNet` lives on each trainer. It has no parameters of its own: its forward pass
  is an RPC to the server, and its "parameters" are RRefs to the server's.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import rpcdist.rpc as rpc

TEST_FRACTION = 0.25
SPLIT_SEED = 0


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (8x8 images, 10 classes) as ``x_train, y_train, x_test, y_test``.

    Pixels are scaled to [0, 1]; the split is stratified and seeded, so every process that
    calls this gets the same one.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y
    )
    return (
        torch.from_numpy(x_train),
        torch.from_numpy(y_train),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test),
    )


class Net(nn.Module):
    """An MLP from the 64 pixels to log-probabilities of the 10 digits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor, snapshot: bool = False) -> torch.Tensor:
        """With ``snapshot``, the pass runs on copies of the parameters (see
        :meth:`ParameterServer.forward`); the gradients still reach the parameters.

        The copies are made here, per call, rather than with ``torch.func.functional_call``,
        which swaps them into the module's attributes for the call: with concurrent calls, one
        call's copies could be left in the module for good.
        """
        w1, b1, w2, b2 = self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias
        if snapshot:
            w1, b1, w2, b2 = w1.clone(), b1.clone(), w2.clone(), b2.clone()
        return F.log_softmax(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), dim=-1)


class ParameterServer:
    """Holds the model on the server; the trainers call :meth:`forward` through an RRef."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = Net()
        self.forwards = 0  # how many forward passes the trainers asked for
        self._count_lock = threading.Lock()
        # (trainer, epoch, train loss, train accuracy, test accuracy of the server's parameters)
        self.history: list[tuple[str, int, float, float, float]] = []
        self._test_set: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for a trainer's batch (the trainers' calls run concurrently, on
        the server's worker threads).

        The trainers train at once, without waiting for one another (asynchronous SGD), so
        another trainer's optimizer step may update the parameters in place between this
        forward pass and its backward pass. Autograd refuses to backpropagate through a tensor
        it saved that has changed since (a known failure of torch's own parameter-server
        tutorial with two trainers or more). So the pass runs on a snapshot of the parameters:
        the graph saves the copies, and the gradients still reach the parameters through them.
        """
        with self._count_lock:
            self.forwards += 1
        return self.model(x, snapshot=True)

    def get_param_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to the parameters (owned here), for a trainer's DistributedOptimizer."""
        return [rpc.RRef(p) for p in self.model.parameters()]

    def record_epoch(self, trainer: str, epoch: int, loss: float, train_accuracy: float) -> float:
        """A trainer finished ``epoch``: keep its numbers with the test accuracy of the
        parameters now (for the curve); returns that accuracy."""
        if self._test_set is None:
            _, _, x_test, y_test = load_data()
            self._test_set = (x_test, y_test)
        test_accuracy = self.accuracy(*self._test_set)
        with self._count_lock:
            self.history.append((trainer, epoch, loss, train_accuracy, test_accuracy))
        return test_accuracy

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The fraction of ``x`` the current parameters classify correctly."""
        return (self.model(x).argmax(dim=1) == y).float().mean().item()


_server: ParameterServer | None = None
_server_lock = threading.Lock()


@rpc.expose  # callable by the trainers in restricted mode (RPCDIST_RESTRICTED=1) too
def get_parameter_server(seed: int = 0) -> ParameterServer:
    """This process's ParameterServer, made on first call (every trainer calls this)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ParameterServer(seed)
        return _server


def local_parameter_server() -> ParameterServer | None:
    """The ParameterServer of this process, if a trainer had it made."""
    return _server


class TrainerNet(nn.Module):
    """A trainer's view of the model: forward passes run on the server, over RPC."""

    def __init__(self, server_name: str, seed: int) -> None:
        super().__init__()
        # Every trainer asks for the server; the first call makes it, later ones share it.
        self.server_rref: rpc.RRef[ParameterServer] = rpc.remote(
            server_name, get_parameter_server, args=(seed,)
        )

    def get_global_param_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        """RRefs to the server's parameters (what a DistributedOptimizer needs)."""
        return self.server_rref.rpc_sync().get_param_rrefs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside a distributed autograd context this RPC is recorded: the output arrives as a
        # tensor whose gradient dist_autograd.backward sends back to the server.
        return self.server_rref.rpc_sync().forward(x)
