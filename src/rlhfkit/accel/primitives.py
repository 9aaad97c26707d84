"""The operations of the accelerated forward (:mod:`.forward`): products, activations and their
backwards, the norm, attention and weight packing, each by name with its plain PyTorch
reference, in a :class:`rlhfkit.registry.Registry` as :mod:`rlhfkit.ops` keeps the core's.
:func:`.registry.install` registers the faster implementations that run here;
``tests/test_accel.py`` checks each against its reference.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..registry import Registry, not_taken

# --------------------------------------------------------------------------- references: linear layers


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def _add_linear(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if b is not None:
        return res + F.linear(x, w, b).view(res.shape)
    return torch.addmm(res.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t()).view(res.shape)


def _mm(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return F.linear(a, m.t())


def _grad_weight(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return a.t() @ b


def _addmm_(out: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return out.addmm_(a, m)


# --------------------------------------------------------------------------- references: activations, norm

C1 = 2.0 * math.sqrt(2.0 / math.pi)
C3 = 0.044715 * C1
_C1_TENSORS = {dtype: torch.tensor(C1, dtype=dtype) for dtype in (torch.float32, torch.float64)}


def c1(x: torch.Tensor) -> torch.Tensor:
    """``C1`` as a 0-dim CPU tensor of ``x``'s dtype (made once): ``addcmul``'s broadcast addend."""
    return _C1_TENSORS[x.dtype]


def gelu_gate(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(c1 x + c3 x^3)`` in three kernels (addcmul gives c1 + c3 x^2 in one): the tanh-GELU
    is ``x`` times it (``(1 + tanh z) / 2 = sigmoid(2z)``; a CPU tensor of float32 or float64)."""
    return torch.addcmul(c1(x), x, x, value=C3).mul_(x).sigmoid_()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return gelu_gate(x).mul_(x)


def _gelu_tanh_gate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = gelu_gate(x)
    return x * s, s


def _gelu_tanh_backward(x: torch.Tensor, s: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    # d/dx [x s(z)] = s + s (1 - s) x dz/dx,  x dz/dx = c1 x + 3 c3 x^3
    xdz = torch.addcmul(c1(x), x, x, value=3 * C3).mul_(x)
    return torch.addcmul(s, s, s, value=-1.0).mul_(xdz).add_(s).mul_(grad)  # (s - s^2) xdz + s


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).mul_(up)


def _swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad_act: torch.Tensor, want_act: bool):
    s = torch.sigmoid(gate)
    silu = gate * s
    act = silu * up if want_act else None
    grad_up = grad_act * silu
    grad_gate = grad_act.mul_(up).mul_(s.mul_(1 + gate * (1 - s)))  # d silu / dg = s (1 + g (1 - s))
    return act, grad_gate, grad_up


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


REFERENCE: dict[str, Callable] = {
    "linear": _linear, "add_linear": _add_linear, "mm": _mm, "grad_weight": _grad_weight,
    "addmm_": _addmm_, "gelu_tanh": _gelu_tanh, "gelu_tanh_gate": _gelu_tanh_gate,
    "gelu_tanh_backward": _gelu_tanh_backward, "swiglu": _swiglu, "swiglu_backward": _swiglu_backward,
    "rms_norm": _rms_norm, "pack": lambda weight, rows=None, keep=True: weight, "packable": lambda weight: False,
    # shortcuts
    "attention": not_taken, "causal_attention": not_taken, "decode_attention": not_taken,
    "graphed_decode_attention": not_taken,
}
_registry = Registry(REFERENCE)
register, get, reference, chosen = _registry.register, _registry.get, _registry.reference, _registry.chosen
_impl = _registry.impl


# --------------------------------------------------------------------------- the calls


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: ``x [..., K]``, ``w [N, K]`` (a transposed view is fine) -> ``[..., N]``."""
    return _impl["linear"](x, w, b)


def add_linear(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``res + F.linear(x, w, b)``, shaped as ``res``; without a bias one ``addmm``, the residual
    as its accumulator."""
    return _impl["add_linear"](res, x, w, b)


def mm(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``a @ m`` for ``a [M, K]``, ``m [K, N]``."""
    return _impl["mm"](a, m)


def grad_weight(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a.T @ b``, the gradient of ``weight`` (``g.T @ x`` for ``x @ w.T``; ``x.T @ g`` for GPT-2's ``x @ w``)."""
    return _impl["grad_weight"](a, b, weight)


def addmm_(out: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``out += a @ m`` in place (no graph recorded)."""
    return _impl["addmm_"](out, a, m)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x, approximate="tanh")`` as ``x * gelu_gate(x)``, no graph (a CPU float tensor)."""
    return _impl["gelu_tanh"](x)


def gelu_tanh_gate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu_tanh(x), gelu_gate(x))``: the output and the gate its backward reads."""
    return _impl["gelu_tanh_gate"](x)


def gelu_tanh_backward(x: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` times the derivative of :func:`gelu_tanh` at ``x``, from its ``gate``."""
    return _impl["gelu_tanh_backward"](x, gate, grad)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (a Llama MLP's activation), no graph."""
    return _impl["swiglu"](gate, up)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad_act: torch.Tensor, want_act: bool):
    """``(act or None, d_gate, d_up)``: :func:`swiglu`'s gradients given ``grad_act`` (which may
    be overwritten), and with ``want_act`` the activation again."""
    return _impl["swiglu_backward"](gate, up, grad_act, want_act)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, x.shape[-1:], weight, eps)``, differentiable."""
    return _impl["rms_norm"](x, weight, eps)


def pack(weight: torch.Tensor, rows: int | None = None, keep: bool = True):
    """``weight``, or a copy packed for a generation call's no-grad products over at most ``rows``
    rows (callable as ``F.linear``'s weight, with ``.add(res, x, b)``); ``keep=False``: only the
    packed copy is kept."""
    return _impl["pack"](weight, rows, keep)


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` packs ``weight``."""
    return _impl["packable"](weight)


def attention(q, k, v, bias, scale: float, shared=None) -> torch.Tensor | None:
    """Shortcut: ``F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
    enable_gqa=True)`` for ``q [B, H, Tq, D]``, ``k, v [B, Hkv, Tk, D]``, an additive ``bias [B, 1,
    Tq|1, Tk]``; ``shared``: a decode step's rows that share their prompt's keys. None: not taken."""
    return _impl["attention"](q, k, v, bias, scale, shared)


def causal_attention(q, k, v, mask, scale: float) -> torch.Tensor | None:
    """Shortcut: :func:`attention` under a causal boolean ``mask [B, Tq, Tk]`` (True: may attend),
    the queries at the last ``Tq`` positions. None: not taken."""
    return _impl["causal_attention"](q, k, v, mask, scale)


def decode_attention(qkv, kv, bias, out, scale: float):
    """Shortcut: a decode step's attention bound to fixed buffers, ``step(t)`` (GPT-2's layout:
    ``qkv [B, 3, H, D]``, cache ``kv [B, 2, H, T, D]``, key ``bias [B, T]``, ``out [B, H, D]``). None: not taken."""
    return _impl["decode_attention"](qkv, kv, bias, out, scale)


def graphed_decode_attention(kv, heads: int):
    """Shortcut: for a CUDA-graphed decode step over the cache ``kv [B, 2, Hkv, T, D]``, an attention
    ``fn(q, k, v, bias, t, scale)`` that reads the step's column ``t`` from device memory. None: not taken."""
    return _impl["graphed_decode_attention"](kv, heads)
