"""The grid-world cat of the RL course notes (rules: docs/environments.md), trained through the
same core functions as RLHF: a move is a token, an episode a response, its mask 1 up to and
including the last move like a ``response_mask`` up to EOS. CPU only."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import core
from ..config import Config, GridworldConfig
from ..utils import MetricsLogger, mean_stats, setup_run, to_float

ARROWS = "↑↓←→"  # the actions: up, down, left, right
_DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (d_row, d_col) per action, row 0 on top
REWARDS = {".": 0.0, "C": 0.0, "B": -1.0, "T": -10.0, "M": 100.0}
TERMINAL = frozenset("TM")
WALL = "#"
# relative tolerance of "the greedy return is optimal": far below a broom, above the hair by which
# a stationary policy can trail a finite horizon's time-dependent optimum under drunk moves
OPTIMAL_RTOL = 1e-3

# the meat's two ways in each pass a broom, the bathtub between them; the short way (down and
# along the bottom, 5 moves) is the unique optimum, return 99; random moves find the meat often
# enough that both learners see it before they learn fear
DEFAULT_LAYOUT = (
    "..B.",
    "C##.",
    ".#TB",
    "..BM",
)


class GridWorld:
    """A layout as transition tables over its cells ``s = row * cols + col`` (walls: cells never
    occupied): ``next_state[s, d]`` and ``move_reward[s, d]`` of a move from ``s`` in direction ``d``."""

    def __init__(self, layout: Sequence[str] = DEFAULT_LAYOUT, drunk: float = 0.0, max_steps: int = 20):
        layout = tuple(layout)
        if not layout or len({len(row) for row in layout}) != 1 or not layout[0]:
            raise ValueError("a layout is a non-empty list of equally long rows")
        cells = "".join(layout)
        unknown = set(cells) - set(REWARDS) - {WALL}
        if unknown:
            raise ValueError(f"unknown layout characters {sorted(unknown)}: use . C B T M #")
        if cells.count("C") != 1:
            raise ValueError(f"a layout needs exactly one start cell C, found {cells.count('C')}")
        if not 0.0 <= drunk <= 1.0:
            raise ValueError(f"drunk is a probability, got {drunk}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.layout, self.drunk, self.max_steps = layout, float(drunk), int(max_steps)
        self.n_rows, self.n_cols, self.n_states = len(layout), len(layout[0]), len(cells)
        self.start = cells.index("C")
        self.terminal = torch.tensor([ch in TERMINAL for ch in cells])  # [S] bool
        moves = [[self._move(s, d) for d in range(4)] for s in range(self.n_states)]
        self.next_state = torch.tensor([[to for to, _ in row] for row in moves])  # [S, 4] long
        self.move_reward = torch.tensor([[r for _, r in row] for row in moves], dtype=torch.float64)  # [S, 4]

    def _move(self, s: int, d: int) -> tuple[int, float]:
        """Where the cat on ``s`` moving in direction ``d`` lands, and the reward for entering it."""
        row, col = divmod(s, self.n_cols)
        r, c = row + _DELTAS[d][0], col + _DELTAS[d][1]
        if not (0 <= r < self.n_rows and 0 <= c < self.n_cols) or self.layout[r][c] == WALL:
            return s, 0.0  # a bump: the cat stays, paid the empty cell's reward
        return r * self.n_cols + c, REWARDS[self.layout[r][c]]

    def transition_matrix(self) -> torch.Tensor:
        """``P[a, d]``: probability that intended action ``a`` moves in direction ``d``, ``[4, 4]``."""
        return (1.0 - self.drunk) * torch.eye(4, dtype=torch.float64) + self.drunk / 4.0

    def step(self, states: torch.Tensor, actions: torch.Tensor,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One move of every cat: ``states``, ``actions`` ``[B]`` long -> ``(next_states, rewards
        float32, done bool)`` ``[B]`` each (done: a terminal cell was entered; the step limit is
        the caller's). ``generator`` draws the drunk slips."""
        if self.drunk > 0:
            slip = torch.rand(states.shape, generator=generator) < self.drunk  # [B]
            random_dir = torch.randint(4, states.shape, generator=generator)  # [B]
            actions = torch.where(slip, random_dir, actions)
        nxt = self.next_state[states, actions]  # [B]
        return nxt, self.move_reward[states, actions].float(), self.terminal[nxt]


