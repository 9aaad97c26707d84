"""Render every benchmark table the docs show from the committed record, ``benchmarks/results/*.jsonl``.

A page asks for a table with a pair of markers; everything between them is this script's:

    <!-- results:time_to_accuracy -->
    (the rendered table)
    <!-- /results -->

Runs group by contender, every setting, device, machine, dtype and allocator (so a table never
pools two machines or two configurations); a group shows the median of its runs with their
min-max, the run count, the commit(s) it was measured at (``+dirty``: with uncommitted changes)
and the machine. CPU and GPU rows go in separate tables.

    python benchmarks/render.py           # rewrite the tables in the pages
    python benchmarks/render.py --check   # exit 1 when a committed page differs from what it renders
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "docs" / "benchmarks.md", ROOT / "benchmarks" / "README.md")
MARKED = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results -->)", re.S)
PPO_STEP = {"rlhfkit_ppo": "rlhfkit PPO", "trl_ppo": "TRL PPO (PPOTrainer 1.12)", "rlhfkit_grpo": "rlhfkit GRPO",
            "rlhfkit_grpo_trl_schedule": "rlhfkit GRPO on TRL's schedule", "trl_grpo": "TRL GRPO"}
TRL_SIDE = ("trl_grpo", "trl_schedule")
CONTENDERS = {"rlhfkit_ppo": "rlhfkit PPO", "rlhfkit_grpo": "rlhfkit GRPO", "trl_grpo": "TRL GRPO",
              "trl_schedule": "TRL GRPO on rlhfkit's schedule", "grpo_trl_schedule": "rlhfkit GRPO on TRL's schedule"}


def load(benchmark: str, results: Path = RESULTS) -> list[dict]:
    """The recorded runs of ``benchmark``, oldest first; a run given a ``superseded`` key by hand
    (the code it measured was replaced) stays in the file and out of the tables."""
    path = results / f"{benchmark}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if "superseded" not in r]


def spread(values: list[float], fmt: str) -> str:
    """``median (min–max)`` of ``values``; the value alone when there is one."""
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} ({min(values):{fmt}}–{max(values):{fmt}})"


def groups(rows: list[dict]) -> list[list[dict]]:
    """Runs that measured the same thing in the same place, in order of first appearance: same
    contender, settings, device, machine, dtype, allocator and threads."""
    found: dict[str, list[dict]] = {}
    for r in rows:
        key = json.dumps([r["contender"], r["settings"], r["device"], r["machine"], r["dtype"], r["allocator"],
                          r["threads"]], sort_keys=True)
        found.setdefault(key, []).append(r)
    return list(found.values())


def commits(runs: list[dict]) -> str:
    return ", ".join(sorted({r["commit"] + ("+dirty" if r.get("dirty") else "") for r in runs}))


def machine(runs: list[dict]) -> str:
    m = runs[0]["machine"]
    return f"{m['cpu']}, {m['cores']} cores"


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])


def by_device(grouped: list[list[dict]], render_one) -> str:
    """One table per device kind, CPU first: a CPU figure says nothing about a GPU."""
    parts = []
    for kind, title in (("cpu", "CPU"), ("gpu", "GPU")):
        mine = [g for g in grouped if (g[0]["device"] == "cpu") == (kind == "cpu")]
        if mine:
            parts.append(f"**{title}**\n\n" + render_one(mine))
    return "\n\n".join(parts)


def time_to_accuracy(rows: list[dict]) -> str:
    """Rollouts and training seconds to the held-out target, per contender."""
    def render_one(grouped):
        lines = []
        for g in grouped:
            s = g[0]["settings"]
            rollouts = [r["rollouts"] for r in g]
            seconds = [r["times_s"][0] for r in g]
            missed = sum(not r["reached"] for r in g)
            lines.append([g[0]["device"], CONTENDERS.get(g[0]["contender"], g[0]["contender"]),
                          f"{s['reward']}, {s['target']}", spread(rollouts, "g") + ("*" if missed else ""),
                          spread([t / max(1, n) for t, n in zip(seconds, rollouts)], ".3f"), spread(seconds, ".1f"),
                          s["clock"], spread([r["peak_mib"] for r in g], ".0f") + f" ({g[0]['allocator']})",
                          f"{len(g)} (seeds {' '.join(str(r['seeds'][0]) for r in g)})", commits(g), machine(g)])
        head = table(["device", "contender", "reward, target", "rollouts to target", "s / rollout",
                      "s to target", "clock", "peak MiB (allocator)", "runs", "commit", "machine"], lines)
        return "\n\n".join([head, *filter(None, ["\n".join(tta_ratios(grouped))])])

    note = ("Seconds of training only (rollout + experience + update; evaluation excluded) on the clock the "
            "column names (cpu: the process's CPU seconds; wall: elapsed), one torch thread, median (min–max) over "
            "runs. `*`: a run stopped at `--max-steps` before the target (its figures, and a ratio with them, are bounds).")
    return by_device(groups(rows), render_one) + "\n\n" + note


def ratios(grouped: list[list[dict]], names: dict, pairs, alike, measures) -> list[str]:
    """``ours / theirs`` for each pair of contenders measured alike (``alike(group)`` equal): the
    ratio of each measure's value, with both sides named, and their commits where they differ."""
    lines = []
    for a, b in pairs:
        for ours in (g for g in grouped if g[0]["contender"] == a):
            for theirs in (g for g in grouped if g[0]["contender"] == b and alike(g) == alike(ours)):
                parts = [f"{measure(ours) / measure(theirs):.2f}× {label}" for label, measure in measures]
                apart = "" if commits(ours) == commits(theirs) else f" (commits {commits(ours)} against {commits(theirs)})"
                lines.append(f"- {names[a]} / {names[b]}: {', '.join(parts)}{apart}")
    return lines


