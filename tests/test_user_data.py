"""The RL commands on the user's own prompt files: every format, every column reaching the
reward functions (aligned through groups), several weighted rewards, held-out evaluation by
the rewards, generic early stopping, passes over the prompt set."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, DatasetDict

from rlhfkit.data import DataError, PromptExample, encode_prompts, hold_out, load_prompts, load_records
from rlhfkit.data.prompts import FilePrompts, PromptRecord, file_records
from rlhfkit.models.forward import load_policy
from rlhfkit.rollout.evaluate import evaluate_rewards
from rlhfkit.rollout.generate import generate
from rlhfkit.rollout.rewards import Reward, RewardError, function_scorer
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import train_rl
from rlhfkit.utils import read_jsonl
from test_data import TOK, user

RECORDS = [{"prompt": f"double {n}", "answer": f"a{2 * n}", "level": n % 3} for n in range(1, 6)]


def write_formats(tmp_path, records) -> dict[str, str]:
    """The same records as JSONL, a JSON array, Parquet, CSV and a save_to_disk directory."""
    ds = Dataset.from_list(records)
    paths = {"jsonl": tmp_path / "p.jsonl", "json": tmp_path / "p.json", "parquet": tmp_path / "p.parquet",
             "csv": tmp_path / "p.csv", "disk": tmp_path / "p_disk"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    paths["json"].write_text(json.dumps(records))
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.save_to_disk(str(paths["disk"]))
    return {k: str(v) for k, v in paths.items()}


def test_every_prompt_file_format_gives_the_same_records(tmp_path):
    paths = write_formats(tmp_path, RECORDS)
    want = [(r["prompt"], {"answer": r["answer"], "level": r["level"]}) for r in RECORDS]
    for kind, path in paths.items():
        got = [(e.prompt, e.meta) for e in load_prompts(path, TOK)]
        # CSV has no types: its cells are strings (docs/data.md)
        assert got == ([(p, {"answer": m["answer"], "level": str(m["level"])}) for p, m in want] if kind == "csv"
                       else want), kind


def test_csv_cells_are_strings_whatever_the_column_holds(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('prompt,answer\n"double 12, please",24\nq2,007\nq3,"two\nlines"\n\nq4,1e3\nq5,\n')
    assert load_records(str(path)) == [{"prompt": "double 12, please", "answer": "24"},
                                       {"prompt": "q2", "answer": "007"}, {"prompt": "q3", "answer": "two\nlines"},
                                       {"prompt": "q4", "answer": "1e3"}, {"prompt": "q5", "answer": None}]
    # records are located by the line they start on (a quoted cell spans two, a blank line is skipped);
    # an empty cell is a missing value
    with pytest.raises(DataError, match=rf"^{path}:8: field 'answer': missing here but present"):
        load_prompts(str(path), TOK)
    path.write_text("prompt,answer\nq1,1\nq2,2,3\n")
    with pytest.raises(DataError, match=rf"^{path}:3: 3 cells but the header"):
        load_prompts(str(path), TOK)


def test_a_split_of_a_saved_dataset_dict(tmp_path):
    DatasetDict({"train": Dataset.from_list(RECORDS[:3]), "test": Dataset.from_list(RECORDS[3:])}).save_to_disk(
        str(tmp_path / "dd"))
    assert [e.prompt for e in load_prompts(str(tmp_path / "dd"), TOK)] == ["double 1", "double 2", "double 3"]
    assert [e.prompt for e in load_prompts(str(tmp_path / "dd"), TOK, split="test")] == ["double 4", "double 5"]
    with pytest.raises(DataError, match="holds splits"):
        load_prompts(str(tmp_path / "dd"), TOK, split="validation")


def test_conversational_prompt_keeps_the_messages_for_the_reward(tmp_path):
    ex = load_prompts([{"prompt": [user("double 12")], "answer": "24"}], TOK)[0]
    assert ex.prompt == "<|user|>double 12\n<|assistant|>"  # rendered with the generation prompt
    assert ex.raw == [user("double 12")]


def test_a_column_missing_in_some_records_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: field 'answer': missing here but present"):
        load_prompts(str(path), TOK)


def test_long_prompts_are_cut_from_the_left_or_refused():
    exs = [PromptExample("abcdefgh", origin="p.jsonl:1"), PromptExample("ab", origin="p.jsonl:2")]
    ids, cut = encode_prompts(exs, TOK, max_length=5, truncation="left")
    assert cut == 1
    assert TOK.decode(ids[0]) == "<s>efgh"  # BOS kept, the prompt's end kept
    assert TOK.decode(ids[1]) == "<s>ab"
    with pytest.raises(DataError, match=r"^p\.jsonl:1: field 'prompt': 9 tokens exceeds data.max_prompt_length=5"):
        encode_prompts(exs, TOK, max_length=5, truncation="error")


def test_passes_over_the_prompts_are_shuffled_per_seed_and_resume_exactly():
    records = [PromptRecord(str(i)) for i in range(10)]
    src = FilePrompts(records, seed=3)
    seen = [r.text for r in src.batch(10)]
    assert sorted(seen) == [str(i) for i in range(10)] and src.epoch == 0  # one pass, every record once
    nxt = src.batch(4)  # crosses into the second pass
    assert src.epoch == 1 and [r.text for r in nxt] != seen[:4]
    state = json.loads(json.dumps(src.state_dict()))  # as a checkpoint stores it
    after = [r.text for r in src.batch(13)]
    other = FilePrompts(records, seed=3)
    other.load_state_dict(state)
    assert [r.text for r in other.batch(13)] == after and other.epoch == src.epoch == 2
    assert [r.text for r in FilePrompts(records, seed=4).batch(10)] != seen  # another seed, another order


def test_eval_fraction_holds_out_a_seeded_share():
    records = [PromptRecord(str(i)) for i in range(20)]
    train, held = hold_out(records, 0.25, seed=0)
    assert len(held) == 5 and len(train) == 15 and not {r.text for r in train} & {r.text for r in held}
    assert hold_out(records, 0.25, seed=0) == (train, held)


# --------------------------------------------------------------------------- reward functions

CALLS: list[dict] = []


def capture_reward(prompts, completions, completion_ids, finished, answer, level, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "finished": finished, "answer": answer, "level": level, "extra": sorted(kwargs)})
    return [1.0] * len(completions)


def two_reward(prompts, completions, **columns):
    return [2.0] * len(completions)


def ones_and_zeros(prompts, completions, completion_ids, **columns):
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


ones_and_zeros.binary = True  # declared 0/1: it gives eval/accuracy


def boom(prompts, completions, **columns):
    raise RuntimeError("my reward exploded")


def returns_none(prompts, completions, **columns):
    return None


ANSWERS: list = []


def capture_answers(prompts, completions, answer, **columns):
    ANSWERS.extend(answer)
    return [float(c == a) for c, a in zip(completions, answer)]  # TRL-style: a str answer compared to a str


def test_an_all_digit_csv_column_reaches_the_reward_as_str_like_jsonl(tiny_models, tiny_config, tmp_path, no_plots):
    records = [{"prompt": f"{n}x2=", "answer": str(2 * n)} for n in (12, 34, 56, 78)]  # every answer all digits
    paths = write_formats(tmp_path, records)
    seen = {}
    for kind in ("jsonl", "csv"):
        ANSWERS.clear()
        cfg = tiny_config(tmp_path / kind, model={"name": tiny_models.policy}, data={"path": paths[kind]},
                          reward={"function": "test_user_data:capture_answers"},
                          ppo={"algo": "grpo", "steps": 1, "batch_size": 8, "group_size": 4, "max_new_tokens": 3})
        train_rl(cfg)
        seen[kind] = list(ANSWERS)
    assert len(seen["csv"]) == 8 and all(type(a) is str for a in seen["csv"])
    assert seen["csv"] == seen["jsonl"]  # the same prompts in the same order, the same values


def doubling_file(tmp_path, n: int = 12, name: str = "prompts.jsonl") -> str:
    """Doubling prompts with their verifier's columns and an extra ``answer`` column."""
    rows = []
    for i in range(n):
        p = doubling.Prompt(1000 + 37 * i, doubling.SET_NAMES[i % 3])
        rows.append({"prompt": p.text, **doubling.columns(p), "answer": doubling.render(2 * p.number, p.charset),
                     "level": i % 3})
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_every_column_reaches_the_reward_aligned_with_the_completions(tiny_models, tiny_config, tmp_path, no_plots):
    CALLS.clear()
    path = doubling_file(tmp_path)
    by_prompt = {r["prompt"]: r for r in read_jsonl(path)}
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                      reward={"function": "test_user_data:capture_reward"}, data={"path": path},
                      ppo={"algo": "grpo", "steps": 3, "batch_size": 8, "group_size": 4, "max_new_tokens": 6})
    train_rl(cfg)
    assert len(CALLS) == 3
    for call in CALLS:
        n = len(call["completions"])
        assert n == 8 and all(len(call[k]) == n for k in ("prompts", "completion_ids", "finished", "answer", "level"))
        assert call["extra"] == ["charset", "number"]  # every other column, by name
        for i in range(n):
            rec = by_prompt[call["prompts"][i]]  # the prompt as the file gave it
            assert (call["answer"][i], call["level"][i]) == (rec["answer"], rec["level"])
            # completions: decoded without special tokens; ids: the EOS kept where one was emitted
            ids = call["completion_ids"][i]
            assert call["completions"][i] == TOK_D.decode(ids, skip_special_tokens=True)
            assert call["finished"][i] == (TOK_D.eos_token_id in ids)
        for g in range(0, n, 4):  # a group's rows: one prompt, its columns repeated
            assert len({call["prompts"][j] for j in range(g, g + 4)}) == 1


