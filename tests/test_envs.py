"""Multi-turn environments (rlhfkit.envs.environment): the invariants of a token-in / token-out episode.

A one-turn environment is bit for bit the single-turn run; the sampler's log-probs equal the
training forward's over the turns and the observations between them; observation tokens get
exactly zero gradient; a broken environment stops the run with one line naming it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli.main import main
from rlhfkit.config import EnvConfig, PPOConfig
from rlhfkit.core import gae
from rlhfkit.data.prompts import PromptRecord, left_pad, prompt_tensors
from rlhfkit.envs.environment import (
    EnvError,
    Environment,
    EpisodeMaker,
    observation_tokens,
    play,
    render_prompt,
)
from rlhfkit.models.forward import load_policy, load_tokenizer, token_logprobs
from rlhfkit.rollout.experience import Experience
from rlhfkit.rollout.generate import Rollout, generate
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import minibatch_loss, train_rl


def length_reward(completions, **columns):
    return [float(len(c)) for c in completions]


class OneTurn(Environment):
    """The single-turn task as an environment: the reward function's score as the turn's reward."""

    def step(self, text):
        return None, float(len(text)), True


class Echo(Environment):
    """Three model turns, each answered with a fixed observation; a reward per turn."""

    max_turns, max_tokens = 3, 32  # the tiny models' context

    def step(self, text):
        return {"role": "user", "content": "x2"}, float(len(text) % 3), False


def run_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_one_turn_environment_is_bit_for_bit_the_single_turn_run(tiny_models, tiny_config, tmp_path, no_plots,
                                                                   algo):
    # the over-long penalty on (max_new_tokens 4): the episode's one turn is the response
    common = {"model": {"name": tiny_models.policy}, "ppo": {"algo": algo, "steps": 1, "overlong_buffer": 2}}
    single = tiny_config(tmp_path / "single", reward={"function": length_reward}, **common)
    episode = tiny_config(tmp_path / "env", env={"cls": OneTurn}, **common)
    train_rl(single)
    train_rl(episode)
    a, b = run_metrics(tmp_path / "single"), run_metrics(tmp_path / "env")
    skip = ("time/", "throughput/", "eval/", "baseline/", "reward/", "env/", "memory/")
    for row_a, row_b in zip(a, b, strict=True):
        keys = {k for k in row_a if not k.startswith(skip)}
        assert keys == {k for k in row_b if not k.startswith(skip)}
        assert {k: row_a[k] for k in keys} == {k: row_b[k] for k in keys}
    assert b[-1]["env/turns"] == 1 and b[-1]["env/obs_tokens"] == 0
    wa = load_file(tmp_path / "single" / "policy" / "model.safetensors")
    wb = load_file(tmp_path / "env" / "policy" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    start = load_file(f"{tiny_models.policy}/model.safetensors")
    assert any(not torch.equal(wa[k], start[k]) for k in wa)  # the step did change the weights


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_multi_turn_run_trains_on_its_turns(tiny_models, tiny_config, tmp_path, no_plots, algo):
    cfg = tiny_config(tmp_path, model={"name": tiny_models.policy}, env={"cls": Echo},
                      ppo={"algo": algo, "steps": 1}, accel={"reuse_rollout_logprobs": False})
    train_rl(cfg)
    row = run_metrics(tmp_path)[-1]
    assert row["env/turns"] == 3 and row["env/obs_tokens"] == 4  # two observations of 2 tokens each
    assert row["policy/logprob_gap"] <= 1e-5  # the training forward over the turns and observations
    assert abs(row["objective/score"] - row["env/return"]) < 1e-6  # no reward function: the return
    # the trajectory view marks the observations, out of the loss mask
    traj = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    obs = [i for i, seg in enumerate(traj["segment"]) if seg == "observation"]
    assert len(obs) == 4 and all(traj["rows"]["mask"][i] == 0 for i in obs)
    assert "x2" in traj["response"]


@pytest.fixture(scope="module")
def episodes(tiny_models):
    """Four three-turn episodes of the tiny policy on the doubling prompts, with the sampler."""
    tok = load_tokenizer(tiny_models.policy)
    policy = load_policy(tiny_models.policy).eval()
    gen = torch.Generator().manual_seed(0)

    def sample(turn, ids, mask, rows, n):
        return generate(policy, ids, mask, n, tok.eos_token_id, tok.pad_token_id, generator=gen)

    maker = EpisodeMaker(EnvConfig(cls=Echo), doubling.N_POSITIONS)
    eps = [maker(PromptRecord(doubling.prompt_text(n, None)), tok) for n in (3, 41, 7, 512)]
    return tok, policy, play(eps, sample, tok, 6, torch.device("cpu")), eps


def test_episodes_and_prompt_records_are_left_padded_alike():
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    tok = doubling.make_tokenizer()
    records = [PromptRecord("数字:1234x2=", ids=(1, 5, 6, 7)), PromptRecord("x", ids=(1, 8))]
    got = prompt_tensors(tok, records, "cpu")
    want = left_pad([[1, 5, 6, 7], [1, 8]], tok.pad_token_id, "cpu")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_an_episode_interleaves_turns_and_observations(episodes):
    tok, _, roll, eps = episodes
    obs = tok("x2", add_special_tokens=False)["input_ids"]
    for i, e in enumerate(eps):
        assert e.turns == 3 and not e.env_done  # max_turns ended it
        model = roll.response_mask[i].tolist()
        seen = roll.response_attention[i].tolist()
        ids = roll.response_ids[i].tolist()
        # two observations of exactly the observation's tokens, none after the last turn
        gaps = [ids[j] for j in range(len(ids)) if seen[j] and not model[j]]
        assert gaps == obs * 2
        # the rewards sit on the last token of each turn: three of them, on model tokens
        cols = [j for j in range(len(ids)) if model[j] and (j + 1 == len(ids) or not model[j + 1])]
        assert len(cols) == 3
        assert roll.turn_rewards[i].nonzero().flatten().tolist() == [c for c in cols if roll.turn_rewards[i, c] != 0]
        assert roll.response_attention[i].sum() == len(e.ids) - e.prompt_len


def test_sampled_logprobs_equal_the_training_forward_across_turns(episodes):
    tok, policy, roll, _ = episodes
    P = roll.prompt_ids.shape[1]
    with torch.no_grad():
        logprobs, _, _ = token_logprobs(policy, roll.input_ids, roll.attention_mask, P, roll.response_ids)
    valid = roll.response_mask.bool()
    assert int((roll.response_attention - roll.response_mask).sum()) > 0  # observations are there
    assert float((logprobs - roll.logprobs).abs()[valid].max()) <= 1e-5


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_observation_tokens_get_exactly_zero_gradient(episodes, algo):
    _, _, roll, _ = episodes
    B, R = roll.response_ids.shape
    pc = PPOConfig(algo=algo, entropy_coef=0.1)
    torch.manual_seed(0)
    leaf = {k: torch.randn(B, R, requires_grad=True) for k in ("logprobs", "entropy", "values")}

    def model(*args, **kwargs):  # the training forward's per-token outputs, as leaves
        return leaf["logprobs"], leaf["entropy"], leaf["values"] if algo == "ppo" else None

    rand = {k: torch.randn(B, R) for k in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")}
    exp = Experience(input_ids=roll.input_ids, attention_mask=roll.attention_mask, prompt_len=roll.prompt_ids.shape[1],
                     response_ids=roll.response_ids, response_mask=roll.response_mask, score=torch.zeros(B),
                     rewards=torch.zeros(B, R), **rand)
    loss, _, _ = minibatch_loss(model, exp, torch.arange(B), pc, 0.3, True)
    loss.backward()
    obs = (roll.response_attention - roll.response_mask).bool()
    assert obs.any()
    for name, t in leaf.items():
        if t.grad is None:
            continue
        assert torch.equal(t.grad[obs], torch.zeros_like(t.grad[obs])), name  # exactly zero
        assert bool((t.grad[roll.response_mask.bool()] != 0).any()), name  # the model's tokens do learn


def test_gae_skips_observation_columns():
    # a model turn, an observation (masked), a model turn: the same as the turns side by side
    r, v = torch.tensor([[0.5, 9.0, -1.0, 2.0]]), torch.tensor([[0.1, 7.0, 0.3, -0.2]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(r, v, mask, 0.9, 0.8)
    adv_c, ret_c = gae(r[:, [0, 2, 3]], v[:, [0, 2, 3]], torch.ones(1, 3), 0.9, 0.8)
    assert torch.allclose(adv[:, [0, 2, 3]], adv_c) and torch.allclose(ret[:, [0, 2, 3]], ret_c)
    assert adv[0, 1] == 0 and ret[0, 1] == 0
    # by hand: A_2 = 2 - (-0.2) = 2.2 (last), A_1 = -1 + .9 * -.2 - .3 + .72 * 2.2, A_0 via V_1 = 0.3
    a1 = -1.0 + 0.9 * -0.2 - 0.3 + 0.72 * 2.2
    assert abs(float(adv[0, 2]) - a1) < 1e-6
    assert abs(float(adv[0, 0]) - (0.5 + 0.9 * 0.3 - 0.1 + 0.72 * a1)) < 1e-6


class Silent(Environment):
    """Model turns answered with an empty observation (no token in plain text): nothing in the
    response mask separates the turns."""

    max_turns, max_tokens = 3, 32

    def step(self, text):
        return "", 0.0, False


def scripted_turns(tok, lengths: list[list[int]]):
    """``sample`` for :func:`play` whose turn ``k`` in episode ``i`` is ``lengths[k][i]`` digit tokens,
    the last an EOS."""
    digit = tok("1", add_special_tokens=False)["input_ids"][0]

    def sample(turn, ids, mask, rows, n):
        cut = [min(lengths[turn][i], n) for i in rows]
        resp = torch.tensor([[digit] * (L - 1) + [tok.eos_token_id] + [tok.pad_token_id] * (n - L) for L in cut])
        resp_mask = (torch.arange(n)[None, :] < torch.tensor(cut)[:, None]).long()  # [b, n]
        zeros = torch.zeros(len(rows), n)
        return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=resp_mask,
                       logprobs=zeros, finished=torch.ones(len(rows), dtype=torch.bool), entropy=zeros)

    return sample


@pytest.mark.parametrize("env, lengths, penalty", [
    (Echo, [2, 2], [0.0]),  # two turns of 2 <= 4 - 2 tokens: none cut, none near the limit
    (Echo, [3, 4, 1], [-2.25]),  # -1.5 * ((3 - 2) / 2 + min(1, (4 - 2) / 2) + 0) = -1.5 * 1.5
    (Silent, [2, 2, 2], [0.0]),  # turns back to back in the mask, each its own response
])
def test_the_overlong_penalty_of_an_episode_sums_its_turns_own(tiny_models, env, lengths, penalty):
    """ppo.overlong_buffer in a multi-turn episode: DAPO's penalty of each turn (a response of at most
    ppo.max_new_tokens=4; buffer 2, penalty 1.5), summed, not that of the episode's model tokens."""
    from types import SimpleNamespace

    from rlhfkit.rollout.experience import final_scores
    from rlhfkit.run.distributed import Shard

    tok = load_tokenizer(tiny_models.policy)
    maker = EpisodeMaker(EnvConfig(cls=env, max_turns=len(lengths)), doubling.N_POSITIONS)
    roll = play([maker(PromptRecord(doubling.prompt_text(12, None)), tok)], scripted_turns(tok, [[n] for n in lengths]),
                tok, 4, torch.device("cpu"))
    assert int(roll.response_mask.sum()) == sum(lengths)
    pc = PPOConfig(max_new_tokens=4, overlong_buffer=2, overlong_penalty=1.5, normalize_reward=False)
    scorer = SimpleNamespace(score=lambda roll, records: (torch.zeros(1), {}))
    _, score, _ = final_scores(scorer, roll, pc, None, Shard())
    assert score.tolist() == [p + r for p, r in zip(penalty, roll.turn_rewards.sum(-1).tolist())]


