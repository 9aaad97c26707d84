"""rlhfkit.accel.forward against transformers: same hidden states, gradients and generations.

With acceleration on, the accelerated forward replaces the models' own forward in training and
rollout for GPT-2 and Llama/Qwen2 stacks, so it must agree with ``transformers`` (the
independent reference) to float rounding, with left padding, grouped-query attention and
rotary positions included, and must step aside for anything it does not reproduce. Every test
here runs with ``accel.enabled=on`` (the rest of the suite runs the models' own forward).

The comparisons run on the CPU; ``RLHFKIT_TEST_DEVICE=cuda pytest tests/test_lean.py`` runs
them on a GPU (the lean path takes GPU-only branches there: fused q/k/v and gate/up).
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhfkit import ops
from rlhfkit.accel import forward as lean
from rlhfkit.accel import primitives
from rlhfkit.models.forward import build_tiny, build_tiny_policy, position_ids_from_mask
from rlhfkit.registry import repeated_rows
from rlhfkit.rollout.generate import generate, sample_tokens
from rlhfkit.tasks import doubling

TOK = doubling.make_tokenizer()
DEV = torch.device(os.environ.get("RLHFKIT_TEST_DEVICE", "cpu"))
TEXTS = ["数字:12x2=", "__:7x2=", "小写:1234x2=45", "大写:9999x2="]


def scramble(model, seed=0):
    """Large weights: GPT-2-style inits give near-constant outputs that would hide bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(DEV).eval()


def qwen2():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return scramble(Qwen2ForCausalLM(cfg), 1)


def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return scramble(LlamaForCausalLM(cfg), 2)


def gpt2(**arch):
    return scramble(build_tiny_policy(TOK, 1, n_layer=2, n_head=2, n_embd=32, **arch))


MODELS = {"gpt2": gpt2, "qwen2": qwen2, "llama": llama}


@pytest.fixture(autouse=True)
def _accelerated(accel_on):
    """The accelerated forward (and every accelerated operation that runs here) for each test."""
    yield


