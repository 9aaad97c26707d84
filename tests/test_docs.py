"""The documentation cannot rot: the config reference the site renders lists every key of rlhfkit.config
with the type, default and range the code enforces, the README stays a README, and every
``rlhfkit ...`` command shown in the README and the site's pages parses with today's keys."""

from __future__ import annotations

import ast
import html
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from rlhfkit import config
from rlhfkit.cli import main as cli
from rlhfkit.trainers.rl_setup import check_rl_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells, split on the pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


@pytest.fixture(scope="module")
def reference_rows() -> dict[str, list[str]]:
    """``{dotted key: [key, type, default, accepts, description]}`` from the rendered page."""
    rows = {}
    for line in _hooks().render_config_reference().splitlines():
        cells = _cells(line) if line.startswith("| `") else []
        if len(cells) == 5:
            rows[cells[0].strip("`")] = [html.unescape(c) for c in cells]  # as the browser shows it
    return rows


def test_config_reference_lists_every_key_of_config_py(reference_rows):
    written_as = {v: k for k, v in config.KEY_ALIASES.items()}  # env.cls is env.class on the command line
    expected = {written_as.get(f"{s}.{k}", f"{s}.{k}") for s, keys in config.key_types().items() for k in keys}
    assert set(reference_rows) == expected
    assert len(expected) > 150  # every section, not one of them


def test_config_reference_rows_hold_the_codes_type_default_range_and_help(reference_rows):
    # written out by hand from rlhfkit.config, so a renderer that shifts a column fails
    key, type_, default, accepts, doc = reference_rows["ppo.top_p"]
    assert (type_, default, accepts) == ("float", "`1.0`", "> 0, <= 1")
    assert doc.startswith("Nucleus sampling")
    assert reference_rows["ppo.group_size"][3] == ">= 2"
    assert reference_rows["accel.threads"][3] == ">= 0"
    assert reference_rows["ppo.kl_estimator"][1] == "'k1' \\| 'k2' \\| 'k3'"  # pipes escaped: one cell
    assert reference_rows["ppo.max_new_tokens"][2] == "unset"
    assert reference_rows["env.class"][2] == "`''`"


def test_config_reference_groups_the_ppo_keys_under_their_concern():
    """The ppo section's table is split by concern, each under its heading, in the config's order."""
    lines = _hooks().render_config_reference().splitlines()
    start = lines.index("## ppo")
    section = lines[start: lines.index("## value")]
    headings = [line.removeprefix("### ") for line in section if line.startswith("### ")]
    assert headings == [h for h, _, _ in config.key_groups()["ppo"]]
    assert {"Sampling", "Loss", "KL", "Guards"} <= set(headings)
    row = next(i for i, line in enumerate(section) if line.startswith("| `ppo.temperature` |"))
    assert section.index("### Sampling") < row < section.index("### Rewards")
    assert not [line for line in lines[:start] if line.startswith("### ")]  # other sections: one table


def test_config_reference_shows_each_rl_commands_defaults():
    page = _hooks().render_config_reference()
    grpo = next(line for line in page.splitlines() if line.startswith("| `rlhfkit grpo` |"))
    assert _cells(grpo)[1:] == [f"`{config.ALGO_DEFAULTS['grpo'][k]!r}`" for k in config.ALGO_KEYS]


def test_readme_is_a_readme():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert hashes == [], f"commit hashes in the README: {hashes}"


def _blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    """The fenced code blocks of a Markdown text in one of ``languages`` ('' for no language)."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks += ["\n".join(lines)] if lang in languages else []
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def shown_command(line: str) -> str | None:
    """The arguments of a shown ``rlhfkit ...`` line, comment dropped (None for another line);
    ``accelerate launch ... -m rlhfkit CMD`` and ``torchrun`` give their command."""
    found = re.search(r"(?:^|-m )rlhfkit (\S.*)$", line.split(" #")[0].strip())
    return " ".join(found.group(1).split()) if found else None


def _shown_commands(path: Path) -> list[str]:
    """Every ``rlhfkit ...`` command line of the file's shell blocks, continuation lines joined."""
    blocks = _blocks(path.read_text(encoding="utf-8"), ("bash", "sh", ""))
    return [c for block in blocks for c in map(shown_command, block.replace("\\\n", " ").splitlines()) if c]


# the functions the README and the pages define in their Python examples (a user's reward module)
SHOWN_FUNCTIONS = {n.name for p in [README, *PAGES] for b in _blocks(p.read_text(encoding="utf-8"), ("python",))
                   for n in ast.walk(ast.parse(b)) if isinstance(n, ast.FunctionDef)}


def _check_reward_spec(spec: str) -> None:
    for entry in spec.split(","):
        module, _, name = entry.partition(":")
        if module.endswith(".py"):
            tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
            assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, entry
        elif module.startswith("rlhfkit."):
            assert callable(getattr(importlib.import_module(module), name)), entry
        else:  # a user's module: the README or a page must show the function
            assert name in SHOWN_FUNCTIONS, entry


def _check_command(line: str) -> None:
    args = cli._parser().parse_args(shlex.split(line))
    if args.command not in cli.COMMAND_SECTIONS:  # fetch-model, report: nothing to resolve
        return
    cfg = cli._config(args)
    if args.command in config.ALGO_DEFAULTS:  # what an RL command refuses before loading anything
        check_rl_config(cfg, cfg.model.name)
    if cfg.reward.function:
        _check_reward_spec(cfg.reward.function)


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shown_command_parses(path, monkeypatch):
    """A renamed or mistyped key in a shown command fails here, not for the user who copies it."""
    monkeypatch.chdir(ROOT)  # --config examples/... and reward files are relative to the repository
    for line in _shown_commands(path):
        try:
            _check_command(line)
        except (SystemExit, ValueError, OSError, AssertionError) as e:  # ConfigError is a ValueError
            pytest.fail(f"{path.name}: rlhfkit {line}: {e!r}")


