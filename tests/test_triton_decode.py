"""The Triton decode attention (rlhfkit.accel.triton_decode) against PyTorch's attention.

On a CPU the kernel runs under Triton's interpreter (tests/conftest.py turns it on before
anything imports Triton); ``RLHFKIT_TEST_DEVICE=cuda`` runs the compiled kernel on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # a dev dependency on Linux; Triton has no other platforms' wheels

from rlhfkit.accel import triton_decode  # noqa: E402

DEV = torch.device(os.environ.get("RLHFKIT_TEST_DEVICE", "cpu"))


@pytest.mark.parametrize("H, Hkv, T, t", [(12, 12, 96, 76), (9, 3, 160, 149), (4, 1, 64, 63), (4, 2, 40, 0),
                                          (2, 2, 33, 16)])
def test_matches_pytorch_over_the_written_columns(H, Hkv, T, t):
    """Grouped query heads, left padding longer than a block, a span that is not a multiple of
    the block, the first and the last column; the columns after ``t`` hold NaN, so reading any
    of them would show."""
    B, D = 5, 64 if H > 2 else 16
    gen = torch.Generator().manual_seed(H * T + t)
    kv = torch.randn(B, 2, Hkv, T, D, generator=gen)
    kv[:, :, :, t + 1:] = float("nan")  # not written yet
    q = torch.randn(B, 1, H, D, generator=gen).transpose(1, 2)  # [B, H, 1, D], strided as in the decode
    bias = torch.zeros(B, T)
    bias[1, :min(70, t)] = float("-inf")  # left padding (the step's own column is never padding)
    bias[2, :min(3, t)] = float("-inf")
    kv, q, bias = kv.to(DEV), q.to(DEV), bias.to(DEV)
    got = triton_decode.attention(q, kv[:, 0], kv[:, 1], bias, torch.tensor([t], device=DEV), D ** -0.5)
    S = t + 1
    want = F.scaled_dot_product_attention(q, kv[:, 0, :, :S], kv[:, 1, :, :S], attn_mask=bias[:, None, None, :S],
                                          scale=D ** -0.5, enable_gqa=Hkv < H)
    assert got.shape == (B, H, 1, D) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_usable_only_where_it_can_run():
    """Power-of-two head sizes and whole groups of query heads (``accel.enabled=off`` never asks)."""
    kv = torch.zeros(1, 2, 2, 8, 16, device=DEV)
    assert triton_decode.usable(kv, 4)
    assert not triton_decode.usable(kv, 3)  # query heads not a multiple of the key heads
    assert not triton_decode.usable(torch.zeros(1, 2, 2, 8, 24, device=DEV), 2)  # head size 24