TOK_D = doubling.make_tokenizer()


def test_weighted_rewards_are_logged_each_and_summed(tiny_models, tiny_config, tmp_path, no_plots):
    path = doubling_file(tmp_path)
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": path},
                      reward={"name": tiny_models.reward, "function": "test_user_data:two_reward", "weights": "0.5,3"},
                      ppo={"algo": "grpo", "steps": 2, "batch_size": 8, "group_size": 4, "max_new_tokens": 6})
    train_rl(cfg)
    for row in read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        assert row["reward/two_reward"] == 2.0
        assert row["objective/score"] == pytest.approx(0.5 * row["reward/reward_model"] + 3 * 2.0, abs=1e-5)


def test_a_weight_per_source_or_a_clear_error(tiny_models, tiny_config, tmp_path):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": doubling_file(tmp_path)},
                      reward={"function": "test_user_data:two_reward", "weights": "1,2"},
                      ppo={"algo": "grpo", "max_new_tokens": 6})
    with pytest.raises(ValueError, match=r"reward.weights='1,2' gives 2 weight\(s\) for 1 reward source"):
        train_rl(cfg)


@pytest.mark.parametrize("fn, message", [
    ("boom", "reward function test_user_data:boom raised RuntimeError: my reward exploded"),
    ("returns_none", "reward function test_user_data:returns_none returned None"),
])
def test_a_failing_reward_function_is_named(fn, message, tiny_models, tiny_config, tmp_path):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": doubling_file(tmp_path)},
                      reward={"function": f"test_user_data:{fn}"}, ppo={"algo": "grpo", "max_new_tokens": 6})
    with pytest.raises(RewardError) as err:
        train_rl(cfg)
    assert str(err.value).startswith(message)


