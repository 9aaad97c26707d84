"""The accelerated forward of GPT-2 and Llama-like models (Llama, Qwen2, Qwen3, Mistral): the
computation of the model's own ``transformers`` forward run straight from its parameters (no
copies: autograd and the optimizer see the usual ``nn.Parameter``s), without the generality
(cache classes, mask factories, hooks) that costs more than the arithmetic at the sizes RLHF on
a CPU deals with.

It stands behind :mod:`rlhfkit.ops`' forward shortcuts (:func:`runs_forward`,
:func:`hidden_states`, :func:`response_hidden_states`, :func:`decoder`; registered by
:mod:`.registry`), each answering None for a model it does not compute (:func:`supported`),
which then runs its own forward:

* :func:`hidden_states` -- the full-sequence forward (left or right padding, with grad);
* :func:`response_hidden_states` -- the same with each prompt repeated across rows run once;
* :func:`prefill` / :func:`decode_step` -- generation with a pre-allocated KV cache.

Products, activations, the norm and attention go through :mod:`.primitives`. A float32
training forward keeps fewer activations for its backward (:class:`_NormLinears`,
:class:`_SwiGLUDown`, :class:`_GeluDown`). Differences from ``transformers`` are rounding only;
``tests/test_lean.py`` compares hidden states, gradients and generations to 1e-5. Why each
choice pays: ``benchmarks/archive/code-evidence.md``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..registry import repeated_rows
from . import primitives as prim

_LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")  # Qwen3: q and k normed per head


def _unwrap(model: nn.Module) -> nn.Module:
    """The ``transformers`` model under a peft wrapper (its layers carry the adapters); any other model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _base(model: nn.Module) -> nn.Module:
    """The decoder stack (``GPT2Model`` / ``LlamaModel`` ...) of a model with or without a head."""
    model = _unwrap(model)
    return getattr(model, "base_model", model)


# a model's dropout modules, found once: supported() runs before every forward, and walking the
# module tree each time cost a small model's training step ~2%
_DROPOUTS: weakref.WeakKeyDictionary[nn.Module, list[nn.Dropout]] = weakref.WeakKeyDictionary()


def _dropout_active(model: nn.Module) -> bool:
    if not model.training:
        return False
    found = _DROPOUTS.get(model)
    if found is None:
        found = _DROPOUTS[model] = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    return any(m.p > 0 for m in found)  # p read now: disable_dropout() after the first call counts


def _adapted(m: nn.Module) -> bool:
    """A peft tuner layer (LoRA or another), wrapping the real layer as ``base_layer``."""
    return hasattr(m, "base_layer")


def _sharded(t: torch.Tensor) -> bool:
    """FSDP2's sharded tensors (DTensors): what ``rlhfkit.run.distributed.is_sharded`` tests."""
    return type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "full_tensor")


def _plain(*modules: nn.Module) -> bool:
    """No module is a peft tuner layer and no parameter of theirs (their own, not their
    children's) is sharded (FSDP2's DTensor)."""
    return not any(_adapted(m) or any(_sharded(p) for p in m._parameters.values()) for m in modules)


def _active_loras(m: nn.Module) -> list[str]:
    """The adapters a peft LoRA layer applies now (none inside ``disable_adapter()``)."""
    return [] if m.disable_adapters else [a for a in m.active_adapters if a in m.lora_A]


def _plain_linear(m: nn.Module, kind: str) -> bool:
    """A linear layer of class ``kind`` ('Conv1D', 'Linear') with plain parameters, or plain LoRA
    on one (peft's ``lora.Linear``: not merged, no DoRA or other variant, no bias on B). peft
    keeps the adapters of a bfloat16 or float16 base in float32 and runs them beside the base
    product; so does this path (:class:`_Unmerged`, its products in the base's precision as under
    autocast) for a Llama-like model's layers. Folding
    such an adapter into the base weight would round its update to the weight's precision (a
    bfloat16 weight keeps 8 bits: early updates vanish). GPT-2's layers take such adapters
    through peft's own forward."""
    if _adapted(m):
        if not hasattr(m, "lora_A") or m.merged or getattr(m, "lora_variant", None):
            return False
        dtype = getattr(getattr(m.base_layer, "weight", None), "dtype", None)
        return _plain_linear(m.base_layer, kind) and all(
            _plain(m.lora_A[a], m.lora_B[a]) and m.lora_B[a].bias is None
            and m.lora_A[a].weight.dtype == m.lora_B[a].weight.dtype
            and (m.lora_A[a].weight.dtype == dtype or (kind == "Linear" and dtype in _HALF))
            for a in _active_loras(m))
    return type(m).__name__ == kind and _plain(m)


_HALF = (torch.bfloat16, torch.float16)


def _lora_delta(m: nn.Module, adapter: str) -> torch.Tensor:
    """``scaling * B @ A`` of one adapter of a peft LoRA layer in its base weight's layout
    (as ``rlhfkit.models.forward.lora_delta``)."""
    delta = (m.lora_B[adapter].weight @ m.lora_A[adapter].weight) * m.scaling[adapter]  # [out, in]
    return delta.T if getattr(m, "fan_in_fan_out", False) else delta


@dataclass(frozen=True)
class _Unmerged:
    """A half-precision linear weight ``[out, in]`` and LoRA adapters kept in float32 beside it,
    ``(A [r, in], B [out, r], scaling)`` each. The adapters' products run in the base's precision,
    as ``torch.autocast`` runs peft's ``lora.Linear`` (and so TRL and the Hugging Face Trainer at
    ``bf16=True``): ``A`` and ``B`` are cast down for the product (their gradients arrive in
    float32 through the cast), and ``y + scaling * (x A^T) B^T`` is one ``addmm`` that accumulates
    in float32 and rounds once, where autocast rounds the adapter's output, its scaling and the
    sum apart. Folding the adapter into a half-precision weight instead would round its small
    entries away. Much faster than the adapters' products in float32, and the hidden states and
    the adapters' gradients stay as close to float32's as peft's under autocast
    (``tests/test_lean.py``; timings: benchmarks/archive/code-evidence.md). Stands where a weight
    tensor stands in a layer's tuple; only :func:`_linear` and :func:`_add_linear` apply it (the
    half-precision forward never takes the float32-only :class:`_NormLinears` /
    :class:`_SwiGLUDown`)."""

    weight: torch.Tensor
    loras: tuple[tuple[torch.Tensor, torch.Tensor, float], ...]
    pack: bool = False  # the stacked weight packed (prim.pack) where it can be
    stacked: list = field(default_factory=list, compare=False)  # ([W; A_1; ...], bias, [bias; 0]) once made

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if (not torch.is_grad_enabled() and x2.shape[0] <= STACK_ROWS and x.device.type == "cpu"
                and self.weight.numel() <= STACK_MAX_WEIGHT and all(a.dtype == x.dtype for a, _, _ in self.loras)):
            # a decode step's few rows: the base product and each x A^T as one product over the
            # weight with the A's stacked under it, made once a generation call (the adapters are
            # cast once a call too, by _weight): one call a layer fewer, each of which cost more
            # to dispatch than its [64, r] product (benchmarks/archive/code-evidence.md)
            if not self.stacked or self.stacked[1] is not bias:
                rank = sum(a.shape[0] for a, _, _ in self.loras)
                w = torch.cat([self.weight, *(a for a, _, _ in self.loras)])
                self.stacked[:] = [prim.pack(w, STACK_ROWS, keep=False) if self.pack else w, bias,
                                   None if bias is None else torch.cat([bias, bias.new_zeros(rank)])]
            n = self.weight.shape[0]
            yt = _linear(x2, self.stacked[0], self.stacked[2])  # [rows, out + sum r]: x W^T + bias, then each x A^T
            out, at = yt[:, :n], n
            for a, b, scaling in self.loras:
                out = torch.addmm(out, yt[:, at:at + a.shape[0]], b.t(), alpha=scaling)
                at += a.shape[0]
            return out.view(*x.shape[:-1], n)
        y = F.linear(x, self.weight, bias)
        out = y.view(-1, y.shape[-1])
        for a, b, scaling in self.loras:
            out = torch.addmm(out, F.linear(x2, a.to(x.dtype)), b.to(x.dtype).t(), alpha=scaling)
        return out.view(y.shape)