def tta_ratios(grouped: list[list[dict]]) -> list[str]:
    """Each rlhfkit contender against each TRL contender on the same device, machine, reward,
    target, clock, evaluation interval and rollout size: the ratios of the medians."""
    def alike(g):
        s = g[0]["settings"]
        return g[0]["device"], machine(g), s["reward"], s["target"], s["clock"], s["eval_every"], s["batch_size"]

    pairs = [(ours, theirs) for theirs in TRL_SIDE for ours in CONTENDERS if ours not in TRL_SIDE]
    measures = [("the seconds to the target", lambda g: statistics.median(r["times_s"][0] for r in g)),
                ("the rollouts", lambda g: statistics.median(r["rollouts"] for r in g))]
    return ratios(grouped, CONTENDERS, pairs, alike, measures)


def rollout(rows: list[dict]) -> str:
    """Tokens per second of each runner; every call of every run pooled."""
    def render_one(grouped):
        lines = []
        generate = {}  # (device, machine, model) -> median tokens/s of transformers' generate
        for g in grouped:
            rates = [r["tokens_per_call"] / t for r in g for t in r["times_s"]]
            if g[0]["contender"] == "transformers generate":
                generate[where(g)] = statistics.median(rates)
        for g in grouped:
            s, rates = g[0]["settings"], [r["tokens_per_call"] / t for r in g for t in r["times_s"]]
            ratio = statistics.median(rates) / generate[where(g)] if where(g) in generate else None
            lines.append([g[0]["device"], s["model"], g[0]["contender"], f"{s['batch']} × {s['new_tokens']}",
                          g[0]["dtype"], s["clock"], spread(rates, ".0f"), f"{ratio:.2f}×" if ratio else "–",
                          f"{len(g)} ({len(rates)} calls)", commits(g), machine(g)])
        return table(["device", "model", "runner", "batch × new tokens", "dtype", "clock", "tokens/s", "vs generate",
                      "runs (calls)", "commit", "machine"], lines)

    note = ("Sampling at temperature 1 with a KV cache, EOS disabled so every call makes the same tokens; "
            "tokens/s: median (min–max) over every timed call; vs generate: the ratio of medians on the same "
            "device and machine, for the same model, shape and clock.")
    return by_device(groups(rows), render_one) + "\n\n" + note


