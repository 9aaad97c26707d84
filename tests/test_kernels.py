"""rlhfkit.accel.kernels (the compiled CPU attention, tanh-GELU and sampling step) against PyTorch,
beyond the one case of each in test_accel.py.

Each kernel replaces a handful of PyTorch ops on the CPU hot paths, so each is checked against
those ops (in float64 where rounding could hide a bug): attention against
``scaled_dot_product_attention`` with padding, causal masks, grouped heads, strided inputs and
head sizes that are not a multiple of the vector width; the GELU against ``F.gelu``; the sampler
against rlhfkit's own PyTorch sampling path, token for token. The library falls back to PyTorch
when there is no C compiler: that path is checked too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhfkit import ops
from rlhfkit.accel import kernels
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.rollout.generate import _entropy, generate, sample_tokens
from rlhfkit.tasks import doubling

HAVE_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: rlhfkit uses PyTorch's kernels here")


def _reference(q, k, v, bias, scale):
    """float64 softmax attention with grouped heads: ``bias [B, Tq|1, Tk]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale + bias.double()[:, None]
    return scores.softmax(-1) @ v


def _bias(B, Tq, Tk, causal, gen):
    """Additive mask: random left padding per row, causal for Tq > 1; every query keeps a key."""
    bias = torch.zeros(B, Tq, Tk)
    pad = torch.randint(0, Tk - Tq + 1, (B,), generator=gen)
    for b in range(B):
        bias[b, :, : int(pad[b])] = float("-inf")
    if causal:
        bias.masked_fill_(torch.ones(Tq, Tk, dtype=torch.bool).triu(Tk - Tq + 1), float("-inf"))
    return bias


@pytest.mark.parametrize("B,H,Hkv,Tq,Tk,D", [
    (64, 4, 4, 1, 19, 16),  # the tiny model's decode step
    (5, 4, 4, 11, 11, 16),  # its prefill (causal)
    (3, 6, 2, 1, 40, 64),  # grouped-query decode
    (2, 8, 2, 1, 150, 64),  # four heads a key head: the grouped decode path, keys over several L1 passes
    (2, 14, 2, 1, 77, 128),  # seven heads a key head, head_dim 128
    (2, 4, 1, 7, 9, 12),  # head_dim not a multiple of 8, queries after a cached prefix
    (2, 2, 2, 3, 3, 80),
    (1, 2, 2, 1, 1, 8),  # a single key
])
@needs_cc
def test_attention_matches_reference(B, H, Hkv, Tq, Tk, D):
    gen = torch.Generator().manual_seed(B * 1000 + Tk)
    qkv = torch.randn(B, Tq, H + 2 * Hkv, D, generator=gen) * 2  # strided views, as a fused projection gives
    q = qkv[:, :, :H].transpose(1, 2)  # [B, H, Tq, D]
    k, v = qkv[:, :, H:H + Hkv].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
    if Tk > Tq:  # queries are the last Tq of Tk positions: prepend cached keys
        extra = torch.randn(B, Hkv, Tk - Tq, D, generator=gen)
        k, v = torch.cat([extra, k], 2), torch.cat([extra.flip(0), v], 2)
    bias = _bias(B, Tq, Tk, Tq > 1, gen)
    scale = D**-0.5
    ours = kernels.attention(q, k, v, bias, scale)
    torch.testing.assert_close(ours.double(), _reference(q, k, v, bias, scale), atol=2e-6, rtol=2e-6)
    # PyTorch's own attention agrees too (same arithmetic in float32)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None], scale=scale, enable_gqa=Hkv < H)
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)
    # a key-padding mask shared by every query ([B, 1, Tk], read with stride 0 over queries)
    keys_only = _bias(B, 1, Tk, False, gen)
    ours = kernels.attention(q, k, v, keys_only, scale)
    torch.testing.assert_close(ours.double(), _reference(q, k, v, keys_only, scale), atol=2e-6, rtol=2e-6)


