"""What every training loop shares: the run's plumbing in one object, and small helpers.

A trainer's own code is its arithmetic; :class:`Run` holds the rest, the same in all of them::

    run = Run(cfg, "dpo", steps=cfg.dpo.steps)       # seed, run dir check, accelerator, guard
    train_model, opt, params, engine = run.optimize(model, lr, batch_size)  # AdamW, DDP / FSDP
    resumed = run.restore({"policy": model}, {"optimizer": opt}, generator=gen)  # + run dir, config.yaml
    for step in run.steps():                          # progress from the resumed step on
        ...                                           # the trainer's own step
        grad_norm = engine.update(opt, params, loss)  # clip, step unless non-finite, zero
        run.log(step, row, loss=f"{row['dpo/loss']:.3f}")
        run.checkpoint(step, pos=pos)                 # when due; extra state beside the standard one
    run.close()
    run.save_model(model, tok, "policy", adapter="policy_adapter")
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import REGIME_NAMES, Config, key_value, regime_value
from ..core import logprobs_from_logits, position_ids_from_mask
from ..models.forward import from_scratch, save_policy
from ..progress import progress
from ..run.checkpoint import Checkpointer, loop_state, restore_loop_state
from ..run.distributed import Shard, clip_grad_norm, full_state_dict, prepare
from ..utils import MetricsLogger, UpdateGuard, make_accelerator, setup_run, start_run_dir

LOSS_FIELDS = ("input_ids", "attention_mask", "loss_mask")  # an encoded row's fields sequence_logprobs reads


def warn_lossy_updates(optimizer: torch.optim.Optimizer) -> None:
    """Warn (once per optimizer) when it trains half-precision weights in place: an AdamW step of
    about ``lr`` rounds to nothing on every weight above about ``2 lr / eps`` in magnitude."""
    for group in optimizer.param_groups:
        half = [p for p in group["params"] if p.dtype in (torch.bfloat16, torch.float16)]
        if half:
            dtype, lr = half[0].dtype, group["lr"]
            warnings.warn(f"{sum(p.numel() for p in half):,} trainable weights are {str(dtype).split('.')[-1]} "
                          f"(model.dtype): an optimizer step of about lr={lr:g} rounds to nothing on every weight "
                          f"above about {2 * lr / torch.finfo(dtype).eps:.2g} in magnitude, most of a model's. Keep them float32: "
                          "model.dtype=float32, or model.master_weights=true with bfloat16 (its arithmetic on "
                          "float32 weights), or train a LoRA adapter (model.lora_r), which stays float32.",
                          RuntimeWarning, stacklevel=2)
            return


def lr_scale(step: int, total: int, warmup: int = 0, schedule: str = "cosine", floor: float = 0.0) -> float:
    """The learning rate of (0-based) step ``step`` of ``total`` as a share of the peak: a linear
    warm-up over ``warmup`` steps, then ``schedule`` ('constant', 'linear', 'cosine') from 1 to
    ``floor``. A function of the step alone, so a resumed run continues on the same curve."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = {"constant": 1.0, "linear": 1.0 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac))}[schedule]
    return floor + (1 - floor) * decay


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up then cosine decay to ``floor`` of the peak (:func:`lr_scale`), for ``LambdaLR``."""
    return functools.partial(lr_scale, total=total, warmup=warmup, schedule="cosine", floor=floor)


def sequence_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor,
                      logit_sums: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sum of log pi(response tokens | prefix) per row, ``[2B, T]`` -> ``[2B]`` (``loss_mask``
    marks the response tokens); with ``logit_sums`` also each row's sum over those positions of
    the logits' vocabulary mean (no grad), for TRL's ``logits/*``."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    logps = logprobs_from_logits(logits[:, :-1], ids[:, 1:])  # [2B, T-1]
    keep = loss_mask[:, 1:].bool()  # [2B, T-1]
    summed = torch.where(keep, logps, 0.0).sum(-1)  # [2B]
    if not logit_sums:
        return summed
    with torch.no_grad():
        vocab_mean = logits[:, :-1].float().mean(-1)  # [2B, T-1]
        return summed, torch.where(keep, vocab_mean, 0.0).sum(-1)  # [2B], [2B]


def training_regime(cfg: Config, model) -> str:
    """What ``model`` is trained as (config.REGIME_DEFAULTS): 'scratch', 'pretrained' or 'lora'
    (model.lora_r > 0); model.regime=auto reads the mark on models built from scratch."""
    regime = cfg.model.regime
    if regime == "auto":
        regime = "scratch" if from_scratch(model) else "pretrained"
    return "lora" if regime == "pretrained" and cfg.model.lora_r else regime


@dataclass
class Engine:
    """How an update runs its backward pass, in one process or several: ``model`` as prepared (None:
    the module itself), ``accelerator`` (None: plain torch), ``shard``, and ``guard``."""

    model: torch.nn.Module | None = None
    accelerator: Any = None
    shard: Shard = field(default_factory=Shard)
    guard: UpdateGuard = field(default_factory=UpdateGuard)
    sync: tuple = ()
    """Parameters whose gradients :meth:`accumulate` averages itself, for an update around the DDP
    wrapper (a critic warm-up)."""

    def _accelerate_adds_nothing(self) -> bool:
        """Are accelerate's ``backward``, ``step`` and ``zero_grad`` the plain calls here (no DeepSpeed,
        Megatron, XLA, scaler or accumulation)? Then they are skipped, with their overhead."""
        acc = self.accelerator
        return acc is None or (acc.distributed_type not in ("DEEPSPEED", "MEGATRON_LM", "XLA") and acc.scaler is None
                               and acc.gradient_accumulation_steps == 1)

    def backward(self, loss: torch.Tensor) -> None:
        if self._accelerate_adds_nothing():
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def _inner(self, optimizer):
        """The torch optimizer inside accelerate's own wrapper (not a subclass such as DeepSpeed's)
        where the wrapper adds nothing, else ``optimizer``."""
        from accelerate.optimizer import AcceleratedOptimizer

        if (type(optimizer) is AcceleratedOptimizer and self._accelerate_adds_nothing() and optimizer.scaler is None
                and optimizer.gradient_state.sync_gradients):
            return optimizer.optimizer
        return optimizer

    def step(self, optimizer) -> None:
        """``optimizer.step()``, around accelerate's wrapper where it adds nothing."""
        self._inner(optimizer).step()

    def zero_grad(self, optimizer) -> None:
        """``optimizer.zero_grad(set_to_none=True)``, around accelerate's wrapper where it adds nothing."""
        self._inner(optimizer).zero_grad(set_to_none=True)

    def clip(self, parameters, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.accelerator, parameters, max_norm)

    def update(self, optimizer, parameters, loss: torch.Tensor, max_norm: float = 1.0) -> torch.Tensor:
        """Clip the gradients, step unless the guard skips a non-finite update, zero them; the norm."""
        grad_norm = self.clip(parameters, max_norm)
        if self.guard.ok(loss, grad_norm):
            optimizer.step()  # the wrapper's own: an LR scheduler counts its calls
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def accumulate(self, n_rows: int, micro_batch: int, step: Callable[[slice], tuple],
                   maxed: tuple[str, ...] = (), passes: int = 0) -> tuple[torch.Tensor, dict]:
        """Backward passes of ``step(rows)``'s ``(loss, stats)`` over ``n_rows``, ``micro_batch`` at a time
        (0: all; DDP syncs on the last), at least ``passes`` (empty ones: the same collectives on
        every process); the summed loss (detached) and stats (``maxed``: the maximum)."""
        size = micro_batch or max(n_rows, 1)
        chunks = [slice(i, min(n_rows, i + size)) for i in range(0, n_rows, size)]
        chunks += [slice(n_rows, n_rows)] * (passes - len(chunks))
        acc = self.accelerator
        if len(chunks) > 1 and acc is not None and acc.distributed_type == "DEEPSPEED":
            raise ValueError("micro_batch_size > 0 is not supported under DeepSpeed, whose engine steps the optimizer "
                             "after every backward; set micro_batch_size=0 (or use DDP)")
        total, out = torch.zeros(()), {}
        for k, rows in enumerate(chunks):
            quiet = k < len(chunks) - 1 and acc is not None and self.model is not None
            with acc.no_sync(self.model) if quiet else contextlib.nullcontext():
                loss, stats = step(rows)
                self.backward(loss)
            total = total.to(loss.device) + loss.detach()
            for key, v in stats.items():
                v = v.detach() if isinstance(v, torch.Tensor) else v
                out[key] = v if key not in out else (max(out[key], v) if key in maxed else out[key] + v)
        self._average_gradients()
        return total, out

    def _average_gradients(self) -> None:
        """DDP's average of the ``sync`` parameters' gradients: each divided by the number of
        processes, then summed over them (one all-reduce of the flattened gradients)."""
        grads = [p.grad for p in self.sync if p.grad is not None]
        if not grads or not self.shard.distributed:
            return
        flat = torch.cat([g.flatten() for g in grads]) / self.shard.world
        torch.distributed.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class Run:
    """One training run's plumbing: run directory, accelerator and shard, update guard,
    checkpoints and exact resume, metrics log, progress, and the final save. ``Run()`` checks and
    seeds; :meth:`restore`, once the models and data exist, creates the run directory, resumes and
    opens the log. Only the main process writes files; every process runs the same calls."""

    def __init__(self, cfg: Config, name: str, steps: int, find_unused_parameters: bool = False, log_every: int = 1):
        self.cfg, self.name, self.total = cfg, name, steps
        self.log_every = cfg.run.log_every or log_every  # run.log_every, else the command's own interval
        # nothing is written yet: restore() starts the directory once the models and data loaded
        self.out: Path = setup_run(cfg, write=False)
        self.accelerator = make_accelerator(cfg, find_unused_parameters=find_unused_parameters)
        kind = getattr(self.accelerator, "distributed_type", None)
        if cfg.model.master_weights and kind in ("FSDP", "DEEPSPEED"):  # their weights are sharded or flattened
            raise ValueError(f"model.master_weights runs on one process or under DDP; under {kind} use the engine's "
                             "own mixed precision (accelerate's --mixed_precision bf16) with model.dtype=float32")
        self.shard = Shard(self.accelerator)
        self.device = self.accelerator.device
        self.guard = UpdateGuard(cfg.run.max_bad_updates, name)
        self.ckpt = Checkpointer.from_config(cfg, self.out, enabled=self.shard.is_main)
        self.start = 0
        self.log_: MetricsLogger | None = None
        self.bar = None
        self._saved: dict[str, Any] = {}
        self._rates = ""  # the learning rates' line (learning_rates), printed when the run starts
        self._t0 = time.perf_counter()

    @property
    def is_main(self) -> bool:
        return self.shard.is_main

    def engine(self, model) -> Engine:
        return Engine(model, self.accelerator, self.shard, self.guard)

    def prepare(self, *objects, micro_batch: int):
        """The trained model(s) and optimizer as the engine wants them (DDP / FSDP / DeepSpeed);
        an optimizer of half-precision weights warns (:func:`warn_lossy_updates`)."""
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer):
                warn_lossy_updates(obj)
        return prepare(self.accelerator, *objects, micro_batch=micro_batch)

    def optimize(self, model, lr: float, batch_size: int, module=None):
        """AdamW at ``lr`` over ``model``'s trainable weights, prepared with ``module`` (``model``, or
        a forward around it that DDP must see) for ``batch_size`` global rows a step: ``(prepared
        module, optimizer, trainable params, engine)``, the params read after FSDP2 replaced them."""
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        module, opt = self.prepare(model if module is None else module, opt,
                                   micro_batch=max(1, batch_size // self.shard.world))
        return module, opt, [p for p in model.parameters() if p.requires_grad], self.engine(module)

    def restore(self, modules: dict, optimizers: dict, schedulers: dict | None = None, data=None,
                generator: torch.Generator | None = None) -> dict:
        """Start the run directory, load the newest checkpoint (``run.resume``) into these objects
        (which :meth:`checkpoint` saves) and open the metrics log; the loop state (``{}``: fresh)."""
        self.shard.wait()  # every process has checked run.out_dir (Run()) before the main one writes
        start_run_dir(self.cfg)
        if self._rates and self.is_main:
            print(self._rates, file=sys.stderr)
        self._saved = {"modules": modules, "optimizers": optimizers, "schedulers": schedulers, "data": data,
                       "generator": generator}
        resumed = self.ckpt.restore(modules, optimizers, schedulers, steps=self.total) or {}
        if resumed:
            restore_loop_state(resumed, self.guard, data, generator)
            print(f"resuming {self.name} from {resumed['path']} (step {resumed['step']} of {self.total})",
                  file=sys.stderr)
        self.start = resumed.get("step", 0)
        self._t0 = time.perf_counter() - resumed.get("seconds", 0.0)
        self.log_ = MetricsLogger(self.out / "metrics.jsonl", self.cfg, enabled=self.is_main,
                                  resume=resumed.get("metrics"))
        return resumed

    def steps(self):
        """The step numbers still to run, under a progress display (main process only)."""
        self.bar = progress(range(self.start, self.total), desc=self.name, total=self.total, initial=self.start,
                            enabled=self.cfg.run.progress and self.is_main)
        return self.bar

    @property
    def seconds(self) -> float:
        """Wall seconds since the start, a resumed run's earlier ones included."""
        return time.perf_counter() - self._t0

    def learning_rates(self, model, *keys: str) -> dict[str, Any]:
        """``{key: value}`` for the dotted ``keys`` of config.REGIME_DEFAULTS: the config's value, or
        where unset the model's regime's (:func:`training_regime`); printed when the run starts."""
        regime = training_regime(self.cfg, model)
        values = {key: regime_value(self.cfg, key, regime) for key in keys}
        shown = ", ".join(f"{key} {value:g}{'' if key_value(self.cfg, key) is None else ' (set)'}"
                          for key, value in values.items())
        self._rates = f"learning rates: {REGIME_NAMES[regime]} -> {shown}"
        return values

    def eval_due(self, step: int, every: int) -> bool:
        """Is a held-out evaluation due after ``step`` (every ``every`` steps, 0: never; and the last)?"""
        return bool(every and (step + 1) % every == 0) or step == self.total - 1

    def log_due(self, step: int, force: bool = False) -> bool:
        """Is a metrics row due after ``step`` (every ``log_every``, the last, or ``force``)?"""
        return force or step % self.log_every == 0 or step >= self.total - 1

    def log(self, step: int, row: dict, force: bool = False, **postfix: str) -> dict | None:
        """One metrics row (``guard/skipped_updates`` added) when one is due (:meth:`log_due`; None
        otherwise); ``postfix`` goes to the progress line."""
        if not self.log_due(step, force):
            return None
        row = self.log_.log(step, {**row, "guard/skipped_updates": self.guard.skipped})
        if postfix and self.bar is not None:
            self.bar.set_postfix(**postfix)
        return row

    def due(self, step: int) -> bool:
        """Is a checkpoint due after ``step`` (``run.checkpoint_every``; never after the last)?"""
        return self.ckpt.due(step + 1, step == self.total - 1)

    def checkpoint(self, step: int, **extra: Any) -> None:
        """After ``step``: save a checkpoint when one is due, with the standard loop state (log
        position, guard, data position, generator, seconds) and ``extra``."""
        if not self.due(step):
            return
        s = self._saved
        state = loop_state(step + 1, self.log_, self.guard, s["data"], s["generator"], seconds=self.seconds, **extra)
        self.ckpt.save(step + 1, s["modules"], s["optimizers"], state, s["schedulers"])

    def close(self) -> None:
        self.log_.close()

    def save_model(self, model, tokenizer, subdir: str, adapter: str | None = None) -> Path:
        """Write ``model`` to ``OUT_DIR/subdir`` as a ``from_pretrained`` directory (a LoRA adapter
        also to ``OUT_DIR/adapter``); a collective, FSDP shards gathered, the main process writes."""
        path = self.out / subdir
        self.shard.wait()
        weights = full_state_dict(model)  # FSDP: gathered on every process; None otherwise
        if self.is_main:
            save_policy(model, tokenizer, path, self.out / adapter if adapter else None, weights)
        self.shard.wait()
        return path