def ppo_step(rows: list[dict]) -> str:
    """Milliseconds of one RL step on the tiny doubling model, phase by phase."""
    def render_one(grouped):
        lines = []
        for g in grouped:
            s = g[0]["settings"]
            phases = [spread([r["phase_median_s"][k] * 1e3 for r in g], ".1f") for k in ("rollout", "experience", "update")]
            lines.append([g[0]["device"], PPO_STEP.get(g[0]["contender"], g[0]["contender"]), s["schedule"], *phases,
                          spread([t * 1e3 for r in g for t in r["times_s"]], ".1f"), s["clock"],
                          spread([r["peak_mib"] for r in g], ".0f") + f" ({g[0]['allocator']})",
                          f"{len(g)} ({sum(len(r['times_s']) for r in g)} steps)", commits(g), machine(g)])
        head = table(["device", "contender", "schedule", "rollout ms", "experience ms", "update ms", "step ms", "clock",
                      "peak MiB (allocator)", "runs (steps)", "commit", "machine"], lines)
        pairs = (("rlhfkit_ppo", "trl_ppo"), ("rlhfkit_grpo", "trl_grpo"), ("rlhfkit_grpo_trl_schedule", "trl_grpo"))
        step = [("the step time", lambda g: statistics.median(t for r in g for t in r["times_s"]))]
        alike = lambda g: (g[0]["device"], machine(g), g[0]["settings"]["clock"])  # noqa: E731
        return "\n\n".join([head, *filter(None, ["\n".join(ratios(grouped, PPO_STEP, pairs, alike, step))])])

    note = ("One step of 64 completions of at most 8 tokens after warm-up steps; phases: median over runs of each "
            "run's median step; step: median (min–max) over every measured step.")
    return by_device(groups(rows), render_one) + "\n\n" + note


def guard_sim(rows: list[dict]) -> str:
    """The reward-hacking guards on simulated runs: how often each healthy case raises its guard,
    how often and how soon each collapse is flagged; one line per case and commit, over that
    commit's recorded simulations of the case."""
    def render_one(kind):
        found: dict[tuple, list[dict]] = {}
        for r in rows:
            if r["kind"] == kind:
                found.setdefault((r["case"], r["commit"]), []).append(r)
        lines = []
        for (case, commit), g in sorted(found.items(), key=lambda kv: kv[0][0]):
            firsts = [r["median_first_step"] for r in g if r["median_first_step"] is not None]
            lines.append([case, f"`{g[0]['guard']}`", f"{len(g)} × {g[0]['runs']}",
                          spread([r["alarm_rate"] for r in g], ".2%"),
                          f"{min(r['ci95'][0] for r in g):.2%}–{max(r['ci95'][1] for r in g):.2%}",
                          spread(firsts, "g") if firsts else "–", commit])
        return table(["case", "guard", "simulations × runs", "alarm rate", "95% interval",
                      "median first flagged step", "commit"], lines)

    return ("**Healthy runs** (an alarm is a false one)\n\n" + render_one("null") +
            "\n\n**Collapses** (an alarm is a detection)\n\n" + render_one("collapse") +
            "\n\nSimulated 100-step runs fed to the watch `train_rl` builds, with the config's defaults; a commit's "
            "rows are that commit's guards; alarm rate: median (min–max) over the simulations. No timing: the "
            "machine does not enter.")


def _measures(r: dict) -> dict[str, float]:
    """What a row of another benchmark measured, by name: a step's seconds (real_step) or a
    rollout's and the rollouts to the target (time_to_accuracy)."""
    if "seconds" in r:
        return {"s / step": r["seconds"]["total"], "peak MiB": r.get("peak_rss_mib", float("nan"))}
    if "rollouts" in r:
        return {"rollouts": r["rollouts"], "s / rollout": r["times_s"][0] / max(1, r["rollouts"])}
    return {"s": statistics.median(r["times_s"])}


