"""Advantages: GAE over a critic's values (PPO) and the critic-free baselines over a prompt's group
(GRPO, RLOO) or the batch (REINFORCE); scaling is its own step (:func:`scale_advantages`)."""

from __future__ import annotations

import math

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over ``[B, R]``: ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam
    A_{t+1}``, ``returns = A + V``; ``t + 1`` is the next *valid* column (a multi-turn episode's
    observations skipped), 0 past the last. ``(advantages, returns)`` ``[B, R]``, 0 where masked."""
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


# A NaN score (no reward scored it) is left out of each mean and std and gets a NaN advantage,
# as in TRL; without a NaN these are the plain reductions, bit for bit.


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
    """Scale centred scores ``c [B]`` (docs/algorithms/grpo.md): ``group`` (True) ``/ std_group(s)``,
    ``batch`` ``/ std(s)``, ``advantages`` ``(c - mean c) / std c`` (TRL's RLOO), ``none`` (False,
    Dr. GRPO) as is; ``eps`` keeps equal scores at 0."""
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
    """GRPO (Shao et al. 2024): ``A_i = s_i - mean_group(s)``, then :func:`scale_advantages`;
    ``scores [B]``, rows ``[g*G, (g+1)*G)`` prompt ``g``'s completions. ``[B]``."""
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    centred = (grouped - _mean(grouped, -1, keepdim=True)).reshape(-1)  # [B]
    return scale_advantages(centred, scores, group_size, scale, eps)


def zero_std_groups(scores: torch.Tensor, group_size: int, rtol: float = 1e-6) -> torch.Tensor:
    """Groups whose scores are equal up to rounding (TRL's "zero std": no policy-gradient signal),
    ``[B] -> [B/G]``: ``max_g s - min_g s <= rtol max(1, max_g |s|)``, NaN scores left out."""
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    unscored = grouped.isnan()  # [B/G, G]
    spread = grouped.masked_fill(unscored, -math.inf).max(-1).values \
        - grouped.masked_fill(unscored, math.inf).min(-1).values  # [B/G]; -inf for a group none scored
    return spread <= rtol * grouped.masked_fill(unscored, 0.0).abs().max(-1).values.clamp(min=1.0)


def group_mean_se(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Cluster-robust standard error of ``x.mean(-1)``, ``[..., B] -> [...]``, groups of ``G`` rows
    sharing a prompt: ``sqrt(var(m_g) / n)`` over the ``n = B/G`` group means; NaN for ``n < 2``."""
    groups = x.unflatten(-1, (-1, group_size)).mean(-1)  # [..., n]
    n = groups.shape[-1]
    if n < 2:
        return torch.full(groups.shape[:-1], math.nan, dtype=groups.dtype, device=groups.device)
    return (groups.var(-1) / n).sqrt()


def rloo_advantages(scores: torch.Tensor, group_size: int, scale: str | bool = "none", eps: float = 1e-4) -> torch.Tensor:
    """RLOO (Kool et al. 2019): ``A_i = s_i - mean_{j != i} s_j`` over groups of ``G``, then
    :func:`scale_advantages`; NaN scores left out of the others' mean, as in TRL. ``[B]``."""
    _check_groups(scores, group_size)
    grouped = scores.view(-1, group_size)  # [B/G, G]
    if bool(grouped.isnan().any()):
        scored = (~grouped.isnan()).sum(-1, keepdim=True)  # [B/G, 1]
        baseline = (grouped.nansum(-1, keepdim=True) - grouped) / (scored - 1)  # mean of the scored others
    else:
        baseline = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)  # mean of the others
    return scale_advantages((grouped - baseline).reshape(-1), scores, group_size, scale, eps)


def reinforce_advantages(scores: torch.Tensor, scale: str | bool = "none", eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: ``A_i = s_i - mean(s)``, ``scale="batch"``: over ``std(s)``."""
    if scale in ("group", True):
        raise ValueError("reinforce has no groups to scale by: scale must be 'batch' or 'none'")
    return scale_advantages(scores - _mean(scores), scores, 1, scale, eps)