def test_held_out_prompts_are_scored_by_the_rewards(tiny_models, tmp_path):
    policy = load_policy(tiny_models.policy)
    records = file_records(doubling_file(tmp_path, 10), TOK_D, _cfg_data())
    binary = function_scorer(ones_and_zeros, TOK_D)
    both = Reward(binary.sources + [(n, 0.5, f) for n, _, f in function_scorer(two_reward, TOK_D).sources])
    ev = evaluate_rewards(policy, TOK_D, records, both, torch.device("cpu"), batch_size=3, max_new_tokens=6)
    # the same completions, decoded greedily by hand, scored by the function itself
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r.ids[::-1]) for r in records], batch_first=True,
                                          padding_value=TOK_D.pad_token_id).flip(1)
    roll = generate(policy, ids, (ids != TOK_D.pad_token_id).long(), 6, TOK_D.eos_token_id, TOK_D.pad_token_id,
                    greedy=True)
    want = ones_and_zeros(None, [None] * 10, [r[:n] for r, n in zip(roll.response_ids.tolist(),
                                                                   roll.response_mask.sum(-1).tolist())])
    assert ev["eval/reward/ones_and_zeros"] == pytest.approx(sum(want) / 10)
    assert ev["eval/accuracy"] == pytest.approx(sum(want) / 10)  # the binary source alone decides
    assert ev["eval/reward/two_reward"] == 2.0
    assert ev["eval/reward"] == pytest.approx(sum(want) / 10 + 0.5 * 2.0)
    only_two = evaluate_rewards(policy, TOK_D, records, function_scorer(two_reward, TOK_D), torch.device("cpu"),
                                max_new_tokens=6)
    assert "eval/accuracy" not in only_two  # no declared 0/1 reward, no accuracy