# _Unmerged stacks its adapters under the weight for no-grad calls of at most STACK_ROWS rows on a
# CPU, for weights of at most STACK_MAX_WEIGHT elements: the stacked copy lives as long as the
# generation call, and the call it saves (~20 us) matters beside a small weight's product (216 us
# for SmolLM2's [1536, 576] at 64 rows), not beside a 7B model's (and CUDA graphs replay a GPU's)
STACK_ROWS, STACK_MAX_WEIGHT = 256, 1 << 22
# a generation call of at least PACK_STEPS decode steps packs its bfloat16 weights (prim.pack):
# packing costs once a call and saves on every decode step (benchmarks/archive/code-evidence.md).
# A weight that is not copied for the call anyway (plain weights, the head) is packed beside the
# live one: only up to STACK_MAX_WEIGHT elements, the head up to PACK_MAX_HEAD (SmolLM2's has 28M,
# 56 MB in bfloat16), so a large model's generation does not hold a second copy
PACK_STEPS, PACK_MAX_HEAD = 16, 1 << 25


def decode_packed(weight: torch.Tensor, limit: int = STACK_MAX_WEIGHT):
    """``weight`` packed for a generation call's decode steps beside the live one (a copy for
    the call: only up to ``limit`` elements), or ``weight`` itself where it cannot be packed."""
    return prim.pack(weight, STACK_ROWS) if weight.numel() <= limit else weight


def packs(input_ids: torch.Tensor, max_new_tokens: int) -> bool:
    """Whether a generation call over ``input_ids`` packs its bfloat16 weights (on a CPU, and only
    where :func:`.primitives.pack` packs; a float32 weight is never packed)."""
    return input_ids.device.type == "cpu" and input_ids.shape[0] <= STACK_ROWS and max_new_tokens >= PACK_STEPS


def _linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.primitives.linear`, or the product of an :class:`_Unmerged` layer, of
    :class:`_StackedLoRAs` or of a packed weight."""
    return prim.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x, b)


def _add_linear(res: torch.Tensor, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.primitives.add_linear`, or the residual plus an :class:`_Unmerged` layer's or a
    packed weight's product (:func:`.primitives.pack`)."""
    if isinstance(w, _Unmerged):
        return res + w(x, b).view(res.shape)
    if not isinstance(w, torch.Tensor):
        return w.add(res, x, b)
    return prim.add_linear(res, x, w, b)


def _weight(m: nn.Module, pack: bool = False) -> tuple[torch.Tensor | _Unmerged, torch.Tensor | None]:
    """``(weight, bias)`` of a linear layer as it computes now. For a LoRA layer the base weight
    plus :func:`_lora_delta` of each active adapter, built out of place: the same function as peft's ``base(x) + B(A(x)) * scaling``
    up to rounding, and the update's gradient reaches A and B through it (the frozen base
    weight gets none). Adapters in another dtype than the base weight (float32 on a half-precision
    base) stay apart: an :class:`_Unmerged` weight. ``pack``: a generation call's weights, whose
    decode steps' products take a bfloat16 weight packed once (:func:`.primitives.pack`)."""
    if not _adapted(m):
        return (decode_packed(m.weight) if pack else m.weight), m.bias
    weight, active = m.base_layer.weight, _active_loras(m)
    if active and m.lora_A[active[0]].weight.dtype != weight.dtype:
        loras = tuple((m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a]) for a in active)
        if not torch.is_grad_enabled():  # generation or scoring: cast once a call, not at every decode step's product
            loras = tuple((a.to(weight.dtype), b.to(weight.dtype), s) for a, b, s in loras)
        return _Unmerged(weight, loras, pack), m.base_layer.bias
    for adapter in active:
        weight = weight + _lora_delta(m, adapter)
    return weight, m.base_layer.bias


def supported(model: nn.Module) -> bool:
    """True when :func:`hidden_states` / :func:`prefill` reproduce this model's forward: a GPT-2
    or Llama-like stack of plain layers or plain LoRA on its linear layers (peft; no other
    adapters, quantised or otherwise replaced layers, no sharded parameters), no active
    dropout, no sliding window. Cheap enough to ask before every forward: the layers' types and
    parameters are looked at directly, and the dropout modules are found once per model."""
    base = _base(model)
    cfg = getattr(base, "config", None)
    if cfg is None or _dropout_active(base):
        return False
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is not None and not _plain(head):
        return False
    kind = getattr(cfg, "model_type", None)
    if kind == "gpt2":
        if (not hasattr(base, "h") or cfg.add_cross_attention or cfg.scale_attn_by_inverse_layer_idx
                or cfg.reorder_and_upcast_attn or not cfg.scale_attn_weights):
            return False
        layers = [(b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj) for b in base.h]
        return _plain(base.wte, base.wpe, base.ln_f, *(b.ln_1 for b in base.h), *(b.ln_2 for b in base.h)) and all(
            _plain_linear(m, "Conv1D") for ms in layers for m in ms)
    if kind in _LLAMA_LIKE:
        if (not hasattr(base, "rotary_emb") or "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
                or getattr(cfg, "pretraining_tp", 1) != 1 or not len(base.layers) or _windowed(cfg)):
            return False
        return _plain(base.embed_tokens, base.norm) and all(
            hasattr(b.self_attn, "q_norm") == (kind == "qwen3") and _plain(b.input_layernorm, b.post_attention_layernorm)
            and (kind != "qwen3" or _plain(b.self_attn.q_norm, b.self_attn.k_norm)) and all(
                _plain_linear(m, "Linear")
                for m in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj,
                          b.self_attn.o_proj, b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj))
            for b in base.layers)
    return False


def _windowed(cfg) -> bool:
    """A Mistral config whose sliding window is shorter than its context (Llama's, Qwen's: ``layer_types``)."""
    window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
    return window is not None and window < cfg.max_position_embeddings


# --------------------------------------------------------------------------- pieces


class _GeluTanhCPU(torch.autograd.Function):
    """``gelu(x, approximate='tanh')`` as ``x * sigmoid(c1 x + c3 x^3)`` (the identity
    ``(1 + tanh z) / 2 = sigmoid(2z)``): this CPU build's ``tanh`` is ~3.5x slower than its
    ``sigmoid``, and the tanh-GELU is the largest element-wise cost of a GPT-2 step. Both
    passes work in place on their own temporaries (fewer allocations, fewer page faults)."""

    @staticmethod
    def forward(ctx, x):
        out, s = prim.gelu_tanh_gate(x)
        ctx.save_for_backward(x, s)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved_tensors
        return prim.gelu_tanh_backward(x, s, grad)


