"""Small shared helpers: seeding, devices, run directories, metric logging."""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows has no fcntl: run directories go unlocked there
    fcntl = None

import numpy as np
import torch

from . import ops
from .config import Config, ConfigError, save_config
from .progress import is_tty, quiet_hub_progress


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def make_accelerator(cfg: Config, find_unused_parameters: bool = False):
    """An ``accelerate.Accelerator`` on ``run.device``: one process, or DDP / DeepSpeed / FSDP under
    ``accelerate launch``; ``find_unused_parameters`` for a backward that skips trained parameters."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    device = resolve_device(cfg.run.device)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)
    if "LOCAL_RANK" in os.environ:
        _destroy_process_group_at_exit()
    if device.type == "cpu" and _launched_with("DEEPSPEED"):
        # accelerate turns DeepSpeed off for cpu=True and, with cpu=False and no GPU, counts one
        # process; a gloo state made first gives both the true count and ranks
        from accelerate import PartialState

        PartialState(cpu=False, backend="gloo")
        return Accelerator(cpu=False, kwargs_handlers=[ddp])
    if device.type == "cpu" and _launched_with("FSDP"):
        return _cpu_fsdp_accelerator()
    return Accelerator(cpu=device.type == "cpu", kwargs_handlers=[ddp])


@functools.cache
def _destroy_process_group_at_exit() -> None:
    """Tear the process group down when a launched process ends (once): left to the interpreter's
    shutdown, a gloo group's threads can abort a finished run (exit code -6)."""
    import torch.distributed as dist

    atexit.register(lambda: dist.is_available() and dist.is_initialized() and dist.destroy_process_group())


def _cpu_fsdp_accelerator():
    """An FSDP accelerator on CPU processes joined with gloo: accelerate applies FSDP only to a
    GPU-like distributed type, so the shared state is told it is multi-device (on the CPU)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=False, backend="gloo")
    if state.num_processes > 1 and state.distributed_type == DistributedType.NO:
        state.distributed_type = DistributedType.MULTI_GPU  # FSDP below; device already set (CPU)
    accelerator = Accelerator(cpu=False)
    # a later Accelerator in this process (the next run) copies this state's type over its own
    state.distributed_type = accelerator.distributed_type
    return accelerator


def _launched_with(engine: str) -> bool:
    """True in a process started by ``accelerate launch`` with an ``engine`` (FSDP, DEEPSPEED) config."""
    return os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true" and "LOCAL_RANK" in os.environ


def is_main_process() -> bool:
    """False on a non-zero rank of a distributed launch: only the main process writes run files."""
    return int(os.environ.get("RANK", "0")) == 0


# What rlhfkit writes at the top of a run directory: a new run continues (run.resume) or replaces
# (run.overwrite deletes these only) a run that left any of them.
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "trajectories.jsonl", "tb", "checkpoints", "policy",
             "policy_adapter", "value_model", "value_head.safetensors", "reward_model", "plots.png", "plot_*.png",
             "summary.json", "report.html", "report.png", "policy.txt", "return_curve.png")


def earlier_run_files(out_dir: str | os.PathLike) -> list[Path]:
    """The files and folders of an earlier run in ``out_dir`` (:data:`RUN_FILES`), sorted."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    return sorted({p for pattern in RUN_FILES for p in out.glob(pattern)})


def produced_anything(out_dir: str | os.PathLike) -> bool:
    """Did the run in ``out_dir`` log a step, write a checkpoint or save a model?"""
    out, checkpoints = Path(out_dir), Path(out_dir) / "checkpoints"
    return ((out / "metrics.jsonl").is_file() and file_size(out / "metrics.jsonl") > 0
            or checkpoints.is_dir() and any(checkpoints.iterdir())
            or any((out / name).exists() for name in ("policy", "policy_adapter", "value_model", "reward_model",
                                                      "summary.json")))


# A live run holds an exclusive flock on this file (dropped by the kernel when the process ends):
# no second process starts, replaces or continues the run there meanwhile.
LOCK_FILE = ".rlhfkit.lock"
_held_locks: dict[Path, Any] = {}


def _flock(f) -> str | None:
    """Take the exclusive lock on open file ``f`` without waiting: None when taken, else the holder's
    description (OSError where the filesystem has no locks)."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        return f.read().strip() or "another process"
    return None


def run_dir_holder(out_dir: str | os.PathLike) -> str | None:
    """Who (process, host, command, since when) else holds ``out_dir``'s run lock, or None."""
    path = Path(out_dir) / LOCK_FILE
    if fcntl is None or Path(out_dir).resolve() in _held_locks or not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _flock(f)  # taken: free (closing the file lets it go)
    except OSError:  # unreadable, or no locks on this filesystem: nothing known
        return None


def _in_use(out_dir: str | os.PathLike, holder: str) -> ConfigError:
    return ConfigError(f"run.out_dir {out_dir} is in use by a live run ({holder}): wait for it to end or stop it, "
                       "or choose another run.out_dir")


