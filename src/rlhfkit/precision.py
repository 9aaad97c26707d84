"""Float32 master weights with bfloat16 arithmetic (``model.master_weights``).

A bfloat16 weight keeps 8 significant bits, so AdamW's steps of about ``lr`` round away on
most of a model's weights when the weights themselves are bfloat16. With master weights the
trained model keeps its float32 parameters -- the optimizer, its moments, the gradients, the
gradient clipping, DDP's all-reduce, the checkpoints and the saved model all see float32 -- and
its forward passes run on bfloat16 copies: :func:`compute_weights` swaps each parameter for
``param.to(bfloat16)`` for the length of a block. The cast is differentiable, so the backward
pass computes each weight's gradient in bfloat16 and accumulates it into the float32 ``.grad``
(across micro-batches too). Every product, norm and residual then runs as in a bfloat16 model:
the same arithmetic as FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, with the
float32 weights of ``torch.autocast`` (where autocast also keeps the residual stream and the
norms in float32, with their casts).

The copies are made once a block: once a generation call, once a minibatch of the update (its
micro-batches' forwards and backwards share them), and once an experience pass that runs the
policy (none where the update's forward gives the old log-probs and the pass runs only the
bfloat16 reference): a small cost beside a step's (benchmarks/archive/code-evidence.md).
"""

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
    """For the block, every floating-point parameter of the modules marked by
    :func:`keep_master_weights` inside ``models`` (DDP-wrapped or not; None and unmarked ones
    are skipped) is replaced, in its module, by a copy in the compute dtype. Under grad mode the
    copies are differentiable casts: the gradients reach the float32 parameters. A parameter
    shared by two modules (tied embeddings) gets one copy. Nested blocks over the same model
    do nothing."""
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