def test_the_overlong_penalty_of_a_one_turn_episode_is_the_single_turn_one(tiny_models):
    from rlhfkit.rollout.experience import overlong_scores

    tok = load_tokenizer(tiny_models.policy)
    maker = EpisodeMaker(EnvConfig(cls=OneTurn), doubling.N_POSITIONS)
    records = [PromptRecord(doubling.prompt_text(n, None)) for n in (3, 41, 7, 512)]
    roll = play([maker(r, tok) for r in records], scripted_turns(tok, [[1, 3, 5, 6]]), tok, 6, torch.device("cpu"))
    pc = PPOConfig(max_new_tokens=6, overlong_buffer=3)
    single = dataclasses.replace(roll, turn_lengths=None)  # read as a single turn's rollout
    assert roll.response_mask.sum(-1).tolist() == [1, 3, 5, 6]  # off the ramp, on it, at its end
    assert torch.equal(overlong_scores(roll, pc), overlong_scores(single, pc))
    assert torch.equal(overlong_scores(roll, pc), torch.tensor([0.0, 0.0, -2 / 3, -1.0]))  # (5 - 3) / 3


def test_an_observation_brings_the_separator_the_model_did_not_sample():
    tok = doubling.make_tokenizer()
    # a template that closes every turn with EOS and a separator '_' the model never samples
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}={% endif %}{{ m['content'] }}"
                         "{{ eos_token }}_{% endfor %}{% if add_generation_prompt %}={% endif %}")
    conv = [{"role": "user", "content": "12"}]
    ids = render_prompt(tok, conv) + tok("24", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    conv = conv + [{"role": "assistant", "content": "24"}]
    delta = observation_tokens(tok, conv, {"role": "user", "content": "3"}, ids)
    assert tok.decode(delta) == "_3E_="
    # a turn the template does not reproduce: one warning, the delta after the template's own rendering
    with pytest.warns(RuntimeWarning, match="not append-only"):
        delta = observation_tokens(tok, conv, {"role": "user", "content": "3"}, ids[:-2] + ids[-1:])
    assert tok.decode(delta) == "3E_="
    # no template: the content's own tokens
    assert observation_tokens(doubling.make_tokenizer(), conv, {"role": "user", "content": "x2"}, ids) == \
        tok("x2", add_special_tokens=False)["input_ids"]


class Raises(Environment):
    def step(self, text):
        raise KeyError("no such door")


class WrongType(Environment):
    def step(self, text):
        return "no", 1.0  # two values, not three


class BadReward(Environment):
    def step(self, text):
        return None, "lots", True


class TooLong(Environment):
    max_tokens = 100_000


class NoInit(Environment):
    def __init__(self):
        raise RuntimeError("no board")


@pytest.mark.parametrize("env, message", [
    (Raises, "environment test_envs:Raises.step raised KeyError: 'no such door'"),
    (WrongType, "environment test_envs:WrongType.step returned tuple \"('no', 1.0)\": return a tuple "
                "(observation, reward, done)"),
    (BadReward, "environment test_envs:BadReward.step returned reward='lots': give a finite number or None"),
    (TooLong, "environment test_envs:TooLong: max_tokens=100000 overflows the model's context of"),
    (NoInit, "environment test_envs:NoInit could not be made: RuntimeError: no board"),
])
def test_a_broken_environment_stops_the_run_with_one_line(tiny_models, tmp_path, capsys, monkeypatch, no_plots,
                                                          env, message):
    monkeypatch.delenv("RLHFKIT_DEBUG", raising=False)
    out = tmp_path / "run"
    args = ["grpo", f"model.name={tiny_models.policy}", f"run.out_dir={out}", "run.progress=false", "ppo.steps=2",
            "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0", "ppo.stop_at=0",
            f"env.class=test_envs:{env.__name__}", "run.checkpoint_every=1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"rlhfkit grpo: error: {message}")
    assert not any("Traceback" in line for line in err)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        json.loads(line)  # whole rows only


def test_env_config_names_the_class_by_file_and_refuses_a_non_environment(tmp_path):
    from rlhfkit.config import load_config
    from rlhfkit.envs.environment import environment_factory

    f = tmp_path / "game.py"
    f.write_text("from rlhfkit.envs.environment import Environment\n\nclass Game(Environment):\n    max_turns = 2\n\n"
                 "def not_an_env():\n    pass\n")
    cfg = load_config(None, [f"env.class={f}:Game", "env.max_turns=5"])
    assert cfg.env.cls == f"{f}:Game" and cfg.env.max_turns == 5
    assert environment_factory(cfg.env.cls)().max_turns == 2
    with pytest.raises(EnvError, match="neither an environment class nor an instance"):
        environment_factory(f"{f}:not_an_env")
    with pytest.raises(ValueError, match="env.class='nowhere:Game' cannot be loaded"):
        environment_factory("nowhere:Game")


def test_the_grid_cat_plays_the_course_notes_world_in_text():
    from rlhfkit.tasks.gridcat import GridCat, make_tokenizer

    env = GridCat()
    assert env.reset(None) == [{"role": "user", "content": "e"}]  # C: row 1, column 0
    assert env.step("→E")[1:] == (0.0, False)  # into the wall: the cat stays, no reward
    assert env.step("x")[:2] == ({"role": "user", "content": "e"}, -1.0)  # not a move: a broom's cost
    # the short way: down, down, right, right over the broom (-1), right onto the meat (+100, the end)
    steps = [env.step(move) for move in "↓↓→→→"]
    assert [r for _, r, _ in steps] == [0.0, 0.0, 0.0, -1.0, 100.0]
    assert [d for _, _, d in steps] == [False] * 4 + [True]
    assert [o["content"] for o, _, _ in steps[:4]] == list("imno")
    tok = make_tokenizer()
    assert tok.decode(tok("e↓", add_special_tokens=False)["input_ids"]) == "e↓" and len(tok) == 23


class Killed(Exception):
    pass


def test_a_multi_turn_run_stopped_mid_step_resumes_as_an_unbroken_one(tiny_models, tiny_config, tmp_path, no_plots,
                                                                      monkeypatch):
    # in-process (the subprocess route of tests/test_resume.py costs seconds of imports per run):
    # the run dies inside step 3, after its rollout; the checkpoint after step 2 is the newest
    import rlhfkit.trainers.rl as rl

    prompts = tmp_path / "prompts.jsonl"  # a few prompts: a short held-out evaluation
    prompts.write_text("".join(json.dumps({"prompt": doubling.prompt_text(n, None)}) + "\n" for n in (3, 41, 7)))

    def cfg(out, **run):
        return tiny_config(out, model={"name": tiny_models.policy}, env={"cls": Echo},
                           data={"path": str(prompts), "eval_path": str(prompts)},
                           run={"checkpoint_every": 2, "tensorboard": False, **run},
                           ppo={"algo": "grpo", "steps": 4, "eval_every": 2})

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train_rl(cfg(whole))

    def fault(name, step):
        if (name, step) == ("rollout", 3):
            raise Killed

    monkeypatch.setattr(rl, "fault_point", fault)
    with pytest.raises(Killed):
        train_rl(cfg(broken))
    monkeypatch.undo()
    train_rl(cfg(broken, resume=True))
    skip = ("time/", "throughput/")
    a, b = ([{k: v for k, v in r.items() if not k.startswith(skip)} for r in run_metrics(d)] for d in (whole, broken))
    assert [r["step"] for r in b] == [0, 1, 2, 3] and a == b and a[-1]["env/turns"] > 1 and "eval/reward" in a[-1]
    wa, wb = (load_file(d / "policy" / "model.safetensors") for d in (whole, broken))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
