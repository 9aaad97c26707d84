"""Property-based tests (hypothesis) of rlhfkit.core over random shapes, values and masks.

What must hold for *every* input, not just the hand-picked ones of test_core.py:

* no NaN/inf out of any masked reduction, loss or advantage when at least one token is valid
  and the valid inputs are finite -- whatever sits in the masked-out slots (NaN included);
* padding invariance: appending padded columns (garbage values, mask 0) changes nothing on the
  valid positions, neither values nor gradients;
* k2, k3 >= 0; entropy in [0, log V]; log-probs <= 0 and normalised;
* whitened values have mean 0 and std 1 under the mask (more than one valid token, nonzero
  variance); group baselines sum to 0 per group and ignore a per-group shift.

Deterministic (``derandomize``) and without an example database, so CI sees the same cases
every run; modest ``max_examples`` keeps the whole file to a few seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlhfkit.core import (
    adaptive_kl_coef,
    bradley_terry_loss,
    dpo_loss,
    entropy_from_logits,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    shaped_rewards,
    value_loss,
)

PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

FINITE = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
LOGPROB = st.floats(-30.0, 0.0, allow_nan=False, width=32)  # log-probs a model can actually produce
NASTY = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30])  # what a padded slot may hold


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=tol, rtol=tol)


def finite(*tensors) -> bool:
    return all(bool(torch.isfinite(torch.as_tensor(t)).all()) for t in tensors)


@st.composite
def shape(draw, max_b=5, max_r=10):
    return draw(st.integers(1, max_b)), draw(st.integers(1, max_r))


@st.composite
def any_mask(draw, b: int, r: int) -> torch.Tensor:
    """A ``[b, r]`` 0/1 mask with at least one 1, anywhere."""
    mask = draw(hnp.arrays(np.bool_, (b, r)))
    mask.flat[draw(st.integers(0, b * r - 1))] = True
    return torch.from_numpy(mask).long()


@st.composite
def response_mask(draw, b: int, r: int) -> torch.Tensor:
    """A ``[b, r]`` response mask: every row 1 up to a length >= 1, then 0 (after EOS)."""
    lengths = torch.tensor(draw(st.lists(st.integers(1, r), min_size=b, max_size=b)))
    return (torch.arange(r)[None, :] < lengths[:, None]).long()


def tensor(draw, b: int, r: int, elements=FINITE, dtype=torch.float64) -> torch.Tensor:
    return torch.from_numpy(draw(hnp.arrays(np.float32, (b, r), elements=elements))).to(dtype)


def soil(x: torch.Tensor, mask: torch.Tensor, draw, elements=NASTY) -> torch.Tensor:
    """``x`` with every masked-out slot overwritten by garbage."""
    junk = torch.tensor(draw(st.lists(elements, min_size=x.numel(), max_size=x.numel())), dtype=x.dtype)
    return torch.where(mask.bool(), x, junk.view_as(x))


def pad_cols(x: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    return torch.cat([x, torch.full((x.shape[0], k), fill, dtype=x.dtype)], dim=1)


# --------------------------------------------------------------------------- masked statistics


@pytest.mark.accel_twice
@PROPS
@given(st.data())
def test_masked_stats_are_finite_and_equal_the_valid_elements(data):
    b, r = data.draw(shape())
    mask = data.draw(any_mask(b, r))
    clean = tensor(data.draw, b, r)
    x = soil(clean, mask, data.draw)  # NaN / inf / 1e30 wherever mask == 0
    picked = clean[mask.bool()]  # the independent reference: just the valid elements
    n = picked.numel()
    mean, var, white = masked_mean(x, mask), masked_var(x, mask), masked_whiten(x, mask)
    assert finite(mean, var, white, masked_sum(x, mask))
    close(mean, picked.mean(), tol=1e-9)
    close(var, picked.var() if n > 1 else 0.0, tol=1e-7)
    assert bool((white[mask == 0] == 0).all())  # nothing stale flows downstream
    if n > 1 and picked.var() > 1e-2:
        w = white[mask.bool()]
        close(w.mean(), 0.0, tol=1e-6)
        close(w.std(), 1.0, tol=1e-6)  # unbiased, like masked_var
    # per-row mean over a dim: finite wherever the row has a valid token
    rows = mask.sum(-1) > 0
    if bool(rows.all()):
        assert finite(masked_mean(x, mask, dim=-1))


@PROPS
@given(st.data())
def test_whiten_float32_has_mean_zero_std_one_under_the_mask(data):
    b, r = data.draw(shape())
    mask = data.draw(any_mask(b, r))
    x = tensor(data.draw, b, r, dtype=torch.float32)
    white = masked_whiten(x, mask)
    assert finite(white)
    picked = x[mask.bool()].double()
    if picked.numel() > 1 and picked.var() > 1e-2:
        w = white[mask.bool()].double()
        close(w.mean(), 0.0, tol=1e-4)
        close(w.std(), 1.0, tol=1e-4)
        # shift_mean=False keeps the mean, only rescales
        kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()].double()
        close(kept.mean(), picked.mean(), tol=1e-3)


# --------------------------------------------------------------------------- log-probs, entropy, KL


@PROPS
@given(st.data())
def test_logprobs_and_entropy_are_normalised_and_bounded(data):
    b, r = data.draw(shape(max_b=3, max_r=4))
    v = data.draw(st.integers(2, 12))
    logits = torch.from_numpy(data.draw(hnp.arrays(np.float32, (b, r, v), elements=st.floats(-100, 100, width=32))))
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, v - 1), min_size=b * r, max_size=b * r))).view(b, r)
    logp = logprobs_from_logits(logits, tokens)
    ent = entropy_from_logits(logits)
    assert finite(logp, ent)
    assert bool((logp <= 1e-5).all())
    # every token's log-prob, exponentiated, sums to 1 at each position
    every = torch.stack([logprobs_from_logits(logits, torch.full_like(tokens, t)) for t in range(v)], -1)
    close(every.double().exp().sum(-1), torch.ones(b, r), tol=1e-4)
    assert bool((ent >= -1e-3).all()) and bool((ent <= math.log(v) + 1e-3).all())


@PROPS
@given(st.data())
def test_k2_k3_are_nonnegative_and_zero_on_the_reference(data):
    b, r = data.draw(shape())
    logp = tensor(data.draw, b, r, LOGPROB, torch.float32)
    ref = tensor(data.draw, b, r, LOGPROB, torch.float32)
    for kind in ("k1", "k2", "k3"):
        assert finite(kl_estimate(logp, ref, kind))
        assert bool((kl_estimate(logp, logp, kind) == 0).all())
    assert bool((kl_estimate(logp, ref, "k2") >= 0).all())
    assert bool((kl_estimate(logp, ref, "k3") >= 0).all())
    # float64 reference of k3 = r - 1 - log r
    log_r = ref.double() - logp.double()
    close(kl_estimate(logp.double(), ref.double(), "k3"), log_r.exp() - 1 - log_r, tol=1e-9)


# --------------------------------------------------------------------------- losses


@pytest.mark.accel_twice
@PROPS
@given(st.data())
def test_losses_are_finite_and_blind_to_padded_slots(data):
    b, r = data.draw(shape())
    mask = data.draw(response_mask(b, r))
    logp = tensor(data.draw, b, r, LOGPROB).requires_grad_()
    old = tensor(data.draw, b, r, LOGPROB)
    adv = tensor(data.draw, b, r)
    values = tensor(data.draw, b, r).requires_grad_()
    old_values, returns = tensor(data.draw, b, r), tensor(data.draw, b, r)
    clip = data.draw(st.floats(0.05, 0.5))
    vclip = data.draw(st.one_of(st.none(), st.floats(0.05, 5.0)))

    def run(lp, o, a, v, ov, ret, m):
        p_loss, p_stats = policy_loss(lp, o, a, m, clip)
        v_loss, v_stats = value_loss(v, ov, ret, m, vclip)
        return p_loss, v_loss, {**p_stats, **v_stats}

    p_loss, v_loss, stats = run(logp, old, adv, values, old_values, returns, mask)
    assert finite(p_loss, v_loss, *stats.values())
    assert v_loss >= 0 and 0 <= stats["policy/clipfrac"] <= 1 and stats["policy/approx_kl"] >= 0
    (p_loss + v_loss).backward()
    g_logp, g_values = logp.grad.clone(), values.grad.clone()
    assert finite(g_logp, g_values)

    # Same batch with garbage (NaN, inf, 1e30) in every padded slot of every input: same loss,
    # same stats, same gradients on valid tokens, zero gradient on the padded ones.
    logp2 = soil(logp.detach(), mask, data.draw).requires_grad_()
    values2 = soil(values.detach(), mask, data.draw).requires_grad_()
    dirty = [soil(t, mask, data.draw) for t in (old, adv, old_values, returns)]
    p2, v2, stats2 = run(logp2, dirty[0], dirty[1], values2, dirty[2], dirty[3], mask)
    close(p2, p_loss, tol=1e-9)
    close(v2, v_loss, tol=1e-9)
    for k in stats:
        close(stats2[k], stats[k], tol=1e-9)
    (p2 + v2).backward()
    close(logp2.grad, g_logp * mask, tol=1e-9)
    close(values2.grad, g_values * mask, tol=1e-9)


@pytest.mark.accel_twice
@PROPS
@given(st.data())
def test_policy_loss_at_ratio_one(data):
    b, r = data.draw(shape())
    mask = data.draw(any_mask(b, r))
    logp = tensor(data.draw, b, r, LOGPROB)
    adv = tensor(data.draw, b, r)
    loss, stats = policy_loss(logp, logp, adv, mask, 0.2)
    close(loss, -masked_mean(adv, mask), tol=1e-9)
    assert stats["policy/clipfrac"] == 0 and stats["policy/approx_kl"] == 0 and stats["policy/ratio_mean"] == 1


@PROPS
@given(st.data())
def test_pairwise_losses_stay_finite_for_extreme_scores(data):
    n = data.draw(st.integers(1, 6))
    big = st.floats(-1e4, 1e4, allow_nan=False, width=32)
    c, rj, rc, rr = (torch.tensor(data.draw(st.lists(big, min_size=n, max_size=n))) for _ in range(4))
    bt, bt_stats = bradley_terry_loss(c, rj, margin=data.draw(st.floats(0, 10)), center_coef=0.01)
    dpo, dpo_stats = dpo_loss(c, rj, rc, rr, beta=data.draw(st.floats(0.01, 1.0)))
    assert finite(bt, dpo, *bt_stats.values(), *dpo_stats.values())
    assert bt >= 0 and dpo >= 0


# --------------------------------------------------------------------------- rewards and advantages


def naive_gae(rewards, values, mask, gamma, lam):
    """Per-row loop over the valid prefix only: the definition, nothing clever."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        n = int(mask[i].sum())
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[i, t + 1] if t + 1 < n else 0.0
            running = rewards[i, t] + gamma * next_v - values[i, t] + gamma * lam * running
            adv[i, t] = running
    return adv, (adv + values) * mask


