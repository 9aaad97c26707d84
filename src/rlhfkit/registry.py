"""Below both :mod:`rlhfkit.ops` and :mod:`rlhfkit.accel`: the registry of named operations each
keeps, and the finder of repeated prompt rows both the experience and the accelerated prefill
use. Imports only torch."""
from __future__ import annotations

from collections.abc import Callable

import torch


def not_taken(*args, **kwargs) -> None:
    """A shortcut's reference: not taken, the caller's own PyTorch code runs."""
    return None


class Registry:
    """Named operations, each computed by its plain PyTorch reference until a faster one is
    registered; :meth:`reset` (every registry at once: :func:`reset_all`) puts them back."""

    instances: list[Registry] = []

    def __init__(self, reference: dict[str, Callable]):
        self.REFERENCE = reference
        self.impl: dict[str, Callable] = dict(reference)  # read by name on every call
        self.labels: dict[str, str] = {}  # name -> what computes it, for the names taken
        Registry.instances.append(self)

    def register(self, name: str, fn: Callable, label: str) -> None:
        """Compute ``name`` with ``fn`` from now on; ``label`` says what it is (``onednn``, ``c-kernels``)."""
        if name not in self.REFERENCE:
            raise KeyError(f"no operation named {name!r} (one of {', '.join(self.REFERENCE)})")
        self.impl[name], self.labels[name] = fn, label

    def get(self, name: str) -> Callable:
        return self.impl[name]

    def reference(self, name: str) -> Callable:
        """The plain PyTorch implementation of ``name`` (a shortcut's: :func:`not_taken`)."""
        return self.REFERENCE[name]

    def chosen(self) -> dict[str, str]:
        """``{name: label}`` of the names a faster implementation computes now."""
        return dict(self.labels)

    def reset(self) -> None:
        self.impl.clear()
        self.impl.update(self.REFERENCE)
        self.labels.clear()


def reset_all() -> None:
    """Every name of every registry back on its reference."""
    for registry in Registry.instances:
        registry.reset()


def repeated_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Runs of identical consecutive ``[B, P]`` prompt rows (how GRPO lays out a group):
    ``(first [U], rows [B])``, the first row of each run and the run of each row; None when no
    row repeats the one before it."""
    if input_ids.shape[0] < 2:
        return None
    same = ((input_ids[1:] == input_ids[:-1]) & (attention_mask[1:] == attention_mask[:-1])).all(1)  # [B-1]
    if not bool(same.any()):
        return None
    rows = torch.cat([same.new_zeros(1), ~same]).long().cumsum(0)  # [B]: run of each row
    first = torch.cat([same.new_ones(1), ~same]).nonzero().squeeze(1)  # [U] first row of each run
    return first, rows
