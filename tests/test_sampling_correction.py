"""Truncated sampling (top-k / top-p) is off-policy: the kept mass is recorded and logged, a
warning comes when most of the probability is dropped, and ``ppo.sampling_correction`` weighs the
policy loss by pi / q -- checked against exact expectations over a small vocabulary."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlhfkit.core import sampling_correction_weights
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.rollout.generate import generate, truncate_logprobs
from rlhfkit.run.watch import SignalWatch
from rlhfkit.tasks.doubling import make_tokenizer


def test_weights_by_hand():
    log_w = torch.log(torch.tensor([[0.5, 0.8, 1.0], [3.0, 0.5, 7.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # per token: the weights themselves, capped at 2 (truncate) or zeroed above it (mask); 0 off the mask
    assert torch.allclose(sampling_correction_weights(log_w, mask, "token_truncate", 2.0),
                          torch.tensor([[0.5, 0.8, 0.0], [2.0, 0.5, 2.0]]))
    assert torch.allclose(sampling_correction_weights(log_w, mask, "token_mask", 2.0),
                          torch.tensor([[0.5, 0.8, 0.0], [0.0, 0.5, 0.0]]))
    # per sequence: the product over the row's tokens, 0.4 and 10.5 (-> 2, or 0 masked)
    assert torch.allclose(sampling_correction_weights(log_w, mask, "sequence_truncate", 2.0),
                          torch.tensor([[0.4, 0.4, 0.0], [2.0, 2.0, 2.0]]))
    assert torch.allclose(sampling_correction_weights(log_w, mask, "sequence_mask", 2.0),
                          torch.tensor([[0.4, 0.4, 0.0], [0.0, 0.0, 0.0]]))


def test_the_weighted_policy_gradient_is_pi_s_over_the_kept_tokens():
    """Six tokens, nucleus 0.8: exact expectations by enumeration. Drawn from q = pi / Z on the
    kept set, the score-function gradient sum_a q(a) A(a) grad log pi(a) is 1/Z times pi's over the
    kept tokens; weighted by w = Z (what the rollout records) it is pi's."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 2.0], dtype=torch.float64)  # any per-token advantage
    logp = torch.log_softmax(logits, -1)
    kept = truncate_logprobs(logp.detach()[None], top_p=0.8)[0]  # [V], -inf outside the nucleus
    log_z = torch.logsumexp(kept, -1)
    q = (kept - log_z).exp()  # the sampler's distribution
    inside = torch.isfinite(kept)
    assert 1 < int(inside.sum()) < 6  # the nucleus drops some tokens

    def expected_grad(weights: torch.Tensor) -> torch.Tensor:  # sum_a q(a) w(a) A(a) grad log pi(a)
        return torch.autograd.grad((q * weights * A * logp).sum(), logits, retain_graph=True)[0]

    on_kept = torch.autograd.grad((torch.where(inside, logp.detach().exp(), 0.0) * A * logp).sum(), logits,
                                  retain_graph=True)[0]  # pi's expectation over the kept tokens
    w = sampling_correction_weights(torch.full((1, 1), float(log_z)), torch.ones(1, 1), "token_truncate", 2.0)
    assert torch.allclose(expected_grad(torch.full_like(A, float(w))), on_kept, atol=1e-12)
    uncorrected = expected_grad(torch.ones_like(A))
    assert torch.allclose(uncorrected, on_kept / log_z.exp(), atol=1e-12)
    assert not torch.allclose(uncorrected, on_kept, atol=1e-3)


def test_a_truncated_rollout_records_its_kept_mass():
    tok = make_tokenizer()
    model = build_tiny_policy(tok, seed=0, n_layer=1, n_head=2, n_embd=16).eval()
    enc = tok([f"数字:{1000 + 37 * i}x2=" for i in range(8)], padding=True, return_tensors="pt")
    u = torch.rand((8, 6), generator=torch.Generator().manual_seed(0))
    args = (model, enc["input_ids"], enc["attention_mask"], 6, tok.eos_token_id, tok.pad_token_id)
    full = generate(*args, temperature=2.0, uniforms=u)
    assert full.kept_logmass is None  # nothing truncated
    roll = generate(*args, temperature=2.0, uniforms=u, top_p=0.5)
    mask = roll.response_mask.bool()
    z = roll.kept_logmass.exp()
    assert torch.all(z[~mask] == 1.0) and torch.all((z[mask] > 0) & (z[mask] <= 1 + 1e-6))
    assert float(z[mask].mean()) < 0.9  # at temperature 2 the nucleus of 0.5 drops a lot
    # each sampled token has q = pi / Z: at least pi, at most 1
    q = (roll.logprobs - roll.kept_logmass).exp()[mask]
    assert torch.all(q >= roll.logprobs.exp()[mask] - 1e-7) and torch.all(q <= 1 + 1e-6)
    # the first step's Z by hand, from the model's logits at temperature 2
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float() / 2.0  # left-padded: the last position is the prompt's end
    by_hand = torch.logsumexp(truncate_logprobs(torch.log_softmax(logits, -1), top_p=0.5), -1)
    assert torch.allclose(roll.kept_logmass[:, 0], by_hand, atol=1e-5)


def test_a_small_kept_mass_warns_once():
    w = SignalWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            w.check(step, {"rollout/kept_mass": 0.9})  # healthy
        for step in range(4, 12):
            w.check(step, {"rollout/kept_mass": 0.3})
    msgs = [str(c.message) for c in caught]
    assert len(msgs) == 1 and "rollout/kept_mass" in msgs[0] and "ppo.sampling_correction" in msgs[0], msgs
    assert msgs[0].startswith("step 7:")  # the mean of the last 5 steps passes 0.5 dropped at step 7


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_without_truncation_the_weights_are_one(mode):
    """Reused rollout log-probs and no top-k / top-p: log w = 0, the update is unchanged."""
    mask = torch.tensor([[1, 1, 1, 0]])
    assert torch.equal(sampling_correction_weights(torch.zeros(1, 4), mask, mode, 2.0),
                       mask.float())


def test_a_run_logs_the_kept_mass_and_weighs_its_advantages(tiny_models, tiny_config, tmp_path, no_plots):
    """GRPO with top_p: rollout/kept_mass is logged; with the correction the mean weight equals
    the kept mass (per token, with reused log-probs w = Z); without it the weight is not logged."""
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.utils import read_jsonl

    base = dict(model={"name": tiny_models.policy}, reward={"function": "rlhfkit.tasks.doubling:exact_reward"})
    for corr in ("none", "token_truncate"):
        cfg = tiny_config(tmp_path / corr, **base, ppo={"algo": "grpo", "top_p": 0.5, "temperature": 2.0,
                                                         "sampling_correction": corr})
        train_rl(cfg)
        rows = read_jsonl(tmp_path / corr / "metrics.jsonl")
        assert all(0 < r["rollout/kept_mass"] < 1 for r in rows)
        if corr == "none":
            assert all("policy/sampling_weight" not in r for r in rows)
        else:
            assert all(r["policy/sampling_weight"] == pytest.approx(r["rollout/kept_mass"], abs=1e-5) for r in rows)
