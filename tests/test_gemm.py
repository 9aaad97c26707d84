"""oneDNN's float32 linear (:mod:`rlhfkit.accel.gemm`) against PyTorch's ops, beyond test_accel.py's
one case of each product, and the bfloat16 weights packed for decode steps.

oneDNN computes only weights of at least :data:`rlhfkit.accel.gemm.MIN_WEIGHT` elements, so the
weights here are that large; ``accel.enabled=on`` routes them to it whatever the CPU's vendor."""
from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

import test_lean
from rlhfkit import ops
from rlhfkit.accel import forward as lean
from rlhfkit.accel import gemm, primitives, registry
from rlhfkit.models.logprobs import chunked_token_logprobs

pytestmark = pytest.mark.skipif(not gemm.available(), reason="this PyTorch build has no oneDNN linear")
K, N = 320, 400  # a weight [N, K] above gemm.MIN_WEIGHT


@pytest.fixture
def onednn_calls(accel_on, monkeypatch):
    """oneDNN's products on (accel.enabled=on); yields the list of the weights' shapes it ran."""
    calls = []
    real = gemm._onednn

    def counted(x, w, b):
        calls.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(gemm, "_onednn", counted)
    return calls


def tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)  # sums of K products, in another order


def test_products_match_pytorch(onednn_calls):
    x, w, b, res, m = tensors((3, 5, K), (N, K), (N,), (3, 5, N), (K, N))
    assert w.numel() >= gemm.MIN_WEIGHT
    close(gemm.linear(x, w, b), F.linear(x, w, b))
    close(gemm.linear(x, w), F.linear(x, w))
    close(gemm.linear(x, m.t()), x @ m)  # a transposed view as the weight (GPT-2's Conv1D)
    close(gemm.add_linear(res, x, w, b), res + F.linear(x, w, b))
    close(gemm.add_linear(res.view(15, N), x, w), res.view(15, N) + F.linear(x, w).view(15, N))
    a = x.view(15, K)
    close(gemm.mm(a, m), a @ m)
    close(gemm.mm(a.t().contiguous().t(), m), a @ m)  # a strided input
    out = torch.randn(15, N)
    close(gemm.addmm_(out.clone(), a, m), out + a @ m)
    assert len(onednn_calls) == 8


def test_backward_products_match_pytorch(onednn_calls):
    """The weight gradient ``a.T @ b`` and ``out = a @ m`` into rows of a bigger tensor (the
    head's input gradient), against PyTorch's products in float64."""
    g, x, w, m = tensors((9, N), (9, K), (N, K), (N, K))
    close(gemm.grad_weight(g, x, w), (g.double().t() @ x.double()).float())
    close(gemm.grad_weight(x, g, w.t()), (x.double().t() @ g.double()).float())  # Conv1D
    close(gemm.grad_weight(g.t().contiguous().t(), x, w), g.t() @ x)  # a strided input
    big = torch.zeros(12, K)
    gemm.mm_out(g, m, big[2:11])
    close(big[2:11], g @ m)
    assert big[:2].eq(0).all() and big[11:].eq(0).all()
    assert onednn_calls == [(K, 9), (N, 9), (K, 9), (K, N)]  # b.T, the rows summed over, stands in for the weight


def test_small_products_and_other_dtypes_stay_on_pytorch(accel_on, monkeypatch):
    monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN called"))
    x, w = tensors((4, 8), (8, 8))
    assert w.numel() < gemm.MIN_WEIGHT
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
    xb, wb = tensors((4, K), (N, K))
    gemm.linear(xb.double(), wb.double())
    gemm.linear(xb.bfloat16(), wb.bfloat16())
    assert gemm.linear(xb[:0], wb).shape == (0, N)  # no rows
    a, b = tensors((1000, 8), (1000, 8))  # a weight gradient: the weight decides, not the rows
    torch.testing.assert_close(gemm.grad_weight(a, b, w), a.t() @ b)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads Linux's /proc/cpuinfo on x86-64")
def test_cpu_flags_reads_this_machines_features():
    flags = gemm.cpu_flags()
    assert {"sse2", "fpu"} <= flags  # every x86-64 CPU has them
    assert all(f == f.strip() and f for f in flags)


AVX512 = frozenset({"avx2", "avx512f"})
AVX2 = frozenset({"avx2"})


@pytest.mark.parametrize("vendor, flags, force, expected", [
    ("AuthenticAMD", AVX512, False, True),  # Zen 4 / Zen 5: MKL's AVX2 code, oneDNN ~1.1-2x its rate
    ("AuthenticAMD", AVX2, False, False),  # Zen 3: MKL faster
    ("", frozenset(), False, False),  # no flags to read: PyTorch's default
    ("GenuineIntel", AVX512, False, False),  # MKL's own kernels
    ("GenuineIntel", AVX512, True, True), ("AuthenticAMD", AVX2, True, True)])  # accel.enabled=on
