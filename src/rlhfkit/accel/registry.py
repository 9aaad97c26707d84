"""The accel package's implementations of :mod:`rlhfkit.ops`' names and of its own forward's
(:mod:`.primitives`), each taking the inputs it was measured to pay on and handing any other to
the reference (``ref``, bound by :func:`install`)."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from . import forward, gemm, kernels, primitives, triton_decode

LINEAR_OPS = ("linear", "add_linear", "mm", "grad_weight", "addmm_")  # the forward's; the core's: linear, mm_out


def install(register: Callable, reference: Callable, force: bool = False) -> dict[str, str]:
    """Call ``register(name, fn, label)`` for every faster implementation of a core name that runs
    here, ``fn`` bound to ``reference(name)``, the plain one it hands other inputs to, and register
    the forward's own operations (:mod:`.primitives`) likewise; returns those as ``{name: label}``.
    ``force`` (``accel.enabled=on``): oneDNN's float32 products on any CPU that has them, not only
    where they were measured faster (AMD with AVX-512)."""
    inner = primitives.register  # ops.configure reset every registry before
    for name, fn in forward.SHORTCUTS.items():  # plain PyTorch: faster than the models' own forward everywhere
        register(name, fn, "lean-forward")
    gemm.configure(force)
    if gemm.enabled():
        register("linear", gemm.linear, "onednn")
        register("mm_out", gemm.mm_out, "onednn")
        for name in LINEAR_OPS:
            inner(name, getattr(gemm, name), "onednn")
    if gemm.packing():
        inner("pack", pack, "onednn")
        inner("packable", gemm.packable, "onednn")
    if kernels.available():
        for name, fn in C_OPERATIONS.items():
            inner(name, partial(fn, primitives.reference(name)), "c-kernels")
        for name, fn in C_SHORTCUTS.items():
            inner(name, fn, "c-kernels")
        for name, fn in C_CORE_SHORTCUTS.items():
            register(name, fn, "c-kernels")
        if gemm.enabled():
            inner("causal_attention", causal_attention, "c-kernels+onednn")
    if triton_decode.importable():
        inner("graphed_decode_attention", graphed_decode_attention, "triton")
    return primitives.chosen()


def pack(weight: torch.Tensor, rows: int | None = None, keep: bool = True):
    return gemm.Packed(weight, rows, keep) if gemm.packable(weight) else weight


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def gelu_tanh(ref, x: torch.Tensor) -> torch.Tensor:
    return kernels.gelu_tanh(x) if _f32_cpu(x) else ref(x)


def gelu_tanh_gate(ref, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not _f32_cpu(x):
        return ref(x)
    s = torch.empty_like(x)
    return kernels.gelu_tanh(x, gate=s), s  # both in one pass


def gelu_tanh_backward(ref, x: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if _f32_cpu(x, gate) and grad.dtype == torch.float32:
        return kernels.gelu_tanh_backward(x, gate, grad)
    return ref(x, gate, grad)


def swiglu(ref, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return kernels.swiglu(gate, up) if _f32_cpu(gate, up) else ref(gate, up)


def swiglu_backward(ref, gate: torch.Tensor, up: torch.Tensor, grad_act: torch.Tensor, want_act: bool):
    if _f32_cpu(gate, up):
        return kernels.swiglu_backward(gate, up, grad_act, want_act)
    return ref(gate, up, grad_act, want_act)


def rms_norm(ref, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if kernels.rms_norm_bf16_usable(x, weight):
        return kernels.rms_norm_bf16(x, weight, eps)
    return ref(x, weight, eps)


def attention(q, k, v, bias, scale: float, shared=None):
    if q.shape[2] == 1 and kernels.decode_bf16_usable(q, k, v, bias):
        return kernels.decode_attention_bf16(q, k, v, bias, scale, shared)
    if kernels.worth_it(q, k, v):
        return kernels.attention(q, k, v, bias[:, 0], scale)  # [B, H, Tq, D], a view of [B, Tq, H, D]
    return None


def causal_attention(q, k, v, mask, scale: float):
    return kernels.block_attention(q, k, v, mask, scale) if kernels.block_usable(q, k, v, mask) else None


def decode_attention(qkv, kv, bias, out, scale: float):
    B, _, H, T, D = kv.shape
    return kernels.decode_attention(qkv, kv, bias, out, scale) if kernels.usable(kv, B * H * T * D, T, D, 1) else None


def graphed_decode_attention(kv, heads: int):
    return triton_decode.attention if triton_decode.usable(kv, heads) else None


def head_lse(z: torch.Tensor, targets: torch.Tensor):
    return kernels.head_lse_bf16(z, targets) if kernels.head_usable(z) else None


def head_grad(z: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, targets: torch.Tensor):
    return kernels.head_grad_bf16(z, lse, coef, targets) if kernels.head_usable(z) else None


def sampler(B: int, R: int, V: int, temperature: float, eos: int):
    return kernels.Sampler(B, R, V, temperature, eos) if kernels.sampler_usable(B, V) else None


C_OPERATIONS = {  # each handed its reference
    "gelu_tanh": gelu_tanh, "gelu_tanh_gate": gelu_tanh_gate, "gelu_tanh_backward": gelu_tanh_backward,
    "swiglu": swiglu, "swiglu_backward": swiglu_backward, "rms_norm": rms_norm,
}
C_SHORTCUTS = {"attention": attention, "decode_attention": decode_attention}  # None where they do not take the inputs
C_CORE_SHORTCUTS = {"head_lse": head_lse, "head_grad": head_grad, "sampler": sampler}
