"""Core math of RLHF: pure functions over tensors, importing only torch.

Shape letters, fixed once for the whole package:
    B  batch            T  full sequence (prompt + response)
    R  response length  V  vocabulary           G  group size

Every experience tensor is *response-aligned*, shape ``[B, R]``: column ``j`` is the
``j``-th generated token. ``response_mask`` is 1 on response tokens up to and including
the first EOS and 0 after it (padding). All reductions here are masked; an empty mask is
an error, never a silent NaN.

Losses return ``(loss, stats)`` where ``stats`` holds detached scalar tensors named as the
metrics the trainers log (``policy/clipfrac`` ...), so trainers can log them as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "logprobs_from_logits",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_estimate",
    "kl_from_logits",
    "shaped_rewards",
    "last_token_index",
    "gae",
    "group_advantages",
    "zero_std_groups",
    "group_mean_se",
    "reinforce_advantages",
    "scale_advantages",
    "rloo_advantages",
    "overlong_penalty",
    "AGGREGATIONS",
    "aggregate",
    "aggregation_count",
    "sequence_log_ratio",
    "policy_loss",
    "token_policy_loss",
    "value_loss",
    "explained_variance",
    "bradley_terry_loss",
    "dpo_loss",
    "adaptive_kl_coef",
]


# --------------------------------------------------------------------------- log-probs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens, so left padding shifts nothing: ``[B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int = 0) -> torch.Tensor:
    """Log-probability of the chosen ``tokens`` under ``logits``.

    ``logp[b, t] = logits[b, t, tokens[b, t]] - logsumexp_v logits[b, t, v]``

    Args:
        logits: ``[B, R, V]`` unnormalised scores (any float dtype; computed in at least
            float32: half/bf16 are upcast, float64 is kept).
        tokens: ``[B, R]`` token ids, the action taken at each position.
        chunk_size: if > 0, process this many rows of ``B`` at a time (no grad only), which
            bounds the float32 temporary to ``[chunk_size, R, V]`` for big vocabularies.

    Returns:
        ``[B, R]`` float32 (float64 for float64 logits) log-probs. No ``[B, R, V]``
        log-softmax is materialised: the gather and the logsumexp read the logits directly
        (logsumexp's backward rebuilds the softmax only inside autograd, once).
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on [B, R]")
    if chunk_size and not torch.is_grad_enabled() and logits.shape[0] > chunk_size:
        return torch.cat(
            [logprobs_from_logits(lg, tk) for lg, tk in zip(logits.split(chunk_size), tokens.split(chunk_size))]
        )
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast, never downcast
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, R]
    return picked - torch.logsumexp(logits, dim=-1)  # [B, R]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``  (equal to ``-sum p log p``)

    Args:
        logits: ``[B, R, V]``.
    Returns:
        ``[B, R]`` entropies (nats), float32 or float64 as for :func:`logprobs_from_logits`.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast, never downcast
    probs = F.softmax(logits, dim=-1)  # [B, R, V]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # [B, R]


# --------------------------------------------------------------------------- masked stats