def test_the_cpu_picks_the_library_unless_forced(monkeypatch, vendor, flags, force, expected):
    from rlhfkit.accel import kernels

    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(gemm, "cpu_flags", lambda: flags)
    gemm.configure(force)
    threads = torch.get_num_threads()
    try:
        assert gemm.enabled() is expected
        calls = []
        real = gemm._onednn
        monkeypatch.setattr(gemm, "_onednn", lambda *a: calls.append(1) or real(*a))
        x, w = tensors((4, K), (N, K))
        close(gemm.linear(x, w), F.linear(x, w))
        assert bool(calls) is expected
        if kernels.available():  # the blocked attention runs only where oneDNN's products do
            torch.set_num_threads(1)
            q, kv = torch.empty(1, 9, 511, 64), torch.empty(1, 3, 575, 64)
            assert kernels.block_usable(q, kv, kv, torch.ones(1, 511, 575, dtype=torch.bool)) is expected
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
        gemm.configure()
        ops.configure(os.environ["RLHFKIT_ACCEL"])


@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_under_autograd_match_pytorch(onednn_calls, with_res, transposed):
    """Under a recorded graph the products go through ``_AddLinear``: its gradients for the
    residual, the input, the weight (also a transposed view of a leaf) and the bias are autograd's."""
    res, x, w, b, up = tensors((2, 3, N), (2, 3, K), (N, K), (N,), (2, 3, N))
    if transposed:
        w = w.t().contiguous()  # stored [in, out] like GPT-2's Conv1D, used as its transpose
    leaves = [t.clone().requires_grad_() for t in (res, x, w, b)]
    ref_leaves = [t.clone().requires_grad_() for t in (res, x, w, b)]

    def weight(ws):
        return ws.t() if transposed else ws

    if with_res:
        out = gemm.add_linear(leaves[0], leaves[1], weight(leaves[2]), leaves[3])
        ref = ref_leaves[0] + F.linear(ref_leaves[1], weight(ref_leaves[2]), ref_leaves[3])
    else:
        out = gemm.linear(leaves[1], weight(leaves[2]), leaves[3])
        ref = F.linear(ref_leaves[1], weight(ref_leaves[2]), ref_leaves[3])
    assert out.grad_fn is not None and "AddLinear" in type(out.grad_fn).__name__
    close(out, ref)
    used = leaves if with_res else leaves[1:]
    refs = ref_leaves if with_res else ref_leaves[1:]
    for a, r in zip(torch.autograd.grad(out, used, up), torch.autograd.grad(ref, refs, up)):
        close(a, r)


