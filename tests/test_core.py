"""Tests for rlhfkit.core: hand-computed values, naive references, edge cases, gradchecks."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from rlhfkit.core import (
    AGGREGATIONS,
    SurrogateOptions,
    adaptive_kl_coef,
    aggregate,
    aggregation_count,
    bradley_terry_loss,
    entropy_from_logits,
    explained_variance,
    gae,
    kl_estimate,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    shaped_rewards,
    value_loss,
)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol
    )


def ragged_mask(b: int, r: int, gen: torch.Generator) -> torch.Tensor:
    """1 up to a random length >= 1, then 0 (the shape of a response_mask after EOS)."""
    lengths = torch.randint(1, r + 1, (b,), generator=gen)
    return (torch.arange(r)[None, :] < lengths[:, None]).long()


def neg_log_sigmoid(x: float) -> float:
    return -math.log(1.0 / (1.0 + math.exp(-x)))


# --------------------------------------------------------------------------- hand-computed values


def test_gae_hand_computed():
    # gamma=0.9, lam=0.8 -> gamma*lam = 0.72. Row 0 fully valid, row 1 has mask [1,1,0].
    # row 0: d2 = 2 + 0 - 1.5 = 0.5                A2 = 0.5
    #        d1 = 0 + 0.9*1.5 - 1.0 = 0.35         A1 = 0.35 + 0.72*0.5 = 0.71
    #        d0 = 1 + 0.9*1.0 - 0.5 = 1.4          A0 = 1.4 + 0.72*0.71 = 1.9112
    # row 1: V past EOS is 0, so the 99 is ignored:
    #        d1 = 0 + 0.9*0 - 1.0 = -1.0           A1 = -1.0
    #        d0 = 1.4                              A0 = 1.4 + 0.72*(-1.0) = 0.68
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 0.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[1.9112, 0.71, 0.5], [0.68, -1.0, 0.0]])
    close(ret, [[1.9112 + 0.5, 0.71 + 1.0, 0.5 + 1.5], [0.68 + 0.5, -1.0 + 1.0, 0.0]])


def test_shaped_rewards_hand_computed():
    # kl_coef=0.5, kl=[0.1,0.2,0.3] -> penalties [-0.05,-0.1,-0.15].
    # row 0: mask [1,1,0], score 5 clipped to 2 lands on col 1: [-0.05, -0.1+2, 0]
    # row 1: mask [1,1,1], score -3 clipped to -2 lands on col 2: [-0.05, -0.1, -0.15-2]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    score = torch.tensor([5.0, -3.0], dtype=torch.float64)
    close(
        shaped_rewards(score, kl, mask, kl_coef=0.5, score_clip=2.0),
        [[-0.05, 1.9, 0.0], [-0.05, -0.1, -2.15]],
    )
    # without clipping the raw score lands: 5 - 0.1 = 4.9, -3 - 0.15 = -3.15
    close(shaped_rewards(score, kl, mask, kl_coef=0.5), [[-0.05, 4.9, 0.0], [-0.05, -0.1, -3.15]])


def test_last_token_index():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    assert last_token_index(mask).tolist() == [1, 0, 2]


def test_policy_loss_hand_computed():
    # eps = 0.2, clip range [0.8, 1.2]; per token max(-A*r, -A*clip(r)):
    # t0: r=1.5, A=+1 -> max(-1.5, -1.2) = -1.2   clipped active
    # t1: r=0.5, A=+1 -> max(-0.5, -0.8) = -0.5   unclipped (pessimistic side)
    # t2: r=0.5, A=-2 -> max( 1.0,  1.6) =  1.6   clipped active
    # t3: r=1.0, A=+3 -> max(-3.0, -3.0) = -3.0   tie, not counted as clipped
    # t4: masked out (huge ratio must not matter)
    # loss = (-1.2 - 0.5 + 1.6 - 3.0) / 4 = -0.775, clipfrac = 2/4
    ratios = [1.5, 0.5, 0.5, 1.0, 50.0]
    old = torch.full((1, 5), -1.0, dtype=torch.float64)
    new = old + torch.log(torch.tensor([ratios], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -2.0, 3.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = policy_loss(new, old, adv, mask, clip_range=0.2)
    close(loss, -0.775)
    close(stats["policy/loss"], -0.775)
    close(stats["policy/clipfrac"], 0.5)
    close(stats["policy/ratio_mean"], (1.5 + 0.5 + 0.5 + 1.0) / 4)
    # k3 of KL(old||new): mean((r - 1) - log r) over the 4 valid tokens
    k3 = [(r - 1) - math.log(r) for r in ratios[:4]]
    close(stats["policy/approx_kl"], sum(k3) / 4)


@pytest.mark.accel_twice
def test_policy_loss_ratio_one():
    # new == old: ratio 1 everywhere, nothing clipped, loss is just -mean(A)
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = ragged_mask(4, 7, gen)
    loss, stats = policy_loss(lp, lp.clone(), adv, mask)
    assert stats["policy/approx_kl"].item() == 0.0
    assert stats["policy/clipfrac"].item() == 0.0
    close(loss, -masked_mean(adv, mask))


def test_value_loss_hand_computed():
    # eps = 0.2; v_clip = old + clamp(v - old, -0.2, 0.2)
    # t0: v=1.0, old=0.5, R=2.0: err=1.0,  v_clip=0.7, err_clip=1.69 -> 1.69 (clip active)
    # t1: v=0.5, old=0.4, R=0.0: err=0.25, v_clip=0.5 (inside), tie   -> 0.25
    # t2: v=0.0, old=1.0, R=0.5: err=0.25, v_clip=0.8, err_clip=0.09 -> 0.25 (not active)
    # loss = 0.5 * (1.69 + 0.25 + 0.25) / 3 = 0.365, clipfrac = 1/3
    v = torch.tensor([[1.0, 0.5, 0.0, 9.0]], dtype=torch.float64)
    old = torch.tensor([[0.5, 0.4, 1.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[2.0, 0.0, 0.5, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(v, old, ret, mask, clip_range=0.2)
    close(loss, 0.365)
    close(stats["value/clipfrac"], 1 / 3)
    # unclipped: 0.5 * (1.0 + 0.25 + 0.25) / 3 = 0.25
    loss, stats = value_loss(v, old, ret, mask, clip_range=None)
    close(loss, 0.25)
    close(stats["value/clipfrac"], 0.0)


def test_bradley_terry_hand_computed():
    # delta = chosen - rejected = [1.0, -0.5]; loss = mean(-log sigmoid(delta - margin))
    chosen = torch.tensor([2.0, 0.0], dtype=torch.float64)
    rejected = torch.tensor([1.0, 0.5], dtype=torch.float64)
    loss, stats = bradley_terry_loss(chosen, rejected)
    close(loss, (neg_log_sigmoid(1.0) + neg_log_sigmoid(-0.5)) / 2)
    close(stats["rm/accuracy"], 0.5)
    close(stats["rm/delta"], 0.25)
    # margin 0.5 -> targets [0.5, -1.0]; accuracy still judged on the raw delta
    loss, stats = bradley_terry_loss(chosen, rejected, margin=0.5)
    close(loss, (neg_log_sigmoid(0.5) + neg_log_sigmoid(-1.0)) / 2)
    close(stats["rm/accuracy"], 0.5)
    # per-pair tensor margin [0.0, 1.0] -> targets [1.0, -1.5]
    loss, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.0, 1.0], dtype=torch.float64))
    close(loss, (neg_log_sigmoid(1.0) + neg_log_sigmoid(-1.5)) / 2)


def test_adaptive_kl_coef():
    # n_steps/horizon = 256/10000 = 0.0256
    # observed 6.6, target 6: e = 0.1          -> 0.1 * (1 + 0.1*0.0256) = 0.100256
    # observed 3:             e = -0.5 -> -0.2 -> 0.1 * (1 - 0.2*0.0256) = 0.099488
    # observed 60:            e = 9 -> 0.2     -> 0.1 * (1 + 0.2*0.0256) = 0.100512
    kw = dict(target=6.0, horizon=10000, n_steps=256)
    assert adaptive_kl_coef(0.1, 6.6, **kw) == pytest.approx(0.100256)
    assert adaptive_kl_coef(0.1, 3.0, **kw) == pytest.approx(0.099488)
    assert adaptive_kl_coef(0.1, 60.0, **kw) == pytest.approx(0.100512)
    assert adaptive_kl_coef(0.1, 6.0, **kw) == pytest.approx(0.1)
    assert adaptive_kl_coef(0.1, float("nan"), **kw) == 0.1  # a bad batch must not poison beta


def test_explained_variance():
    gen = torch.Generator().manual_seed(1)
    ret = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = ragged_mask(3, 5, gen)
    mask[0] = 1  # at least 5 valid tokens so Var[returns] > 0
    close(explained_variance(ret, ret, mask), 1.0)  # perfect critic
    close(explained_variance(torch.zeros_like(ret), ret, mask), 0.0)  # Var[R - 0] / Var[R]
    close(explained_variance(ret, torch.ones_like(ret), mask), 0.0)  # constant returns: 0, not NaN


# --------------------------------------------------------------------------- naive references


def test_gae_matches_double_loop():
    gen = torch.Generator().manual_seed(2)
    B, R, gamma, lam = 4, 7, 0.97, 0.9
    rewards = torch.randn(B, R, generator=gen, dtype=torch.float64)
    values = torch.randn(B, R, generator=gen, dtype=torch.float64)
    mask = ragged_mask(B, R, gen)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        n = int(mask[b].sum())
        a = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0  # episode ends at EOS
            a = rewards[b, t].item() + gamma * next_v - values[b, t].item() + gamma * lam * a
            ref_adv[b, t] = a
    close(adv, ref_adv, tol=1e-10)
    close(ret, (ref_adv + values) * mask, tol=1e-10)


def test_logprobs_and_entropy_match_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, 11, generator=gen) * 3
    tokens = torch.randint(0, 11, (5, 6), generator=gen)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    close(logprobs_from_logits(logits, tokens), ref, tol=1e-5)
    with torch.no_grad():  # chunked path (5 rows in chunks of 2: uneven last chunk)
        close(logprobs_from_logits(logits, tokens, chunk_size=2), ref, tol=1e-5)
    p = torch.softmax(logits, -1)
    close(entropy_from_logits(logits), -(p * torch.log(p)).sum(-1), tol=1e-5)
    # low precision is upcast to float32; float64 is not downcast
    assert logprobs_from_logits(logits.bfloat16(), tokens).dtype == torch.float32
    assert entropy_from_logits(logits.double()).dtype == torch.float64
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, tokens[:, :-1])


@pytest.mark.accel_twice
def test_masked_mean_and_var_match_selected_elements():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = ragged_mask(4, 7, gen)
    mask[0] = 1  # >= 2 valid elements for an unbiased variance
    sel = x[mask.bool()]
    close(masked_mean(x, mask), sel.mean())
    close(masked_var(x, mask), torch.var(sel, unbiased=True))
    close(masked_var(x, mask, unbiased=False), torch.var(sel, unbiased=False))
    rows = torch.stack([x[b, mask[b].bool()].mean() for b in range(4)])
    close(masked_mean(x, mask, dim=1), rows)


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimator_formulas():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    close(kl_estimate(lp, ref, "k1"), lp - ref)
    close(kl_estimate(lp, ref, "k2"), 0.5 * (ref - lp) ** 2)
    log_r = ref - lp
    close(kl_estimate(lp, ref, "k3"), torch.exp(log_r) - 1 - log_r)
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


def test_kl_estimators_are_unbiased_on_samples():
    # sample from pi; E[k1] = E[k3] = KL(pi || ref) and k3 >= 0 per sample
    gen = torch.Generator().manual_seed(5)
    logp_all = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), -1)
    logq_all = torch.log_softmax(torch.randn(10, generator=gen, dtype=torch.float64), -1)
    true_kl = (logp_all.exp() * (logp_all - logq_all)).sum().item()
    x = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=gen)
    lp, lq = logp_all[x], logq_all[x]
    k3 = kl_estimate(lp, lq, "k3")
    assert (k3 >= 0).all()
    assert kl_estimate(lp, lq, "k1").mean().item() == pytest.approx(true_kl, rel=0.05)
    assert k3.mean().item() == pytest.approx(true_kl, rel=0.05)


# --------------------------------------------------------------------------- edge cases


@pytest.mark.accel_twice
def test_empty_mask_raises():
    x = torch.randn(2, 3)
    empty = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        masked_mean(x, empty)
    with pytest.raises(ValueError):
        masked_whiten(x, empty)
    one_empty_row = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError):
        masked_mean(x, one_empty_row, dim=1)  # any empty slice is an error
    with pytest.raises(ValueError):
        last_token_index(one_empty_row)
    with pytest.raises(ValueError):
        shaped_rewards(torch.ones(2), x, one_empty_row, kl_coef=0.1)
    with pytest.raises(ValueError):
        masked_mean(x, torch.ones(3, 2))  # shape mismatch


def test_single_valid_token_whiten_is_zero():
    x = torch.tensor([[3.0, float("nan"), 7.0]])
    mask = torch.tensor([[1, 0, 0]])
    out = masked_whiten(x, mask)
    assert torch.isfinite(out).all()
    close(out, [[0.0, 0.0, 0.0]])
    close(masked_var(x, mask), 0.0)


@pytest.mark.accel_twice
def test_masked_whiten_mean_zero_std_one():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 5 + 3
    mask = ragged_mask(4, 7, gen)
    mask[0] = 1
    out = masked_whiten(x, mask)
    sel = out[mask.bool()]
    close(sel.mean(), 0.0, tol=1e-7)
    close(sel.std(unbiased=True), 1.0, tol=1e-7)
    assert (out[~mask.bool()] == 0).all()  # padding is zeroed, not stale
    # shift_mean=False only rescales: the mean is kept
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    close(kept.mean(), x[mask.bool()].mean(), tol=1e-7)


@pytest.mark.accel_twice
def test_masked_positions_cannot_leak():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), -float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    close(masked_var(x, mask), 1.0)  # var of [1,2,3], unbiased
    assert torch.isfinite(masked_whiten(x, mask)).all()


# --------------------------------------------------------------------------- gradients (float64)


def test_gradcheck_policy_loss():
    # log-ratios chosen away from the clip boundaries log(0.8), log(1.2): inside (+-0.05)
    # or far outside (+-0.7), where the clipped branch is either active or not
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[0.05, -0.05, 0.7, -0.7, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -0.5, 2.0, -1.0, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    lp = (old + log_ratio).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: policy_loss(x, old, adv, mask)[0], (lp,))


def test_gradcheck_value_loss():
    # v - old is inside the clip (+-0.1) or far outside (+-0.8), never near ties of the max
    old = torch.tensor([[0.0, 1.0, 0.5, -0.5, 2.0]], dtype=torch.float64)
    v = (old + torch.tensor([[0.1, -0.1, 0.8, -0.8, 0.0]], dtype=torch.float64)).requires_grad_()
    ret = torch.tensor([[1.0, 0.0, 3.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, ret, mask)[0], (v,))


def test_gradcheck_bradley_terry():
    gen = torch.Generator().manual_seed(7)
    c = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    m = torch.rand(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, mg: bradley_terry_loss(a, b, mg)[0], (c, r, m))


def test_gradcheck_logprobs_and_entropy():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, tokens), (logits,))
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


# --------------------------------------------------------------------------- import hygiene


def test_core_imports_only_torch():
    """A fresh interpreter that imports rlhfkit.core loads no other rlhfkit module (not the ops
    seam, not accel) and none of transformers, accelerate or peft: the math reads alone."""
    code = ("import sys, rlhfkit.core\n"
            "print(*sorted(m for m in sys.modules if m.split('.')[0] in "
            "('rlhfkit', 'transformers', 'accelerate', 'peft')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = out.stdout.split()
    assert [m for m in loaded if m != "rlhfkit" and m.split(".")[:2] != ["rlhfkit", "core"]] == []
    assert "rlhfkit.core" in loaded


# --------------------------------------------------------------------------- group baselines and DPO


def test_group_advantages_match_a_per_group_loop():
    from rlhfkit.core import group_advantages

    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(12, generator=gen, dtype=torch.float64)
    G = 4
    expected = []
    for g in range(0, 12, G):  # the plain loop: centre and scale each prompt's group alone
        grp = scores[g : g + G].tolist()
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        expected += [(x - mean) / (std + 1e-4) for x in grp]
    close(group_advantages(scores, G), expected, tol=1e-9)
    # unscaled: only centred; a group of equal scores gives 0 (no signal, no NaN)
    close(group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, scale=False), [-1.0, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        group_advantages(scores, 5)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_an_unscored_completion_is_left_out_of_its_group_as_if_it_were_not_there(scale):
    """NaN: a completion no reward scored (TRL: nanmean / nanstd over the scored ones). Its group's
    scored rows get the advantages of a group without it; its own advantage is NaN (zeroed by the
    caller); a group with one scored completion has no spread (zero-std) and a NaN std."""
    from rlhfkit.core import group_advantages, rloo_advantages, zero_std_groups

    nan = float("nan")
    scores = torch.tensor([1.0, nan, 3.0, 5.0, 2.0, 7.0, nan, nan], dtype=torch.float64)
    for fn in (group_advantages, rloo_advantages):
        got = fn(scores, 4, scale)
        close(got[[0, 2, 3]], fn(torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64), 3, scale), tol=1e-12)
        close(got[[4, 5]], fn(torch.tensor([2.0, 7.0], dtype=torch.float64), 2, scale), tol=1e-12)
        assert got[[1, 6, 7]].isnan().all()
    assert zero_std_groups(torch.tensor([1.0, nan, 1.0, nan, 2.0, nan, nan, nan]), 4).tolist() == [True, True]
    assert zero_std_groups(torch.tensor([nan, nan, nan, nan, 1.0, 2.0, nan, nan]), 4).tolist() == [True, False]


def test_zero_std_groups_hand_computed():
    from rlhfkit.core import group_advantages, rloo_advantages, zero_std_groups

    # groups of 3: [1, 1, 1] all equal; [0, 1, 0] spread 1; the same three float32 parts summed in two
    # orders, (0.1 + 0.2) + 1/3 and (1/3 + 0.2) + 0.1, differ by one ulp (6e-8): equal up to rounding;
    # [50, 50, 50.001] spread 1e-3 > 1e-6 * 50
    f = [torch.tensor(v) for v in (0.1, 0.2, 1 / 3)]
    one_way, other_way = (f[0] + f[1]) + f[2], (f[2] + f[1]) + f[0]
    assert one_way != other_way
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, one_way, other_way, one_way, 50.0, 50.0, 50.001])
    assert zero_std_groups(scores, 3).tolist() == [True, False, True, False]
    # what "zero std" means for the estimators: those groups' mean-centred advantages vanish
    for adv in (group_advantages(scores, 3, "none"), rloo_advantages(scores, 3)):
        grouped = adv.view(-1, 3).abs().max(-1).values
        assert (grouped[[0, 2]] < 1e-6).all() and (grouped[[1, 3]] > 1e-4).all()
    assert zero_std_groups(torch.tensor([2.0, 2.0, 2.0, -2.0]), 2).tolist() == [True, False]
    with pytest.raises(ValueError):
        zero_std_groups(scores, 5)


def test_group_mean_se_hand_computed():
    from rlhfkit.core import group_mean_se

    # EOS flags of three prompts' groups of 4: group means 0.5, 1, 0 (mean 0.5), their unbiased
    # variance (0 + 0.25 + 0.25) / 2 = 0.25, over 3 groups: se = sqrt(0.25 / 3)
    x = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    close(group_mean_se(x, 4), math.sqrt(0.25 / 3))
    # groups of 1: the sample standard error, 12 * 0.25 / 11 / 12 (the binomial 0.25 / 12, times 12 / 11)
    close(group_mean_se(x, 1), math.sqrt(0.25 / 11))
    # a batch of runs [2, B], and one group: no spread to measure
    close(group_mean_se(torch.stack([x, 1 - x]), 4), [math.sqrt(0.25 / 3)] * 2)
    assert math.isnan(float(group_mean_se(x, 12)))


def test_rloo_advantages_hand_computed():
    from rlhfkit.core import rloo_advantages

    # group [1, 2, 6]: baselines are means of the others: (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    # -> advantages 1-4=-3, 2-3.5=-1.5, 6-1.5=4.5; second group [0, 0, 3]: 0-1.5, 0-1.5, 3-0
    close(rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0]), 3), [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])


def test_batch_scaling_divides_by_the_batch_std_and_drops_the_reward_units():
    from rlhfkit.core import group_advantages, reinforce_advantages, rloo_advantages, scale_advantages

    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    # mean 2, squared deviations 1, 0, 16, 4, 4, 1 -> unbiased variance 26/5, std sqrt(5.2)
    std = math.sqrt(26 / 5)
    close(group_advantages(scores, 3, "batch"), [(x - m) / (std + 1e-4) for x, m in
                                                 zip(scores.tolist(), [3.0] * 3 + [1.0] * 3)], tol=1e-12)
    close(rloo_advantages(scores, 3, "batch"), [a / (std + 1e-4) for a in (-3.0, -1.5, 4.5, -1.5, -1.5, 3.0)],
          tol=1e-12)
    close(reinforce_advantages(scores, "batch"), [(x - 2.0) / (std + 1e-4) for x in scores.tolist()], tol=1e-12)
    # the same advantages for a reward in other units (x 1000 + 7), up to eps; "none" keeps the units
    for fn in (lambda s, k: group_advantages(s, 3, k), lambda s, k: rloo_advantages(s, 3, k), reinforce_advantages):
        close(fn(1000 * scores + 7, "batch"), fn(scores, "batch"), tol=1e-4)
        close(fn(1000 * scores + 7, "none"), 1000 * fn(scores, "none"), tol=1e-9)
    # "group" divides each group by its own std: RLOO's leave-one-out scaled like GRPO's
    close(rloo_advantages(scores, 3, "group"), 1.5 * group_advantages(scores, 3, "group"), tol=1e-12)
    with pytest.raises(ValueError, match="no groups"):
        reinforce_advantages(scores, "group")
    with pytest.raises(ValueError, match="'group', 'batch', 'advantages' or 'none'"):
        scale_advantages(scores, scores, 3, "batchwise")


def test_advantage_scaling_normalises_the_advantages_not_the_scores():
    """scale_rewards=advantages (TRL's RLOO normalize_advantages): (A - mean A) / std A, against
    'batch' which divides by the raw scores' std."""
    from rlhfkit.config import load_config
    from rlhfkit.core import group_advantages, reinforce_advantages, rloo_advantages

    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    # RLOO advantages -3, -1.5, 4.5, -1.5, -1.5, 3: mean 0, squares 9 + 2.25 + 20.25 + 2.25 + 2.25 + 9
    # = 45, unbiased variance 45/5 = 9, std 3 -> -1, -0.5, 1.5, -0.5, -0.5, 1
    close(rloo_advantages(scores, 3, "advantages"), [a / (1 + 1e-4 / 3) for a in (-1, -0.5, 1.5, -0.5, -0.5, 1)],
          tol=1e-12)
    # 'batch' divides by std(scores) = sqrt(26/5) = 2.280: -3 / 2.280 = -1.316, not -1
    assert abs(rloo_advantages(scores, 3, "batch")[0].item() + 3 / math.sqrt(5.2)) < 1e-4
    # GRPO: deviations from the group means -2, -1, 3, -1, -1, 2 (squares sum 20, std 2)
    close(group_advantages(scores, 3, "advantages"), [d / (2 + 1e-4) for d in (-2, -1, 3, -1, -1, 2)], tol=1e-12)
    # a batch mean that is not 0 is removed: advantages 1, 1, 4 (mean 2, std sqrt(3))
    from rlhfkit.core import scale_advantages

    close(scale_advantages(torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64), torch.zeros(3), 3, "advantages"),
          [x / (math.sqrt(3) + 1e-4) for x in (-1, -1, 2)], tol=1e-12)
    # reinforce: the centred scores' std is the scores' std, so the two agree
    close(reinforce_advantages(scores, "advantages"), reinforce_advantages(scores, "batch"), tol=1e-12)
    assert load_config(None, ["ppo.algo=rloo", "ppo.scale_rewards=advantages"]).ppo.scale_rewards == "advantages"


