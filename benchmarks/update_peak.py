"""What is alive at the peak of one rlhfkit GRPO update: every tensor, by what made it.

``real_step.py`` gives each phase's peak as one number (the resident set on a CPU, the CUDA
allocator's ``max_memory_allocated`` on a GPU). This script runs one of its rlhfkit rows the same
way (same model, workload and switches: ``--rows`` names it) for a warm-up step and a measured
one, and records the measured step's update -- from the end of the experience phase, so the
moments' copy back under ``accel.offload`` is in it -- under ``torch.profiler`` with
``profile_memory``. From the profiler's memory timeline (``torch.profiler._memory_profiler``, the
same one ``export_memory_timeline`` plots) it prints:

- the peak of the live tensors on the device and the op running at it;
- the tensors alive at the peak, grouped by size, the profiler's category (parameter, gradient,
  optimizer state, activation, ...) and the op that allocated them (``pre``: made before the
  recorded span, such as the weights and the moments);
- the step's own phase peak from ``real_step``'s clock, for comparison.

The live tensors count what the allocator handed out, not what it keeps cached, so on CUDA the
peak here is ``max_memory_allocated``'s (up to the allocator's rounding); on a CPU the resident
set is higher (the heap's own pages).

    python benchmarks/update_peak.py --size smollm2 --workload short --rows rlhfkit_grpo_ckpt --core 1
    python benchmarks/update_peak.py --device cuda --size smollm2-init --shape-from DIR --workload short \\
        --rows rlhfkit_grpo_graph_ckpt_offload

Results typed by hand before the record existed are in ``archive/RESULTS.md`` ("What the update
holds at its peak"); not regenerable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import real_step as rs  # noqa: E402
from bench_common import add_record_args, commit, cpu, pin_to_core, record  # noqa: E402


def live_at_peak(prof, device: str):
    """(peak bytes, its time in us, {key: (bytes, category, creator)} alive then, op at the peak)."""
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    mp = prof._memory_profile()
    times, sizes = MemoryProfileTimeline(mp)._coalesce_timeline(device)
    totals = [sum(s) for s in sizes]
    i = max(range(len(totals)), key=totals.__getitem__)
    peak_t = times[i]
    creator, running = {}, "?"
    for node in mp._data_flow_graph.flow_nodes:
        for key, edge in node._edges.items():
            if edge.is_allocation:
                creator.setdefault(key, node._event.name)
        if node.start_time / 1000 <= peak_t:
            running = node._event.name
    live = {}
    for t, action, (key, version), nbytes in mp.timeline:
        t = int(t / 1000) if t != -1 else -1
        if key.device != torch.device(device) or t > peak_t:
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            cat = mp._categories.get(key, version)
            live[key] = (nbytes, "?" if cat is None else cat.name.lower(), "pre" if t == -1 else creator.get(key, "?"))
        elif action == Action.INCREMENT_VERSION and key in live:
            cat = mp._categories.get(key, version + 1)
            live[key] = (live[key][0], "?" if cat is None else cat.name.lower(), live[key][2])
        elif action == Action.DESTROY:
            live.pop(key, None)
    return totals[i], peak_t, live, running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(rs.SIZES), default="smollm2")
    ap.add_argument("--layers", type=int, help="decoder layers of a random-init gpt2 / qwen model")
    ap.add_argument("--workload", choices=list(rs.WORKLOADS), default="short")
    ap.add_argument("--rows", default="rlhfkit_grpo_ckpt", choices=[r for r in rs.ROWS if r.startswith("rlhfkit")],
                    help="the rlhfkit row whose update is taken apart")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape-from", help="smollm2-init: the directory whose config and tokenizer the model takes")
    ap.add_argument("--core", type=int, help="pin to this core (CPU)")
    ap.add_argument("--top", type=int, default=25, help="groups of live tensors to list")
    ap.add_argument("--out", default="runs/update_peak")
    add_record_args(ap)
    args = ap.parse_args()
    if args.core is not None:
        pin_to_core(args.core)
    rs.quiet_hf()
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")  # as real_step's workers
    args.layers = rs.model_layers(args.size, args.layers)
    args.warmup, args.steps, args.seed = 1, 1, 0
    wl = dict(rs.WORKLOADS[args.workload])
    paths = rs.prepare(Path(args.out), args.size, args.layers, wl["prompt_tokens"], 256, args.shape_from)

    from torch.profiler import ProfilerActivity, profile

    import rlhfkit.trainers.rl as rl

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    state = {"experiences": 0, "prof": None}
    make_experience, ppo_update = rl.make_experience, rl.ppo_update

    def experience(*a, **kw):  # the last step's: open the recording as the experience phase ends
        out = make_experience(*a, **kw)
        state["experiences"] += 1
        if state["experiences"] == args.warmup + args.steps:
            state["prof"] = profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True)
            state["prof"].__enter__()
        return out

    def update(*a, **kw):
        out = ppo_update(*a, **kw)
        if state["prof"] is not None:
            if args.device == "cuda":
                torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
        return out

    rl.make_experience, rl.ppo_update = experience, update
    result = rs.run_rlhfkit(args.rows, paths, wl, args)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    peak, _, live, running = live_at_peak(state["prof"], device)
    mib = 2**20
    print(f"\n{args.rows}, {args.size} ({args.layers} layers), workload {args.workload}, {args.device}; "
          f"commit {commit()}, {torch.cuda.get_device_name() if args.device == 'cuda' else cpu()}")
    print(f"update's phase peak ({'max_memory_allocated' if args.device == 'cuda' else 'resident set'}): "
          f"{result['steps'][-1]['peak_mib']['update']:.0f} MiB")
    print(f"live tensors at the recorded peak: {peak / mib:.0f} MiB, during {running}")
    by_cat = Counter()
    for nbytes, cat, _ in live.values():
        by_cat[cat] += nbytes
    print("by category: " + ", ".join(f"{c} {b / mib:.0f}" for c, b in by_cat.most_common()))
    groups = Counter()
    for nbytes, cat, made_by in live.values():
        groups[(nbytes, cat, made_by)] += 1
    print(f"\n{'MiB each':>9} {'count':>6} {'MiB':>8}  category          made by")
    for (nbytes, cat, made_by), n in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[: args.top]:
        print(f"{nbytes / mib:9.2f} {n:6d} {nbytes * n / mib:8.1f}  {cat:16s}  {made_by}")
    found = {"row": args.rows, "peak_mib": peak / mib, "phase_peak_mib": result["steps"][-1]["peak_mib"]["update"],
             "by_category_mib": {c: b / mib for c, b in by_cat.items()}, "running": running}
    print(json.dumps(found))
    settings = {"size": args.size, "layers": args.layers, "workload": wl}
    record("update_peak", {"contender": args.rows, "settings": settings, "seeds": [args.seed],
                           "times_s": [sum(s["seconds"].values()) for s in result["steps"]], **found}, args, args.device)


if __name__ == "__main__":
    main()