def test_readme_recipes_are_found():
    commands = _shown_commands(README)
    for needed in ("demo", "grpo model.name=runs/sft/policy data.path=prompts.jsonl", "dpo model.name=runs/sft/policy",
                   "fetch-model smollm2-135m-instruct", "grpo model.name=models/smol model.lora_r=16"):
        assert any(c.startswith(needed) for c in commands), needed


def test_every_example_path_the_readme_names_exists():
    text = README.read_text(encoding="utf-8")
    paths = set(re.findall(r"\b((?:examples|benchmarks|docs)/[\w./-]+\w)", text))
    assert paths and [p for p in paths if not (ROOT / p).exists()] == []


def _run_snippets(*names: str) -> dict:
    """Execute the Python blocks of the README and the pages that define ``names``; their globals."""
    scope: dict = {}
    for path in [README, *PAGES]:
        for block in _blocks(path.read_text(encoding="utf-8"), ("python",)):
            defined = {n.name for n in ast.parse(block).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            if defined & set(names):
                exec(compile(block, str(path), "exec"), scope)
    return scope


def test_the_shown_reward_function_scores_as_described():
    correct = _run_snippets("correct")["correct"]
    scores = correct(prompts=["2+2?"] * 3, completions=["4", " 4 ", "5"], completion_ids=[[1], [1], [2]],
                     finished=[True, False, True], answer=["4", "4", "4"])
    assert scores == [1.0, 0.0, 0.0] and correct.binary is True  # the second was cut: not finished


def test_the_shown_environments_play_an_episode():
    from rlhfkit.data.prompts import PromptRecord

    scope = _run_snippets("Guess", "Calculator")
    guess = scope["Guess"]()
    assert guess.reset(PromptRecord("", {"secret": 7}))[0]["role"] == "user"
    assert guess.step("3") == ({"role": "user", "content": "No."}, -0.1, False)
    assert guess.step(" 7") == (None, 1.0, True)
    calc = scope["Calculator"]()
    calc.reset(PromptRecord("What is 3 * 4?", {"product": 12}))
    assert (calc.reward("12"), calc.reward("13")) == (1.0, 0.0)
    assert scope["multiply"](3, 4) == 12


def test_the_api_pages_example_is_one_grpo_runs():
    block = _blocks((ROOT / "docs/reference/api.md").read_text(encoding="utf-8"), ("python",))[0]
    scope: dict = {}
    exec(block.split("summary = ")[0], scope)  # everything but the training run itself
    assert "rlhfkit.grpo(data=prompts, reward_funcs=[exact_answer], overrides=settings)" in block
    reward = scope["exact_answer"]
    cfg = cli.resolve_config("grpo", None, {**scope["settings"], "reward.function": [reward]})
    assert (cfg.ppo.algo, cfg.ppo.steps, cfg.ppo.kl_coef) == ("grpo", 20, config.algo_defaults("grpo", lora=True)["kl_coef"])
    check_rl_config(cfg, cfg.model.name)
    prompts = scope["prompts"]
    assert reward([p["prompt"] for p in prompts], [" 4", "5"], answer=[p["answer"] for p in prompts]) == [1.0, 0.0]


def test_design_page_names_every_module_of_the_layer_map():
    """docs/design.md's layer table and tests/test_layers.py's map name the same modules."""
    spec = importlib.util.spec_from_file_location("layers_map", ROOT / "tests" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    table = "\n".join(line for line in (ROOT / "docs/design.md").read_text(encoding="utf-8").splitlines()
                      if line.startswith("| "))
    named = set(re.findall(r"`([\w.]+)`", table))
    mapped = {m for m in layers.LAYER_OF if m != "__main__"}
    assert mapped - named == set()


@pytest.mark.slow  # converts the real chat model once per machine when it is not cached yet
def test_the_command_fetch_model_suggests_runs(capsys):
    """``rlhfkit fetch-model`` ends with an example command: it must be one the RL commands accept."""
    if cli.main(["fetch-model", "smollm2-135m-instruct"]) != 0:
        pytest.skip("the real chat model cannot be fetched here (offline?)")
    hint = capsys.readouterr().out.splitlines()[-1]
    assert hint.startswith("e.g. rlhfkit grpo ")
    args = cli._parser().parse_args(shlex.split(hint.removeprefix("e.g. rlhfkit ")))
    cfg = cli._config(args)
    check_rl_config(cfg, cfg.model.name)


def test_the_home_page_lists_every_command():
    rows = [line for line in (ROOT / "docs/index.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `rlhfkit")]
    listed = {name for row in rows for name in re.findall(r"`(?:rlhfkit )?([\w-]+)`", _cells(row)[0])}
    assert listed == set(cli.COMMANDS)


def test_every_package_says_what_it_holds_and_the_design_page_lists_it():
    """Each subpackage of src/rlhfkit opens with a docstring of a few lines, and docs/design.md's
    package table has a row for it."""
    import ast

    page = (ROOT / "docs/design.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(\w+)` \|", page.split("## Packages", 1)[1].split("## Layers", 1)[0], re.M))
    packages = sorted(p.parent.name for p in (ROOT / "src/rlhfkit").glob("*/__init__.py"))
    for name in packages:
        doc = ast.get_docstring(ast.parse((ROOT / "src/rlhfkit" / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.splitlines()) <= 8, f"src/rlhfkit/{name}/__init__.py: a docstring of a few lines"
    assert set(packages) - rows == set(), "packages missing from docs/design.md's package table"
