"""The grid-world cat of the RL course notes: a tiny RL problem trained through the same core functions as RLHF.

A cat starts on ``C`` and moves one cell per step, up / down / left / right:

    .  empty      0
    B  broom     -1   the episode goes on
    T  bathtub  -10   the episode ends
    M  meat    +100   the episode ends
    #  wall           cannot be entered

Rules, fixed once here:

* A reward is paid for *entering* a cell.
* A move into a wall or off the grid leaves the cat where it is and pays the empty-cell
  reward 0, even when the cat stands on a broom: the broom hurts on the way in, not for
  standing on it, so one broom is never charged twice.
* ``drunk = p``: with probability ``p`` the move goes in a uniformly random direction (one
  of the four, so the intended one again with probability ``p / 4``), else as intended.
* An episode stops on meat or bathtub, or after ``max_steps`` moves (a truncation, not a
  terminal cell).
* The *return* of an episode is the undiscounted sum of its rewards; ``gamma`` only shapes
  the training targets. :func:`optimal_return` is the best expected return reachable from
  the start within ``max_steps`` moves, by exact finite-horizon value iteration.

The mapping to RLHF: a move is a token, an episode a response. A batch of episodes is padded
to ``[B, T]`` (``T <= max_steps``) with a mask that is 1 up to and including the move that
ends the episode, exactly like a ``response_mask`` up to EOS, so ``core.gae``,
``core.policy_loss``, ``core.value_loss``, ``core.masked_mean`` ... apply unchanged.
Everything runs on the CPU: the networks are a few thousand parameters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import core
from ..config import Config, GridworldConfig
from ..utils import MetricsLogger, mean_stats, setup_run, to_float

ACTIONS = ("up", "down", "left", "right")
ARROWS = "↑↓←→"
_DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (d_row, d_col) per action, row 0 on top
REWARDS = {".": 0.0, "C": 0.0, "B": -1.0, "T": -10.0, "M": 100.0}
TERMINAL = frozenset("TM")
WALL = "#"
# Relative tolerance of "the greedy return is optimal". Without drunk moves returns are whole
# numbers and 0.1% of ~100 is far below a broom. With them the optimum of a finite horizon
# can need a time-dependent policy, which a stationary greedy policy trails by a hair: the
# value-iteration policy on the default layout misses it by 1.3e-4 at drunk=0.2 and 0.029 (of
# 55.9) at drunk=0.7.
OPTIMAL_RTOL = 1e-3

# Meat in the bottom-right corner, each of its two ways in over a broom, with the bathtub
# between the two brooms. From C the short way goes down and along the bottom (5 moves, one
# broom); the long way goes up and around the top (7 moves, a second broom on the way). The
# short way is the unique optimum, return 99 (tests/test_gridworld.py). Random moves find the
# meat within 20 steps about 9% of the time, so both learners see it before they learn fear.
DEFAULT_LAYOUT = (
    "..B.",
    "C##.",
    ".#TB",
    "..BM",
)


class GridWorld:
    """A grid layout turned into transition tables over the ``S = rows * cols`` cells.

    Cell ``s = row * cols + col``. ``next_state[s, d]`` and ``move_reward[s, d]`` give the
    cell reached and the reward paid when the cat on ``s`` actually moves in direction ``d``
    (a bump gives ``s`` itself and 0). Wall cells are states too, never occupied.
    """

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
        self.layout = layout
        self.drunk = float(drunk)
        self.max_steps = int(max_steps)
        self.n_rows, self.n_cols = len(layout), len(layout[0])
        self.n_states = len(cells)
        self.start = cells.index("C")
        self.cells = cells
        self.terminal = torch.tensor([ch in TERMINAL for ch in cells])  # [S] bool
        next_state = torch.empty(self.n_states, 4, dtype=torch.long)  # [S, 4]
        move_reward = torch.zeros(self.n_states, 4, dtype=torch.float64)  # [S, 4]
        for s in range(self.n_states):
            row, col = divmod(s, self.n_cols)
            for d, (dr, dc) in enumerate(_DELTAS):
                r2, c2 = row + dr, col + dc
                inside = 0 <= r2 < self.n_rows and 0 <= c2 < self.n_cols
                if inside and layout[r2][c2] != WALL:
                    next_state[s, d] = r2 * self.n_cols + c2
                    move_reward[s, d] = REWARDS[layout[r2][c2]]
                else:  # bump: stay, empty-cell reward
                    next_state[s, d] = s
        self.next_state = next_state
        self.move_reward = move_reward

    def transition_matrix(self) -> torch.Tensor:
        """``P[a, d]``: probability that intended action ``a`` moves in direction ``d``, ``[4, 4]``."""
        eye = torch.eye(4, dtype=torch.float64)
        return (1.0 - self.drunk) * eye + self.drunk / 4.0

    def step(
        self, states: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One move of every cat in a batch.

        Args:
            states, actions: ``[B]`` long, the cell each cat is on and the action it intends.
            generator: RNG for the drunk slips (unused when ``drunk == 0``).
        Returns:
            ``(next_states, rewards, done)``, ``[B]`` each (rewards float32, done bool: a
            terminal cell was entered; the step limit is the caller's business).
        """
        if self.drunk > 0:
            slip = torch.rand(states.shape, generator=generator) < self.drunk  # [B]
            random_dir = torch.randint(4, states.shape, generator=generator)  # [B]
            actions = torch.where(slip, random_dir, actions)
        nxt = self.next_state[states, actions]  # [B]
        reward = self.move_reward[states, actions].float()  # [B]
        return nxt, reward, self.terminal[nxt]