def _gelu_by_gate(x: torch.Tensor) -> bool:
    """Whether the sigmoid-gate form below applies: a CPU tensor of a dtype with a constant in
    :func:`.primitives.c1` (a CPU scalar cannot be ``addcmul``'s addend for a CUDA tensor)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    if not _gelu_by_gate(x):
        return F.gelu(x, approximate="tanh")
    if torch.is_grad_enabled() and x.requires_grad:
        return _GeluTanhCPU.apply(x)
    return prim.gelu_tanh(x)  # no graph to keep: the gate's memory is reused


def _gpt2_act(mlp: nn.Module):
    if type(mlp.act).__name__ in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):
        return _gelu_tanh  # the same function as gelu_new, 2 kernels (CPU) or 1 (GPU) instead of 7
    return mlp.act


def _norm_params(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _rms_norm(params: tuple[torch.Tensor, float], x: torch.Tensor) -> torch.Tensor:
    weight, eps = params
    if x.dtype == weight.dtype:  # the formula below as one fused kernel each way; in half precision it
        # rounds once where the formula rounds the normalised rows and their product with the weight
        # apart, and is faster; on a CPU in bfloat16 an accelerated one where registered, whose
        # backward is one pass a row where PyTorch's is about ten (benchmarks/archive/code-evidence.md)
        return prim.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)  # (y, rstd); not in every torch


def _norm_with_stats(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """``(norm(x), rstd [N, 1], mean [N, 1] or None)``: an RMS norm (``bias`` None) or a layer
    norm of ``x [N, C]`` and the per-row statistics its backward needs, from the norm's own
    kernel (``native_layer_norm``, ``_fused_rms_norm``) rather than a second pass over ``x``: at
    the doubling task's 64-wide model ``var_mean`` alone took 5% of a GRPO update. The same
    numbers as ``F.layer_norm`` / ``F.rms_norm``, which call those kernels."""
    C = x.shape[-1:]
    if bias is not None:
        h, mean, rstd = torch.native_layer_norm(x, C, weight, bias, eps)
        return h, rstd, mean
    if _FUSED_RMS_NORM is not None and x.dtype == weight.dtype:
        h, rstd = _FUSED_RMS_NORM(x, list(C), weight, eps)
        return h, rstd, None
    return F.rms_norm(x, C, weight, eps), torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)), None


class _NormLinears(torch.autograd.Function):
    """Linear layers reading one norm's output: a Llama layer's q, k, v (or gate and up) after
    its RMS norm, GPT-2's q/k/v or MLP input after its layer norm. Keeps ``x [N, C]`` and the
    norm's per-row statistics for the backward instead of the normalised rows, which are
    computed again there (two element-wise passes): autograd would keep the norm's input and
    output both, so this keeps ``C`` fewer numbers a token for every norm of every layer.
    The forward is the layers' own arithmetic (``F.rms_norm`` / ``F.layer_norm``, then
    ``F.linear``, or ``addmm(b, h, w)`` for GPT-2's ``Conv1D`` weights stored ``[in, out]``).

    ``forward(ctx, x, norm_weight, norm_bias, eps, conv1d, w_1, b_1, w_2, b_2, ...)`` ->
    ``(y_1, y_2, ...)``; ``norm_bias`` None: an RMS norm, else a layer norm."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps, conv1d, *linears):
        h, rstd, mean = _norm_with_stats(x, norm_weight, norm_bias, eps)
        weights, biases = linears[0::2], linears[1::2]
        ctx.save_for_backward(x, norm_weight, norm_bias, rstd, mean, *weights)
        ctx.conv1d, ctx.biased = conv1d, [b is not None for b in biases]
        return tuple(prim.linear(h, w.t() if conv1d else w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, norm_weight, norm_bias, rstd, mean, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        xhat = (x if mean is None else x - mean) * rstd  # the normalised rows again
        h = xhat * norm_weight if norm_bias is None else torch.addcmul(norm_bias, xhat, norm_weight)
        grad_h, out = None, [None] * (2 * len(weights))
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            if need[5 + 2 * i]:
                out[2 * i] = prim.grad_weight(h, g, w) if ctx.conv1d else prim.grad_weight(g, h, w)
            if need[6 + 2 * i] and ctx.biased[i]:
                out[2 * i + 1] = g.sum(0)
            if any(need[:3]):
                wt = w.t() if ctx.conv1d else w
                grad_h = prim.mm(g, wt) if grad_h is None else prim.addmm_(grad_h, g, wt)
        grad_x = grad_nw = grad_nb = None
        if grad_h is not None:
            grad_nw = (grad_h * xhat).sum(0) if need[1] else None
            grad_nb = grad_h.sum(0) if need[2] else None
            if need[0]:
                u = grad_h * norm_weight
                grad_x = u - xhat * (u * xhat).mean(-1, keepdim=True)
                if mean is not None:  # a layer norm's centring
                    grad_x -= u.mean(-1, keepdim=True)
                grad_x *= rstd
        return grad_x, grad_nw, grad_nb, None, None, *out


class _SwiGLUDown(torch.autograd.Function):
    """``x + F.linear(silu(gate) * up, weight, bias)``: a Llama MLP's tail and its residual,
    keeping ``gate`` and ``up`` only. Autograd would also keep ``silu(gate)`` and the product (the
    down projection's input): two of the layer's widest tensors, about a third of its saved
    activations. The backward computes them again (:func:`.primitives.swiglu_backward`).

    ``x [N, C]``, ``gate, up [N, I]``, ``weight [C, I]``."""

    @staticmethod
    def forward(ctx, x, gate, up, weight, bias):
        act = prim.swiglu(gate, up)
        ctx.save_for_backward(gate, up, weight)
        ctx.biased = bias is not None
        return prim.add_linear(x, act, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        need_x, need_gate, need_up, need_w, need_b = ctx.needs_input_grad
        grad_act = prim.mm(grad, weight)  # [N, I]
        act, grad_gate, grad_up = prim.swiglu_backward(gate, up, grad_act, need_w)
        grad_w = prim.grad_weight(grad, act, weight) if need_w else None
        grad_b = grad.sum(0) if need_b and ctx.biased else None
        return grad if need_x else None, grad_gate, grad_up, grad_w, grad_b


class _GeluDown(torch.autograd.Function):
    """``x + addmm(bias, gelu_tanh(f), weight)``: GPT-2's MLP tail (``Conv1D`` weight ``[I, C]``)
    and its residual, keeping ``f`` (the MLP's input projection) only. Autograd would also keep
    the GELU's gate and its output (the down projection's input), two tensors as wide as ``f``;
    the backward computes them again (:func:`.primitives.gelu_tanh_gate`)."""

    @staticmethod
    def forward(ctx, x, f, weight, bias):
        if _gelu_by_gate(f):
            m = prim.gelu_tanh(f)
        else:  # a GPU (one fused kernel), or a dtype the gate has no constant for
            m = F.gelu(f, approximate="tanh")
        ctx.save_for_backward(f, weight)
        ctx.biased = bias is not None
        return prim.add_linear(x, m, weight.t(), bias)

    @staticmethod
    def backward(ctx, grad):
        f, weight = ctx.saved_tensors
        need_x, need_f, need_w, need_b = ctx.needs_input_grad
        grad_m = prim.mm(grad, weight.t())  # [N, I]
        if _gelu_by_gate(f):
            m, s = prim.gelu_tanh_gate(f)
            grad_f = prim.gelu_tanh_backward(f, s, grad_m)
        else:
            m = F.gelu(f, approximate="tanh") if need_w else None
            grad_f = torch.ops.aten.gelu_backward(grad_m, f, approximate="tanh")
        grad_w = prim.grad_weight(m, grad, weight) if need_w else None
        grad_b = grad.sum(0) if need_b and ctx.biased else None
        return grad if need_x else None, grad_f, grad_w, grad_b


def _lean_training(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a layer's norms and MLP keep fewer activations (:class:`_NormLinears`,
    :class:`_SwiGLUDown`, :class:`_GeluDown`): a float32 forward that records a graph."""
    return torch.is_grad_enabled() and x.dtype == weight.dtype == torch.float32


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == swap_halves(x) * _signed_sin(sin)``."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = [-x2, x1]``) in
    three operations: the sign is in ``signed_sin`` (:func:`_signed_sin`, once per forward).
    ``x [B, H, T, D]``, ``cos / signed_sin [B, 1, T, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)


def _attend(q, k, v, mask, scale, groups: int, additive: dict | None = None,
            shared: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Masked softmax attention: ``q [B, H, Tq, D]``, ``k, v [B, Hkv, Tk, D]``, ``mask [B, 1, Tq|1, Tk]``
    boolean (True = may attend) or additive. Every mask here is causal with the queries at the
    last ``Tq`` of the ``Tk`` positions (a forward, a prompt, the responses after a shared
    prompt, a decode step). :func:`.primitives.causal_attention` (a boolean mask) and
    :func:`.primitives.attention` may take it; otherwise PyTorch's.

    ``additive``: a dict that lives as long as one forward through the layers; a boolean mask
    the other two routes need as an additive one is converted once into it and reused by
    every layer (:func:`_additive`). ``shared``: a decode step's :attr:`KVCache.shared`, with
    which a faster decode attention reads each group's prompt once."""
    if mask.dtype == torch.bool and mask.shape[2] == q.shape[2]:
        if (out := prim.causal_attention(q, k, v, mask[:, 0], scale)) is not None:
            return out
    if mask.dtype == torch.bool:
        mask = _additive(mask, q.dtype, {} if additive is None else additive)
    if (out := prim.attention(q, k, v, mask, scale, shared)) is not None:
        return out
    if _fold_heads(q, k, groups):
        B, H, Tq, D = q.shape
        folded = _folded_mask(mask, groups, Tq, {} if additive is None else additive)
        return F.scaled_dot_product_attention(q.reshape(B, H // groups, groups * Tq, D), k, v, attn_mask=folded,
                                              scale=scale).reshape(B, H, Tq, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def _fold_heads(q: torch.Tensor, k: torch.Tensor, groups: int) -> bool:
    """Whether grouped heads should run as one head of ``groups x Tq`` queries a key head: a
    half-precision CPU forward that autograd records, with several queries a row. PyTorch's CPU
    flash attention handles ``enable_gqa`` by head, and its bfloat16 backward pays per head, so
    folding makes the backward faster at the same forward. Each query's output is the same bit
    for bit (its keys and mask do not change); the keys' and values' gradients differ by the
    order of the sums. Float32 and no-grad forwards gain nothing: those keep the grouped call
    (timings: benchmarks/archive/code-evidence.md)."""
    return (groups > 1 and q.shape[2] > 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))


def _folded_mask(mask: torch.Tensor, groups: int, Tq: int, memo: dict) -> torch.Tensor:
    """The additive ``mask [B, 1, Tq | 1, Tk]`` for :func:`_fold_heads`' queries, ``[B, 1, groups x
    Tq, Tk]``, the mask repeated for each head of a group; made once per ``memo`` (one forward)."""
    hit = memo.get(("folded", id(mask), groups, Tq))
    if hit is None or hit[0] is not mask:
        B, Tk = mask.shape[0], mask.shape[3]
        hit = memo[("folded", id(mask), groups, Tq)] = (
            mask, mask.expand(B, 1, Tq, Tk).unsqueeze(2).expand(B, 1, groups, Tq, Tk).reshape(B, 1, groups * Tq, Tk))
    return hit[1]


def _additive(mask: torch.Tensor, dtype: torch.dtype, memo: dict) -> torch.Tensor:
    """The boolean ``mask`` as an additive one (0 attend, -inf never), made once per ``memo``.
    PyTorch's attention would convert a boolean mask itself, the same way (bit for bit), on
    every call, and keep each layer's conversion for the backward: at the reasoning update's
    micro-batch (8 rows x 511 response queries x 575 keys, 30 layers) that was 270 MiB of
    identical float masks. The memo holds the boolean mask too, so its ``id`` cannot be reused."""
    hit = memo.get(id(mask))
    if hit is None or hit[0] is not mask or hit[1].dtype != dtype:
        hit = memo[id(mask)] = (mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                                .masked_fill_(~mask, float("-inf")))
    return hit[1]


def _full_mask(attention_mask: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, 1, T, T]`` causal and key-padding mask, boolean or (with ``dtype``) additive. Every
    query may see itself, so rows of padding get a finite (unused) output instead of a
    softmax over nothing."""
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]: key j <= query i
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
    allowed = causal & (keys | torch.eye(T, dtype=torch.bool, device=attention_mask.device))
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class _StackedLoRAs:
    """Generation only: several LoRA layers reading one input (q, k and v; gate and up), each
    with one adapter of the same scaling in the base's half precision (:class:`_Unmerged`, cast
    for the call), as two products: ``x [W_1; ...; A_1; ...]^T`` (plus the biases) and the
    adapters' outputs times the block-diagonal ``[B_1, ...]``, added with ``addmm``, over a
    decode step's rows (at most ``STACK_ROWS``; more rows take the layers apart). Each output
    column sums what :class:`_Unmerged`'s stacked product sums, the block-diagonal product adding
    exact zeros for the other layers' ranks: the same numbers bit for bit (``tests/test_gemm.py``;
    SmolLM2's logits too). Two calls where the layers apart make two each, which is faster on a
    CPU's decode steps (benchmarks/archive/code-evidence.md). The stacked weight is packed
    (:func:`.primitives.pack`) and only the packed copy kept."""

    def __init__(self, layers: list[_Unmerged], biases: list[torch.Tensor | None]):
        self.apart = list(zip(layers, biases))
        weights = [u.weight for u in layers]
        (_, _, self.scaling), = layers[0].loras
        A = [a for u in layers for a, _, _ in u.loras]
        stacked = torch.cat([*weights, *A])
        self.n, rank = sum(w.shape[0] for w in weights), sum(a.shape[0] for a in A)
        self.weight = prim.pack(stacked, STACK_ROWS, keep=False)
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)] + [stacked.new_zeros(rank)])
        self.B = stacked.new_zeros((self.n, rank))  # block-diagonal
        row = col = 0
        for u in layers:
            (_, b, _), = u.loras
            self.B[row:row + b.shape[0], col:col + b.shape[1]] = b
            row, col = row + b.shape[0], col + b.shape[1]

    @staticmethod
    def fits(pairs: list[tuple]) -> bool:
        """Layers this class computes: :class:`_Unmerged` with one adapter each, of one scaling, in
        the weight's dtype (generation casts them), at most ``STACK_MAX_WEIGHT`` elements in all,
        on weights it can pack (bfloat16 on a CPU with oneDNN's: where it was measured and
        checked bit for bit; a float16 base keeps the layers apart)."""
        return (all(isinstance(u, _Unmerged) and len(u.loras) == 1 and u.loras[0][0].dtype == u.weight.dtype
                    and prim.packable(u.weight) for u, _ in pairs)
                and len({u.loras[0][2] for u, _ in pairs}) == 1
                and sum(u.weight.numel() for u, _ in pairs) <= STACK_MAX_WEIGHT)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > STACK_ROWS or torch.is_grad_enabled():  # a prefill's rows: the layers apart, as
            # _Unmerged runs them there (oneDNN blocks a product over many rows by its shape, so a
            # stacked one would round differently)
            return torch.cat([u(x2, b) for u, b in self.apart], 1).view(*x.shape[:-1], self.n)
        yt = _linear(x2, self.weight, self.bias)  # [rows, n + sum r]
        out = torch.addmm(yt[:, :self.n], yt[:, self.n:], self.B.t(), alpha=self.scaling)
        return out.view(*x.shape[:-1], self.n)


def _fuse(pairs: list[tuple], lora: bool = False) -> list[tuple]:
    """``[(weight, bias)]`` computing several linear layers' ``(weight, bias)`` on the same input,
    outputs concatenated; ``lora``: LoRA layers too, as :class:`_StackedLoRAs` where it fits. The
    pairs themselves otherwise if one is not a tensor."""
    if lora and _StackedLoRAs.fits(pairs):
        return [(_StackedLoRAs([u for u, _ in pairs], [b for _, b in pairs]), None)]
    if not all(isinstance(w, torch.Tensor) for w, _ in pairs):
        return pairs
    weight = torch.cat([w for w, _ in pairs])
    if all(b is None for _, b in pairs):
        return [(weight, None)]
    return [(weight, torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in pairs]))]


class _Arch:
    """A model's parameters gathered once per call into plain lists (module attribute look-ups
    are a large share of a small model's step), plus the layer arithmetic. The tensors are
    the live parameters (or, for generation, concatenations of them), never stale copies."""

    def __init__(self, model: nn.Module, fuse: bool = False, pack: bool = False):
        self.base = base = _base(model)
        cfg = base.config
        self.gpt2 = cfg.model_type == "gpt2"
        if self.gpt2:
            self.n_heads = self.kv_heads = cfg.n_head
            self.head_dim = cfg.n_embd // cfg.n_head
            self.eps = cfg.layer_norm_epsilon
            self.layers = [(b.ln_1.weight, b.ln_1.bias, *_weight(b.attn.c_attn), *_weight(b.attn.c_proj),
                            b.ln_2.weight, b.ln_2.bias, *_weight(b.mlp.c_fc), *_weight(b.mlp.c_proj),
                            _gpt2_act(b.mlp)) for b in base.h]
            self.wte, self.wpe = base.wte.weight, base.wpe.weight
            self.final = (base.ln_f.weight, base.ln_f.bias)
        else:
            self.n_heads = cfg.num_attention_heads
            self.kv_heads = cfg.num_key_value_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.layers = []
            for b in base.layers:
                a, m = b.self_attn, b.mlp
                proj = [_weight(lin, pack) for lin in (a.q_proj, a.k_proj, a.v_proj)]
                mlp_in = [_weight(lin, pack) for lin in (m.gate_proj, m.up_proj)]
                if fuse:  # one matmul for q, k, v and one for gate, up (generation only: no grad to route)
                    proj, mlp_in = _fuse(proj), _fuse(mlp_in)
                elif pack:  # a CPU's generation: LoRA layers stacked (their copy is made anyway), plain ones apart
                    proj, mlp_in = _fuse(proj, lora=True), _fuse(mlp_in, lora=True)
                self.layers.append((_norm_params(b.input_layernorm), proj, _weight(a.o_proj, pack),
                                    _norm_params(b.post_attention_layernorm), mlp_in, _weight(m.down_proj, pack), m.act_fn,
                                    type(m.act_fn).__name__ in ("SiLU", "SiLUActivation"),  # F.silu
                                    (_norm_params(a.q_norm), _norm_params(a.k_norm)) if hasattr(a, "q_norm") else None))
            self.wte = base.embed_tokens.weight
            self.final = _norm_params(base.norm)
        self.groups = self.n_heads // self.kv_heads
        self.scale = self.head_dim**-0.5

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            return F.embedding(ids, self.wte) + F.embedding(positions, self.wpe)
        return F.embedding(ids, self.wte)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """``cos, sin [B, 1, T, D]`` for Llama-like models (None for GPT-2)."""
        if self.gpt2:
            return None
        cos, sin = self.base.rotary_emb(x, positions)
        return cos[:, None], _signed_sin(sin[:, None])

    def qkv(self, layer, x: torch.Tensor, rope):
        """Residual stream ``[B, T, H]`` -> ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``."""
        B, T, C = x.shape
        if self.gpt2:
            if _lean_training(x, layer[0]):  # the normalised rows are not kept for the backward
                qkv, = _NormLinears.apply(x.reshape(B * T, C), layer[0], layer[1], self.eps, True, layer[2], layer[3])
            else:
                h = F.layer_norm(x, (C,), layer[0], layer[1], self.eps)
                qkv = prim.linear(h.view(B * T, C), layer[2].t(), layer[3])
            q, k, v = qkv.view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            return q, k, v
        D, H, Hkv = self.head_dim, self.n_heads, self.kv_heads
        if len(layer[1]) == 1:  # fused: q and k side by side already
            qkv = _linear(_rms_norm(layer[0], x), *layer[1][0]).view(B, T, H + 2 * Hkv, D)
            qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]
            if layer[8] is not None:
                qk = torch.cat(self.qk_norm(layer, qk[:, :, :H], qk[:, :, H:]), 2)
        else:  # q and k rotated together (one set of kernels; on a GPU the launches are the cost)
            if _lean_training(x, layer[0][0]):  # the normalised rows are not kept for the backward
                q, k, v = _NormLinears.apply(x.reshape(B * T, C), layer[0][0], None, layer[0][1], False,
                                             *(t for wb in layer[1] for t in wb))
                if x.device.type == "cpu":  # rotated apart: attention keeps q for the backward, and a
                    # view of a joint q-and-k tensor would keep k's rows alive with it (on SmolLM2 a
                    # quarter more; the keys it uses are a copy). The same arithmetic element by element.
                    q, k = self.qk_norm(layer, q.view(B, T, H, D), k.view(B, T, Hkv, D))
                    return (_rope(q.transpose(1, 2), *rope), _rope(k.transpose(1, 2), *rope),
                            v.view(B, T, Hkv, D).transpose(1, 2))
            else:
                h = _rms_norm(layer[0], x)
                q, k, v = (_linear(h, w, b) for w, b in layer[1])
            qk, v = torch.cat(self.qk_norm(layer, q.view(B, T, H, D), k.view(B, T, Hkv, D)), 2), v.view(B, T, Hkv, D)
        q, k = _rope(qk.transpose(1, 2), *rope).split([H, Hkv], 1)  # [B, H, T, D], [B, Hkv, T, D]
        return q, k, v.transpose(1, 2)

    def qk_norm(self, layer, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's RMS norms of each head of ``q [B, T, H, D]`` and ``k [B, T, Hkv, D]``, before the
        rotation; other models' q and k unchanged."""
        if layer[8] is None:
            return q, k
        return _rms_norm(layer[8][0], q), _rms_norm(layer[8][1], k)

    def finish_layer(self, layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, H, T, D]`` -> output projection, residual, MLP, residual."""
        B, _, T, _ = attn_out.shape
        return self.finish_tokens(layer, x, attn_out.transpose(1, 2).reshape(B * T, -1))

    def finish_tokens(self, layer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """:meth:`finish_layer` with the attention output as ``[B * T, heads * D]`` rows, in
        ``x [B, T, H]``'s token order."""
        B, T, C = x.shape
        if self.gpt2:
            x = prim.add_linear(x, a, layer[4].t(), layer[5])
            if layer[12] is _gelu_tanh and _lean_training(x, layer[6]):  # fewer activations kept
                f, = _NormLinears.apply(x.view(B * T, C), layer[6], layer[7], self.eps, True, layer[8], layer[9])
                return _GeluDown.apply(x.view(B * T, C), f, layer[10], layer[11]).view(B, T, C)
            h = F.layer_norm(x, (C,), layer[6], layer[7], self.eps).view(B * T, C)
            m = layer[12](prim.linear(h, layer[8].t(), layer[9]))
            return prim.add_linear(x, m, layer[10].t(), layer[11])
        x = _add_linear(x, a, *layer[2])
        if len(layer[4]) == 2 and layer[7] and _lean_training(x, layer[3][0]):  # fewer activations kept
            gate, up = _NormLinears.apply(x.view(B * T, C), layer[3][0], None, layer[3][1], False,
                                          *(t for wb in layer[4] for t in wb))
            return _SwiGLUDown.apply(x.view(B * T, C), gate, up, *layer[5]).view(B, T, C)
        h = _rms_norm(layer[3], x)
        if len(layer[4]) == 1:
            gate, up = _linear(h, *layer[4][0]).chunk(2, dim=-1)
        else:
            gate, up = (_linear(h, w, b) for w, b in layer[4])
        return _add_linear(x, layer[6](gate) * up, *layer[5])

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            return F.layer_norm(x, x.shape[-1:], self.final[0], self.final[1], self.eps)
        return _rms_norm(self.final, x)


# --------------------------------------------------------------------------- full forward


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state ``[B, T, H]`` (after the final norm), as ``model.base_model(...)``."""
    arch = _Arch(model)
    x = arch.embed(input_ids, position_ids)
    rope = arch.rope(x, position_ids)
    mask, additive = _full_mask(attention_mask), {}

    def step(i, layer, x):
        q, k, v = arch.qkv(layer, x, rope)
        return arch.finish_layer(layer, x, _attend(q, k, v, mask, arch.scale, arch.groups, additive))

    x, = _run_layers(arch, step, (x,))
    return arch.final_norm(x)


def _checkpointing(arch: _Arch) -> bool:
    """Whether this forward checkpoints its layers: the model's own switch
    (``gradient_checkpointing_enable()``, :func:`rlhfkit.models.forward.enable_gradient_checkpointing`)
    in train mode, and a graph being recorded."""
    return arch.base.training and bool(getattr(arch.base, "gradient_checkpointing", False)) and torch.is_grad_enabled()


def _run_layers(arch: _Arch, step, state: tuple) -> tuple:
    """``state = step(i, layer, *state)`` through every layer. Under the model's gradient
    checkpointing each layer's call keeps only its inputs and runs again in the backward, as
    the model's own forward does with ``use_reentrant=False``. No dropout is active on this
    path (:func:`supported`), so the second run needs no saved random state."""
    ckpt = _checkpointing(arch)
    for i, layer in enumerate(arch.layers):
        if ckpt:
            state = checkpoint(step, i, layer, *state, use_reentrant=False, preserve_rng_state=False)
        else:
            state = step(i, layer, *state)
        if not isinstance(state, tuple):
            state = (state,)
    return state


def shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                   max_share: float = 0.75) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, rows)`` when the ``[B, P]`` prompts repeat enough to be worth computing once:
    ``first [U]`` a row holding each distinct prompt, ``rows [B]`` the distinct prompt of each
    row. None when more than ``max_share`` of the rows are distinct (or B == 1)."""
    B = input_ids.shape[0]
    if B < 2:
        return None
    key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], 1)
    uniq, rows = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] > max_share * B:
        return None
    first = torch.empty(uniq.shape[0], dtype=torch.long, device=key.device)
    first.scatter_(0, rows, torch.arange(B, device=key.device))
    return first, rows


