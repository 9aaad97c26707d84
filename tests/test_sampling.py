"""Sampling from given uniforms (rollout.generate(uniforms=...)): the right distribution, and a
row's sample independent of the rest of the batch, which is what lets N processes sample what
one process samples (rlhfkit.run.distributed.rollout_uniforms)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.rollout.generate import generate
from rlhfkit.run.distributed import Shard, rollout_uniforms
from rlhfkit.tasks.doubling import make_tokenizer


class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are the same everywhere."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        B, T = input_ids.shape
        return SimpleNamespace(logits=self.logits.expand(B, T, -1), past_key_values=past_key_values)


def test_inverse_cdf_sampling_matches_the_softmax():
    logits = torch.tensor([2.0, -1e9, 0.5, 1.0, -0.5])  # token 1 has probability 0
    probs = torch.softmax(logits, -1)
    n = 40000
    ids = torch.zeros((n, 1), dtype=torch.long)
    u = torch.rand((n, 1), generator=torch.Generator().manual_seed(0))
    out = generate(FixedLogits(logits), ids, torch.ones_like(ids), 1, eos_token_id=99, pad_token_id=0, uniforms=u)
    freq = torch.bincount(out.response_ids[:, 0], minlength=5).float() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert freq[1] == 0 and ((freq - probs).abs() <= 4 * sigma + 1e-12).all(), (freq, probs)
    # the reported log-prob is that of the drawn token
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1)[out.response_ids[:, 0]])


def test_a_rows_sample_does_not_depend_on_the_batch_split():
    tok = make_tokenizer()
    model = build_tiny_policy(tok, seed=0, n_layer=1, n_head=2, n_embd=16).eval()
    texts = [f"数字:{1000 + 37 * i}x2=" for i in range(8)]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    full = generate(model, ids, mask, 6, tok.eos_token_id, tok.pad_token_id,
                    uniforms=rollout_uniforms(3, 7, 8, 6, slice(0, 8)))
    halves = []
    for rank in (0, 1):
        shard = Shard()
        shard.rank, shard.world = rank, 2  # the rows rank 0 / 1 of 2 processes take
        rows = shard.span(8)
        halves.append(generate(model, ids[rows], mask[rows], 6, tok.eos_token_id, tok.pad_token_id,
                               uniforms=rollout_uniforms(3, 7, 8, 6, rows)))
    for half, rows in zip(halves, (slice(0, 4), slice(4, 8))):
        R = half.response_ids.shape[1]
        assert torch.equal(half.response_ids, full.response_ids[rows, :R])
        assert (full.response_mask[rows, R:] == 0).all()  # the full batch ran longer only for other rows
    # another step draws other numbers
    assert not torch.equal(rollout_uniforms(3, 7, 8, 6, slice(0, 8)), rollout_uniforms(3, 8, 8, 6, slice(0, 8)))