def commit_ab(rows: list[dict]) -> str:
    """Each benchmark at two commits, runs alternating on one machine (benchmarks/ab_commits.py):
    median (min–max) per commit and the new / old ratio of the medians."""
    found: dict[str, list[dict]] = {}
    for r in rows:
        key = json.dumps([r["ab"]["script"], r["ab"]["args"], r["ab"]["env"], r["contender"], r["device"],
                          r["machine"], r["dtype"]], sort_keys=True)
        found.setdefault(key, []).append(r)
    lines = []
    for g in found.values():
        sides = {side: [r for r in g if r["ab"]["side"] == side] for side in ("old", "new")}
        for name in _measures(g[0]):
            vals = {side: [_measures(r)[name] for r in runs] for side, runs in sides.items()}
            if not all(vals.values()):
                continue
            ratio = statistics.median(vals["new"]) / statistics.median(vals["old"])
            fmt = ".0f" if statistics.median(vals["old"]) >= 100 else \
                ".2f" if statistics.median(vals["old"]) >= 1 else ".4f"
            env = " ".join(f"{k}={v}" for k, v in g[0]["ab"]["env"].items())
            lines.append([g[0]["device"], f"`{g[0]['ab']['script']} {' '.join(g[0]['ab']['args'])}` {env}",
                          g[0]["contender"], name, f"{spread(vals['old'], fmt)} ({commits(sides['old'])})",
                          f"{spread(vals['new'], fmt)} ({commits(sides['new'])})", f"{ratio:.3f}",
                          str(len(sides["old"])), machine(g)])
    return table(["device", "benchmark", "contender", "measure", "old commit", "new commit", "new / old", "runs each",
                  "machine"], lines)


def where(g: list[dict]) -> tuple:
    s = g[0]["settings"]
    return g[0]["device"], machine(g), s["model"], s["batch"], s["new_tokens"], g[0]["dtype"], s["clock"]


# name -> (renderer, the command that appends its rows)
TABLES = {
    "time_to_accuracy": (time_to_accuracy, "python benchmarks/time_to_accuracy.py --seeds 0 1 2 "
                                           "--contenders rlhfkit_grpo rlhfkit_ppo trl_grpo --clock cpu --core 1 --record"),
    "rollout": (rollout, "python benchmarks/rollout.py --models tiny gpt2-small --repeats 3 --clock cpu --core 1 "
                         "--record"),
    "ppo_step": (ppo_step, "python benchmarks/ppo_step.py --clock cpu --core 1 --record"),
    "guard_sim": (guard_sim, "python benchmarks/guard_sim.py"),
    "commit_ab": (commit_ab, "python benchmarks/ab_commits.py OLD NEW --runs 2 -- real_step.py --size smollm2 "
                             "--rows rlhfkit_grpo --groups 4 --group-size 4 --new-tokens 16 --steps 2 --warmup 1 "
                             "--runs 1 --core 1"),
}


def render(name: str, results: Path = RESULTS) -> str:
    """The block between ``name``'s markers: its table(s), or a line saying none is recorded, and
    the command that records more."""
    if name not in TABLES:
        raise SystemExit(f"unknown table '{name}' in a results marker; known: {', '.join(TABLES)}")
    fn, command = TABLES[name]
    rows = load(name, results)
    body = fn(rows) if rows else f"No run of `{name}` is recorded yet."
    return f"{body}\n\nRows: `benchmarks/results/{name}.jsonl`; more of them: `{command}`, then " \
           f"`python benchmarks/render.py`.\n"


def render_page(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked block replaced by what :func:`render` makes of it."""
    return MARKED.sub(lambda m: m.group(1) + render(m.group(2), results) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="*", type=Path, default=list(PAGES), help="default: the pages that show results")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs from its rendering")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of <benchmark>.jsonl files")
    args = ap.parse_args(argv)
    stale = []
    for page in args.pages:
        text = page.read_text()
        new = render_page(text, args.results)
        if new != text:
            stale.append(str(page))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"out of date with {args.results}: {', '.join(stale)}; run python benchmarks/render.py")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "every page is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
