"""The files of the real-model pipeline (examples/real_model/make_pipeline_data.py): what each
stage learns from, checked against the task's facts and the verifier, and read by rlhfkit's
loaders with the real model's chat template (its tokenizer only: fast)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hf_helpers import import_example
from rlhfkit.cli import fetch
from rlhfkit.data import load_preferences, load_prompts, load_sft
from rlhfkit.models.forward import load_tokenizer
from rlhfkit.tasks.cities import COUNTRY_OF

EXAMPLE = Path(__file__).parents[1] / "examples" / "real_model"


def _example(name: str):
    return import_example(EXAMPLE, name)


@pytest.fixture(scope="module")
def tokenizer():
    try:
        path = fetch.fetch_model("smollm2-135m-instruct")["dir"]
    except fetch.FetchError as e:
        msg = f"smollm2-135m-instruct cannot be fetched ({e}) -- the pipeline's files NOT read with its template"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return load_tokenizer(str(path))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _city(row: dict) -> str:
    return row["prompt"][-1]["content"].split("city of ")[1].split("?")[0]


def test_the_pipeline_files_teach_the_right_country_and_hold_out_the_grpo_examples_cities(tmp_path, tokenizer):
    make, make_grpo, rewards = _example("make_pipeline_data"), _example("make_data"), _example("rewards")
    make.main(tmp_path / "p", 20)
    make_grpo.main(tmp_path / "g")
    d = tmp_path / "p"
    sft, prefs, prefs_eval = _rows(d / "sft.jsonl"), _rows(d / "prefs.jsonl"), _rows(d / "prefs_eval.jsonl")
    held = {_city(r) for r in _rows(d / "held.jsonl")}
    assert held == {_city(r) for r in _rows(tmp_path / "g" / "held.jsonl")}  # the GRPO example's 32
    train = {_city(r) for r in _rows(d / "prompts.jsonl")}
    assert len(held) == 32 and len(train) == 98 and not held & train
    assert {_city(r) for r in sft} <= train and len(sft) == 20
    assert {_city(r) for r in prefs} == train and {_city(r) for r in prefs_eval} == held
    assert all(r["completion"][0]["content"] == COUNTRY_OF[_city(r)] for r in sft)
    # the verifier scores every chosen answer 1 and every rejected one 0; half the rejected answers
    # keep the right country in a sentence (the base's form), the other half name a wrong one
    for rows in (prefs, prefs_eval):
        answers = [COUNTRY_OF[_city(r)] for r in rows]
        chosen, rejected = [r["chosen"] for r in rows], [r["rejected"] for r in rows]
        assert rewards.exact(chosen, answers) == [1.0] * len(rows)
        assert rewards.exact(rejected, answers) == [0.0] * len(rows)
        assert rewards.contains(rejected, answers)[0::2] == [1.0] * (len(rows) // 2)
        assert rewards.contains(rejected, answers)[1::2] == [0.0] * (len(rows) // 2)
    # rlhfkit reads every file in TRL's conversational formats through the model's chat template
    assert len(load_sft(str(d / "sft.jsonl"), tokenizer)) == 20
    pairs = load_preferences(str(d / "prefs.jsonl"), tokenizer)
    assert len(pairs) == 196 and "<|im_start|>assistant\n" in pairs[0].prompt
    assert len(load_prompts(str(d / "held.jsonl"), tokenizer)) == 32
