"""Generation with FSDP2-sharded weights: gather every layer once per rollout, or each layer
around each of its forwards?

rlhfkit's rollout under FSDP runs inside ``distributed.full_weights(model)``: every sharded
module is all-gathered once before the rollout and kept whole until it ends (one all-gather
per layer per rollout; the full weights held meanwhile; the lean decode path can run on
them). ``full_weights(model, per_layer=True)`` gathers only the root's own weights
(embeddings, final norm) and lets FSDP's hooks gather and free each layer around each of its
forwards: one all-gather per layer per generated token, only one layer whole at a time, and
the model's own forward (the lean path does not run on sharded layers).

A random-init GPT-2 (``--layers``, width 768, vocabulary 50257: GPT-2 small's shape by default)
is sharded per block over the launched processes (gloo on a CPU, NCCL on GPUs), and each
variant samples ``--rows`` prompts of ``--prompt`` random tokens for ``--new`` tokens, best of
``--repeats``:

    gather-all, lean     the default (``full_weights(model)``)
    gather-all, HF       the same weights, the model's own forward (``lean=False``): separates
                         the lean path's share from the gathering's
    per-layer, HF        ``full_weights(model, per_layer=True)``

Memory is each process's resident-set peak during the call (``VmHWM`` after a reset, memory
freed by the variant before handed back to the OS first), the largest over processes. Run it with two processes:

    torchrun --nproc_per_node 2 benchmarks/fsdp_gather.py
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_common import add_record_args, proc_status_mib, quiet_hf, record, reset_peak_rss  # noqa: E402


def build(layers: int):
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257)).eval()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def release_freed_memory() -> None:
    """Hand memory freed by earlier variants back to the OS (glibc ``malloc_trim``), so that each
    variant's resident-set peak is its own, not inherited from the one before."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run(model, variant: str, args) -> tuple[list[float], float, float]:
    from rlhfkit.rollout.generate import generate
    from rlhfkit.run.distributed import full_weights

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(50000, (args.rows, args.prompt), generator=gen)
    u = torch.rand(args.rows, args.new, generator=gen)
    times, peak, before = [], 0.0, float("inf")
    for _ in range(args.repeats):
        release_freed_memory()
        dist.barrier()
        before = min(before, proc_status_mib("VmRSS"))
        reset_peak_rss()
        t0 = time.perf_counter()
        with full_weights(model, per_layer=variant.startswith("per-layer")):
            out = generate(model, ids, torch.ones_like(ids), args.new, eos_token_id=50256, pad_token_id=50256,
                           uniforms=u, lean=variant.endswith("lean"))
        times.append(time.perf_counter() - t0)
        peak = max(peak, proc_status_mib("VmHWM"))
        assert out.response_ids.shape == (args.rows, args.new), out.response_ids.shape
    return times, peak, before  # every repeat's seconds, the largest peak, the smallest resident set before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/fsdp_gather", help="where rows go without --record")
    add_record_args(ap)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun: torchrun --nproc_per_node 2 benchmarks/fsdp_gather.py")
    torch.set_num_threads(1)
    quiet_hf()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = build(args.layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for variant in ("gather-all, lean", "gather-all, HF", "per-layer, HF"):
        result = run(model, variant, args)
        both = [None] * world
        dist.all_gather_object(both, result)
        # the slowest process's seconds in each repeat, the largest peak, the largest resident set before
        times = [max(r[0][i] for r in both) for i in range(args.repeats)]
        rows.append((variant, times, max(r[1] for r in both), max(r[2] for r in both)))
    if rank == 0:
        print(f"\nGeneration under FSDP2, {world} processes (one thread each), GPT-2 shape with {args.layers} layers "
              f"(width 768, vocabulary 50257), {args.rows} rows x ({args.prompt} prompt + {args.new} new) tokens; "
              f"best of {args.repeats}; slowest process, largest peak")
        print(f"{'variant':<20}{'seconds':>9}{'tokens/s':>10}{'RSS before':>13}{'peak RSS':>12}")
        for variant, times, peak, before in rows:
            seconds = min(times)
            record("fsdp_gather", {"contender": variant, "settings": {"layers": args.layers, "rows": args.rows,
                                   "prompt_tokens": args.prompt, "new_tokens": args.new, "processes": world},
                                   "seeds": [1], "times_s": times, "tokens_per_call": args.rows * args.new,
                                   "peak_mib": peak, "before_mib": before}, args,
                   "cuda" if torch.cuda.is_available() else "cpu")
            print(f"{variant:<20}{seconds:>9.2f}{args.rows * args.new / seconds:>10.0f}{before:>9.0f} MiB"
                  f"{peak:>8.0f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
