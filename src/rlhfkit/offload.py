"""``accel.offload``: what a phase of an RL step does not read waits in host memory.

Full fine-tuning keeps on the device, beside the policy, AdamW's two moments (twice the trained
weights) and the frozen models: the reference and any reward model. The rollout reads none of
them, yet with long completions its KV cache makes it the step's peak. So, with ``accel.offload``:

- :class:`HostMoments`: the optimizer's state goes to host memory when a step starts (and before
  a held-out evaluation) and comes back just before the update;
- :func:`offload_frozen`: a frozen model's weights stay in host memory, and
  :func:`on_device` puts a copy on the device for the blocks that run it. Every use of a
  reference or reward model is inside :func:`rlhfkit.distributed.full_weights`, which calls it.

Nothing is computed differently: what comes back is a copy of what left. The cost is the copies,
per step the moments once each way and the frozen weights once up (their host copy stays, so
putting them away copies nothing). On CUDA the host buffers are pinned and the copies are queued
on the current stream: a freed device tensor's memory is reused only by work queued after its copy,
and the moments' copies to the host are waited for before the host can read them.
On a CPU, where host and device memory are one, the same copies run and save nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class HostMoments:
    """The state tensors of ``optimizer`` (AdamW's moments and step counts) in host buffers between
    :meth:`to_host` and :meth:`to_device`; each buffer is allocated once and reused every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
        self.device, self.pin = device, device.type == "cuda"
        self.away: dict = {}  # param -> {key: (host buffer, the device it came from)}

    @torch.no_grad()
    def to_host(self) -> None:
        """Copy every state tensor into its host buffer and let the device's copy go."""
        for p, state in self.optimizer.state.items():
            kept = self.away.setdefault(p, {})
            for key, value in state.items():
                if not torch.is_tensor(value) or (key in kept and value is kept[key][0]):
                    continue  # not a tensor, or away already
                buf = kept.get(key, (None,))[0]
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                    buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pin)
                buf.copy_(value, non_blocking=self.pin)
                kept[key] = (buf, value.device)
                state[key] = buf
        if self.pin:  # the copies are queued: finish them before anything on the host reads the buffers (a
            # checkpoint); the work queued next would wait for them on the GPU anyway
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def to_device(self) -> None:
        """A fresh device copy of every state tensor sent away (a no-op when none is)."""
        for p, state in self.optimizer.state.items():
            for key, (buf, device) in self.away.get(p, {}).items():
                if state.get(key) is buf:
                    state[key] = buf.to(device, non_blocking=self.pin, copy=True)


def offload_frozen(model: nn.Module | None, device: torch.device) -> None:
    """Move ``model``'s parameters to host memory (pinned on CUDA; buffers stay), to be put on
    ``device`` for the blocks of :func:`on_device`. None is a no-op."""
    if model is None:
        return
    pin, host = device.type == "cuda", []
    with torch.no_grad():
        for p in model.parameters():  # each tied weight once
            h = p.detach().to("cpu", copy=True)
            p.data = h.pin_memory() if pin else h
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
        pin = off["device"].type == "cuda"
        for p, h in off["host"]:
            p.data = h.to(off["device"], non_blocking=pin, copy=True)
    off["depth"] += 1
    try:
        yield
    finally:
        off["depth"] -= 1
        if off["depth"] == 0:
            for p, h in off["host"]:
                p.data = h  # the device copy is freed; the host one never changed (frozen)