def _cfg_data():
    from rlhfkit.config import Config

    return Config()


def test_evaluation_and_generic_early_stop_on_held_out_prompts(tiny_models, tiny_config, tmp_path, no_plots):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                      data={"path": doubling_file(tmp_path), "eval_path": doubling_file(tmp_path, 5, "held.jsonl")},
                      reward={"function": "test_user_data:two_reward"},
                      ppo={"algo": "grpo", "steps": 6, "batch_size": 8, "group_size": 4, "max_new_tokens": 6,
                           "eval_every": 2, "stop_metric": "eval/reward", "stop_at": 2.0})
    out = train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # the first evaluation (after step 1, the second) already meets it: reached names that row's step
    assert out["reached"]["step"] == rows[-1]["step"] == 1 and out["reached"]["steps"] == len(rows) == 2
    assert rows[1]["eval/reward"] == 2.0 and rows[1]["eval/reward/two_reward"] == 2.0
    assert "eval/reward" not in rows[0]
    assert [r["data/epoch"] for r in rows] == [0, 0]


def test_prompt_file_passes_are_counted(tiny_models, tiny_config, tmp_path, no_plots):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": doubling_file(tmp_path, 4)},
                      reward={"function": "rlhfkit.tasks.doubling:exact_reward"},
                      ppo={"algo": "grpo", "steps": 4, "batch_size": 8, "group_size": 4, "max_new_tokens": 6})
    train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["data/epoch"] for r in rows] == [0, 0, 1, 1]  # 2 prompts a step, 4 in the file


def test_rl_on_a_file_needs_max_new_tokens(tiny_models, tiny_config, tmp_path):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": doubling_file(tmp_path)},
                      reward={"function": "test_user_data:two_reward"}, ppo={"max_new_tokens": None})
    with pytest.raises(ValueError, match="ppo.max_new_tokens must be set with data.path"):
        train_rl(cfg)


def test_task_verifiers_read_columns_and_the_finished_flag():
    p = doubling.Prompt(1234, "digits")
    cols = doubling.columns(p)
    # the RL loop's convention: no EOS text, `finished` says whether the response ended with EOS
    assert doubling.exact_reward(["anything"], ["2468"], number=[cols["number"]], charset=[cols["charset"]],
                                 finished=[True]) == [1.0]
    assert doubling.exact_reward(["anything"], ["2468"], number=[1234], charset=["digits"], finished=[False]) == [0.0]
    # the old convention still holds: EOS in the text, prompt parsed
    assert doubling.exact_reward([p.text], ["2468" + doubling.EOS]) == [1.0]


def test_reward_functions_given_as_python_objects(tiny_models, tiny_config, tmp_path, no_plots):
    def length_reward(prompts, completions, **columns):  # defined here: no importable name
        return [float(len(c)) for c in completions]

    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                      reward={"function": [two_reward, length_reward], "weights": "1,0.5"},
                      ppo={"algo": "grpo", "steps": 2, "batch_size": 8, "group_size": 4, "max_new_tokens": 4})
    train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward/two_reward"] for r in rows] == [2.0, 2.0] and all("reward/length_reward" in r for r in rows)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "- test_user_data:two_reward\n" in saved and "- <callable>\n" in saved


TASK_CALLS: list[dict] = []


def capture_task_reward(prompts, completions, completion_ids, finished, number, charset, **columns):
    TASK_CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                       "finished": finished})
    return [0.0] * len(completions)


