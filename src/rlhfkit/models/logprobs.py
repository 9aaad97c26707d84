"""The LM head's log-probs a few rows at a time, never holding the ``[N, V]``
logits (big vocabularies, ``models.UPDATE_LOGITS``); the head's products and fused bfloat16 path
go through :mod:`rlhfkit.ops`, the numbers are :func:`rlhfkit.core.logprobs_from_logits`'."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops

__all__ = ["chunked_token_logprobs"]


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 temperature: float) -> torch.Tensor:
    """``[n, V]`` logits of one chunk in the LM head's dtype, tempered in that dtype too: the
    numbers the full-logits path sees, before any upcast."""
    logits = ops.linear(hidden, weight, bias)  # [n, V]
    return logits / temperature if temperature != 1.0 else logits


def _chunk_forward(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple:
    """``(picked, lse, ent)`` of one chunk's logits ``z [n, V]`` (may be overwritten), ``[n]`` each: the
    fused bfloat16 head's where it applies (``ent`` None); else in at least float32."""
    fused = None if with_entropy else ops.head_lse(z, targets)
    if fused is not None:
        return fused[1], fused[0], None
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    picked = z.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    if not with_entropy:
        return picked, _logsumexp_(z), None
    lse = torch.logsumexp(z, dim=-1)
    return picked, lse, lse - (F.softmax(z, dim=-1) * z).sum(-1)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """:func:`chunked_token_logprobs`: only the inputs and each row's logsumexp are saved; the
    backward builds each chunk's logits again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, with_entropy):
        ctx.set_materialize_grads(False)  # an unused entropy output gets no gradient pass at all
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        logp = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)  # [N]
        ent = torch.empty_like(logp) if with_entropy else None  # [N]
        lse = torch.empty_like(logp)  # [N], kept for the backward
        for s in range(0, hidden.shape[0], chunk_rows):
            e = s + chunk_rows
            z = _head_logits(hidden[s:e], weight, bias, temperature)  # [n, V]
            picked, lse[s:e], part = _chunk_forward(z, targets[s:e], with_entropy)
            logp[s:e] = picked - lse[s:e]
            if with_entropy:
                ent[s:e] = part
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return (logp, ent) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)  # the weight gradients are summed in at least float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        grad_w = None  # the first chunk's product, the others summed into it: no zeroed [V, H] buffer
        for s in range(0, hidden.shape[0], ctx.chunk_rows):
            e = s + ctx.chunk_rows
            h = hidden[s:e]  # [n, H]
            z = _head_logits(h, weight, bias, ctx.temperature)
            # the fused head's gradient where it applies, d(z / T) / dz inside
            fused = grad_ent is None and grad_logp is not None
            g = ops.head_grad(z, lse[s:e], grad_logp[s:e] / ctx.temperature, targets[s:e]) if fused else None
            if g is not None:
                grad_w = _head_grads(g, h, weight, 1.0, grad_h, grad_w, need_w, grad_b, s, acc)
                continue
            g = _logit_grad(z.to(torch.promote_types(z.dtype, torch.float32)), lse[s:e, None], targets[s:e],
                            None if grad_logp is None else grad_logp[s:e],
                            None if grad_ent is None else grad_ent[s:e])  # [n, V]
            grad_w = _head_grads(g, h, weight, ctx.temperature, grad_h, grad_w, need_w, grad_b, s, acc)
            del g
        return grad_h, *_head_dtypes(grad_w, grad_b, weight, bias, need_w), None, None, None, None


def _check_shapes(hidden: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> None:
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and targets {tuple(targets.shape)} [N]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def _head_grads(g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, temperature: float,
                grad_h: torch.Tensor | None, grad_w: torch.Tensor | None, need_w: bool,
                grad_b: torch.Tensor | None, s: int, acc: torch.dtype) -> torch.Tensor | None:
    """Add one chunk's share from ``g [n, V]`` (overwritten), the gradient wrt its tempered logits:
    ``grad_h[s : s + n] = g W``, ``grad_b += sum(g)``; returns ``grad_w + g.T h`` (in ``acc``)."""
    if temperature != 1.0:
        g = g.div_(temperature)  # d(z / T) / dz
    g = g.to(weight.dtype)  # the head's dtype, as its matmuls run
    if grad_h is not None and grad_h.dtype == g.dtype:
        ops.mm_out(g, weight, grad_h[s : s + g.shape[0]])  # rows of grad_h: contiguous
    elif grad_h is not None:
        grad_h[s : s + g.shape[0]] = g @ weight
    if need_w:
        if grad_w is None:
            grad_w = (g.t() @ h).to(acc)  # [V, H]; a half-precision product rounded as below
        elif g.dtype == acc:  # summed in place: no [V, H] temporary a chunk
            grad_w.addmm_(g.t(), h)
        else:
            grad_w += g.t() @ h
    if grad_b is not None:
        grad_b += g.sum(0)
    return grad_w


def _head_dtypes(grad_w: torch.Tensor | None, grad_b: torch.Tensor | None, weight: torch.Tensor,
                 bias: torch.Tensor | None, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The summed head gradients in the weights' dtypes (zeros for a weight no row reached)."""
    if need_w and grad_w is None:  # no rows
        grad_w = torch.zeros_like(weight)
    return (None if grad_w is None else grad_w.to(weight.dtype)), (None if grad_b is None else grad_b.to(bias.dtype))


def _logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(z, -1)`` for ``z [n, V]``, overwriting ``z`` with ``exp(z - max)``: no fresh
    ``[n, V]`` tensor. A row whose max is infinite is shifted by 0, as torch's is."""
    top = z.amax(-1, keepdim=True)  # [n, 1]
    top.masked_fill_(top.isinf(), 0.0)
    return z.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _logit_grad(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor | None,
                grad_ent: torch.Tensor | None) -> torch.Tensor:
    """Gradient wrt the (tempered) logits ``z [n, V]`` (overwritten) of ``grad_logp . logp(targets)
    + grad_ent . H``, given the rows' logsumexp ``lse [n, 1]`` from the forward: ``d logp / dz =
    onehot - p`` and ``dH / dz = -p * (log p + H)``."""
    if grad_ent is None:  # the update's usual case: -grad_logp p, then + grad_logp at the target, in z's pages
        if grad_logp is None:
            return z.zero_()
        gl = grad_logp[:, None].to(z.dtype)
        g = z.sub_(lse).exp_().mul_(gl.neg())  # [n, V]
        return g.scatter_add_(1, targets[:, None], gl)
    logp = z.sub_(lse)  # [n, V] log-softmax, in place
    p = logp.exp()  # [n, V]
    ent = -(p * logp).sum(-1, keepdim=True)  # [n, 1]
    g = logp.add_(ent).mul_(p).mul_(-grad_ent[:, None])  # -grad_ent * p * (log p + H)
    if grad_logp is not None:
        g.addcmul_(p, grad_logp[:, None].to(g.dtype), value=-1.0)
        g.scatter_add_(1, targets[:, None], grad_logp[:, None].to(g.dtype))
    return g


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           targets: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [N], entropy [N] or None)`` of ``targets [N]`` under the LM head ``z = (hidden @
    weight.T + bias) / temperature``, ``chunk_rows`` rows at a time; logits in the head's dtype,
    softmax and weight gradient in at least float32."""
    _check_shapes(hidden, targets, chunk_rows)
    out = _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_rows),
                                      bool(with_entropy))
    return out if with_entropy else (out, None)

