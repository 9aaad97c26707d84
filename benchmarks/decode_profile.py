"""Where a rollout's decode step spends its time: wall-clock per token and the profiler's kernels.

The GPU step of ``real_step.py`` is mostly the rollout's decode loop. This script runs that loop
alone, as the rollout runs it (:func:`rlhfkit.accel.forward.prefill`, then one step per new token), for
the two workloads of ``real_step.py`` and three ways of stepping:

- ``eager``: :func:`rlhfkit.accel.forward.decode_step`, attention over the columns written so far (the
  default);
- ``fixed``: :func:`rlhfkit.accel.forward.static_decode_step`, every shape fixed, attention over the whole
  pre-allocated cache with the unwritten columns masked, run as written;
- ``graph``: the fixed step replayed as a CUDA graph (``accel.cuda_graph``; CUDA only).

With ``--attention sdpa triton`` each runs again with the decode attention swapped for the
Triton kernel of :mod:`rlhfkit.triton_decode` (one query a row, where PyTorch's memory-efficient
kernel computes tiles of 64 queries; ``accel.cuda_graph`` uses it inside the library, reading the
step's column from device memory; the fixed and graph steps then run the library's own path, one
graph over the written columns), and the last step's logits are compared with PyTorch's.
On a CPU that needs ``TRITON_INTERPRET=1`` (slow: a check, not a timing), and rlhfkit's compiled
CPU attention is switched off so that the calls reach the swapped function.

For each it prints the seconds per token (mean over the whole loop, so early and late columns
both count), and with ``--profile`` the kernels (or, on a CPU, operators) that took the most
device time over the loop, with their share. Random weights of the real shapes (the timing does
not depend on their values); the LM head is included, sampling is not (argmax stands in).

    python benchmarks/decode_profile.py --device cuda --profile
    python benchmarks/decode_profile.py --device cuda --attention sdpa triton
    python benchmarks/decode_profile.py --workload short --layers 2 --steps 8    # a quick CPU run
    TRITON_INTERPRET=1 python benchmarks/decode_profile.py --workload short --layers 1 --steps 4 --attention sdpa triton
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from rlhfkit import ops
from rlhfkit.accel import forward as lean
from rlhfkit.accel import gemm, kernels
from rlhfkit.accel.forward import FixedStep as _FixedStep
from rlhfkit.models.forward import position_ids_from_mask

# real_step.py's workloads and the model shapes it runs them on
WORKLOADS = {
    "reasoning": {"shape": "gpt2", "prompts": 8, "group": 8, "prompt_len": 64, "new": 512},
    "short": {"shape": "smollm2", "prompts": 16, "group": 4, "prompt_len": 128, "new": 64},
}


def build(shape: str, layers: int | None) -> torch.nn.Module:
    if shape == "gpt2":  # GPT-2 small
        return GPT2LMHeadModel(GPT2Config(n_layer=layers or 12, n_embd=768, n_head=12, vocab_size=50257,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    return LlamaForCausalLM(LlamaConfig(  # SmolLM2-135M's shape
        num_hidden_layers=layers or 30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True))


@contextlib.contextmanager
def attention(kind: str):
    """The decode loop's attention: PyTorch's (``sdpa``), or one-query calls sent to the Triton
    kernel of :mod:`rlhfkit.triton_decode` (``triton``) over the span the caller passes;
    :mod:`rlhfkit.accel.forward` looks the function up at each call, so replacing it here reaches its
    decode step."""
    if kind == "sdpa":
        yield
        return
    try:
        import triton  # noqa: F401

        from rlhfkit.accel import triton_decode
    except ImportError as e:
        raise SystemExit(f"--attention triton needs Triton (CUDA builds of PyTorch bring it): {e}") from None

    torch_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False, **kw):
        if q.shape[-2] != 1 or attn_mask is None or attn_mask.dtype == torch.bool or kw:
            return torch_sdpa(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, **kw)
        B, S = q.shape[0], k.shape[2]
        last = torch.full((1,), S - 1, dtype=torch.long, device=q.device)  # every column passed; the mask rules
        return triton_decode.attention(q, k, v, attn_mask.expand(B, 1, 1, S)[:, 0, 0], last,
                                       scale if scale is not None else q.shape[-1] ** -0.5)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = torch_sdpa


def loop(model, wl: dict, how: str, device, steps: int | None, prof=None, attend: str = "sdpa"):
    """Prefill the workload's rows (each group's prompt repeated, as GRPO lays them out), then
    decode ``steps`` tokens (default: the workload's). Returns the seconds of the decode loop, its
    steps and the last step's logits; ``prof``, a profiler context, is entered around the decode loop alone."""
    P, new = wl["prompt_len"], wl["new"]
    steps = steps or new
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (wl["prompts"], P), generator=gen)
    ids = ids.repeat_interleave(wl["group"], 0).to(device)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    weight = model.get_output_embeddings().weight
    head = lambda h: gemm.linear(h, weight)  # noqa: E731  the rollout's head (oneDNN on a CPU)
    with torch.no_grad():
        hidden, cache = lean.prefill(model, ids, mask, pos, new)
        tok, nxt = head(hidden).argmax(-1), pos[:, -1] + 1
        fixed = _FixedStep(cache, head, device.type == "cuda") if how != "eager" else None
        if how == "fixed":
            fixed.cuda = False  # the fixed-shape step as written, no graph
        sync(device)
        with attention(attend), prof if prof is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            for _ in range(steps):
                if fixed is None:
                    logits = head(lean.decode_step(cache, tok, nxt))
                else:
                    _, logits = fixed(tok, nxt)
                tok, nxt = logits.argmax(-1), nxt + 1
            sync(device)
            seconds = time.perf_counter() - t0
    return seconds, steps, logits


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=list(WORKLOADS))
    ap.add_argument("--how", choices=["eager", "fixed", "graph"], nargs="+")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the real shape (quick checks)")
    ap.add_argument("--steps", type=int, help="decode steps (default: the workload's new tokens)")
    ap.add_argument("--shape", choices=["gpt2", "smollm2"],
                    help="the model's shape (default: the workload's, as on a GPU in real_step.py's tables)")
    ap.add_argument("--profile", action="store_true", help="also print the loop's top kernels")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--attention", choices=["sdpa", "triton"], nargs="+", default=["sdpa"],
                    help="the decode attention: PyTorch's, and/or rlhfkit.triton_decode's Triton kernel (CUDA)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as real_step.py runs both libraries
    if "triton" in args.attention and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--attention triton runs on CUDA (or on a CPU under TRITON_INTERPRET=1, slowly)")
    hows = args.how or (["eager", "fixed", "graph"] if device.type == "cuda" else ["eager", "fixed"])
    for name in args.workload:
        wl = WORKLOADS[name]
        model = build(args.shape or wl["shape"], args.layers).to(device).eval()
        print(f"\n{name}: {args.shape or wl['shape']} shape, {model.config.num_hidden_layers} layers, "
              f"{wl['prompts'] * wl['group']} rows, prompt {wl['prompt_len']}, {args.steps or wl['new']} new tokens")
        last = {}  # how -> PyTorch attention's last logits
        for attend in args.attention:
            # the fixed and graph steps choose their attention themselves (accel.forward.FixedStep):
            # with triton the library's kernel over the written columns, with sdpa PyTorch's over bands
            ops.configure("auto" if attend == "triton" else "off")
            if attend == "triton" and device.type == "cpu":  # let the decode's attention reach SDPA
                for op in ("attention", "decode_attention"):
                    ops.register(op, ops.reference(op), "reference")
            for how in hows:
                # warm-up: kernels, allocator, graph capture
                loop(model, wl, how, device, min(8, args.steps or wl["new"]), attend=attend)
                seconds, steps, logits = loop(model, wl, how, device, args.steps, attend=attend)
                apart = ""
                if attend == "sdpa":
                    last[how] = logits
                elif how in last:
                    apart = f", last logits {(logits - last[how]).abs().max().item():.1e} from PyTorch attention's"
                print(f"  {how:6s} {attend:6s} {1e3 * seconds / steps:7.2f} ms a token ({seconds:.2f} s for {steps}){apart}")
                if args.profile:
                    profile(model, wl, how, device, args, attend)