@needs_cc
def test_masked_keys_never_leak():
    """A key under a -inf bias gets probability 0 whatever it holds (NaN, inf: uninitialised cache)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    bias = torch.zeros(2, 1, 9)
    bias[:, :, :3] = float("-inf")
    clean = kernels.attention(q, k, v, bias, 0.25)
    k[:, :, 0], k[:, :, 1] = float("nan"), float("inf")
    torch.testing.assert_close(kernels.attention(q, k, v, bias, 0.25), clean, atol=0, rtol=0)


@needs_cc
def test_decode_attention_appends_and_attends():
    B, H, D, T_max, t = 3, 4, 16, 10, 6
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(B, 2, H, T_max, D, generator=gen)
    kv[:, :, :, t:] = float("nan")  # columns not written yet
    qkv = torch.randn(B, 3, H, D, generator=gen)
    bias = torch.zeros(B, T_max)
    bias[0, :2] = float("-inf")  # a left-padded row
    out = torch.empty(B, H, D)
    step = kernels.decode_attention(qkv, kv, bias, out, D**-0.5)
    step(t)
    torch.testing.assert_close(kv[:, 0, :, t], qkv[:, 1], atol=0, rtol=0)  # the step's key and value landed
    torch.testing.assert_close(kv[:, 1, :, t], qkv[:, 2], atol=0, rtol=0)
    ref = _reference(qkv[:, 0, :, None], kv[:, 0, :, : t + 1], kv[:, 1, :, : t + 1], bias[:, None, : t + 1], D**-0.5)
    torch.testing.assert_close(out.double(), ref[:, :, 0], atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="outside the cache"):
        step(T_max)


needs_bf16 = pytest.mark.skipif(not (HAVE_CC and kernels._avx512_bf16()),
                                reason="no AVX-512 BF16 here: bfloat16 decode steps use PyTorch's attention")


def _bf16_cache(B, Hkv, Tk, D, gen, T_max=None):
    """Keys and values as lean's decode sees them: ``[B, Hkv, Tk, D]`` views of a ``[B, 2, Hkv,
    T_max, D]`` cache whose later columns are not written (NaN)."""
    T_max = T_max or Tk + 5
    kv = torch.randn(B, 2, Hkv, T_max, D, generator=gen).to(torch.bfloat16)
    kv[:, :, :, Tk:] = float("nan")
    return kv, kv[:, 0, :, :Tk], kv[:, 1, :, :Tk]


@needs_bf16
@pytest.mark.parametrize("B,H,Hkv,Tk,D", [
    (3, 6, 2, 1, 64),  # the first step after a one-token prompt
    (2, 9, 3, 17, 64),  # SmolLM2's heads, one block of 16 keys and a tail
    (2, 8, 2, 150, 128),  # head_dim 128, an odd tail
    (2, 8, 1, 40, 32),  # eight heads a key head
    (1, 4, 4, 33, 256),  # no grouping, the widest head
])
def test_bf16_decode_attention_is_as_close_to_exact_as_pytorchs(B, H, Hkv, Tk, D):
    gen = torch.Generator().manual_seed(Tk)
    q = torch.randn(B, 1, H, D, generator=gen).to(torch.bfloat16).transpose(1, 2)  # as the projection lays it out
    _, k, v = _bf16_cache(B, Hkv, Tk, D, gen)
    bias = _bias(B, 1, Tk, False, gen).to(torch.bfloat16)[:, None]  # [B, 1, 1, Tk], left padding
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert kernels.decode_bf16_usable(q, k, v, bias)
        ours = kernels.decode_attention_bf16(q, k, v, bias, D**-0.5)
    finally:
        torch.set_num_threads(threads)
    pytorch = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=D**-0.5, enable_gqa=True)
    exact = _reference(q, k, v, bias[:, 0], D**-0.5)
    assert ours.dtype == torch.bfloat16 and ours.shape == (B, H, 1, D)
    err, err_pt = ((t.double() - exact).abs().max().item() for t in (ours, pytorch))
    assert err <= 1.5 * err_pt + 2**-9 * exact.abs().max().item(), (err, err_pt)


@needs_bf16
def test_bf16_decode_attention_reads_a_shared_prompt_from_its_first_row():
    """With ``shared = (rows, P)`` row b's first P keys and values come from row ``rows[b]``: the
    same output as reading its own copy, and the other rows' copies are never read."""
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, Tk, D, P = 6, 6, 2, 45, 64, 21
    q = torch.randn(B, H, 1, D, generator=gen).to(torch.bfloat16)
    kv, k, v = _bf16_cache(B, Hkv, Tk, D, gen)
    rows = torch.tensor([0, 0, 0, 3, 3, 3])
    kv[:, :, :, :P] = kv[rows, :, :, :P]  # two groups of three, each group's rows one prompt
    bias = torch.zeros(B, 1, 1, Tk, dtype=torch.bfloat16)
    bias[3:, ..., :4] = float("-inf")  # the second group's prompt is left-padded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        own = kernels.decode_attention_bf16(q, k, v, bias, D**-0.5)
        kv[[1, 2, 4, 5], :, :, :P] = float("nan")  # copies the shared route must not read
        shared = kernels.decode_attention_bf16(q, k, v, bias, D**-0.5, (rows, P))
        assert torch.equal(own, shared)
        with pytest.raises(ValueError, match="shared rows outside"):
            kernels.decode_attention_bf16(q, k, v, bias, D**-0.5, (torch.full((B,), B), P))
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_bf16_decode_attention_steps_aside():
    q, kv = torch.empty(2, 9, 1, 64, dtype=torch.bfloat16), torch.empty(2, 3, 30, 64, dtype=torch.bfloat16)
    bias = torch.zeros(2, 1, 1, 30, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.decode_bf16_usable(q, kv, kv, bias)
        assert not kernels.decode_bf16_usable(q.float(), kv.float(), kv.float(), bias.float())
        assert not kernels.decode_bf16_usable(q.expand(2, 9, 2, 64), kv, kv, bias)  # two queries a row
        assert not kernels.decode_bf16_usable(q[..., :48], kv[..., :48], kv[..., :48], bias)  # head_dim 48
        torch.set_num_threads(2)
        assert not kernels.decode_bf16_usable(q, kv, kv, bias)  # threads: PyTorch's threaded attention
    finally:
        torch.set_num_threads(threads)


@needs_cc
@pytest.mark.parametrize("N,C", [(37, 576), (5, 13), (1, 8)])
def test_bf16_rms_norm_and_its_gradients_are_as_close_to_exact_as_pytorchs(N, C):
    gen = torch.Generator().manual_seed(C)
    x = (3 * torch.randn(2, N, C, generator=gen)).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.3 * torch.randn(C, generator=gen)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, N, C, generator=gen).to(torch.bfloat16)
    assert kernels.rms_norm_bf16_usable(x, w) and not kernels.rms_norm_bf16_usable(x.float(), w.float())
    results = []
    for norm in (lambda x, w: kernels.rms_norm_bf16(x, w, 1e-5), lambda x, w: F.rms_norm(x, (C,), w, 1e-5),
                 lambda x, w: F.rms_norm(x.double(), (C,), w.double(), 1e-5)):
        y = norm(x, w)
        results.append((y, *torch.autograd.grad(y, (x, w), grad.to(y.dtype))))
    ours, pytorch, exact = results
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.bfloat16
    for i in range(3):
        scale = exact[i].abs().max().item()
        err, err_pt = ((r[i].double() - exact[i]).abs().max().item() for r in (ours, pytorch))
        assert err <= 1.5 * err_pt + 2**-9 * scale, (i, err, err_pt)
    with torch.no_grad():  # no graph: the same forward
        assert torch.equal(kernels.rms_norm_bf16(x, w, 1e-5), ours[0])