def test_the_built_in_task_reward_sees_text_without_bos_or_eos(tiny_models, tiny_config, tmp_path, no_plots):
    """TRL's convention on the built-in task's prompts (no data.path): the prompt as the task wrote it
    (no BOS), completions decoded without the EOS text, finished exactly where the ids end in EOS."""
    TASK_CALLS.clear()
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                      reward={"function": "test_user_data:capture_task_reward"},
                      ppo={"algo": "grpo", "steps": 3, "batch_size": 8, "group_size": 4, "max_new_tokens": 6,
                           "temperature": 2.0})
    train_rl(cfg)
    eos, specials = TOK_D.eos_token_id, {doubling.BOS, doubling.EOS, doubling.PAD}
    rows = [(p, c, ids, done) for call in TASK_CALLS
            for p, c, ids, done in zip(call["prompts"], call["completions"], call["completion_ids"], call["finished"])]
    assert len(rows) == 24
    for prompt, completion, ids, done in rows:
        assert prompt[:2] in doubling.PREFIX.values() and not set(prompt) & specials  # as the task wrote it
        assert done == (ids[-1:] == [eos]) and ids.count(eos) == int(done)  # the EOS id kept, once, at the end
        assert not set(completion) & specials  # no EOS (nor BOS/pad) text in what the function reads
        assert completion == TOK_D.decode([i for i in ids if i != eos], skip_special_tokens=True)
    assert {done for *_, done in rows} == {True, False}  # both kinds of row were seen


def test_a_reward_model_object_from_python(tiny_models, tiny_config, tmp_path, no_plots):
    from rlhfkit.models.forward import load_scalar_model

    rm = load_scalar_model(tiny_models.reward)
    by_path = tiny_config(tmp_path / "path", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                          ppo={"algo": "grpo", "steps": 2})
    train_rl(by_path)
    train_rl(by_path.replace(run={"out_dir": str(tmp_path / "object")}, reward={"name": rm}))
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("path", "object"))
    assert [r["reward/reward_model"] for r in a] == [r["reward/reward_model"] for r in b]  # the same scores
    assert "name: <callable>" in (tmp_path / "object" / "config.yaml").read_text()


