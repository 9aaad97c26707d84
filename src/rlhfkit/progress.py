"""Progress bars: tqdm on a terminal or in a notebook, plain throttled lines in a log (never a
carriage-return frame), and the Hugging Face loading bars turned off where they would be frames."""

from __future__ import annotations

import sys

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


class PlainProgress(_std_tqdm):
    """tqdm as whole lines ``desc: n/total (pct), elapsed, rate | postfix`` for a log: at the start,
    at most every ``interval`` seconds, and at the end; never a carriage-return frame."""

    monitor_interval = 0  # no monitor thread: the loop writes every line

    def __init__(self, iterable=None, total=None, desc: str = "", initial: int = 0, file=None,
                 interval: float | None = None):
        self._last_n: int | None = None  # n at the last line written
        # leave=False: close() writes the last line (display below) and nothing after it
        super().__init__(iterable, total=total, desc=desc, initial=initial, file=sys.stderr if file is None else file,
                         mininterval=PLAIN_PROGRESS_INTERVAL_S if interval is None else interval, miniters=1,
                         leave=False)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)  # shown with the next line, not at once

    def display(self, msg=None, pos=None) -> bool:
        if self._last_n != self.n:
            self.fp.write(self.format_line() + "\n")
            self.fp.flush()
            self._last_n = self.n
        return False  # nothing on screen for close() to clear

    def format_line(self) -> str:
        elapsed, done = self.format_dict["elapsed"], self.n - self.initial
        head = (f"{self.desc}: " if self.desc else "") + (
            f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}")
        parts = [head, f"{self.format_interval(elapsed)} elapsed"]
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{rate:.2f} it/s" if rate >= 1 else f"{1 / rate:.2f} s/it")
        return ", ".join(parts) + (f" | {self.postfix}" if self.postfix else "")
