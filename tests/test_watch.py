"""The reward-hacking watch: each sign flags its steps, warns once, survives a checkpoint, and
the report marks the flagged steps."""

from __future__ import annotations

import json
import warnings

import pytest

from rlhfkit.report import build_report
from rlhfkit.trainers.rl import train_rl
from rlhfkit.utils import read_jsonl
from rlhfkit.watch import HackingWatch


def _steps(watch, rows):
    return [watch.check(i, r) for i, r in enumerate(rows)]


def test_each_sign_flags_its_steps_and_warns_once():
    w = HackingWatch(kl_max=10.0, eos_ratio=0.5, eval_drop=0.2, metric="eval/exact_acc")
    rows = [
        {"objective/kl": 1.0, "response/eos_rate": 1.0, "objective/score": 0.1, "eval/exact_acc": 0.3},
        {"objective/kl": 12.0, "response/eos_rate": 0.9, "objective/score": 0.5},
        {"objective/kl": 15.0, "response/eos_rate": 0.4, "objective/score": 0.8, "eval/exact_acc": 0.8},
        {"objective/kl": 3.0, "response/eos_rate": 0.6, "objective/score": 0.9, "eval/exact_acc": 0.55},
        {"objective/kl": 3.0, "response/eos_rate": 0.6, "objective/score": 0.7, "eval/exact_acc": 0.5},
    ]
    with pytest.warns(RuntimeWarning) as caught:
        flags = _steps(w, rows)
    assert [f["guard/kl_high"] for f in flags] == [0, 1, 1, 0, 0]
    assert [f["guard/eos_collapse"] for f in flags] == [0, 0, 1, 0, 0]  # 0.4 < 0.5 * 1.0 only
    # step 3: 0.55 < best 0.8 - 0.2 with the score above its value at the best; step 4: score fell
    assert [f["guard/eval_drop"] for f in flags] == [0, 0, 0, 1, 0]
    assert len(caught) == 3  # one warning per sign, not per step
    assert "ppo.guard_kl" in str(caught[0].message) and "step 1" in str(caught[0].message)


def test_the_watch_resumes_where_it_was():
    rows = [{"objective/kl": k, "response/eos_rate": e, "objective/score": s, "eval/exact_acc": a}
            for k, e, s, a in [(1, 1.0, 0.1, 0.5), (20, 0.8, 0.4, 0.9), (2, 0.3, 0.9, 0.6), (30, 0.2, 1.0, 0.5)]]
    whole = HackingWatch(10, 0.5, 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _steps(whole, rows)
        first = HackingWatch(10, 0.5, 0.2)
        _steps(first, rows[:2])
        second = HackingWatch(10, 0.5, 0.2)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got = want[:2] + [second.check(i + 2, r) for i, r in enumerate(rows[2:])]
    assert got == want and second.warned == whole.warned


def test_a_run_logs_the_flags_and_the_report_marks_them(tiny_models, tiny_config, tmp_path, no_plots):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "steps": 3, "guard_kl": 1e-12})  # any KL at all counts
    with pytest.warns(RuntimeWarning, match="may be gaming its reward"):
        train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    flagged = [r["step"] for r in rows if r["guard/kl_high"] == 1.0]
    assert flagged and all(r["objective/kl"] > 0 for r in rows if r["step"] in flagged)
    html = build_report(tmp_path / "run")
    assert 'class="hack"' in html and "Signs of reward hacking" in html
    assert f"at steps {', '.join(str(s) for s in flagged)}" in html