def _check_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of values {tuple(values.shape)}")
    return mask.to(values.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all dims when None). ``values`` and ``mask`` share a shape."""
    mask = _check_mask(values, mask)
    # where() rather than a product so a NaN/inf in a masked-out slot cannot leak in
    vals = torch.where(mask.bool(), values, torch.zeros_like(values))
    return vals.sum() if dim is None else vals.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1.

    ``sum(values * mask) / sum(mask)`` over ``dim`` (all dims when None).

    Raises:
        ValueError: if the mask is empty (over all dims when ``dim`` is None, or in any
            slice along ``dim``) -- a mean of nothing is undefined, not zero and not NaN.
    """
    mask = _check_mask(values, mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    if bool((count == 0).any()):
        raise ValueError(
            "masked_mean over an empty mask: no valid token to average. Check that every "
            "sequence has at least one response token (response_mask) in this batch."
        )
    return masked_sum(values, mask, dim) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is 1 (a scalar).

    ``var = sum(mask * (x - mean)^2) / (n - 1)`` when ``unbiased`` and ``n > 1``; with a
    single valid token the (biased) variance 0 is returned instead of a division by zero.

    Raises:
        ValueError: on an empty mask.
    """
    mean = masked_mean(values, mask)
    centred_sq = (values - mean) ** 2
    var = masked_mean(centred_sq, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``values`` to mean 0, std 1 over the valid positions.

    ``(x - mean) / sqrt(var + eps)``, statistics over ``mask == 1`` only. With
    ``shift_mean=False`` the mean is added back (only the scale changes). Masked-out
    positions are returned as 0 so nothing stale flows downstream.

    Args:
        values, mask: same shape, e.g. ``[B, R]``.
    Raises:
        ValueError: on an empty mask.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- KL and rewards


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    With ``log r = ref_logprobs - logprobs`` (r = pi_ref / pi at the sampled token):

    * ``k1 = -log r``           unbiased, can be negative per token
    * ``k2 = (log r)^2 / 2``    biased, >= 0, low variance
    * ``k3 = (r - 1) - log r``  unbiased, >= 0 (Schulman's estimator)

    Args:
        logprobs, ref_logprobs: ``[B, R]``.
    Returns:
        ``[B, R]`` per-token estimates (not masked: mask when reducing).
    """
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}: choose 'k1', 'k2' or 'k3'")


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) of each next-token distribution, over the whole vocabulary (no sampling):
    ``sum_v p_v (log p_v - log q_v)`` with ``p = softmax(logits)``, ``q = softmax(ref_logits)``,
    in float32 at least.

    Args:
        logits, ref_logits: ``[..., V]`` (e.g. ``[B, R, V]``).
    Returns:
        ``[...]`` per-position KL, >= 0 (not masked: mask when reducing).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = logits.to(dtype).log_softmax(-1)  # [..., V]
    logq = ref_logits.to(dtype).log_softmax(-1)  # [..., V]
    return (logp.exp() * (logp - logq)).sum(-1)  # [...]


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last valid token of each row of a ``[B, R]`` mask, as ``[B]`` long.

    Raises:
        ValueError: if a row has no valid token.
    """
    if bool((response_mask.sum(-1) == 0).any()):
        raise ValueError("a response has no valid token (its response_mask row is all zero)")
    cols = torch.arange(response_mask.shape[-1], device=response_mask.device)  # [R]
    return (cols * response_mask.long()).argmax(-1)  # [B]


def shaped_rewards(
    score: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    score_clip: float | None = None,
) -> torch.Tensor:
    """Per-token RLHF reward: a KL penalty everywhere, the score on the last token.

    ``rewards[b, t] = -kl_coef * kl[b, t]                       for valid t``
    ``rewards[b, L_b] += clip(score[b], -score_clip, score_clip)``  (L_b = last valid column,
    i.e. the EOS when one was emitted, else the last generated token)

    This is the one place that decides where the score lands.

    Args:
        score: ``[B]`` sequence-level reward (e.g. a reward model's output).
        kl: ``[B, R]`` per-token KL estimate (see :func:`kl_estimate`).
        response_mask: ``[B, R]``.
        kl_coef: beta >= 0.
        score_clip: clip the score to ``[-score_clip, score_clip]``; None for no clipping.
    Returns:
        ``[B, R]`` rewards, 0 on masked positions.
    """
    valid = response_mask.bool()
    rewards = torch.where(valid, -kl_coef * kl, torch.zeros_like(kl))  # [B, R]
    if score_clip is not None:
        score = score.clamp(-score_clip, score_clip)
    last = last_token_index(response_mask)  # [B]
    rewards = rewards.scatter_add(1, last.unsqueeze(1), score.to(rewards.dtype).unsqueeze(1))
    return rewards


# --------------------------------------------------------------------------- advantages


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (no whitening here).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``,  ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t``; ``V`` and ``A`` are taken as 0 past the last valid token,
    so an episode ends at its EOS. ``t + 1`` is the next *valid* column: masked columns
    between valid ones (a multi-turn episode's observations, rlhfkit.envs) are skipped, as if
    the model's turns were contiguous.

    Args:
        rewards, values, response_mask: ``[B, R]``.
    Returns:
        ``(advantages, returns)``, both ``[B, R]`` and 0 on masked positions.
    """
    mask = response_mask.to(values.dtype)
    valid = response_mask.bool()
    # where(), not a product: a NaN/inf parked in a padded slot must not reach valid ones
    values = torch.where(valid, values, torch.zeros_like(values))
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    R = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])  # [B]
    next_value = torch.zeros_like(values[:, 0])  # [B]
    for t in reversed(range(R)):  # R is a response length: tens of tokens, a cheap loop
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = adv
        # a masked column passes the next valid one's value and advantage on (0 after the end)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


# A NaN score is a completion that no reward scored (every reward function returned None): the
# baselines below leave it out of each mean and std, as TRL does, and give it a NaN advantage, which
# the caller turns into 0. Without a NaN they are the plain reductions, bit for bit.