@needs_cc
def test_attention_rejects_what_it_cannot_do():
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="unsupported"):
        kernels.attention(q.double(), q.double(), q.double(), torch.zeros(1, 1, 1), 1.0)
    with pytest.raises(ValueError, match="unsupported"):  # head_dim not contiguous
        kernels.attention(q.transpose(-1, -2), q, q, torch.zeros(1, 1, 1), 1.0)


@needs_cc
def test_gelu_tanh():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1003, generator=gen) * 4  # a length that leaves a scalar tail
    x[:8] = torch.tensor([-100.0, -30.0, -10.0, 0.0, 1e-4, 10.0, 30.0, 100.0])
    gate = torch.empty_like(x)
    out = kernels.gelu_tanh(x, gate=gate)
    torch.testing.assert_close(out.double(), F.gelu(x.double(), approximate="tanh"), atol=1e-6, rtol=2e-6)
    z2 = 2 * (2 / torch.pi) ** 0.5 * (x.double() + 0.044715 * x.double() ** 3)
    torch.testing.assert_close(gate.double(), torch.sigmoid(z2), atol=2e-7, rtol=2e-6)
    assert out[0] == 0 and out[7] == 100  # the saturated ends are exact
    x[8] = float("nan")  # in a vector of 8, not the scalar tail: a NaN stays NaN through the clamps
    nan_out = kernels.gelu_tanh(x, gate=gate)
    assert nan_out[8].isnan() and gate[8].isnan() and not nan_out[9:].isnan().any()
    x[8] = out[8] = 0.0
    y = x.clone()
    kernels.gelu_tanh(y, out=y)  # in place
    torch.testing.assert_close(y, out, atol=0, rtol=0)


