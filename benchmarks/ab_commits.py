"""One benchmark at two commits, runs alternating (old, new, old, new ...) on one machine: what a
change of the code did to a measured time, with the spread over runs on both sides, and so does the script's ``--out`` (what it caches there, such as a pretrained base,
is built once and used by both).

Each commit is checked out once as a detached git worktree under ``--work``; every run is that
worktree's own copy of the script importing its own package (``PYTHONPATH``), so the script's
options must exist at both commits. Environment settings (``--env RLHFKIT_ACCEL=on``) apply to
both sides.

    python benchmarks/ab_commits.py OLD NEW --runs 2 --env RLHFKIT_ACCEL=on -- \\
        real_step.py --size smollm2 --rows rlhfkit_grpo --steps 2 --warmup 1 --runs 1

Every row a run writes to its scratch ``results.jsonl`` is appended, with ``ab`` (the script,
its arguments, the environment, the pair it belongs to), to ``--to`` (default
``benchmarks/results/commit_ab.jsonl``), which ``benchmarks/render.py`` renders.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worktree(rev: str, work: Path) -> Path:
    """A detached checkout of ``rev`` under ``work`` (made once, reused)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    path = work / sha[:12]
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def run_once(tree: Path, script: list[str], env: dict, out: Path) -> list[dict]:
    """The rows one run of ``script`` in ``tree`` wrote (its scratch results.jsonl under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    full_env = {**os.environ, **env, "PYTHONPATH": str(tree / "src")}
    subprocess.run([sys.executable, str(tree / "benchmarks" / script[0]), *script[1:], "--out", str(out)],
                   cwd=tree, env=full_env, check=True)
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--runs", type=int, default=2, help="runs of each side, alternating")
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE settings for both sides")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlhfkit-ab"), help="where the two checkouts go")
    ap.add_argument("--to", type=Path, default=ROOT / "benchmarks" / "results" / "commit_ab.jsonl")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        ap.error("name the benchmark script after --: ... -- SCRIPT.py [its options] (without --out)")
    cut = argv.index("--")
    args, script = ap.parse_args(argv[:cut]), argv[cut + 1:]
    env = dict(kv.split("=", 1) for kv in args.env)
    trees = {side: worktree(rev, args.work) for side, rev in (("old", args.old), ("new", args.new))}
    for pair in range(args.runs):
        for side, tree in trees.items():
            rows = run_once(tree, script, env, args.work / "out")  # one --out: models it caches serve both sides
            with open(args.to, "a") as f:
                for row in rows:
                    ab = {"script": script[0], "args": script[1:], "env": env, "pair": pair, "side": side}
                    f.write(json.dumps({**row, "benchmark": "commit_ab", "measured": row.get("benchmark"),
                                        "ab": ab}) + "\n")
            print(f"pair {pair} {side} ({tree.name}): {len(rows)} row(s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