def _mean(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The mean over the entries of ``x`` that are not NaN (over ``dim``, or all of them)."""
    kw = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    return x.nanmean(**kw) if bool(x.isnan().any()) else x.mean(**kw)


def _std(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased std over the entries of ``x`` that are not NaN (NaN for fewer than two)."""
    kw = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    if not bool(x.isnan().any()):
        return x.std(**kw)
    centred = x - (x.nanmean() if dim is None else x.nanmean(dim, keepdim=True))
    return (centred.square().nansum(**kw) / ((~x.isnan()).sum(**kw) - 1)).sqrt()


def scale_advantages(centred: torch.Tensor, scores: torch.Tensor, group_size: int, scale: str | bool,
                     eps: float = 1e-4) -> torch.Tensor:
    """Scale baseline-centred scores ``[B]`` by a standard deviation:

    * ``"group"`` (or True): each group's own (unbiased) std of the scores -- GRPO's paper and
      reference code. Small differences inside a group become full-size advantages, whatever
      the reward's units;
    * ``"batch"``: the std of every score in the batch, ``std(scores)`` (TRL's GRPO
      ``scale_rewards="batch"``): the advantages no longer carry the reward's units, and a group
      whose scores barely differ keeps small advantages;
    * ``"advantages"``: the centred values themselves, re-centred on their batch mean and divided
      by their own std, ``(c - mean(c)) / std(c)`` (TRL's RLOO ``normalize_advantages=True``).
      It differs from ``"batch"`` by the ratio ``std(scores) / std(c)``: a group's centring removes
      the spread between prompts (and RLOO's leave-one-out stretches each group by G / (G - 1)),
      so the two can be far apart; for reinforce (one batch-mean baseline) they are equal;
    * ``"none"`` (or False): nothing -- advantages in the reward's units (Dr. GRPO).

    ``eps`` keeps a group (or batch) of equal scores at 0 instead of 0/0. NaN entries (completions
    no reward scored) are left out of each mean and std.
    """
    scale = ("group" if scale else "none") if isinstance(scale, bool) else scale
    if scale == "none":
        return centred
    if scale == "batch":
        return centred / (_std(scores) + eps)
    if scale == "advantages":
        return (centred - _mean(centred)) / (_std(centred) + eps)
    if scale == "group":
        std = _std(scores.view(-1, group_size), -1, keepdim=True)  # [B/G, 1]
        return (centred.view(-1, group_size) / (std + eps)).reshape(-1)
    raise ValueError(f"scale must be 'group', 'batch', 'advantages' or 'none', got {scale!r}")


def _check_groups(scores: torch.Tensor, group_size: int) -> None:
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"group_size must be >= 2 and divide the batch ({scores.shape[0]}), got {group_size}")


