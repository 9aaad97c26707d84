"""Progress reports: a tqdm bar on a terminal, plain throttled lines (no carriage returns) in a log."""

from __future__ import annotations

import io

import pytest
import tqdm.std as tqdm_module
from tqdm.std import tqdm as std_tqdm

from rlhfkit.progress import PLAIN_PROGRESS_INTERVAL_S, PlainProgress, progress


class FakeClock:
    """A clock that stands still until the test moves it (``clock.t += seconds``)."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_interval_is_about_ten_seconds():
    assert PLAIN_PROGRESS_INTERVAL_S == pytest.approx(10.0)


def test_fast_loop_off_a_terminal_writes_a_few_plain_lines():
    out = io.StringIO()  # isatty() is False
    bar = progress(range(10_000), desc="ppo", total=10_000, file=out)
    assert isinstance(bar, PlainProgress)
    for i in bar:
        bar.set_postfix(score=f"{i / 10_000:.2f}", kl=0.0125)
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and "\x1b" not in text
    assert 2 <= len(lines) <= 3  # a fast loop: the start, perhaps one more, the end
    assert lines[0].startswith("ppo: 0/10000")
    assert lines[-1].startswith("ppo: 10000/10000 (100%)")
    assert "score=1.00" in lines[-1] and "kl=0.0125" in lines[-1]


def test_lines_are_throttled_to_the_interval(monkeypatch):
    # each step takes 1 s of (fake) time: one line per ~10 steps, not one per step
    clock = FakeClock()
    monkeypatch.setattr(tqdm_module, "time", clock)  # the clock a new bar reads
    out = io.StringIO()
    bar = progress(range(1000), desc="sft", total=1000, file=out)
    for _ in bar:
        clock.t += 1.0
        bar.set_postfix(loss=0.25)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    n = len(lines)
    expected = 1000 / PLAIN_PROGRESS_INTERVAL_S
    assert expected <= n <= expected + 2, n  # every 10th step, the start and perhaps the end
    assert all(line.startswith("sft: ") and "elapsed" in line for line in lines)
    assert all("loss=0.25" in line for line in lines[1:])
    assert "/s" in lines[-1] or "s/it" in lines[-1]  # a rate


def test_resumed_run_counts_from_initial_and_reports_the_end_when_the_loop_breaks(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tqdm_module, "time", clock)  # the clock a new bar reads
    out = io.StringIO()
    bar = progress(range(40, 100), desc="grpo", total=100, initial=40, file=out)
    for step in bar:
        clock.t += 0.01
        bar.set_postfix(score=0.5)
        if step == 59:  # stop_at_exact: the loop is left early
            break
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("grpo: 40/100 (40%)")
    # as tqdm: the step the loop left in is not counted (the count advances when the next step starts)
    assert lines[-1].startswith("grpo: 59/100 (59%)") and "score=0.5" in lines[-1]


def test_manual_updates_and_close():
    out = io.StringIO()
    with progress(total=5, desc="write", file=out) as bar:
        for _ in range(5):
            bar.update()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("write: 0/5 (0%)") and lines[-1].startswith("write: 5/5 (100%)")
    bar.close()  # idempotent
    assert len(out.getvalue().splitlines()) == 2


def test_default_stream_is_stderr(capsys):
    for _ in progress(range(3), desc="x", total=3):
        pass
    captured = capsys.readouterr()  # pytest's capture is not a terminal
    assert captured.out == "" and captured.err.splitlines()[-1].startswith("x: 3/3")


def test_on_a_terminal_it_is_a_tqdm_bar():
    out = TTY()
    bar = progress(range(3), desc="ppo", total=3, file=out)
    assert isinstance(bar, std_tqdm)
    for _ in bar:
        bar.set_postfix(score=1.0)
    assert "\r" in out.getvalue()  # tqdm's redrawn frames, as before


def test_disabled_writes_nothing():
    out = io.StringIO()
    bar = progress(range(3), total=3, desc="ppo", enabled=False, file=out)
    for _ in bar:
        bar.set_postfix(score=1.0)
    assert out.getvalue() == ""


def test_utils_does_not_re_export_progress_or_the_heap_helpers():
    import rlhfkit.utils as utils
    from rlhfkit.accel import heap

    assert progress.__module__ == "rlhfkit.progress" and heap.gradient_buffer.__module__ == "rlhfkit.accel.heap"
    for name in ("progress", "gradient_buffer", "release_free_memory", "tensors_off_heap"):
        assert not hasattr(utils, name), name
