"""Small shared helpers: seeding, devices, run directories, metric logging."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import Config, save_config


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def make_accelerator(cfg: Config, find_unused_parameters: bool = False):
    """An ``accelerate.Accelerator`` on the configured device.

    Trainers take their device from it, ``prepare`` the trained models and optimizers and
    call ``accelerator.backward``: one process by default, DDP / DeepSpeed / FSDP under
    ``accelerate launch`` (see :mod:`rlhfkit.distributed`). ``find_unused_parameters``: some
    backward passes leave trained parameters out (a PPO critic warm-up skips the actor),
    which DDP must be told (it costs a graph traversal per backward).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    device = resolve_device(cfg.run.device)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)
    return Accelerator(cpu=device.type == "cpu", kwargs_handlers=[ddp])


def is_main_process() -> bool:
    """True unless this is a non-zero rank of a distributed launch (``accelerate launch``,
    ``torchrun``): only the main process writes run files."""
    return int(os.environ.get("RANK", "0")) == 0


def setup_run(cfg: Config) -> Path:
    """Seed, set threads, create the run directory and save the resolved config in it (the
    main process only; every process of a distributed launch uses the same seed)."""
    seed_everything(cfg.run.seed)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        save_config(cfg, out / "config.yaml")
    return out


def progress(iterable=None, total=None, desc: str = "", enabled: bool = True):
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` (scalars only, NaN kept as null).

    ``enabled=False`` (a non-main process) builds the same rows and writes nothing."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8") if enabled else None
        self.t0 = time.perf_counter()

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        row = {"step": step, "time/elapsed_s": round(time.perf_counter() - self.t0, 4)}
        for k, v in metrics.items():
            f = to_float(v)
            row[k] = f if math.isfinite(f) else None
        if self._fh is not None:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
        return row

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def mean_stats(rows: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average a list of stats dicts key by key."""
    keys = rows[0].keys() if rows else []
    return {k: sum(to_float(r[k]) for r in rows) / len(rows) for k in keys}