def group_advantages(scores: torch.Tensor, group_size: int, scale: str | bool = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantage of each completion (Shao et al. 2024).

    Rows ``[g*G, (g+1)*G)`` are the ``G`` completions of prompt ``g``:
    ``A_i = s_i - mean_group(s)``, divided by the std that ``scale`` names
    (:func:`scale_advantages`; the paper's is the group's).

    Args:
        scores: ``[B]`` with ``B = n_prompts * G``, grouped contiguously; NaN: no reward scored it
            (left out of its group's mean and std; its advantage NaN).
    Returns:
        ``[B]`` advantages (0 for a group whose scores are all equal).
    """
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    centred = (grouped - _mean(grouped, -1, keepdim=True)).reshape(-1)  # [B]
    return scale_advantages(centred, scores, group_size, scale, eps)


def zero_std_groups(scores: torch.Tensor, group_size: int, rtol: float = 1e-6) -> torch.Tensor:
    """Which groups' scores are all equal (TRL's "zero std"): ``[B] -> [B/G]`` bool.

    Rows ``[g*G, (g+1)*G)`` are group ``g``. It is zero-std when
    ``max_g(s) - min_g(s) <= rtol * max(1, max_g |s|)``: equal up to float rounding, so a
    weighted sum of equal parts counts as equal. Such a group's mean-centred advantages
    (GRPO, RLOO) are all 0: it carries no policy-gradient signal. NaN scores (no reward scored
    them) are left out: a group with at most one scored completion is zero-std too.
    """
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    unscored = grouped.isnan()  # [B/G, G]
    spread = grouped.masked_fill(unscored, -math.inf).max(-1).values \
        - grouped.masked_fill(unscored, math.inf).min(-1).values  # [B/G]; -inf for a group none scored
    return spread <= rtol * grouped.masked_fill(unscored, 0.0).abs().max(-1).values.clamp(min=1.0)


def group_mean_se(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The standard error of ``x.mean(-1)`` when its rows come in groups: ``[..., B] -> [...]``.

    Rows ``[g*G, (g+1)*G)`` share a prompt (``G = group_size``; 1: no groups), so they are not
    independent draws: a prompt can decide most of its completions (whether they end with EOS,
    say). The mean is that of the ``n = B/G`` group means ``m_g``, each an independent draw, so
    ``se = sqrt(sum_g (m_g - m)^2 / ((n - 1) n))`` -- the cluster-robust standard error; for
    ``G = 1`` the sample one. NaN with fewer than two groups.
    """
    groups = x.unflatten(-1, (-1, group_size)).mean(-1)  # [..., n]
    n = groups.shape[-1]
    if n < 2:
        return torch.full(groups.shape[:-1], math.nan, dtype=groups.dtype, device=groups.device)
    return (groups.var(-1) / n).sqrt()


def rloo_advantages(scores: torch.Tensor, group_size: int, scale: str | bool = "none", eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (Kool et al. 2019; Ahmadian et al. 2024).

    ``A_i = s_i - mean_{j != i} s_j = G / (G - 1) * (s_i - mean_group(s))`` within each group
    of ``G`` completions of one prompt, then divided by the std that ``scale`` names
    (:func:`scale_advantages`; the paper divides by nothing).

    Args:
        scores: ``[B]`` grouped contiguously in groups of ``G``; NaN: no reward scored it (left out
            of the others' mean, whose count it lowers; its advantage NaN, and a completion whose
            group has no other scored one gets NaN too, as in TRL).
    Returns:
        ``[B]`` advantages.
    """
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    if bool(grouped.isnan().any()):
        scored = (~grouped.isnan()).sum(-1, keepdim=True)  # [B/G, 1]
        baseline = (grouped.nansum(-1, keepdim=True) - grouped) / (scored - 1)  # mean of the scored others
    else:
        baseline = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)  # mean of the others
    return scale_advantages((grouped - baseline).reshape(-1), scores, group_size, scale, eps)


def reinforce_advantages(scores: torch.Tensor, scale: str | bool = "none", eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: ``A_i = s_i - mean(s)``, then divided by the
    batch's std with ``scale="batch"`` (there are no groups; :func:`scale_advantages`)."""
    if scale in ("group", True):
        raise ValueError("reinforce has no groups to scale by: scale must be 'batch' or 'none'")
    return scale_advantages(scores - _mean(scores), scores, 1, scale, eps)


# --------------------------------------------------------------------------- losses


def sampling_correction_weights(log_w: torch.Tensor, response_mask: torch.Tensor, mode: str,
                                cap: float) -> torch.Tensor:
    """Importance weights ``[B, R]`` for tokens drawn from a sampler q other than the policy pi.

    ``log_w [B, R]`` is log pi(a_t|s_t) - log q(a_t|s_t) per token (for top-k / top-p sampling,
    log Z_t, the log of the kept mass, plus any gap between the training forward's and the
    sampler's log-probs). ``mode`` (TRL's vllm_importance_sampling_mode names):
    ``token_*`` weighs each token by w_t = exp(log_w_t); ``sequence_*`` weighs every token of a row
    by the product over its tokens, exp(sum_t log_w_t); ``*_truncate`` caps a weight at ``cap``,
    ``*_mask`` zeroes the weights above it. 0 where the mask is 0. E_q[w f(a)] = E_pi[f(a) 1(a kept)]:
    over the tokens q can draw the weighted estimate is pi's.
    """
    if mode.startswith("sequence"):
        log_w = masked_sum(log_w, response_mask, -1)[:, None].expand_as(log_w)  # [B, R]: the row's product
    over = log_w > math.log(cap)
    w = torch.where(over, cap if mode.endswith("truncate") else 0.0, log_w.clamp(max=math.log(cap)).exp())
    return torch.where(response_mask.bool(), w, 0.0)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft over-long punishment (Yu et al. 2025, eq. 13), scaled by ``penalty``: with
    ``start = max_len - buffer``,

    ``0`` for ``L <= start``; ``-penalty * (L - start) / buffer`` for ``start < L <= max_len``
    (down to ``-penalty`` at ``max_len``); ``-penalty`` beyond.

    Args:
        lengths: ``[B]`` response lengths in tokens (EOS included), or any shape of them (an
            episode's turns: ``[B, R]``, 0 where no turn ends, which is below the ramp).
        max_len: the longest response allowed (``L_max``). buffer: ``L_cache`` >= 1.
    Returns:
        penalties (<= 0) of the shape of ``lengths``, to add to the scores.
    """
    if buffer < 1:
        raise ValueError(f"the over-long penalty needs buffer >= 1, got {buffer}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0) / buffer  # shape of lengths
    return -penalty * over.clamp(max=1.0)


# --------------------------------------------------------------------------- loss aggregation
#
# Every loss part (policy, value, KL, entropy) is a per-token tensor [B, R] reduced to a scalar by
# one named aggregation. Each aggregation is linear in the per-token values, and a minibatch's
# aggregate is the sum of its micro-batches' aggregates, each weighted by its share of the
# minibatch's ``unit`` (tokens or rows): that share is what gradient accumulation and data
# parallelism weigh a micro-batch or a process by, so any split gives the whole minibatch's loss.


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)``: one mean over every token of the minibatch."""
    return masked_mean(per_token, mask)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """``mean_i( sum_t(x * mask)_i / max(1, sum_t(mask)_i) )``: each row's token mean, then the
    mean over rows (a row without tokens counts as 0, as in TRL)."""
    per_row = masked_sum(per_token, mask, -1) / _check_mask(per_token, mask).sum(-1).clamp(min=1)  # [B]
    return per_row.mean()


def _fixed_length(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """``sum(x * mask) / (B * max_len)``: Dr. GRPO's constant normaliser, no length bias."""
    if max_len < 1:
        raise ValueError(f"the dr_grpo aggregation needs max_len >= 1 (the longest completion allowed), got {max_len}")
    return masked_sum(per_token, mask) / (per_token.shape[0] * max_len)


class Aggregation(NamedTuple):
    fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    unit: str  # "tokens" or "rows": what a micro-batch's share of the minibatch counts


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": Aggregation(_token_mean, "tokens"),
    # TRL's names for the same minibatch-wide token mean (docs/ppo_walkthrough.md, section 10)
    "bnpo": Aggregation(_token_mean, "tokens"),
    "dapo": Aggregation(_token_mean, "tokens"),
    "grpo": Aggregation(_sequence_mean, "rows"),
    "dr_grpo": Aggregation(_fixed_length, "rows"),
    # the two loss types that also change the policy objective (POLICY_OBJECTIVES) reduce as TRL's
    # do: cispo by the token count (TRL's dapo normaliser), sapo per sequence (TRL's grpo's)
    "cispo": Aggregation(_token_mean, "tokens"),
    "sapo": Aggregation(_sequence_mean, "rows"),
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, kind: str = "token_mean", max_len: int = 0) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` over ``mask`` ``[B, R]`` to a scalar, by ``kind``:

    - ``token_mean`` (also ``bnpo``, ``dapo``, ``cispo``): ``sum(x * m) / sum(m)``
    - ``grpo`` (also ``sapo``): ``mean_i( sum_t(x * m)_i / sum_t(m)_i )`` -- each sequence's mean,
      then over sequences
    - ``dr_grpo``: ``sum(x * m) / (B * max_len)``

    Padded slots (mask 0) reach neither the value nor the gradient, NaN included."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {kind!r}; expected one of {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[kind].fn(per_token, mask, max_len)


def aggregation_count(mask: torch.Tensor, kind: str = "token_mean") -> torch.Tensor:
    """What :func:`aggregate` ``kind`` weighs a part of a batch by: its tokens (``mask.sum()``) or
    its rows (``B``). A micro-batch's aggregate times ``count(micro) / count(minibatch)``, summed
    over the micro-batches, is the minibatch's aggregate."""
    if AGGREGATIONS[kind].unit == "tokens":
        return mask.sum()
    return torch.tensor(mask.shape[0], device=mask.device)


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's (Zheng et al. 2025, eq. 7) length-normalised sequence log-ratio ``[B, 1]``:
    ``log s_i = sum_t(log_ratio * m)_i / max(1, sum_t(m)_i)``, i.e. ``s_i`` is the geometric mean
    of the row's token ratios."""
    mask = _check_mask(log_ratio, response_mask)
    return (masked_sum(log_ratio, mask, -1) / mask.sum(-1).clamp(min=1))[:, None]  # [B, 1]


class SurrogateOptions(NamedTuple):
    """The knobs of the policy objectives (:data:`POLICY_OBJECTIVES`); each reads its own."""

    clip_low: float = 0.2
    """clip: the ratio's lower clip ``1 - clip_low``."""
    clip_high: float | None = None
    """clip: the ratio's upper clip ``1 + clip_high`` (None: ``clip_low``; DAPO's clip-higher)."""
    cap: float = 5.0
    """cispo: the largest importance weight (an absolute value, not ``1 + eps``)."""
    temperature_pos: float = 1.0
    """sapo: the gate's temperature on tokens with a positive advantage."""
    temperature_neg: float = 1.05
    """sapo: the gate's temperature on the others."""


def _clipped_surrogate(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                       opts: SurrogateOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """PPO's ``max(-A * w, -A * clip(w, 1 - lo, 1 + hi))`` per token; active: the clipped term won."""
    high = opts.clip_low if opts.clip_high is None else opts.clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - opts.clip_low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, {}


def _cispo_surrogate(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                     opts: SurrogateOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """CISPO (MiniMax-M1, arXiv 2506.13585; without its lower bound, as in TRL):
    ``-sg[min(w, cap)] * A * log pi``. The weight is capped and detached, never the token's
    gradient dropped: every token keeps ``-min(w, cap) * A * grad log pi`` (at ``w = 1`` the clipped
    surrogate's gradient). Active: the weight was capped, whatever the advantage's sign (TRL's
    cispo_clip_ratio counts the positive advantages only)."""
    capped = ratio.clamp(max=opts.cap).detach()
    return -capped * advantages * logprobs, ratio.detach() > opts.cap, {}


def _sapo_surrogate(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                    opts: SurrogateOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """SAPO (soft adaptive policy optimization, arXiv 2511.20347): a soft gate in place of the clip,
    ``-A * f(w)``, ``f(w) = sigmoid(tau * (w - 1)) * 4 / tau``, with ``tau`` the positive or the
    negative temperature by the sign of ``A``. ``f'(w) = 4 s (1 - s)`` (``s`` the sigmoid) is 1 at
    ``w = 1`` and decays smoothly as the ratio moves away, faster for a larger ``tau``; nothing
    is clipped (active: none). Extra stat ``policy/sapo_gate``: the mean ``f'(w)``."""
    tau = torch.where(advantages > 0, ratio.new_tensor(opts.temperature_pos), ratio.new_tensor(opts.temperature_neg))  # [B, R]
    gate = torch.sigmoid(tau * (ratio - 1.0))
    return -advantages * gate * 4.0 / tau, torch.zeros_like(ratio, dtype=torch.bool), \
        {"policy/sapo_gate": (4.0 * gate * (1.0 - gate)).detach()}


# loss_type -> the per-token policy objective; every other loss_type is PPO's clipped one
POLICY_OBJECTIVES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]] = {
    "clip": _clipped_surrogate,
    "cispo": _cispo_surrogate,
    "sapo": _sapo_surrogate,
}


def policy_objective(loss_type: str) -> str:
    """The policy objective a ``ppo.loss_type`` uses: ``cispo`` and ``sapo`` their own, the
    aggregations (token_mean, grpo, bnpo, dr_grpo, dapo) PPO's clipped surrogate."""
    return loss_type if loss_type in POLICY_OBJECTIVES else "clip"


def token_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      valid: torch.Tensor, objective: str = "clip",
                      options: SurrogateOptions | None = None) -> torch.Tensor:
    """The per-token loss of :func:`policy_loss` at ``level='token'``, before its aggregation:
    ``objective`` (:data:`POLICY_OBJECTIVES`) of ``ratio = exp(logprobs - old_logprobs)``; slots
    where ``valid`` (bool, the shape of ``logprobs``) is False compute on zeros. Any shape: each
    token's value reads that token alone, so a chunk of rows gives the whole's values there."""
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    own = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    per_token, _, _ = POLICY_OBJECTIVES[objective](own, torch.exp(log_ratio), advantages, options or SurrogateOptions())
    return per_token


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float = 0.2,
    aggregation: str = "token_mean",
    max_len: int = 0,
    level: str = "token",
    objective: str = "clip",
    options: SurrogateOptions | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise, or another
    per-token policy objective (``objective``, :data:`POLICY_OBJECTIVES`).

    ``ratio = exp(logprobs - old_logprobs)``
    ``loss = aggregate( max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) )``
    ``objective="cispo"``: ``aggregate( -sg[min(ratio, cap)] * A * logprobs )`` (MiniMax-M1);
    ``objective="sapo"``: ``aggregate( -A * sigmoid(tau * (ratio - 1)) * 4 / tau )`` (SAPO),
    ``tau`` by the sign of ``A``.

    ``level`` picks the importance ratio: ``token`` (above); ``sequence`` (GSPO): every token of
    row ``i`` takes ``s_i = exp(mean_t log_ratio)`` (:func:`sequence_log_ratio`), clipped per
    sequence, its gradient ``s_i * mean_t grad log pi``; ``sequence_token`` (GSPO-token): the
    value ``s_i`` but per-token gradients, ``sg[s_i] * pi_t / sg[pi_t]``, so that token-level
    advantages weigh their own tokens (with one advantage per row its gradient equals
    ``sequence``'s under every aggregation). CISPO detaches its weight, so there ``sequence``
    and ``sequence_token`` are one.

    Args:
        logprobs: ``[B, R]`` log pi_theta(a_t|s_t), with grad.
        old_logprobs: ``[B, R]`` log-probs at rollout time (no grad).
        advantages: ``[B, R]`` (usually whitened).
        response_mask: ``[B, R]``.
        clip_range: eps (the lower clip; also the upper one unless ``options.clip_high``).
        aggregation, max_len: how the per-token loss is reduced (:func:`aggregate`).
        level: ``token``, ``sequence`` or ``sequence_token``.
        objective: ``clip``, ``cispo`` or ``sapo``.
        options: the objectives' other knobs (:class:`SurrogateOptions`; its ``clip_low`` is
            ``clip_range``).
    Returns:
        ``(loss, stats)``; stats (token means over the mask whatever the aggregation, so runs
        compare): ``policy/loss`` (the per-token loss's mean), ``policy/clipfrac`` (share of
        tokens whose clip or cap was the active one; 0 for sapo), ``policy/approx_kl`` (k3
        estimate of KL(old || new) from the token ratios, exactly 0 when ratio == 1),
        ``policy/ratio_mean`` (of the ratio used); sapo adds ``policy/sapo_gate``.
    """
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(f"unknown policy objective {objective!r}; expected one of {', '.join(POLICY_OBJECTIVES)}")
    options = (options or SurrogateOptions())._replace(clip_low=clip_range)
    # where(), not a product: a NaN/inf in a padded slot must reach neither the loss nor, through
    # exp's backward (0 * inf), the gradient of the valid tokens
    valid = response_mask.bool()
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, R]
    own = torch.where(valid, logprobs, torch.zeros_like(logprobs))  # [B, R]
    if level == "token":
        log_weight = log_ratio
    elif level == "sequence":
        log_weight = sequence_log_ratio(log_ratio, response_mask).expand_as(log_ratio)  # [B, R]
    elif level == "sequence_token":
        log_weight = own - own.detach() + sequence_log_ratio(log_ratio, response_mask).detach()  # [B, R]
    else:
        raise ValueError(f"unknown importance sampling level {level!r}; expected token, sequence or sequence_token")
    ratio = torch.exp(log_weight)  # [B, R]
    per_token, active, extra = POLICY_OBJECTIVES[objective](own, ratio, advantages, options)  # [B, R] each
    loss = aggregate(per_token, response_mask, aggregation, max_len)
    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)
        stats = {
            "policy/loss": masked_mean(per_token, response_mask),
            "policy/clipfrac": masked_mean(active.float(), response_mask),
            "policy/approx_kl": masked_mean((token_ratio - 1) - log_ratio, response_mask),
            "policy/ratio_mean": masked_mean(ratio, response_mask),
        }
        stats.update({k: masked_mean(v, response_mask) for k, v in extra.items()})
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
    aggregation: str = "token_mean",
    max_len: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss.

    ``v_clip = old_values + clip(values - old_values, -eps, eps)``
    ``loss = 0.5 * mean_mask( max((values - returns)^2, (v_clip - returns)^2) )``
    With ``clip_range=None`` it is the plain ``0.5 * mean_mask((values - returns)^2)``. Another
    ``aggregation`` (:func:`aggregate`) replaces the token mean.

    Args:
        values: ``[B, R]`` current predictions, with grad.
        old_values, returns, response_mask: ``[B, R]``.
    Returns:
        ``(loss, stats)``; stats: ``value/loss``, ``value/clipfrac``.
    """
    valid = response_mask.bool()
    values = torch.where(valid, values, torch.zeros_like(values))  # padded garbage: no grad, no NaN
    old_values = torch.where(valid, old_values, torch.zeros_like(old_values))
    returns = torch.where(valid, returns, torch.zeros_like(returns))
    err = (values - returns) ** 2
    if clip_range is None:
        per_token, clip_active = err, torch.zeros_like(err)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err_clip = (v_clip - returns) ** 2
        per_token, clip_active = torch.maximum(err, err_clip), (err_clip > err).float()
    loss = 0.5 * aggregate(per_token, response_mask, aggregation, max_len)
    with torch.no_grad():
        stats = {"value/loss": 0.5 * masked_mean(per_token, response_mask),  # a token mean, whatever the aggregation
                 "value/clipfrac": masked_mean(clip_active, response_mask)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over valid tokens (1 is a perfect critic).

    Returns NaN-free 0 when the returns have no variance.
    """
    var_ret = masked_var(returns, response_mask)
    if var_ret <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return 1 - masked_var(returns - values, response_mask) / var_ret


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model pairwise loss: ``mean(-logsigmoid(r_chosen - r_rejected - margin))``
    ``+ center_coef * mean((r_chosen + r_rejected)^2)``.

    Bradley-Terry fixes only differences, so each prompt can carry an arbitrary offset; a
    policy-gradient learner then sees "every answer to this prompt is bad". The centring
    term (Eisenstein et al. 2023) pins the pair's mean near 0 so scores compare across
    prompts.

    Args:
        chosen, rejected: ``[B]`` scalar rewards of the preferred / dispreferred answer.
        margin: optional ``[B]`` or scalar required gap (Llama-2 style); None for 0.
        center_coef: weight of the centring term (0 for plain Bradley-Terry).
    Returns:
        ``(loss, stats)``; stats: ``rm/loss``, ``rm/accuracy`` (share with chosen > rejected),
        ``rm/delta`` (mean chosen - rejected), ``rm/chosen``, ``rm/rejected``.
    """
    delta = chosen - rejected  # [B]
    target = delta if margin is None else delta - margin
    loss = -F.logsigmoid(target).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        stats = {
            "rm/loss": loss.detach(),
            "rm/accuracy": (delta > 0).float().mean(),
            "rm/delta": delta.mean(),
            "rm/chosen": chosen.mean(),
            "rm/rejected": rejected.mean(),
        }
    return loss, stats


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sigmoid DPO loss (Rafailov et al. 2023, eq. 7).

    ``h = beta * ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)))``,
    ``loss = mean(-logsigmoid(h))``.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: ``[B]`` summed log-probs of
            the chosen / rejected responses under the policy and the reference.
        beta: inverse temperature of the implicit reward.
    Returns:
        ``(loss, stats)``; stats: ``dpo/loss``, ``dpo/accuracy`` (implicit reward of chosen >
        rejected), ``dpo/margin`` (mean implicit-reward gap), ``dpo/chosen``, ``dpo/rejected``.
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)  # [B]
    rejected_reward = beta * (policy_rejected - ref_rejected)  # [B]
    loss = -F.logsigmoid(chosen_reward - rejected_reward).mean()
    return loss, _preference_stats(loss, chosen_reward, rejected_reward)


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO loss (Azar et al. 2023, eq. 17): a squared loss that pulls the log-ratio gap of every
    pair to ``1 / (2 beta)`` instead of pushing it to infinity as the sigmoid loss can.

    ``h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))``,
    ``loss = mean((h - 1 / (2 beta))^2)``.

    With ``chosen_tokens`` / ``rejected_tokens`` (each response's token count) every log-prob is
    first divided by its response's length -- a per-token mean, TRL's ``loss_type="ipo"``
    (``dpo.loss=ipo``); without them the log-probs are the response sums, as in
    :func:`dpo_loss` (``dpo.loss=ipo_sum``). The two ``beta`` are not interchangeable: with sums
    the target ``1 / (2 beta)`` is a gap over whole responses, with means a gap per token.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: ``[B]`` summed log-probs.
        beta: regularisation strength; the target gap is ``1 / (2 beta)``.
        chosen_tokens, rejected_tokens: ``[B]`` response lengths, or None (sums).
    Returns:
        ``(loss, stats)`` with the keys of :func:`dpo_loss`; the implicit rewards are
        ``beta * (log pi - log ref)`` of the log-probs the loss uses (means or sums). TRL logs its
        ``rewards/*`` from the summed log-ratios even under ``loss_type="ipo"``, so with means the
        two libraries' logged rewards differ (the loss is the same).
    """
    if (chosen_tokens is None) != (rejected_tokens is None):
        raise ValueError("give both chosen_tokens and rejected_tokens, or neither")
    if chosen_tokens is not None:  # per-token means
        policy_chosen, ref_chosen = policy_chosen / chosen_tokens, ref_chosen / chosen_tokens  # [B]
        policy_rejected, ref_rejected = policy_rejected / rejected_tokens, ref_rejected / rejected_tokens  # [B]
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # [B]
    loss = ((h - 1.0 / (2.0 * beta)) ** 2).mean()
    return loss, _preference_stats(loss, beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected))


def _preference_stats(loss: torch.Tensor, chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> dict:
    with torch.no_grad():
        return {
            "dpo/loss": loss.detach(),
            "dpo/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "dpo/margin": (chosen_reward - rejected_reward).mean(),
            "dpo/chosen": chosen_reward.mean(),
            "dpo/rejected": rejected_reward.mean(),
        }


def adaptive_kl_coef(kl_coef: float, observed_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Proportional KL controller of Ziegler et al. (2019), one update.

    ``e = clip(observed / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.

    Args:
        kl_coef: current beta.
        observed_kl: mean per-sequence KL of the last batch.
        target: KL the controller steers towards.
        horizon: how many samples the correction is spread over.
        n_steps: samples seen since the last update (the batch size).
    """
    if not math.isfinite(observed_kl):
        return kl_coef
    err = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + err * n_steps / horizon)
