"""How many operations the update's forward and backward issue with shared prompts and without.

On a GPU at a small model's size a step is bound by kernel launches, not arithmetic, so the
count of compute operations per forward + backward is what decides whether sharing each
group's prompt (``rlhfkit.accel.forward.response_hidden_states``) pays there. This script counts them
on any device with ``torch.profiler``: top-level ``aten`` operations that are not views or
allocations (each launches at least one kernel on a GPU), and times them, for three paths:
``shared`` (prompts and responses as two streams per layer, the CPU's default above
``rlhfkit.accel.forward.FLAT_CPU_ELEMENTS``), ``flat`` (one flat sequence through the token-wise
operations, the GPU's default and the CPU's for small steps) and ``unshared`` (every
row in full, ``rlhfkit.accel.forward.hidden_states``); and the same for one cached decode step of the
rollout (``decode``, no grad).

    python benchmarks/shared_prompt_ops.py                      # small sizes, both shapes
    python benchmarks/shared_prompt_ops.py --prompts 16 --group 4 --prompt-len 128 --new 64

Random weights, 2 layers: GPT-2 small's width, and a Llama shape with SmolLM2-135M's width
(576, 9 heads, 3 key/value heads).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhfkit.accel import forward as lean
from rlhfkit.models.forward import position_ids_from_mask

# operations that launch no kernel of their own: views, allocations, dtype/shape queries
NO_KERNEL = {"view", "permute", "transpose", "unflatten", "slice", "select", "as_strided", "expand", "t",
             "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_strided", "_unsafe_view", "flatten",
             "split", "chunk", "narrow", "reshape", "lift_fresh", "result_type", "resolve_conj", "resolve_neg",
             "_reshape_alias", "view_as", "unbind", "split_with_sizes", "empty_like", "contiguous", "to",
             "_to_copy", "is_nonzero", "item", "_local_scalar_dense"}


def model(shape: str) -> torch.nn.Module:
    if shape == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=768, n_head=12, vocab_size=1000, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    else:
        m = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=576, intermediate_size=1536,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=1000))
    return m.train()


def decode_ops(shape: str, args) -> None:
    """Top-level compute operations and time of one cached decode step (:func:`rlhfkit.accel.forward.decode_step`)
    for ``prompts x group`` rows: the rollout's unit of work, bound by launches on a GPU."""
    B, P = args.prompts * args.group, args.prompt_len
    m = model(shape).eval().to(args.device)
    ids = torch.randint(0, 1000, (B, P)).to(args.device)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    _, cache = lean.prefill(m, ids, mask, pos, args.repeats + 3)
    tok, nxt = ids[:, -1], pos[:, -1] + 1
    ops, seconds = count_and_time(lambda: lean.decode_step(cache, tok, nxt), args.repeats, args.device == "cuda")
    print(f"{shape:6} {'decode':9} {ops:11d} {1e3 * seconds:12.2f}")


def count_and_time(step, repeats: int, cuda: bool) -> tuple[int, float]:
    """Top-level compute operations of one ``step()`` and its median seconds over ``repeats``."""
    step()  # warm-up
    with torch.profiler.profile() as prof:
        step()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.name[6:] not in NO_KERNEL
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sum(ops.values()), statistics.median(times)


def compare(shape: str, args) -> None:
    P, B = args.prompt_len, args.prompts * args.group
    m = model(shape).to(args.device)
    ids = torch.randint(0, 1000, (args.prompts, P)).repeat_interleave(args.group, 0)
    ids = torch.cat([ids, torch.randint(0, 1000, (B, args.new))], 1).to(args.device)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    shared = lean.shared_prompts(ids, mask, P)
    assert shared is not None and lean.supported(m)

    def forward(path: str) -> torch.Tensor:
        if path == "unshared":
            return lean.hidden_states(m, ids, mask, pos)[:, P - 1 : -1]
        return lean.response_hidden_states(m, ids, mask, pos, P, *shared, flat=path == "flat")

    for path in ("shared", "flat", "unshared"):
        ops, seconds = count_and_time(lambda: forward(path).square().mean().backward(),  # noqa: B023
                                      args.repeats, args.device == "cuda")
        print(f"{shape:6} {path:9} {ops:11d} {1e3 * seconds:12.1f}")
    full = forward("unshared")
    gaps = [(forward(path) - full).abs().max().item() for path in ("shared", "flat")]
    print(f"{shape:6} largest difference from unshared: shared {gaps[0]:.2e}, flat {gaps[1]:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=8, help="response tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{args.prompts} prompts x {args.group} samples, {args.prompt_len} + {args.new} tokens, 2 layers, "
          f"{args.device}")
    print(f"{'shape':6} {'path':9} {'compute ops':>11} {'ms (median)':>12}")
    for shape in ("gpt2", "llama"):
        compare(shape, args)
    for shape in ("gpt2", "llama"):
        decode_ops(shape, args)


if __name__ == "__main__":
    main()
