"""Do the RL commands' defaults hold on rewards they were not tuned on?

Every cell of {ppo, grpo, rloo, reinforce} x {exact verifier, Bradley-Terry reward model, label
classifier} x seeds runs the command with its defaults (``ALGO_DEFAULTS`` and the config's) from
the same pretrained doubling base, for a fixed number of steps with no early stop, evaluating
greedy exact accuracy on the 512 held-out prompts every ``--eval-every`` steps. It prints, per
cell: steps and training seconds to the first evaluation at >= 0.95 exact, the final exact
accuracy, the peak per-sequence KL to the reference (``objective/kl``) and per token, the final
EOS rate, whether the run collapsed (final exact below half its best -- a reward-hacked policy)
and which reward-hacking guards (``guard/*``, rlhfkit.run.watch) flagged a step.

The three rewards:
    exact       the task's verifier as a function: 1 for the right answer in the requested set
    bt          a Bradley-Terry reward model trained on the task's preference pairs
    classifier  the number-doubling tutorial's reward: a classifier of the answer's character
                set, scored as the logit of the set the prompt asks for (it never checks the
                digits, so a policy can game it)

The reward models and the base are cached under ``--out`` (``bench_common.prepare``).

    python benchmarks/robustness.py                        # the full matrix, seeds 0 1 2
    python benchmarks/robustness.py --algos grpo --rewards classifier --seeds 10 11 --override ppo.lr=1e-4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    DEFAULT_OUT,
    add_record_args,
    code_version,
    peak_rss_mib,
    pinned_cmd,
    prepare,
    quiet_hf,
    record,
    worker_setup,
)

ALGOS = ("ppo", "grpo", "rloo", "reinforce")
GUARD_KEYS = ("guard/kl_high", "guard/eos_collapse", "guard/eval_drop", "guard/reward_tradeoff")  # rlhfkit.run.watch.KEYS
REWARDS = ("exact", "bt", "classifier")
TARGET = 0.95
RESULT = "RESULT "


def reward_section(reward: str, paths: dict) -> dict:
    if reward == "exact":
        return {"function": "rlhfkit.tasks.doubling:exact_reward"}
    return {"name": paths["rm" if reward == "bt" else "classifier"]}


def run_cell(algo: str, reward: str, seed: int, paths: dict, args) -> dict:
    from rlhfkit.config import ALGO_DEFAULTS, Config, load_config
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.utils import read_jsonl

    out = Path(args.out) / f"robust_{algo}_{reward}_{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a run appends to an existing metrics.jsonl: start clean
    cfg = Config().replace(
        run={"out_dir": str(out), "seed": seed, "progress": False, "checkpoint_every": 0,
             "tensorboard": False},
        accel={"threads": 1},
        ppo={**ALGO_DEFAULTS[algo], "steps": args.steps, "stop_at": 0.0, "eval_every": args.eval_every,
             "trajectories_every": 0},
        reward=reward_section(reward, paths),
    )
    cfg = load_config(None, args.override, base=cfg)
    train_rl(cfg, paths["base"])
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if r.get("eval/exact_acc") is not None]
    hit = next((r for r in evals if r["eval/exact_acc"] >= TARGET), None)
    best = max(r["eval/exact_acc"] for r in evals)
    final = evals[-1]["eval/exact_acc"]
    return {"steps": hit["step"] + 1 if hit else None, "train_s": hit["time/train_s"] if hit else None,
            "final_exact": final, "best_exact": best, "peak_kl": max(r["objective/kl"] for r in rows),
            "peak_kl_token": max(r["objective/kl"] / r["response/length"] for r in rows if r["response/length"]),
            "final_eos": rows[-1]["response/eos_rate"], "collapsed": final < 0.5 * best,
            "guards": sorted(k for k in GUARD_KEYS if any(r.get(k) for r in rows))}


def worker(args) -> None:
    paths = worker_setup(args)
    res = run_cell(args.algo, args.reward, args.seed, paths, args)
    print(RESULT + json.dumps({**res, "peak_mib": peak_rss_mib()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=REWARDS)
    ap.add_argument("--steps", type=int, default=150, help="steps per run (no early stop: drift shows)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--core", type=int, default=0, help="CPU core every run is pinned to")
    ap.add_argument("--override", nargs="*", default=[], help="dotted overrides applied to every run")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--algo", help=argparse.SUPPRESS)
    ap.add_argument("--reward", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--clock", default="wall", help=argparse.SUPPRESS)
    add_record_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    quiet_hf()
    prepare(args.out)  # build the cached base and reward models once, before the workers
    results = []
    for reward in args.rewards:
        for algo in args.algos:
            for seed in args.seeds:
                cmd = pinned_cmd(args.core, __file__, "--worker", "--algo", algo, "--reward", reward, "--seed",
                                 str(seed), "--out", args.out, "--steps", str(args.steps), "--eval-every",
                                 str(args.eval_every), "--core", str(args.core), "--override", *args.override)
                env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
                at = code_version()  # the code the worker imports now
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
                if proc.returncode or not lines:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
                    raise SystemExit(f"{algo} / {reward} / seed {seed} failed (exit {proc.returncode})")
                res = {"algo": algo, "reward": reward, "seed": seed, **json.loads(lines[-1][len(RESULT):])}
                results.append(res)
                settings = {"reward": reward, "steps": args.steps, "eval_every": args.eval_every,
                            "overrides": args.override}
                record("robustness", {"contender": algo, "settings": settings, "seeds": [seed],
                                      "times_s": [res["train_s"]] if res["train_s"] is not None else [],
                                      "threads": 1, **res}, args, at=at)
                print(f"  {algo:<10} {reward:<11} seed {seed}: to {TARGET}: {res['steps']} steps "
                      f"{res['train_s'] and round(res['train_s'], 2)} s; final {res['final_exact']:.3f} "
                      f"(best {res['best_exact']:.3f}), peak KL {res['peak_kl']:.2f} ({res['peak_kl_token']:.2f}/token), "
                      f"EOS {res['final_eos']:.2f}, guards {', '.join(res['guards']) or 'none'}"
                      f"{'  COLLAPSED' if res['collapsed'] else ''}", flush=True)
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: list[dict], args) -> None:
    print(f"\nDefaults of each command, {args.steps} steps (no early stop), greedy exact accuracy on 512 held-out "
          f"prompts every {args.eval_every} steps; seeds {' '.join(map(str, args.seeds))}; overrides: "
          f"{' '.join(args.override) or 'none'}")
    print(f"{'algo':<10}{'reward':<12}{'steps to ' + str(TARGET):>14}{'seconds':>10}{'final exact':>13}"
          f"{'min final':>11}{'peak KL':>9}{'final EOS':>11}{'collapsed':>11}{'guarded':>9}")
    cells = {}
    for r in results:
        cells.setdefault((r["algo"], r["reward"]), []).append(r)
    for (algo, reward), rows in cells.items():
        reached = [r for r in rows if r["steps"] is not None]
        steps = "/".join(str(r["steps"]) if r["steps"] is not None else "-" for r in rows)
        secs = f"{statistics.median(r['train_s'] for r in reached):.1f}" if reached else "-"
        print(f"{algo:<10}{reward:<12}{steps:>14}{secs:>10}{statistics.median(r['final_exact'] for r in rows):>13.3f}"
              f"{min(r['final_exact'] for r in rows):>11.3f}{max(r['peak_kl'] for r in rows):>9.2f}"
              f"{min(r['final_eos'] for r in rows):>11.2f}{sum(r['collapsed'] for r in rows):>8}/{len(rows)}"
              f"{sum(bool(r['guards']) for r in rows):>6}/{len(rows)}")
    bad = [r for r in results if r["final_exact"] < TARGET]
    print(f"\ncells below {TARGET} final exact: {len(bad)} of {len(results)} runs")


if __name__ == "__main__":
    main()