REWARD_FILE = '''
def correct(prompts, completions, answer, **columns):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


@pytest.mark.parametrize("how", ["path", "module_in_cwd"])
def test_a_reward_function_from_a_file_or_the_current_directory(how, tmp_path, monkeypatch):
    from rlhfkit.rollout.rewards import load_reward_function

    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    name = f"myreward_{how}"  # a module name no other test imports
    (tmp_path / f"{name}.py").write_text(REWARD_FILE)
    if how == "path":
        monkeypatch.chdir(tmp_path.parent)
        spec = f"{tmp_path.name}/{name}.py:correct"  # relative to the current directory, as a user types it
    else:
        monkeypatch.chdir(tmp_path)
        spec = f"{name}:correct"  # the README's and docs/data.md's reward.function=myreward:correct
    fn = load_reward_function(spec)
    assert fn(prompts=["a", "b"], completions=[" 4", "5"], answer=["4", "6"]) == [1.0, 0.0]
    assert load_reward_function(spec) is fn  # imported once
    with pytest.raises(ValueError, match="cannot be loaded: .*no_such"):
        load_reward_function(spec.replace(":correct", ":no_such"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_reward_function("missing_dir/nothing.py:correct")


def _file_run(tiny_models, tiny_config, tmp_path, reward="two_reward", **ppo):
    return tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                       data={"path": doubling_file(tmp_path), "eval_path": doubling_file(tmp_path, 5, "held.jsonl")},
                       reward={"function": f"test_user_data:{reward}"},
                       ppo={"algo": "grpo", "steps": 4, "batch_size": 8, "group_size": 4, "max_new_tokens": 6,
                            "eval_every": 2, **ppo})


@pytest.mark.parametrize("reward, metric", [("two_reward", "eval/reward"), ("ones_and_zeros", "eval/accuracy")])
def test_the_stop_metric_defaults_to_one_the_run_logs(reward, metric, tiny_models, tiny_config, tmp_path, no_plots):
    """A prompt file's run logs no eval/exact_acc (the built-in tasks' metric): early stopping on
    it was silently off. The default is now what the evaluation logs, measured first before step 0."""
    two = reward == "two_reward"
    out = train_rl(_file_run(tiny_models, tiny_config, tmp_path, reward, stop_at=2.0 if two else 1e-9))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert f"baseline/{metric}" in rows[0] and (rows[0][f"baseline/{metric}"] == 2.0 or not two)
    assert metric not in rows[0] and metric in rows[1]  # eval_every=2: step 0's only evaluation is the one before it
    if two:  # every completion scores 2: the first evaluation after training (step 1) meets it
        assert out["reached"] == {"step": 1, "steps": 2, "train_s": out["reached"]["train_s"]}
    else:  # stopped by eval/accuracy exactly when it is above 0 at step 1
        assert (out["reached"] is not None) == (rows[1][metric] > 0)
        assert len(rows) == (2 if out["reached"] else 4)


def test_the_built_in_task_runs_stop_on_exact_acc_with_a_baseline(tiny_models, tiny_config, tmp_path, no_plots):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "steps": 1})
    train_rl(cfg)
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert {"baseline/eval/exact_acc", "baseline/eval/format_acc", "eval/exact_acc"} <= set(row)


def test_a_stop_metric_the_run_does_not_log_stops_before_training(tiny_models, tmp_path, capsys):
    from rlhfkit.cli.main import main

    out = tmp_path / "run"
    argv = ["grpo", f"model.name={tiny_models.policy}", f"data.path={doubling_file(tmp_path)}",
            f"data.eval_path={doubling_file(tmp_path, 5, 'held.jsonl')}", "reward.function=test_user_data:two_reward",
            "ppo.max_new_tokens=4", f"run.out_dir={out}", "run.progress=false"]
    assert main([*argv, "ppo.stop_metric=eval/acuracy"]) == 2  # a typo
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlhfkit grpo: error: ppo.stop_metric='eval/acuracy' is not logged by this run's evaluation, which "
                   "logs eval/reward, eval/reward/two_reward: name one of those (or leave ppo.stop_metric empty)"]
    assert not out.exists()  # nothing trained, nothing written
    assert main([*argv[:3], *argv[4:], "ppo.stop_metric=eval/reward"]) == 2  # no held-out prompts at all
    assert "has no held-out prompts to evaluate" in capsys.readouterr().err


# --------------------------------------------------------------------------- None: a function that does not score a completion

# per row of two groups of 4 completions: what each function returns (None: it does not score that one)
MATH = [1.0, None, 3.0, None, 0.0, 0.0, None, None]
CODE = [None, 2.0, None, None, 1.0, None, None, None]


def math_score(prompts, completions, **columns):
    return MATH[: len(completions)]


def code_score(prompts, completions, **columns):
    return CODE[: len(completions)]


def none_experience(algo: str, scale: str = "none"):
    """An ``algo`` experience of 8 completions scored by math_score (weight 1) and code_score
    (weight 2), advantages scaled as ``scale`` says; ``(exp, stats)``."""
    import dataclasses

    from rlhfkit.config import Config
    from rlhfkit.models.forward import build_tiny_policy, freeze
    from rlhfkit.rollout.experience import ActorCritic, make_experience

    tok = doubling.make_tokenizer()
    policy, ref = build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16), freeze(build_tiny_policy(tok, 0, n_layer=1,
                                                                                                      n_head=2, n_embd=16))
    enc = tok([doubling.prompt_text(n, None) for n in (12, 12, 12, 12, 7, 7, 7, 7)], padding=True, return_tensors="pt")
    roll = generate(policy, enc["input_ids"], enc["attention_mask"], 4, tok.eos_token_id, tok.pad_token_id,
                    generator=torch.Generator().manual_seed(0))
    reward = Reward([*function_scorer(math_score, tok).sources,
                     *[(n, 2.0, f) for n, _, f in function_scorer(code_score, tok).sources]])
    pc = dataclasses.replace(Config().replace(ppo={"algo": algo}).ppo, group_size=4, batch_size=8, scale_rewards=scale)
    return make_experience(ActorCritic(policy), ref, reward, roll, pc, kl_coef=pc.kl_coef)


def test_a_none_leaves_the_function_out_of_the_sample_and_a_sample_none_scores_gets_advantage_zero():
    """TRL's convention (GRPOTrainer: NaN for None, nansum of the weighted scores; a completion every
    function skips is unscorable: out of the group mean and std, advantage 0). Totals by hand:
    [1, 2*2, 3, -, 0 + 2*1, 0, -, -]; groups [1, 4, 3, -] and [2, 0, -, -]."""
    with pytest.warns(RuntimeWarning, match="every reward function returned None for some completions"):
        exp, stats = none_experience("grpo", "group")
    adv = exp.advantages[:, 0]  # [B]: the same on every token of a row
    mean0, std0 = 8 / 3, (((1 - 8 / 3) ** 2 + (4 - 8 / 3) ** 2 + (3 - 8 / 3) ** 2) / 2) ** 0.5
    want = torch.tensor([(1 - mean0) / (std0 + 1e-4), (4 - mean0) / (std0 + 1e-4), (3 - mean0) / (std0 + 1e-4), 0.0,
                         1 / (2**0.5 + 1e-4), -1 / (2**0.5 + 1e-4), 0.0, 0.0])
    torch.testing.assert_close(adv, want)
    # the logged means: over the completions each function scored, the total over the scored ones
    assert stats["reward/math_score"] == pytest.approx((1 + 3 + 0 + 0) / 4)
    assert stats["reward/code_score"] == pytest.approx((2 + 1) / 2)
    assert stats["objective/score"] == pytest.approx((1 + 4 + 3 + 2 + 0) / 5)
    assert exp.score.tolist() == [1.0, 4.0, 3.0, 0.0, 2.0, 0.0, 0.0, 0.0]  # written as 0 where none scored
    # the batch's std: of the scored totals [1, 4, 3, 2, 0], sqrt(10 / 4)
    batch, _ = none_experience("grpo", "batch")
    centred = torch.tensor([1 - mean0, 4 - mean0, 3 - mean0, 0.0, 1.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(batch.advantages[:, 0], centred / (2.5**0.5 + 1e-4))
    # rloo: the scored others' mean (row 0: 1 - (4 + 3) / 2); reinforce: the batch's scored mean
    rloo, _ = none_experience("rloo")
    torch.testing.assert_close(rloo.advantages[:, 0], torch.tensor([-2.5, 2.0, 0.5, 0.0, 2.0, -2.0, 0.0, 0.0]))
    reinforce, _ = none_experience("reinforce")
    torch.testing.assert_close(reinforce.advantages[:, 0], torch.tensor([-1.0, 2.0, 1.0, 0.0, 0.0, -2.0, 0.0, 0.0]))


def test_a_completion_no_function_scores_stops_ppo_and_a_nan_stays_an_error():
    with pytest.raises(RewardError, match=r"every reward function returned None for 3 of 8 completions: ppo's critic"):
        none_experience("ppo")
    tok = doubling.make_tokenizer()
    roll = generate(build_tiny_policy_for_scores(tok), *prompt_batch(tok), 2, tok.eos_token_id, tok.pad_token_id)
    nan = function_scorer(lambda completions, **kw: [float("nan")] + [0.0] * (len(completions) - 1), tok)
    with pytest.raises(RewardError, match=r"returned 1 non-finite score\(s\)"):
        nan(roll)


def build_tiny_policy_for_scores(tok):
    from rlhfkit.models.forward import build_tiny_policy

    return build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16)


def prompt_batch(tok):
    enc = tok([doubling.prompt_text(n, None) for n in (12, 7)], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def test_held_out_means_leave_out_the_completions_a_function_does_not_score():
    from rlhfkit.rollout.evaluate import ScoredCompletions, reward_means, win_rate

    nan = float("nan")
    scored = ScoredCompletions(["a", "b", "c", "d"], [True] * 4, torch.tensor([1.0, 1.0, 0.0, nan], dtype=torch.float64),
                               {"math": torch.tensor([1.0, nan, 0.0, nan], dtype=torch.float64),
                                "code": torch.tensor([nan, 1.0, nan, nan], dtype=torch.float64)}, ["math", "code"])
    # accuracy: over the completions some 0/1 source judged (3), correct where each that judged gave 1 (2)
    out = reward_means(scored)
    assert {k: v for k, v in out.items() if "reward_std" not in k} == {
        "eval/reward": 2 / 3, "eval/reward/math": 0.5, "eval/reward/code": 1.0, "eval/accuracy": 2 / 3}
    # each source's spread over the completions it scored: math's 1 and 0 (sample std sqrt(0.5)), code's one 1
    assert out["eval/reward_std/math"] == pytest.approx(0.5**0.5) and out["eval/reward_std/code"] == 0.0
    assert win_rate(torch.tensor([1.0, nan, 2.0]), torch.tensor([0.0, 1.0, 2.0])) == 0.75  # the middle left out