def batch():
    enc = TOK(TEXTS, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # left padding present
    return enc["input_ids"].to(DEV), enc["attention_mask"].to(DEV)


def grouped_batch():
    """:func:`batch`'s prompts as 4 groups of 3 rows, each row with its own 5 response tokens:
    ``(seq, seq_mask, position_ids, prompt_len, responses)``."""
    ids, mask = batch()
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    resp = torch.randint(3, len(TOK), (12, 5), generator=torch.Generator().manual_seed(1)).to(DEV)
    seq, seq_mask = torch.cat([ids, resp], 1), torch.cat([mask, torch.ones_like(resp)], 1)
    return seq, seq_mask, position_ids_from_mask(seq_mask), ids.shape[1], resp


def loss_grads(model, hiddens, valid) -> list[dict[str, torch.Tensor]]:
    """For each of ``hiddens`` (two forwards of ``model``), the gradients of one random projection
    of the valid positions' states, by parameter name."""
    weight = torch.randn(hiddens[0].shape[-1]).to(DEV)
    grads = []
    for h in hiddens:
        model.zero_grad()
        (h[valid] @ weight).square().mean().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads


@pytest.mark.parametrize("accel", ["reference", "accelerated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_states_and_grads_match_transformers(name, accel, request):
    """The lean forward against the model's own, its operations on their references
    (accel.enabled=off) and with every accelerated one that runs here (accel.enabled=on)."""
    if accel == "reference":
        request.getfixturevalue("accel_off")
    _hidden_states_and_grads_match_transformers(name)


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_mistral_and_qwen3_match_transformers(name):
    """Mistral (Llama's layout) and Qwen3 (Llama's plus an RMS norm on each head of q and k)
    take the accelerated forward: the same hidden states and gradients as their own forward,
    and the same generations as their own cached decode."""
    model = scramble(build_tiny(name, TOK, seed=4, hidden=32, heads=4, kv_heads=2), 3)
    _hidden_states_and_grads_match_transformers(model)
    ids, mask = batch()
    a = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, greedy=True)
    b = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, greedy=True, lean=False)
    assert a.forward_logprobs and torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def _hidden_states_and_grads_match_transformers(name):
    model = MODELS[name]() if isinstance(name, str) else name
    assert lean.supported(model)
    ids, mask = batch()
    pos = position_ids_from_mask(mask)
    valid = mask.bool()
    ref = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    ours = lean.hidden_states(model, ids, mask, pos)
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-5, rtol=1e-5)
    # gradients of a loss on the valid positions reach the same parameters with the same values
    grads = loss_grads(model, (ref, ours), valid)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for a, b in zip(grads[0].values(), grads[1].values()):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_generation_with_static_cache_matches_the_models_own_forward(name):
    model = MODELS[name]()
    ids, mask = batch()
    a = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, greedy=True)
    b = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, greedy=True, lean=False)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    u = torch.rand((ids.shape[0], 8), generator=torch.Generator().manual_seed(7)).to(DEV)
    a = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, uniforms=u)
    b = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, uniforms=u, lean=False)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def lora(name: str, dropout: float = 0.0):
    """The model with a LoRA adapter on every linear layer but the head, A and B random (a fresh
    adapter's B = 0 would hide a missing branch)."""
    from rlhfkit.models.forward import add_lora

    model = add_lora(MODELS[name](), r=4, alpha=8.0, dropout=dropout).to(DEV)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_lora_hidden_states_grads_and_generations_match_peft(name):
    """Plain LoRA takes the lean path: the adapted layers compute ``W + scaling * B @ A``, equal
    to peft's ``base(x) + B(A(x)) * scaling``; the gradients reach A and B (the base weights stay
    without any); inside ``disable_adapter()`` it is the base model; generations match the
    model's own forward."""
    model = lora(name)
    assert lean.supported(model)
    ids, mask = batch()
    pos = position_ids_from_mask(mask)
    valid = mask.bool()
    body = model.get_base_model().base_model
    ref = body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    ours = lean.hidden_states(model, ids, mask, pos)
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-5, rtol=1e-5)
    grads = loss_grads(model, (ref, ours), valid)
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0]) and len(grads[0]) > 0
    for n in grads[0]:  # float32 rounding of gradients up to ~100: relative to each tensor's scale
        scale = grads[0][n].abs().max().item()
        assert (grads[1][n] - grads[0][n]).abs().max().item() <= 5e-5 * scale, n
    with torch.no_grad(), model.disable_adapter():  # the LoRA reference: the base model exactly
        assert lean.supported(model)
        base = body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        torch.testing.assert_close(lean.hidden_states(model, ids, mask, pos)[valid], base[valid], atol=1e-5, rtol=1e-5)
    assert (base[valid] - ref[valid]).abs().max() > 1e-2  # the adapter matters
    u = torch.rand((ids.shape[0], 8), generator=torch.Generator().manual_seed(7)).to(DEV)
    a = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, uniforms=u)
    b = generate(model, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, uniforms=u, lean=False)
    assert a.forward_logprobs and not b.forward_logprobs
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_lora_on_a_half_precision_base_is_as_close_to_float32_as_peft_under_autocast(name, dtype):
    """peft keeps a half-precision base's adapters in float32; the lean path runs them beside the
    half-precision products (not folded into a half-precision weight), their products in half
    precision as ``torch.autocast`` computes peft's layers (TRL's and the Trainer's ``bf16=True``).
    Against the same weights held in float32 (the exact function), its hidden states and the
    adapters' gradients are as close as peft's under autocast, within 2.5x of peft's
    float32-adapter forward's; and the adapters matter."""
    full = lora(name)
    with torch.no_grad():  # the half-precision base's values, held in float32
        for n, p in full.named_parameters():
            if "lora_" not in n:
                p.copy_(p.to(dtype))
    half = lora(name)
    for n, p in half.named_parameters():
        p.data = p.data.to(dtype) if "lora_" not in n else p.data
    assert lean.supported(half)
    ids, mask = batch()
    pos, valid = position_ids_from_mask(mask), mask.bool()
    exact = lean.hidden_states(full, ids, mask, pos)
    peft_h = half.get_base_model().base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    with torch.autocast(torch.device(DEV).type, dtype):
        auto_h = half.get_base_model().base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    ours = lean.hidden_states(half, ids, mask, pos)
    assert ours.dtype == dtype

    def err(h):
        return (h[valid].float() - exact[valid]).abs().max().item()

    assert err(ours) <= 1.5 * err(auto_h) + 1e-3, (err(ours), err(auto_h))
    assert err(ours) <= 2.5 * err(peft_h) + 1e-3, (err(ours), err(peft_h))
    with torch.no_grad(), half.disable_adapter():
        base = lean.hidden_states(half, ids, mask, pos)
    assert (base[valid].float() - exact[valid]).abs().max() > 20 * err(ours)  # the adapters matter
    w = torch.randn(exact.shape[-1], generator=torch.Generator().manual_seed(3)).to(DEV)
    grads = []
    for model, h in ((full, exact), (half, peft_h), (half, auto_h), (half, ours)):
        model.zero_grad()
        (h[valid].float() @ w).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[3].keys() and all("lora_" in n for n in grads[3])
    assert all(g.dtype == torch.float32 for g in grads[3].values())

    def gerr(g):
        return max(((g[n] - grads[0][n]).norm() / grads[0][n].norm()).item() for n in grads[0])

    assert gerr(grads[3]) <= 1.5 * gerr(grads[2]) + 1e-3, (gerr(grads[3]), gerr(grads[2]))
    assert gerr(grads[3]) <= 2.5 * gerr(grads[1]) + 1e-3, (gerr(grads[3]), gerr(grads[1]))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_half_precision_lora_decode_stacks_the_adapters_under_the_weight(name):
    """On a CPU a decode step's few rows (at most ``STACK_ROWS``) compute the base product and each
    ``x A^T`` of a half-precision LoRA layer as one product over ``[W; A]`` (``lean._Unmerged``,
    made once a generation call), the bias (qwen2's q/k/v) in that product as in ``F.linear``;
    more rows take the separate products: the same states for the same rows."""
    half = bf16_base(lora(name))
    ids, mask = batch()
    n = lean.STACK_ROWS // ids.shape[0] + 1  # the batch repeated: more rows than a stacked step takes
    steps = torch.randint(3, len(TOK), (4, ids.shape[0]), generator=torch.Generator().manual_seed(1)).to(DEV)

    def decode(ids, mask, steps):
        pos = position_ids_from_mask(mask)
        _, cache = lean.prefill(half, ids, mask, pos, len(steps))
        layer = cache.arch.layers[0]
        return torch.stack([lean.decode_step(cache, t, pos[:, -1] + 1 + i) for i, t in enumerate(steps)]), layer

    def stacks(layer) -> bool:
        return any(isinstance(w, lean._Unmerged) and w.stacked for w in _flat(layer))

    stacked, layer = decode(ids, mask, steps)
    assert stacks(layer) == (DEV.type == "cpu")  # a GPU keeps its separate products (and its memory)
    apart, layer = decode(ids.repeat(n, 1), mask.repeat(n, 1), steps.repeat(1, n))
    assert ids.shape[0] * n > lean.STACK_ROWS and not stacks(layer)
    assert torch.equal(apart[:, : ids.shape[0]], stacked)  # each output column reduces over the same inputs alike


