"""Decode-step attention as a Triton kernel, for the rollout's CUDA graph (``accel.cuda_graph``).

A decode step has one query a row. On a GPU PyTorch's attention runs it with kernels whose
tiles hold 64 queries, and a CUDA graph fixes the span of columns it reads, so the graphed
step read up to the end of a band of columns (``accel.forward.FixedStep``). This kernel reads the
step's column from device memory (the tensor ``t``), so one graph serves the whole rollout
and each replay reads only the columns written so far: one program per (row, key head) walks
them in blocks with a running (online) softmax, every query head of a grouped-query key head
together, in float32 throughout (a decode step is bound by memory, not arithmetic). Keys and
values are read in place from the lean cache (``[B, 2, Hkv, T, D]``) through their strides, the
additive key mask ``[B, T]`` likewise.

Used when Triton imports and the cache is on CUDA (``accel.enabled=off`` keeps PyTorch's
attention). On a CPU Triton's interpreter runs it (``TRITON_INTERPRET=1``), which is how the
tests check it against PyTorch's attention.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(kv: torch.Tensor, heads: int) -> bool:
    """Whether the kernel can run a decode step over the cache tensor ``kv [B, 2, Hkv, T, D]``
    with ``heads`` query heads: Triton imports, the cache is on CUDA (on a CPU: under Triton's
    interpreter) and the head size is a power of two."""
    D, Hkv = kv.shape[-1], kv.shape[2]
    if D & (D - 1) or heads % Hkv or kv.stride(-1) != 1:
        return False
    if not (kv.device.type == "cuda" or (kv.device.type == "cpu" and _interpreting())):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def importable() -> bool:
    """Whether Triton is installed here (a CUDA build of torch on Linux brings it); found, not imported."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel (made on first use: Triton reads ``TRITON_INTERPRET`` when it jits)."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_query(q_ptr, k_ptr, v_ptr, bias_ptr, t_ptr, out_ptr, scale,
                  sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sb_b, so_b, so_h,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)  # a row and one of its key heads
        span = tl.load(t_ptr) + 1  # columns 0 .. t: the step's own key is written already
        g, d = tl.arange(0, GP), tl.arange(0, D)
        heads = h * G + g  # the query heads reading this key head
        live = g < G
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        q = q.to(tl.float32) * scale  # [GP, D]
        k_ptr += b * sk_b + h * sk_h
        v_ptr += b * sv_b + h * sv_h
        top = tl.full([GP], float("-inf"), tl.float32)  # running max of the scores
        total = tl.zeros([GP], tl.float32)  # running sum of exp(score - top)
        acc = tl.zeros([GP, D], tl.float32)  # running sum of exp(score - top) * value
        for start in range(0, span, BLOCK):
            t = start + tl.arange(0, BLOCK)
            inside = t < span
            k = tl.load(k_ptr + t[:, None] * sk_t + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + t[:, None] * sv_t + d[None, :], mask=inside[:, None], other=0.0)
            bias = tl.load(bias_ptr + b * sb_b + t, mask=inside, other=float("-inf")).to(tl.float32)
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

    return one_query, triton.next_power_of_2


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor, t: torch.Tensor,
              scale: float) -> torch.Tensor:
    """``q [B, H, 1, D]`` over columns ``0 .. t`` of ``k, v [B, Hkv, T, D]`` (the lean cache's
    ``kv[:, 0]`` and ``kv[:, 1]``; any strides, the last one 1) under the additive ``key_bias
    [B, T]`` (0 attend, -inf padding); ``t``: a ``[1]`` integer tensor on the same device, read
    by the kernel, so a CUDA graph replays the step for any ``t``. Returns ``[B, H, 1, D]``
    (contiguous). A row whose columns are all padding gets NaN (0 / 0)."""
    B, H, one, D = q.shape
    Hkv = k.shape[1]
    if (one != 1 or H % Hkv or D & (D - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or key_bias.stride(-1) != 1):
        raise ValueError("one query a row, query heads a multiple of key heads, a power-of-two head size, "
                         "the last dimension contiguous")
    kernel, next_power_of_2 = _kernel(_interpreting())
    G = H // Hkv
    GP = next_power_of_2(G)
    out = q.new_empty((B, H, 1, D))
    kernel[(B, Hkv)](q, k, v, key_bias, t, out, scale,
                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), key_bias.stride(0), out.stride(0), out.stride(1),
                     G=G, GP=GP, D=D, BLOCK=max(16, 64 // GP), num_warps=4)
    return out
