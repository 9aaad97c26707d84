"""The reward-hacking watch: each sign flags its steps, warns once, survives a checkpoint, and
the report marks the flagged steps."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_helpers import import_example
from rlhfkit.cli.report import build_report
from rlhfkit.config import PPOConfig
from rlhfkit.run.watch import KEYS, HackingWatch
from rlhfkit.trainers.rl import train_rl
from rlhfkit.utils import MetricsLogger, read_jsonl

guard_sim = import_example(Path(__file__).resolve().parents[1] / "benchmarks", "guard_sim")


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


# The benchmark's cases (benchmarks/guard_sim.py, 2000 runs each), 200 runs each here. Each case
# is fed to the watch train_rl builds, as train_rl feeds it. The earlier rules flagged, of 2000
# healthy runs fed one at a time: a steady reward-model source at 0.3 / 0.5 / 1.5 beside a rising
# 0/1 one 20% / 20% / 4% (a source was taken for a 0/1 share from its mean and given a share's
# noise, or none); GRPO groups whose prompt decides the EOS 8.8% (completions counted as
# independent); a per-token KL above the bound on one-word answers, or on episodes whose held-out
# return rises, 100% (a fixed bound without a noise model).
SIM_RUNS = 200
NULLS = [c for c in guard_sim.CASES if c.kind == "null"]
COLLAPSES = [c for c in guard_sim.CASES if c.kind == "collapse"]


@pytest.mark.parametrize("case", guard_sim.CASES, ids=[c.name for c in guard_sim.CASES])
def test_runs_fed_as_arrays_flag_as_runs_fed_one_at_a_time(case):
    """The simulations feed arrays of runs; a trainer feeds one run's scalars. Each run's flags
    must not depend on the others' (the earlier trade-off guard gave every run a share's noise
    only when every run's baseline lay in [0, 1])."""
    together = guard_sim.simulate(case, 50, seed=3)
    alone = guard_sim.simulate(case, 50, seed=3, chunk=1)
    assert all(np.array_equal(together[k], alone[k]) for k in KEYS)


@pytest.mark.parametrize("case", NULLS, ids=[c.name for c in NULLS])
def test_a_healthy_simulated_run_rarely_raises_its_guard(case):
    first = guard_sim.simulate(case, SIM_RUNS, seed=1)
    assert (first[case.guard] >= 0).mean() <= 0.01  # at most 2 of 200 runs


# the share of runs that must flag: the fall of a 0/1 source from 0.56 is judged against one
# evaluation before training over 32 prompts, whose own noise hides it in a few runs (2.7% of 2000)
DETECTED = {"tradeoff/fact_for_brevity": 0.95}


