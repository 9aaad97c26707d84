"""Tests for the grid-world cat: rules by hand, exact optimum, drunk moves, learning."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.config import Config, ConfigError, load_config
from rlhfkit.tasks.gridworld import (
    GridNet,
    GridWorld,
    optimal_return,
    policy_return,
    render_policy,
    returns_to_go,
    rollout,
    train_gridworld,
    value_iteration,
)

UP, DOWN, LEFT, RIGHT = range(4)


def step1(env: GridWorld, state: int, action: int) -> tuple[int, float, bool]:
    nxt, reward, done = env.step(torch.tensor([state]), torch.tensor([action]))
    return int(nxt[0]), float(reward[0]), bool(done[0])


# --------------------------------------------------------------------------- rules by hand

# cells numbered row * 3 + col:   0 C   1 .   2 B
#                                 3 #   4 T   5 M
RULES = ("C.B", "#TM")


def test_empty_cell_pays_zero_and_continues():
    assert step1(GridWorld(RULES), 0, RIGHT) == (1, 0.0, False)


def test_broom_costs_one_and_continues():
    assert step1(GridWorld(RULES), 1, RIGHT) == (2, -1.0, False)


def test_meat_pays_hundred_and_ends():
    assert step1(GridWorld(RULES), 2, DOWN) == (5, 100.0, True)


def test_bathtub_costs_ten_and_ends():
    assert step1(GridWorld(RULES), 1, DOWN) == (4, -10.0, True)


def test_wall_and_edge_bumps_stay_and_pay_zero():
    env = GridWorld(RULES)
    assert step1(env, 0, DOWN) == (0, 0.0, False)  # into the wall
    assert step1(env, 0, UP) == (0, 0.0, False)  # off the top
    assert step1(env, 0, LEFT) == (0, 0.0, False)  # off the left edge
    # standing on a broom and bumping does not charge the broom again
    assert step1(env, 2, UP) == (2, 0.0, False)
    assert step1(env, 2, RIGHT) == (2, 0.0, False)


def test_step_is_batched():
    env = GridWorld(RULES)
    nxt, reward, done = env.step(torch.tensor([0, 1, 1, 2]), torch.tensor([RIGHT, RIGHT, DOWN, DOWN]))
    assert nxt.tolist() == [1, 2, 4, 5]
    assert reward.tolist() == [0.0, -1.0, -10.0, 100.0]
    assert done.tolist() == [False, False, True, True]


@pytest.mark.parametrize(
    "layout, match",
    [(("C.", "."), "equally long"), (("..",), "exactly one start"), (("CX",), "unknown"), (("CC",), "exactly one")],
)
def test_bad_layouts_raise(layout, match):
    with pytest.raises(ValueError, match=match):
        GridWorld(layout)


# --------------------------------------------------------------------------- exact optimum


def test_optimal_return_default_layout_hand_computed():
    #   . . B .      The optimal path from C (row 1, col 0), 5 moves:
    #   C # # .      down (2,0) 0, down (3,0) 0, right (3,1) 0, right (3,2) broom -1,
    #   . # T B      right (3,3) meat +100   ->  return 99.
    #   . . B M      The other way (up, around the top) is 7 moves over two brooms: 98.
    env = GridWorld()
    assert optimal_return(env) == 99.0
    # discounted, gamma = 0.9: -1 on move 4, +100 on move 5 -> -0.9^3 + 100 * 0.9^4 = 64.881
    # (the top way is worth -0.9^2 - 0.9^5 + 100 * 0.9^6 = 51.74, less)
    assert value_iteration(env, gamma=0.9)[0][env.start].item() == pytest.approx(64.881, abs=1e-9)
    # the step limit is a horizon: 4 moves cannot reach the meat, the best is to stay safe (0)
    assert optimal_return(GridWorld(max_steps=4)) == 0.0
    assert optimal_return(GridWorld(max_steps=5)) == 99.0


def test_policy_return_and_render_of_the_optimal_policy():
    env = GridWorld()
    actions = value_iteration(env, gamma=0.9)[1].argmax(-1)  # [S]
    assert policy_return(env, actions) == 99.0
    rows = render_policy(env, actions).split("\n")
    assert len(rows) == 4
    # two characters per cell, joined by spaces: marker + arrow, ## wall, " T" / " M"
    assert rows[1].split(" ")[:3] == ["C↓", "##", "##"]
    assert rows[2].startswith(" ↓ ## ") and " T " in rows[2]
    assert rows[3] == " →  → B→  M"
    # a policy that bumps forever from the start earns nothing
    stay = torch.full((env.n_states,), LEFT)
    assert policy_return(env, stay) == 0.0


# --------------------------------------------------------------------------- drunk moves


def test_transition_matrix_rows():
    p = GridWorld(drunk=0.4).transition_matrix()
    torch.testing.assert_close(p.sum(-1), torch.ones(4, dtype=torch.float64))
    # intended direction: 1 - p + p/4 = 0.7; each other: p/4 = 0.1
    torch.testing.assert_close(p[UP], torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64))


def test_drunk_moves_follow_the_given_probability():
    # a 3x3 open room, cat in the middle: every direction leads to a different cell
    env = GridWorld(("...", ".C.", "..."), drunk=0.4)
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    nxt, _, _ = env.step(torch.full((n,), 4), torch.full((n,), UP), gen)
    freq = torch.bincount(nxt, minlength=9).double() / n
    # up -> cell 1 with 1 - p + p/4 = 0.7; down 7, left 3, right 5 with p/4 = 0.1 each.
    # Binomial std at n = 40000 is <= 0.0023, so 0.01 is a > 4 sigma band.
    expected = torch.zeros(9, dtype=torch.float64)
    expected[[1, 7, 3, 5]] = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    # sober cats never slip
    sober, _, _ = GridWorld(("...", ".C.", "...")).step(torch.full((n,), 4), torch.full((n,), UP), gen)
    assert bool((sober == 1).all())


def test_drunk_policy_return_matches_simulation():
    # the exact expectation of policy_return agrees with the mean of simulated episodes
    env = GridWorld(drunk=0.3)
    actions = value_iteration(env)[1].argmax(-1)  # [S]
    n = 20_000
    gen = torch.Generator().manual_seed(1)
    state = torch.full((n,), env.start)
    alive = torch.ones(n, dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(env.max_steps):
        nxt, reward, done = env.step(state, actions[state], gen)
        total += torch.where(alive, reward.double(), torch.zeros_like(total))
        state = torch.where(alive, nxt, state)
        alive &= ~done
    # returns lie in [-30, 100]: std < 40, standard error < 0.3 at n = 20000
    assert total.mean().item() == pytest.approx(policy_return(env, actions), abs=1.5)
    assert policy_return(env, actions) < optimal_return(GridWorld()) - 5  # slipping costs


# --------------------------------------------------------------------------- episodes as [B, T]


def test_returns_to_go_hand_computed():
    # gamma = 0.9; row 0: rewards [0, -1, 100], all valid:
    #   G2 = 100, G1 = -1 + 0.9 * 100 = 89, G0 = 0 + 0.9 * 89 = 80.1
    # row 1 ends after two moves (mask [1, 1, 0]): the 100 in padding is ignored
    #   G1 = -10, G0 = 0 + 0.9 * -10 = -9
    rewards = torch.tensor([[0.0, -1.0, 100.0], [0.0, -10.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(
        returns_to_go(rewards, mask, 0.9), torch.tensor([[80.1, 89.0, 100.0], [-9.0, -10.0, 0.0]], dtype=torch.float64)
    )


def test_rollout_padding_and_logprobs():
    torch.manual_seed(0)
    env = GridWorld()
    net = GridNet(env.n_states, hidden=8)
    ep = rollout(env, net, 64, torch.Generator().manual_seed(0))
    B, T = ep.mask.shape
    assert B == 64 and T <= env.max_steps
    assert bool((ep.states[:, 0] == env.start).all())
    lengths = ep.mask.sum(1)  # [B]
    assert bool((lengths >= 1).all())
    # the mask is 1 then 0: no gaps, like a response mask up to EOS
    assert torch.equal(ep.mask, (torch.arange(T)[None, :] < lengths[:, None]).long())
    assert bool((ep.rewards[ep.mask == 0] == 0).all())
    torch.testing.assert_close(ep.episode_returns, ep.rewards.sum(1))
    # an episode shorter than the limit ended on meat or bathtub, on its last move
    short = lengths < env.max_steps
    last_reward = ep.rewards.gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert bool(((last_reward[short] == 100) | (last_reward[short] == -10)).all())
    # rollout-time log-probs equal the training forward's: the first PPO ratio is exactly 1
    logits, _ = net(ep.states)
    logp = torch.log_softmax(logits, -1).gather(-1, ep.actions[..., None]).squeeze(-1)
    torch.testing.assert_close(ep.logprobs[ep.mask == 1], logp[ep.mask == 1])


# --------------------------------------------------------------------------- config


def test_gridworld_config_overrides():
    cfg = load_config(overrides=["gridworld.algo=ppo", "gridworld.drunk=0.1", "gridworld.iterations=7"])
    assert cfg.gridworld.algo == "ppo" and cfg.gridworld.drunk == 0.1 and cfg.gridworld.iterations == 7
    with pytest.raises(ConfigError, match="gridworld.algo"):
        load_config(overrides=["gridworld.algo=dqn"])


# --------------------------------------------------------------------------- learning


def _train(tmp_path, algo: str, seed: int) -> dict:
    cfg = Config().replace(run={"seed": seed, "out_dir": str(tmp_path / f"{algo}{seed}"), "progress": False},
                           gridworld={"algo": algo})
    return train_gridworld(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("algo", ["reinforce", "ppo"])
def test_learns_the_optimal_policy(tmp_path, algo, seed):
    # default hyperparameters, 5 seeds out of 5: the greedy policy from the start is optimal
    result = _train(tmp_path, algo, seed)
    assert result["optimal_return"] == 99.0
    assert result["greedy_return"] == 99.0, f"{algo} seed {seed}:\n{result['policy']}"
    assert result["optimal"]
    assert result["returns"][-1] > 90  # the sampling policy has settled too, not just its argmax


@pytest.mark.slow
def test_train_writes_outputs(tmp_path):
    result = _train(tmp_path, "reinforce", 0)
    out = tmp_path / "reinforce0"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(result["returns"]) == Config().gridworld.iterations
    assert [r["return/mean"] for r in rows] == pytest.approx(result["returns"])
    assert (out / "policy.txt").read_text(encoding="utf-8").rstrip("\n") == result["policy"]
    assert (out / "return_curve.png").stat().st_size > 1000
    assert (out / "config.yaml").exists()


def test_cli_gridworld(tmp_path, capsys):
    from rlhfkit.cli.main import main

    assert main(["gridworld", f"run.out_dir={tmp_path}", "gridworld.iterations=3"]) == 0
    out = capsys.readouterr().out
    assert "mean return by iteration: 0:" in out and "optimum 99" in out
    assert "C" in out and "##" in out and (tmp_path / "policy.txt").exists()
    assert main(["gridworld", f"run.out_dir={tmp_path}", "gridworld.algo=dqn"]) == 2
    assert "gridworld.algo" in capsys.readouterr().err
