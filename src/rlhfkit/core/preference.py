"""Pairwise losses over a chosen and a rejected answer: the reward model's Bradley-Terry loss,
and DPO's and IPO's losses over the policy's and the reference's summed log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float | None = None,
                       center_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry over ``[B]`` rewards: ``mean(-logsigmoid(r_c - r_r - margin)) + center_coef
    mean((r_c + r_r)^2)``; the centring term (Eisenstein et al. 2023) pins each pair's mean near 0,
    which Bradley-Terry leaves free, so scores compare across prompts."""
    delta = chosen - rejected  # [B]
    target = delta if margin is None else delta - margin
    loss = -F.logsigmoid(target).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        return loss, {"rm/loss": loss.detach(), "rm/accuracy": (delta > 0).float().mean(), "rm/delta": delta.mean(),
                      "rm/chosen": chosen.mean(), "rm/rejected": rejected.mean()}


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sigmoid DPO (Rafailov et al. 2023, eq. 7) over ``[B]`` summed log-probs: ``mean(-logsigmoid(h))``,
    ``h = beta ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)))``."""
    chosen_reward = beta * (policy_chosen - ref_chosen)  # [B]
    rejected_reward = beta * (policy_rejected - ref_rejected)  # [B]
    loss = -F.logsigmoid(chosen_reward - rejected_reward).mean()
    return loss, _preference_stats(loss, chosen_reward, rejected_reward)


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO (Azar et al. 2023, eq. 17): ``mean((h - 1 / (2 beta))^2)``, ``h`` as in :func:`dpo_loss`:
    every pair's gap pulled to ``1 / (2 beta)``, not to infinity. With ``chosen_tokens`` /
    ``rejected_tokens`` ``[B]`` each log-prob is a per-token mean (TRL's ``ipo``; docs/algorithms/dpo.md)."""
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
        return {"dpo/loss": loss.detach(), "dpo/accuracy": (chosen_reward > rejected_reward).float().mean(),
                "dpo/margin": (chosen_reward - rejected_reward).mean(), "dpo/chosen": chosen_reward.mean(),
                "dpo/rejected": rejected_reward.mean()}
