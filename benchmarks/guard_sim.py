"""How often do the reward-hacking guards (rlhfkit.run.watch) cry wolf, and how soon do they see a collapse?

Each case draws ``--runs`` runs of 100 steps at once and feeds them to the watch that
``train_rl`` builds (``RLState(...).watch``: the config's defaults), the way ``train_rl``
feeds it: every step's logged statistics (the KL, response length, EOS rate and its
standard error over the prompt groups, computed by the trainer's own function), every 5 steps a
held-out evaluation (for prompt files each reward source's mean and standard deviation over the
prompts, as the evaluator computes them), and the evaluation before training in step 0's row.
A healthy ("null") case should raise its guard in at most 1% of runs; a collapse should be
flagged in every run, soon after it starts. Each case writes one JSON row to ``--out``: the
alarm rate of its guard with a 95% Wilson interval (2000 runs: about +-0.45% at a rate of 1%),
every guard's rate, the median first flagged step, the watch's settings, the seed and the commit.

The null cases:
    tradeoff/rm_<m>       a steady reward-model source (per prompt N(m, 1), m = 0.3 / 0.5 / 1.5)
                          beside a 0/1 source rising 0.1 -> 0.9 over 50 steps, 32 held-out prompts
    eos/grpo_prompt_eos   GRPO's defaults (64 completions in groups of 4) where the prompt decides
                          its completions' EOS (each prompt all or none, 0.3 of prompts all)
    kl/short_answers      one-word answers: 2.5 nats/token over 2 tokens, the held-out accuracy
                          steady at 0.5 on 32 prompts
    kl/multi_turn_rising  episodes whose held-out return rises 0.275 -> 0.61 (32 episodes, sd 0.4
                          each) while the per-token KL climbs from 1 to 2.5 nats
The collapses:
    tradeoff/fact_for_brevity  a 0/1 fact source 0.56 -> 0.1 while a 0/1 brevity one 0.15 -> 0.95
                               over steps 5-15 (the capital-city task's gaming), 32 prompts
    tradeoff/rm_for_brevity    a reward model's mean 1.5 -> 0.3 (sd 1) while a 0/1 source of weight
                               2 rises 0.1 -> 0.9 over steps 20-40, 32 prompts
    eos/grpo_collapse          the EOS rate 0.95 -> 0.2 over steps 30-50, prompt-decided as above
    kl/blow_up                 the per-token KL 0.5 -> 3.5 over steps 30-50 while the held-out exact
                               falls 0.95 -> 0.3 (512 prompts: the doubling task)
    kl/blow_up_32_prompts      the same KL while the held-out accuracy falls 0.8 -> 0.2 on 32 prompts

    python benchmarks/guard_sim.py                      # every case, 2000 runs each
    python benchmarks/guard_sim.py --runs 200 --cases eos/grpo_prompt_eos

(No ``from __future__ import annotations``: the tests load this file by path, outside
``sys.modules``, where dataclasses cannot resolve string annotations.)
"""

import argparse
import json
import math
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rlhfkit.config import Config
from rlhfkit.core import group_mean_se
from rlhfkit.rollout.experience import RLState, completions_per_prompt
from rlhfkit.run.watch import KEYS

STEPS, EVAL_EVERY = 100, 5
EVAL_STEPS = np.arange(EVAL_EVERY - 1, STEPS, EVAL_EVERY)  # the steps after which train_rl evaluates
OUT = Path(__file__).resolve().parent / "results" / "guard_sim.jsonl"


