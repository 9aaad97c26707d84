"""``accel.offload``: AdamW's moments (:class:`HostMoments`) wait in host memory through the
rollout, frozen models' weights (:func:`offload_frozen`) outside the blocks that run them
(:func:`on_device`). Nothing is computed differently."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def host_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for a device tensor; pinned on CUDA, so the copies queue on the stream."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class HostMoments:
    """The state tensors of ``optimizer`` (AdamW's moments and step counts) in host buffers between
    :meth:`to_host` and :meth:`to_device`; each buffer is allocated once and reused every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
        self.device = device
        self.away: dict = {}  # param -> {key: (host buffer, the device it came from)}

    @torch.no_grad()
    def to_host(self) -> None:
        """Copy every state tensor into its host buffer and let the device's copy go."""
        queued = False
        for p, state in self.optimizer.state.items():
            kept = self.away.setdefault(p, {})
            for key, value in state.items():
                if not torch.is_tensor(value) or (key in kept and value is kept[key][0]):
                    continue  # not a tensor, or away already
                buf = kept.get(key, (None,))[0]
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                    buf = host_empty(value.shape, value.dtype)
                buf.copy_(value, non_blocking=buf.is_pinned())
                queued |= buf.is_pinned() and value.is_cuda
                kept[key] = (buf, value.device)
                state[key] = buf
        if queued:  # finish the copies before anything on the host reads the buffers (a checkpoint)
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def to_device(self) -> None:
        """A fresh device copy of every state tensor sent away (a no-op when none is)."""
        for p, state in self.optimizer.state.items():
            for key, (buf, device) in self.away.get(p, {}).items():
                if state.get(key) is buf:
                    state[key] = buf.to(device, non_blocking=buf.is_pinned(), copy=True)


def offload_frozen(model: nn.Module | None, device: torch.device) -> None:
    """Move ``model``'s parameters to host memory (buffers stay), to be put on ``device`` for the
    blocks of :func:`on_device`. None is a no-op."""
    if model is None:
        return
    host = []
    with torch.no_grad():
        for p in model.parameters():  # each tied weight once
            p.data = host_empty(p.shape, p.dtype).copy_(p.detach())
            host.append((p, p.data))
    model._rlhfkit_offload = {"device": device, "host": host, "depth": 0}


@contextlib.contextmanager
def on_device(model: nn.Module | None):
    """``model``'s weights on its device for the block when :func:`offload_frozen` put them in host
    memory (a no-op otherwise); nested blocks copy once."""
    off = getattr(model, "_rlhfkit_offload", None)
    if off is None:
        yield
        return
    if off["depth"] == 0:
        for p, h in off["host"]:
            p.data = h.to(off["device"], non_blocking=h.is_pinned(), copy=True)
    off["depth"] += 1
    try:
        yield
    finally:
        off["depth"] -= 1
        if off["depth"] == 0:
            for p, h in off["host"]:
                p.data = h  # the device copy is freed; the host one never changed (frozen)