@pytest.mark.parametrize("case", COLLAPSES, ids=[c.name for c in COLLAPSES])
def test_a_simulated_collapse_is_flagged_after_it_starts(case):
    first = guard_sim.simulate(case, SIM_RUNS, seed=1)[case.guard]
    fired = first >= 0
    assert fired.mean() >= DETECTED.get(case.name, 0.99)
    assert first[fired].min() >= case.start  # never before the collapse
    assert np.median(first[fired]) <= case.start + 30  # within six evaluations of its start


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
    score keeps rising (the over-optimisation README's robustness section found: GRPO on the
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


def _tradeoff_flagged(p_fact: np.ndarray, p_short: np.ndarray, prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs with two 0/1 reward sources, ``fact`` and ``short`` (their probabilities ``[STEPS]``),
    over ``prompts`` held-out prompts: which raised guard/reward_tradeoff, and the first step each did."""
    draw = lambda rng, runs: guard_sim.two_sources(rng, runs, ("fact", p_fact, None, 1.0),  # noqa: E731
                                                    ("short", p_short, None, 1.0), prompts)
    case = guard_sim.Case("tradeoff", "null", "guard/reward_tradeoff", draw, eval_prompts=prompts)
    first = guard_sim.simulate(case, RUNS, seed=prompts)["guard/reward_tradeoff"]
    return first >= 0, first


@pytest.mark.parametrize("prompts", [32, 128])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.56, 0.9])
def test_steady_reward_sources_rarely_raise_the_tradeoff_guard(prompts, p):
    # a healthy run: the fact source holds at p, the other one rises (the total rises with it).
    # Each evaluation an independent binomial draw, the baseline one too: harsher than greedy
    # answers of a slowly moving policy
    fired, _ = _tradeoff_flagged(np.full(STEPS, p), guard_sim.ramp(0.1, 0.9, 0, 50), prompts)
    assert fired.mean() <= 0.01


@pytest.mark.parametrize("prompts", [32, 128])
def test_a_source_bought_with_another_raises_the_tradeoff_guard(prompts):
    # the capital-city task's gaming: answers turn short (0.15 -> 0.95) and drop the fact (0.56 -> 0.1)
    fired, first = _tradeoff_flagged(guard_sim.ramp(0.56, 0.1, 5, 10), guard_sim.ramp(0.15, 0.95, 5, 10), prompts)
    # by the second evaluation after the fall (steps 14, 19); 32 prompts: 97% of runs, 128: all
    assert fired.mean() >= (0.95 if prompts == 32 else 0.99) and np.median(first[fired]) <= 19
    # the same fall with the total falling too is a collapse, not a trade (the other guards' case)
    fired, _ = _tradeoff_flagged(guard_sim.ramp(0.56, 0.1, 5, 10), np.full(STEPS, 0.15), prompts)
    assert not fired.any()


def _tradeoff_rows(sd_before: float = 0.5, sds: tuple[float, float] = (0.33, 0.29)) -> list[dict]:
    """Two evaluations, 10 steps apart, of a run whose ``contains`` source falls from 0.56 to 0.12
    and 0.09 while ``brevity`` rises; ``contains`` spreads ``sd_before``, then ``sds``, over the prompts."""
    rows = [{"baseline/eval/reward": 0.72, "baseline/eval/reward/contains": 0.56, "baseline/eval/reward/brevity": 0.16,
             "baseline/eval/reward_std/contains": sd_before, "baseline/eval/reward_std/brevity": 0.37}]
    for total, contains, brevity, sd in ((1.0, 0.12, 0.88, sds[0]), (1.1, 0.09, 0.95, sds[1])):
        rows += [{} for _ in range(9)] + [{"eval/reward": total, "eval/reward/contains": contains,
                                          "eval/reward/brevity": brevity, "eval/reward_std/contains": sd,
                                          "eval/reward_std/brevity": 0.3}]
    return rows


def test_the_tradeoff_guard_judges_a_fall_by_the_source_spread():
    """Hand-computed, over 32 prompts: spread 0.5 before, 0.33 and 0.29 after:
    se = sqrt(0.25 + (0.33^2 + 0.29^2) / 2) / sqrt(32) = 0.104, and 0.56 - 0.105 = 0.455 >
    3.5 * 0.104 = 0.364: flagged. A reward model's scores spread 1.2 each time:
    se = sqrt(2 * 1.44) / sqrt(32) = 0.300, and 3.5 * 0.300 = 1.05 > 0.455: the same fall is noise."""
    for spreads, want in (((0.5, (0.33, 0.29)), [20]), ((1.2, (1.2, 1.2)), [])):
        w = HackingWatch(tradeoff=0.3, eval_prompts=32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert [t for t, r in enumerate(_tradeoff_rows(*spreads)) if w.check(t, r)["guard/reward_tradeoff"]] == want


def test_the_evaluation_logs_each_source_spread_over_the_prompts():
    from rlhfkit.rollout.evaluate import ScoredCompletions, reward_means

    scores = {"fact": torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
              "rm": torch.tensor([0.5, -1.0, 2.0, 0.3], dtype=torch.float64)}
    scored = ScoredCompletions(["a"] * 4, [True] * 4, scores["fact"] + scores["rm"], scores)
    out = reward_means(scored)
    # the sample standard deviation: fact, mean 0.75, squares sum 3 * 0.0625 + 0.5625 = 0.75, / 3
    assert out["eval/reward_std/fact"] == pytest.approx(0.5)
    assert out["eval/reward_std/rm"] == pytest.approx(float(scores["rm"].std()))
    assert out["eval/reward/rm"] == pytest.approx(0.45)


def test_the_tradeoff_message_names_the_fallen_source_and_resumes():
    rows = _tradeoff_rows()
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


def _run_rows(held_out_falls: bool = True) -> list[dict]:
    """A 40-step run: healthy for 20 steps (KL 0.2 nats/token over 6 tokens, EOS 0.95, held-out
    0.9 every 5 steps), then the KL climbs to 3 nats/token, the EOS rate drops to 0.1 and the
    held-out accuracy to 0.5 (or holds, ``held_out_falls`` False) while the score rises."""
    rows = []
    for t in range(40):
        bad = t >= 20
        row = {"objective/kl": 6 * (3.0 if bad else 0.2) + 0.01 * (t % 3), "response/length": 6.0,
               "response/eos_rate": (0.1 if bad else 0.95) - 0.01 * (t % 2), "response/eos_rate_se": 0.02,
               "objective/score": 0.1 * t}
        if (t + 1) % 5 == 0:
            row["eval/exact_acc"] = (0.5 if t >= 25 and held_out_falls else 0.9) + 0.01 * (t % 3)
        rows.append(row)
    return rows


def test_each_sign_flags_its_steps_and_warns_once():
    w = HackingWatch(kl_max=1.5, eos_ratio=0.5, eval_drop=0.15, metric="eval/exact_acc", batch_size=64)
    rows = _run_rows()
    with pytest.warns(RuntimeWarning) as caught:
        flags = _steps(w, rows)
    on = {k: [t for t, f in enumerate(flags) if f[k]] for k in KEYS}
    # EOS: the window mean falls below 0.5 * 0.95 at the third bad step, far beyond the noise (the
    # binomial 0.95 * 0.05 / 64 = 0.00074 a step is above the logged 0.02^2 = 0.0004)
    assert on["guard/eos_collapse"] == list(range(22, 40))
    # held-out, at steps 4, 9, ..., 39: 0.91 0.90 0.92 0.91 0.90 | 0.52 0.51 0.50. Means of three:
    # best 0.91 (limit 0.85 * 0.91 = 0.7735); step 29: 0.777, not below; step 34: 0.643, below, but
    # the noise (mean |step| 0.44 / 6 / 1.128 = 0.065) times 4.5 is 0.293 > 0.91 - 0.643; step 39:
    # 0.51, 0.40 below the best against 4.5 * 0.45 / 7 / 1.128 = 0.256: flagged
    assert on["guard/eval_drop"] == [39]
    # the KL's 5-step mean passes 1.5 at step 22 (3 * 3 + 2 * 0.2 > 7.5), but the held-out metric
    # has fallen beyond its noise only at step 39
    assert on["guard/kl_high"] == [39]
    assert len(caught) == 3  # one warning per sign, not per step
    eos, kl, drop = (str(c.message) for c in caught)
    assert kl.startswith("step 39:") and "3.00 nats per token" in kl and "ppo.guard_kl=1.5" in kl
    assert "eval/exact_acc fell to 0.510" in kl and "from its best 0.910" in kl
    assert "first 10 steps: 0.94" in eos and "ppo.missing_eos_penalty" in eos
    assert "mean of the last 3 evaluations" in drop and "training score rose" in drop


def test_a_high_kl_with_a_held_out_metric_that_holds_is_not_flagged():
    """One-word answers move far from a chatty reference; while the held-out metric holds, that is
    the intended change, not gaming."""
    w = HackingWatch(kl_max=1.5, eos_ratio=0.0, eval_drop=0.15, metric="eval/exact_acc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not any(f["guard/kl_high"] for f in _steps(w, _run_rows(held_out_falls=False)))


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
        # written before the EOS rate's standard error was logged: the binomial variance alone
        first = HackingWatch(1.5, 0.5, 0.15)
        _steps(first, [{k: v for k, v in r.items() if k != "response/eos_rate_se"} for r in rows[:12]])
        state = json.loads(json.dumps(first.state_dict()))
        del state["eos_anchor_var"], state["eos_recent_var"]
        second = HackingWatch(1.5, 0.5, 0.15)
        second.load_state_dict(state)
        assert want[:12] + [second.check(12 + i, r) for i, r in enumerate(rows[12:])] == want
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
    with pytest.warns(RuntimeWarning):  # the KL guard judges the KL by the held-out metric
        off = HackingWatch(1.5, 0.5, 0.15).announce({"eval/reward"}, 40)
    assert [o.split(" (")[0] for o in off] == ["guard/kl_high", "guard/eval_drop"]
    assert "ppo.stop_metric=eval/exact_acc; it logs eval/reward" in off[0]
    with pytest.warns(RuntimeWarning, match="1 evaluation"):
        HackingWatch(1.5, 0.5, 0.15).announce(tasks, 1)
    with pytest.warns(RuntimeWarning, match=r"guard/eos_collapse \(ppo.guard_eos=0\)"):
        HackingWatch(1.5, 0.0, 0.15).announce(None)


def test_a_prompt_file_run_names_its_eval_metrics():
    """What the stop metric is checked against: the task's verifier, or the rewards on held-out prompts."""
    from rlhfkit.rollout.rewards import Reward
    from rlhfkit.trainers.rl_setup import eval_metrics

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
                      ppo={"algo": "grpo", "steps": 3})
    with pytest.warns(RuntimeWarning, match="guards off"):  # one evaluation: the held-out guards cannot act
        train_rl(cfg)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "objective/kl" in r]
    assert len(rows) == 3 and all(r[k] == 0.0 for r in rows for k in KEYS)
    # the EOS rate's standard error over the batch's two groups of 4: |m_1 - m_2| / 2, m_g = k_g / 4
    assert all(r["response/eos_rate_se"] in {0.0, 0.125, 0.25, 0.375, 0.5} for r in rows)
    # the report marks the steps a watch flagged: the run above's rows, and a hacked run's
    run = tmp_path / "hacked"
    log = MetricsLogger(run / "metrics.jsonl")
    w = HackingWatch(1.5, 0.5, 0.15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t, r in enumerate(_run_rows()):
            log.log(t, {**r, **w.check(t, r)})
    log.close()
    html = build_report(run)
    assert 'class="hack"' in html and "Signs of reward hacking" in html
    assert f"at steps {', '.join(str(s) for s in range(22, 40))}" in html
    assert 'class="hack"' not in build_report(tmp_path / "run")
