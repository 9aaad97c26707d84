"""``rlhfkit eval`` on the user's prompt file: completions scored by the user's rewards, written one
line per prompt, and the win rate against a baseline policy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import TINY_ARCH
from rlhfkit.cli.main import main
from rlhfkit.core import kl_from_logits
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.rollout.evaluate import completion_kl, win_rate
from rlhfkit.rollout.generate import Rollout
from rlhfkit.tasks import doubling
from rlhfkit.utils import read_jsonl

N_PROMPTS = 12
REWARDS = "rlhfkit.tasks.doubling:exact_reward,test_eval_files:length_reward,test_eval_files:finished_reward"


def length_reward(prompts, completions, **columns) -> list[float]:
    """Characters of the completion: a reward that differs between random policies."""
    return [float(len(c)) for c in completions]


def finished_reward(prompts, completions, finished, **columns) -> list[float]:
    return [1.0 if f else 0.0 for f in finished]


finished_reward.binary = True  # declared 0/1, like the task's exact_reward


FUNCTIONS = {"exact_reward": doubling.exact_reward, "length_reward": length_reward,
             "finished_reward": finished_reward}


@pytest.fixture
def held(tmp_path) -> str:
    path = tmp_path / "held.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for p in doubling.eval_prompts()[:N_PROMPTS]:
            f.write(json.dumps({"prompt": p.text, **doubling.columns(p)}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> str:
    """A run directory whose policy/ is a differently initialised tiny policy."""
    run = tmp_path_factory.mktemp("other_run")
    tok = doubling.make_tokenizer()
    build_tiny_policy(tok, 5, **TINY_ARCH).save_pretrained(run / "policy")
    tok.save_pretrained(run / "policy")
    return str(run)


def run_eval(model: str, out, *overrides: str) -> tuple[int, dict, list[dict]]:
    code = main(["eval", model, f"run.out_dir={out}", "run.device=cpu", "eval.max_new_tokens=6", *overrides])
    if code != 0:
        return code, {}, []
    return code, json.loads((out / "eval.json").read_text(encoding="utf-8")), read_jsonl(out / "eval_samples.jsonl")


def test_one_scored_line_per_prompt(tiny_models, held, tmp_path, capsys):
    code, result, rows = run_eval(tiny_models.policy, tmp_path / "ev", f"data.path={held}",
                                  f"reward.function={REWARDS}", "reward.weights=1,0.5,2")
    assert code == 0
    summary = capsys.readouterr().out
    assert f"{N_PROMPTS} prompts of {held}" in summary and "reward" in summary
    assert len(rows) == N_PROMPTS
    prompts = [p.text for p in doubling.eval_prompts()[:N_PROMPTS]]
    assert [r["prompt"] for r in rows] == prompts
    # the scores are the functions themselves applied to the written completions
    kwargs = {"prompts": prompts, "completions": [r["completion"] for r in rows],
              "finished": [r["finished"] for r in rows],
              "number": [r["columns"]["number"] for r in rows], "charset": [r["columns"]["charset"] for r in rows]}
    for name, fn in FUNCTIONS.items():
        assert [r["scores"][name] for r in rows] == pytest.approx(fn(**kwargs))
    for r in rows:
        s = r["scores"]
        assert r["reward"] == pytest.approx(s["exact_reward"] + 0.5 * s["length_reward"] + 2 * s["finished_reward"])
        assert "baseline_completion" not in r
    assert result["prompts"] == N_PROMPTS and result["path"] == tiny_models.policy
    assert result["eval/reward"] == pytest.approx(sum(r["reward"] for r in rows) / N_PROMPTS)
    for name in FUNCTIONS:
        assert result[f"eval/reward/{name}"] == pytest.approx(sum(r["scores"][name] for r in rows) / N_PROMPTS)
    # two declared 0/1 rewards (exact, finished): accuracy is the share that both score 1
    want = sum(r["scores"]["exact_reward"] == 1 and r["finished"] for r in rows) / N_PROMPTS
    assert result["eval/accuracy"] == pytest.approx(want)
    assert "数字" in (tmp_path / "ev" / "eval_samples.jsonl").read_text(encoding="utf-8")  # not \\u escapes


def test_a_model_against_itself_wins_half(tiny_models, held, tmp_path):
    """A reward model and a function, a run's own policy as baseline: same completions, same scores."""
    code, result, rows = run_eval(tiny_models.policy, tmp_path / "ev", f"data.path={held}",
                                  f"reward.name={tiny_models.reward}", "reward.function=test_eval_files:length_reward",
                                  f"eval.baseline={tiny_models.policy}")
    assert code == 0
    assert result["win_rate"] == 0.5
    assert result["win_rates"] == {"reward_model": 0.5, "length_reward": 0.5}
    assert result["kl_to_baseline"] == pytest.approx(0.0, abs=1e-6)  # the same weights
    assert result["baseline"]["eval/reward"] == result["eval/reward"]
    assert result["baseline"]["path"] == tiny_models.policy
    for r in rows:
        assert r["baseline_completion"] == r["completion"] and r["baseline_reward"] == r["reward"]
        assert set(r["baseline_scores"]) == {"reward_model", "length_reward"}