@dataclass
class Feed:
    """What a trainer logs, for ``runs`` runs: ``steps`` every step, ``evals`` at EVAL_STEPS (each
    ``[STEPS, runs]``), ``baseline`` the evaluation before training (``[runs]``, logged as
    ``baseline/<key>`` in step 0's row)."""

    steps: dict[str, np.ndarray] = field(default_factory=dict)
    evals: dict[str, np.ndarray] = field(default_factory=dict)
    baseline: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Case:
    name: str
    kind: str  # "null" (healthy: should not flag) or "collapse" (should flag)
    guard: str  # the guard/* key the case is about
    draw: Callable[[np.random.Generator, int], Feed]
    start: int = 0  # a collapse: the step it starts (a flag before it is a false alarm)
    metric: str = "eval/exact_acc"  # ppo.stop_metric
    eval_prompts: int = 32
    algo: str = "grpo"


def ramp(start: float, end: float, before: int = 0, over: int = STEPS) -> np.ndarray:
    """``[STEPS]``: ``start`` for ``before`` steps, linear to ``end`` over ``over`` steps, then ``end``."""
    return np.concatenate([np.full(before, start), np.linspace(start, end, over + 1)[1:],
                           np.full(STEPS - before - over, end)])[:STEPS]


def eos_steps(rng: np.random.Generator, runs: int, p: np.ndarray, batch: int, group: int) -> dict[str, np.ndarray]:
    """Each step's EOS rate and its standard error over the groups, where each of the batch's
    ``batch / group`` prompts decides its group's EOS: all of its completions end with EOS with
    probability ``p[step]``, else none do."""
    decided = rng.random((STEPS, runs, batch // group)) < p[:, None, None]  # [STEPS, runs, prompts]
    finished = torch.from_numpy(np.repeat(decided, group, axis=-1)).double()  # [STEPS, runs, batch]
    return {"response/eos_rate": finished.mean(-1).numpy(),
            "response/eos_rate_se": group_mean_se(finished, group).numpy()}


def kl_steps(rng: np.random.Generator, runs: int, per_token: np.ndarray, length: float) -> dict[str, np.ndarray]:
    """Sequence KLs of ``per_token[step]`` nats per token over ``length`` tokens, log-normal noise of 30%."""
    kl = per_token[:, None] * rng.lognormal(0.0, 0.3, (STEPS, runs)) * length
    return {"objective/kl": kl, "response/length": np.full((STEPS, runs), float(length))}


def held_out(rng: np.random.Generator, runs: int, mean: np.ndarray, prompts: int, sd: float | None = None,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Evaluations over ``prompts`` held-out prompts, each scored 0/1 (``sd`` None: right with
    probability ``mean[step]``) or ``N(mean[step], sd)``, a fresh draw at every evaluation
    (harsher than greedy answers of a slowly moving policy, which repeat): the mean and the
    sample standard deviation over the prompts at each step (``[STEPS, runs]``, NaN off
    EVAL_STEPS), and the same two of the evaluation before training (``mean[0]``, ``[runs]``)."""
    steps = np.concatenate([[0], EVAL_STEPS])
    shape = (len(steps), runs, prompts)
    m = mean[steps][:, None, None]
    scores = (rng.random(shape) < m).astype(float) if sd is None else rng.normal(m, sd, shape)
    means, sds = scores.mean(-1), scores.std(-1, ddof=1)  # [1 + evaluations, runs], as evaluate.reward_means
    out_m, out_s = np.full((STEPS, runs), np.nan), np.full((STEPS, runs), np.nan)
    out_m[EVAL_STEPS], out_s[EVAL_STEPS] = means[1:], sds[1:]
    return out_m, out_s, means[0], sds[0]


def two_sources(rng: np.random.Generator, runs: int, first: tuple, second: tuple, prompts: int = 32) -> Feed:
    """A prompt-file run with two reward sources, each ``(name, mean [STEPS], sd or None, weight)``:
    ``eval/reward/<name>``, ``eval/reward_std/<name>`` and the weighted total ``eval/reward``."""
    feed = Feed()
    total, total_before = 0.0, 0.0
    for name, mean, sd, weight in (first, second):
        m, s, m0, s0 = held_out(rng, runs, mean, prompts, sd)
        feed.evals.update({f"eval/reward/{name}": m, f"eval/reward_std/{name}": s})
        feed.baseline.update({f"eval/reward/{name}": m0, f"eval/reward_std/{name}": s0})
        total, total_before = total + weight * m, total_before + weight * m0
    feed.evals["eval/reward"], feed.baseline["eval/reward"] = total, total_before
    return feed


def kl_with_held_out(rng: np.random.Generator, runs: int, per_token: np.ndarray, length: float,
                     held: np.ndarray, prompts: int, metric: str, sd: float | None = None) -> Feed:
    m, _, m0, _ = held_out(rng, runs, held, prompts, sd)
    return Feed(steps=kl_steps(rng, runs, per_token, length), evals={metric: m}, baseline={metric: m0})


CASES = [
    *(Case(f"tradeoff/rm_{m}", "null", "guard/reward_tradeoff",
           lambda rng, runs, m=m: two_sources(rng, runs, ("rm", np.full(STEPS, m), 1.0, 1.0),
                                              ("exact", ramp(0.1, 0.9, 0, 50), None, 1.0)))
      for m in (0.3, 0.5, 1.5)),
    Case("eos/grpo_prompt_eos", "null", "guard/eos_collapse",
         lambda rng, runs: Feed(steps=eos_steps(rng, runs, np.full(STEPS, 0.3), 64, 4))),
    Case("kl/short_answers", "null", "guard/kl_high",
         lambda rng, runs: kl_with_held_out(rng, runs, np.full(STEPS, 2.5), 2, np.full(STEPS, 0.5), 32,
                                            "eval/exact_acc")),
    Case("kl/multi_turn_rising", "null", "guard/kl_high",
         lambda rng, runs: kl_with_held_out(rng, runs, ramp(1.0, 2.5), 20, ramp(0.275, 0.61), 32, "eval/reward", 0.4),
         metric="eval/reward"),
    Case("tradeoff/fact_for_brevity", "collapse", "guard/reward_tradeoff",
         lambda rng, runs: two_sources(rng, runs, ("fact", ramp(0.56, 0.1, 5, 10), None, 1.0),
                                       ("brevity", ramp(0.15, 0.95, 5, 10), None, 1.0)), start=5),
    Case("tradeoff/rm_for_brevity", "collapse", "guard/reward_tradeoff",
         lambda rng, runs: two_sources(rng, runs, ("rm", ramp(1.5, 0.3, 20, 20), 1.0, 1.0),
                                       ("brevity", ramp(0.1, 0.9, 20, 20), None, 2.0)), start=20),
    Case("eos/grpo_collapse", "collapse", "guard/eos_collapse",
         lambda rng, runs: Feed(steps=eos_steps(rng, runs, ramp(0.95, 0.2, 30, 20), 64, 4)), start=30),
    Case("kl/blow_up", "collapse", "guard/kl_high",
         lambda rng, runs: kl_with_held_out(rng, runs, ramp(0.5, 3.5, 30, 20), 6, ramp(0.95, 0.3, 30, 20), 512,
                                            "eval/exact_acc"), start=30, eval_prompts=512),
    Case("kl/blow_up_32_prompts", "collapse", "guard/kl_high",
         lambda rng, runs: kl_with_held_out(rng, runs, ramp(0.5, 3.5, 30, 20), 6, ramp(0.8, 0.2, 30, 20), 32,
                                            "eval/exact_acc"), start=30),
]


def watch_for(case: Case):
    """The watch of a run of ``case.algo`` with the config's defaults, built as train_rl builds it."""
    pc = Config().replace(ppo={"algo": case.algo}).ppo
    return RLState(pc, case.metric, case.eval_prompts).watch, pc


def simulate(case: Case, runs: int, seed: int, chunk: int = 0) -> dict[str, np.ndarray]:
    """Feed ``runs`` runs of ``case`` to its watch, ``chunk`` runs to a watch (0: all of them, as
    arrays; 1: one run at a time, as scalars, exactly as train_rl): each guard's first flagged step
    per run (-1: never)."""
    feed = case.draw(np.random.default_rng(seed), runs)
    first = {key: np.full(runs, -1) for key in KEYS}
    for lo in range(0, runs, chunk or runs):
        part = slice(lo, lo + (chunk or runs))
        one = (lambda v: v[0]) if chunk == 1 else (lambda v: v)  # noqa: E731
        watch, _ = watch_for(case)
        with warnings.catch_warnings():
            # arrays of runs: the watch warns for single runs only; a single run's warnings are its messages
            warnings.simplefilter("ignore" if chunk == 1 else "error")
            for step in range(STEPS):
                stats = {k: one(v[step, part]) for k, v in feed.steps.items()}
                if step == 0:
                    stats.update({f"baseline/{k}": one(v[part]) for k, v in feed.baseline.items()})
                if step in EVAL_STEPS:
                    stats.update({k: one(v[step, part]) for k, v in feed.evals.items()})
                for key, on in watch.check(step, stats).items():
                    now = first[key][part]
                    first[key][part] = np.where((np.asarray(on) > 0) & (now < 0), step, now)
    return first


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate of ``k`` in ``n``."""
    centre, half = (k + z * z / 2) / (n + z * z), z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return max(0.0, centre - half), min(1.0, centre + half)


def commit() -> str:
    here = Path(__file__).resolve().parent
    run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def row(case: Case, first: dict[str, np.ndarray], runs: int, seed: int, chunk: int = 0) -> dict:
    watch, pc = watch_for(case)
    fired = first[case.guard] >= 0
    flagged_any = np.logical_or.reduce([f >= 0 for f in first.values()])
    settings = {k: getattr(watch, k) for k in ("kl_max", "eos_ratio", "eval_drop", "tradeoff", "z", "z_tradeoff",
                                               "window", "anchor", "eval_window", "min_evals", "tradeoff_window",
                                               "batch_size", "eval_prompts", "metric")}
    return {"case": case.name, "kind": case.kind, "guard": case.guard, "runs": runs, "steps": STEPS,
            "eval_every": EVAL_EVERY, "alarm_rate": float(fired.mean()),
            "ci95": [round(x, 4) for x in wilson(int(fired.sum()), runs)],
            "median_first_step": float(np.median(first[case.guard][fired])) if fired.any() else None,
            "before_start_rate": float((fired & (first[case.guard] < case.start)).mean()),
            "any_guard_rate": float(flagged_any.mean()), "rates": {k: float((f >= 0).mean()) for k, f in first.items()},
            "settings": {**settings, "algo": case.algo, "group_size": completions_per_prompt(pc)},
            "seed": seed, "runs_per_watch": chunk or runs, "commit": commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated runs per case")
    ap.add_argument("--seed", type=int, default=0, help="case i draws from seed + i")
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--chunk", type=int, default=0, help="runs per watch: 0 all at once (arrays), 1 one at a time")
    ap.add_argument("--out", default=str(OUT), help="JSONL file the rows are appended to ('' = none)")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'case':28}{'kind':>9}  {'guard':24}{'alarm rate':>11}{'95% interval':>17}{'median step':>13}{'any guard':>11}")
    for i, case in enumerate(CASES):
        if args.cases and case.name not in args.cases:
            continue
        r = row(case, simulate(case, args.runs, args.seed + i, args.chunk), args.runs, args.seed + i, args.chunk)
        rows.append(r)
        step = "-" if r["median_first_step"] is None else f"{r['median_first_step']:.0f}"
        interval = "{:.2%}-{:.2%}".format(*r["ci95"])
        print(f"{case.name:28}{case.kind:>9}  {case.guard:24}{r['alarm_rate']:>11.2%}{interval:>17}{step:>13}"
              f"{r['any_guard_rate']:>11.2%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with Path(args.out).open("a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
