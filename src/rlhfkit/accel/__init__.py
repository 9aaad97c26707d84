"""Faster implementations of the core's named operations (:mod:`rlhfkit.ops`) for particular
hardware, and the decisions of where they pay: the CPU's vendor and flags, a C compiler, thread
counts and size thresholds are read here only (each module: docs/design.md's layer table).
:func:`install` registers what runs on this machine; each implementation takes the inputs it was
measured to pay on and hands any other to the reference. Of the rest of the package it imports
only :mod:`rlhfkit.registry`, and importing it imports nothing at all (``accel.malloc`` reads
:mod:`.malloc` before torch loads). Measurements: ``benchmarks/ACCEL_EVIDENCE.md``.
"""
from __future__ import annotations


def install(register, reference, force: bool = False) -> dict[str, str]:
    """Call ``register(name, fn, label)`` for every faster implementation that runs here
    (:func:`.registry.install`); ``reference(name)``: the plain one each hands other inputs to.
    Returns ``{name: label}`` of the forward's own operations it took (:mod:`.primitives`)."""
    from .registry import install as register_all

    return register_all(register, reference, force)
