"""Tests for rlhfkit.tasks.cities: tokenizer, held-out split, generators, verifier."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhfkit.tasks import cities, get_task
from rlhfkit.tasks.cities import (
    COUNTRY_OF,
    EOS,
    HELD_OUT_FORM,
    TUNING_PROMPTS,
    CitiesData,
    Prompt,
    answer_text,
    eval_prompts,
    make_tokenizer,
    parse_prompt,
    verify,
)


def test_registry_and_interface():
    assert get_task("cities") is cities
    for name in ("make_tokenizer", "TaskData", "eval_prompts", "held_out_pairs", "verify", "exact_reward",
                 "MAX_NEW_TOKENS", "N_POSITIONS"):
        assert hasattr(cities, name), name
    with pytest.raises(ValueError, match="unknown task 'towns'.*doubling, cities"):
        get_task("towns")


def test_tokenizer_round_trip_and_lengths():
    tok = make_tokenizer()
    text = "Where is Pune? Pune is in India." + EOS
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(text)
    assert tok.decode(ids) == "^" + text
    assert tok.decode(ids, skip_special_tokens=True) == text[:-1]
    longest_answer = max(len(answer_text(c)) for c in COUNTRY_OF)
    assert longest_answer <= cities.MAX_NEW_TOKENS
    longest = max(len(tok(p.text + answer_text(p.city))["input_ids"]) for p in eval_prompts())
    assert longest <= cities.N_POSITIONS


def test_held_out_prompts_never_appear_in_tuning_data():
    held = {(p.city, p.template) for p in eval_prompts()}
    assert len(held) == len(COUNTRY_OF) == 130 and not held & set(TUNING_PROMPTS)
    assert len(TUNING_PROMPTS) == 2 * len(COUNTRY_OF)
    assert {t for t in HELD_OUT_FORM.values()} == {0, 1, 2}  # every question form is held out somewhere
    data = CitiesData(0)
    assert all((p.city, p.template) not in held for p in data.prompts(2000))
    assert all((parse_prompt(p).city, parse_prompt(p).template) not in held
               for p, _chosen, _rejected in data.preference_pairs(2000))
    assert all((parse_prompt(p).city, parse_prompt(p).template) not in held for p, _ in data.sft_examples(500))


def test_pretraining_answers_are_mostly_terse():
    texts = CitiesData(1).pretrain_texts(6000)
    qa = [t for t in texts if "?" in t]
    styles = Counter()
    for t in qa:
        q, a = t.split("? ", 1)
        city = parse_prompt(q + "? ").city
        if a == f"{COUNTRY_OF[city]}.{EOS}":
            styles["terse"] += 1
        elif a == answer_text(city):
            styles["sentence"] += 1
        elif a.startswith("It is in"):
            styles["pronoun"] += 1
        else:
            assert a.startswith(f"{city} is in ") and a != answer_text(city), a
            styles["wrong"] += 1
    total = sum(styles.values())
    assert abs(len(qa) / len(texts) - 0.65) < 0.03
    # the terse style dominates so the base greedily answers in the wrong form
    assert styles["terse"] / total == pytest.approx(0.40, abs=0.03)
    assert styles["sentence"] / total == pytest.approx(0.30, abs=0.03)


def test_preference_pairs_prefer_the_right_sentence():
    pairs = CitiesData(2).preference_pairs(3000, hard=0.5)
    wrong_country = 0
    for prompt, chosen, rejected in pairs:
        p = parse_prompt(prompt)
        assert verify(p, chosen)["exact"] and not verify(p, rejected)["exact"] and chosen != rejected
        wrong_country += verify(p, rejected)["format"]  # a well-formed sentence, wrong country
    assert wrong_country / len(pairs) == pytest.approx(0.5, abs=0.04)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Pune is in India.$", (True, True, True)),
        ("Pune is in India.$~~", (True, True, True)),  # after EOS nothing counts
        ("Pune is in Japan.$", (True, False, False)),
        ("India.$", (False, False, True)),
        ("It is in India.$", (False, False, True)),
        ("Pune is in India.", (False, False, False)),  # no EOS
        ("Delhi is in India.$", (False, False, True)),  # another city
        ("Pune is in Indai.$", (False, False, False)),  # not a country of this world
        ("Pune is in India. Pune is in India.$", (False, False, True)),
        ("$", (False, False, False)),
    ],
)
def test_verify(completion, expected):
    v = verify(Prompt("Pune", 0), completion)
    assert (v["format"], v["exact"], v["answer"]) == expected


def test_parse_prompt_inverts_every_template():
    for t in range(len(cities.QUESTIONS)):
        assert parse_prompt("^" + Prompt("Guadalajara", t).text) == Prompt("Guadalajara", t)
    with pytest.raises(ValueError, match="not a city question"):
        parse_prompt("Where is Atlantis? ")


def test_exact_reward_callable():
    prompts = [Prompt("Kyoto").text, Prompt("Kyoto").text]
    assert cities.exact_reward(prompts, ["Kyoto is in Japan.$", "Japan.$"]) == [1.0, 0.0]


@pytest.mark.slow
def test_cities_demo_pipeline_runs_every_algorithm(tmp_path, capsys):
    # plumbing only (tiny budgets): the command applies the task's defaults, every algorithm
    # starts from the same base, and the summary pairs base and tuned answers per prompt.
    # Learning is measured by rlhfkit demo run.task=cities (benchmarks/README-0.1.0-measurements.md).
    from rlhfkit.cli.main import main

    out = tmp_path / "cities"
    assert main(["demo", "run.task=cities", f"run.out_dir={out}", "run.progress=false", "model.n_layer=1",
                 "model.n_embd=32", "pretrain.steps=20", "reward.steps=5", "ppo.steps=2", "ppo.critic_warmup_steps=1",
                 "ppo.batch_size=16", "ppo.minibatch_size=16", "ppo.group_size=4", "dpo.steps=2", "dpo.num_pairs=64",
                 "eval.batch_size=130"]) == 0
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "cities" and set(summary["algos"]) == {"ppo", "grpo", "dpo"}
    assert all(summary["algos"][a]["steps"] == 2 for a in ("ppo", "grpo", "dpo"))
    cfg_text = (out / "pretrain" / "config.yaml").read_text()
    assert "task: cities" in cfg_text and "n_embd: 32" in cfg_text and "lr: 0.0001" in (out / "config.yaml").read_text()
    held = [p.text for p in eval_prompts()]
    assert [ex["prompt"] for ex in summary["examples"]] == held[: len(summary["examples"])]
    for ex in summary["examples"]:
        assert {"base", "ppo", "grpo", "dpo", "ppo_exact"} <= set(ex)
    for sub in ("pretrain/policy", "reward/reward_model", "policy", "grpo/policy", "dpo/policy"):
        assert (out / sub / "model.safetensors").exists(), sub
    assert "after grpo" in capsys.readouterr().out
