"""The reward-hacking watch: each sign flags its steps, warns once, survives a checkpoint, and
the report marks the flagged steps."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from rlhfkit.config import PPOConfig
from rlhfkit.report import build_report
from rlhfkit.trainers.rl import train_rl
from rlhfkit.utils import read_jsonl
from rlhfkit.watch import KEYS, HackingWatch


def _steps(watch, rows):
    return [watch.check(i, r) for i, r in enumerate(rows)]


# --------------------------------------------------------------------------- simulated runs
# Healthy and hacking-like runs simulated 1000 at a time: the watch takes arrays of runs stepping
# together, so the checks below run the watch's own code, 100 calls per setting.
RUNS, STEPS, EVAL_EVERY = 1000, 100, 5
DEFAULTS = PPOConfig()


def _watch(batch_size: int = 64, kl: float = DEFAULTS.guard_kl, eos: float = DEFAULTS.guard_eos,
           drop: float = DEFAULTS.guard_eval_drop) -> HackingWatch:
    return HackingWatch(kl, eos, drop, "eval/exact_acc", batch_size)


def _flagged(watch: HackingWatch, series: dict[str, np.ndarray], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Feed ``series`` (each ``[STEPS, RUNS]``; ``eval/exact_acc`` read every EVAL_EVERY steps) to
    the watch: which runs raised ``key`` at least once, and the first step each did (-1: never)."""
    fired, first = np.zeros(RUNS, bool), np.full(RUNS, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # arrays of runs: no per-run messages
        for step in range(STEPS):
            stats = {k: v[step] for k, v in series.items() if k != "eval/exact_acc" or (step + 1) % EVAL_EVERY == 0}
            on = np.asarray(watch.check(step, stats)[key], bool)
            first = np.where(on & ~fired, step, first)
            fired |= on
    return fired, first


def _ramp(start: float, end: float, before: int, over: int) -> np.ndarray:
    """``[STEPS, 1]``: ``start`` for ``before`` steps, linear to ``end`` over ``over`` steps, then ``end``."""
    return np.concatenate([np.full(before, start), np.linspace(start, end, over + 1)[1:],
                           np.full(STEPS - before - over, end)])[:, None]


@pytest.mark.parametrize("batch", [8, 64])
@pytest.mark.parametrize("p", [0.3, 0.5, 0.9])
def test_a_constant_eos_rate_rarely_raises_the_eos_guard(batch, p):
    """At a constant EOS probability the rate is binomial noise: <= 1% of 100-step runs flag. The
    first-batch rule flagged 60 of 200 runs at batch 64, p 0.3 and 178 of 200 at batch 8, p 0.5."""
    eos = np.random.default_rng(batch + int(10 * p)).binomial(batch, p, (STEPS, RUNS)) / batch
    fired, _ = _flagged(_watch(batch), {"response/eos_rate": eos}, "guard/eos_collapse")
    assert fired.mean() <= 0.01


@pytest.mark.parametrize("batch", [8, 64])
def test_an_eos_collapse_is_flagged_within_steps(batch):
    """Hacking-like: the EOS rate falls from 0.95 to 0.2 over steps 30-50 (a policy whose reward
    likes answers cut short; ppo.missing_eos_penalty's case). Every run flags, by step 55."""
    eos = np.random.default_rng(batch).binomial(batch, _ramp(0.95, 0.2, 30, 20), (STEPS, RUNS)) / batch
    fired, first = _flagged(_watch(batch), {"response/eos_rate": eos}, "guard/eos_collapse")
    assert fired.all() and first.max() <= 55 and first.min() >= 34


@pytest.mark.parametrize("per_token,length", [(0.03, 512.0), (0.8, 6.0), (0.3, 50.0)])
def test_a_healthy_kl_does_not_raise_the_kl_guard_whatever_the_length(per_token, length):
    """Healthy per-token KLs, noisy (log-normal, 30%) around their level: a chat model's 0.03
    nats/token over 512 tokens (15 nats: the per-sequence bound of 10 flagged every step) and the
    doubling task's healthy peak, ~0.8 nats/token over ~6 tokens (4.6 nats, the robustness
    table of benchmarks/README-0.1.0-measurements.md). None flags."""
    kl = per_token * np.random.default_rng(1).lognormal(0.0, 0.3, (STEPS, RUNS)) * length
    fired, _ = _flagged(_watch(), {"objective/kl": kl, "response/length": np.full((STEPS, RUNS), length)},
                        "guard/kl_high")
    assert fired.mean() <= 0.01


def test_a_kl_blow_up_is_flagged():
    """Hacking-like, after the GRPO collapses of the robustness section of
    benchmarks/README-0.1.0-measurements.md (group-std scaling, beta 0.05, seed 10: per-sequence KL
    17 and 25 nats, measured again at commit caa43df as 3.1 and 4.3 nats/token at the peak, rising
    from ~0.5 over about 40 steps; the real runs flagged at steps 58 and 49): the per-token KL
    rises from 0.5 to 3.5 over steps 30-50. Every run flags."""
    kl_token = _ramp(0.5, 3.5, 30, 20) * np.random.default_rng(2).lognormal(0.0, 0.3, (STEPS, RUNS))
    fired, first = _flagged(_watch(), {"objective/kl": 6.0 * kl_token, "response/length": np.full((STEPS, RUNS), 6.0)},
                            "guard/kl_high")
    assert fired.all() and first.max() <= 50


@pytest.mark.parametrize("prompts", [64, 512])
@pytest.mark.parametrize("p", [0.3, 0.5, 0.9])
def test_a_steady_held_out_accuracy_rarely_raises_the_eval_guard(prompts, p):
    """Held-out accuracy over ``prompts`` greedy answers at a constant success probability
    (binomial), every 5 steps: <= 1% of runs flag, also where a 15% relative drop is within one
    evaluation's noise (64 prompts at 0.3: std 0.057)."""
    rng = np.random.default_rng(prompts + int(10 * p))
    series = {"eval/exact_acc": rng.binomial(prompts, p, (STEPS, RUNS)) / prompts,
              "objective/score": rng.normal(1.0, 0.1, (STEPS, RUNS))}
    fired, _ = _flagged(_watch(), series, "guard/eval_drop")
    assert fired.mean() <= 0.01


@pytest.mark.parametrize("prompts,share", [(64, 0.8), (512, 1.0)])
@pytest.mark.parametrize("trace", ["plateau", "learned"])
def test_a_held_out_collapse_is_flagged(prompts, share, trace):
    """Hacking-like: held-out accuracy falls from 0.95 to 0.6 over steps 40-60 while the training
    score keeps rising (the over-optimisation the robustness section of
    benchmarks/README-0.1.0-measurements.md found: GRPO on the
    learned rewards fell to 0.03 and 0.09 held-out exact by step 100; a milder fall here). 'learned':
    the run first climbs from 0.3 over 30 steps, whose own steps raise the noise estimate. On the
    doubling task's 512 held-out prompts every run flags; on 64 prompts at least 80% (all of the
    'plateau' runs, 84% of the 'learned' ones: there one evaluation's noise is 0.03-0.06)."""
    acc = _ramp(0.95, 0.6, 40, 20) if trace == "plateau" else np.concatenate(
        [np.linspace(0.3, 0.95, 30)[:, None], _ramp(0.95, 0.6, 10, 20)[: STEPS - 30]])
    rng = np.random.default_rng(prompts)
    series = {"eval/exact_acc": rng.binomial(prompts, acc, (STEPS, RUNS)) / prompts,
              "objective/score": np.linspace(0.0, 2.0, STEPS)[:, None] + rng.normal(0, 0.1, (STEPS, RUNS))}
    fired, first = _flagged(_watch(), series, "guard/eval_drop")
    assert fired.mean() >= share and first[fired].min() >= 40


def test_the_first_step_alone_no_longer_raises_the_eos_guard():
    """The single-batch rule: a first batch at 0.45 and a second at 0.2 flagged at once."""
    w = HackingWatch(10, 0.5, 0.2)
    assert w.check(0, {"response/eos_rate": 0.45}) == {"guard/kl_high": 0.0, "guard/eos_collapse": 0.0,
                                                       "guard/eval_drop": 0.0, "guard/reward_tradeoff": 0.0}
    assert w.check(1, {"response/eos_rate": 0.2})["guard/eos_collapse"] == 0.0


def _sources(p_fact: np.ndarray, p_short: np.ndarray, prompts: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Held-out evaluations of two 0/1-like reward sources, ``fact`` and ``short`` (each
    ``[STEPS, RUNS]``, binomial over ``prompts`` greedy answers), and their total (weights 1, 1);
    the baseline is one more such draw at the starting probabilities."""
    rng = np.random.default_rng(seed)
    draw = lambda p: rng.binomial(prompts, np.broadcast_to(p, (STEPS, RUNS))) / prompts  # noqa: E731
    fact, short = draw(p_fact), draw(p_short)
    b_fact, b_short = (rng.binomial(prompts, np.broadcast_to(p[0], (RUNS,))) / prompts for p in (p_fact, p_short))
    return {"eval/reward/fact": fact, "eval/reward/short": short, "eval/reward": fact + short,
            "baseline/eval/reward/fact": b_fact, "baseline/eval/reward/short": b_short,
            "baseline/eval/reward": b_fact + b_short}


def _tradeoff_flagged(series: dict[str, np.ndarray], prompts: int) -> tuple[np.ndarray, np.ndarray]:
    watch = HackingWatch(tradeoff=DEFAULTS.guard_tradeoff, eval_prompts=prompts)
    fired, first = np.zeros(RUNS, bool), np.full(RUNS, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(STEPS):
            stats = {k: v for k, v in series.items() if k.startswith("baseline/")} if step == 0 else {}
            if (step + 1) % EVAL_EVERY == 0:
                stats.update({k: v[step] for k, v in series.items() if not k.startswith("baseline/")})
            on = np.asarray(watch.check(step, stats)["guard/reward_tradeoff"], bool)
            first = np.where(on & ~fired, step, first)
            fired |= on
    return fired, first


@pytest.mark.parametrize("prompts", [32, 128])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.56, 0.9])
def test_steady_reward_sources_rarely_raise_the_tradeoff_guard(prompts, p):
    # a healthy run: the fact source holds at p, the other one rises (the total rises with it).
    # Each evaluation an independent binomial draw, the baseline one too: harsher than greedy
    # answers of a slowly moving policy. With 16 held-out prompts, p = 0.56: 1.7% of runs
    fired, _ = _tradeoff_flagged(_sources(np.full((STEPS, 1), p), _ramp(0.1, 0.9, 0, 50), prompts), prompts)
    assert fired.mean() <= 0.01


@pytest.mark.parametrize("prompts", [32, 128])
def test_a_source_bought_with_another_raises_the_tradeoff_guard(prompts):
    # the capital-city task's gaming: answers turn short (0.15 -> 0.95) and drop the fact (0.56 -> 0.1)
    series = _sources(_ramp(0.56, 0.1, 5, 10), _ramp(0.15, 0.95, 5, 10), prompts)
    fired, first = _tradeoff_flagged(series, prompts)
    # by the second evaluation after the fall (steps 14, 19); 32 prompts: 93% of runs, 128: all
    assert fired.mean() >= (0.9 if prompts == 32 else 0.99) and np.median(first[fired]) <= 19
    # the same fall with the total falling too is a collapse, not a trade (the other guards' case)
    fired, _ = _tradeoff_flagged(_sources(_ramp(0.56, 0.1, 5, 10), np.full((STEPS, 1), 0.15), prompts), prompts)
    assert not fired.any()


def test_the_tradeoff_message_names_the_fallen_source_and_resumes():
    rows = [{"baseline/eval/reward": 0.72, "baseline/eval/reward/contains": 0.56, "baseline/eval/reward/brevity": 0.16}]
    rows += [{} for _ in range(9)] + [{"eval/reward": 1.0, "eval/reward/contains": 0.12, "eval/reward/brevity": 0.88}]
    rows += [{} for _ in range(9)] + [{"eval/reward": 1.1, "eval/reward/contains": 0.09, "eval/reward/brevity": 0.95}]
    w = HackingWatch(tradeoff=0.3, eval_prompts=32)
    with pytest.warns(RuntimeWarning) as caught:
        flags = [w.check(t, r)["guard/reward_tradeoff"] for t, r in enumerate(rows)]
    assert [t for t, f in enumerate(flags) if f] == [20]  # two evaluations: 0.105 < 0.7 * 0.56, 0.455 > 3.5 se
    (msg,) = (str(c.message) for c in caught)
    assert msg.startswith("step 20:") and "contains 0.56 -> 0.10" in msg and "reward.weights" in msg
    cut = HackingWatch(tradeoff=0.3, eval_prompts=32)
    for t, r in enumerate(rows[:12]):
        cut.check(t, r)
    again = HackingWatch(tradeoff=0.3, eval_prompts=32)
    again.load_state_dict(json.loads(json.dumps(cut.state_dict())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [again.check(12 + t, r)["guard/reward_tradeoff"] for t, r in enumerate(rows[12:])] == flags[12:]


# --------------------------------------------------------------------------- one run


def _run_rows() -> list[dict]:
    """A 40-step run: healthy for 20 steps (KL 0.2 nats/token over 6 tokens, EOS 0.95, held-out
    0.9 every 5 steps), then the KL climbs to 3 nats/token, the EOS rate drops to 0.1 and the
    held-out accuracy to 0.5 while the score rises."""
    rows = []
    for t in range(40):
        bad = t >= 20
        row = {"objective/kl": 6 * (3.0 if bad else 0.2) + 0.01 * (t % 3), "response/length": 6.0,
               "response/eos_rate": (0.1 if bad else 0.95) - 0.01 * (t % 2), "objective/score": 0.1 * t}
        if (t + 1) % 5 == 0:
            row["eval/exact_acc"] = (0.5 if t >= 25 else 0.9) + 0.01 * (t % 3)
        rows.append(row)
    return rows


def test_each_sign_flags_its_steps_and_warns_once():
    w = HackingWatch(kl_max=1.5, eos_ratio=0.5, eval_drop=0.15, metric="eval/exact_acc", batch_size=64)
    rows = _run_rows()
    with pytest.warns(RuntimeWarning) as caught:
        flags = _steps(w, rows)
    on = {k: [t for t, f in enumerate(flags) if f[k]] for k in KEYS}
    # a 5-step window: the KL mean passes 1.5 once 3 of its 5 steps are bad (3 * 3 + 2 * 0.2 > 7.5)
    assert on["guard/kl_high"] == list(range(22, 40))
    # EOS: the window mean falls below 0.5 * 0.95 at the third bad step, far beyond the binomial noise
    assert on["guard/eos_collapse"] == list(range(22, 40))
    # held-out, at steps 4, 9, ..., 39: 0.91 0.90 0.92 0.91 0.90 | 0.52 0.51 0.50. Means of three:
    # best 0.91 (limit 0.85 * 0.91 = 0.7735); step 29: 0.777, not below; step 34: 0.643, below, but
    # the noise (mean |step| 0.44 / 6 / 1.128 = 0.065) times 4.5 is 0.293 > 0.91 - 0.643; step 39:
    # 0.51, 0.40 below the best against 4.5 * 0.45 / 7 / 1.128 = 0.256: flagged
    assert on["guard/eval_drop"] == [39]
    assert len(caught) == 3  # one warning per sign, not per step
    kl, eos, drop = (str(c.message) for c in caught)
    assert kl.startswith("step 22:") and "nats per token" in kl and "ppo.guard_kl=1.5" in kl
    assert "first 10 steps: 0.94" in eos and "ppo.missing_eos_penalty" in eos
    assert "mean of the last 3 evaluations" in drop and "training score rose" in drop


def test_the_watch_resumes_where_it_was():
    rows = _run_rows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = HackingWatch(1.5, 0.5, 0.15)
        want = _steps(whole, rows)
        for cut in (3, 12, 24, 31):
            first = HackingWatch(1.5, 0.5, 0.15)
            _steps(first, rows[:cut])
            second = HackingWatch(1.5, 0.5, 0.15)
            second.load_state_dict(json.loads(json.dumps(first.state_dict())))
            got = want[:cut] + [second.check(cut + i, r) for i, r in enumerate(rows[cut:])]
            assert got == want and second.warned == whole.warned
    old = {"first_eos": 0.9, "best": 0.8, "score_at_best": 0.1, "warned": ["guard/kl_high"]}  # single-batch guards
    w = HackingWatch(1.5, 0.5, 0.15)
    w.load_state_dict(old)
    assert w.warned == ["guard/kl_high"] and w.eos_anchor == []


def test_a_guard_that_cannot_act_says_so_at_the_start():
    tasks = {"eval/format_acc", "eval/exact_acc"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HackingWatch(1.5, 0.5, 0.15).announce(tasks, 40) == []  # the defaults on a built-in task
    with pytest.warns(RuntimeWarning, match="guards off") as caught:
        off = HackingWatch(0.0, 0.5, 0.15).announce({"eval/reward", "eval/accuracy"}, 40)
    assert len(caught) == 1
    assert off == ["guard/kl_high (ppo.guard_kl=0)",
                   "guard/eval_drop (this run does not log ppo.stop_metric=eval/exact_acc; it logs eval/accuracy, "
                   "eval/reward: set ppo.stop_metric to one of them)"]
    with pytest.warns(RuntimeWarning, match="set data.eval_path"):
        HackingWatch(1.5, 0.5, 0.15).announce(set(), 40)
    with pytest.warns(RuntimeWarning, match="1 evaluation"):
        HackingWatch(1.5, 0.5, 0.15).announce(tasks, 1)
    with pytest.warns(RuntimeWarning, match=r"guard/eos_collapse \(ppo.guard_eos=0\)"):
        HackingWatch(1.5, 0.0, 0.15).announce(None)


def test_a_prompt_file_run_names_its_eval_metrics():
    """What the stop metric is checked against: the task's verifier, or the rewards on held-out prompts."""
    from rlhfkit.rewards import Reward
    from rlhfkit.trainers.rl import eval_metrics

    binary = lambda *a: None  # noqa: E731
    binary.binary = True
    reward = Reward([("exact", 1.0, binary), ("rm", 0.5, lambda *a: None)])
    assert eval_metrics(SimpleNamespace(task=object(), eval_records=[]), reward) == {"eval/format_acc",
                                                                                    "eval/exact_acc"}
    assert eval_metrics(SimpleNamespace(task=None, eval_records=[]), reward) == set()
    assert eval_metrics(SimpleNamespace(task=None, eval_records=[1]), reward) == {
        "eval/reward", "eval/reward/exact", "eval/reward/rm", "eval/accuracy"}


def test_a_run_logs_the_flags_and_the_report_marks_them(tiny_models, tiny_config, tmp_path, no_plots):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "steps": 7, "guard_kl": 1e-12, "lr": 1e-2})  # any mean KL above 0
    with pytest.warns(RuntimeWarning, match="may be gaming its reward"):
        train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    flagged = [r["step"] for r in rows if r["guard/kl_high"] == 1.0]
    assert flagged and all(r["objective/kl"] > 0 for r in rows if r["step"] in flagged)
    html = build_report(tmp_path / "run")
    assert 'class="hack"' in html and "Signs of reward hacking" in html
    assert f"at steps {', '.join(str(s) for s in flagged)}" in html