# On a CPU the flat layout is taken up to this many token-wise elements (tokens run x width).
# The flat layout was faster for small token-wise sizes and no faster near the real model's update
# micro-batches (``benchmarks/shared_prompt_ops.py``), which keep the two sequences; the bound sits
# between them (the table: benchmarks/archive/code-evidence.md).
FLAT_CPU_ELEMENTS = 1 << 19


def flat_on_cpu(tokens: int, width: int) -> bool:
    """Whether a CPU runs shared prompts in :func:`response_hidden_states`'s flat layout: a step
    small enough (``tokens x width`` at most ``FLAT_CPU_ELEMENTS``) that halving its operations
    pays; above it the two sequences the measured real-size tables used."""
    return tokens * width <= FLAT_CPU_ELEMENTS


def response_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, prompt_len: int, first: torch.Tensor,
                           rows: torch.Tensor, flat: bool | None = None, through_last: bool = False) -> torch.Tensor:
    """Hidden states at columns ``P-1 .. T-2`` (those that predict the response tokens),
    ``[B, R, H]``, with each distinct prompt run once (``first`` / ``rows`` from
    :func:`shared_prompts`).

    A prompt's states never depend on what follows it (causal attention), so the rows of a
    GRPO group share one prompt pass: its keys and values are copied to every row for the
    response queries, and autograd sums the gradients of the copies back into it. Equal to
    ``hidden_states(...)[:, P-1:-1]`` up to rounding; on a group of 4 with 11-token prompts and
    6-token responses it runs ~45% fewer tokens. The last column predicts no token and, the
    attention being causal, no other column reads it, so it is not run at all (unless it is the
    only response column).

    ``through_last``: every column is run, the last included, and the states at columns
    ``P-1 .. T-1`` come back, ``[B, R+1, H]`` (a reward model's or classifier's read at the
    last attended token, :func:`rlhfkit.models.forward.sequence_logits`).

    ``flat`` runs the distinct prompts' ``U x P`` tokens and the responses' ``B x R`` through
    every token-wise operation (norms, projections, MLP) as one sequence, and only attention
    sees them apart. Two sequences of kernels per layer cost a GPU twice the launches for the
    same arithmetic (on an H100 at a 135M-parameter model's size the update took twice as long
    with them as with the prompts unshared), so a GPU always takes it. On a CPU it is taken for
    small steps only (:func:`flat_on_cpu`), where each operation's fixed cost is a large part of
    its time; at larger sizes neither is consistently faster.
    """
    arch = _Arch(model)
    P, T = prompt_len, input_ids.shape[1]
    # the columns run: all but the last (it predicts nothing), unless it is asked for
    T_in = T if through_last or T - P == 1 else T - 1
    keep = T - P if through_last else T - 1 - P  # response columns returned after the prompt's last
    full_mask = _full_mask(attention_mask[:, :T_in])  # [B, 1, T_in, T_in]
    mask_p = full_mask[first, :, :P, :P]  # [U, 1, P, P]
    mask_r = full_mask[:, :, P:, :]  # [B, 1, T_in - P, T_in]: response queries see the whole prompt row
    if flat is None:
        flat = input_ids.device.type == "cuda" or flat_on_cpu(first.shape[0] * P + rows.shape[0] * (T_in - P),
                                                              arch.wte.shape[1])
    if flat:
        return _shared_flat(arch, input_ids[:, :T_in], position_ids[:, :T_in], P, first, rows, mask_p, mask_r,
                            keep)
    pos_p, pos_r = position_ids[first, :P], position_ids[:, P:T_in]
    # one lookup for both streams: a trained embedding's backward fills one [V, H] gradient, not two
    xp, xr = arch.embed(torch.cat([input_ids[first, :P].flatten(), input_ids[:, P:T_in].flatten()]),
                        torch.cat([pos_p.flatten(), pos_r.flatten()])).split([pos_p.numel(), pos_r.numel()])
    xp, xr = xp.view(*pos_p.shape, -1), xr.view(*pos_r.shape, -1)  # [U, P, H], [B, T_in - P, H]
    rope_p, rope_r = arch.rope(xp, pos_p), arch.rope(xr, pos_r)
    last, additive = len(arch.layers) - 1, {}

    def step(i, layer, xp, xr):
        qp, kp, vp = arch.qkv(layer, xp, rope_p)
        qr, kr, vr = arch.qkv(layer, xr, rope_r)
        keys = torch.cat([kp.index_select(0, rows), kr], 2)  # [B, Hkv, T, D]
        values = torch.cat([vp.index_select(0, rows), vr], 2)
        mp = mask_p
        if i == last:  # the prompt's last column is all that is still needed from it
            qp, xp, mp = qp[:, :, -1:], xp[:, -1:], mp[:, :, -1:]
        return (arch.finish_layer(layer, xp, _attend(qp, kp, vp, mp, arch.scale, arch.groups, additive)),
                arch.finish_layer(layer, xr, _attend(qr, keys, values, mask_r, arch.scale, arch.groups, additive)))

    xp, xr = _run_layers(arch, step, (xp, xr))
    hp = arch.final_norm(xp[:, -1]).index_select(0, rows)  # [B, H]: the state at column P-1
    return torch.cat([hp[:, None], arch.final_norm(xr[:, :keep])], 1)  # [B, keep + 1, H]