def test_scale_rewards_reads_the_old_booleans_and_refuses_groups_for_reinforce():
    from rlhfkit.config import ConfigError, PPOConfig, load_config

    assert load_config(None, ["ppo.scale_rewards=false"]).ppo.scale_rewards == "none"
    assert load_config(None, ["ppo.scale_rewards=true"]).ppo.scale_rewards == "group"
    assert PPOConfig().scale_rewards == "batch"
    with pytest.raises(ConfigError, match="reinforce: its baseline is the batch mean"):
        PPOConfig(algo="reinforce", scale_rewards="group")


def test_dpo_loss_hand_computed():
    from rlhfkit.core import dpo_loss

    # beta=0.5; pair 1: chosen reward 0.5*(-1-(-2))=0.5, rejected 0.5*(-3-(-2))=-0.5, h=1
    #           pair 2: chosen 0.5*(-2-(-1))=-0.5, rejected 0.5*(-1-(-1))=0,  h=-0.5
    loss, stats = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]),
                           torch.tensor([-2.0, -1.0]), torch.tensor([-2.0, -1.0]), beta=0.5)
    nll = lambda h: -math.log(1 / (1 + math.exp(-h)))  # noqa: E731
    close(loss, (nll(1.0) + nll(-0.5)) / 2)
    close(stats["dpo/accuracy"], 0.5)
    close(stats["dpo/margin"], (1.0 - 0.5) / 2)