# --------------------------------------------------------------------------- exact references


def _backup(env: GridWorld, v: torch.Tensor, gamma: float) -> torch.Tensor:
    """``Q[s, a] = sum_d P[a, d] * (move_reward[s, d] + gamma * V[next(s, d)])``, ``[S, 4]``.

    ``v`` is the value with one move fewer left; nothing follows a terminal cell.
    """
    v_next = v[env.next_state]  # [S, 4]
    v_next = torch.where(env.terminal[env.next_state], torch.zeros_like(v_next), v_next)
    q_dir = env.move_reward + gamma * v_next  # [S, 4] per direction actually taken
    return q_dir @ env.transition_matrix().T  # [S, 4] per intended action


def value_iteration(env: GridWorld, gamma: float = 1.0, horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact finite-horizon optimal values by backward induction.

    ``V_0 = 0``, ``V_k(s) = max_a Q_k(s, a)`` with ``Q_k`` from ``V_{k-1}`` (:func:`_backup`).

    Returns:
        ``(V, Q)`` with ``horizon`` (default ``env.max_steps``) moves left: ``[S]``, ``[S, 4]``
        float64. ``V[env.start]`` is the best expected (discounted if ``gamma < 1``) return.
    """
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
    """Exact expected return from the start of the stationary policy ``actions`` (``[S]`` long).

    Same backward induction as :func:`value_iteration` with the max replaced by the policy's
    action, so with ``drunk == 0`` it is the return of the single greedy episode.
    """
    v = torch.zeros(env.n_states, dtype=torch.float64)
    for _ in range(env.max_steps):
        v = _backup(env, v, gamma).gather(1, actions.view(-1, 1)).squeeze(1)  # [S]
    return float(v[env.start])


def render_policy(env: GridWorld, actions: torch.Tensor) -> str:
    """The grid with one action per cell as an arrow, two characters per cell.

    ``##`` wall, `` M`` meat, `` T`` bathtub; other cells show their marker (``C`` start,
    ``B`` broom, blank for empty) followed by the arrow of ``actions[s]``.
    """
    lines = []
    for r, row in enumerate(env.layout):
        out = []
        for c, ch in enumerate(row):
            if ch == WALL:
                out.append("##")
            elif ch in TERMINAL:
                out.append(" " + ch)
            else:
                marker = " " if ch == "." else ch
                out.append(marker + ARROWS[int(actions[r * env.n_cols + c])])
        lines.append(" ".join(out))
    return "\n".join(lines)


# --------------------------------------------------------------------------- agent


class GridNet(nn.Module):
    """Policy MLP and value MLP on a one-hot cell, ``[...] -> ([..., 4], [...])``.

    The value "head" has its own hidden layer: a shared trunk would be pulled around by the
    squared value error far more than by the policy gradient.
    """

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
    states = torch.zeros(B, T, dtype=torch.long)
    actions = torch.zeros(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T)
    mask = torch.zeros(B, T, dtype=torch.long)
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
    states, actions, rewards, mask = states[:, :length], actions[:, :length], rewards[:, :length], mask[:, :length]
    # the same function the update uses, so the ratio at the first PPO step is 1
    logprobs = core.logprobs_from_logits(logits_all[states], actions)  # [B, T]
    return Episodes(states, actions, rewards, mask, logprobs, values_all[states])


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{k >= 0} gamma^k r_{t+k}`` up to each episode's last move, ``[B, T]`` (0 on padding).

    GAE with a zero critic and ``lam = 1`` is exactly this sum, so core.gae computes it.
    """
    _, returns = core.gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return returns


def reinforce_update(net: GridNet, optimizer: torch.optim.Optimizer, ep: Episodes, gc: GridworldConfig) -> dict:
    """One gradient step of ``-masked_mean(logp * (G_t - b))`` with a batch-mean baseline ``b``."""
    returns = returns_to_go(ep.rewards * gc.reward_scale, ep.mask, gc.gamma)  # [B, T]
    baseline = core.masked_mean(returns, ep.mask)  # scalar: one baseline for every move of the batch
    logits, _ = net(ep.states)  # [B, T, 4]
    logp = core.logprobs_from_logits(logits, ep.actions)  # [B, T]
    pg_loss = -core.masked_mean(logp * (returns - baseline), ep.mask)
    entropy = core.masked_mean(core.entropy_from_logits(logits), ep.mask)
    loss = pg_loss - gc.entropy_coef * entropy
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"policy/loss": pg_loss.detach(), "policy/entropy": entropy.detach(), "reinforce/baseline": baseline}


