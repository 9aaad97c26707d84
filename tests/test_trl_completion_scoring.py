"""The one-step benchmark's completion-position rows (``benchmarks/real_step.py``,
``completion_only_scoring``) make TRL's fused log-prob head score only the positions with a
label, as it does where Triton runs, instead of every position as on a CPU. Forced or stock,
the per-token log-probs, entropies and gradients must be the same, and both must equal the
log-softmax of the model's own logits; the forced path must project fewer rows.

TRL is an optional benchmark dependency, so the test is marked ``bench``: ``make test`` leaves it
out and ``make bench-real``, which installs TRL, runs it before the benchmark. TRL is imported in
the test (about 9 s on a busy core), not when the file is collected.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_helpers import import_example

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def scored(trl_utils, model, ids, mask, labels, weights):
    """Log-probs, entropies, the head's row count and the gradients of a weighted log-prob sum."""
    rows = []
    original = trl_utils._ChunkedLogProbFunction

    class Counting:  # records how many positions the head projects
        @staticmethod
        def apply(hidden, *rest):
            rows.append(hidden.shape[0])
            return original.apply(hidden, *rest)

    trl_utils._ChunkedLogProbFunction = Counting
    try:
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (out.log_probs * weights).sum().backward()
    finally:
        trl_utils._ChunkedLogProbFunction = original
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach(), sum(rows), grads


@pytest.mark.bench
def test_completion_only_scoring_matches_the_stock_cpu_head():
    import trl.trainer.utils as trl_utils
    from transformers import GPT2Config, GPT2LMHeadModel

    real_step = import_example(BENCHMARKS, "real_step")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    B, T, R = 3, 10, 4  # rows, prompt + completion, completion tokens
    ids = torch.randint(0, 97, (B, T))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-R] = -100  # TRL's labels: completion tokens only
    labels[2, -1] = -100  # a completion that ended one token early
    weights = torch.randn(B, T - 1)

    stock = scored(trl_utils, model, ids, mask, labels, weights)
    with real_step.completion_only_scoring():
        forced = scored(trl_utils, model, ids, mask, labels, weights)
    assert trl_utils._use_triton(torch.device("cpu")) is False  # restored on exit

    valid = labels[:, 1:] != -100  # [B, T-1]
    assert stock[2] == B * (T - 1) and forced[2] == int(valid.sum()) == B * R - 1
    torch.testing.assert_close(forced[0], stock[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(forced[1], stock[1], atol=1e-5, rtol=0)
    for name, grad in stock[3].items():
        torch.testing.assert_close(forced[3][name], grad, atol=1e-5, rtol=0, msg=name)
    # both against the model's own logits (the forward without the fused head)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]
    reference = logits.log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)
    torch.testing.assert_close(forced[0][valid], reference[valid], atol=1e-5, rtol=0)
    assert (forced[0][~valid] == 0).all()