@needs_cc
def test_gelu_tanh_gradient():
    """The training forward's GELU (forward saving its gate, one-pass backward) against autograd
    through F.gelu in float64."""
    from rlhfkit.accel.forward import _gelu_tanh

    x = (torch.randn(37, 29, generator=torch.Generator().manual_seed(3)) * 3).requires_grad_()
    w = torch.randn(37, 29, generator=torch.Generator().manual_seed(4))
    (_gelu_tanh(x) * w).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (F.gelu(x64, approximate="tanh") * w.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=2e-6, rtol=2e-6)
    direct = kernels.gelu_tanh_backward(x.detach(), torch.sigmoid(
        2 * (2 / torch.pi) ** 0.5 * (x.detach() + 0.044715 * x.detach() ** 3)), w)
    torch.testing.assert_close(direct.double(), x64.grad, atol=2e-6, rtol=2e-6)


@needs_cc
def test_swiglu_and_its_gradients():
    """A Llama MLP's ``silu(gate) * up`` and its one-pass backward (which also rebuilds the
    activation) against float64 autograd, saturated ends and a scalar tail included; the
    training layer that uses them (``lean._SwiGLUDown``) gives autograd's gradients through it."""
    from rlhfkit.accel.forward import _SwiGLUDown

    gen = torch.Generator().manual_seed(5)
    gate, up, d = (torch.randn(41, 27, generator=gen) * 4 for _ in range(3))  # 1107 = 138 x 8 + 3
    gate[0, :6] = torch.tensor([-100.0, -88.0, -30.0, 0.0, 30.0, 100.0])
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    ref = F.silu(g64) * u64
    (ref * d.double()).sum().backward()
    act = kernels.swiglu(gate, up)
    torch.testing.assert_close(act.double(), ref.detach(), atol=1e-6, rtol=2e-6)
    again, dg, du = kernels.swiglu_backward(gate, up, d, want_act=True)
    torch.testing.assert_close(again, act, atol=0, rtol=0)
    torch.testing.assert_close(dg.double(), g64.grad, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(du.double(), u64.grad, atol=1e-6, rtol=2e-6)
    assert kernels.swiglu_backward(gate, up, d, want_act=False)[0] is None
    # through the layer: compiled forward and backward against autograd's graph of the same sum
    x = torch.randn(41, 9, generator=gen).requires_grad_()
    w = torch.randn(9, 27, generator=gen).requires_grad_()
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate, up, w)]
    out = _SwiGLUDown.apply(*leaves, None)
    xr, gr, ur, wr = [t.detach().clone().requires_grad_() for t in (x, gate, up, w)]
    ref = xr + F.silu(gr) * ur @ wr.t()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-6)
    probe = torch.randn(41, 9, generator=gen)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    for ours, theirs in zip(leaves, (xr, gr, ur, wr)):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-4, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("V,temperature", [(42, 1.0), (7, 0.7), (16, 1.3), (5000, 1.0)])
