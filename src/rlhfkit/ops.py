"""The operations the core calls where a faster implementation may stand in, each by name with
its reference in plain PyTorch (the code a reader reads).

An *operation* (``linear``) computes its result. A *shortcut* (``head_lse``, ``decoder`` ...) is a
fused path: its reference returns None and the caller's own code runs; a faster one returns the
result, or None for inputs it does not take. :func:`configure` (``accel.enabled``) lets
:mod:`rlhfkit.accel` register what runs faster; ``tests/test_accel.py`` checks each.
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .registry import Registry, not_taken, reset_all

MODES = ("auto", "on", "off")
OLD_SWITCHES = ("RLHFKIT_KERNELS", "RLHFKIT_ONEDNN", "RLHFKIT_TRITON")

# --------------------------------------------------------------------------- references


def _mm_out(a: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, m, out=out)


REFERENCE: dict[str, Callable] = {
    "linear": F.linear, "mm_out": _mm_out,
    # shortcuts
    "head_lse": not_taken, "head_grad": not_taken, "sampler": not_taken, "runs_forward": not_taken,
    "hidden_states": not_taken, "response_hidden_states": not_taken, "decoder": not_taken,
}
_core = Registry(REFERENCE)
register, get, reference, chosen = _core.register, _core.get, _core.reference, _core.chosen
_impl = _core.impl
_mode: str | None = None  # the last configured mode
_said: str | None = None  # the last summary printed


def summary() -> str:
    """One line: which names are accelerated, and by what; the others run their reference."""
    by = ", ".join(f"{name}={label}" for name, label in _core.labels.items()) or "none"
    off = ", ".join(name for name in REFERENCE if name not in _core.labels) or "none"
    return f"accel ({_mode}): {by}; reference: {off}"


def configure(accel) -> dict[str, str]:
    """Choose once per run what computes each name (``accel``: an ``AccelConfig`` or its ``enabled``):
    ``off`` every reference, nothing of :mod:`rlhfkit.accel` imported; ``auto`` what it measured
    to pay here; ``on`` all it has that runs here. Prints :func:`summary` when it changes."""
    global _mode, _said
    mode = getattr(accel, "enabled", accel)
    if mode not in MODES:
        raise ValueError(f"accel.enabled must be one of {', '.join(MODES)}, not {mode!r}")
    old = [name for name in OLD_SWITCHES if name in os.environ]
    if old:
        warnings.warn(f"{', '.join(old)} no longer read: set accel.enabled=auto|on|off instead", stacklevel=2)
    reset_all()  # the core's names and the accelerated forward's own
    _mode = mode
    if mode != "off":
        from . import accel as hardware  # the one place the core reaches the accel package

        _core.labels.update(hardware.install(register, reference, force=mode == "on"))  # + the forward's own names
    if summary() != _said:
        _said = summary()
        print(_said, file=sys.stderr)
    return chosen()


# --------------------------------------------------------------------------- the core's calls


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: ``x [..., K]``, ``w [N, K]`` (a transposed view is fine) -> ``[..., N]``."""
    return _impl["linear"](x, w, b)


def mm_out(a: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ m`` (``out [M, N]`` written, e.g. a block of rows of a bigger tensor)."""
    return _impl["mm_out"](a, m, out)


def head_lse(z: torch.Tensor, targets: torch.Tensor):
    """Shortcut: ``(logsumexp [n], z[r, targets[r]] [n])`` in float32 of logits ``z [n, V]`` read as
    they are. None: not taken (the caller upcasts them)."""
    return _impl["head_lse"](z, targets)


def head_grad(z: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, targets: torch.Tensor):
    """Shortcut, after :func:`head_lse` took ``z``: ``coef[r] (onehot(targets[r]) - softmax(z[r]))``
    in ``z``'s dtype. None: not taken."""
    return _impl["head_grad"](z, lse, coef, targets)


def sampler(B: int, R: int, V: int, temperature: float, eos: int):
    """Shortcut: a sampling step in one call (``step(t, logits, u)``, as :class:`rlhfkit.rollout.generate._Draw`
    samples without truncation, with per-row uniforms) for float32 CPU logits. None: not taken."""
    return _impl["sampler"](B, R, V, temperature, eos)


def runs_forward(model) -> bool | None:
    """Shortcut: True when an accelerated forward computes ``model`` (its layers' own forward
    never runs). None: not taken."""
    return _impl["runs_forward"](model)


def hidden_states(model, input_ids, attention_mask, position_ids) -> torch.Tensor | None:
    """Shortcut: the last hidden states ``[B, T, H]`` (after the final norm) of a causal LM or
    scalar-head model, as ``model.base_model(...).last_hidden_state``. None: not taken."""
    return _impl["hidden_states"](model, input_ids, attention_mask, position_ids)


def response_hidden_states(model, input_ids, attention_mask, position_ids, prompt_len: int,
                           through_last: bool = False) -> torch.Tensor | None:
    """Shortcut: the hidden states at columns ``P-1 .. T-2`` ``[B, R, H]`` (``through_last``: ``P-1
    .. T-1``, ``[B, R+1, H]``) of ``[prompt (P) | response]`` rows, each prompt repeated across
    rows (a GRPO group) run once. None: not taken."""
    return _impl["response_hidden_states"](model, input_ids, attention_mask, position_ids, prompt_len, through_last)


def decoder(model, prompt_ids, prompt_mask, position_ids, max_new_tokens: int, graph: bool = False):
    """Shortcut: a generation's forward from its prefill: ``logits [B, V]``, ``hidden [B, H]`` of the
    last position and ``step(tokens [B], positions [B]) -> logits [B, V]``; ``graph``: replayed as
    CUDA graphs on a GPU. None: not taken."""
    return _impl["decoder"](model, prompt_ids, prompt_mask, position_ids, max_new_tokens, graph)

