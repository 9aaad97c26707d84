"""Tests for rlhfkit.models.forward: padding handling, HF reference agreement, response alignment."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.core import logprobs_from_logits
from rlhfkit.models.forward import (
    ValueHead,
    build_tiny_policy,
    build_tiny_scalar_model,
    policy_forward,
    position_ids_from_mask,
    sequence_scores,
    token_values,
)
from rlhfkit.tasks.doubling import make_tokenizer

ARCH = dict(n_layer=2, n_head=2, n_embd=32)
# Full sequences of different lengths (BOS added by the tokenizer); no pad 'P' inside.
TEXTS = ["数字:1234x2=2468E", "小写:5x2=一〇E", "__:99x2="]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def scramble(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Add large noise to every weight.

    GPT-2's init (std 0.02) gives near-constant outputs, so a position or pooling bug would
    move them by less than the tolerance; after this, such bugs move them by O(0.1) or more.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def scalar_model(tok):
    return scramble(build_tiny_scalar_model(tok, seed=0, **ARCH))


@pytest.fixture(scope="module")
def policy(tok):
    return scramble(build_tiny_policy(tok, seed=1, **ARCH), seed=1)


def batch(tok, texts, side):
    enc = tok(texts, padding=True, padding_side=side, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def alone(tok, model, text):
    ids = tok(text, return_tensors="pt")["input_ids"]
    return sequence_scores(model, ids, torch.ones_like(ids))[0]


# --------------------------------------------------------------------------- position ids


def test_position_ids_from_mask_hand_written():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left padded: positions start at the first real token
            [1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0],  # right padded: pads repeat the last position
            [0, 0, 0, 0, 1],
        ]
    )
    expected = torch.tensor(
        [
            [0, 0, 0, 1, 2],
            [0, 1, 2, 3, 4],
            [0, 1, 2, 2, 2],
            [0, 0, 0, 0, 0],
        ]
    )
    assert torch.equal(position_ids_from_mask(mask), expected)
    assert torch.equal(position_ids_from_mask(mask.bool()), expected)


# --------------------------------------------------------------------------- sequence scores


@pytest.mark.accel_twice
@torch.no_grad()
@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_scores_padding_matches_unpadded(tok, scalar_model, side):
    ids, mask = batch(tok, TEXTS, side)
    assert (mask == 0).any()  # the batch really is padded
    got = sequence_scores(scalar_model, ids, mask)
    ref = torch.stack([alone(tok, scalar_model, t) for t in TEXTS])
    assert got.shape == (3,)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert (ref.max() - ref.min()) > 1e-2  # rows differ, so a row mix-up would show


@torch.no_grad()
def test_sequence_scores_left_padding_needs_mask_positions(tok, scalar_model):
    # The check above has teeth: plain positions 0..T-1 under left padding change the score.
    ids, mask = batch(tok, TEXTS, "left")
    plain = torch.arange(ids.shape[1]).expand_as(ids)
    wrong = sequence_scores(scalar_model, ids, mask, position_ids=plain)
    ref = torch.stack([alone(tok, scalar_model, t) for t in TEXTS])
    assert (wrong - ref).abs().max() > 1e-3


@torch.no_grad()
def test_sequence_scores_matches_hf_classifier(tok, scalar_model):
    # Independent reference: HF pools at the last token != pad_token_id, which is the last
    # attended token when padding is on the right and 'P' never occurs in the text.
    ids, mask = batch(tok, TEXTS, "right")
    hf = scalar_model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(sequence_scores(scalar_model, ids, mask), hf, atol=1e-5, rtol=0)


@torch.no_grad()
def test_token_values_at_last_token_is_the_score(tok, scalar_model):
    ids, mask = batch(tok, TEXTS, "left")
    values = token_values(scalar_model, ids, mask)
    assert values.shape == ids.shape
    # left padding: the last attended token is the last column of every row
    torch.testing.assert_close(values[:, -1], sequence_scores(scalar_model, ids, mask), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- policy forward


def prompt_response(tok, extra_pad: int = 0):
    """Left-padded prompts + right-padded responses: ``ids, mask, P, response ids``."""
    prompts = ["数字:1234x2=", "__:99x2="]  # 1 + 10 and 1 + 8 tokens
    responses = ["2468E", "一九八E"]
    p_ids, p_mask = batch(tok, prompts, "left")
    r = tok(responses, add_special_tokens=False, padding=True, padding_side="right", return_tensors="pt")
    r_ids, r_mask = r["input_ids"], r["attention_mask"]
    pad = torch.full((2, extra_pad), tok.pad_token_id)
    ids = torch.cat([pad, p_ids, r_ids], dim=1)
    mask = torch.cat([torch.zeros_like(pad), p_mask, r_mask], dim=1)
    return ids, mask, p_ids.shape[1] + extra_pad, r_ids


@torch.no_grad()
def test_policy_forward_is_response_aligned(tok, policy):
    ids, mask, P, r_ids = prompt_response(tok)
    logits, values = policy_forward(policy, ids, mask, prompt_len=P)
    assert values is None
    # plain way: full logits, column t predicts token t+1, so response token j is column P+j-1
    full = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    assert logits.shape == (2, r_ids.shape[1], len(tok))
    torch.testing.assert_close(logits, full[:, P - 1 : -1], atol=1e-5, rtol=0)
    # off by one would be a different tensor: neighbouring columns really differ
    assert (full[:, P:] - full[:, P - 1 : -1]).abs().max() > 1e-2


@torch.no_grad()
def test_policy_forward_value_head_starts_at_zero(tok, policy):
    ids, mask, P, r_ids = prompt_response(tok)
    head = ValueHead(policy.config.n_embd)
    logits, values = policy_forward(policy, ids, mask, prompt_len=P, value_head=head)
    assert values.shape == r_ids.shape == logits.shape[:2]
    assert torch.equal(values, torch.zeros_like(values))


@pytest.mark.accel_twice
@torch.no_grad()
def test_logprobs_invariant_to_left_padding(tok, policy):
    ids0, mask0, P0, r_ids = prompt_response(tok, extra_pad=0)
    ids3, mask3, P3, _ = prompt_response(tok, extra_pad=3)
    assert P3 == P0 + 3 and ids3.shape[1] == ids0.shape[1] + 3
    lp0 = logprobs_from_logits(policy_forward(policy, ids0, mask0, P0)[0], r_ids)
    lp3 = logprobs_from_logits(policy_forward(policy, ids3, mask3, P3)[0], r_ids)
    # every column, the pads after the short response's EOS included
    torch.testing.assert_close(lp0, lp3, atol=1e-5, rtol=0)
    # and the log-probs are not trivially uniform (log(1/42) = -3.74 everywhere)
    assert lp0.std() > 0.1


def test_context_window_is_the_smallest_declared_limit(tok):
    from rlhfkit.data import Limit, context_limit
    from rlhfkit.models.forward import add_lora, build_tiny, context_window

    gpt2 = build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16, n_positions=24)  # GPT-2: n_positions
    llama = build_tiny("llama", tok, max_positions=40)  # max_position_embeddings
    assert (context_window(gpt2), context_window(llama), context_window(gpt2, None, llama)) == (24, 40, 24)
    assert context_window(add_lora(llama, 2, 4.0)) == 40 and context_window(None) is None
    # the configured limit when it fits, else the room the context leaves after the new tokens
    assert context_limit("data.max_prompt_length", 16, 40, 8, "ppo.max_new_tokens") == 16
    assert context_limit("data.max_prompt_length", 512, None, 8, "ppo.max_new_tokens") == 512
    got = context_limit("data.max_prompt_length", 512, 40, 8, "ppo.max_new_tokens")
    assert isinstance(got, Limit) and got.tokens == 32 and got.fix == "lower ppo.max_new_tokens"
    assert context_limit("data.max_length", 512, 40).tokens == 40
    with pytest.raises(ValueError, match="ppo.max_new_tokens=40 leaves no room"):
        context_limit("data.max_prompt_length", 512, 40, 40, "ppo.max_new_tokens")


def test_lora_on_gpt2_conv1d_layers_warns_nothing_and_merges_exactly(tok):
    import warnings

    from rlhfkit.models.forward import add_lora, merge_lora

    base = build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16)
    ids = torch.tensor([[tok.bos_token_id, 5, 6, 7]])
    want = base(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = add_lora(base, 2, 4.0)
    assert not [str(w.message) for w in seen if "fan_in_fan_out" in str(w.message)]
    adapted = [m for m in model.modules() if hasattr(m, "fan_in_fan_out")]
    assert adapted and all(m.fan_in_fan_out for m in adapted)  # GPT-2's Conv1D: weight stored (in, out)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a non-zero update, so a transposed merge would show
        got = model(input_ids=ids).logits
    assert not torch.allclose(got, want)
    torch.testing.assert_close(merge_lora(model)(input_ids=ids).logits, got, rtol=1e-5, atol=1e-5)
