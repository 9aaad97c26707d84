"""Faster implementations of the core's named operations (:mod:`rlhfkit.ops`) for particular
hardware, and the decisions of where they pay: the CPU's vendor and flags, a C compiler,
thread counts and size thresholds are read here only.

* :mod:`.forward`: GPT-2's and Llama/Qwen2's forward and KV-cache decode run straight from the
  model's parameters, over :mod:`.primitives`' named operations;
* :mod:`.kernels` (+ ``csrc/``): compiled C loops for a CPU: attention, GELU, SwiGLU, the
  sampling step, a bfloat16 LM head, RMS norm and decode attention;
* :mod:`.gemm`: float32 products through oneDNN, and bfloat16 weights packed for decode steps;
* :mod:`.triton_decode`: the decode attention of a CUDA-graphed rollout step;
* :mod:`.malloc`: the command line restarted under tcmalloc or jemalloc (``accel.malloc``).
* :mod:`.offload`: ``accel.offload``, optimizer state and frozen weights in host memory between phases.

:func:`install` registers what runs on this machine (:mod:`.registry`: each implementation
takes the inputs it was measured to pay on and hands any other to the reference). Of the rest of
the package it imports only :mod:`rlhfkit.registry`, and importing it imports nothing at all (``accel.malloc`` reads
:mod:`.malloc` before torch loads).
Measurements: ``benchmarks/ACCEL_EVIDENCE.md`` and ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations


def install(register, reference, force: bool = False) -> dict[str, str]:
    """Call ``register(name, fn, label)`` for every faster implementation that runs here
    (:func:`.registry.install`); ``reference(name)``: the plain one each hands other inputs to.
    Returns ``{name: label}`` of the forward's own operations it took (:mod:`.primitives`)."""
    from .registry import install as register_all

    return register_all(register, reference, force)