@pytest.mark.accel_twice
@PROPS
@given(st.data())
def test_gae_matches_the_definition_and_ignores_padding(data):
    b, r = data.draw(shape())
    mask = data.draw(response_mask(b, r))
    rewards, values = tensor(data.draw, b, r), tensor(data.draw, b, r)
    gamma, lam = data.draw(st.floats(0, 1)), data.draw(st.floats(0, 1))
    adv, ret = gae(soil(rewards, mask, data.draw), soil(values, mask, data.draw), mask, gamma, lam)
    assert finite(adv, ret)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, gamma, lam)
    close(adv, ref_adv, tol=1e-6)
    close(ret, ref_ret, tol=1e-6)
    # appending k padded columns (garbage, mask 0) leaves the valid part as it was
    k = data.draw(st.integers(1, 4))
    fill = data.draw(NASTY)
    adv2, ret2 = gae(pad_cols(rewards, k, fill), pad_cols(values, k, fill), pad_cols(mask, k, 0), gamma, lam)
    close(adv2[:, :r], adv, tol=1e-12)
    close(ret2[:, :r], ret, tol=1e-12)
    assert bool((adv2[:, r:] == 0).all()) and bool((ret2[:, r:] == 0).all())


@pytest.mark.accel_twice
@PROPS
@given(st.data())
def test_appending_padding_changes_no_masked_result(data):
    b, r = data.draw(shape())
    mask = data.draw(response_mask(b, r))
    x = tensor(data.draw, b, r)
    k, fill = data.draw(st.integers(1, 4)), data.draw(NASTY)
    xp, mp = pad_cols(x, k, fill), pad_cols(mask, k, 0)
    close(masked_mean(xp, mp), masked_mean(x, mask), tol=1e-12)
    close(masked_var(xp, mp), masked_var(x, mask), tol=1e-12)
    close(masked_whiten(xp, mp)[:, :r], masked_whiten(x, mask), tol=1e-12)
    close(masked_mean(xp, mp, dim=-1), masked_mean(x, mask, dim=-1), tol=1e-12)
    close(explained_variance(xp, pad_cols(x.flip(0), k, fill), mp), explained_variance(x, x.flip(0), mask), tol=1e-9)
    score, coef = torch.tensor(data.draw(st.lists(FINITE, min_size=b, max_size=b)), dtype=x.dtype), 0.1
    rew = shaped_rewards(score, x, mask, coef, score_clip=5.0)
    close(shaped_rewards(score, xp, mp, coef, score_clip=5.0)[:, :r], rew, tol=1e-12)
    # the whole score lands once per row, the KL penalty on every valid token
    close(rew.sum(-1), score.clamp(-5, 5) - coef * masked_sum(x, mask, dim=-1), tol=1e-9)