def test_win_rate_against_another_model_is_the_hand_count(tiny_models, held, other_run, tmp_path):
    code, result, rows = run_eval(tiny_models.policy, tmp_path / "ev", f"data.path={held}",
                                  "reward.function=test_eval_files:length_reward", f"eval.baseline={other_run}")
    assert code == 0
    assert result["baseline"]["path"].endswith("policy")  # the run directory's policy/
    assert any(r["completion"] != r["baseline_completion"] for r in rows)
    wins = sum(1.0 if r["reward"] > r["baseline_reward"] else 0.5 if r["reward"] == r["baseline_reward"] else 0.0
               for r in rows)
    assert result["win_rate"] == pytest.approx(wins / N_PROMPTS)
    assert result["win_rates"] == {"length_reward": pytest.approx(wins / N_PROMPTS)}  # the only source
    assert result["kl_to_baseline"] > 0.01  # two random policies
    assert result["kl_to_baseline"] == pytest.approx(sum(r["kl_to_baseline"] for r in rows) / N_PROMPTS)
    assert [r["baseline_scores"]["length_reward"] for r in rows] == [float(len(r["baseline_completion"])) for r in rows]
    assert result["baseline"]["eval/reward"] == pytest.approx(sum(r["baseline_reward"] for r in rows) / N_PROMPTS)


def test_kl_from_logits_is_the_hand_computed_kl():
    # p = (1/4, 3/4), q = (1/2, 1/2): KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812...
    p, q = torch.log(torch.tensor([1.0, 3.0])), torch.zeros(2)
    assert float(kl_from_logits(p, q)) == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-6)
    assert float(kl_from_logits(p + 7.0, q - 2.0)) == pytest.approx(0.1308121, rel=1e-5)  # logits' shifts cancel
    a, b = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)).unbind(0)[:2]
    want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=a),
                                             torch.distributions.Categorical(logits=b))
    assert torch.allclose(kl_from_logits(a, b), want, atol=1e-6)
    assert torch.allclose(kl_from_logits(a, a), torch.zeros(4), atol=1e-6)


def test_completion_kl_is_the_sum_over_each_unpadded_completion(tiny_models, other_run):
    """Left-padded prompts and right-padded completions give, row by row, the per-token KLs of a plain
    forward over that row alone, summed over its completion's tokens."""
    from transformers import AutoModelForCausalLM

    pol = AutoModelForCausalLM.from_pretrained(tiny_models.policy).eval()
    ref = AutoModelForCausalLM.from_pretrained(other_run + "/policy").eval()
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 20, (3, 5), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    response_ids = torch.randint(3, 20, (3, 4), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    roll = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(3, 4), torch.ones(3, dtype=torch.bool))
    got = completion_kl(pol, ref, roll)
    for i in range(3):
        ids = torch.cat([prompt_ids[i][prompt_mask[i].bool()], response_ids[i][response_mask[i].bool()]])[None]
        n, P = int(response_mask[i].sum()), int(prompt_mask[i].sum())
        with torch.no_grad():
            lp, lq = (m(ids).logits[0, P - 1 : P - 1 + n].log_softmax(-1) for m in (pol, ref))  # [n, V]
        assert float(got[i]) == pytest.approx(float((lp.exp() * (lp - lq)).sum()), rel=1e-4, abs=1e-6)
    assert torch.allclose(completion_kl(pol, pol, roll), torch.zeros(3), atol=1e-6)


def test_win_rate_counts_ties_half():
    assert win_rate(torch.tensor([1.0, 2.0, 3.0, 0.0]), torch.tensor([0.0, 2.0, 4.0, 0.0])) == 0.5
    assert win_rate(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.75


@pytest.mark.parametrize("overrides, needles", [
    (["data.path={tmp}/missing.jsonl", "reward.function=test_eval_files:length_reward"],
     ["missing.jsonl", "cannot read this data file"]),
    (["data.path={held}"], ["reward.function", "reward.name"]),
    (["data.path={held}", "reward.function=test_eval_files:length_reward", "eval.max_new_tokens=null"],
     ["eval.max_new_tokens", "ppo.max_new_tokens"]),
    (["eval.baseline={policy}"], ["eval.baseline", "data.path"]),
])
def test_bad_input_is_one_line_and_exit_2(overrides, needles, tiny_models, held, tmp_path, capsys):
    argv = ["eval", tiny_models.policy, f"run.out_dir={tmp_path / 'ev'}", "eval.max_new_tokens=6",
            *(o.format(tmp=tmp_path, held=held, policy=tiny_models.policy) for o in overrides)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhfkit eval: error: "), err
    for needle in needles:
        assert needle in lines[0]
    assert not (tmp_path / "ev" / "eval.json").exists()
