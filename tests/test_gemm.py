"""oneDNN's float32 linear (:mod:`rlhfkit.gemm`) against PyTorch's ops, and the lean paths with it.

The tests' models are far below :data:`rlhfkit.gemm.MIN_WEIGHT`, so these tests lower it to 0 to
send every product of a float32 CPU forward through oneDNN, and count the calls that did."""
from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

import test_lean
from rlhfkit import lean
from rlhfkit.accel import gemm
from rlhfkit.core import chunked_token_logprobs, position_ids_from_mask

pytestmark = pytest.mark.skipif(not gemm.available(), reason="this PyTorch build has no oneDNN linear")


@pytest.fixture
def onednn_calls(monkeypatch):
    """Every float32 CPU product through oneDNN; yields the list of the weights' shapes it ran."""
    calls = []
    real = gemm._onednn

    def counted(x, w, b):
        calls.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(gemm, "MIN_WEIGHT", 0)
    monkeypatch.setattr(gemm, "_enabled", True)  # whatever the CPU: on an Intel one MKL is the default
    monkeypatch.setattr(gemm, "_onednn", counted)
    return calls


def tensors(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def test_products_match_pytorch(onednn_calls):
    x, w, b, res, m = tensors((3, 5, 7), (6, 7), (6,), (3, 5, 6), (7, 4))
    torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
    torch.testing.assert_close(gemm.linear(x, m.t()), x @ m)  # a transposed view as the weight (GPT-2's Conv1D)
    torch.testing.assert_close(gemm.add_linear(res, x, w, b), res + F.linear(x, w, b))
    torch.testing.assert_close(gemm.add_linear(res.view(15, 6), x, w), res.view(15, 6) + F.linear(x, w).view(15, 6))
    a = x.view(15, 7)
    torch.testing.assert_close(gemm.mm(a, m), a @ m)
    torch.testing.assert_close(gemm.mm(a.t().contiguous().t(), m), a @ m)  # a strided input
    out = torch.randn(15, 4)
    torch.testing.assert_close(gemm.addmm_(out.clone(), a, m), out + a @ m)
    assert len(onednn_calls) == 8


def test_backward_products_match_pytorch(onednn_calls):
    """The weight gradient ``a.T @ b`` and ``out = a @ m`` into rows of a bigger tensor (the
    head's input gradient), against PyTorch's products in float64."""
    g, x, w, h = tensors((9, 6), (9, 5), (6, 5), (9, 4))
    torch.testing.assert_close(gemm.grad_weight(g, x, w), (g.double().t() @ x.double()).float())
    torch.testing.assert_close(gemm.grad_weight(x, g, w.t()), (x.double().t() @ g.double()).float())  # Conv1D
    torch.testing.assert_close(gemm.grad_weight(g.t().contiguous().t(), x, w), g.t() @ x)  # a strided input
    big, m = torch.zeros(12, 4), tensors((6, 4), seed=1)[0]
    gemm.mm_out(g, m, big[2:11])
    torch.testing.assert_close(big[2:11], g @ m)
    assert big[:2].eq(0).all() and big[11:].eq(0).all()
    assert onednn_calls == [(5, 9), (6, 9), (5, 9), (4, 6)]  # b.T, the rows summed over, stands in for the weight


def test_small_products_and_other_dtypes_stay_on_pytorch(monkeypatch):
    monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN called"))
    x, w = tensors((4, 8), (8, 8))
    assert w.numel() < gemm.MIN_WEIGHT
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
    monkeypatch.setattr(gemm, "MIN_WEIGHT", 0)
    gemm.linear(x.double(), w.double())
    gemm.linear(x.bfloat16(), w.bfloat16())
    assert gemm.linear(x[:0], w).shape == (0, 8)  # no rows
    monkeypatch.setattr(gemm, "MIN_WEIGHT", 65)  # a weight gradient: the weight decides, not the rows
    a, b = tensors((100, 8), (100, 8))
    torch.testing.assert_close(gemm.grad_weight(a, b, w), a.t() @ b)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("RLHFKIT_ONEDNN", "0")
    gemm.reset()
    try:
        assert not gemm.available() and not gemm.enabled()
        monkeypatch.setattr(gemm, "MIN_WEIGHT", 0)
        monkeypatch.setattr(gemm, "_onednn", lambda *a: pytest.fail("oneDNN called"))
        x, w = tensors((4, 8), (8, 8))
        torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
    finally:
        monkeypatch.undo()
        gemm.reset()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads Linux's /proc/cpuinfo on x86-64")
def test_cpu_flags_reads_this_machines_features():
    flags = gemm.cpu_flags()
    assert {"sse2", "fpu"} <= flags  # every x86-64 CPU has them
    assert all(f == f.strip() and f for f in flags)


AVX512 = frozenset({"avx2", "avx512f"})
AVX2 = frozenset({"avx2"})


@pytest.mark.parametrize("vendor, flags, setting, expected", [
    ("AuthenticAMD", AVX512, None, True),  # Zen 4 / Zen 5: MKL's AVX2 code, oneDNN ~1.1-2x its rate
    ("AuthenticAMD", AVX2, None, False), ("AuthenticAMD", AVX2, "auto", False),  # Zen 3: MKL faster
    ("", frozenset(), None, False),  # no flags to read: PyTorch's default
    ("GenuineIntel", AVX512, None, False), ("GenuineIntel", AVX512, "auto", False),  # MKL's own kernels
    ("GenuineIntel", AVX512, "1", True), ("AuthenticAMD", AVX2, "1", True), ("AuthenticAMD", AVX512, "0", False)])
def test_the_cpu_picks_the_library_unless_the_environment_does(monkeypatch, vendor, flags, setting, expected):
    from rlhfkit.accel import kernels

    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(gemm, "cpu_flags", lambda: flags)
    if setting is None:
        monkeypatch.delenv("RLHFKIT_ONEDNN", raising=False)
    else:
        monkeypatch.setenv("RLHFKIT_ONEDNN", setting)
    gemm.reset()
    threads = torch.get_num_threads()
    try:
        assert gemm.enabled() is expected
        monkeypatch.setattr(gemm, "MIN_WEIGHT", 0)
        calls = []
        real = gemm._onednn
        monkeypatch.setattr(gemm, "_onednn", lambda *a: calls.append(1) or real(*a))
        x, w = tensors((4, 8), (8, 8))
        torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
        assert bool(calls) is expected
        if kernels.available():  # the blocked attention runs only where oneDNN's products do
            torch.set_num_threads(1)
            q, kv = torch.empty(1, 9, 511, 64), torch.empty(1, 3, 575, 64)
            assert kernels.block_usable(q, kv, kv, torch.ones(1, 511, 575, dtype=torch.bool)) is expected
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
        gemm.reset()


@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_under_autograd_match_pytorch(onednn_calls, with_res, transposed):
    """Under a recorded graph the products go through ``_AddLinear``: its gradients for the
    residual, the input, the weight (also a transposed view of a leaf) and the bias are autograd's."""
    res, x, w, b, up = tensors((2, 3, 6), (2, 3, 5), (6, 5), (6,), (2, 3, 6))
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
    torch.testing.assert_close(out, ref)
    used = leaves if with_res else leaves[1:]
    refs = ref_leaves if with_res else ref_leaves[1:]
    for a, r in zip(torch.autograd.grad(out, used, up), torch.autograd.grad(ref, refs, up)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("name", list(test_lean.MODELS))
def test_lean_forwards_backwards_and_generation_through_onednn(name, onednn_calls, monkeypatch):
    """The lean paths' own equality tests (transformers' forward and gradients, generation,
    shared prompts) with every product of the float32 CPU forwards and input gradients on oneDNN."""
    if test_lean.DEV.type != "cpu":
        pytest.skip("oneDNN's linear is a CPU path")
    test_lean._hidden_states_and_grads_match_transformers(name)
    test_lean.test_generation_with_static_cache_matches_the_models_own_forward(name)
    test_lean.test_shared_prompt_forward_matches_the_full_forward(name, None, monkeypatch)
    assert len(onednn_calls) > 0


def test_chunked_head_through_onednn(onednn_calls):
    hidden, weight, bias = tensors((10, 6), (13, 6), (13,))
    targets = torch.randint(0, 13, (10,), generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, ent = chunked_token_logprobs(*leaves, targets, 0.7, 4, True)
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    z = F.linear(*ref_leaves) / 0.7
    ref = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(ent, ref_ent)
    for a, r in zip(torch.autograd.grad((logp + ent).sum(), leaves), torch.autograd.grad((ref + ref_ent).sum(), ref_leaves)):
        torch.testing.assert_close(a, r)
    assert len(onednn_calls) >= 6  # three chunks, forward and again in the backward


@pytest.mark.parametrize("name", list(test_lean.MODELS))
def test_a_row_does_not_depend_on_the_rest_of_the_batch(name, onednn_calls):
    """Which library runs a product depends on the weight, not on the rows: the forward and the
    parameter gradients of a batch are its halves', as micro-batches and processes split it."""
    if test_lean.DEV.type != "cpu":
        pytest.skip("oneDNN's linear is a CPU path")
    model = test_lean.MODELS[name]().train()
    ids, mask = test_lean.batch()
    pos = position_ids_from_mask(mask)

    def forward_and_grads(rows):
        model.zero_grad()
        h = lean.hidden_states(model, ids[rows], mask[rows], pos[rows])
        (h * mask[rows, :, None]).square().sum().backward()
        return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, g_whole = forward_and_grads(slice(0, 4))
    first, g_first = forward_and_grads(slice(0, 2))
    second, g_second = forward_and_grads(slice(2, 4))
    assert torch.equal(whole, torch.cat([first, second]))
    assert len(onednn_calls) > 0
    for n, g in g_whole.items():
        torch.testing.assert_close(g, g_first[n] + g_second[n], atol=1e-5, rtol=1e-5)  # sums in another order


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
    (LoRA's stacked ``[W; A]``, plain weights and biases: qwen2's q/k/v) and its head once: the
    same tokens and log-probs as unpacked, bit for bit."""
    from rlhfkit.rollout import generate

    model = test_lean.bf16_base(test_lean.lora(name) if adapters else test_lean.MODELS[name]())
    ids, mask = test_lean.batch()
    monkeypatch.setattr(lean, "STACK_ROWS", ids.shape[0])  # the prefill's rows above it, as a real prompt's are
    assert gemm.packing()  # checked (with a product of its own) before the products are counted
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

    packed = sample(lean.PACK_STEPS)
    # each layer's seven products (with LoRA q, k, v as one and gate, up as one: lean._StackedLoRAs), the head
    per_step = (4 if adapters else 7) * model.config.num_hidden_layers + 1
    assert len(packs) == per_step and len({id(p) for p in made}) == per_step  # each packed once
    assert len(made) >= per_step * (lean.PACK_STEPS - 1)  # and used at every decode step
    made.clear()
    packs.clear()
    assert sample(lean.PACK_STEPS - 1).response_ids.shape[1] == lean.PACK_STEPS - 1  # too short to pay:
    assert not made and not packs
    monkeypatch.setattr(lean, "PACK_STEPS", 10**9)  # nothing packed, the layers apart
    plain = sample(16)
    assert not made and not packs
    assert torch.equal(packed.response_ids, plain.response_ids)
    assert torch.equal(packed.logprobs, plain.logprobs)


@needs_packing
@pytest.mark.parametrize("rows", [64, 300])
def test_stacked_loras_compute_what_the_layers_apart_do(rows):
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
