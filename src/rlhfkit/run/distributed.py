"""Data parallelism through ``accelerate`` (docs/scale-out.md): each process takes its shard of the
global batch, batch statistics use gathered rows, token means are reweighted so DDP's average is the
global mean; with one process every method is the identity."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence

import torch

from ..accel.offload import on_device
from ..models.precision import compute_weights


def rollout_uniforms(seed: int, step: int, global_rows: int, max_new_tokens: int, rows: slice,
                     turn: int = 0) -> torch.Tensor:
    """This process's rows of the step's ``[global_rows, max_new_tokens]`` U(0, 1) draws, a function of
    ``(seed, step, turn)`` alone: a row samples the same response however many processes there are."""
    key = seed * 1_000_003 + step
    if turn:
        key = key * 1_000_033 + turn
    gen = torch.Generator().manual_seed(key % (2**63 - 1))
    return torch.rand((global_rows, max_new_tokens), generator=gen)[rows]  # [b, max_new_tokens]


class Shard:
    """This process's share of a global batch and the trainers' collectives; ``Shard(None)``: one process."""

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.world = accelerator.num_processes if accelerator is not None else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def local_size(self, global_size: int, what: str = "batch size", multiple: int = 1) -> int:
        """``global_size / world``, which must be a whole multiple of ``multiple`` (e.g. GRPO's group)."""
        if global_size % (self.world * multiple):
            extra = f" x {multiple} (group size)" if multiple > 1 else ""
            raise ValueError(f"{what} {global_size} must be divisible by {self.world} processes{extra}")
        return global_size // self.world

    def span(self, n: int) -> slice:
        """This process's share of ``n`` items dealt as evenly as they go (some may get one more)."""
        return slice(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def chunks(self, n: int, size: int) -> list[slice]:
        """This process's chunks of ``n`` items, ``size`` at a time, dealt round-robin."""
        return [slice(i, min(n, i + size)) for i in range(self.rank * size, n, self.world * size)]

    def take(self, items: Sequence | torch.Tensor, what: str = "batch size", multiple: int = 1):
        """This process's contiguous rows of a global batch (a list or a tensor's first dim)."""
        self.local_size(len(items), what, multiple)
        return items[self.span(len(items))]

    def local_rows(self, global_rows: torch.Tensor, local_size: int) -> torch.Tensor:
        """The entries of ``global_rows`` (indices into a global batch sharded as by :meth:`take`) that
        this process holds, as indices into its own ``local_size`` rows, in their order."""
        start = self.rank * local_size
        mine = (global_rows >= start) & (global_rows < start + local_size)
        return global_rows[mine] - start

    def rows_per_process(self, global_rows: torch.Tensor, local_size: int) -> list[int]:
        """How many of ``global_rows`` each process holds, in rank order (no communication)."""
        return torch.bincount(global_rows // local_size, minlength=self.world).tolist()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce sum (a copy; the identity with one process)."""
        return self._all_reduce(x, "SUM")

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, "MAX")

    def _all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self.distributed:
            return x
        out = x.detach().clone()
        torch.distributed.all_reduce(out, op=getattr(torch.distributed.ReduceOp, op))
        return out

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's rows in rank order, ``[b, ...] -> [world * b, ...]``; a ``[b, R]`` whose ``R``
        differs between processes is right-padded with zeros to the longest first."""
        if not self.distributed:
            return x
        if x.dim() > 1:
            x = self.accelerator.pad_across_processes(x.contiguous(), dim=1, pad_index=0)
        return self.accelerator.gather(x.contiguous())

    def apply_rows(self, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        """``fn`` (``[B, ...]`` tensors -> a ``[B, ...]`` tensor or a scalar) on the gathered global
        batch, cut back to this process's rows (and a ``[b, R]`` input's width)."""
        if not self.distributed:
            return fn(*tensors)
        out = fn(*[self.gather_rows(t) for t in tensors])
        if out.dim() == 0:
            return out
        b = tensors[0].shape[0]
        out = out[self.rank * b : (self.rank + 1) * b]
        return out[:, : tensors[0].shape[1]] if out.dim() > 1 and tensors[0].dim() > 1 else out

    def token_weight(self, mask: torch.Tensor) -> float:
        return self.count_weight(mask.sum())

    def count_weight(self, n_local: torch.Tensor) -> float:
        """``world * n_local / n_global`` for a mean over this process's ``n_local`` units (tokens,
        rows): after DDP's average the gradient is the global mean's (1 with one process)."""
        if not self.distributed:
            return 1.0
        n_local = torch.as_tensor(n_local).float()
        n_global = self.sum(n_local)
        return float(self.world * n_local / n_global.clamp(min=1))

    def mean(self, stats: dict[str, float], weight: float = 1.0, maxed: Sequence[str] = ()) -> dict[str, float]:
        """Average scalar stats over processes, this process's times ``weight`` (a :meth:`token_weight`
        makes a token mean exact); keys in ``maxed`` are reduced with max instead."""
        if not self.distributed or not stats:
            return dict(stats)
        keys = list(stats)
        device = self.accelerator.device
        vals = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64, device=device)
        is_max = torch.tensor([k in maxed for k in keys], device=device)
        out = self.sum(torch.where(is_max, 0.0, vals * weight)) / self.world
        if bool(is_max.any()):
            out = torch.where(is_max, self.max(torch.where(is_max, vals, float("-inf"))), out)
        return {k: float(v) for k, v in zip(keys, out.tolist())}

    def wait(self) -> None:
        if self.distributed:
            self.accelerator.wait_for_everyone()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_sharded(t) -> bool:
    """True for FSDP2's sharded tensors (DTensors); plain tensors skip the slower attribute probe."""
    return type(t) not in _PLAIN and hasattr(t, "full_tensor")