def lock_run_dir(out_dir: str | os.PathLike) -> None:
    """Take ``out_dir``'s run lock (creating it) until this process ends or :func:`release_run_dir`;
    ConfigError when another live process holds it, a warning where the filesystem has no locks."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    key = Path(out_dir).resolve()
    if fcntl is None or key in _held_locks:
        return
    f = open(Path(out_dir) / LOCK_FILE, "a+", encoding="utf-8")
    try:
        holder = _flock(f)
    except OSError as e:
        f.close()
        warnings.warn(f"run.out_dir {out_dir}: cannot lock it ({e}); nothing stops a second run from writing "
                      "there at the same time", stacklevel=2)
        return
    if holder:
        f.close()
        raise _in_use(out_dir, holder)
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)[:300]}\n")
    f.flush()
    _held_locks[key] = f


def release_run_dir(out_dir: str | os.PathLike) -> None:
    """Give up ``out_dir``'s run lock before this process ends (a notebook or sweep handing it on)."""
    f = _held_locks.pop(Path(out_dir).resolve(), None)
    if f is not None:
        f.close()  # closing the only descriptor releases the flock


def check_out_dir(cfg: Config, resumable: bool = True) -> None:
    """ConfigError, before anything is written, when ``run.out_dir`` holds a live run, or an earlier
    one that produced something that the config neither resumes nor overwrites."""
    r = cfg.run
    if r.resume and r.overwrite:
        raise ConfigError("run.resume and run.overwrite both set: continue the run in run.out_dir (--resume) or "
                          "replace it (run.overwrite=true), not both")
    holder = run_dir_holder(r.out_dir) if is_main_process() else None
    if holder:
        raise _in_use(r.out_dir, holder)
    found = [] if r.resume or r.overwrite or not produced_anything(r.out_dir) else earlier_run_files(r.out_dir)
    if found:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found[:3]) + (" ..." if len(found) > 3 else "")
        how = "continue it with --resume, replace it with" if resumable else "replace it with"
        raise ConfigError(f"run.out_dir {r.out_dir} holds an earlier run ({names}): {how} run.overwrite=true "
                          "(deletes that run's files first), or choose another run.out_dir")


def clear_run_files(out_dir: str | os.PathLike, extra: tuple[str, ...] = ()) -> None:
    """Delete an earlier run's files (:data:`RUN_FILES` and ``extra``) in ``out_dir``; others stay."""
    out = Path(out_dir)
    for p in [*earlier_run_files(out), *(out / name for name in extra)]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def setup_run(cfg: Config, resumable: bool = True, write: bool = True) -> Path:
    """Seed, threads, accelerated operations, quiet loading bars off a terminal, ``run.out_dir``
    checked; ``write=False``: the caller starts it once its inputs load (a bad one leaves nothing)."""
    seed_everything(cfg.run.seed)
    if cfg.accel.threads > 0:
        torch.set_num_threads(cfg.accel.threads)
    ops.configure(cfg.accel)
    if not cfg.run.progress or not is_tty(sys.stderr):
        quiet_hub_progress()
    check_out_dir(cfg, resumable)
    if write:
        start_run_dir(cfg)
    return Path(cfg.run.out_dir)


def start_run_dir(cfg: Config) -> Path:
    """Create ``run.out_dir`` (an earlier run's files deleted under ``run.overwrite``, or when it
    produced nothing) and save the resolved config in it; the main process only."""
    out = Path(cfg.run.out_dir)
    if is_main_process():
        lock_run_dir(out)  # before anything is deleted or written: a live run there stays untouched
        if cfg.run.overwrite or not (cfg.run.resume or produced_anything(out)):
            clear_run_files(out)  # (an earlier run that produced nothing: its empty logs and config)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    return out


def cut_file(path: str | Path, size: int) -> None:
    """Truncate a file the loop appends to back to ``size`` bytes (where a checkpoint saw it)."""
    if file_size(path) > size:
        with open(path, "r+b") as fh:
            fh.truncate(size)