@contextlib.contextmanager
def labelled_kernels():
    """rlhfkit's compiled CPU kernels are ctypes calls, which the profiler does not see: for the
    profiled loop each attention call is wrapped in a ``record_function`` named after it, so
    that its time is counted and shown (``rlhfkit::attention``, ``rlhfkit::decode_attention``)."""
    from torch.profiler import record_function

    attention, decode_attention = kernels.attention, kernels.decode_attention

    def labelled_attention(*a, **k):
        with record_function("rlhfkit::attention"):
            return attention(*a, **k)

    def labelled_decode_attention(*a, **k):
        step = decode_attention(*a, **k)

        def labelled_step(t):
            with record_function("rlhfkit::decode_attention"):
                step(t)

        labelled_step.buffers = step.buffers
        return labelled_step

    kernels.attention, kernels.decode_attention = labelled_attention, labelled_decode_attention
    try:
        yield
    finally:
        kernels.attention, kernels.decode_attention = attention, decode_attention


def profile(model, wl, how, device, args, attend: str = "sdpa") -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = torch_profile(activities=acts)
    with labelled_kernels():
        seconds, steps, _ = loop(model, wl, how, device, args.steps, prof, attend)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [e for e in events if getattr(e, key, 0) > 0]
    total = sum(getattr(e, key) for e in rows)
    print(f"    {'device' if cuda else 'CPU'} time in kernels/ops: {total / 1e3:.1f} ms of the profiled loop's "
          f"{1e3 * seconds:.1f} ms wall-clock ({steps} steps); top {args.top}:")
    for e in sorted(rows, key=lambda e: -getattr(e, key))[: args.top]:
        print(f"    {100 * getattr(e, key) / total:5.1f}%  {getattr(e, key) / 1e3:9.1f} ms  {e.count:7d} x  {e.key[:90]}")


if __name__ == "__main__":
    main()
