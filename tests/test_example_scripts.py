"""The example shell scripts find the project's Python and the model the way a user's checkout
has them: the repository's .venv when it exists (not a bare ``python`` or ``rlhfkit`` from
PATH), the model where ``rlhfkit fetch-model`` put it or in MODEL_DIR. Run against a stand-in
interpreter that records each call, so no model is trained; ``fetch-model --print-path`` is
checked on its own against a finished conversion in a cache of the test's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlhfkit.cli import fetch
from rlhfkit.cli.main import main

needs_tools = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("taskset") and os.path.exists("/usr/bin/time")),
                                 reason="the scripts pin stages with taskset and time them with /usr/bin/time")
ROOT = Path(__file__).resolve().parents[1]
FETCHED = "/fetched/models/smollm2-135m-instruct"  # what the stand-in's fetch-model --print-path answers
# a stand-in for .venv/bin/python: one line per call with its arguments; fetch-model --print-path
# answers with a directory, as rlhfkit's does
STAND_IN = f"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in *"fetch-model"*"--print-path"*) echo {FETCHED} ;; esac
"""
SCRIPTS = ["examples/real_model/run.sh", "examples/real_model/pipeline.sh",
           "examples/real_model/calculator/run.sh", "examples/own_data/run.sh"]
REAL_MODEL = SCRIPTS[:3]


def model_paths(calls: list[str]) -> set[str]:
    """The model directories the calls name (``model.name=DIR``, ``eval.baseline=DIR``, a bare DIR)."""
    return {t.split("=", 1)[-1] for c in calls for t in c.split() if "smol" in t and t != "smollm2-135m-instruct"}


def executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def checkout(tmp_path: Path, venv: bool = True) -> Path:
    """A copy of examples/ in a repository directory, with a stand-in .venv/bin/python (``venv``)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", repo / "examples")
    if venv:
        executable(repo / ".venv" / "bin" / "python", STAND_IN)
    return repo


def run_script(repo: Path, script: str, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                           list[str]]:
    """Run ``script`` of ``repo`` from another directory with a plain PATH and none of the scripts'
    variables set; the process and the stand-in's calls."""
    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    keep = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "RLHFKIT", "MODEL_DIR", "RLHFKIT_CACHE")}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    done = subprocess.run(["bash", str(repo / script), str(tmp_path / "out"), *args], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120,
                          env={**keep, "PATH": env.pop("PATH", "/usr/bin:/bin"), "CORE": "0", "CALLS": str(calls),
                               **env})
    return done, calls.read_text().splitlines() if calls.exists() else []


@needs_tools
@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_run_the_checkouts_venv_and_the_fetched_model(script, tmp_path):
    repo = checkout(tmp_path)
    done, calls = run_script(repo, script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls[0] == "-c import rlhfkit"  # the log is the venv interpreter's: every call went through it
    commands = [c.split()[2] for c in calls if c.startswith("-m rlhfkit ")]
    assert commands and all(c.startswith(("-m rlhfkit ", str(repo / "examples"), "-c ")) for c in calls), calls
    if script in REAL_MODEL:  # the model: where fetch-model put it
        assert "fetch-model" in commands and model_paths(calls) == {FETCHED}


@needs_tools
@pytest.mark.parametrize("script", REAL_MODEL)
def test_a_model_in_a_directory_of_ones_own_is_used_as_it_is(script, tmp_path):
    repo = checkout(tmp_path)
    done, calls = run_script(repo, script, tmp_path, MODEL_DIR="/my/models/smol")
    assert done.returncode == 0, done.stderr
    assert not any("fetch-model" in c for c in calls) and model_paths(calls) == {"/my/models/smol"}
    if script == "examples/real_model/run.sh":  # its extra arguments go to grpo
        done, calls = run_script(repo, script, tmp_path, "ppo.steps=2", MODEL_DIR="/my/models/smol")
        assert calls[-1].startswith("-m rlhfkit grpo ") and calls[-1].endswith(" ppo.steps=2")


@needs_tools
def test_without_a_venv_python3_is_used_and_one_that_lacks_rlhfkit_is_one_line(tmp_path):
    repo = checkout(tmp_path, venv=False)
    stand_ins = tmp_path / "bin"
    executable(stand_ins / "python3", 'echo "no module named rlhfkit" >&2; exit 1\n')
    done, calls = run_script(repo, "examples/own_data/run.sh", tmp_path, PATH=f"{stand_ins}:/usr/bin:/bin")
    assert done.returncode == 2 and not calls
    assert done.stderr.strip() == (f"run.sh: error: python3 cannot import rlhfkit: run `make demo` in {repo} (it "
                                   "creates .venv), activate the venv it is installed in (source .venv/bin/activate), "
                                   "or set PYTHON=...")
    executable(stand_ins / "python3", STAND_IN)  # an activated venv's python3 with rlhfkit
    done, calls = run_script(repo, "examples/own_data/run.sh", tmp_path, PATH=f"{stand_ins}:/usr/bin:/bin")
    assert done.returncode == 0 and calls[1].startswith("-m rlhfkit pretrain "), done.stderr


def test_fetch_model_prints_the_directory_alone_for_scripts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path))
    done = fetch.default_dir("smollm2-135m-instruct")  # a finished conversion: nothing to fetch
    done.mkdir(parents=True)
    (done / fetch.MARKER).write_text(json.dumps({"source": "test"}))
    assert main(["fetch-model", "smollm2-135m-instruct", "--print-path"]) == 0
    assert capsys.readouterr().out == f"{done}\n"
    own = tmp_path / "own"
    shutil.copytree(done, own)
    monkeypatch.chdir(tmp_path)
    assert main(["fetch-model", "smollm2-135m-instruct", "own", "--print-path"]) == 0
    assert capsys.readouterr().out == f"{own}\n"  # absolute, whatever directory it was named from
