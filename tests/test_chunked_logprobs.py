"""Log-probs and entropies of the chosen tokens computed chunk by chunk from the LM head
(``core.chunked_token_logprobs``), as the update does for big vocabularies.

* in float64 the values and the gradients wrt the hidden states, the head's weight and bias equal
  those of ``logprobs_from_logits`` / ``entropy_from_logits`` on the full logits, for chunks of one
  row, of an odd number of rows, of all rows and of more, with a temperature;
* half-precision inputs give float32 log-probs and gradients in the inputs' dtypes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.core import chunked_token_logprobs, entropy_from_logits, logprobs_from_logits

N, H, V = 9, 6, 13


def _inputs(bias: bool, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(V, (N,), generator=gen)
    return hidden, weight, b, targets


def _full(hidden, weight, bias, targets, temperature):
    logits = F.linear(hidden, weight, bias)[None] / temperature  # [1, N, V]
    return logprobs_from_logits(logits, targets[None])[0], entropy_from_logits(logits)[0]


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, N, 50])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("terms", ["both", "logprobs", "entropy"])
def test_chunks_equal_the_full_logits(chunk_rows, bias, terms):
    hidden, weight, b, targets = _inputs(bias)
    params = [p for p in (hidden, weight, b) if p is not None]
    gen = torch.Generator().manual_seed(1)
    a, c = torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(N, generator=gen, dtype=torch.float64)
    use_lp, use_ent = terms in ("both", "logprobs"), terms in ("both", "entropy")

    def objective(lp, ent):  # a weighted sum of whichever outputs are in use
        return (lp * a).sum() * use_lp + ((ent * c).sum() if use_ent else 0.0)

    lp, ent = chunked_token_logprobs(hidden, weight, b, targets, 0.7, chunk_rows, with_entropy=use_ent)
    assert lp.dtype == torch.float64 and (ent is None) != use_ent
    full_lp, full_ent = _full(hidden, weight, b, targets, 0.7)
    torch.testing.assert_close(lp, full_lp, atol=1e-12, rtol=1e-12)
    if use_ent:
        torch.testing.assert_close(ent, full_ent, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(objective(lp, ent), params)
    full_grads = torch.autograd.grad(objective(full_lp, full_ent), params)
    for name, g, fg in zip(("hidden", "weight", "bias"), grads, full_grads):
        torch.testing.assert_close(g, fg, atol=1e-12, rtol=1e-12, msg=name)


def test_gradcheck_with_temperature():
    hidden, weight, b, targets = _inputs(bias=True)
    small = (hidden[:4].detach().requires_grad_(), weight, b)
    assert torch.autograd.gradcheck(lambda h, w, bb: chunked_token_logprobs(h, w, bb, targets[:4], 1.3, 3, True), small)


def test_frozen_head_gets_no_gradient():
    """A LoRA policy's head is frozen: only the hidden states get a gradient, the same one."""
    hidden, weight, _, targets = _inputs(bias=False)
    weight = weight.detach()
    lp, _ = chunked_token_logprobs(hidden, weight, None, targets, 1.0, 2)
    (g,) = torch.autograd.grad(lp.sum(), hidden)
    (fg,) = torch.autograd.grad(_full(hidden, weight, None, targets, 1.0)[0].sum(), hidden)
    torch.testing.assert_close(g, fg, atol=1e-12, rtol=1e-12)


def test_half_precision_computes_the_softmax_in_float32():
    hidden, weight, b, targets = _inputs(bias=True, dtype=torch.bfloat16)
    lp, ent = chunked_token_logprobs(hidden, weight, b, targets, 0.8, 4, with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    full_lp, full_ent = _full(hidden, weight, b, targets, 0.8)  # bf16 logits, float32 log-softmax
    torch.testing.assert_close(lp, full_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, full_ent, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight, b))
    full_grads = torch.autograd.grad(full_lp.sum() + full_ent.sum(), (hidden, weight, b))
    for g, fg, p in zip(grads, full_grads, (hidden, weight, b)):
        assert g.dtype == p.dtype
        torch.testing.assert_close(g.float(), fg.float(), atol=0.05, rtol=0.05)


def test_bad_shapes_are_refused():
    hidden, weight, b, targets = _inputs(bias=True)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(hidden, weight, b, targets[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_token_logprobs(hidden, weight, b, targets, chunk_rows=0)