def test_ipo_loss_hand_computed():
    from rlhfkit.core import ipo_loss

    # beta=0.25: target gap 1/(2*0.25) = 2
    # pair 1: h = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2   -> (2 - 2)^2 = 0
    # pair 2: h = (-2 - -1) - (-1 - -1) = -1 - 0 = -1    -> (-1 - 2)^2 = 9
    policy_c, policy_r = torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-3.0, -1.0])
    loss, stats = ipo_loss(policy_c, policy_r, torch.tensor([-2.0, -1.0]), torch.tensor([-2.0, -1.0]), beta=0.25)
    close(loss, (0.0 + 9.0) / 2)
    # implicit rewards beta * (log pi - log ref): chosen 0.25, -0.25; rejected -0.25, 0
    close(stats["dpo/chosen"], 0.0)
    close(stats["dpo/rejected"], -0.125)
    close(stats["dpo/accuracy"], 0.5)
    close(stats["dpo/margin"], (0.5 - 0.25) / 2)
    close(stats["dpo/loss"], 4.5)
    # d loss / d policy_chosen = 2 (h - 2) / B: 0 for the pair already at the target, -3 for the other
    loss.backward()
    close(policy_c.grad, [0.0, -3.0])
    # a gap beyond the target is pulled back (the sigmoid loss would keep pushing it out)
    far, _ = ipo_loss(torch.tensor([10.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), beta=0.25)
    close(far, (10.0 - 2.0) ** 2)


def test_ipo_over_per_token_means_as_trl():
    """dpo.loss=ipo (TRL's loss_type='ipo'): each log-prob divided by its response's length before
    the gap; the summed form (ipo_sum) of the same numbers gives another loss."""
    from rlhfkit.core import ipo_loss

    # pair: chosen 4 tokens, policy -6 / ref -8 -> means -1.5 / -2; rejected 2 tokens, policy -5 / ref -4
    # -> means -2.5 / -2. h = (-1.5 + 2) - (-2.5 + 2) = 0.5 + 0.5 = 1; beta 0.5: target 1 -> loss 0
    # second pair: chosen 2 tokens -2 / -2 (means -1 / -1), rejected 5 tokens -10 / -5 (-2 / -1):
    # h = 0 - (-1) = 1 -> loss 0 too; summed instead: h = 0 - (-5) = 5 -> (5 - 1)^2 = 16
    args = (torch.tensor([-6.0, -2.0]), torch.tensor([-5.0, -10.0]), torch.tensor([-8.0, -2.0]),
            torch.tensor([-4.0, -5.0]))
    lengths = (torch.tensor([4.0, 2.0]), torch.tensor([2.0, 5.0]))
    loss, stats = ipo_loss(*args, 0.5, *lengths)
    close(loss, 0.0)
    # first pair: h_sum = 2 - (-1) = 3 -> (3 - 1)^2 = 4; second 16: mean 10
    close(ipo_loss(*args, 0.5)[0], 10.0)
    # implicit rewards over the means, as TRL: chosen 0.5 * 0.5 = 0.25 and 0; rejected 0.5 * -0.5, 0.5 * -1
    close(stats["dpo/chosen"], 0.125)
    close(stats["dpo/rejected"], (-0.25 - 0.5) / 2)
    # one example: per-token h 0.4 vs 2.1 summed, beta 0.1 (target 5): (0.4-5)^2 = 21.16 vs (2.1-5)^2 = 8.41
    one = (torch.tensor([-3.0]), torch.tensor([-6.0]), torch.tensor([-4.0]), torch.tensor([-4.9]))
    close(ipo_loss(*one, 0.1, torch.tensor([5.0]), torch.tensor([5.0]))[0], (2.1 / 5 - 5) ** 2)
    close(ipo_loss(*one, 0.1)[0], (2.1 - 5) ** 2)
    with pytest.raises(ValueError, match="both"):
        ipo_loss(*one, 0.1, torch.tensor([5.0]))


# --------------------------------------------------------------------------- loss aggregation (ppo.loss_type)

NAN = float("nan")
# three responses of 3, 1 and 2 tokens; the padded slots hold NaN, which must reach nothing
AGG_X = [[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [5.0, 6.0, NAN, NAN]]
AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("kind, value, grads", [
    # token mean: (1+2+3+4+5+6) / 6 = 3.5; every token weighs 1/6
    ("token_mean", 3.5, [1 / 6] * 3),
    ("bnpo", 3.5, [1 / 6] * 3),
    ("dapo", 3.5, [1 / 6] * 3),
    # per-sequence means 2, 4, 5.5 -> mean 11.5/3; a token of row i weighs 1 / (3 * len_i)
    ("grpo", 11.5 / 3, [1 / 9, 1 / 3, 1 / 6]),
    # 21 / (3 rows * max_len 5) = 1.4; every token weighs 1/15
    ("dr_grpo", 1.4, [1 / 15] * 3),
])
def test_aggregations_hand_computed(kind, value, grads):
    x = torch.tensor(AGG_X, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(AGG_MASK)
    out = aggregate(x, mask, kind, max_len=5)
    close(out, value)
    out.backward()
    expected = torch.tensor(grads, dtype=torch.float64)[:, None] * mask  # [3, 4]: 0 on padding, no NaN
    close(x.grad, expected)


def test_aggregation_errors():
    x, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(x, mask, "dr_grpo", max_len=0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(x, mask, "seq_mean")
    with pytest.raises(ValueError, match="empty mask"):  # a token mean of nothing stays an error
        aggregate(x, torch.zeros(2, 3), "token_mean")


def _naive_aggregate(x: list, mask: list, kind: str, max_len: int) -> float:
    """Plain-Python loops: the reference the vectorised aggregations are checked against."""
    rows = [[v for v, m in zip(r, mr) if m] for r, mr in zip(x, mask)]
    if kind in ("grpo", "sapo"):  # sapo reduces as TRL's grpo
        return sum(sum(r) / max(1, len(r)) for r in rows) / len(rows)
    total = sum(sum(r) for r in rows)
    if kind == "dr_grpo":
        return total / (len(rows) * max_len)
    return total / sum(len(r) for r in rows)


@pytest.mark.parametrize("kind", list(AGGREGATIONS))
def test_aggregation_splits_into_weighted_parts(kind):
    """Any split of the rows (micro-batches, processes), each part's aggregate weighted by its
    share of aggregation_count, gives the whole; with DDP's average of W processes each weighted
    by W * count_p / count (Shard.count_weight) too. Weighting grpo or dr_grpo by tokens would not."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    mask = ragged_mask(7, 6, gen)
    whole = aggregate(x, mask, kind, max_len=6)
    close(whole, _naive_aggregate(x.tolist(), mask.tolist(), kind, 6), tol=1e-12)
    parts = [slice(0, 2), slice(2, 5), slice(5, 7)]
    n = aggregation_count(mask, kind).double()
    split = sum(aggregate(x[p], mask[p], kind, 6) * aggregation_count(mask[p], kind) / n for p in parts)
    close(split, whole, tol=1e-12)
    W = len(parts)  # as three processes: each loss times its count weight, then DDP's mean
    ddp = sum(aggregate(x[p], mask[p], kind, 6) * (W * aggregation_count(mask[p], kind) / n) for p in parts) / W
    close(ddp, whole, tol=1e-12)
    by_tokens = sum(aggregate(x[p], mask[p], kind, 6) * mask[p].sum() / mask.sum() for p in parts)
    assert (abs(float(by_tokens - whole)) > 1e-3) == (AGGREGATIONS[kind].unit == "rows")


def _trl_loss(x: torch.Tensor, mask: torch.Tensor, loss_type: str, max_len: int, accum: int) -> torch.Tensor:
    """TRL GRPOTrainer's aggregation (1.x, _compute_loss) of one optimizer step on one process,
    written from its formulas: the batch comes in ``accum`` equal micro-batches (gradient
    accumulation), each micro-batch's loss divided by ``accum`` except dapo's, which divides the
    token sum by num_items_in_batch (the generation batch's tokens; here one generation batch is
    one optimizer step, TRL's default steps_per_generation = gradient_accumulation_steps)."""
    total = x.new_zeros(())
    for xm, mm in zip(x.chunk(accum), mask.chunk(accum)):
        xm = torch.where(mm.bool(), xm, 0.0)
        if loss_type == "grpo":
            total = total + (xm.sum(-1) / mm.sum(-1).clamp(min=1)).mean() / accum
        elif loss_type == "bnpo":
            total = total + xm.sum() / mm.sum().clamp(min=1) / accum
        elif loss_type == "dr_grpo":
            total = total + xm.sum() / (xm.shape[0] * max_len) / accum
        elif loss_type == "dapo":
            total = total + xm.sum() / mask.sum()
    return total


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregations_against_trl_formulas(loss_type):
    """rlhfkit's loss_type over a minibatch equals TRL's over one optimizer step of the same rows
    whatever TRL's gradient accumulation -- except bnpo, a token mean per micro-batch in TRL,
    equal only without accumulation (one micro-batch per optimizer step and process)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    mask = ragged_mask(8, 5, gen)
    ours = aggregate(x, mask, loss_type, max_len=7)
    close(_trl_loss(x, mask, loss_type, 7, accum=1), ours, tol=1e-12)
    accumulated = _trl_loss(x, mask, loss_type, 7, accum=4)
    if loss_type == "bnpo":
        assert abs(float(accumulated - ours)) > 1e-3  # TRL's mean of micro-batch means
    else:
        close(accumulated, ours, tol=1e-12)
    close(aggregate(x, mask, "token_mean"), _trl_loss(x, mask, "dapo", 7, accum=4), tol=1e-12)


# --------------------------------------------------------------------------- sequence-level ratios (GSPO)


def test_sequence_level_policy_loss_hand_computed():
    # row 0: log-ratios 0.1, 0.2, 0.3 -> s0 = exp(0.2) = 1.2214, A = +1: max(-1.2214, -1.2) = -1.2 (clipped)
    # row 1: log-ratios -0.3, -0.1 -> s1 = exp(-0.2) = 0.8187, A = -1: max(0.8187, 0.8187) unclipped
    # token_mean: (3 * -1.2 + 2 * s1) / 5; grpo: (-1.2 + s1) / 2; the padded slot (ratio 50) counts nowhere
    s1 = math.exp(-0.2)
    old = torch.zeros(2, 4, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.2, 0.3, math.log(50)], [-0.3, -0.1, 9.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    new.requires_grad_(True)
    loss, stats = policy_loss(new, old, adv, mask, 0.2, level="sequence")
    close(loss, (3 * -1.2 + 2 * s1) / 5)
    close(stats["policy/clipfrac"], 3 / 5)  # row 0's three tokens
    close(stats["policy/ratio_mean"], (3 * math.exp(0.2) + 2 * s1) / 5)
    loss.backward()
    # row 0 clipped: no gradient; row 1: d/dlp_t (2/5 * s1) = 2/5 * s1 * 1/2 for each of its tokens
    close(new.grad, torch.tensor([[0.0] * 4, [s1 / 5, s1 / 5, 0.0, 0.0]], dtype=torch.float64))
    grpo, _ = policy_loss(new, old, adv, mask, 0.2, aggregation="grpo", level="sequence")
    close(grpo, (-1.2 + s1) / 2)
    # the token level differs: each token is clipped alone (e^0.1 is inside [0.8, 1.2], e^-0.3 = 0.74 is not)
    token, _ = policy_loss(new, old, adv, mask, 0.2)
    close(token, (-math.exp(0.1) - 1.2 - 1.2 + 0.8 + math.exp(-0.1)) / 5)


@pytest.mark.parametrize("kind", list(AGGREGATIONS))
def test_sequence_level_gradient_at_ratio_one(kind):
    """At ratio 1 with one advantage per row (GRPO), GSPO's gradient is the token-level one under
    every aggregation (each row's tokens share one weight); GSPO-token's also with per-token
    advantages, where GSPO's own is the row's mean gradient instead."""
    gen = torch.Generator().manual_seed(6)
    lp = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = ragged_mask(5, 6, gen)
    row_adv = torch.randn(5, 1, generator=gen, dtype=torch.float64).expand(5, 6)
    token_adv = torch.randn(5, 6, generator=gen, dtype=torch.float64)

    def grad(adv, level):
        x = lp.clone().requires_grad_(True)
        policy_loss(x, lp, adv, mask, 0.2, kind, 6, level)[0].backward()
        return x.grad

    close(grad(row_adv, "sequence"), grad(row_adv, "token"), tol=1e-12)
    close(grad(row_adv, "sequence_token"), grad(row_adv, "token"), tol=1e-12)
    close(grad(token_adv, "sequence_token"), grad(token_adv, "token"), tol=1e-12)
    assert (grad(token_adv, "sequence") - grad(token_adv, "token")).abs().max() > 1e-3


def test_sequence_level_gradcheck():
    gen = torch.Generator().manual_seed(7)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.05 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = ragged_mask(3, 4, gen)
    # GSPO's loss only: GSPO-token's gradient is by design not its value's (the stop-gradients)
    assert torch.autograd.gradcheck(lambda x: policy_loss(x, old, adv, mask, 0.2, "grpo", 4, "sequence")[0], (lp,))


# --------------------------------------------------------------------------- CISPO, SAPO, clip-higher (ppo.loss_type)

LN2, LN6 = math.log(2), math.log(6)


def _cispo_reference(lp: list, old: list, adv: list, mask: list, cap: float) -> tuple[float, list]:
    """MiniMax-M1's CISPO written out token by token (TRL 1.16's formula: the capped weight held
    constant, the token sum divided by the token count): (loss, d loss / d lp)."""
    n = sum(map(sum, mask))
    loss, grad = 0.0, [[0.0] * len(r) for r in lp]
    for i, row in enumerate(lp):
        for t, x in enumerate(row):
            if mask[i][t]:
                w = min(math.exp(x - old[i][t]), cap)
                loss += -w * adv[i][t] * x / n
                grad[i][t] = -w * adv[i][t] / n
    return loss, grad


def _sapo_reference(lp: list, old: list, adv: list, mask: list, tau_pos: float, tau_neg: float) -> tuple[float, list]:
    """SAPO token by token (the paper's eq. with TRL 1.16's gate 4/tau * sigmoid(tau (r - 1)), its
    grpo reduction: each row's token mean, then the mean over rows): (loss, d loss / d lp), the
    gradient by hand: d/dx f(e^(x - old)) = 4 s (1 - s) e^(x - old)."""
    loss, grad = 0.0, [[0.0] * len(r) for r in lp]
    for i, row in enumerate(lp):
        n_i = sum(mask[i])
        for t, x in enumerate(row):
            if mask[i][t]:
                r = math.exp(x - old[i][t])
                tau = tau_pos if adv[i][t] > 0 else tau_neg
                s = 1 / (1 + math.exp(-tau * (r - 1)))
                loss += -adv[i][t] * s * 4 / tau / n_i / len(lp)
                grad[i][t] = -adv[i][t] * 4 * s * (1 - s) * r / n_i / len(lp)
    return loss, grad


def test_cispo_hand_computed():
    # old log-probs 0: weights 2, 0.5, 8 -> 5 (the cap) on row 0 (A = +1); 6 -> 5, 1 on row 1 (A = -2)
    # per token -w * A * lp: -2 ln2, -0.5 * -ln2, -5 * 3 ln2 | -5 * -2 * ln6, 0 -> token mean over 5
    lp = torch.tensor([[LN2, -LN2, 3 * LN2, NAN], [LN6, 0.0, NAN, NAN]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss, stats = policy_loss(lp, old, adv, mask, 0.2, "cispo", objective="cispo", options=SurrogateOptions(cap=5.0))
    close(loss, (-2 * LN2 + 0.5 * LN2 - 15 * LN2 + 10 * LN6) / 5)
    close(stats["policy/clipfrac"], 2 / 5)  # the 8 and the 6 were capped
    loss.backward()
    # d/dlp = -w * A / 5, the weight a constant: every token keeps a gradient, the capped ones too
    close(lp.grad, [[-2 / 5, -0.1, -1.0, 0.0], [2.0, 0.4, 0.0, 0.0]])
    ref_loss, ref_grad = _cispo_reference([[LN2, -LN2, 3 * LN2], [LN6, 0.0]], [[0.0] * 3, [0.0] * 2],
                                          [[1.0] * 3, [-2.0] * 2], [[1] * 3, [1] * 2], 5.0)
    close(loss, ref_loss)
    close(lp.grad[0, :3], ref_grad[0])
    # the clipped surrogate drops the gradient of row 0's first and last tokens (ratio 2, 8 > 1.2, A > 0)
    clip_lp = lp.detach().clone().requires_grad_(True)
    policy_loss(clip_lp, old, adv, mask, 0.2)[0].backward()
    assert clip_lp.grad[0, 0] == 0.0 and clip_lp.grad[0, 2] == 0.0 and lp.grad[0, 2] != 0.0


def test_sapo_hand_computed():
    # row 0 (A = +1, tau_pos 1): ratios e^0.5, 1; row 1 (A = -1, tau_neg 2): ratio e^-0.5
    # f(r) = 4/tau * sigmoid(tau (r - 1)); loss = mean over rows of each row's token mean of -A f(r)
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    r0, r1 = math.exp(0.5), math.exp(-0.5)
    f = lambda r, tau: 4 / tau * sig(tau * (r - 1))  # noqa: E731
    lp = torch.tensor([[0.5, 0.0, NAN], [-0.5, NAN, NAN]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    opts = SurrogateOptions(temperature_pos=1.0, temperature_neg=2.0)
    loss, stats = policy_loss(lp, old, adv, mask, 0.2, "sapo", objective="sapo", options=opts)
    close(loss, ((-f(r0, 1) - f(1.0, 1)) / 2 + f(r1, 2)) / 2)
    close(f(1.0, 1), 2.0)  # sigmoid(0) * 4
    close(stats["policy/clipfrac"], 0.0)  # nothing is clipped
    gate = lambda r, tau: 4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1)))  # noqa: E731
    close(stats["policy/sapo_gate"], (gate(r0, 1) + gate(1.0, 1) + gate(r1, 2)) / 3)
    loss.backward()
    # d/dx -A f(e^x) = -A * 4 s (1 - s) * e^x; the on-policy token's is -A / (its row's 2 tokens * 2 rows)
    close(lp.grad, [[-gate(r0, 1) * r0 / 4, -0.25, 0.0], [gate(r1, 2) * r1 / 2, 0.0, 0.0]])
    ref_loss, ref_grad = _sapo_reference([[0.5, 0.0], [-0.5]], [[0.0, 0.0], [0.0]], [[1.0, 1.0], [-1.0]],
                                         [[1, 1], [1]], 1.0, 2.0)
    close(loss, ref_loss)
    close(lp.grad[0, :2], ref_grad[0])
    close(lp.grad[1, :1], ref_grad[1])


@pytest.mark.parametrize("objective", ["cispo", "sapo"])
def test_cispo_sapo_against_token_loop_references(objective):
    """Random ragged batches, off-policy ratios (some above the cap), both advantage signs: loss
    and gradient equal the token-by-token references above; padded NaNs reach neither."""
    gen = torch.Generator().manual_seed(11)
    old = torch.randn(6, 5, generator=gen, dtype=torch.float64) - 2.0
    lp = old + 0.8 * torch.randn(6, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = ragged_mask(6, 5, gen)
    x = torch.where(mask.bool(), lp, NAN).requires_grad_(True)
    opts = SurrogateOptions(cap=1.5, temperature_pos=0.7, temperature_neg=1.3)
    loss, _ = policy_loss(x, old, adv, mask, 0.2, objective, objective=objective, options=opts)
    loss.backward()
    rows = [[lp[i, t].item() for t in range(5) if mask[i, t]] for i in range(6)]
    olds = [[old[i, t].item() for t in range(5) if mask[i, t]] for i in range(6)]
    advs = [[adv[i, t].item() for t in range(5) if mask[i, t]] for i in range(6)]
    ones = [[1] * len(r) for r in rows]
    if objective == "cispo":
        assert (lp - old)[mask.bool()].exp().max() > 1.5  # the cap is met
        ref_loss, ref_grad = _cispo_reference(rows, olds, advs, ones, 1.5)
    else:
        ref_loss, ref_grad = _sapo_reference(rows, olds, advs, ones, 0.7, 1.3)
    close(loss, ref_loss, tol=1e-12)
    for i in range(6):
        n = len(rows[i])
        close(x.grad[i, :n], ref_grad[i], tol=1e-12)
        assert (x.grad[i, n:] == 0).all()


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("kind", ["grpo", "token_mean"])
def test_every_objective_has_ppos_gradient_on_policy(level, kind):
    """At ratio 1 (the first minibatch of a step) clip, cispo and sapo give one gradient, -A grad
    log pi reduced alike: they differ only off-policy (the cap, the gate, the clip)."""
    gen = torch.Generator().manual_seed(12)
    lp = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 5)
    mask = ragged_mask(4, 5, gen)

    def grad(objective):
        x = lp.clone().requires_grad_(True)
        policy_loss(x, lp, adv, mask, 0.2, kind, 5, level, objective)[0].backward()
        return x.grad

    close(grad("cispo"), grad("clip"), tol=1e-12)
    close(grad("sapo"), grad("clip"), tol=1e-12)


def test_sapo_gradcheck_and_the_gate_closing():
    gen = torch.Generator().manual_seed(13)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.3 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = ragged_mask(3, 4, gen)
    for level in ("token", "sequence"):
        assert torch.autograd.gradcheck(
            lambda x: policy_loss(x, old, adv, mask, 0.2, "sapo", 4, level, "sapo")[0], (lp,))  # noqa: B023
    # far off-policy the gate shuts smoothly: at a ratio of e^3, A = +1, it lets through less than 1%
    # of the on-policy gradient, and a larger temperature shuts it sooner
    one = torch.ones(1, 1, dtype=torch.float64)

    def g(log_ratio, tau):
        x = torch.full((1, 1), float(log_ratio), dtype=torch.float64, requires_grad=True)
        opts = SurrogateOptions(temperature_pos=tau)
        policy_loss(x, torch.zeros(1, 1, dtype=torch.float64), one, one, 0.2, objective="sapo", options=opts)[0].backward()
        return -x.grad.item() / math.exp(log_ratio)  # the gate f'(r): d/dlp = f'(r) * r

    assert g(0.0, 1.0) == pytest.approx(1.0)
    assert 0 < g(3.0, 1.0) < 0.01
    assert g(0.3, 2.0) < g(0.3, 1.0) < g(0.0, 1.0)


def test_cispo_gradient_is_the_capped_weight_times_the_score():
    """CISPO's stop-gradient: its gradient is not its value's (gradcheck would fail by design);
    it is the finite difference of the same loss with the capped weight frozen."""
    gen = torch.Generator().manual_seed(14)
    old = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    lp = (old + 0.7 * torch.randn(3, 4, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = ragged_mask(3, 4, gen)
    opts = SurrogateOptions(cap=1.3)
    policy_loss(lp, old, adv, mask, 0.2, "cispo", objective="cispo", options=opts)[0].backward()
    w = (lp.detach() - old).exp().clamp(max=1.3)

    def frozen(x):  # the weight held at its value at lp
        return -(torch.where(mask.bool(), w * adv * x, 0.0)).sum() / mask.sum()

    assert torch.autograd.gradcheck(frozen, (lp.detach().clone().requires_grad_(True),))
    x = lp.detach().clone().requires_grad_(True)
    frozen(x).backward()
    close(lp.grad, x.grad, tol=1e-12)


def test_epsilon_high_clips_the_ratio_higher():
    # ratio 1.25, A = +1: inside [0.8, 1.28] (epsilon_high 0.28): -1.25, gradient -1.25 / 2 tokens;
    # with the symmetric 0.2 it is clipped to -1.2, no gradient. ratio 0.7, A = -1: the lower clip
    # 0.8 holds either way (max(0.7, 0.8) = 0.8, no gradient)
    lp = torch.tensor([[math.log(1.25), math.log(0.7)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    for high, value, g0 in ((0.28, (-1.25 + 0.8) / 2, -1.25 / 2), (None, (-1.2 + 0.8) / 2, 0.0)):
        x = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(x, torch.zeros(1, 2, dtype=torch.float64), adv, mask, 0.2,
                                  options=SurrogateOptions(clip_high=high))
        close(loss, value)
        loss.backward()
        close(x.grad, [[g0, 0.0]])
    with pytest.raises(ValueError, match="unknown policy objective"):
        policy_loss(lp, lp, adv, mask, objective="cipso")


# --------------------------------------------------------------------------- DAPO's over-long penalty


def test_overlong_penalty_hand_computed():
    # max_len 10, buffer 4: the ramp starts after 6 tokens; DAPO eq. 13 ((10 - 4) - L) / 4, times 0.5
    from rlhfkit.core import overlong_penalty

    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    expected = [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]  # 12 > max_len: the whole penalty
    close(overlong_penalty(lengths, max_len=10, buffer=4, penalty=0.5), expected)
    dapo = [0.0 if n <= 6 else ((10 - 4) - n) / 4 if n <= 10 else -1.0 for n in lengths.tolist()]  # the paper's cases
    close(overlong_penalty(lengths, 10, 4), dapo)
    with pytest.raises(ValueError, match="buffer >= 1"):
        overlong_penalty(lengths, 10, 0)
