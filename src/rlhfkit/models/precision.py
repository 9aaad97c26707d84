"""``model.master_weights``: float32 parameters, optimizer state and checkpoints (AdamW's steps of
about ``lr`` round away on bfloat16 weights), the forwards on bfloat16 copies made once a block by
:func:`compute_weights`, a differentiable cast, as FSDP2's ``MixedPrecisionPolicy``."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_DTYPE = "_rlhfkit_compute_dtype"  # on a module whose float32 parameters run in another dtype
_ACTIVE = "_rlhfkit_compute_active"  # set while its parameters are swapped


def keep_master_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Mark ``model`` (float32) to run its forwards in ``dtype`` under :func:`compute_weights`,
    keeping its float32 parameters as the master copy. Returns ``model``."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"master weights compute in bfloat16 or float16, not {dtype}")
    setattr(model, _DTYPE, dtype)
    return model


def _marked(models) -> list[nn.Module]:
    found = []
    for model in models:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        if not isinstance(model, nn.Module):  # None, a wrapper of a model (AdapterDisabled), a reward function
            continue
        found += [m for m in model.modules() if getattr(m, _DTYPE, None) is not None and not getattr(m, _ACTIVE, False)]
    return list({id(m): m for m in found}.values())


@contextlib.contextmanager
def compute_weights(*models):
    """For the block, every float parameter of the marked modules in ``models`` (DDP-wrapped or
    not; others skipped) is replaced by a differentiable cast to the compute dtype, one per shared
    parameter (tied embeddings); nested blocks over the same model do nothing."""
    roots = _marked(models)
    if not roots:
        yield
        return
    swapped, copies = [], {}
    try:
        for root in roots:
            dtype = getattr(root, _DTYPE)
            setattr(root, _ACTIVE, True)
            for module in root.modules():
                for name, p in module._parameters.items():
                    if p is None or not p.is_floating_point() or p.dtype == dtype:
                        continue
                    if id(p) not in copies:
                        copies[id(p)] = p.to(dtype)
                    module._parameters[name] = copies[id(p)]  # a plain tensor: what `module.weight` returns
                    swapped.append((module, name, p))
        yield
    finally:
        for module, name, p in reversed(swapped):
            module._parameters[name] = p
        for root in roots:
            setattr(root, _ACTIVE, False)
