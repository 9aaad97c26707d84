"""A real pretrained chat model learns (``make test-real``; not part of ``make test``).

GRPO with LoRA on SmolLM2-135M-Instruct (``rlhfkit fetch-model``) for the city-country task of
``examples/real_model`` ("In which country is the city of Jaipur? Answer with the country's name
only.", 98 training and 32 held-out cities). The base answers in whole sentences: held-out greedy
exact 0.00, the right country somewhere in the answer 0.53. With the command's defaults for a
LoRA policy (config.LORA_DEFAULTS: no KL term; 16 completions a step, the three weighted rewards
of the example), within 60 steps held-out exact must go from 0 to 0.5 or more (the run stops
there: ppo.stop_at, evaluated every 5 steps) while the share of answers naming the right country
does not fall below the base's -- the format learned, the facts kept. A few minutes on one core
(the first steps' sentences are slow, one-word answers fast).

The budget: ``benchmarks/real_model.py`` measured 30, 15 and 55 steps to 0.5 on seeds 0-2, and
this one run can land anywhere in that range: on a 2-core Zen 5 AMD EPYC the same code gave
0.00 after 40 steps under ``make test-real`` and 0.84 alone (why the two runs differ is not
known), so 40 steps was a coin flip there; 60 covers the slowest seed measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rlhfkit.cli import fetch
from rlhfkit.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.real]
EXAMPLE = Path(__file__).parents[1] / "examples" / "real_model"
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def model_dir() -> str:
    try:
        return str(fetch.fetch_model("smollm2-135m-instruct")["dir"])
    except fetch.FetchError as e:
        msg = f"smollm2-135m-instruct cannot be fetched ({e}) -- the real-model learning test NOT run"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def test_grpo_with_lora_teaches_the_real_model_the_format_and_keeps_the_facts(model_dir, tmp_path, monkeypatch):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import make_data
    finally:
        sys.path.remove(str(EXAMPLE))
    make_data.main(tmp_path / "data")
    rewards = EXAMPLE / "rewards.py"
    args = ["grpo", f"model.name={model_dir}", "model.lora_r=16",
            f"data.path={tmp_path / 'data' / 'prompts.jsonl'}", f"data.eval_path={tmp_path / 'data' / 'held.jsonl'}",
            f"reward.function={rewards}:exact,{rewards}:contains,{rewards}:brevity", "reward.weights=1,1,1",
            "ppo.batch_size=16", "ppo.max_new_tokens=16", "ppo.steps=60", "ppo.eval_every=5", "ppo.stop_at=0.5",
            "accel.threads=1", "run.progress=false",
            f"run.out_dir={tmp_path / 'run'}"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    base, last = rows[0], rows[-1]
    exact = [round(r["eval/reward/exact"], 2) for r in rows if "eval/reward/exact" in r]
    print(f"\nheld-out exact: base {base['baseline/eval/reward/exact']:.2f}, at evaluations {exact}; contains: base "
          f"{base['baseline/eval/reward/contains']:.2f}, last {last['eval/reward/contains']:.2f}", file=sys.stderr)
    assert base["baseline/eval/reward/exact"] == 0.0 and base["objective/kl_coef"] == 0.0  # the LoRA default
    assert last["eval/accuracy"] == last["eval/reward/exact"] >= 0.5  # exact is declared 0/1
    assert last["eval/reward/contains"] >= base["baseline/eval/reward/contains"]
    # the held-out metric rose, answers turned into one word far from the chatty base: no guard may cry wolf
    flagged = sorted({k for r in rows for k, v in r.items() if k.startswith("guard/") and v})
    assert not flagged, f"guards flagged on a run whose held-out exact rose: {flagged}"


@pytest.mark.parametrize("scenario", ["sft", "dpo"])
def test_the_commands_defaults_keep_a_pretrained_models_general_answers(model_dir, tmp_path, scenario):
    """benchmarks/pretrained_defaults.py's scenarios with the command's defaults: 10 steps of SFT on
    24 chat records answered with one word, or 10 steps of DPO on 8 pairs preferring a one-word
    answer. Afterwards the model still names Paris as the capital of France and writes a sentence
    when asked for one (at the toy rates it answered "Blue" and "Red", or nothing)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import pretrained_defaults as scenarios
    finally:
        sys.path.remove(str(BENCHMARKS))
    data = scenarios.write_data(tmp_path / "data")
    assert main(scenarios.scenario_args(scenario, model_dir, data, tmp_path / scenario)) == 0
    capital, sea = scenarios.greedy_answers(tmp_path / scenario / "policy", scenarios.PROMPTS[:2])
    print(f"\n{scenario}: {capital!r} / {sea!r}", file=sys.stderr)
    assert "Paris" in capital
    assert len(sea.split()) >= 5
