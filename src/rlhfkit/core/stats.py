"""Log-probs and entropies from logits, and reductions over a mask (:func:`masked_sum`,
:func:`masked_mean`): an empty mask is an error, a NaN in a masked-out slot stays out."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens, so left padding shifts nothing: ``[B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int = 0) -> torch.Tensor:
    """``logits[b, t, tokens[b, t]] - logsumexp_v logits[b, t, v]``, ``[B, R, V] -> [B, R]`` in at
    least float32, no log-softmax built; ``chunk_size`` (no grad) rows at a time bound the upcast."""
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
    """Entropy at each position, ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (``= -sum p log p``):
    ``[B, R, V] -> [B, R]`` nats, in the dtype of :func:`logprobs_from_logits`."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast, never downcast
    probs = F.softmax(logits, dim=-1)  # [B, R, V]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # [B, R]


def _check_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of values {tuple(values.shape)}")
    return mask.to(values.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all dims when None). ``values`` and ``mask`` share a shape."""
    # where() rather than a product so a NaN/inf in a masked-out slot cannot leak in
    vals = torch.where(_check_mask(values, mask).bool(), values, 0.0)
    return vals.sum() if dim is None else vals.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over ``dim`` (all dims when None). ValueError on an empty
    mask (or an empty slice along ``dim``): a mean of nothing is undefined, not 0 and not NaN."""
    mask = _check_mask(values, mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    if bool((count == 0).any()):
        raise ValueError("masked_mean over an empty mask: no valid token to average. Check that every "
                         "sequence has at least one response token (response_mask) in this batch.")
    return masked_sum(values, mask, dim) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """``sum(mask (x - mean)^2) / (n - 1)`` (``/ n`` unless ``unbiased`` and ``n > 1``)."""
    var = masked_mean((values - masked_mean(values, mask)) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``mask == 1`` (``shift_mean=False``: the mean added
    back), 0 where masked."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last valid token of each row of a ``[B, R]`` mask, ``[B]`` long; ValueError if
    a row has none."""
    if bool((response_mask.sum(-1) == 0).any()):
        raise ValueError("a response has no valid token (its response_mask row is all zero)")
    cols = torch.arange(response_mask.shape[-1], device=response_mask.device)  # [R]
    return (cols * response_mask.long()).argmax(-1)  # [B]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over valid tokens (1: a perfect critic); 0, not
    NaN, when the returns do not vary."""
    var_ret = masked_var(returns, response_mask)
    if var_ret <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return 1 - masked_var(returns - values, response_mask) / var_ret
