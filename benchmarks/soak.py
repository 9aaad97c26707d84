"""Soak: PPO on the doubling task for a fixed wall time while its memory (RSS) is sampled.

A long RLHF run must not grow: a list that keeps every step, a cache keyed by batch shape, a
tensor kept alive by a log line all show up as RSS that climbs with the step count. This
runs ``rlhfkit ppo`` as a child process for ``--minutes`` (default 30) with no early stop,
reads the child's ``VmRSS`` from ``/proc/PID/status`` every ``--interval`` seconds, then
prints a table and the growth after warm-up:

    growth = (median RSS of the last 10% of samples - median RSS of the first 10% after
              warm-up) / the latter

The target is growth < 5%. The base model and reward model are built once (pretrain + RM,
about a minute) and cached under ``--out``. For a quiet, comparable run pin it to one core:

    taskset -c 1 .venv/bin/python benchmarks/soak.py --minutes 30
    taskset -c 1 .venv/bin/python benchmarks/soak.py --minutes 3 --interval 2   # a quick check

Results are also written to ``<out>/soak.json``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB, None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def rlhfkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhfkit", *args]


def prepare(out: Path, seed: int, threads: int) -> tuple[Path, Path]:
    """Pretrained base and reward model, built once and cached under ``out``."""
    base, rm = out / "pretrain" / "policy", out / "reward" / "reward_model"
    common = [f"run.seed={seed}", f"accel.threads={threads}", "run.progress=false", "run.overwrite=true"]
    if not (base / "config.json").exists():
        print("preparing the base model (cached for later runs) ...", flush=True)
        subprocess.run(rlhfkit("pretrain", f"run.out_dir={out / 'pretrain'}", *common), check=True,
                       stdout=subprocess.DEVNULL)
    if not (rm / "config.json").exists():
        print("preparing the reward model ...", flush=True)
        subprocess.run(rlhfkit("rm", f"model.name={base}", f"run.out_dir={out / 'reward'}", *common), check=True,
                       stdout=subprocess.DEVNULL)
    return base, rm


def soak(args) -> dict:
    out = Path(args.out)
    base, rm = prepare(out, args.seed, args.threads)
    run_dir = out / "ppo"
    # run.overwrite: an earlier soak's run there is replaced, so the step count is this run's
    cmd = rlhfkit("ppo", f"model.name={base}", f"reward.name={rm}", f"run.out_dir={run_dir}", "run.overwrite=true",
                  f"run.seed={args.seed}", f"accel.threads={args.threads}", "run.progress=false",
                  "ppo.steps=100000000", "ppo.stop_at=0", f"ppo.eval_every={args.eval_every}")
    print("soak:", " ".join(cmd[2:]), flush=True)
    log = open(out / "soak_child.log", "w")
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    samples = []  # (seconds, steps done, RSS MiB)
    try:
        while True:
            elapsed = time.monotonic() - t0
            rss = rss_mib(child.pid)
            if child.poll() is not None or rss is None:
                raise RuntimeError(f"the PPO run exited early (code {child.returncode}); see {out / 'soak_child.log'}")
            if rss > 0:  # 0 in the instant between fork and exec
                samples.append((elapsed, count_lines(run_dir / "metrics.jsonl"), rss))
            if elapsed >= args.minutes * 60:
                break
            time.sleep(min(args.interval, max(0.0, args.minutes * 60 - elapsed)))
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        log.close()
    return summarise(samples, args)


def summarise(samples: list[tuple[float, int, float]], args) -> dict:
    warmup_s = args.warmup_minutes * 60 if args.warmup_minutes is not None else max(60.0, 0.1 * args.minutes * 60)
    after = [s for s in samples if s[0] >= warmup_s]
    if len(after) < 4:
        raise RuntimeError(f"only {len(after)} samples after the {warmup_s:.0f} s warm-up: run longer")
    k = max(1, len(after) // 10)
    start, end = statistics.median(s[2] for s in after[:k]), statistics.median(s[2] for s in after[-k:])
    growth = (end - start) / start
    # least-squares slope of RSS over time after warm-up, in MiB per hour
    ts, rs = [s[0] for s in after], [s[2] for s in after]
    mt, mr = statistics.fmean(ts), statistics.fmean(rs)
    slope = sum((t - mt) * (r - mr) for t, r in zip(ts, rs)) / max(1e-9, sum((t - mt) ** 2 for t in ts)) * 3600
    steps = samples[-1][1]
    every = max(1, len(samples) // 25)
    print(f"\n{'t (s)':>8} {'steps':>7} {'RSS MiB':>9}")
    for i, (t, n, r) in enumerate(samples):
        if i % every == 0 or i == len(samples) - 1:
            mark = "  (warm-up)" if t < warmup_s else ""
            print(f"{t:8.0f} {n:7d} {r:9.1f}{mark}")
    result = {
        "minutes": args.minutes, "interval_s": args.interval, "warmup_s": warmup_s, "threads": args.threads,
        "samples": len(samples), "steps": steps, "s_per_step": samples[-1][0] / max(1, steps),
        "rss_first_mib": samples[0][2], "rss_after_warmup_mib": start, "rss_end_mib": end,
        "rss_max_mib": max(rs), "growth_after_warmup": growth, "slope_mib_per_hour": slope,
        "pass": growth < args.target,
    }
    print(f"\n{steps} PPO steps in {samples[-1][0] / 60:.1f} min ({result['s_per_step']:.3f} s/step), "
          f"{len(samples)} RSS samples every {args.interval:g} s")
    print(f"RSS after the {warmup_s:.0f} s warm-up {start:.1f} MiB -> end {end:.1f} MiB (max {max(rs):.1f}): "
          f"growth {100 * growth:+.2f}% (target < {100 * args.target:.0f}%), slope {slope:+.1f} MiB/hour "
          f"-> {'PASS' if result['pass'] else 'FAIL'}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="wall time of the PPO run")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="samples before this are warm-up (default: 10%% of the run, at least 1 minute)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the PPO run (accel.threads)")
    ap.add_argument("--eval-every", type=int, default=50, help="held-out greedy evaluation every N steps")
    ap.add_argument("--target", type=float, default=0.05, help="largest acceptable growth after warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/soak")
    args = ap.parse_args()
    if not os.path.exists("/proc/self/status"):
        sys.exit("soak.py reads /proc/PID/status: Linux only")
    result = soak(args)
    Path(args.out, "soak.json").write_text(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
