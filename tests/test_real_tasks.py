"""The real-model task suite of ``benchmarks/real_tasks.py`` and the matrix's bookkeeping
(``benchmarks/real_matrix.py``): deterministic generators, disjoint splits, verifiers and shaping
terms on hand-written answers, the gamed-run and steps-to-target rules on hand-made series."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import real_matrix  # noqa: E402
import real_tasks as rt  # noqa: E402
from rlhfkit.data.prompts import PromptRecord  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(rt.TASKS))
def test_generator_is_deterministic_and_splits_are_disjoint(name, tmp_path):
    task = rt.TASKS[name]
    a, b = rt.write(tmp_path / "a", task), rt.write(tmp_path / "b", task)
    for split in ("train", "held"):
        assert Path(a[split]).read_bytes() == Path(b[split]).read_bytes()
    train, held = task.records()
    assert len(held) >= 30 and len(train) >= 50
    assert not {r["key"] for r in train} & {r["key"] for r in held}  # no held-out item is trained on
    if name != "guess":  # a guessing game's prompt hides its secret: its key tells the episodes apart
        assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held}
    asks = {r["prompt"][0]["content"].split(" ")[0] for r in held}
    assert len(asks) >= 2  # several phrasings in the held-out split


def score(fn, texts, **columns):
    return fn([[{"role": "assistant", "content": t}] for t in texts], **columns)


def test_capital_verifier_and_brevity():
    texts = ["Amman.", "amman", "The capital of Jordan is Amman.", "Jordan."]
    assert score(rt.capital_exact, texts, answer=["Amman"] * 4) == [1, 1, 0, 0]
    assert score(rt.brevity, texts) == [1, 1, 1 / 6, 1]  # the non-answer "Jordan." scores as "Amman." does
    assert score(rt.knows, texts, answer=["Amman"] * 4) == [1, 1, 1, 0]


def test_number_verifier_and_shaping():
    texts = ["42", "42.", "6 * 7 = 42", "41"]
    assert score(rt.number_exact, texts, answer=["42"] * 4) == [1, 1, 0, 0]
    assert score(rt.has_number, texts + ["forty-two"]) == [1, 1, 1, 1, 0]


def test_yesno_verifier_and_shaping():
    texts = ["Yes.", "No", "Yes, Rabat is the capital.", "No."]
    assert score(rt.yesno_exact, texts, answer=["yes", "yes", "yes", "yes"]) == [1, 0, 0, 0]
    assert score(rt.one_word, texts) == [1, 1, 0, 1]  # a wrong "No." earns the shaping term


def test_listing_verifier_and_shaping():
    texts = ["apple, banana, cherries", "Apple, apple, banana", "red, blue, green", "apple, banana",
             "Here are three fruits: apple, banana, pear"]
    n, cat = [3] * 5, ["fruits"] * 5
    assert score(rt.listing_exact, texts, category=cat, n=n) == [1, 0, 0, 0, 0]
    assert score(rt.listing_count, texts, n=n) == [1, 1, 1, 0, 1]  # three items of anything


def test_sentence_verifier_and_shaping():
    texts = ["The river flows.", "Rivers run.", "The river flows past the old mill by the town.",
             "Rain falls. The river rises.", "The sea is calm."]
    cols = {"word": ["river"] * 5, "limit": [8] * 5}
    assert score(rt.sentence_exact, texts, **cols) == [1, 1, 0, 0, 0]
    assert score(rt.sentence_word, texts, **cols) == [1, 1, 1, 1, 0]


def play(env_cls, columns, turns):
    env = env_cls()
    env.reset(PromptRecord(text="", columns=columns, prompt=[{"role": "user", "content": "?"}]))
    return [env.step(t) for t in turns]


def test_guess_env_feedback_and_held_out_shaping():
    out = play(rt.GuessEnv, {"secret": 7, "hi": 10, "held": False}, ["5", "I pick 9", "7"])
    assert [o[0] for o in out] == ["Higher.", "Lower.", None]
    assert [o[1] for o in out] == pytest.approx([0.1, 0.0, 1.1])  # 0.1 per bare in-range guess
    assert out[-1][2] is True
    rt.HELD_SHAPING.clear()
    out = play(rt.GuessEnv, {"secret": 7, "hi": 10, "held": True}, ["5", "7"])
    assert [o[1] for o in out] == [0.0, 1.0]  # a held-out episode scores the target alone
    assert rt.HELD_SHAPING == pytest.approx([0.2])


def test_calculator_env_shaping_on_a_call_and_target_at_the_end():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call>'
    rt.HELD_SHAPING.clear()
    train = play(rt.CalcEnv, {"answer": "10063", "held": False}, [call, "10063"])
    assert train[0][0]["content"] == "10063" and train[0][1] == pytest.approx(0.2)
    assert train[1][1:] == (1.0, True)
    held = play(rt.CalcEnv, {"answer": "10063", "held": True}, [call, "10062"])
    assert [h[1] for h in held] == [0.0, 0.0] and rt.HELD_SHAPING == pytest.approx([0.2])


def test_gamed_when_target_falls_while_shaping_rises():
    assert real_matrix.gamed([0.1, 0.5, 0.3], [0.2, 0.3, 0.6])  # fell 0.2 from its best, shaping up 0.3
    assert not real_matrix.gamed([0.1, 0.5, 0.3], [0.2, 0.6, 0.6])  # the shaping term did not rise
    assert not real_matrix.gamed([0.1, 0.5, 0.45], [0.2, 0.3, 0.9])  # the target held
    assert real_matrix.gamed([0.3, 0.1], [0.2, 0.5])  # never above the base, and fell


def test_steps_to_target_is_the_first_evaluation_after_training():
    evals = [{"step": 0, "target": 0.9}, {"step": 5, "target": 0.2}, {"step": 10, "target": 0.5},
             {"step": 15, "target": 0.7}]
    assert real_matrix.steps_to_target(evals, 0.5) == 10
    assert real_matrix.steps_to_target(evals, 0.8) is None


def test_report_counts_a_task_passed_on_two_seeds_of_three_ungamed(tmp_path, capsys):
    import argparse
    import json

    args = argparse.Namespace(results=str(tmp_path / "r.jsonl"), steps=60, eval_every=5, seeds=[0, 1, 2],
                              tasks=["capital"], contenders=["rlhfkit_grpo", "rlhfkit_ppo", "rlhfkit_rloo"],
                              every_seed=False, override=[])
    runs = {"rlhfkit_grpo": [(10, False), (None, False), (20, False)],  # 2 of 3: passed
            "rlhfkit_ppo": [(10, True), (15, False), (None, False)],  # one reached by gaming: 1 of 3
            "rlhfkit_rloo": [(30, False)]}  # its one seed
    with open(args.results, "w") as f:
        for c, seeds in runs.items():
            for seed, (steps, was_gamed) in enumerate(seeds):
                f.write(json.dumps({"contender": c, "task": "capital", "seed": seed, "steps_max": 60, "eval_every": 5,
                                    "target": rt.TASKS["capital"].target, "overrides": [],
                                    "steps_to_target": steps, "gamed": was_gamed}) + "\n")
    real_matrix.report(args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[3:] == ["10/-/20", "10g/15/-", "30"]
    assert lines[3].split() == ["passed", "1", "0", "1"]
