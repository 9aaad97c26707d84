"""Advantages: GAE over a critic's values (PPO), and the critic-free baselines over groups of
completions of one prompt (GRPO, RLOO) or over the batch (REINFORCE). Nothing here whitens
unless asked: scaling is its own step (:func:`scale_advantages`)."""

from __future__ import annotations

import math

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over ``[B, R]`` response tokens (no whitening here).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns_t = A_t + V_t``; ``V`` and ``A`` are 0 past the last valid token (the episode ends
    at its EOS), and ``t + 1`` is the next *valid* column, so a multi-turn episode's masked
    observations are skipped. Returns ``(advantages, returns)`` ``[B, R]``, 0 where masked.
    """
    mask = response_mask.to(values.dtype)
    valid = response_mask.bool()
    # where(), not a product: a NaN/inf parked in a padded slot must not reach valid ones
    values, rewards = torch.where(valid, values, 0.0), torch.where(valid, rewards, 0.0)
    advantages = torch.zeros_like(rewards)
    next_adv, next_value = torch.zeros_like(rewards[:, 0]), torch.zeros_like(values[:, 0])  # [B] each
    for t in reversed(range(rewards.shape[1])):  # R is a response length: tens of tokens, a cheap loop
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = adv
        # a masked column passes the next valid one's value and advantage on (0 after the end)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    return advantages, (advantages + values) * mask


# A NaN score is a completion that no reward scored: the baselines leave it out of each mean and
# std, as TRL does, and give it a NaN advantage (the caller makes it 0). Without a NaN they are
# the plain reductions, bit for bit.


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
    """Divide baseline-centred scores ``c [B]`` by the std ``scale`` names (docs/algorithms/grpo.md):
    ``"group"`` (or True) each group's std of the scores (GRPO's paper); ``"batch"`` ``std(scores)``
    (TRL's GRPO ``scale_rewards="batch"``); ``"advantages"`` ``(c - mean(c)) / std(c)`` (TRL's
    RLOO ``normalize_advantages=True``); ``"none"`` (or False) nothing (Dr. GRPO). ``eps`` keeps
    equal scores at 0 instead of 0/0; NaN scores are left out of each mean and std.
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
    """GRPO's group-relative advantage (Shao et al. 2024): ``A_i = s_i - mean_group(s)``, then
    :func:`scale_advantages`. ``scores [B]``: rows ``[g*G, (g+1)*G)`` are prompt ``g``'s ``G``
    completions; a NaN score is left out of its group's statistics. Returns ``[B]``."""
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    centred = (grouped - _mean(grouped, -1, keepdim=True)).reshape(-1)  # [B]
    return scale_advantages(centred, scores, group_size, scale, eps)


def zero_std_groups(scores: torch.Tensor, group_size: int, rtol: float = 1e-6) -> torch.Tensor:
    """Which groups' scores are all equal (TRL's "zero std"), ``[B] -> [B/G]`` bool: ``max_g(s) -
    min_g(s) <= rtol * max(1, max_g |s|)``, equal up to rounding. Such a group's GRPO / RLOO
    advantages are all 0: no policy-gradient signal. NaN scores are left out (a group with at most
    one scored completion is zero-std)."""
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    unscored = grouped.isnan()  # [B/G, G]
    spread = grouped.masked_fill(unscored, -math.inf).max(-1).values \
        - grouped.masked_fill(unscored, math.inf).min(-1).values  # [B/G]; -inf for a group none scored
    return spread <= rtol * grouped.masked_fill(unscored, 0.0).abs().max(-1).values.clamp(min=1.0)


def group_mean_se(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Standard error of ``x.mean(-1)``, ``[..., B] -> [...]``, when rows ``[g*G, (g+1)*G)`` share a
    prompt and so are not independent draws: ``se = sqrt(sum_g (m_g - m)^2 / ((n - 1) n))`` over
    the ``n = B/G`` group means (cluster-robust; ``G = 1`` the sample one). NaN for ``n < 2``."""
    groups = x.unflatten(-1, (-1, group_size)).mean(-1)  # [..., n]
    n = groups.shape[-1]
    if n < 2:
        return torch.full(groups.shape[:-1], math.nan, dtype=groups.dtype, device=groups.device)
    return (groups.var(-1) / n).sqrt()


def rloo_advantages(scores: torch.Tensor, group_size: int, scale: str | bool = "none", eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (Kool et al. 2019; Ahmadian et al. 2024) over ``[B]``
    scores in groups of ``G``: ``A_i = s_i - mean_{j != i} s_j = G / (G - 1) (s_i - mean_group(s))``,
    then :func:`scale_advantages`. A NaN score is left out of the others' mean; a completion with
    no other scored one in its group gets NaN, as in TRL."""
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
