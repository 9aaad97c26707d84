"""Per-token rewards: KL estimators against the reference, the score placed on the last token,
DAPO's over-long penalty, and the adaptive KL coefficient."""

from __future__ import annotations

import math

import torch

from .stats import last_token_index


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate ``[B, R]`` at tokens drawn from pi, ``log r = ref - logp``:
    ``k1 = -log r`` (unbiased), ``k2 = (log r)^2 / 2`` (low variance), ``k3 = r - 1 - log r`` (both)."""
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}: choose 'k1', 'k2' or 'k3'")


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) of each next-token distribution, ``[..., V] -> [...]``: ``sum_v p_v (log p_v -
    log q_v)``, ``p = softmax(logits)``, ``q = softmax(ref_logits)``, in at least float32. Not masked."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = logits.to(dtype).log_softmax(-1)  # [..., V]
    logq = ref_logits.to(dtype).log_softmax(-1)  # [..., V]
    return (logp.exp() * (logp - logq)).sum(-1)  # [...]


def shaped_rewards(score: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float,
                   score_clip: float | None = None) -> torch.Tensor:
    """Per-token reward ``[B, R]`` (0 where masked): ``-kl_coef kl`` on every valid token, plus
    ``clip(score, -score_clip, score_clip)`` on the last valid one; the one place the score lands."""
    rewards = torch.where(response_mask.bool(), -kl_coef * kl, 0.0)  # [B, R]
    if score_clip is not None:
        score = score.clamp(-score_clip, score_clip)
    last = last_token_index(response_mask)  # [B]
    return rewards.scatter_add(1, last.unsqueeze(1), score.to(rewards.dtype).unsqueeze(1))


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft over-long penalty (Yu et al. 2025, eq. 13), shaped as ``lengths`` (tokens, EOS
    included): ``-penalty clip((L - max_len + buffer) / buffer, 0, 1)``."""
    if buffer < 1:
        raise ValueError(f"the over-long penalty needs buffer >= 1, got {buffer}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0) / buffer  # shape of lengths
    return -penalty * over.clamp(max=1.0)


def adaptive_kl_coef(kl_coef: float, observed_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Ziegler et al.'s (2019) KL controller: ``beta (1 + clip(kl / target - 1, -0.2, 0.2) n_steps /
    horizon)``, ``kl`` the batch's mean per-sequence KL; a non-finite KL keeps beta."""
    if not math.isfinite(observed_kl):
        return kl_coef
    err = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + err * n_steps / horizon)
