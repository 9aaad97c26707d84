"""The RL trainer reads as one loop: trainers/rl.py holds the steps, short and in order, the
walkthrough names them as they are, and each input check runs once per run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "rlhfkit"
LOOP_FILES = [*sorted((PKG / "trainers").glob("*.py")), *sorted((PKG / "cli").glob("*.py")),
              *(PKG / f"{name}.py" for name in ("run/checkpoint", "run/watch", "rollout/evaluate", "run/distributed", "api"))]


def functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def calls_in_order(fn: ast.FunctionDef) -> list[str]:
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return [n.func.id for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def test_the_rl_trainer_is_the_loop_in_short_functions():
    rl = PKG / "trainers" / "rl.py"
    assert len(rl.read_text(encoding="utf-8").splitlines()) <= 400
    long = {f"{p.name}:{name}": fn.end_lineno - fn.lineno + 1 for p in LOOP_FILES
            for name, fn in functions(p).items() if fn.end_lineno - fn.lineno + 1 > 80}
    assert long == {}
    # set-up in one call, then the step's phases, the checkpoint and the final save
    steps = [c for c in calls_in_order(functions(rl)["train_rl"]) if c not in ("fault_point",)]
    assert steps == ["setup_rl", "rl_step", "log_step", "save_checkpoint", "finish_rl"]
    phases = calls_in_order(functions(rl)["rl_step"])
    assert [c for c in phases if c in ("rollout", "make_experience", "update_step")] == \
        ["rollout", "make_experience", "update_step"]
    assert "ppo_update" in calls_in_order(functions(rl)["update_step"])


def test_the_walkthrough_names_the_loop_as_it_is():
    """Every ``trainers/...py:name`` of docs/ppo_walkthrough.md exists there, and its opening
    names the loop's functions in the order train_rl calls them."""
    text = (ROOT / "docs" / "ppo_walkthrough.md").read_text(encoding="utf-8")
    for module, name in set(re.findall(r"trainers/(\w+)\.py:(\w+)", text)):
        assert name in functions(PKG / "trainers" / f"{module}.py") or \
            re.search(rf"^(class )?{name}\b", (PKG / "trainers" / f"{module}.py").read_text(), re.M), (module, name)
    opening = text[: text.index("## 1.")]
    order = ["setup_rl", "rollout", "generate", "make_experience", "update_step", "ppo_update", "log_step",
             "save_checkpoint", "finish_rl"]
    where = [opening.find(f":{name}`") for name in order]
    assert -1 not in where and where == sorted(where), dict(zip(order, where))


def score(completions, **kwargs):
    return [0.0] * len(completions)


def test_grpo_and_eval_check_their_reward_function_once(tiny_models, tiny_config, tmp_path, monkeypatch, no_plots):
    """The prompt file and reward checks run before the heavy imports (cli.run_command), not again
    in the trainer or the evaluation: one check of the reward function's call per run."""
    import rlhfkit.api
    import rlhfkit.callables

    checked, real = [], rlhfkit.callables.check_call

    def counted(fn, columns):
        checked.append(fn)
        return real(fn, columns)

    monkeypatch.setattr(rlhfkit.callables, "check_call", counted)
    cfg = tiny_config(tmp_path / "grpo", model={"name": tiny_models.policy}, reward={"function": score},
                      ppo={"steps": 1})
    rlhfkit.api.grpo(cfg)
    assert checked == [score]
    checked.clear()
    rlhfkit.api.evaluate(tiny_models.policy, tiny_config(tmp_path / "eval"), data=[{"prompt": "12x2="}],
                     reward_funcs=score)
    assert checked == [score]
