"""Every benchmark number the docs show is rendered from the committed record: the pages equal what
``benchmarks/render.py`` makes of ``benchmarks/results/*.jsonl``, its cells are the median and
min-max of the recorded runs (checked against values worked out by hand), and a benchmark's row
carries where and with what it was measured."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rlhfkit

ROOT = Path(__file__).resolve().parents[1]
RENDER = ROOT / "benchmarks" / "render.py"


def _module(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the scripts import bench_common as a top-level module
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True, cwd=ROOT)


def _write(folder: Path, benchmark: str, rows: list[dict]) -> None:
    (folder / f"{benchmark}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


CPU_A = {"cpu": "AMD EPYC 7B13 (family 25, model 1)", "cores": 2}
CPU_B = {"cpu": "Intel Xeon (family 6, model 207)", "cores": 2}


def _tta(seed, rollouts, seconds, device="cpu", machine=CPU_A, reached=True, commit="abc1234", contender="rlhfkit_grpo"):
    return {"benchmark": "time_to_accuracy", "contender": contender, "seeds": [seed], "times_s": [seconds],
            "rollouts": rollouts, "reached": reached, "final_exact": 0.99, "peak_mib": 500.0 + seed,
            "settings": {"reward": "exact", "target": 0.99, "clock": "cpu", "eval_every": 5, "batch_size": 64},
            "device": device, "machine": machine,
            "dtype": "fp32", "allocator": "glibc" if device == "cpu" else "cuda caching", "threads": 1,
            "commit": commit, "dirty": False}


def test_committed_pages_equal_what_the_script_renders():
    done = _render("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_pages_show_every_table_the_script_knows():
    render = _module("render")
    for page in render.PAGES:
        assert {m[1] for m in render.MARKED.findall(page.read_text())} == set(render.TABLES), page


def test_time_to_accuracy_cells_are_median_and_range_over_runs(tmp_path):
    rows = [_tta(0, 90, 9.0), _tta(1, 100, 12.0), _tta(2, 80, 10.0, reached=False, commit="def5678"),
            _tta(0, 70, 3.5, device="NVIDIA H100 80GB HBM3"), _tta(0, 60, 6.0, machine=CPU_B)]
    _write(tmp_path, "time_to_accuracy", rows)
    text = _module("render").render("time_to_accuracy", tmp_path)
    cpu, gpu = text.split("**GPU**")
    assert "**CPU**" in cpu
    lines = [ln for ln in cpu.splitlines() if ln.startswith("| cpu")]
    assert len(lines) == 2  # another machine is another row, never pooled
    cells = [c.strip() for c in lines[0].split("|")[1:-1]]
    # rollouts 90 100 80 -> 90 (80-100), one stopped early; s/rollout 0.100 0.120 0.125; s 9 12 10
    assert cells[1] == "rlhfkit GRPO"
    assert cells[3:6] == ["90 (80–100)*", "0.120 (0.100–0.125)", "10.0 (9.0–12.0)"]
    assert cells[7] == "501 (500–502) (glibc)"
    assert cells[8] == "3 (seeds 0 1 2)" and cells[9] == "abc1234, def5678"
    assert cells[10] == "AMD EPYC 7B13 (family 25, model 1), 2 cores"
    assert "Intel Xeon (family 6, model 207)" in lines[1] and "| 60 |" in lines[1]
    gpu_lines = [ln for ln in gpu.splitlines() if ln.startswith("| NVIDIA")]
    assert len(gpu_lines) == 1 and "| 70 |" in gpu_lines[0] and "cuda caching" in gpu_lines[0]


def test_time_to_accuracy_names_both_sides_of_a_ratio_measured_alike(tmp_path):
    ours = [_tta(0, 90, 9.0), _tta(1, 100, 12.0), _tta(2, 80, 10.0)]
    theirs = [_tta(s, n, t, contender="trl_grpo") for s, n, t in ((0, 200, 20.0), (1, 300, 30.0), (2, 250, 25.0))]
    ppo = [_tta(0, 50, 4.0, contender="rlhfkit_ppo", commit="def5678")]
    elsewhere = [_tta(0, 100, 5.0, machine=CPU_B, contender="trl_grpo")]  # another machine: no ratio against it
    _write(tmp_path, "time_to_accuracy", ours + theirs + elsewhere + ppo)
    text = _module("render").render("time_to_accuracy", tmp_path)
    # seconds: median 10 against 25 -> 0.40x; rollouts: 90 against 250 -> 0.36x
    ratios = [ln for ln in text.splitlines() if ln.startswith("- ")]
    assert ratios == ["- rlhfkit PPO / TRL GRPO: 0.16× the seconds to the target, 0.20× the rollouts "
                      "(commits def5678 against abc1234)",  # 4/25, 50/250
                      "- rlhfkit GRPO / TRL GRPO: 0.40× the seconds to the target, 0.36× the rollouts"]
    assert "**GPU**" not in text


def test_rollout_pools_every_call_and_divides_medians_on_one_machine(tmp_path):
    def row(runner, times):
        return {"benchmark": "rollout", "contender": runner, "times_s": times, "tokens_per_call": 100,
                "settings": {"model": "tiny", "batch": 10, "new_tokens": 10, "clock": "cpu"}, "seeds": [0],
                "peak_mib": 300.0,
                "device": "cpu", "machine": CPU_A, "dtype": "fp32", "allocator": "glibc", "threads": 1,
                "commit": "abc1234", "dirty": True}

    _write(tmp_path, "rollout", [row("transformers generate", [0.5, 0.25]), row("rlhfkit", [0.25]),
                                 row("rlhfkit", [0.125])])
    text = _module("render").render("rollout", tmp_path)
    ours = next(ln for ln in text.splitlines() if "| rlhfkit |" in ln)
    # generate: 200 and 400 tokens/s -> 300; rlhfkit: 400 and 800 over two runs -> 600, 2.00x
    assert "| cpu | 600 (400–800) | 2.00× | 2 (2 calls) | abc1234+dirty |" in ours
    assert "| 300 (200–400) | 1.00× | 1 (2 calls) |" in text


def test_ppo_step_phases_are_medians_over_runs_and_the_step_pools_every_step(tmp_path):
    def row(times, rollout, contender="rlhfkit_grpo"):
        return {"benchmark": "ppo_step", "contender": contender, "times_s": times, "seeds": [0],
                "phase_median_s": {"rollout": rollout, "experience": 0.002, "update": 0.004}, "peak_mib": 400.0,
                "settings": {"schedule": "16x4, 2x2 of 32", "clock": "cpu"}, "device": "cpu", "machine": CPU_A,
                "dtype": "fp32", "allocator": "tcmalloc", "threads": 1, "commit": "abc1234", "dirty": False}

    _write(tmp_path, "ppo_step", [row([0.010, 0.012], 0.003), row([0.011, 0.020, 0.009], 0.005),
                                  row([0.020, 0.024], 0.010, "trl_grpo")])
    text = _module("render").render("ppo_step", tmp_path)
    line = next(ln for ln in text.splitlines() if ln.startswith("| cpu"))
    # rollout medians 3 and 5 ms -> 4.0 (3.0-5.0); steps 10 12 11 20 9 ms -> 11.0 (9.0-20.0)
    assert "| 4.0 (3.0–5.0) | 2.0 (2.0–2.0) | 4.0 (4.0–4.0) | 11.0 (9.0–20.0) | cpu | 400 (400–400) (tcmalloc) |" in line
    assert "| 2 (5 steps) |" in line and "| rlhfkit GRPO |" in line
    # every step: 11 ms against TRL's 22 -> 0.50x
    assert [ln for ln in text.splitlines() if ln.startswith("- ")] == ["- rlhfkit GRPO / TRL GRPO: 0.50× the step time"]


def test_guard_sim_groups_a_cases_simulations_by_commit(tmp_path):
    def row(case, kind, rate, ci, first, commit):
        return {"case": case, "kind": kind, "guard": "guard/kl_high", "runs": 2000, "alarm_rate": rate, "ci95": ci,
                "median_first_step": first, "commit": commit}

    _write(tmp_path, "guard_sim", [row("kl/a", "null", 1.0, [0.9981, 1.0], 4.0, "old1234"),
                                   row("kl/a", "null", 0.001, [0.0003, 0.0036], 44.0, "new5678"),
                                   row("kl/a", "null", 0.003, [0.0010, 0.0060], 40.0, "new5678"),
                                   row("kl/b", "collapse", 1.0, [0.9981, 1.0], None, "new5678")])
    text = _module("render").render("guard_sim", tmp_path)
    healthy, collapses = text.split("**Collapses**")
    assert "| kl/a | `guard/kl_high` | 1 × 2000 | 100.00% | 99.81%–100.00% | 4 | old1234 |" in healthy
    # two simulations at one commit: rates 0.1% and 0.3% -> 0.20% (0.10%-0.30%), first steps 44 and 40 -> 42
    assert "| kl/a | `guard/kl_high` | 2 × 2000 | 0.20% (0.10%–0.30%) | 0.03%–0.60% | 42 (40–44) | new5678 |" in healthy
    assert "| kl/b | `guard/kl_high` | 1 × 2000 | 100.00% | 99.81%–100.00% | – | new5678 |" in collapses


def test_check_fails_on_a_stale_page_and_rendering_fixes_it(tmp_path):
    _write(tmp_path, "rollout", [])
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- results:rollout -->\n| a hand-typed | 0.86x |\n<!-- /results -->\nafter\n")
    stale = _render("--check", "--results", str(tmp_path), str(page))
    assert stale.returncode == 1 and "out of date" in stale.stdout
    assert _render("--results", str(tmp_path), str(page)).returncode == 0
    text = page.read_text()
    assert "0.86x" not in text and "No run of `rollout` is recorded yet." in text and text.endswith("after\n")
    assert _render("--check", "--results", str(tmp_path), str(page)).returncode == 0


def test_an_unknown_table_is_one_clear_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- results:nonsense -->\n<!-- /results -->\n")
    done = _render("--check", str(page))
    assert done.returncode != 0 and "unknown table 'nonsense'" in done.stderr


def test_a_recorded_row_carries_where_and_with_what_it_ran(tmp_path, monkeypatch):
    bench = _module("bench_common")
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc_minimal.so.4")
    args = SimpleNamespace(record=False, out=str(tmp_path))
    bench.record("rollout", {"contender": "rlhfkit", "settings": {"model": "tiny"}, "seeds": [0],
                             "times_s": [0.5, 0.25], "tokens_per_call": 100, "peak_mib": 1.0}, args)
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert row["commit"] == head.stdout.strip() and isinstance(row["dirty"], bool)
    assert row["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert set(row["versions"]) == {"rlhfkit", "torch", "transformers", "peft", "trl"}
    assert row["versions"]["rlhfkit"] == rlhfkit.__version__
    assert row["machine"]["cores"] == os.cpu_count() and row["machine"]["cpu"]
    assert (row["device"], row["dtype"], row["allocator"]) == ("cpu", "fp32", "tcmalloc")
    assert row["threads"] == torch.get_num_threads() and row["times_s"] == [0.5, 0.25]
    # --record sends the same row to the committed file the renderer reads
    assert bench.results_path("rollout", SimpleNamespace(record=True, out="x")) == ROOT / "benchmarks" / "results" / "rollout.jsonl"


@pytest.mark.parametrize("benchmark", ["time_to_accuracy", "rollout", "ppo_step"])
def test_committed_rows_hold_every_field_the_tables_and_readers_need(benchmark):
    rows = _module("render").load(benchmark)
    for r in rows:
        for key in ("commit", "dirty", "versions", "machine", "device", "dtype", "allocator", "threads", "contender",
                    "settings", "seeds", "times_s", "peak_mib"):
            assert key in r, (benchmark, key)
