"""The update's losses: the per-token policy objectives (PPO's clip, CISPO, SAPO) at the token or
the sequence level, the clipped value loss, the one named aggregation that reduces every
per-token loss part, and the importance weights for tokens drawn by another sampler."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .stats import _check_mask, masked_mean, masked_sum


def sampling_correction_weights(log_w: torch.Tensor, response_mask: torch.Tensor, mode: str,
                                cap: float) -> torch.Tensor:
    """Importance weights ``[B, R]`` (0 where masked) for tokens drawn by a sampler q, not pi, from
    ``log_w = log pi - log q``: ``token_*`` ``exp(log_w_t)``, ``sequence_*`` ``exp(sum_t log_w_t)``;
    ``*_truncate`` caps at ``cap``, ``*_mask`` zeroes above it (TRL's names)."""
    if mode.startswith("sequence"):
        log_w = masked_sum(log_w, response_mask, -1)[:, None].expand_as(log_w)  # [B, R]: the row's product
    over = log_w > math.log(cap)
    w = torch.where(over, cap if mode.endswith("truncate") else 0.0, log_w.clamp(max=math.log(cap)).exp())
    return torch.where(response_mask.bool(), w, 0.0)


# Every loss part (policy, value, KL, entropy) is a per-token [B, R] tensor reduced by one named
# aggregation, linear in the per-token values: a minibatch's aggregate is the sum of its
# micro-batches', each weighted by its share of the minibatch's ``unit`` (tokens or rows).


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
    """Reduce a per-token loss ``[B, R]`` over ``mask``: ``token_mean`` ``sum(x m) / sum(m)``; ``grpo``
    the mean of the rows' token means; ``dr_grpo`` ``sum(x m) / (B max_len)``. Masked slots (NaN
    included) reach neither the value nor the gradient."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {kind!r}; expected one of {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[kind].fn(per_token, mask, max_len)


def aggregation_count(mask: torch.Tensor, kind: str = "token_mean") -> torch.Tensor:
    """What :func:`aggregate` weighs a part of a batch by, its tokens or its rows: the micro-batches'
    aggregates times ``count(micro) / count(minibatch)`` sum to the minibatch's."""
    if AGGREGATIONS[kind].unit == "tokens":
        return mask.sum()
    return torch.tensor(mask.shape[0], device=mask.device)


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's (Zheng et al. 2025, eq. 7) sequence log-ratio ``[B, 1]``, the geometric mean of the
    row's token ratios: ``log s_i = sum_t(log_ratio m)_i / max(1, sum_t m_i)``."""
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
    """CISPO (MiniMax-M1, arXiv 2506.13585; no lower bound, as in TRL): ``-sg[min(w, cap)] * A *
    log pi``: the weight is capped and detached, no token's gradient dropped. Active: the weight was
    capped, whatever the advantage's sign (TRL's cispo_clip_ratio counts positive advantages only)."""
    capped = ratio.clamp(max=opts.cap).detach()
    return -capped * advantages * logprobs, ratio.detach() > opts.cap, {}


def _sapo_surrogate(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                    opts: SurrogateOptions) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """SAPO (arXiv 2511.20347): a soft gate in place of the clip, ``-A * f(w)``, ``f(w) =
    sigmoid(tau * (w - 1)) * 4 / tau``, ``tau`` the positive or negative temperature by the sign of
    ``A``; ``f'(w) = 4 s (1 - s)`` is 1 at ``w = 1`` (stat ``policy/sapo_gate``). Nothing is clipped."""
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


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_range: float = 0.2, aggregation: str = "token_mean",
                max_len: int = 0, level: str = "token", objective: str = "clip",
                options: SurrogateOptions | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) or another ``objective``
    (:data:`POLICY_OBJECTIVES`), reduced by :func:`aggregate`: ``aggregate(max(-A w, -A clip(w, 1 -
    clip_range, 1 + clip_high)))`` over ``[B, R]``; ``level``: ``w`` per token, or the row's
    :func:`sequence_log_ratio` (GSPO; docs/algorithms/grpo.md). Stats are token means."""
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(f"unknown policy objective {objective!r}; expected one of {', '.join(POLICY_OBJECTIVES)}")
    options = (options or SurrogateOptions())._replace(clip_low=clip_range)
    # where(), not a product: a NaN/inf in a padded slot reaches neither the loss nor, through
    # exp's backward (0 * inf), the gradient of the valid tokens
    valid = response_mask.bool()
    log_ratio, own = torch.where(valid, logprobs - old_logprobs, 0.0), torch.where(valid, logprobs, 0.0)  # [B, R]
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
        stats = {"policy/loss": per_token, "policy/clipfrac": active.float(),
                 "policy/approx_kl": (torch.exp(log_ratio) - 1) - log_ratio, "policy/ratio_mean": ratio, **extra}
        return loss, {k: masked_mean(v, response_mask) for k, v in stats.items()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
               clip_range: float | None = 0.2, aggregation: str = "token_mean",
               max_len: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss over ``[B, R]``: ``0.5 aggregate(max((v - G)^2, (v_clip - G)^2))``, ``v_clip =
    v_old + clip(v - v_old, -eps, eps)`` (``clip_range=None``: no clip)."""
    valid = response_mask.bool()  # padded garbage: no grad, no NaN
    values, old_values, returns = (torch.where(valid, x, 0.0) for x in (values, old_values, returns))
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
