"""The classes rl_actor_observer.py places on its workers: the Agent and its Observers.

rpcdist sends classes and functions by name (``rl_functions.Observer``), so every worker must
be able to import them: that is why they live here rather than in the script.

The agent owns the policy; each observer owns a CartPole environment. During an episode an
observer asks the agent for every action through an RRef to the agent, so the policy's
forward passes (and the autograd graph they build) stay on the agent, where training happens.
"""

from __future__ import annotations

import gymnasium as gym
import torch
import torch.nn.functional as F
from torch import nn

import rpcdist.rpc as rpc
from rpcdist.futures import wait_all

ENV_NAME = "CartPole-v1"


class Policy(nn.Module):
    """A small MLP from the 4 CartPole observations to probabilities of its 2 actions."""

    def __init__(self, n_inputs: int = 4, n_actions: int = 2, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = nn.Linear(n_inputs, hidden)
        self.out = nn.Linear(hidden, n_actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.out(F.relu(self.hidden(x))), dim=-1)


class Observer:
    """Owns one environment, on the observer's worker; created there by ``rpc.remote``."""

    def __init__(self, ob_id: int, seed: int) -> None:
        self.ob_id = ob_id
        self.env = gym.make(ENV_NAME)
        self.seed: int | None = seed  # seeds the first reset; later resets continue its stream

    def run_episode(self, agent_rref: rpc.RRef[Agent], n_steps: int) -> float:
        """Play one episode of at most ``n_steps``, asking the agent for every action.

        The rewards go back to the agent when the episode ends; returns their total.
        """
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None
        agent = agent_rref.rpc_sync()  # a proxy: agent.method(...) runs on the agent's worker
        rewards: list[float] = []
        for _ in range(n_steps):
            action = agent.select_action(self.ob_id, torch.as_tensor(state, dtype=torch.float32))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        agent.report_rewards(self.ob_id, rewards)
        return sum(rewards)


class Agent:
    """Owns the policy and the optimiser, on the agent's worker; drives the observers.

    Trains with REINFORCE: after each round (one episode on every observer, run concurrently)
    it weights each step's log-probability by the normalised discounted return from that step.
    """

    def __init__(
        self,
        observer_names: list[str],
        seed: int,
        lr: float = 1e-2,
        gamma: float = 0.99,
        hidden: int = 128,
    ) -> None:
        torch.manual_seed(seed)
        self.policy = Policy(hidden=hidden)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.gamma = gamma
        self.rref = rpc.RRef(self)  # what the observers call back into
        self.ob_rrefs: list[rpc.RRef[Observer]] = []
        self.generators: dict[int, torch.Generator] = {}
        self.log_probs: dict[int, list[torch.Tensor]] = {}
        self.rewards: dict[int, list[float]] = {}
        for ob_id, name in enumerate(observer_names):
            ob_seed = seed + 1000 * (ob_id + 1)
            self.ob_rrefs.append(rpc.remote(name, Observer, args=(ob_id, ob_seed)))
            # One sampling stream per observer: the observers' calls interleave differently
            # from run to run, but each observer's own sequence of actions does not.
            self.generators[ob_id] = torch.Generator().manual_seed(ob_seed)
            self.log_probs[ob_id] = []
            self.rewards[ob_id] = []

    # -- called by the observers, through self.rref --------------------------------------------
    # Both are `async def`, so rpcdist runs them on the agent's event loop, one at a time: no
    # locks, no hop to a worker thread, and every forward pass is recorded by the same thread
    # (which keeps the backward pass, and so the whole run, repeatable). Neither awaits or
    # takes long, so the loop stays responsive.
    async def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        """Sample an action for observer ``ob_id`` in ``state``; keeps its log-probability."""
        probs = self.policy(state)
        action = int(torch.multinomial(probs.detach(), 1, generator=self.generators[ob_id]))
        self.log_probs[ob_id].append(torch.log(probs[action]))
        return action

    async def report_rewards(self, ob_id: int, rewards: list[float]) -> None:
        """The rewards of observer ``ob_id``'s episode, one per selected action."""
        self.rewards[ob_id].extend(rewards)

    # -- the training loop, on the agent's main thread -------------------------------------------
    def run_round(self, n_steps: int) -> list[float]:
        """One episode on every observer, all at once; returns their total rewards."""
        futures = [ob.rpc_async().run_episode(self.rref, n_steps) for ob in self.ob_rrefs]
        return wait_all(futures)

    def finish_round(self) -> float:
        """A REINFORCE update from the steps of the last round; returns the loss."""
        returns: dict[int, list[float]] = {}
        for ob_id, rewards in self.rewards.items():
            # Discounted returns, within each observer's own episode.
            ret, ob_returns = 0.0, []
            for reward in reversed(rewards):
                ret = reward + self.gamma * ret
                ob_returns.append(ret)
            returns[ob_id] = ob_returns[::-1]
        every = torch.tensor([r for ob_id in sorted(returns) for r in returns[ob_id]])
        mean, std = every.mean(), every.std() + 1e-8
        self.optimizer.zero_grad()
        total = 0.0
        for ob_id in sorted(returns):  # one backward per observer, in a fixed order: repeatable
            target = (torch.tensor(returns[ob_id]) - mean) / std
            loss = -(torch.stack(self.log_probs[ob_id]) * target).sum()
            loss.backward()
            total += loss.item()
            self.rewards[ob_id] = []
            self.log_probs[ob_id] = []
        self.optimizer.step()
        return total