# --------------------------------------------------------------------------- exact references


def _backup(env: GridWorld, v: torch.Tensor, gamma: float) -> torch.Tensor:
    """``Q[s, a] = sum_d P[a, d] * (move_reward[s, d] + gamma * v[next(s, d)])`` ``[S, 4]``, ``v``
    the value with one move fewer left; nothing follows a terminal cell."""
    v_next = torch.where(env.terminal[env.next_state], 0.0, v[env.next_state])  # [S, 4]
    q_dir = env.move_reward + gamma * v_next  # [S, 4] per direction actually taken
    return q_dir @ env.transition_matrix().T  # [S, 4] per intended action


def value_iteration(env: GridWorld, gamma: float = 1.0, horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact optimal ``(V [S], Q [S, 4])`` (float64) with ``horizon`` (default ``env.max_steps``)
    moves left, by backward induction: ``V_0 = 0``, ``V_k = max_a Q_k``."""
    v = torch.zeros(env.n_states, dtype=torch.float64)
    q = torch.zeros(env.n_states, 4, dtype=torch.float64)
    for _ in range(env.max_steps if horizon is None else horizon):
        q = _backup(env, v, gamma)
        v = q.max(-1).values
    return v, q


def optimal_return(env: GridWorld, gamma: float = 1.0) -> float:
    """Best expected undiscounted (by default) return from the start cell within ``max_steps``."""
    return float(value_iteration(env, gamma)[0][env.start])


def policy_return(env: GridWorld, actions: torch.Tensor, gamma: float = 1.0) -> float:
    """Exact expected return from the start of the stationary policy ``actions [S]`` (the backward
    induction of :func:`value_iteration` with the policy's action for the max)."""
    v = torch.zeros(env.n_states, dtype=torch.float64)
    for _ in range(env.max_steps):
        v = _backup(env, v, gamma).gather(1, actions.view(-1, 1)).squeeze(1)  # [S]
    return float(v[env.start])


def render_policy(env: GridWorld, actions: torch.Tensor) -> str:
    """The grid, two characters per cell: ``##`` wall, `` M`` / `` T`` terminal, else the cell's
    marker (blank when empty) and the arrow of ``actions[s]``."""
    def cell(s: int, ch: str) -> str:
        if ch == WALL:
            return "##"
        return " " + ch if ch in TERMINAL else (" " if ch == "." else ch) + ARROWS[int(actions[s])]

    return "\n".join(" ".join(cell(r * env.n_cols + c, ch) for c, ch in enumerate(row))
                     for r, row in enumerate(env.layout))


# --------------------------------------------------------------------------- agent


class GridNet(nn.Module):
    """Policy MLP and value MLP on a one-hot cell, ``[...] -> ([..., 4], [...])``; separate hidden
    layers, as a shared trunk would follow the squared value error more than the policy gradient."""

    def __init__(self, n_states: int, hidden: int = 32):
        super().__init__()
        self.n_states = n_states
        self.policy = nn.Sequential(nn.Linear(n_states, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        self.value = nn.Sequential(nn.Linear(n_states, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        with torch.no_grad():  # start near the uniform policy: every direction gets explored
            self.policy[-1].weight.mul_(0.01)
            self.policy[-1].bias.zero_()

    def forward(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.one_hot(states, self.n_states).float()  # [..., S]
        return self.policy(x), self.value(x).squeeze(-1)

    @torch.no_grad()
    def greedy(self) -> torch.Tensor:
        """Most likely action on every cell, ``[S]`` long."""
        logits, _ = self(torch.arange(self.n_states))
        return logits.argmax(-1)


@dataclass
class Episodes:
    """A batch of episodes padded to ``[B, T]``; column ``t`` is the ``t``-th move."""

    states: torch.Tensor  # [B, T] long, the cell the move starts from
    actions: torch.Tensor  # [B, T] long, the intended action
    rewards: torch.Tensor  # [B, T] float32, 0 on padding
    mask: torch.Tensor  # [B, T] long, 1 up to and including the episode's last move
    logprobs: torch.Tensor  # [B, T] log pi(action | state) at rollout time
    values: torch.Tensor  # [B, T] critic at rollout time

    @property
    def episode_returns(self) -> torch.Tensor:
        """Undiscounted return of each episode, ``[B]``."""
        return core.masked_sum(self.rewards, self.mask, dim=1)


@torch.no_grad()
def rollout(env: GridWorld, net: GridNet, n_episodes: int, generator: torch.Generator) -> Episodes:
    """Play ``n_episodes`` episodes in lockstep, sampling from the current policy."""
    # the policy is fixed during a rollout, so one forward over every cell serves all moves
    logits_all, values_all = net(torch.arange(env.n_states))  # [S, 4], [S]
    probs_all = torch.softmax(logits_all, dim=-1)  # [S, 4]
    B, T = n_episodes, env.max_steps
    states, actions, mask = (torch.zeros(B, T, dtype=torch.long) for _ in range(3))  # [B, T] each
    rewards = torch.zeros(B, T)
    state = torch.full((B,), env.start, dtype=torch.long)  # [B]
    alive = torch.ones(B, dtype=torch.bool)  # [B]
    length = T
    for t in range(T):
        action = torch.multinomial(probs_all[state], 1, generator=generator).squeeze(1)  # [B]
        nxt, reward, done = env.step(state, action, generator)
        states[:, t], actions[:, t], mask[:, t] = state, action, alive.long()
        rewards[:, t] = torch.where(alive, reward, torch.zeros_like(reward))
        state = torch.where(alive, nxt, state)  # finished cats stay put (padding)
        alive = alive & ~done
        if not alive.any():
            length = t + 1
            break
    states, actions, rewards, mask = (x[:, :length] for x in (states, actions, rewards, mask))
    # the same function the update uses, so the ratio at the first PPO step is 1
    logprobs = core.logprobs_from_logits(logits_all[states], actions)  # [B, T]
    return Episodes(states, actions, rewards, mask, logprobs, values_all[states])


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{k >= 0} gamma^k r_{t+k}`` ``[B, T]`` (0 on padding): GAE with a zero critic and ``lam = 1``."""
    _, returns = core.gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return returns


def _descend(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def reinforce_update(net: GridNet, optimizer: torch.optim.Optimizer, ep: Episodes, gc: GridworldConfig) -> dict:
    """One gradient step of ``-masked_mean(logp * (G_t - b))`` with a batch-mean baseline ``b``."""
    returns = returns_to_go(ep.rewards * gc.reward_scale, ep.mask, gc.gamma)  # [B, T]
    baseline = core.masked_mean(returns, ep.mask)  # scalar: one baseline for every move of the batch
    logits, _ = net(ep.states)  # [B, T, 4]
    logp = core.logprobs_from_logits(logits, ep.actions)  # [B, T]
    pg_loss = -core.masked_mean(logp * (returns - baseline), ep.mask)
    entropy = core.masked_mean(core.entropy_from_logits(logits), ep.mask)
    _descend(optimizer, pg_loss - gc.entropy_coef * entropy)
    return {"policy/loss": pg_loss.detach(), "policy/entropy": entropy.detach(), "reinforce/baseline": baseline}


def ppo_update(net: GridNet, optimizer: torch.optim.Optimizer, ep: Episodes, gc: GridworldConfig,
               generator: torch.Generator) -> dict:
    """``gc.ppo_epochs`` passes of clipped PPO over ``gc.minibatches`` minibatches of episodes."""
    advantages, returns = core.gae(ep.rewards * gc.reward_scale, ep.values, ep.mask, gamma=gc.gamma, lam=gc.lam)  # [B, T]
    advantages = core.masked_whiten(advantages, ep.mask)
    B = ep.mask.shape[0]
    rows = []
    for _ in range(gc.ppo_epochs):
        for idx in torch.randperm(B, generator=generator).split(math.ceil(B / gc.minibatches)):
            mask = ep.mask[idx]  # [b, T]
            logits, values = net(ep.states[idx])  # [b, T, 4], [b, T]
            logp = core.logprobs_from_logits(logits, ep.actions[idx])  # [b, T]
            p_loss, p_stats = core.policy_loss(logp, ep.logprobs[idx], advantages[idx], mask, gc.clip_range)
            # no value clipping: with returns of order 1 a 0.2 clip would only slow the critic
            v_loss, v_stats = core.value_loss(values, ep.values[idx], returns[idx], mask, clip_range=None)
            entropy = core.masked_mean(core.entropy_from_logits(logits), mask)
            _descend(optimizer, p_loss + gc.vf_coef * v_loss - gc.entropy_coef * entropy)
            rows.append({**p_stats, **v_stats, "policy/entropy": entropy.detach()})
    stats = mean_stats(rows)
    stats["value/explained_var"] = to_float(core.explained_variance(ep.values, returns, ep.mask))
    return stats


def train_gridworld(cfg: Config, layout: Sequence[str] = DEFAULT_LAYOUT) -> dict:
    """Train ``gridworld.algo`` (reinforce or ppo), seeded by ``run.seed``; writes
    ``metrics.jsonl``, ``policy.txt`` (greedy arrows) and ``return_curve.png``; returns the curves,
    the final greedy policy's exact return and whether it reaches the optimum."""
    gc = cfg.gridworld
    if gc.algo not in ("reinforce", "ppo"):
        raise ValueError(f"gridworld.algo must be 'reinforce' or 'ppo', got {gc.algo!r}")
    out = setup_run(cfg, resumable=False)
    env = GridWorld(layout, drunk=gc.drunk, max_steps=gc.max_steps)
    best = optimal_return(env)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    net = GridNet(env.n_states, gc.hidden)  # init from the torch RNG that setup_run seeded
    optimizer = torch.optim.Adam(net.parameters(), lr=gc.lr, fused=True)  # fused: one kernel per step
    log = MetricsLogger(out / "metrics.jsonl", cfg)
    curve: list[float] = []  # mean sampled return per iteration
    greedy_curve: list[float] = []  # the greedy policy's exact return per iteration
    t0 = time.perf_counter()
    for it in range(gc.iterations):
        ep = rollout(env, net, gc.episodes_per_iter, generator)
        stats = reinforce_update(net, optimizer, ep, gc) if gc.algo == "reinforce" else \
            ppo_update(net, optimizer, ep, gc, generator)
        curve.append(to_float(ep.episode_returns.mean()))
        greedy_curve.append(policy_return(env, net.greedy()))
        stats.update({"return/mean": curve[-1], "return/greedy": greedy_curve[-1],
                      "episode/length": ep.mask.sum(1).float().mean()})
        log.log(it, stats)
    seconds = time.perf_counter() - t0
    log.close()
    actions = net.greedy()
    greedy, policy = policy_return(env, actions), render_policy(env, actions)
    (out / "policy.txt").write_text(policy + "\n", encoding="utf-8")
    from ..run.plots import plot_returns  # matplotlib only when a run finishes

    plot_returns(curve, greedy_curve, best, out / "return_curve.png", f"grid-world cat, {gc.algo}, seed {cfg.run.seed}")
    return {"algo": gc.algo, "seed": cfg.run.seed, "iterations": gc.iterations, "returns": curve,
            "greedy_return": greedy, "optimal_return": best,
            "optimal": greedy >= best - OPTIMAL_RTOL * max(1.0, abs(best)), "policy": policy,
            "seconds": seconds, "out_dir": str(out)}