def _shared_flat(arch: _Arch, input_ids: torch.Tensor, position_ids: torch.Tensor, P: int, first: torch.Tensor,
                 rows: torch.Tensor, mask_p: torch.Tensor, mask_r: torch.Tensor, keep: int) -> torch.Tensor:
    """:func:`response_hidden_states` with the prompts and responses as one flat sequence
    (``input_ids`` the columns run; the first ``keep`` response columns' states returned after
    the prompt's last)."""
    U, (B, T) = first.shape[0], input_ids.shape
    R, n_p = T - P, U * P  # response columns; prompt tokens in the flat sequence
    flat = [torch.cat([t[first, :P].reshape(1, n_p), t[:, P:].reshape(1, B * R)], 1)
            for t in (input_ids, position_ids)]  # [1, N]: the distinct prompts, then the responses
    x = arch.embed(*flat)  # [1, N, H]
    rope = arch.rope(x, flat[1])
    last, additive = len(arch.layers) - 1, {}

    def step(i, layer, x):
        # [1, heads, N, D] -> [U, heads, P, D] and [B, heads, R, D] views (split: its backward is one cat)
        (qp, qr), (kp, kr), (vp, vr) = (
            (a.unflatten(1, (U, P)).transpose(0, 1), b.unflatten(1, (B, R)).transpose(0, 1))
            for a, b in (t.squeeze(0).split([n_p, B * R], 1) for t in arch.qkv(layer, x, rope)))
        keys = torch.cat([kp.index_select(0, rows), kr], 2)  # [B, Hkv, T, D]
        values = torch.cat([vp.index_select(0, rows), vr], 2)
        mp = mask_p
        if i == last:  # the prompt's last column is all that is still needed from it
            qp, mp = qp[:, :, -1:], mp[:, :, -1:]
            xp, xr = x.squeeze(0).split([n_p, B * R])
            x = torch.cat([xp.unflatten(0, (U, P))[:, -1], xr])[None]  # [1, U + B*R, H]
        a = torch.cat([_attend(qp, kp, vp, mp, arch.scale, arch.groups, additive).transpose(1, 2).flatten(0, 1),
                       _attend(qr, keys, values, mask_r, arch.scale, arch.groups, additive).transpose(1, 2).flatten(0, 1)])
        return arch.finish_tokens(layer, x, a.flatten(1))  # a: [tokens, heads * D]

    x, = _run_layers(arch, step, (x,))
    xp, xr = arch.final_norm(x.squeeze(0)).split([U, B * R])
    hp = xp.index_select(0, rows)  # [B, H]: the state at column P-1
    return torch.cat([hp[:, None], xr.unflatten(0, (B, R))[:, :keep]], 1)  # [B, keep + 1, H]