@PROPS
@given(st.data())
def test_group_baselines_sum_to_zero_and_ignore_a_group_shift(data):
    g = data.draw(st.integers(2, 6))
    n_groups = data.draw(st.integers(1, 4))
    scores = torch.tensor(data.draw(st.lists(FINITE, min_size=g * n_groups, max_size=g * n_groups)),
                          dtype=torch.float64)
    shift = torch.tensor(data.draw(st.lists(FINITE, min_size=n_groups, max_size=n_groups)),
                         dtype=torch.float64).repeat_interleave(g)
    for adv_fn in (lambda s: group_advantages(s, g, scale=True), lambda s: group_advantages(s, g, scale=False),
                   lambda s: rloo_advantages(s, g)):
        adv = adv_fn(scores)
        assert finite(adv)
        close(adv.view(-1, g).sum(-1), torch.zeros(n_groups), tol=1e-7)
        close(adv_fn(scores + shift), adv, tol=1e-6)
    # a z-score with the unbiased std is at most (G - 1) / sqrt(G) in size
    assert bool((group_advantages(scores, g).abs() <= (g - 1) / math.sqrt(g) + 1e-9).all())
    # RLOO: each sample minus the mean of the *other* samples of its group
    grouped = scores.view(-1, g)
    others = torch.stack([torch.cat([row[:i], row[i + 1:]]).mean() for row in grouped for i in range(g)])
    close(rloo_advantages(scores, g), scores - others, tol=1e-9)


@PROPS
@given(st.floats(1e-4, 10), st.floats(-1e6, 1e6) | NASTY, st.floats(1e-3, 10), st.integers(1, 10**5),
       st.integers(1, 512))
def test_adaptive_kl_coef_moves_by_at_most_the_clipped_step(coef, observed, target, horizon, n):
    new = adaptive_kl_coef(coef, observed, target, horizon, n)
    assert math.isfinite(new)
    assert abs(new / coef - 1) <= 0.2 * n / horizon + 1e-12
