"""The calculator task of examples/real_model/calculator: the tool reads two numbers and one
operator and nothing else (no code is evaluated), the environment scores the final number and
rewards a call that ran, and the data hold out questions the training and demonstrations lack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_helpers import import_example
from rlhfkit.data.prompts import PromptRecord

EXAMPLE = Path(__file__).parents[1] / "examples" / "real_model" / "calculator"


def _example(name: str):
    return import_example(EXAMPLE, name)


calc = _example("calculator")


@pytest.mark.parametrize("expression, result", [
    ("347 * 29", "10063"), ("347*29", "10063"), ("347 x 29", "10063"), ("1,000 + 24", "1024"),
    ("7 - 12", "-5"), ("-3 * -4", "12"), ("10 / 4", "2.5"), ("84 / 12", "7"), ("0.5 * 3 =", "1.5"),
])
def test_the_calculator_computes_one_operation(expression, result):
    assert calc.calculator(expression) == result


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "2 ** 100", "1 + 2 + 3", "(3 * 4)", "347 * abc", "", "5 / 0",
])
def test_the_calculator_refuses_anything_but_two_numbers_and_one_operator(expression):
    with pytest.raises((ValueError, ZeroDivisionError)):
        calc.calculator(expression)


def _env(answer: str):
    env = calc.CalculatorEnv()
    env.reset(PromptRecord(text="", columns={"answer": answer},
                           prompt=[{"role": "user", "content": "What is 347 * 29?"}]))
    return env


def test_the_environment_shapes_a_call_that_ran_and_scores_the_number_alone():
    env = _env("10063")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call>'
    assert env.step(call) == ({"role": "tool", "name": "calculator", "content": "10063"}, 0.2, False)
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 ** 29"}}</tool_call>'
    obs, reward, done = env.step(bad)
    assert (reward, done) == (0.0, False) and obs["content"].startswith("ValueError")
    assert env.step("10063") == (None, 1.0, True)
    assert env.step("10,063.") == (None, 1.0, True)
    assert env.step("The answer is 10063") == (None, 0.0, True)
    assert env.step("10064") == (None, 0.0, True)


def test_the_held_out_questions_are_neither_trained_on_nor_demonstrated(tmp_path):
    _example("make_data").main(tmp_path, sft=8)
    rows = {n: [json.loads(x) for x in (tmp_path / n).read_text().splitlines()]
            for n in ("prompts.jsonl", "held.jsonl", "held_no_tool.jsonl", "sft.jsonl")}
    ask = {n: {r["prompt"][0]["content"] for r in rows[n]} for n in ("prompts.jsonl", "held.jsonl")}
    demos = {r["messages"][1]["content"] for r in rows["sft.jsonl"]}
    assert (len(ask["prompts.jsonl"]), len(ask["held.jsonl"]), len(rows["sft.jsonl"])) == (128, 32, 16)
    assert not ask["held.jsonl"] & (ask["prompts.jsonl"] | demos) and demos <= ask["prompts.jsonl"]
    for r in rows["held.jsonl"] + rows["held_no_tool.jsonl"]:  # the answer column is the product
        a, b = r["prompt"][0]["content"].split("What is ")[1].split("?")[0].split(" * ")
        assert r["answer"] == str(int(a) * int(b))
    final = [r["messages"] for r in rows["sft.jsonl"] if len(r["messages"]) == 5]
    assert all(m[3]["content"] == m[4]["content"] for m in final) and len(final) == 8