# --------------------------------------------------------------------------- generation


@dataclass
class KVCache:
    """Pre-allocated keys and values (one ``[B, 2, Hkv, T_max, D]`` tensor per layer, keys at
    ``[:, 0]`` and values at ``[:, 1]``, so that a step writes both with one copy), the additive
    key mask ``[B, T_max]`` (0 attend, -inf padding; cheaper than a boolean one in CPU
    attention), the number of filled columns and the gathered parameters. For GPT-2 on a CPU in
    float32, ``bound`` holds per layer a ``qkv [B, 3C]`` and an ``out [B, C]`` buffer and the
    attention bound to them and to the cache where one is registered (:func:`.primitives.decode_attention`)."""

    kv: list[torch.Tensor]
    key_bias: torch.Tensor
    length: int
    arch: _Arch
    bound: list | None = None
    shared: tuple[torch.Tensor, int] | None = None  # (rows [B], P): row b's prompt columns equal row rows[b]'s

    @property
    def keys(self) -> list[torch.Tensor]:
        return [t[:, 0] for t in self.kv]  # [B, Hkv, T_max, D] views

    @property
    def values(self) -> list[torch.Tensor]:
        return [t[:, 1] for t in self.kv]


@torch.no_grad()
def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            max_new_tokens: int) -> tuple[torch.Tensor, KVCache]:
    """Run the prompt, fill the cache; returns the last column's hidden state ``[B, H]``.

    A prompt repeated in consecutive rows (GRPO and RLOO lay out each group that way) is run
    once and its cache rows copied, which divides the prompt's cost by the group size.
    """
    # fusing q/k/v and gate/up saves kernel launches on a GPU; on a CPU the copy of the weights
    # (fresh memory, page faults) costs more than the matmuls it merges
    # on a CPU, bfloat16 weights packed once for the decode steps (prim.pack): the packing (about
    # 0.1 s for SmolLM2 and its head) pays for itself within a few steps
    arch = _Arch(model, fuse=input_ids.device.type == "cuda", pack=packs(input_ids, max_new_tokens))
    rows = None
    if (runs := repeated_rows(input_ids, attention_mask)) is not None:  # keep the first row of each run
        first, rows = runs
        input_ids, attention_mask, position_ids = input_ids[first], attention_mask[first], position_ids[first]
    B, P = input_ids.shape
    x = arch.embed(input_ids, position_ids)
    rope = arch.rope(x, position_ids)
    L, T_max = len(arch.layers), P + max_new_tokens
    kv = [x.new_empty((B, 2, arch.kv_heads, T_max, arch.head_dim)) for _ in range(L)]
    keys, values = [t[:, 0] for t in kv], [t[:, 1] for t in kv]
    key_bias = x.new_zeros((B, T_max))
    key_bias[:, :P].masked_fill_(attention_mask == 0, float("-inf"))
    mask = _full_mask(attention_mask, x.dtype)  # additive: the cheaper one in CPU attention
    for i, layer in enumerate(arch.layers):
        q, k, v = arch.qkv(layer, x, rope)
        keys[i][:, :, :P] = k
        values[i][:, :, :P] = v
        if i == L - 1:  # only the last column is needed from here on
            q, x, mask = q[:, :, -1:], x[:, -1:], mask[:, :, -1:]
        x = arch.finish_layer(layer, x, _attend(q, k, v, mask, arch.scale, arch.groups))
    hidden = arch.final_norm(x[:, -1])
    if rows is not None:  # back to one row per sample
        kv = [t.index_select(0, rows) for t in kv]
        key_bias, hidden = key_bias.index_select(0, rows), hidden.index_select(0, rows)
    cache = KVCache(kv, key_bias, P, arch)
    if rows is not None:  # each row's prompt columns are a copy of its run's first row's
        cache.shared = (first.index_select(0, rows).contiguous(), P)
    if arch.gpt2 and (first := _bind_decode(cache, kv[0]))[2] is not None:
        cache.bound = [first] + [_bind_decode(cache, t) for t in kv[1:]]
    return hidden, cache