def test_chunked_head_through_onednn(onednn_calls):
    hidden, weight, bias = tensors((10, K), (N, K), (N,))
    targets = torch.randint(0, N, (10,), generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, ent = chunked_token_logprobs(*leaves, targets, 0.7, 4, True)
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    z = F.linear(*ref_leaves) / 0.7
    ref = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    close(logp, ref)
    close(ent, ref_ent)
    for a, r in zip(torch.autograd.grad((logp + ent).sum(), leaves), torch.autograd.grad((ref + ref_ent).sum(), ref_leaves)):
        close(a, r)
    assert len(onednn_calls) >= 6  # three chunks, forward and again in the backward


def test_a_row_does_not_depend_on_the_rest_of_the_batch(onednn_calls):
    """Which library runs a product depends on the weight, not on the rows: a batch's products
    are its halves', and its weight gradient their sum, as micro-batches and processes split it."""
    x, w, g = tensors((16, K), (N, K), (16, N))
    assert torch.equal(gemm.linear(x, w), torch.cat([gemm.linear(x[:8], w), gemm.linear(x[8:], w)]))
    close(gemm.grad_weight(g, x, w), gemm.grad_weight(g[:8], x[:8], w) + gemm.grad_weight(g[8:], x[8:], w))
    assert len(onednn_calls) == 6


needs_packing = pytest.mark.skipif(not gemm.packing(), reason="no oneDNN bfloat16 products on this CPU")


@needs_packing
@pytest.mark.parametrize("rows, n, k, biased", [(64, 208, 96, False), (7, 80, 48, True), (1, 64, 32, False)])
def test_a_packed_bfloat16_weight_computes_what_pytorch_does(rows, n, k, biased):
    """``gemm.Packed``: the product and the product plus a residual (with and without a bias),
    bit for bit ``F.linear`` / ``add_linear``'s; calls over more rows than it packs for, and
    calls autograd records, take ``F.linear`` on the weight (and get a gradient)."""
    x, w, res, b = (t.bfloat16() for t in tensors((rows, k), (n, k), (rows, n), (n,), seed=rows))
    b = b if biased else None
    p = gemm.Packed(w, rows)
    with torch.no_grad():
        assert torch.equal(p(x, b), F.linear(x, w, b))
        assert p.packed is not None  # made at the first call
        assert torch.equal(p.add(res, x, b), gemm.add_linear(res, x, w, b))
        assert torch.equal(p(x.view(1, rows, k), b), F.linear(x, w, b)[None])  # leading dimensions kept
        more = torch.cat([x, x])
        assert torch.equal(p(more, b), F.linear(more, w, b))
    alone = gemm.Packed(w, rows, keep=False)  # packed at once, the weight not kept
    assert alone.weight is None
    with torch.no_grad():
        assert torch.equal(alone(x, b), F.linear(x, w, b))
        assert torch.equal(alone.add(res, x, b), gemm.add_linear(res, x, w, b))
        with pytest.raises(RuntimeError, match="packed without keeping"):
            alone(torch.cat([x, x]), b)  # more rows than it packs for, and no weight to fall back on
    with pytest.raises(RuntimeError, match="packed without keeping"):
        alone(x, b)  # autograd recording
    wg = w.clone().requires_grad_()
    y = gemm.Packed(wg, rows)(x, b)
    assert torch.equal(y, F.linear(x, w, b).to(y.dtype))
    y.float().sum().backward()
    assert wg.grad is not None


@needs_packing
@pytest.mark.parametrize("name, adapters", [("llama", True), ("qwen2", False)])
def test_generation_packs_bfloat16_weights_and_computes_the_same_tokens(name, adapters, monkeypatch):
    """A bfloat16 generation call of at least ``lean.PACK_STEPS`` steps packs its layers' weights
    (LoRA's stacked ``[W; A]``, plain weights and biases: qwen2's q/k/v) and its head once, where
    packing is registered (here alone, every other name on its reference): the same tokens and
    log-probs as unpacked, bit for bit."""
    from rlhfkit.rollout.generate import generate

    model = test_lean.bf16_base(test_lean.lora(name) if adapters else test_lean.MODELS[name]())
    ids, mask = test_lean.batch()
    made, packs = [], []
    real, real_pack = gemm.Packed._product, gemm._pack

    def counted(self, *a):
        made.append(self)
        return real(self, *a)

    def pack_counted(*a):
        packs.append(a[0].shape)
        return real_pack(*a)

    monkeypatch.setattr(gemm.Packed, "_product", counted)
    monkeypatch.setattr(gemm, "_pack", pack_counted)

    def sample(steps):
        return generate(model.eval(), ids, mask, steps, eos_token_id=-1, pad_token_id=0,
                        generator=torch.Generator().manual_seed(5))

    ops.configure("off")
    try:
        for shortcut, fn in lean.SHORTCUTS.items():  # the accelerated forward, its operations on their references
            ops.register(shortcut, fn, "lean-forward")
        plain = sample(lean.PACK_STEPS)
        assert not made and not packs
        primitives.register("pack", registry.pack, "onednn")
        primitives.register("packable", gemm.packable, "onednn")
        packed = sample(lean.PACK_STEPS)
        # each layer's products (with LoRA q, k, v as one and gate, up as one: lean._StackedLoRAs), the head
        assert packs and len({id(p) for p in made}) == len(packs)  # each packed once
        assert len(made) >= len(packs) * (lean.PACK_STEPS - 1)  # and used at every decode step
        made.clear()
        packs.clear()
        assert sample(lean.PACK_STEPS - 1).response_ids.shape[1] == lean.PACK_STEPS - 1  # too short to pay:
        assert not made and not packs
    finally:
        ops.configure(os.environ["RLHFKIT_ACCEL"])
    assert torch.equal(packed.response_ids, plain.response_ids)
    assert torch.equal(packed.logprobs, plain.logprobs)


@needs_packing
@pytest.mark.parametrize("rows", [64, 300])
def test_stacked_loras_compute_what_the_layers_apart_do(rows, accel_on):
    """``lean._StackedLoRAs``: q, k and v (qwen2's biases on them) of bfloat16 LoRA layers as
    one product and one block-diagonal adapter product: the same numbers as each layer's own
    stacked product (``lean._Unmerged``), bit for bit, over a decode step's rows; a prefill's
    rows (more than ``STACK_ROWS``) take the layers apart."""
    g = torch.Generator().manual_seed(rows)
    K, r, s = 160, 8, 2.0

    def bf(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    layers = [lean._Unmerged(bf(n, K), ((bf(r, K), bf(n, r) * 0.1, s),)) for n in (192, 64, 64)]
    biases = [bf(192), None, bf(64)]
    x = bf(rows, K)
    with torch.no_grad():
        apart = torch.cat([u(x, b) for u, b in zip(layers, biases)], 1)
        (fused, none), = lean._fuse(list(zip(layers, biases)), lora=True)
        assert isinstance(fused, lean._StackedLoRAs) and none is None
        assert torch.equal(fused(x), apart)
        assert torch.equal(fused(x), apart)  # its packed weight (where there is one) made at the first call
    other = [lean._Unmerged(bf(64, K), ((bf(r, K), bf(64, r), 1.0),)), layers[1]]  # another scaling
    assert lean._fuse(list(zip(other, [None, None])), lora=True) == list(zip(other, [None, None]))