def ppo_update(
    net: GridNet, optimizer: torch.optim.Optimizer, ep: Episodes, gc: GridworldConfig, generator: torch.Generator
) -> dict:
    """``gc.ppo_epochs`` passes of clipped PPO over ``gc.minibatches`` minibatches of episodes."""
    rewards = ep.rewards * gc.reward_scale
    advantages, returns = core.gae(rewards, ep.values, ep.mask, gamma=gc.gamma, lam=gc.lam)  # [B, T]
    advantages = core.masked_whiten(advantages, ep.mask)
    B = ep.mask.shape[0]
    size = math.ceil(B / gc.minibatches)
    rows = []
    for _ in range(gc.ppo_epochs):
        for idx in torch.randperm(B, generator=generator).split(size):
            mask = ep.mask[idx]  # [b, T]
            logits, values = net(ep.states[idx])  # [b, T, 4], [b, T]
            logp = core.logprobs_from_logits(logits, ep.actions[idx])  # [b, T]
            p_loss, p_stats = core.policy_loss(logp, ep.logprobs[idx], advantages[idx], mask, gc.clip_range)
            # no value clipping: with returns of order 1 a 0.2 clip would only slow the critic
            v_loss, v_stats = core.value_loss(values, ep.values[idx], returns[idx], mask, clip_range=None)
            entropy = core.masked_mean(core.entropy_from_logits(logits), mask)
            loss = p_loss + gc.vf_coef * v_loss - gc.entropy_coef * entropy
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rows.append({**p_stats, **v_stats, "policy/entropy": entropy.detach()})
    stats = mean_stats(rows)
    stats["value/explained_var"] = to_float(core.explained_variance(ep.values, returns, ep.mask))
    return stats


def _plot_curve(curve: list[float], greedy: list[float], best: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(curve)), curve, label="mean sampled return")
    ax.plot(range(len(greedy)), greedy, label="greedy return", alpha=0.8)
    ax.axhline(best, color="k", ls="--", lw=1, label=f"optimum {best:g}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def train_gridworld(cfg: Config, layout: Sequence[str] = DEFAULT_LAYOUT) -> dict:
    """Train ``cfg.gridworld.algo`` (reinforce or ppo) on the grid world, seeded by ``run.seed``.

    Writes ``metrics.jsonl``, ``policy.txt`` (the greedy policy as arrows) and
    ``return_curve.png`` under ``run.out_dir``.

    Returns:
        ``returns`` (mean sampled episode return per iteration), ``greedy_return`` (exact
        expected return of the final greedy policy from the start), ``optimal_return``,
        ``optimal`` (whether the greedy return reaches it, within OPTIMAL_RTOL), ``policy`` (the
        arrows grid), ``seconds`` (training time, files excluded).
    """
    gc = cfg.gridworld
    if gc.algo not in ("reinforce", "ppo"):
        raise ValueError(f"gridworld.algo must be 'reinforce' or 'ppo', got {gc.algo!r}")
    out = setup_run(cfg, resumable=False)
    env = GridWorld(layout, drunk=gc.drunk, max_steps=gc.max_steps)
    best = optimal_return(env)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    net = GridNet(env.n_states, gc.hidden)  # init from the torch RNG that setup_run seeded
    optimizer = torch.optim.Adam(net.parameters(), lr=gc.lr, fused=True)  # fused: one kernel per step, ~20% faster here
    log = MetricsLogger(out / "metrics.jsonl", cfg)
    curve: list[float] = []
    greedy_curve: list[float] = []
    t0 = time.perf_counter()
    for it in range(gc.iterations):
        ep = rollout(env, net, gc.episodes_per_iter, generator)
        if gc.algo == "reinforce":
            stats = reinforce_update(net, optimizer, ep, gc)
        else:
            stats = ppo_update(net, optimizer, ep, gc, generator)
        curve.append(to_float(ep.episode_returns.mean()))
        greedy_curve.append(policy_return(env, net.greedy()))
        stats.update({"return/mean": curve[-1], "return/greedy": greedy_curve[-1],
                      "episode/length": ep.mask.sum(1).float().mean()})
        log.log(it, stats)
    seconds = time.perf_counter() - t0
    log.close()
    actions = net.greedy()
    greedy = policy_return(env, actions)
    policy = render_policy(env, actions)
    (out / "policy.txt").write_text(policy + "\n", encoding="utf-8")
    _plot_curve(curve, greedy_curve, best, out / "return_curve.png", f"grid-world cat, {gc.algo}, seed {cfg.run.seed}")
    return {
        "algo": gc.algo,
        "seed": cfg.run.seed,
        "iterations": gc.iterations,
        "returns": curve,
        "greedy_return": greedy,
        "optimal_return": best,
        "optimal": greedy >= best - OPTIMAL_RTOL * max(1.0, abs(best)),
        "policy": policy,
        "seconds": seconds,
        "out_dir": str(out),
    }