def _bind_decode(cache: KVCache, kv: torch.Tensor):
    """``(qkv [B, 3C], out [B, C], step)`` for one GPT-2 layer: the step's projections are written
    into ``qkv``; ``step(t)`` puts its key and value into cache column ``t`` and attends with its
    query over columns ``0 .. t``, writing ``out`` (heads side by side); ``step`` None where no
    bound attention is registered (:func:`.primitives.decode_attention`)."""
    B, _, H, _, D = kv.shape
    qkv, out = kv.new_empty((B, 3 * H * D)), kv.new_empty((B, H * D))
    step = prim.decode_attention(qkv.view(B, 3, H, D), kv, cache.key_bias, out.view(B, H, D), cache.arch.scale)
    return qkv, out, step


@torch.no_grad()
def decode_step(cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One cached step: ``tokens, positions [B]`` -> last hidden state ``[B, H]``; appends to
    ``cache`` and uses the parameters :func:`prefill` gathered into it."""
    t = cache.length
    mask = None if cache.bound else cache.key_bias[:, None, None, : t + 1]  # [B, 1, 1, t+1]
    hidden = _decode(cache, tokens, positions, t, t + 1, mask, cache.bound)
    cache.length = t + 1
    return hidden


def _write_column(kv: torch.Tensor, column: int | torch.Tensor, new: torch.Tensor) -> None:
    """``new [B, 2, Hkv, 1, D]`` into cache column ``column``: an int, or a tensor ``[1]`` (fixed address)."""
    if isinstance(column, int):
        kv.narrow(3, column, 1).copy_(new)
    else:
        kv.index_copy_(3, column, new)


def _decode(cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, column: int | torch.Tensor,
            span: int, mask: torch.Tensor | None, bound: list | None, one_query=None) -> torch.Tensor:
    """The step of :func:`decode_step` and :func:`static_decode_step`: this step's keys and values
    go in at ``column``, attention reads cache columns ``0 .. span-1`` under ``mask [B, 1, 1, span]``
    (GPT-2 with ``bound``: attention bound to the cache, which takes the column and mask itself;
    ``one_query(q [B, H, 1, D], kv) -> [B, H, 1, D]``: an attention that finds the columns itself)."""
    arch = cache.arch
    if arch.gpt2:
        return _gpt2_decode(cache, tokens, positions, column, span, mask, bound, one_query)
    x = arch.embed(tokens[:, None], positions[:, None])  # [B, 1, H]
    rope = arch.rope(x, positions[:, None])
    for layer, kv in zip(arch.layers, cache.kv):
        q, k, v = arch.qkv(layer, x, rope)
        _write_column(kv, column, torch.stack([k, v], 1))
        if one_query is not None:
            a = one_query(q, kv)
        else:
            seen = kv[:, :, :, :span]
            a = _attend(q, seen[:, 0], seen[:, 1], mask, arch.scale, arch.groups, shared=cache.shared)
        x = arch.finish_layer(layer, x, a)
    return arch.final_norm(x[:, 0])


# rotary embeddings whose tables do not depend on how long the sequence is (the dynamic and long
# ones recompute them as it grows, a host-side decision a CUDA graph cannot replay)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def static_shapes(cache: KVCache) -> bool:
    """Whether :func:`static_decode_step` computes this cache's model."""
    arch = cache.arch
    return arch.gpt2 or getattr(arch.base.rotary_emb, "rope_type", None) in _STATIC_ROPE


@torch.no_grad()
def static_decode_step(cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, t: torch.Tensor,
                       columns: torch.Tensor, attend=None) -> torch.Tensor:
    """:func:`decode_step` with every shape and address fixed, so that a CUDA graph can replay
    it: the step's column is the tensor ``t [1]`` rather than ``cache.length``, the keys and
    values go in with ``index_copy_``, and attention runs over a fixed span of columns
    (``columns [S]``: ``arange(S)``, S <= T_max, S > t) with those after ``t`` masked, instead of
    a slice that grows. ``attend``: an attention ``attend(q, k, v, bias, t, scale)`` that reads
    ``t`` itself and only columns ``0 .. t`` (:func:`.primitives.graphed_decode_attention`;
    ``columns`` is then not read). Equal to :func:`decode_step` up to rounding; it does not
    advance ``cache.length``."""
    if attend is not None:
        bias, scale = cache.key_bias, cache.arch.scale
        return _decode(cache, tokens, positions, t, 0, None, None,
                       lambda q, kv: attend(q, kv[:, 0], kv[:, 1], bias, t, scale))
    span = columns.shape[0]
    bias = cache.key_bias[:, :span].masked_fill(columns > t, float("-inf"))[:, None, None, :]  # [B, 1, 1, S]
    return _decode(cache, tokens, positions, t, span, bias, None)


def _gpt2_decode(cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, column: int | torch.Tensor,
                 span: int, mask: torch.Tensor | None, bound: list | None, one_query=None) -> torch.Tensor:
    """:func:`_decode` for GPT-2 written out flat: at a small model's sizes each tensor op costs a
    few microseconds and the Python around it as much again."""
    arch = cache.arch
    eps, H, D = arch.eps, arch.n_heads, arch.head_dim
    B = tokens.shape[0]
    x = torch.embedding(arch.wte, tokens) + torch.embedding(arch.wpe, positions)  # [B, C]
    C = x.shape[-1]
    sdpa = F.scaled_dot_product_attention
    for (ln1w, ln1b, aw, ab, pw, pb, ln2w, ln2b, fw, fb, mw, mb, act), kv, layer_bound in zip(
            arch.layers, cache.kv, bound or [None] * len(cache.kv)):
        h = torch.layer_norm(x, (C,), ln1w, ln1b, eps)
        if layer_bound is not None:  # the compiled attention, bound to this layer's buffers and cache
            qkv, a, attend = layer_bound
            torch.addmm(ab, h, aw, out=qkv)  # [B, 3C]
            attend(column)  # this step's key and value into the cache column, attention into a [B, C]
        else:
            qkv = torch.addmm(ab, h, aw).view(B, 3, H, 1, D)
            _write_column(kv, column, qkv[:, 1:])  # this step's key and value, one copy
            if one_query is not None:
                a = one_query(qkv[:, 0], kv).view(B, C)
            else:
                seen = kv[:, :, :, :span]
                a = sdpa(qkv[:, 0], seen[:, 0], seen[:, 1], attn_mask=mask, scale=arch.scale).view(B, C)
        x = torch.addmm(pb, a, pw).add_(x)
        x = torch.addmm(mb, act(torch.addmm(fb, torch.layer_norm(x, (C,), ln2w, ln2b, eps), fw)), mw).add_(x)
    return torch.layer_norm(x, (C,), arch.final[0], arch.final[1], eps)


# --------------------------------------------------------------------------- the shortcuts


class Decoder:
    """:func:`rlhfkit.ops.decoder` on this forward: the prefill's ``hidden [B, H]`` and ``logits
    [B, V]``, then ``step(tokens, positions)``; the LM head applied without its module's call
    (its hooks machinery would run per token), on a bfloat16 weight packed once where it pays;
    ``graph``: fixed shapes (:class:`FixedStep`), where the rotary tables do not change."""

    def __init__(self, model: nn.Module, prompt_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 max_new_tokens: int, graph: bool = False):
        head = model.get_output_embeddings()
        if type(head) is nn.Linear:
            w = head.weight
            if packs(prompt_ids, max_new_tokens):  # packed once for the steps where it can be
                w = decode_packed(w, PACK_MAX_HEAD)
            head = lambda h, w=w, b=head.bias: _linear(h, w, b)  # noqa: E731
        self.head = head
        self.hidden, self.cache = prefill(model, prompt_ids, mask, positions, max_new_tokens)
        self.logits = head(self.hidden)  # [B, V]
        self.fixed = None
        if graph and static_shapes(self.cache):
            self.fixed = FixedStep(self.cache, head, prompt_ids.device.type == "cuda")

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens [B]`` at ``positions [B]``; the next position's logits ``[B, V]``."""
        if self.fixed is not None:
            self.hidden, logits = self.fixed(tokens, positions)
            return logits
        self.hidden = decode_step(self.cache, tokens, positions)
        return self.head(self.hidden)


def runs_forward(model: nn.Module) -> bool | None:
    return True if supported(model) else None


def full_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor) -> torch.Tensor | None:
    return hidden_states(model, input_ids, attention_mask, position_ids) if supported(model) else None


