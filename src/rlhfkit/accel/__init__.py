"""Faster implementations of the core's named operations (:mod:`rlhfkit.ops`) for particular
hardware, and the decisions of where they pay: the CPU's vendor and flags, a C compiler,
thread counts and size thresholds are read here only.

* :mod:`.kernels` (+ ``csrc/``): compiled C loops for a CPU: attention, GELU, SwiGLU, the
  sampling step, a bfloat16 LM head, RMS norm and decode attention;
* :mod:`.gemm`: float32 products through oneDNN, and bfloat16 weights packed for decode steps;
* :mod:`.triton_decode`: the decode attention of a CUDA-graphed rollout step;
* :mod:`.malloc`: the command line restarted under tcmalloc or jemalloc (``run.malloc``).

:func:`install` registers what runs on this machine (:mod:`.registry`: each implementation
takes the inputs it was measured to pay on and hands any other to the reference). Importing
this package imports nothing (``run.malloc`` reads :mod:`.malloc` before torch loads).
Measurements: ``benchmarks/ACCEL_EVIDENCE.md`` and ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations


def install(force: bool = False) -> dict[str, str]:
    """Register into :mod:`rlhfkit.ops` every faster implementation that runs here
    (:func:`.registry.install`); returns ``{name: label}``."""
    from .registry import install as register_all

    return register_all(force)
