"""Every command and Python example that the README and the recipe pages show runs, in the order
shown, as a user who copies them would run it: through ``rlhfkit.cli.main.main`` (``python ...`` lines
in a subprocess), in a directory of the test's where ``runs/...`` lands, with ``examples/`` linked
from the repository. A command is rewritten only by appending tiny sizes (:data:`TINY`: one step,
batches of 2, four new tokens, no periodic evaluation), so a renamed key, a changed file format or
a command that reads what an earlier one no longer writes fails here, not for the user.

The files the pages assume the user has (``sft.jsonl``, ``prompts.jsonl``, ``myreward.py`` ...)
are written from the formats and examples the pages show (:func:`user_files`). What cannot run
as shown is listed, with the reason, in :data:`NOT_RUN` and :data:`STAND_INS`; everything else
must run."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_helpers import chat_tokenizer, save_tiny
from rlhfkit.cli import fetch
from rlhfkit.cli import main as cli
from test_docs import ROOT, _blocks, shown_command

# the README and the recipe pages, each followed top to bottom
PAGES = ["README.md", "docs/getting-started.md", "docs/data.md", "docs/real-models.md", "docs/environments.md"]

# appended to every command that reads the key's section (or the key itself): later overrides win
TINY = ["run.progress=false", "run.tensorboard=false",
        "pretrain.steps=2", "pretrain.batch_size=4", "pretrain.warmup_steps=0",
        "reward.steps=1", "reward.batch_size=2", "reward.eval_pairs=4",
        "ppo.steps=1", "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.group_size=2", "ppo.max_new_tokens=4",
        "ppo.eval_every=0", "ppo.critic_warmup_steps=0",
        "sft.steps=1", "sft.batch_size=2", "sft.warmup_steps=0",
        "dpo.steps=1", "dpo.batch_size=2", "dpo.num_pairs=4", "dpo.eval_every=0",
        "eval.max_new_tokens=4", "chat.max_new_tokens=4",
        "gridworld.iterations=1", "gridworld.episodes_per_iter=2"]
# the commands that build their model from scratch: the tiny shape too
FROM_SCRATCH = ("pretrain", "demo")
TINY_MODEL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16"]

# shown lines that are not run, by their start, and why
NOT_RUN = {
    "make ": "the Makefile's set-up and test targets (make demo: set-up, then the `rlhfkit demo` run below)",
    "git clone": "set-up", "source ": "set-up", "python3 -m venv": "set-up", ".venv/bin/pip": "set-up",
    "examples/real_model/calculator/run.sh": "SFT and GRPO on the real chat model for minutes; its commands "
                                             "are checked against a stand-in in tests/test_example_scripts.py",
    "python benchmarks/gridcat_env.py": "a benchmark of three seeds, minutes; tests/test_envs.py runs the task",
}
# placeholders the pages show: the tiny model directory (user_files) the test puts in their place, and why
STAND_INS = {
    "model.name=BASE": ("llama", "BASE is any model directory: a tiny random Llama with a character chat tokenizer"),
    "model.name=Qwen/Qwen3-0.6B": ("qwen3", "a hub id, and no model hub here: a tiny random Qwen3 saved locally"),
    "model.name=...": ("llama", "the page leaves the model to the reader"),
}
# every `## ` section starts in a fresh directory (a recipe of its own), except these, which read
# what an earlier section of the page wrote: they run in its directory
CONTINUES = {("docs/data.md", "Evaluate and compare on your prompts"): "The pipeline on files"}
# the sections that run the real chat model, minutes each on a CPU: make test-real runs them
REAL = {("README.md", "Recipe 3: a real chat model with LoRA, offline"),
        ("docs/real-models.md", "A real chat model, offline")}
# a section whose commands read what a step shown elsewhere on the page (not as a command) made
GIVEN = {("docs/getting-started.md", "The run report"): ["demo"]}  # `make demo` in the install section


def steps(path: Path) -> list[tuple[str, str, str]]:
    """``(section, kind, text)`` in the page's order: each shell line of a ``bash``/``sh`` block
    (continuations joined, comments dropped; kind 'sh') and each ``python`` block ('python')."""
    out, section, lang, lines = [], "", None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        if lang is None and line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
                continue
            if lang == "python":
                out.append((section, "python", "\n".join(lines)))
            elif lang in ("bash", "sh"):
                for shown in "\n".join(lines).replace("\\\n", " ").splitlines():
                    shown = " ".join(shown.split(" #")[0].split())
                    if shown and not shown.startswith("#"):
                        out.append((section, "sh", shown))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


def tiny(command: str) -> list[str]:
    """The overrides of :data:`TINY` that ``command`` reads."""
    reads = cli.COMMAND_SECTIONS.get(command, ())
    extra = [o for o in TINY if o.split("=")[0] in reads or o.split(".")[0] in reads]
    return extra + (TINY_MODEL if command in FROM_SCRATCH else [])


def user_files(root: Path) -> None:
    """The files the pages assume the user has, in the formats docs/data.md documents: the records
    the README's reward example names (``{"prompt": "What is 2+2?", "answer": "4"}``, with the
    ``secret`` docs/environments.md's ``Guess`` reads), the reward module and environment the
    pages show, and the tiny models of :data:`STAND_INS`."""
    sums = [(a, b) for a in range(1, 5) for b in range(1, 5)]
    prompts = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b), "secret": (a + b) % 9 + 1} for a, b in sums]
    sft = [{"prompt": r["prompt"], "completion": " " + r["answer"]} for r in prompts]
    prefs = [{"prompt": r["prompt"], "chosen": " " + r["answer"], "rejected": " 0"} for r in prompts]
    files = {"prompts.jsonl": prompts, "held.jsonl": prompts[:4], "sft.jsonl": sft, "prefs.jsonl": prefs,
             "prefs_held.jsonl": prefs[:4]}
    for name, records in files.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, defines in (("myreward.py", "correct"), ("guess.py", "Guess")):
        (root / name).write_text(next(b for p in PAGES for b in _blocks((ROOT / p).read_text(), ("python",))
                                      if f"def {defines}(" in b or f"class {defines}(" in b))
    for arch in {arch for arch, _ in STAND_INS.values()}:
        save_tiny(root / arch, arch, chat_tokenizer())


def run_python_block(block: str, where: str) -> None:
    """A Python example: every ``rlhfkit.COMMAND(...)`` call gets the tiny overrides as well."""
    tree = ast.parse(block)
    for call in ast.walk(tree):
        func = getattr(call, "func", None)
        if isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "rlhfkit":
            command = {"reward_model": "rm", "evaluate": "eval"}.get(func.attr, func.attr)
            values = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in tiny(command))}
            extra = ast.parse(repr(values), mode="eval").body  # typed, as a YAML file gives them
            shown = next((k for k in call.keywords if k.arg == "overrides"), None)
            if shown is None:
                call.keywords.append(ast.keyword("overrides", extra))
            else:  # the shown overrides, then the tiny ones
                shown.value = ast.Dict([None, None], [shown.value, extra])
    exec(compile(ast.fix_missing_locations(tree), where, "exec"), {"__name__": "__docs__"})


def run_shell_line(line: str, where: str, models: dict[str, Path], monkeypatch) -> None:
    """One shown shell line: an ``rlhfkit`` command through the CLI's entry point (``chat`` reads two
    lines from stdin), a ``python`` script in a subprocess, or one of :data:`NOT_RUN`."""
    if any(line.startswith(start) for start in NOT_RUN):
        return
    for shown, stand_in in models.items():
        line = line.replace(shown, f"model.name={stand_in}")
    if line.startswith("python "):
        done = subprocess.run([sys.executable, *shlex.split(line)[1:]], capture_output=True, text=True)
        assert done.returncode == 0, f"{where}: {line}\n{done.stderr[-2000:]}"
        return
    args = shown_command(line)
    assert args is not None, f"{where}: a shown line this test does not know how to run: {line}"
    argv = shlex.split(args)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2+2?\n/quit\n"))
    assert cli.main([*argv, *tiny(argv[0])]) == 0, f"{where}: rlhfkit {args}"


def user_directory(tmp_path: Path, name: str, monkeypatch) -> dict[str, Path]:
    """The working directory of a section, made with the user's files and ``examples/`` the first
    time; the stand-ins for :data:`STAND_INS`."""
    root = tmp_path / re.sub(r"\W+", "-", name)
    if not root.exists():
        root.mkdir()
        (root / "examples").symlink_to(ROOT / "examples")
        user_files(root)
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))  # `from myreward import correct`, as from the user's directory
    return {shown: root / arch for shown, (arch, _) in STAND_INS.items()}


def follow(page: str, tmp_path: Path, monkeypatch, only=None) -> None:
    """Run the page's steps in order (``only``: the sections to run; every other one otherwise
    skips :data:`REAL`)."""
    sections, models = set(), {}
    for section, kind, text in steps(ROOT / page):
        if section not in only if only else (page, section) in REAL:
            continue
        where = f"{page}, {section!r}"
        if section not in sections:
            sections.add(section)
            models = user_directory(tmp_path, CONTINUES.get((page, section), section), monkeypatch)
            for command in GIVEN.get((page, section), []):
                run_shell_line(f"rlhfkit {command}", where, models, monkeypatch)
        if kind == "python":
            run_python_block(text, where)
        else:
            run_shell_line(text, where, models, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_shown_command_runs_in_order(page, tmp_path, monkeypatch):
    follow(page, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("page, section", sorted(REAL))
def test_the_real_model_recipes_run(page, section, tmp_path, monkeypatch):
    try:
        fetch.fetch_model("smollm2-135m-instruct")  # converted once per machine; the recipe converts again
    except fetch.FetchError as e:
        msg = f"smollm2-135m-instruct cannot be fetched ({e}) -- the real-model recipes NOT run"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    follow(page, tmp_path, monkeypatch, only={section})


def test_what_is_not_run_is_named_and_still_shown():
    """Every shown line is an ``rlhfkit`` command, a ``python`` script or in :data:`NOT_RUN`, and
    every entry of the tables above still names something a page shows (no stale excuses)."""
    shown = {(p, section, text) for p in PAGES for section, kind, text in steps(ROOT / p) if kind == "sh"}
    lines = {line for _, _, line in shown}
    for line in lines:
        assert shown_command(line) or line.startswith("python ") or any(line.startswith(s) for s in NOT_RUN), line
    assert all(any(line.startswith(start) for line in lines) for start in NOT_RUN)
    assert all(any(placeholder in line for line in lines) for placeholder in STAND_INS)
    sections = {(page, section) for page, section, _ in shown}
    assert set(REAL) | set(GIVEN) | set(CONTINUES) <= sections
    assert {(page, earlier) for (page, _), earlier in CONTINUES.items()} <= sections