def test_sampler_matches_the_pytorch_path(V, temperature):
    """Same tokens (for draws not within float error of a CDF boundary), log-probs, entropies and
    EOS bookkeeping as rollout.sample_tokens on log_softmax(logits / temperature)."""
    B, R, eos = 64, 4, 3
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(R, B, V, generator=gen) * 3
    logits[..., 0] = float("-inf")  # a banned token
    u = torch.rand(B, R, generator=gen)
    sampler = kernels.Sampler(B, R, V, temperature, eos)
    alive = torch.ones(B, dtype=torch.bool)
    for t in range(R):
        n_alive = sampler.step(t, logits[t], u[:, t])
        logp = torch.log_softmax(logits[t] / temperature, -1)
        tok = sample_tokens(logp, u=u[:, t])
        cdf = logp.exp().cumsum(-1)
        point = (1 - u[:, t, None]) * cdf[:, -1:]
        clear = ((cdf - point).abs() > 1e-5).all(-1)  # draws far from every boundary
        assert clear.float().mean() > 0.9
        assert torch.equal(sampler.tokens[clear, t], tok[clear])
        assert (sampler.tokens[:, t] != 0).all()  # never the banned token
        took = sampler.tokens[:, t]
        torch.testing.assert_close(sampler.logprobs[:, t], logp.gather(1, took[:, None])[:, 0], atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(sampler.entropy[:, t], _entropy(logp), atol=2e-5, rtol=2e-6)
        alive &= took != eos
        assert n_alive == int(alive.sum())
        assert torch.equal(sampler.alive, alive)


@needs_cc
def test_generate_same_with_and_without_kernels(accel_on):
    """The lean rollout (compiled attention, GELU and sampler) and the PyTorch fallback agree."""
    tok = doubling.make_tokenizer()
    model = build_tiny_policy(tok, 0, n_layer=2, n_head=2, n_embd=32).eval()
    enc = tok(["数字:12x2=", "__:7x2=", "小写:1234x2=45", "大写:9999x2="], padding=True, return_tensors="pt")
    u = torch.rand((4, 6), generator=torch.Generator().manual_seed(0))

    def run():
        return generate(model, enc["input_ids"], enc["attention_mask"], 6, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, uniforms=u, temperature=0.9)

    assert accel_on["sampler"] == "c-kernels"
    fast = run()
    ops.configure("off")  # PyTorch's ops, as without a compiler
    slow = run()
    assert torch.equal(fast.response_ids, slow.response_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(fast.entropy, slow.entropy, atol=2e-6, rtol=1e-6)
    assert torch.equal(fast.response_mask, slow.response_mask) and torch.equal(fast.finished, slow.finished)


@pytest.mark.slow
def test_no_compiler_falls_back_and_builds_are_cached(tmp_path):
    """Without a compiler the library says so once and uses PyTorch; with one, a build is made
    once per cache directory and reused by later processes."""
    code = "from rlhfkit.accel import kernels; print(kernels.available())"
    env = {**os.environ, "RLHFKIT_CACHE": str(tmp_path), "CC": "/nonexistent/cc"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False" and "unavailable" in done.stderr
    if not HAVE_CC:
        return
    env["CC"] = os.environ.get("CC") or "cc"
    stamps = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "True", done.stderr
        built = list((tmp_path / "kernels").glob("*.so"))
        assert len(built) == 1
        stamps.append(built[0].stat().st_mtime_ns)
    assert stamps[0] == stamps[1]  # the second process loaded the first one's build


@needs_cc
@pytest.mark.parametrize("B,H,Hkv,Tq,Tk,D", [(4, 4, 4, 8, 19, 16), (3, 4, 2, 11, 11, 16), (2, 2, 1, 5, 7, 12),
                                              (2, 8, 2, 1, 70, 16)])
def test_attention_gradients_match_reference(B, H, Hkv, Tq, Tk, D):
    """The compiled backward against autograd through float64 softmax attention: dq, dk, dv with
    padding, causal masks, grouped heads, strided inputs, a head size with a scalar tail."""
    gen = torch.Generator().manual_seed(Tk)
    qkv = torch.randn(B, Tk, H + 2 * Hkv, D, generator=gen).requires_grad_()  # one leaf, strided views
    q = qkv[:, Tk - Tq:, :H].transpose(1, 2)
    k, v = qkv[:, :, H:H + Hkv].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
    bias = _bias(B, Tq, Tk, True, gen)
    w = torch.randn(B, H, Tq, D, generator=gen)
    out = kernels.attention(q, k, v, bias, D**-0.5)
    assert out.requires_grad
    (out * w).sum().backward()
    ours = qkv.grad.clone()
    qkv.grad = None
    (_reference(q, k, v, bias, D**-0.5) * w.double()).sum().backward()
    torch.testing.assert_close(ours, qkv.grad, atol=5e-6, rtol=5e-6)


@needs_cc
def test_attention_steps_aside_for_large_work_and_other_dtypes():
    q, k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    assert kernels.worth_it(q, k, v)
    assert not kernels.worth_it(q.double(), k.double(), v.double())
    big = torch.empty(1, 1, kernels.MAX_KEYS + 1, 16)
    assert not kernels.worth_it(q[:1, :1], big, big)  # more keys than the kernel's stack holds


@needs_cc
def test_a_decode_step_takes_the_kernel_at_any_size_on_one_thread():
    # shapes of the real model's long-completion rollout: 64 rows, 9 query heads over 3 key heads,
    # 576 keys of 64 -- work above SMALL_ONE_THREAD, where PyTorch's time is about twice the kernel's
    q = torch.empty(1, 1, 1, 64).expand(64, 9, 1, 64)
    kv = torch.empty(1, 1, 1, 64).expand(64, 3, 576, 64)
    assert 64 * 9 * 576 * 64 > kernels.SMALL_ONE_THREAD
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.worth_it(q, kv, kv)
        assert not kernels.worth_it(q.expand(64, 9, 8, 64), kv, kv)  # eight queries a row: PyTorch's blocking wins
        torch.set_num_threads(2)
        assert not kernels.worth_it(q, kv, kv)  # on two threads PyTorch's threaded attention wins
    finally:
        torch.set_num_threads(threads)


@needs_cc
@pytest.mark.parametrize("H,Hkv,D", [(8, 2, 64), (12, 3, 32), (7, 1, 16)])
def test_grouped_decode_is_separate_rows_bit_for_bit(H, Hkv, D):
    # with four or more query heads a key head, a decode step takes the heads of a group in turns
    # over blocks of keys; the arithmetic per head is the same as with the key head repeated
    gen = torch.Generator().manual_seed(H)
    B, Tk = 3, 203
    q = torch.randn(B, H, 1, D, generator=gen)
    k, v = torch.randn(B, Hkv, Tk, D, generator=gen), torch.randn(B, Hkv, Tk, D, generator=gen)
    bias = _bias(B, 1, Tk, False, gen)
    grouped = kernels.attention(q, k, v, bias, D**-0.5)
    g = H // Hkv
    separate = kernels.attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), bias, D**-0.5)
    assert torch.equal(grouped, separate)


@needs_cc
@pytest.mark.parametrize("B,H,Hkv,Tq,Tk,D", [
    (3, 6, 2, 300, 340, 64),  # responses after a prompt: three blocks, the last one short
    (2, 4, 2, 133, 133, 16),  # a whole causal sequence, keys in every block a multiple of 8 plus a tail
    (2, 3, 3, 131, 155, 12),  # head_dim not a multiple of 8, one head a key head
    (1, 8, 1, 9, 9, 32),  # eight heads over one key head, one short block
])
def test_block_attention_matches_reference(B, H, Hkv, Tq, Tk, D):
    gen = torch.Generator().manual_seed(Tq)
    q = torch.randn(B, H, Tq, D, generator=gen).requires_grad_()
    k = torch.randn(B, Hkv, Tk, D, generator=gen).requires_grad_()
    v = torch.randn(B, Hkv, Tk, D, generator=gen).requires_grad_()
    allowed = _bias(B, Tq, Tk, True, gen) == 0  # left padding per row, causal: query i sees keys <= Tk - Tq + i
    scale = D**-0.5
    bias = torch.zeros(B, Tq, Tk).masked_fill(~allowed, float("-inf"))
    ours = kernels.block_attention(q, k, v, allowed, scale)
    torch.testing.assert_close(ours.double(), _reference(q, k, v, bias, scale), atol=2e-6, rtol=2e-6)
    w = torch.randn(B, H, Tq, D, generator=gen)
    grads = torch.autograd.grad((ours * w).sum(), (q, k, v))
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    refs = torch.autograd.grad((_reference(qq, kk, vv, bias, scale) * w.double()).sum(), (qq, kk, vv))
    for ours_g, ref_g in zip(grads, refs):
        torch.testing.assert_close(ours_g.double(), ref_g, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the same values without autograd
        torch.testing.assert_close(kernels.block_attention(q, k, v, allowed, scale), ours, atol=0, rtol=0)


@needs_cc
def test_block_attention_routing_never_depends_on_the_batch_size(accel_on):
    if "linear" not in accel_on:  # accel.enabled=on: oneDNN's products whatever the CPU's vendor
        pytest.skip("this PyTorch build has no oneDNN linear: the blocked attention's products")
    q, kv = torch.empty(1, 9, 511, 64), torch.empty(1, 3, 575, 64)
    mask = torch.ones(1, 511, 575, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.block_usable(q, kv, kv, mask)
        assert kernels.block_usable(q.expand(8, -1, -1, -1), kv.expand(8, -1, -1, -1), kv.expand(8, -1, -1, -1),
                                    mask.expand(8, -1, -1))
        assert not kernels.block_usable(q[:, :, :10], kv[:, :, :10], kv[:, :, :10], mask[:, :10, :10])  # too small
        assert not kernels.block_usable(q, kv, kv, mask.float())  # an additive mask: not this path
        torch.set_num_threads(2)
        assert not kernels.block_usable(q, kv, kv, mask)  # threads: PyTorch's threaded attention
    finally:
        torch.set_num_threads(threads)
