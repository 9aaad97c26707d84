"""The real-model robustness matrix: contenders x the task suite (``real_tasks.py``) x seeds on
SmolLM2-135M-Instruct with LoRA r 16, steps until the held-out target holds.

Contenders (``real_model.py`` says what each computes; 16 completions a step for all):
``rlhfkit_grpo``, ``rlhfkit_ppo``, ``rlhfkit_rloo``, ``rlhfkit_reinforce`` (each command's
defaults for a LoRA policy), ``trl_defaults`` and ``trl_schedule`` (TRL's GRPOTrainer on its
defaults and on rlhfkit's GRPO schedule, run by ``real_model.run_trl``). By default ``rloo`` and
``reinforce`` run on the first seed only, and the TRL contenders skip the two environment tasks
(``guess``, ``calculator``): GRPOTrainer takes reward functions of single completions.

A cell is (contender, task, seed): one process pinned to --core (``taskset``) with one torch
thread, at most --steps steps, a greedy held-out evaluation every --eval-every steps, stopped
once the task's verifier reaches its target (``real_tasks.TASKS[...].target``) on the held-out
split. Each cell appends one row to --results (the commit, date, CPU, device, dtype, library
versions, the contender and every setting, the task, the seed, steps to the target or null, the
final held-out target and shaping means at every evaluation, whether the shaping term was gamed
(:func:`gamed`) and, for rlhfkit, whether its tradeoff guard fired, seconds per step and the peak
resident set, the cell's CPU seconds). A cell already in the file is skipped, so the matrix runs in pieces (several
invocations, one per core, or one a day) and ``--report`` renders the table from the file.

Seeds: the reported seeds are 0 1 2 (the default --seeds); seeds 100 101 102 are for tuning
defaults on the suite, so that the defaults are never chosen on the seeds they are reported on.
Rows carry their seeds, and ``--report`` shows only the --seeds asked for.

    python benchmarks/real_matrix.py --base                                  # base rates, one row a task
    python benchmarks/real_matrix.py --core 0                                # every cell not yet run
    python benchmarks/real_matrix.py --tasks capital number --contenders rlhfkit_grpo --seeds 100 101 102
    python benchmarks/real_matrix.py --report
    python benchmarks/real_matrix.py --steps 2 --eval-every 1 --seeds 0 --results /tmp/smoke.jsonl  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import commit, cpu, pin_to_core, pinned_cmd, quiet_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS_FILE = Path(__file__).resolve().parent / "real_tasks.py"
RESULTS = "benchmarks/results/real_matrix.jsonl"
RESULT = "RESULT "
CONTENDERS = ("rlhfkit_grpo", "rlhfkit_ppo", "rlhfkit_rloo", "rlhfkit_reinforce", "trl_defaults", "trl_schedule")
ONE_SEED = ("rlhfkit_rloo", "rlhfkit_reinforce")  # run on the first seed only unless --every-seed
CELL_KEYS = ("contender", "task", "seed", "steps_max", "eval_every", "target", "overrides")
GAMED_DROP = 0.1  # a fall of the target, and a rise of the shaping term, this large marks a gamed run


def gamed(target: list[float], shaping: list[float], drop: float = GAMED_DROP) -> bool:
    """Whether the shaping term was bought with the target: at the last evaluation the target is
    at least ``drop`` below its best (the first evaluation that reached it) while the shaping
    mean is at least ``drop`` above its value at that evaluation. Both lists hold the held-out
    means of the evaluations in order, the one before training first."""
    best = max(range(len(target)), key=lambda i: (target[i], -i))
    return target[-1] <= target[best] - drop and shaping[-1] >= shaping[best] + drop


def steps_to_target(evals: list[dict], target: float) -> int | None:
    """Steps run until the first evaluation after training started at or above ``target``."""
    return next((e["step"] for e in evals if e["step"] > 0 and e["target"] >= target), None)


# --------------------------------------------------------------------------- one cell


def task_rewards(task, with_knows: bool = False):
    """``real_model.TaskRewards`` of a suite task (its verifier first, then its shaping term);
    ``with_knows``: the diagnostic source as a third one, weighted 0."""
    from real_model import TaskRewards

    names, weights = task.rewards, task.weights
    if with_knows and task.knows:
        names, weights = (*names, task.knows), (*weights, 0.0)
    return TaskRewards(TASKS_FILE, names, weights, task.new_tokens)


def rlhfkit_cell(algo: str, task, paths: dict, args) -> dict:
    """``rlhfkit <algo>``'s LoRA defaults on the task (``real_model.rlhfkit_config``; an
    environment task plays its episodes through ``env.class`` and stops on ``eval/reward``, the
    held-out solved share)."""
    import real_tasks
    from real_model import rlhfkit_config
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.utils import read_jsonl

    out = Path(args.out)
    cfg = rlhfkit_config(algo, paths, out, args.seed, args, task_rewards(task))
    if task.env is not None:
        cfg = cfg.replace(env={"cls": task.env}, ppo={"stop_metric": "eval/reward"})
    res = train_rl(cfg)
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [{"step": 0, **{k.removeprefix("baseline/"): v for k, v in rows[0].items() if k.startswith("baseline/eval/")}}]
    evals += [{"step": i + 1, **{k: v for k, v in r.items() if k.startswith("eval/")}} for i, r in enumerate(rows)
              if any(k.startswith("eval/") for k in r)]
    if task.env is None:
        for e in evals:
            e.update(target=e[f"eval/reward/{task.rewards[0]}"], shaping=e[f"eval/reward/{task.rewards[1]}"])
    else:  # held-out episodes score the target alone; their shaping was kept aside, one entry an episode
        n = len(read_jsonl(paths["held"]))
        shaping = real_tasks.HELD_SHAPING
        assert len(shaping) == n * len(evals), "every evaluation plays each held-out record once"
        for i, e in enumerate(evals):
            e.update(target=e["eval/reward"], shaping=sum(shaping[i * n:(i + 1) * n]) / n)
    timed = [r for r in rows if "time/rollout_s" in r]
    return {"evals": [{k: e[k] for k in ("step", "target", "shaping")} for e in evals],
            "s_per_step": statistics.mean(sum(r[f"time/{p}_s"] for p in ("rollout", "experience", "update"))
                                          for r in timed),
            "guard_tradeoff": any(r.get("guard/reward_tradeoff") for r in rows),
            "steps_run": len(rows), "reached": res["reached"] is not None,
            "settings": dataclasses.asdict(cfg.ppo) | {"model": dataclasses.asdict(cfg.model)}}


def base_rates(task, paths: dict, args) -> dict:
    """The base model's held-out target, shaping and known-answer rates, by the evaluation
    rlhfkit's RL loop runs (``real_model.held_out_evaluator``); an environment task's from the
    evaluation before one rlhfkit grpo step (its episodes need the loop)."""
    if task.env is not None:
        return rlhfkit_cell("grpo", task, paths, args)
    import torch
    from transformers import AutoModelForCausalLM

    from real_model import held_out_evaluator

    rewards = task_rewards(task, with_knows=True)
    ev = held_out_evaluator(paths, args, rewards)(AutoModelForCausalLM.from_pretrained(paths["model"],
                                                                                       dtype=torch.float32))
    names = dict(zip(("target", "shaping", "knows"), rewards.names))
    return {"evals": [{"step": 0, **{k: ev[name] for k, name in names.items()}}], "s_per_step": None,
            "guard_tradeoff": None, "steps_run": 0, "reached": False, "settings": {}}


def trl_cell(kind: str, task, paths: dict, args) -> dict:
    """A TRL contender on the task (``real_model.run_trl``, stopped at the task's target)."""
    from real_model import run_trl, trl_settings

    rewards = task_rewards(task)
    res = run_trl(kind, paths, args, rewards)
    names = rewards.names
    evals = [{"step": e["step"], "target": e[names[0]], "shaping": e[names[1]]} for e in res["evals"]]
    return {"evals": evals, "s_per_step": sum(res["phase_s"].values()), "guard_tradeoff": None,
            "steps_run": res["steps"], "reached": res["reached"], "settings": trl_settings(kind, args, rewards)}


def worker(args) -> None:
    """One cell in this process: the task's files, the run, one RESULT line on stdout."""
    import real_tasks
    from rlhfkit.cli.fetch import fetch_model

    pin_to_core(args.core)
    quiet_hf()
    task = real_tasks.TASKS[args.task]
    paths = {"model": fetch_model("smollm2-135m-instruct")["dir"],
             **real_tasks.write(Path(args.out) / "data", task)}
    args.target = task.target
    if args.worker == "base":
        res = base_rates(task, paths, args)
    elif args.worker.startswith("trl"):
        res = trl_cell(args.worker, task, paths, args)
    else:
        res = rlhfkit_cell(args.worker.removeprefix("rlhfkit_"), task, paths, args)
    use = resource.getrusage(resource.RUSAGE_SELF)
    res["peak_rss_mib"] = use.ru_maxrss / 1024
    res["cpu_s"] = use.ru_utime + use.ru_stime  # the whole cell's CPU seconds: on a shared core, wall seconds stretch
    print(RESULT + json.dumps(res), flush=True)


# --------------------------------------------------------------------------- the matrix


def environment() -> dict:
    """Where and with what a row was measured."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "peft", "trl"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu(), "device": "cpu", "dtype": "float32", "versions": versions}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def cell_key(row: dict) -> tuple:
    return tuple(json.dumps(row.get(k, [] if k == "overrides" else None)) for k in CELL_KEYS)


def planned_cells(args) -> list[dict]:
    """The cells asked for, in run order: seed by seed, task by task, the contenders' order
    reversed on every other seed so that none always runs first."""
    import real_tasks

    cells = []
    for i, seed in enumerate(args.seeds):
        for name in args.tasks:
            task = real_tasks.TASKS[name]
            for c in args.contenders if i % 2 == 0 else args.contenders[::-1]:
                if c in ONE_SEED and i > 0 and not args.every_seed:
                    continue
                if c.startswith("trl") and task.env is not None:
                    continue  # GRPOTrainer scores single completions: no episodes
                cells.append({"contender": c, "task": name, "seed": seed, "steps_max": args.steps,
                              "eval_every": args.eval_every, "target": task.target, "overrides": args.override})
    return cells


def run_cell(cell: dict, args) -> dict:
    """One cell in its own pinned process; its row."""
    out = Path(args.out) / f"{cell['contender']}_{cell['task']}_{cell['seed']}"
    worker = "base" if cell["contender"] == "base" else cell["contender"]
    cmd = pinned_cmd(args.core, __file__, "--worker", worker, "--task", cell["task"], "--seed", str(cell["seed"]),
                     "--core", str(args.core), "--out", str(out), "--steps", str(cell["steps_max"]),
                     "--eval-every", str(cell["eval_every"]), "--trl-lr", str(args.trl_lr),
                     "--override", *args.override)
    env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
    where = environment()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"{cell['contender']} {cell['task']} seed {cell['seed']} failed (exit {proc.returncode})")
    res = json.loads(lines[-1][len(RESULT):])
    evals = res["evals"]
    row = {**where, **cell, "batch": 16, "lora_r": 16, "steps_to_target": steps_to_target(evals, cell["target"]),
           "final_target": evals[-1]["target"], "final_shaping": evals[-1]["shaping"],
           "gamed": gamed([e["target"] for e in evals], [e["shaping"] for e in evals]), **res}
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"  {cell['contender']:<18} {cell['task']:<11} seed {cell['seed']:>3}: "
          f"{row['steps_to_target'] if row['steps_to_target'] is not None else '-':>3} steps to "
          f"{cell['target']:g}, held-out target/shaping {evals[0]['target']:.2f}/{evals[0]['shaping']:.2f} -> "
          f"{row['final_target']:.2f}/{row['final_shaping']:.2f}{' GAMED' if row['gamed'] else ''}, "
          f"{row['s_per_step'] or 0:.1f} s/step, peak {row['peak_rss_mib']:.0f} MiB", flush=True)
    return row


def run_base(args) -> None:
    """One row a task: the base model's held-out target, shaping and (where a task has one) the
    answer known in any form, from rlhfkit's evaluation before its first step."""
    import real_tasks

    done = {r["task"] for r in read_rows(Path(args.results)) if r["contender"] == "base"}
    for name in args.tasks:
        if name not in done:
            run_cell({"contender": "base", "task": name, "seed": 0, "steps_max": 1, "eval_every": 0,
                      "target": real_tasks.TASKS[name].target, "overrides": []}, args)


def report(args) -> None:
    """The table: steps to the target per seed (``-`` not reached, ``g`` gamed), and per
    contender the tasks passed: reached in at most --steps steps, ungamed, on at least two
    thirds of the seeds it runs (2 of 3; ``rloo`` and ``reinforce`` 1 of 1)."""
    import real_tasks

    rows = {cell_key(r): r for r in read_rows(Path(args.results)) if r["contender"] != "base"}
    base = {r["task"]: r for r in read_rows(Path(args.results)) if r["contender"] == "base"}
    planned = planned_cells(args)
    print(f"SmolLM2-135M-Instruct + LoRA r 16, 16 completions a step, at most {args.steps} steps, held-out target "
          f"evaluated every {args.eval_every}; seeds {' '.join(map(str, args.seeds))}; {args.results}")
    print(f"{'task':<11}{'target':>7}{'base':>6}  " + "".join(f"{c:<20}" for c in args.contenders))
    passed = dict.fromkeys(args.contenders, 0)
    for name in args.tasks:
        cells = []
        for c in args.contenders:
            found = [rows.get(cell_key(cell)) for cell in planned if cell["contender"] == c and cell["task"] == name]
            marks = ["." if r is None else f"{r['steps_to_target'] or '-'}{'g' if r['gamed'] else ''}" for r in found]
            reached = sum(r is not None and r["steps_to_target"] is not None and not r["gamed"] for r in found)
            passed[c] += bool(found) and 3 * reached >= 2 * len(found)
            cells.append("/".join(marks) or "n/a")
        b = base.get(name)
        print(f"{name:<11}{real_tasks.TASKS[name].target:>7g}{b['evals'][0]['target'] if b else float('nan'):>6.2f}  "
              + "".join(f"{x:<20}" for x in cells))
    print(f"{'passed':<26}" + "".join(f"{passed[c]:<20}" for c in args.contenders))
    print("cells: steps to the target on each seed run ('-' not reached, 'g' the shaping term gamed, '.' not run yet, "
          "n/a: not a cell of the matrix); base: the base model's held-out target rate")


def main() -> None:
    import real_tasks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(real_tasks.TASKS), choices=list(real_tasks.TASKS))
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="reported seeds 0 1 2; tune defaults on 100 101 102")
    ap.add_argument("--every-seed", action="store_true", help="run rloo and reinforce on every seed too")
    ap.add_argument("--core", type=int, default=0, help="CPU core every cell is pinned to")
    ap.add_argument("--steps", type=int, default=60, help="most steps (rollouts of 16 completions) per cell")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--trl-lr", type=float, default=3e-4, help="learning rate of the trl_defaults contender")
    ap.add_argument("--override", nargs="*", default=[], help="dotted rlhfkit keys for the rlhfkit contenders: a variant")
    ap.add_argument("--results", default=str(ROOT / RESULTS), help="the JSONL file rows are appended to")
    ap.add_argument("--out", default="runs/real_matrix", help="run directories")
    ap.add_argument("--base", action="store_true", help="only the base model's held-out rates, one row a task")
    ap.add_argument("--report", action="store_true", help="run nothing: the table from --results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.report:
        return report(args)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    if args.base:
        return run_base(args)
    if any(c.startswith("trl") for c in args.contenders) and args.override:
        sys.exit("--override applies to the rlhfkit contenders only: leave the trl_* contenders out")
    done = {cell_key(r) for r in read_rows(Path(args.results))}
    todo = [c for c in planned_cells(args) if cell_key(c) not in done]
    print(f"{len(todo)} cells to run ({args.results})", flush=True)
    for cell in todo:
        if cell_key(cell) not in {cell_key(r) for r in read_rows(Path(args.results))}:  # another core may have run it
            run_cell(cell, args)
    report(args)


if __name__ == "__main__":
    main()