def shared_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         position_ids: torch.Tensor, prompt_len: int, through_last: bool = False):
    """:func:`response_hidden_states` where the model is supported and the prompts repeat."""
    if not supported(model) or (shared := shared_prompts(input_ids, attention_mask, prompt_len)) is None:
        return None
    return response_hidden_states(model, input_ids, attention_mask, position_ids, prompt_len, *shared,
                                  through_last=through_last)


def decoder(model: nn.Module, prompt_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
            max_new_tokens: int, graph: bool = False) -> Decoder | None:
    return Decoder(model, prompt_ids, mask, positions, max_new_tokens, graph) if supported(model) else None


SHORTCUTS = {"runs_forward": runs_forward, "hidden_states": full_hidden_states,
             "response_hidden_states": shared_hidden_states, "decoder": decoder}


class FixedStep:
    """The lean decode step with fixed shapes and buffers (:func:`static_decode_step`),
    on CUDA captured as CUDA graphs and replayed for every token: at a small model's size a step is
    hundreds of kernel launches, each costing more than its arithmetic, and a replay launches them
    all at once. Attention reads the cache up to the end of the current band of ``band`` columns
    (the written ones and fewer than ``band`` unwritten ones, masked), one graph per band,
    captured when the decode reaches the band and dropped when it leaves it (bands only grow; the
    next graph shares its memory pool): attention over the whole pre-allocated cache at every
    token cost more than the launches saved on long completions (512 new tokens of a 12-layer
    model on an H200). Where a graphed attention is registered (:func:`.primitives.graphed_decode_attention`:
    Triton's) attention is its kernel,
    which reads the step's column from device memory and only the columns written so far: then
    one band spans the whole cache and one graph serves the rollout. On a CPU (no graphs) the
    same steps run as written, which is how the tests check them (the Triton kernel under its
    interpreter). The outputs are a graph's own buffers, rewritten by its next replay, so they
    are copied out."""

    BAND = 64  # columns per band, at least; at most 16 bands (captures) per rollout

    def __init__(self, cache, head, cuda: bool):
        B, T = cache.key_bias.shape
        dev = cache.key_bias.device
        self.cache, self.head, self.cuda, self.T = cache, head, cuda, T
        self.attend = prim.graphed_decode_attention(cache.kv[0], cache.arch.n_heads)
        self.triton = self.attend is not None
        self.band = T if self.triton else max(self.BAND, -(-T // 16))
        self.span, self.graph, self.out = 0, None, None  # the current band's end, graph and outputs
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.columns = torch.arange(T, device=dev)
        for kv in cache.kv:  # attention weighs the unwritten columns by 0, and 0 * NaN would not be 0
            kv[:, :, :, cache.length:].zero_()

    @torch.no_grad()
    def _run(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = static_decode_step(self.cache, self.tok, self.pos, self.t, self.columns[:span], self.attend)
        return hidden, self.head(hidden)

    def _capture(self, span: int) -> None:
        """The graph of the step over columns ``0 .. span-1`` in place of the last band's; its
        warm-up runs the current step (writing this step's cache column, which the first replay
        writes again)."""
        dev = self.t.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # CUDA's libraries set themselves up outside the capture
            self._run(span)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # the last band's graph is never replayed again: the new one may take its pool's free memory
        with torch.cuda.graph(graph, pool=self.graph.pool() if self.graph is not None else None):
            out = self._run(span)
        self.graph, self.out, self.span = graph, out, span

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [B, H], logits [B, V])`` after feeding ``tok`` at ``pos``; advances the cache."""
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.t.fill_(self.cache.length)
        span = min(self.T, (self.cache.length // self.band + 1) * self.band)
        if not self.cuda:
            hidden, logits = self._run(span)
        else:
            if span != self.span:
                self._capture(span)
            self.graph.replay()
            hidden, logits = (x.clone() for x in self.out)
        self.cache.length += 1
        return hidden, logits
