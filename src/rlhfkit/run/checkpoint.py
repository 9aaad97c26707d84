"""Atomic checkpoints and exact resume (docs/checkpoints.md): ``checkpoints/step-N/`` (trainable
parameters, ``trainer_state.pt``, ``meta.json``) is written under a temporary name and renamed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from safetensors.torch import load_file, save_file
from torch import nn

from .distributed import is_sharded

CHECKPOINTS = "checkpoints"
SHARDED = "sharded"
_PREFIX = "step-"


def fault_point(name: str, step: int) -> None:
    """SIGKILL this process if ``RLHFKIT_FAULT`` names this point and step (a test hook)."""
    want = os.environ.get("RLHFKIT_FAULT")
    if want and want == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _py_state(rng) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_py_state(rng, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, every CUDA device) RNG states: a JSON part and a tensor part."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": _py_state(random),
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return {"plain": plain, "tensors": tensors}


def set_rng_state(plain: dict[str, Any], tensors: dict[str, Any]) -> None:
    _set_py_state(random, plain["python"])
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters an optimizer changes (``requires_grad``), by name, as contiguous CPU tensors."""
    return {n: p.detach().contiguous().cpu() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable_state(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    params = dict(module.named_parameters())
    want = {n for n, p in params.items() if p.requires_grad}
    wrong = sorted(n for n in want & set(state) if state[n].shape != params[n].shape)[:3]
    if set(state) != want or wrong:
        missing, extra = sorted(want - set(state))[:3], sorted(set(state) - want)[:3]
        critic = {n.split(".")[0] for n in [*missing, *extra]} & {"critic", "value_head"}
        hint = (" (PPO's critic: set ppo.value_model as the run had it, 'separate' for a critic model of its own "
                "or 'shared' for a value head on the policy)") if critic else ""
        raise ValueError(f"checkpoint {where} does not fit the model built from this config (missing {missing}, "
                         f"unexpected {extra}, other shapes {wrong}): resume with the config the run was started "
                         f"with{hint}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


def holds_shards(modules: dict[str, nn.Module]) -> bool:
    """Do these modules train FSDP-sharded weights? Then every process writes its shards."""
    return any(is_sharded(p) for m in modules.values() for p in m.parameters() if p.requires_grad)


def _rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def _world() -> int:
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def _barrier(sharded: bool = True) -> None:
    """Wait for every process, where all of them write a sharded checkpoint."""
    if sharded and _world() > 1:
        tdist.barrier()


def _sharded_states(modules: dict[str, nn.Module], optimizers: dict[str, Any]):
    """The local shards of the module and optimizers as ``torch.distributed.checkpoint`` writes them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if len(modules) != 1:
        raise NotImplementedError(f"sharded checkpoints hold one trained module, not {sorted(modules)}")
    (name, model), = modules.items()
    optims = {k: getattr(o, "optimizer", o) for k, o in optimizers.items()}  # accelerate's wrapper: the torch one
    options = StateDictOptions(ignore_frozen_params=True)
    state = {"modules": {name: get_model_state_dict(model, options=options)},
             "optimizers": {k: get_optimizer_state_dict(model, o, options=options) for k, o in optims.items()}}
    return state, model, optims, options


def save_shards(path: Path, modules: dict[str, nn.Module], optimizers: dict[str, Any]) -> None:
    """Every process writes into checkpoint ``path`` its shards of the trainable weights and optimizer
    states, and its RNG states (a collective)."""
    import torch.distributed.checkpoint as dcp

    _barrier()  # the directory exists
    dcp.save(_sharded_states(modules, optimizers)[0], checkpoint_id=path / SHARDED)
    torch.save(rng_state(), path / f"rng-{_rank()}.pt")
    _barrier()  # every process's files are written


def load_shards(path: Path, meta: dict[str, Any], modules: dict[str, nn.Module], optimizers: dict[str, Any]) -> None:
    """Read back what :func:`save_shards` wrote into the same modules and optimizers, with the same
    number of processes (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    then, now, sharded = meta["sharded"]["processes"], _world(), holds_shards(modules)
    if then != now or not sharded:
        raise ValueError(f"checkpoint {path} holds the shards of {then} FSDP processes, this run has {now} "
                         f"{'FSDP ' if sharded else 'unsharded '}processes: resume with the launch "
                         "the run was started with")
    directory = path / SHARDED
    state, model, optims, options = _sharded_states(modules, optimizers)
    # a fresh optimizer's state read creates one for every parameter: keep those the checkpoint has
    keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for k, osd in state["optimizers"].items():
        prefix = f"optimizers.{k}.state."
        saved = {key[len(prefix):].rsplit(".", 1)[0] for key in keys if key.startswith(prefix)}
        osd["state"] = {fqn: v for fqn, v in osd["state"].items() if fqn in saved}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, next(iter(state["modules"].values())), options=options)
    partial = dataclasses.replace(options, strict=False)  # those parameters without a state
    for k, o in optims.items():
        set_optimizer_state_dict(model, o, state["optimizers"][k], options=partial)
    rng = torch.load(path / f"rng-{_rank()}.pt", map_location="cpu", weights_only=True)
    set_rng_state(rng["plain"], rng["tensors"])


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # a filesystem that cannot open or sync a directory: nothing to do
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _step_of(path: Path) -> int | None:
    """The step of a complete checkpoint directory ``step-N`` (None for anything else)."""
    digits = path.name.removeprefix(_PREFIX)
    done = path.name.startswith(_PREFIX) and digits.isdecimal() and (path / "meta.json").exists()
    return int(digits) if done else None


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir/checkpoints`` (None if there is none)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None]
    return max(found)[1] if found else None


class Checkpointer:
    """Saves a loop's modules, optimizers, schedulers and JSON ``state`` every ``every`` steps (0:
    never); restores the newest into the same objects when ``resume``. The main process writes
    (under FSDP each process its shards); every process restores."""

    def __init__(self, out_dir: str | Path, every: int = 0, keep: int = 2, resume: bool = False,
                 enabled: bool = True):
        self.root = Path(out_dir) / CHECKPOINTS
        self.every, self.keep, self.resume, self.enabled = every, max(1, keep), resume, enabled

    @classmethod
    def from_config(cls, cfg, out_dir: str | Path, enabled: bool = True) -> Checkpointer:
        r = cfg.run
        return cls(out_dir, r.checkpoint_every, r.keep_checkpoints, r.resume, enabled)

    def due(self, steps_done: int, last: bool = False) -> bool:
        """Is a checkpoint due after ``steps_done`` steps? (Not after the last: the run saves its models.)"""
        return self.every > 0 and not last and steps_done % self.every == 0

    def save(self, steps_done: int, modules: dict[str, nn.Module], optimizers: dict[str, Any],
             state: dict[str, Any], schedulers: dict[str, Any] | None = None) -> Path | None:
        sharded = holds_shards(modules)
        if not self.enabled and not sharded:
            return None
        final = self.root / f"{_PREFIX}{steps_done:08d}"
        # sharded: one directory that every process writes into, so a name they all know
        tmp = self.root / f".tmp-{final.name}-{SHARDED if sharded else os.getpid()}"
        if self.enabled:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if sharded:
            save_shards(tmp, modules, optimizers)
        if self.enabled:
            self._write(tmp, steps_done, modules, optimizers, state, schedulers, sharded)
        _barrier(sharded)
        fault_point("checkpoint_write", steps_done)  # files written, not yet renamed
        if self.enabled:
            if final.exists():  # a resumed run passing the same step again: replace it
                old = self.root / f".old-{final.name}-{os.getpid()}"
                final.rename(old)
                shutil.rmtree(old)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier(sharded)  # no process goes on before the checkpoint is complete
        return final if self.enabled else None

    def _write(self, tmp: Path, steps_done: int, modules: dict[str, nn.Module], optimizers: dict[str, Any],
               state: dict[str, Any], schedulers: dict[str, Any] | None, sharded: bool) -> None:
        if not sharded:
            for name, module in modules.items():
                save_file(trainable_state(module), str(tmp / f"{name}.safetensors"))
        rng = rng_state()
        torch.save({"optimizers": {} if sharded else {k: o.state_dict() for k, o in optimizers.items()},
                    "schedulers": {k: s.state_dict() for k, s in (schedulers or {}).items()},
                    "rng": rng["tensors"]}, tmp / "trainer_state.pt")
        meta = {"step": steps_done, "rng": rng["plain"], "state": state, "modules": sorted(modules)}
        if sharded:
            meta["sharded"] = {"processes": _world()}
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        for d in (tmp / SHARDED, tmp):
            _fsync_dir(d)

    def _prune(self) -> None:
        done = sorted((s, p) for p in self.root.iterdir() if (s := _step_of(p)) is not None)
        for _, p in done[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def restore(self, modules: dict[str, nn.Module], optimizers: dict[str, Any],
                schedulers: dict[str, Any] | None = None, steps: int | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint into these objects (when ``resume``); its step and state.
        ``steps``: the run's step budget, which must lie beyond it."""
        if not self.resume:
            return None
        if self.root.is_dir() and self.enabled:  # a write killed half-way: nothing of it is used
            for p in [*self.root.glob(".tmp-*"), *self.root.glob(".old-*")]:
                shutil.rmtree(p, ignore_errors=True)
        path = latest_checkpoint(self.root.parent)
        if path is None:
            return None
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if steps is not None and meta["step"] >= steps:
            raise ValueError(f"checkpoint {path} is after step {meta['step']}, but this run has only {steps} steps: "
                             "raise the step count to continue it, or start a fresh run.out_dir")
        if sorted(modules) != meta["modules"]:
            raise ValueError(f"checkpoint {path} holds modules {meta['modules']}, this run trains {sorted(modules)}: "
                             "resume with the command and config the run was started with")
        trainer = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        if "sharded" in meta:
            load_shards(path, meta, modules, optimizers)
        else:
            for name, module in modules.items():
                load_trainable_state(module, load_file(str(path / f"{name}.safetensors")), str(path))
            for k, o in optimizers.items():
                o.load_state_dict(trainer["optimizers"][k])
            set_rng_state(meta["rng"], trainer["rng"])
        for k, s in (schedulers or {}).items():
            s.load_state_dict(trainer["schedulers"][k])
        return {"step": meta["step"], "path": str(path), **meta["state"]}


def data_state(data) -> Any:
    """A task data generator's position as JSON: ``data.state_dict()``, else its ``data.rng``'s."""
    if hasattr(data, "state_dict"):
        return data.state_dict()
    rng = getattr(data, "rng", None)
    if not isinstance(rng, random.Random):
        raise TypeError(f"{type(data).__name__} has neither state_dict() nor a random.Random .rng: its position "
                        "cannot be checkpointed (add state_dict / load_state_dict to it)")
    return _py_state(rng)


def load_data_state(data, state: Any) -> None:
    if hasattr(data, "load_state_dict"):
        data.load_state_dict(state)
    else:
        _set_py_state(data.rng, state)


def loop_state(steps_done: int, log, guard, data=None, generator: torch.Generator | None = None,
               **extra: Any) -> dict[str, Any]:
    """A loop's JSON state for :meth:`Checkpointer.save`: the log's position, the guard's counters,
    the data's and ``generator``'s positions."""
    state = {"metrics": log.position(steps_done), "guard": [guard.skipped, guard.in_a_row], **extra}
    if data is not None:
        state["data"] = data_state(data)
    if generator is not None:
        state["generator"] = generator.get_state().tolist()
    return state


def restore_loop_state(resumed: dict[str, Any], guard, data=None, generator: torch.Generator | None = None) -> None:
    """Put back what :func:`loop_state` saved (the metrics log takes ``resumed['metrics']`` itself)."""
    guard.skipped, guard.in_a_row = resumed["guard"]
    if data is not None:
        load_data_state(data, resumed["data"])
    if generator is not None:
        generator.set_state(torch.tensor(resumed["generator"], dtype=torch.uint8))
