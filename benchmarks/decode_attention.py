"""A decode-step attention kernel in Triton, one query a row: an experiment for ``decode_profile.py``.

On a GPU the long-completion rollout spends about a third of its decode time in PyTorch's
memory-efficient attention, whose tiles hold 64 queries where a decode step has one
(``benchmarks/README.md``). This kernel reads each row's keys and values once: one program per
(row, key head) walks the columns in blocks with a running (online) softmax, every query head of
a grouped-query key head together, in float32 throughout (no TF32: the step is bound by memory,
not arithmetic). The keys and values are read through their strides, so the views
``rlhfkit.lean`` passes (columns ``0 .. span-1`` of the pre-allocated cache) need no copy.

``decode_profile.py --attention triton`` swaps it in for the decode loop's attention, to time it
against PyTorch's. The library's version (``rlhfkit.triton_decode``, used by ``ppo.cuda_graph``)
grew out of it: it reads the step's column from device memory, so one CUDA graph serves a
whole rollout.

    python benchmarks/decode_attention.py                      # check against PyTorch on a GPU
    TRITON_INTERPRET=1 python benchmarks/decode_attention.py   # the same check on a CPU (slow)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _one_query_attention(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, span, scale,
                         sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sb_b, sb_t, so_b, so_h,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)  # a row and one of its key heads
    g, d = tl.arange(0, GP), tl.arange(0, D)
    heads = h * G + g  # the query heads reading this key head
    live = g < G
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
    q = q.to(tl.float32) * scale  # [GP, D]
    top = tl.full([GP], float("-inf"), tl.float32)  # running max of the scores
    total = tl.zeros([GP], tl.float32)  # running sum of exp(score - top)
    acc = tl.zeros([GP, D], tl.float32)  # running sum of exp(score - top) * value
    for start in range(0, span, BLOCK):
        t = start + tl.arange(0, BLOCK)
        inside = t < span
        k = tl.load(k_ptr + b * sk_b + h * sk_h + t[:, None] * sk_t + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + t[:, None] * sv_t + d[None, :], mask=inside[:, None], other=0.0)
        bias = tl.load(bias_ptr + b * sb_b + t * sb_t, mask=inside, other=float("-inf")).to(tl.float32)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) + bias[None, :]  # [GP, BLOCK]
        new_top = tl.maximum(top, tl.max(s, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a block of padding only: no NaN
        p = tl.exp(s - shift[:, None])
        fade = tl.exp(top - shift)
        total = total * fade + tl.sum(p, axis=1)
        acc = acc * fade[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        top = new_top
    out = acc / total[:, None]
    tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``q [B, H, 1, D]`` over ``k, v [B, Hkv, S, D]`` (any strides, the last one 1) under the
    additive ``bias [B, 1, 1, S]``; returns ``[B, H, 1, D]``."""
    B, H, one, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if one != 1 or H % Hkv or D & (D - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("one query a row, query heads a multiple of key heads, a power-of-two head size")
    G = H // Hkv
    GP = triton.next_power_of_2(G)
    out = q.new_empty((B, H, 1, D))
    bias = bias.expand(B, 1, 1, S)
    _one_query_attention[(B, Hkv)](
        q, k, v, bias, out, S, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        bias.stride(0), bias.stride(3), out.stride(0), out.stride(1),
        G=G, GP=GP, D=D, BLOCK=max(16, 64 // GP), num_warps=4)
    return out


def check(device: str = "cuda") -> float:
    """Largest difference from PyTorch's attention over cache views with left padding, a block of
    padding only, grouped heads and a span that is not a multiple of the block."""
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for H, Hkv, S, T in [(12, 12, 77, 96), (9, 3, 150, 160), (4, 1, 64, 64)]:
        B, D = 5, 64
        kv = torch.randn(B, 2, Hkv, T, D, generator=gen).to(device)  # rlhfkit.lean's cache layout
        k, v = kv[:, 0, :, :S], kv[:, 1, :, :S]
        q = torch.randn(B, 1, H, D, generator=gen).to(device).transpose(1, 2)  # [B, H, 1, D], strided
        bias = torch.zeros(B, 1, 1, S, device=device)
        bias[1, ..., :min(70, S - 1)] = float("-inf")  # more than a block of left padding (a step sees its own column)
        bias[2, ..., :3] = float("-inf")
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=D ** -0.5, enable_gqa=Hkv < H)
        got = one_query_attention(q, k, v, bias, D ** -0.5)
        err = (got - want).abs().max().item()
        worst = max(worst, err if err == err else float("inf"))  # NaN counts as the worst
    return worst


if __name__ == "__main__":
    import os

    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    err = check(device)
    print(f"largest difference from PyTorch's attention: {err:.2e}")
    if err > 1e-4:
        raise SystemExit("the kernel disagrees with PyTorch")