def file_size(path: str | Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.exists() else 0


def to_float(value: Any) -> float:
    return float(value.detach().float().item()) if isinstance(value, torch.Tensor) else float(value)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl`` (NaN as null) and, given ``cfg``, to
    TensorBoard and ``run.trackers``; ``rows()`` reads them back. ``enabled=False`` (a non-main
    process) writes nothing and keeps the rows in memory."""

    def __init__(self, path: Path, cfg: Config | None = None, enabled: bool = True, resume: dict | None = None):
        self.path = Path(path)
        self.enabled = enabled
        self._kept: list[dict] = []  # rows of a disabled logger
        self._sinks, self._fh, self._start = [], None, 0
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume:  # continuing a run from a checkpoint (position()): drop the rows logged after it
                cut_file(self.path, resume["offset"])
            self._start = resume["start"] if resume else file_size(self.path)  # where earlier runs' rows end
            purge = resume["step"] if resume else None
            self._sinks = make_sinks(cfg, self.path.parent, purge) if cfg is not None else []
            self._fh = self.path.open("a", encoding="utf-8")
        self.t0 = time.perf_counter()

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        row = {"step": step, "time/elapsed_s": round(time.perf_counter() - self.t0, 4)}
        for k, v in metrics.items():
            f = to_float(v)
            row[k] = f if math.isfinite(f) else None
        if not self.enabled:
            self._kept.append(row)
            return row
        self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")  # reward/<name> as named
        self._fh.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and v is not None}
        for sink in self._sinks:
            sink.log(step, scalars)
        return row

    def position(self, step: int) -> dict:
        """Where a checkpoint taken after ``step`` steps finds this log (``MetricsLogger(resume=...)``)."""
        self._flush()
        return {"offset": file_size(self.path) if self.enabled else 0, "start": self._start, "step": step}

    def _flush(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        for sink in self._sinks:
            sink.close()

    def rows(self) -> list[dict]:
        """The rows this logger wrote (not those of an earlier run appended to the same file)."""
        if not self.enabled:
            return list(self._kept)
        self._flush()
        with self.path.open("rb") as f:
            f.seek(self._start)
            return [json.loads(line) for line in f if line.strip()]


class _TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        # purge_step: a resumed run hides the events an interrupted one wrote from that step on
        self.writer = SummaryWriter(logdir=str(log_dir), flush_secs=30, purge_step=purge_step)
        self.close = self.writer.close

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)


class _TrackerSink:
    """wandb or trackio: both expose ``init(project, name, config)``, ``log(dict, step)`` and ``finish()``."""

    def __init__(self, name: str, cfg: Config, out_dir: Path):
        import importlib

        try:
            self.mod = importlib.import_module(name)
        except ImportError:
            raise ValueError(f"run.trackers={cfg.run.trackers!r} asks for {name}, which is not installed: "
                             f"pip install {name} (or drop it from run.trackers)") from None
        self.run = self.mod.init(project="rlhfkit", name=str(out_dir), config=cfg.to_dict())
        self.close = self.mod.finish

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mod.log(scalars, step=step)


TRACKERS = ("wandb", "trackio")


def make_sinks(cfg: Config, out_dir: Path, purge_step: int | None = None) -> list:
    """The metric sinks ``cfg.run`` asks for, besides metrics.jsonl."""
    names = [t.strip() for t in cfg.run.trackers.split(",") if t.strip()]
    bad = [t for t in names if t not in TRACKERS]
    if bad:
        raise ValueError(f"run.trackers={cfg.run.trackers!r}: unknown tracker {bad[0]!r}; choose from {', '.join(TRACKERS)}")
    sinks: list = [_TensorBoardSink(Path(out_dir) / "tb", purge_step)] if cfg.run.tensorboard else []
    sinks += [_TrackerSink(n, cfg, Path(out_dir)) for n in names]
    return sinks


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: str | os.PathLike, rows) -> int:
    """One JSON object a line, non-ASCII characters kept readable; returns the count."""
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    return len(lines)


def mean_stats(rows: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average a list of stats dicts key by key (a key over the dicts that have it)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: sum(vals) / len(vals) for k in keys if (vals := [to_float(r[k]) for r in rows if k in r])}


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. its updates keep coming out NaN); the message says what to change."""


class UpdateGuard:
    """Skips (warns, counts) optimizer updates whose loss or gradient norm is NaN/inf; ``max_bad`` in
    a row raise :class:`TrainingError`: one bad minibatch is noise, a run of them divergence."""

    def __init__(self, max_bad: int = 5, where: str = "training"):
        if max_bad < 1:
            raise ValueError(f"max_bad must be >= 1, got {max_bad}")
        self.max_bad, self.where = max_bad, where
        self.skipped = 0  # updates skipped so far
        self.in_a_row = 0  # consecutive skipped updates, reset by a good one

    def ok(self, loss: torch.Tensor, *grad_norms: torch.Tensor) -> bool:
        """True if this update may be applied; False (after a warning) if it must be skipped."""
        dev = loss.device if isinstance(loss, torch.Tensor) else None
        vals = torch.stack([torch.as_tensor(v, device=dev).detach().float().reshape(()) for v in (loss, *grad_norms)]).cpu()
        if bool(torch.isfinite(vals).all()):
            self.in_a_row = 0
            return True
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        shown = ", ".join(f"{v:.4g}" for v in vals.tolist())
        if self.in_a_row >= self.max_bad:
            raise TrainingError(f"{self.where}: {self.in_a_row} optimizer updates in a row had a non-finite loss or "
                                f"gradient (loss, grad norms = {shown}); stopping before the weights are ruined. "
                                "Lower the learning rate, check the reward/score scale and the data, or allow more "
                                "with run.max_bad_updates")
        warnings.warn(f"{self.where}: non-finite loss or gradient (loss, grad norms = {shown}); update skipped "
                      f"({self.in_a_row} in a row, {self.skipped} in total)", RuntimeWarning, stacklevel=2)
        return False
