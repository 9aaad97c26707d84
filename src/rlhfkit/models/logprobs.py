"""The LM head's log-probs and per-token losses a few rows at a time, never holding the ``[N, V]``
logits (big vocabularies, ``models.UPDATE_LOGITS``); the head's products and fused bfloat16 path
go through :mod:`rlhfkit.ops`, the numbers are :func:`rlhfkit.core.logprobs_from_logits`'."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import ops

__all__ = ["chunked_token_logprobs", "chunked_token_loss"]


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 temperature: float) -> torch.Tensor:
    """``[n, V]`` logits of one chunk in the LM head's dtype, tempered in that dtype too: the
    numbers the full-logits path sees, before any upcast."""
    logits = ops.linear(hidden, weight, bias)  # [n, V]
    return logits / temperature if temperature != 1.0 else logits


def _chunk_forward(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool) -> tuple:
    """``(z, picked, lse, ent, total)`` of one chunk's logits ``z [n, V]``, ``[n]`` each: the fused
    bfloat16 head's where it applies (``z`` as it is; ``ent``, ``total`` None); else in at least
    float32, where without entropy ``z`` becomes ``exp(z - max)`` in place and ``total`` its row sums."""
    fused = None if with_entropy else ops.head_lse(z, targets)
    if fused is not None:
        return z, fused[1], fused[0], None, None
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    picked = z.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    if not with_entropy:
        lse, total = _logsumexp_(z)
        return z, picked, lse, None, total
    lse = torch.logsumexp(z, dim=-1)
    return z, picked, lse, lse - (F.softmax(z, dim=-1) * z).sum(-1), None


def _grad_buffers(hidden, weight, bias, need_h: bool, need_b: bool) -> tuple:
    """``(acc, grad_h, grad_b)``: the dtype the weight gradients are summed in (at least float32)
    and the buffers of the hidden and bias gradients (None where not needed)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
    return acc, torch.empty_like(hidden) if need_h else None, grad_b


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
            _, picked, lse[s:e], part, _ = _chunk_forward(z, targets[s:e], with_entropy)
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
        acc, grad_h, grad_b = _grad_buffers(hidden, weight, bias, need_h, need_b)
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


class _ChunkedTokenLoss(torch.autograd.Function):
    """:func:`chunked_token_loss`: each chunk's logits are built once, in the forward, where its
    loss gradient wrt its log-probs (and entropies) is known, so the gradients wrt ``hidden``,
    ``weight`` and ``bias`` are summed there and the backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, with_entropy, loss_fn):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        acc, grad_h, grad_b = _grad_buffers(hidden, weight, bias, need_h, need_b)
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=dtype, device=hidden.device)  # [N]
        ent = torch.empty_like(logp) if with_entropy else None  # [N]
        grad_w = None  # the first chunk's product, the others summed into it (no zeroed [V, H] buffer)
        loss = torch.zeros((), dtype=dtype, device=hidden.device)
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            h, t = hidden[s:e], targets[s:e]  # [n, H], [n]
            z, picked, lse, part, total = _chunk_forward(_head_logits(h, weight, bias, temperature), t, with_entropy)
            bf16 = part is None and total is None  # the fused head's
            logp[s:e] = picked - lse
            if with_entropy:
                ent[s:e] = part
            with torch.enable_grad():  # d loss_chunk / d logp (and d / d entropy): small tensors
                lp = logp[s:e].detach().requires_grad_()
                en = ent[s:e].detach().requires_grad_() if with_entropy else None
                chunk_loss = loss_fn(lp, en, s, e)
                grads = torch.autograd.grad(chunk_loss, [lp, en] if with_entropy else [lp], allow_unused=True)
            loss += chunk_loss.detach().to(dtype)
            g_lp = torch.zeros_like(lp) if grads[0] is None else grads[0]  # [n]
            if bf16:  # d(z / T) / dz folded into the coefficient: one rounding to bfloat16
                g = ops.head_grad(z, lse, g_lp / temperature, t)
            elif with_entropy:
                g = _logit_grad(z, lse[:, None], t, g_lp, torch.zeros_like(lp) if grads[1] is None else grads[1])
            else:  # -g p with p = z / total, then + g at the target: d logp / dz = onehot - p
                g = z.mul_((-g_lp / total)[:, None].to(z.dtype)).scatter_add_(1, t[:, None], g_lp[:, None].to(z.dtype))
            grad_w = _head_grads(g, h, weight, 1.0 if bf16 else temperature, grad_h, grad_w, need_w, grad_b, s, acc)
            del z, g
        ctx.grads = (grad_h, *_head_dtypes(grad_w, grad_b, weight, bias, need_w))
        ctx.mark_non_differentiable(logp, *([ent] if with_entropy else []))
        return (loss, logp, ent) if with_entropy else (loss, logp)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("chunked_token_loss computed its gradients once, in the forward: its backward "
                               "cannot run twice (build the loss again instead of retain_graph=True)")
        grads, ctx.grads = ctx.grads, None  # once: the summed gradients are not kept past their use
        out = [None if gr is None else gr.mul_(grad_loss) for gr in grads]  # a scalar: the loss's weight
        return (*out, None, None, None, None, None)


def _check_shapes(hidden: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> None:
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and targets {tuple(targets.shape)} [N]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def chunked_token_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor | None, int, int], torch.Tensor],
                       temperature: float = 1.0, chunk_rows: int = 1024,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, logprobs [N], entropy [N] or None)`` of a loss summed over tokens, each chunk's logits
    built once; ``loss_fn(logp, ent, s, e)`` gives rows ``s .. e-1``'s part from their log-probs (and
    entropies, or None), reading no other row. Only ``loss`` carries a gradient."""
    _check_shapes(hidden, targets, chunk_rows)
    out = _ChunkedTokenLoss.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_rows),
                                  bool(with_entropy), loss_fn)
    return out if with_entropy else (*out, None)


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


def _logsumexp_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(torch.logsumexp(z, -1), total)`` for ``z [n, V]``, overwriting ``z`` with ``exp(z - max)``
    (``total``: its row sums), no fresh ``[n, V]`` tensor. A row whose max is infinite is shifted by
    0, as torch's is."""
    top = z.amax(-1, keepdim=True)  # [n, 1]
    top.masked_fill_(top.isinf(), 0.0)
    total = z.sub_(top).exp_().sum(-1)  # [n]
    return total.log().add_(top.squeeze(-1)), total


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

