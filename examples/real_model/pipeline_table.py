"""Prints the table of examples/real_model/pipeline.sh: per stage, the held-out numbers of each
policy against the base, the CPU and wall seconds, and a few answers side by side.

    python examples/real_model/pipeline_table.py OUT_DIR

Reads OUT_DIR/eval_<policy>/eval.json and eval_samples.jsonl (``rlhfkit eval`` with the base as
``eval.baseline``), OUT_DIR/rm/metrics.jsonl (the reward model's held-out pair accuracy) and
OUT_DIR/times/<stage>.txt (``/usr/bin/time -f "%U %S %e %M"``: user, sys, wall seconds, peak KB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POLICIES = ("sft", "ppo", "grpo", "dpo")
SAMPLES = 6


def times(out: Path, stage: str) -> tuple[float, float, float] | None:
    """(CPU seconds, wall seconds, peak RSS in GB) of a stage, None when it did not run."""
    path = out / "times" / f"{stage}.txt"
    if not path.exists():
        return None
    user, sys_, wall, kb = path.read_text().split()[-4:]
    return float(user) + float(sys_), float(wall), int(kb) / 1e6


def words(rows: list[dict], prefix: str = "") -> float:
    return sum(len(r[f"{prefix}completion"].split()) for r in rows) / len(rows)


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def last_metric(path: Path, key: str) -> float | None:
    value = None
    for row in rows_of(path) if path.exists() else []:
        value = row.get(key, value)
    return value


def main(out: Path) -> None:
    evals = {p: json.loads((out / f"eval_{p}" / "eval.json").read_text()) for p in POLICIES
             if (out / f"eval_{p}" / "eval.json").exists()}
    samples = {p: rows_of(out / f"eval_{p}" / "eval_samples.jsonl") for p in evals}
    if not evals:
        sys.exit(f"no eval_*/eval.json under {out}: run examples/real_model/pipeline.sh first")
    first = next(iter(evals))
    base = evals[first]["baseline"]
    n = evals[first]["prompts"]

    def cost(*stages: str) -> str:
        got = [t for t in (times(out, s) for s in stages) if t is not None]
        return f"{sum(t[0] for t in got):.0f} | {sum(t[1] for t in got):.0f}" if got else " | "

    print(f"Held out: {n} cities, greedy answers of at most {evals[first]['max_new_tokens']} tokens. "
          "exact: the country's name alone; contains: the right country named; win rate: against the "
          "base under the reward model (ties half); KL: nats per answer along the policy's answers.\n")
    print("| stage | exact | contains | words / answer | win rate (RM) | KL to base | CPU s (train + eval) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| base | {base['eval/accuracy']:.2f} | {base['eval/reward/contains']:.2f} | "
          f"{words(samples[first], 'baseline_'):.1f} | 0.50 | 0 | {cost('fetch')} |")
    for p, ev in evals.items():
        print(f"| {p} | {ev['eval/accuracy']:.2f} | {ev['eval/reward/contains']:.2f} | {words(samples[p]):.1f} | "
              f"{ev['win_rates']['reward_model']:.2f} | {ev.get('kl_to_baseline', float('nan')):.2f} | "
              f"{cost(p, f'eval_{p}')} |")
        if p == "sft":
            acc = last_metric(out / "rm" / "metrics.jsonl", "eval/rm/accuracy")
            acc_s = f"{acc:.2f}" if acc is not None else "?"
            print(f"| reward model (held-out pair accuracy {acc_s}) | | | | | | {cost('rm')} |")
    total = [t for t in (times(out, s) for s in ("fetch", "sft", "rm", *POLICIES[1:],
                                                   *(f"eval_{p}" for p in POLICIES))) if t]
    print(f"| **whole pipeline** | | | | | | {sum(t[0] for t in total):.0f} | {sum(t[1] for t in total):.0f} |")
    print(f"\nPeak RSS of any stage: {max(t[2] for t in total):.1f} GB\n")
    print("| city | base | " + " | ".join(evals) + " |")
    print("|---|---|" + "---|" * len(evals))
    for i in range(min(SAMPLES, n)):
        r = samples[first][i]
        city = r["prompt"][-1]["content"].split("city of ")[1].split("?")[0]
        cells = [samples[p][i]["completion"] for p in evals]
        print(f"| {city} ({r['columns']['answer']}) | {r['baseline_completion']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/real_pipeline"))