def _clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (NaN/inf passed to the caller's guard) in four calls,
    without torch's per-call checks and grouping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(g.device != grads[0].device or g.dtype != grads[0].dtype for g in grads):  # torch groups them
        return torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_(max=1.0))
    return total.detach()


def clip_grad_norm(accelerator, parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradient norm through the engine; the norm before clipping, detached (NaN where
    the engine reports none: DeepSpeed)."""
    params = [p for p in parameters if p.requires_grad]
    if accelerator is None or (accelerator.distributed_type == "NO" and accelerator.scaler is None):
        return _clip_grad_norm(params, max_norm)
    norm = accelerator.clip_grad_norm_(params, max_norm)
    if norm is None:
        return torch.tensor(float("nan"))
    if is_sharded(norm):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    return torch.as_tensor(norm).detach()


def full_state_dict(module) -> dict | None:
    """The module's weights with FSDP2's shards gathered, for saving (a collective); None when
    nothing is sharded."""
    sd = module.state_dict()
    if not any(is_sharded(v) for v in sd.values()):
        return None
    return {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu() for k, v in sd.items()}


def fsdp_modules(model) -> list:
    """``model``'s FSDP2 modules, the root first (empty when nothing is sharded)."""
    if not isinstance(model, torch.nn.Module):  # None, or a LoRA reference (sharded with its policy)
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_frozen(accelerator, *models) -> list:
    """Under FSDP, shard frozen models (reference, reward) by decoder layer and root as the trained
    ones are; returns those it sharded."""
    if getattr(accelerator, "distributed_type", None) != "FSDP":
        return []
    from torch.distributed.fsdp import fully_shard

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None) or []
    sharded = []
    for model in models:
        if not isinstance(model, torch.nn.Module) or fsdp_modules(model):
            continue
        layers = set(names) or set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        sharded.append(model)
    if sharded and accelerator.is_main_process:
        print(f"FSDP: {len(sharded)} frozen model(s) (reference, reward model) sharded too", file=sys.stderr)
    return sharded


@contextlib.contextmanager
def full_weights(*models, per_layer: bool = False, compute: bool = True):
    """:func:`_full_weights` of each of ``models`` (offloaded ones brought back) and, with
    ``compute``, their compute-dtype copies under ``model.master_weights``."""
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(on_device(model))  # accel.offload: a frozen model's weights come from host memory
            stack.enter_context(_full_weights(model, per_layer))
        if compute:
            stack.enter_context(compute_weights(*models))
        yield


@contextlib.contextmanager
def _full_weights(model, per_layer: bool = False):
    """Under FSDP2, ``model``'s weights gathered for calls that bypass its root forward (generation)
    until the block ends; ``per_layer``: only the root's, each layer gathering its own."""
    mods = fsdp_modules(model)
    if not mods:
        yield
        return
    # the root first: a layer called directly would make itself a root and break the next training forward
    mods[0]._get_fsdp_state()._lazy_init()  # no public call does it outside a root forward
    groups = [] if per_layer else [g for m in mods for g in m._get_fsdp_state()._fsdp_param_groups]
    saved = [g.post_forward_mesh_info for g in groups]
    for g in groups:  # keep the layers gathered after their forwards
        g.post_forward_mesh_info = None
    gathered = mods if not per_layer else mods[:1]
    for m in gathered:
        m.unshard()
    try:
        yield
    finally:
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info
        for m in gathered:
            m.reshard()


def prepare(accelerator, *objects, micro_batch: int):
    """``accelerator.prepare(*objects)``, first telling DeepSpeed the per-process micro-batch (it
    reads it from a dataloader otherwise, and the trainers prepare none)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    return accelerator.prepare(*objects)