def bf16_base(model):
    """``model`` with its own weights in bfloat16 and its LoRA adapters (if any) in float32, as
    peft keeps them on a half-precision base; the adapters' ``B`` random, so that they change
    the states."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" not in n:
                p.data = p.data.to(torch.bfloat16)
            elif "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _flat(tree):
    """The leaves of nested tuples and lists."""
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _flat(t)]
    return [tree]


def test_lora_variants_the_lean_path_does_not_compute_fall_back():
    model = lora("qwen2", dropout=0.1).train()
    assert not lean.supported(model)  # the adapter's dropout is active
    model.eval()
    assert lean.supported(model)
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(MODELS["llama"](), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert not lean.supported(dora)
    lora_embed = get_peft_model(MODELS["llama"](), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    assert not lean.supported(lora_embed)  # an adapted embedding: the lean path reads the table itself


def test_unsupported_models_fall_back():
    model = MODELS["gpt2"]()
    model.train()
    assert lean.supported(model)  # dropout probabilities are 0 in the tiny config
    model.transformer.drop.p = 0.1
    assert not lean.supported(model)  # active dropout: the lean path has none
    model.eval()
    assert lean.supported(model)

    class Adapter(torch.nn.Linear):  # stands for a quantised or other replacement of a projection
        pass

    q = qwen2()
    proj = q.model.layers[1].self_attn.v_proj
    q.model.layers[1].self_attn.v_proj = Adapter(proj.in_features, proj.out_features).to(DEV)
    assert not lean.supported(q)
    ids, mask = batch()
    out = generate(q, ids, mask, 4, TOK.eos_token_id, TOK.pad_token_id, greedy=True)  # still works, HF path
    assert out.response_ids.shape[0] == len(TEXTS)


def test_sigmoid_form_gelu_is_the_tanh_gelu():
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lean._GeluTanhCPU.apply, (x[::50].detach().requires_grad_(),))
    ours, ref = lean._gelu_tanh(x), F.gelu(x, approximate="tanh")
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-12)
    g_ours, = torch.autograd.grad(ours.sum(), x)
    g_ref, = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-10, rtol=1e-10)
    with torch.no_grad():  # the in-place inference branch
        y = torch.randn(1000) * 4
        torch.testing.assert_close(lean._gelu_tanh(y), F.gelu(y, approximate="tanh"), atol=1e-6, rtol=1e-6)


def test_inverse_cdf_sampling_follows_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 1.0, 0.0], [0.1, 0.1, 0.1, 0.7]])
    n = 40000
    draws = sample_tokens(probs.log().repeat(n, 1), torch.Generator().manual_seed(0)).view(n, 3)
    freq = torch.stack([torch.bincount(draws[:, r], minlength=4) for r in range(3)]).float() / n
    assert (freq[probs == 0] == 0).all()  # a zero-probability token is never drawn
    assert (freq - probs).abs().max() < 0.01  # 4 sigma of a binomial at n=40000 is ~0.01


def test_repeated_prompts_share_one_prefill():
    """GRPO-style batches (each prompt G times) give the same rollout as distinct rows would."""
    model = MODELS["qwen2"]()
    ids, mask = batch()
    rep_ids, rep_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    grouped = generate(model, rep_ids, rep_mask, 6, TOK.eos_token_id, TOK.pad_token_id, greedy=True)
    plain = generate(model, rep_ids, rep_mask, 6, TOK.eos_token_id, TOK.pad_token_id, greedy=True, lean=False)
    assert torch.equal(grouped.response_ids, plain.response_ids)
    torch.testing.assert_close(grouped.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    pos = position_ids_from_mask(rep_mask)
    hidden, cache = lean.prefill(model, rep_ids, rep_mask, pos, 6)
    assert cache.keys[0].shape[0] == rep_ids.shape[0]  # expanded back to one row per sample
    alone, _ = lean.prefill(model, ids[:1], mask[:1], position_ids_from_mask(mask[:1]), 6)
    torch.testing.assert_close(hidden[:3], alone.expand(3, -1), atol=1e-5, rtol=0)


def test_bfloat16_decode_kernel_is_as_close_to_float32_as_pytorchs_attention(monkeypatch, accel_on):
    """A bfloat16 model's decode steps on one thread of a CPU with AVX-512 BF16 take the compiled
    attention (:func:`rlhfkit.accel.kernels.decode_attention_bf16`), reading each group's prompt from
    its first row (``KVCache.shared``). Against the same weights in float32, its hidden states
    are as close as those of PyTorch's attention on the same bfloat16 cache."""
    from rlhfkit.accel import kernels

    if DEV.type != "cpu" or not kernels._avx512_bf16() or not kernels.available():
        pytest.skip("the bfloat16 decode kernel runs on CPUs with AVX-512 BF16")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(TOK), hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    full = scramble(LlamaForCausalLM(cfg), 3).to(torch.bfloat16).float()  # bfloat16's values, in float32
    half = LlamaForCausalLM(cfg).to(torch.bfloat16)
    half.load_state_dict(full.state_dict())
    ids, mask = batch()
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # groups of three
    pos = position_ids_from_mask(mask)
    steps = torch.randint(3, len(TOK), (6, ids.shape[0]), generator=torch.Generator().manual_seed(1))
    calls = []
    real = kernels.decode_attention_bf16
    monkeypatch.setattr(kernels, "decode_attention_bf16", lambda *a: calls.append(a[-1]) or real(*a))

    def decode(model, kernel: bool):
        monkeypatch.setattr(kernels, "decode_bf16_usable", usable if kernel else lambda *a: False)
        _, cache = lean.prefill(model, ids, mask, pos, len(steps))
        return torch.stack([lean.decode_step(cache, t, pos[:, -1] + 1 + i) for i, t in enumerate(steps)]), cache

    usable = kernels.decode_bf16_usable
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exact, _ = decode(full, False)
        pytorch, _ = decode(half, False)
        assert not calls
        ours, cache = decode(half, True)
    finally:
        torch.set_num_threads(threads)
    assert cache.shared is not None and cache.shared[1] == ids.shape[1]
    assert torch.equal(cache.shared[0], torch.arange(ids.shape[0]) // 3 * 3)
    assert calls[0] is None  # the prefill's last layer, which only needs its last column's query
    assert len(calls) == 1 + len(steps) * 2 and all(c is cache.shared for c in calls[1:])  # each step's layers
    err, err_pt = ((h.float() - exact).abs().max().item() for h in (ours, pytorch))
    assert err <= 1.5 * err_pt + 1e-3, (err, err_pt)


def test_repeated_rows_finds_runs_of_one_prompt():
    """Runs of equal consecutive rows, a differing mask breaking a run; None without a repeat."""
    ids = torch.tensor([[5, 6], [5, 6], [5, 6], [7, 8], [5, 6], [5, 6]])
    mask = torch.ones_like(ids)
    mask[5, 0] = 0  # same tokens, another mask: another prompt
    first, rows = repeated_rows(ids, mask)
    assert first.tolist() == [0, 3, 4, 5]
    assert rows.tolist() == [0, 0, 0, 1, 2, 3]
    assert repeated_rows(ids[2:4], mask[2:4]) is None
    assert repeated_rows(ids[:1], mask[:1]) is None


@pytest.mark.parametrize("flat", [None, False, True, "accel"],
                         ids=["device_default", "two_streams", "flat", "accelerated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_shared_prompt_forward_matches_the_full_forward(name, flat, monkeypatch):
    """Rows that repeat a prompt (shuffled, as in a GRPO minibatch) run it once: same logits
    and the same gradients as running every row in full -- with the device's choice of two
    streams or one flat sequence (flat on a GPU, and on a CPU at these small sizes:
    ``lean.flat_on_cpu``), with each of the two forced, and with the shared path on every
    accelerated operation that runs here (the full forward on the references)."""
    from rlhfkit.models.forward import policy_forward

    if flat == "accel":
        try:
            _shared_prompt_forward_matches(name, policy_forward, lambda: ops.configure("on"))
        finally:
            ops.configure(os.environ["RLHFKIT_ACCEL"])
        return

    if flat is not None:
        monkeypatch.setattr(lean, "response_hidden_states",
                            functools.partial(lean.response_hidden_states, flat=flat))

    _shared_prompt_forward_matches(name, policy_forward)


def classifier(name: str):
    """:data:`MODELS`' shape as a 3-label sequence classifier (a reward model's head on it)."""
    from transformers import AutoModelForSequenceClassification

    causal = MODELS[name]()
    cfg = causal.config
    cfg.num_labels = 3
    model = AutoModelForSequenceClassification.from_config(cfg)
    model.load_state_dict(causal.state_dict(), strict=False)  # the scrambled body; a fresh head
    with torch.no_grad():
        model.score.weight.normal_(generator=torch.Generator().manual_seed(3))
    return model.to(DEV).eval()


@pytest.mark.parametrize("flat", [None, False, True], ids=["device_default", "two_streams", "flat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_classifier_reads_each_shared_prompt_once(name, flat, monkeypatch):
    """A reward model or classifier scoring a rollout (``sequence_logits(..., prompt_len=P)``, as
    ``rewards.reward_model_scorer`` and ``classifier_scorer`` call it) runs each group's prompt
    once and reads the last attended column: the logits of the full forward, with left-padded
    prompts, responses cut early and an empty response (its last attended column the prompt's
    last)."""
    from rlhfkit.models.forward import sequence_logits

    model = classifier(name)
    calls = []
    real = lean.response_hidden_states

    def spy(*a, **k):
        calls.append(k.get("through_last"))
        return real(*a, **k) if flat is None else real(*a, **{**k, "flat": flat})

    monkeypatch.setattr(lean, "response_hidden_states", spy)
    seq, seq_mask, pos, P, _ = grouped_batch()
    seq_mask[1, P + 2:] = 0  # responses that ended early, one of them with no token at all
    seq_mask[5, P:] = 0
    with torch.no_grad():
        full = sequence_logits(model, seq, seq_mask)
        assert not calls  # without prompt_len: the full forward
        shared = sequence_logits(model, seq, seq_mask, prompt_len=P)
        hf = model(input_ids=seq * seq_mask, attention_mask=seq_mask, position_ids=pos).logits  # [12, 3]
    assert calls == [True]
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, hf, atol=1e-5, rtol=1e-5)  # it pools the last token that is not padding


@pytest.mark.parametrize("path", ["hf", "full", "two_streams", "flat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_response_states_never_read_the_last_column(name, path, monkeypatch):
    """The states that score a response end at column T-2: the last column's state predicts
    nothing and, the attention being causal, no earlier column reads it, so
    ``models.response_hidden`` does not run it on any path (the model's own forward, the lean
    one in full, shared prompts as two streams or one flat sequence). A token id outside the
    vocabulary there would make the embedding raise if it were read; the states equal the full
    forward's at columns P-1..T-2, also with one response column (its state is the prompt's
    last)."""
    from rlhfkit.models import forward as models

    if path == "hf":
        monkeypatch.setattr(lean, "supported", lambda model: False)
    elif path == "full":  # what the lean path does when sharing prompts does not pay
        monkeypatch.setattr(lean, "shared_prompts", lambda *a, **k: None)
    else:
        monkeypatch.setattr(lean, "response_hidden_states",
                            functools.partial(lean.response_hidden_states, flat=path == "flat"))
    model = MODELS[name]()
    ids, mask = batch()
    P = ids.shape[1]
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # 4 groups of 3
    for R in (5, 1):
        resp = torch.randint(3, len(TOK), (12, R), generator=torch.Generator().manual_seed(1)).to(DEV)
        seq, seq_mask = torch.cat([ids, resp], 1), torch.cat([mask, torch.ones_like(resp)], 1)
        with torch.no_grad():
            ref = lean.hidden_states(model, seq, seq_mask, position_ids_from_mask(seq_mask))[:, P - 1 : -1]
            bad = seq.clone()
            if R > 1:
                bad[:, -1] = len(TOK) + 1000  # no such token
            got = models.response_hidden(model, bad, seq_mask, P)
        assert got.shape == ref.shape == (12, R, ref.shape[-1])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def saved_bytes(fn):
    """``fn()`` and the bytes autograd keeps for its backward outside checkpointed regions (the
    checkpoint's own hooks take the tensors saved inside them)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("path", ["full", "two_streams", "flat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointing_keeps_values_and_gradients_and_drops_activations(name, path):
    """With the model's gradient checkpointing on, the lean forwards (full, and shared prompts
    as two streams or one flat sequence) checkpoint each layer: the same states and gradients
    as without, with well under half the activations kept for the backward; in eval mode or
    without a graph nothing is checkpointed."""
    from rlhfkit.models.forward import enable_gradient_checkpointing

    plain, ckpt = MODELS[name]().train(), enable_gradient_checkpointing(MODELS[name]()).train()
    assert lean.supported(ckpt)
    seq, seq_mask, pos, P, resp = grouped_batch()
    shared = lean.shared_prompts(seq, seq_mask, P)

    def forward(model):
        if path == "full":
            return lean.hidden_states(model, seq, seq_mask, pos)[:, P - 1 : -1]
        return lean.response_hidden_states(model, seq, seq_mask, pos, P, *shared, flat=path == "flat")

    weight = torch.randn(32, generator=torch.Generator().manual_seed(2)).to(DEV)  # the models' width
    outs, kept, grads = [], [], []
    for model in (plain, ckpt):
        out, n = saved_bytes(functools.partial(forward, model))
        (out @ weight).square().mean().backward()
        outs.append(out.detach())
        kept.append(n)
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    assert [g is None for g in grads[1]] == [g is None for g in grads[0]] and grads[0][1] is not None
    for a, b in zip(*grads):
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert kept[1] < 0.5 * kept[0], kept
    with torch.no_grad():
        assert not lean._checkpointing(lean._Arch(ckpt))
    assert not lean._checkpointing(lean._Arch(ckpt.eval()))


@pytest.mark.parametrize("attention, new_tokens", [("torch", 8), ("torch", 136), ("triton", 8)])
@pytest.mark.parametrize("name", list(MODELS))
def test_fixed_shape_decode_matches_the_growing_one(name, attention, new_tokens, monkeypatch, request):
    """``generate(graph=True)``: the decode step with fixed shapes (attention over the cache up to
    the end of the current band of columns, unwritten columns masked; on CUDA replayed as a CUDA
    graph per band) samples the same tokens with the same log-probs as the step over a cache that
    grows, greedy and sampled, with left padding and a row that ends early; run past twice the
    band's columns, the decode crosses several. With the Triton attention (on a CPU under Triton's
    interpreter) one band spans the whole cache, so one graph serves each rollout, and the
    kernel reads the written columns only."""
    from rlhfkit.accel import triton_decode

    if attention == "triton":
        pytest.importorskip("triton")  # a dev dependency on Linux; Triton has no other platforms' wheels
    else:  # PyTorch's attention over the band of columns
        primitives.register("graphed_decode_attention", primitives.reference("graphed_decode_attention"), "reference")
    kernel_calls = []
    kernel = triton_decode.attention
    monkeypatch.setattr(triton_decode, "attention", lambda *a: kernel_calls.append(a[4]) or kernel(*a))
    ids, mask = batch()
    long = new_tokens > 2 * lean.FixedStep.BAND
    # GPT-2's learned positions: as many as the long decode reaches
    model = gpt2(n_positions=ids.shape[1] + new_tokens) if long and name == "gpt2" else MODELS[name]()
    calls = []  # (the step's column, the columns attention reads, the cache's columns)
    step = lean.static_decode_step
    monkeypatch.setattr(lean, "static_decode_step",
                        lambda *a: calls.append((a[0].length, a[4].shape[0], a[0].key_bias.shape[1])) or step(*a))
    u = torch.rand((ids.shape[0], new_tokens), generator=torch.Generator().manual_seed(7)).to(DEV)
    eos = -1 if long else TOK.eos_token_id  # -1: no row ends, every one decodes across the bands
    ended = False
    for kw in ({"greedy": True}, {"uniforms": u}):
        a = generate(model, ids, mask, new_tokens, eos, TOK.pad_token_id, graph=True, **kw)
        b = generate(model, ids, mask, new_tokens, eos, TOK.pad_token_id, **kw)
        ended |= bool((b.response_mask == 0).any())
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=0)
    assert ended != long  # some row ended before the token limit (these seeds)
    spans = [span for _, span, _ in calls]
    assert bool(kernel_calls) == (attention == "triton")
    if attention == "triton":  # one band: the whole cache
        assert all(span == T for _, span, T in calls)
    else:
        width = max(lean.FixedStep.BAND, -(-calls[0][2] // 16))
        for t, span, T in calls:  # the written columns and those up to the band's end, no more
            assert t < span <= T and (span == T or span % width == 0) and span - t <= width
        assert (len(set(spans)) > 2) == long
    if DEV.type == "cpu":  # every step after the prefill took the fixed path
        assert len(calls) >= 2 * 7
    else:  # a CUDA graph per band, each run twice when made (warm-up, capture), the rest replays:
        made = spans[::2]  # in each of the two rollouts, one per band in growing order
        assert spans[1::2] == made and sum(b <= a for a, b in zip(made, made[1:])) == 1


def activation_bytes(model, fn):
    """``fn()`` and the bytes autograd keeps for its backward, parameters left out."""
    params = {p.data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t):
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("path", ["full", "two_streams", "flat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_training_layers_keep_fewer_activations_for_the_same_gradients(name, path, monkeypatch):
    """A layer's training forward keeps the norms' inputs instead of their outputs (``_NormLinears``)
    and the MLP's input projections instead of the activation's intermediates and output
    (``_SwiGLUDown``: gate and up, not silu(gate) and the product; ``_GeluDown``: not the GELU's
    gate and output): the same states and gradients as autograd's own graph of the same layer,
    with at least ``2 (hidden + intermediate)`` fewer numbers kept per token and layer. On a GPU
    autograd's own GPT-2 layer keeps one intermediate fewer to begin with (there the GELU is
    ``F.gelu``, one op keeping its input; on a CPU it is the sigmoid-gate form, which keeps its
    gate too), so there the saving is ``2 hidden + intermediate``."""
    model = MODELS[name]().train()
    seq, seq_mask, pos, P, resp = grouped_batch()
    shared = lean.shared_prompts(seq, seq_mask, P)

    def forward():
        if path == "full":
            return lean.hidden_states(model, seq, seq_mask, pos)[:, P - 1 : -1]
        return lean.response_hidden_states(model, seq, seq_mask, pos, P, *shared, flat=path == "flat")

    weight = torch.randn(32, generator=torch.Generator().manual_seed(2)).to(DEV)
    outs, kept, grads = [], [], []
    for lean_layers in (False, True):
        if not lean_layers:
            monkeypatch.setattr(lean, "_lean_training", lambda x, w: False)
        else:
            monkeypatch.undo()
        model.zero_grad(set_to_none=True)
        out, n = activation_bytes(model, forward)
        (out @ weight).square().mean().backward()
        outs.append(out.detach())
        kept.append(n)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert grads[1].keys() == grads[0].keys() and len(grads[0]) > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-4, rtol=1e-4, msg=k)
    cfg = model.config
    C, L = cfg.hidden_size, cfg.num_hidden_layers
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * C
    run_resp = resp.numel() - resp.shape[0]  # the shared paths do not run the last column
    tokens = seq.numel() if path == "full" else 4 * P + run_resp
    last_mlp = tokens if path == "full" else 4 + run_resp  # the prompts' last column only, at the top
    act = inner if name == "gpt2" and DEV.type != "cpu" else 2 * inner  # the MLP's intermediates not kept
    fewer = 4 * ((2 * C + act) * tokens * (L - 1) + C * tokens + (C + act) * last_mlp)  # float32 bytes
    assert kept[1] <= kept[0] - fewer, (kept, fewer)


@pytest.mark.parametrize("path", ["full", "two_streams", "flat"])
def test_pytorch_attention_keeps_one_additive_mask_per_forward_and_queries_without_keys(path, accel_off):
    """Attention routed to PyTorch's (``F.scaled_dot_product_attention``) gets each boolean mask
    of a forward as one additive mask made once (``lean._additive``), not one conversion per
    layer kept for the backward: a 4-layer model keeps one mask (full forward) or three (the
    shared prompts' streams: the prompts', the responses', the prompts' last column at the top)
    where it kept one per layer and stream. On a CPU q and k are rotated apart, so the queries
    attention keeps are not a view holding the keys' rows too. The values and gradients are the
    other tests' (this forward against the model's own)."""
    torch.manual_seed(0)  # accel.enabled=off: PyTorch's attention at every size
    cfg = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    model = scramble(LlamaForCausalLM(cfg), 2).train()
    seq, seq_mask, pos, P, resp = grouped_batch()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if path == "full":
            lean.hidden_states(model, seq, seq_mask, pos)
        else:
            lean.response_hidden_states(model, seq, seq_mask, pos, P, *lean.shared_prompts(seq, seq_mask, P),
                                        flat=path == "flat")
    masks = {t.untyped_storage().data_ptr() for t in saved
             if t.dim() == 4 and t.shape[1] == 1 and t.is_floating_point() and ((t == 0) | (t == -math.inf)).all()}
    assert len(masks) == (1 if path == "full" else 3)
    if path == "full" and DEV.type == "cpu":  # every saved [B, heads, T, D] tensor owns its storage
        heads = [t for t in saved if t.dim() == 4 and t.shape[1] in (4, 2) and t.shape[-1] == 8]
        assert len(heads) >= 3 * 4  # q, keys, values of each layer
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in heads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_grouped_heads_are_pytorchs_grouped_attention(dtype):
    """A half-precision CPU forward under autograd runs grouped heads as one head of
    ``groups x Tq`` queries a key head (``lean._fold_heads``; PyTorch's bfloat16 backward pays by
    head): every output equals PyTorch's grouped attention bit for bit, and the gradients are as
    close to float64's as PyTorch's are. Float32, no-grad and single-query calls keep the
    grouped call."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Tq, Tk, D = 3, 6, 2, 7, 11, 16
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(B, Hkv, Tk, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).repeat(B, 1, 1)[:, None]  # queries at the end
    mask[0, :, :, :2] = False  # a row's left padding
    grad = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    assert lean._fold_heads(q, k, H // Hkv)
    assert not lean._fold_heads(q.float(), k.float(), H // Hkv) and not lean._fold_heads(q[:, :, :1], k, H // Hkv)
    with torch.no_grad():
        assert not lean._fold_heads(q, k, H // Hkv)
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, -math.inf)
    results = []
    for run in (lambda q, k, v: lean._attend(q, k, v, mask, 0.25, H // Hkv, {}),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25, enable_gqa=True),
                lambda q, k, v: F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               attn_mask=bias.double(), scale=0.25, enable_gqa=True)):
        out = run(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
        results.append((out, dq, dk, dv))
    ours, grouped, exact = results
    assert torch.equal(ours[0], grouped[0])
    for i in range(1, 4):
        err = (ours[i].double() - exact[i]).abs().max().item()
        assert err <= 1.5 * (grouped[i].double() - exact[i]).abs().max().item() + 1e-3, i


def test_norm_linears_swiglu_down_and_gelu_down_gradients():
    """The hand-written backward passes against finite differences (float64, PyTorch's ops; the
    compiled kernels are float32 and checked in tests/test_kernels.py)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g).requires_grad_()
    norm = (1 + 0.3 * torch.randn(5, dtype=torch.float64, generator=g)).requires_grad_()
    w1, w2 = (torch.randn(n, 5, dtype=torch.float64, generator=g).requires_grad_() for n in (4, 3))
    b2 = torch.randn(3, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: lean._NormLinears.apply(a[0], a[1], None, 1e-6, False, a[2], None, a[3], a[4]),
                                    (x, norm, w1, w2, b2))
    gate, up = (torch.randn(6, 7, dtype=torch.float64, generator=g).mul(3).requires_grad_() for _ in range(2))
    wd = torch.randn(5, 7, dtype=torch.float64, generator=g).requires_grad_()
    bd = torch.randn(5, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: lean._SwiGLUDown.apply(*a, None), (x, gate, up, wd))
    assert torch.autograd.gradcheck(lean._SwiGLUDown.apply, (x, gate, up, wd, bd))
    # the forwards are the layers' own arithmetic
    h = F.rms_norm(x, (5,), norm, 1e-6)
    ys = lean._NormLinears.apply(x, norm, None, 1e-6, False, w1, None, w2, b2)
    torch.testing.assert_close(ys[0], F.linear(h, w1))
    torch.testing.assert_close(ys[1], F.linear(h, w2, b2))
    torch.testing.assert_close(lean._SwiGLUDown.apply(x, gate, up, wd, bd), x + F.linear(F.silu(gate) * up, wd, bd))
    # a layer norm and GPT-2's [in, out] weights; GPT-2's MLP tail
    nb = torch.randn(5, dtype=torch.float64, generator=g).requires_grad_()
    w3 = torch.randn(5, 4, dtype=torch.float64, generator=g).requires_grad_()
    b3 = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: lean._NormLinears.apply(a[0], a[1], a[2], 1e-5, True, a[3], a[4]),
                                    (x, norm, nb, w3, b3))
    y, = lean._NormLinears.apply(x, norm, nb, 1e-5, True, w3, b3)
    torch.testing.assert_close(y, torch.addmm(b3, F.layer_norm(x, (5,), norm, nb, 1e-5), w3))
    f = torch.randn(6, 7, dtype=torch.float64, generator=g).mul(3).requires_grad_()
    wp = torch.randn(7, 5, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lean._GeluDown.apply, (x, f, wp, bd))
    torch.testing.assert_close(lean._GeluDown.apply(x, f, wp, bd),
                               x + torch.addmm(bd, F.gelu(f, approximate="tanh"), wp))


@pytest.mark.parametrize("gate_form", [True, False])
def test_gelu_down_both_branches_agree(gate_form, monkeypatch):
    """``_GeluDown`` takes PyTorch's fused tanh-GELU (and its backward op) where the sigmoid-gate
    form does not apply: on a GPU, whose ``addcmul`` cannot take the gate's CPU constant. On a CPU
    the fused branch is forced here, so both branches are checked against finite differences and
    against autograd through ``F.gelu`` on every machine; on ``RLHFKIT_TEST_DEVICE=cuda`` the
    unforced case is the GPU's own branch."""
    if not gate_form:
        monkeypatch.setattr(lean, "_gelu_by_gate", lambda x: False)
    g = torch.Generator().manual_seed(1)
    x, f, wp, bd = (torch.randn(*shape, dtype=torch.float64, generator=g).to(DEV).requires_grad_()
                    for shape in ((6, 5), (6, 7), (7, 5), (5,)))
    with torch.no_grad():
        f.mul_(3)  # both tails of the GELU
    assert torch.autograd.gradcheck(lean._GeluDown.apply, (x, f, wp, bd))
    assert torch.autograd.gradcheck(lambda *a: lean._GeluDown.apply(*a, None), (x, f, wp))
    ref_inputs = [t.detach().clone().requires_grad_() for t in (x, f, wp, bd)]
    ref = ref_inputs[0] + torch.addmm(ref_inputs[3], F.gelu(ref_inputs[1], approximate="tanh"), ref_inputs[2])
    out = lean._GeluDown.apply(x, f, wp, bd)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn(6, 5, dtype=torch.float64, generator=g).to(DEV)
    for a, b in zip(torch.autograd.grad(out, (x, f, wp, bd), upstream),
                    torch.autograd.grad(ref, ref_inputs, upstream)):
        torch.testing.assert_close(a, b)


def _shared_prompt_forward_matches(name, policy_forward, before_ours=None):
    """The body of the shared-prompt test; ``before_ours`` runs between the reference (the
    full forward) and the shared forward."""
    model = MODELS[name]().train()
    ids, mask = batch()
    P = ids.shape[1]
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0)).to(DEV)
    ids, mask = ids.repeat(3, 1)[order], mask.repeat(3, 1)[order]
    resp = torch.randint(3, len(TOK), (12, 5), generator=torch.Generator().manual_seed(1)).to(DEV)
    resp_mask = torch.ones_like(resp)
    resp_mask[0, 3:] = 0  # a response that ended early: padding after it
    seq, seq_mask = torch.cat([ids, resp], 1), torch.cat([mask, resp_mask], 1)
    assert lean.shared_prompts(seq, seq_mask, P) is not None  # 4 distinct prompts in 12 rows
    pos = position_ids_from_mask(seq_mask)
    ref_logits = model.get_output_embeddings()(lean.hidden_states(model, seq, seq_mask, pos)[:, P - 1 : -1])
    if before_ours is not None:
        before_ours()
    ours, _ = policy_forward(model, seq, seq_mask, P)  # takes the shared path
    valid = resp_mask.bool()
    torch.testing.assert_close(ours[valid], ref_logits[valid], atol=1e-5, rtol=1e-5)
    grads = []
    for out in (ref_logits, ours):
        model.zero_grad()
        out[valid].logsumexp(-1).sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
