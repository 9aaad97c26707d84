"""The public Python surface (``from rlhfkit import grpo, Config, ...``) runs what the command
line runs: the same metrics from in-memory data and Python reward callables as from the same
records in a file and a ``module:name`` reward."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import rlhfkit
from rlhfkit.cli.main import main
from rlhfkit.config import Config, ConfigError
from rlhfkit.data import DataError
from rlhfkit.tasks import doubling
from rlhfkit.utils import read_jsonl

TINY = {"run.progress": False, "ppo.steps": 2, "ppo.batch_size": 8, "ppo.minibatch_size": 4,
        "ppo.max_new_tokens": 4, "ppo.eval_every": 0, "ppo.stop_at": 0}


def digits_reward(prompts, completions, **columns) -> list[float]:
    """A reward that depends on the completions (so the runs' updates do too)."""
    return [sum(ch.isdigit() for ch in c) / 4 for c in completions]


def prompt_records(n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        p = doubling.Prompt(1000 + 37 * i, doubling.SET_NAMES[i % 3])
        rows.append({"prompt": p.text, "level": i % 3})
    return rows


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def metrics(out_dir) -> list[dict]:
    """The logged values, less the timings (they differ between any two runs)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
            for row in read_jsonl(out_dir / "metrics.jsonl")]


def cli_args(overrides: dict) -> list[str]:
    return [f"{k}={v}" for k, v in overrides.items()]


def test_grpo_on_a_list_and_a_callable_logs_what_the_command_on_a_file_logs(tiny_models, tmp_path, no_plots):
    records = prompt_records()
    given = {**TINY, "model.name": tiny_models.policy}
    assert main(["grpo", *cli_args(given), f"run.out_dir={tmp_path / 'cli'}",
                 f"data.path={write_jsonl(tmp_path / 'prompts.jsonl', records)}",
                 "reward.function=test_api:digits_reward"]) == 0
    summary = rlhfkit.grpo(model=tiny_models.policy, data=records, reward_funcs=[digits_reward],
                           overrides={**TINY, "run.out_dir": tmp_path / "py"})
    want = metrics(tmp_path / "cli")
    assert len(want) == 2 and "reward/digits_reward" in want[0]
    assert metrics(tmp_path / "py") == want
    assert summary["steps"] == 2 and summary["path"] == str(tmp_path / "py" / "policy")
    # the records the run read are in its directory, and its config.yaml names them
    assert read_jsonl(tmp_path / "py" / "data.jsonl") == records
    saved = (tmp_path / "py" / "config.yaml").read_text(encoding="utf-8")
    assert f"path: {tmp_path / 'py' / 'data.jsonl'}" in saved
    assert "function:\n  - test_api:digits_reward" in saved


def test_a_dataset_runs_as_its_list(tiny_models, tmp_path, no_plots):
    datasets = pytest.importorskip("datasets")
    records = prompt_records()
    common = {"model": tiny_models.policy, "reward_funcs": digits_reward}
    rlhfkit.grpo(data=records, **common, overrides={**TINY, "run.out_dir": tmp_path / "list"})
    rlhfkit.grpo(data=datasets.Dataset.from_list(records), **common,
                 overrides={**TINY, "run": {"out_dir": str(tmp_path / "ds")}})  # a section mapping works too
    assert metrics(tmp_path / "ds") == metrics(tmp_path / "list")


def test_sft_and_dpo_from_lists_match_their_commands_on_files(tiny_models, tmp_path):
    task = doubling.DoublingData(0)
    demos = [{"prompt": p, "completion": c} for p, c in task.sft_examples(16)]
    pairs = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in task.preference_pairs(16) if c != r + "E"]
    for command, fn, records, steps in (("sft", rlhfkit.sft, demos, {"sft.steps": 2, "sft.batch_size": 4}),
                                        ("dpo", rlhfkit.dpo, pairs, {"dpo.steps": 2, "dpo.batch_size": 4,
                                                                     "dpo.eval_every": 0})):
        given = {"run.progress": False, **steps}
        path = write_jsonl(tmp_path / f"{command}.jsonl", records)
        assert main([command, f"model.name={tiny_models.policy}", f"data.path={path}", *cli_args(given),
                     f"run.out_dir={tmp_path / command / 'cli'}"]) == 0
        summary = fn(model=tiny_models.policy, data=records, overrides={**given, "run.out_dir": tmp_path / command / "py"})
        assert metrics(tmp_path / command / "py") == metrics(tmp_path / command / "cli"), command
        assert summary["path"] == str(tmp_path / command / "py" / "policy")


def test_config_forms_resolve_as_the_command_line_does(tmp_path):
    """A YAML path, a mapping or a Config, with dotted or section overrides: the command's config."""
    from rlhfkit.cli.main import _config, _parser, resolve_config

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("ppo:\n  steps: 7\n")
    want = _config(_parser().parse_args(["rloo", "--config", str(yaml_file), "ppo.lr=0.01"]))
    assert resolve_config("rloo", str(yaml_file), {"ppo.lr": 0.01}) == want
    assert resolve_config("rloo", {"ppo": {"steps": 7}}, {"ppo": {"lr": 0.01}}) == want
    assert (want.ppo.algo, want.ppo.steps, want.ppo.lr, want.run.out_dir) == ("rloo", 7, 0.01, "runs/rloo")
    mine = resolve_config("grpo", Config().replace(run={"seed": 5}), {"ppo.steps": 3})
    assert (mine.ppo.algo, mine.run.seed, mine.ppo.steps) == ("grpo", 5, 3)
    with pytest.raises(ConfigError, match="config key 'steps' has no section"):
        resolve_config("grpo", None, {"steps": 3})
    with pytest.raises(ConfigError, match="unknown config key 'ppo.stepz'"):
        rlhfkit.grpo(overrides={"ppo.stepz": 3})


def test_in_memory_records_are_checked_with_their_place(tmp_path):
    with pytest.raises(DataError, match=r"^list\[1\]: field 'prompt'"):
        rlhfkit.grpo(data=[{"prompt": "a"}, {"prompt": 3}], overrides={"run.out_dir": tmp_path / "run"})
    with pytest.raises(DataError, match=r"^list\[0\]: cannot be written as JSON"):
        rlhfkit.sft(data=[{"prompt": "a", "completion": "b", "when": object()}],
                    overrides={"run.out_dir": tmp_path / "run"})


def test_an_earlier_runs_data_file_stays_when_the_run_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "data.jsonl").write_text('{"prompt": "earlier"}\n')
    with pytest.raises(ConfigError, match="holds an earlier run"):
        rlhfkit.grpo(data=[{"prompt": "new"}], overrides={"run.out_dir": out})
    assert (out / "data.jsonl").read_text() == '{"prompt": "earlier"}\n'


def test_the_public_names_import_and_the_commands_without_torch():
    from rlhfkit import Config, Environment, ToolEnvironment, dpo, grpo, ppo, sft  # noqa: F401

    assert sorted(set(rlhfkit.__all__) - set(dir(rlhfkit))) == []
    sections = {type(getattr(Config(), f.name)).__name__ for f in dataclasses.fields(Config)}
    assert sections <= set(rlhfkit.__all__)  # every config section class is exported
    assert Environment.__module__ == "rlhfkit.envs.environment" and issubclass(ToolEnvironment, Environment)
    code = ("import sys\nimport rlhfkit\nfrom rlhfkit import Config, load_config, grpo, dpo, sft, ppo\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_a_command_without_a_python_function_is_refused_naming_it():
    from rlhfkit.api import run

    with pytest.raises(ValueError, match="no Python function runs 'rlhfkit chat'"):
        run("chat", overrides={"run.progress": False})
