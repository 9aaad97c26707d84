"""Where the update's CPU tensors live on glibc's heap: freed pages handed back between a step's
phases, large tensors mapped off the heap, the gradients in one buffer. glibc keeps what a step
frees between live blocks as resident holes, so without these the resident set grows past the
tensors alive (measurements: benchmarks/archive/code-evidence.md). Nothing happens off glibc.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys

import torch


@functools.cache
def _glibc():
    """glibc with ``malloc_trim`` and ``mallopt`` typed, or None (not Linux, or another C library: musl has none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``), so the next phase's peak
    resident set does not start from the last one's. Between phases only: tens of milliseconds,
    and per micro-batch the pages' re-faulting would cost a noticeable share of the update."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h) and the ceiling of its dynamic mmap threshold on 64-bit
_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING = -3, 32 << 20
UPDATE_MMAP_THRESHOLD = 1 << 20


@contextlib.contextmanager
def tensors_off_heap(enabled: bool = True, threshold: int = UPDATE_MMAP_THRESHOLD):
    """Within the block every allocation of ``threshold`` bytes or more is its own ``mmap``, handed
    straight back on ``free`` (``mallopt(M_MMAP_THRESHOLD)``): the resident set is the tensors
    alive, at the cost of a page fault per page per allocation (``accel.update_off_heap``). glibc's
    default threshold rises to 32 MiB once so large a tensor is freed, carving an update's
    activations out of the heap. On leaving, the threshold is set to that 32 MiB and stays fixed."""
    libc = _glibc() if enabled else None
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING)


# below this many trained numbers the gradients are too small to matter to the heap, and the hook
# and copy per parameter and micro-batch cost the doubling task's model 2% of its GRPO update
GRADIENT_BUFFER_MIN = 1 << 22


@contextlib.contextmanager
def gradient_buffer(params, enabled: bool = True, min_numbers: int = GRADIENT_BUFFER_MIN):
    """Within the block the CPU gradients of ``params`` live in one flat (mmapped) buffer per dtype
    instead of a heap block each, which would sit among the activations' holes until the optimizer
    step. A hook copies a parameter's first gradient into its slice and points ``.grad`` there;
    later micro-batches add in place, as autograd does. The sums are unchanged, a parameter with
    no gradient keeps None, ``zero_grad(set_to_none=True)`` still frees them. Only plain strided
    CPU tensors take part, none when ``enabled`` is false (FSDP, DeepSpeed own the gradients) or
    they hold fewer than ``min_numbers`` numbers in all."""
    params = [p for p in params if enabled and p.requires_grad and p.device.type == "cpu" and type(p.data) is torch.Tensor
              and p.layout == torch.strided]
    if sum(p.numel() for p in params) < min_numbers:
        params = []  # too small to scatter the heap: the hooks' copies would be all it does
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}  # pages faulted in on first use
    slots, offsets = {}, dict.fromkeys(sizes, 0)
    for p in params:
        start = offsets[p.dtype]
        slots[p] = buffers[p.dtype][start:start + p.numel()].view_as(p)
        offsets[p.dtype] = start + p.numel()

    def move(p: torch.Tensor) -> None:
        slot, grad = slots[p], p.grad
        if grad is not None and grad.layout == torch.strided and grad.data_ptr() != slot.data_ptr():
            slot.copy_(grad)
            p.grad = slot

    handles = [p.register_post_accumulate_grad_hook(move) for p in params]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
