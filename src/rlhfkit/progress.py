"""Progress bars: tqdm on a terminal or in a notebook, plain throttled lines in a log (never a
carriage-return frame), and the Hugging Face loading bars turned off where they would be frames."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _notebook_or_std_tqdm
from tqdm.std import tqdm as _std_tqdm


def quiet_hub_progress() -> None:
    """Turn off transformers' and huggingface_hub's tqdm bars for the rest of the process."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


PLAIN_PROGRESS_INTERVAL_S = 10.0  # seconds between two lines written to a stream that is not a terminal
_IN_NOTEBOOK = _notebook_or_std_tqdm is not _std_tqdm  # tqdm.auto chose the Jupyter widget
_clock = time.monotonic  # module-level so that tests can replace it


def is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress(iterable=None, total=None, desc: str = "", enabled: bool = True, initial: int = 0, file=None):
    """A progress bar on ``file`` (stderr): tqdm on a terminal or in a notebook, else :class:`PlainProgress`."""
    stream = sys.stderr if file is None else file
    if not enabled or _IN_NOTEBOOK or is_tty(stream):
        return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True,
                    initial=initial, file=file)
    return PlainProgress(iterable, total=total, desc=desc, initial=initial, file=stream)


class PlainProgress:
    """The part of tqdm the trainers use, as whole lines ``desc: n/total (pct), elapsed, rate |
    postfix``: at the start, at most every ``interval`` seconds, and at the end."""

    def __init__(self, iterable=None, total=None, desc: str = "", initial: int = 0, file=None,
                 interval: float | None = None):
        self.iterable, self.desc, self.n, self.initial = iterable, desc, initial, initial
        self.total = total if total is not None or not hasattr(iterable, "__len__") else len(iterable)
        self.file = sys.stderr if file is None else file
        self.interval = PLAIN_PROGRESS_INTERVAL_S if interval is None else interval
        self.postfix: dict[str, Any] = {}
        self.start_t = self._last_t = _clock()
        self._last_n: int | None = None  # n at the last line written
        self.closed = False

    def __iter__(self):
        if self.iterable is None:
            raise TypeError("PlainProgress without an iterable: call update() instead")
        self._write()
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:  # also when the loop breaks early (the generator is closed) or raises
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if _clock() - self._last_t >= self.interval:
            self._write()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._last_n != self.n:
            self._write()

    def format_line(self) -> str:
        elapsed = _clock() - self.start_t
        head = (f"{self.desc}: " if self.desc else "") + (
            f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}")
        parts = [head, f"{_std_tqdm.format_interval(elapsed)} elapsed"]
        done = self.n - self.initial
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{rate:.2f} it/s" if rate >= 1 else f"{1 / rate:.2f} s/it")
        values = ", ".join(f"{k}={_postfix_value(v)}" for k, v in self.postfix.items())
        return ", ".join(parts) + (f" | {values}" if values else "")

    def _write(self) -> None:
        self.file.write(self.format_line() + "\n")
        self.file.flush()
        self._last_t, self._last_n = _clock(), self.n


def _postfix_value(v: Any) -> str:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    return f"{v:.4g}" if isinstance(v, float) else str(v)
