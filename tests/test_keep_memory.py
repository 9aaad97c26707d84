"""``run.keep_freed_memory``: on glibc, a tensor freed and allocated again reuses the process's
pages instead of faulting fresh zeroed ones in, and runs on a CPU apply it unless told not to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhfkit import utils
from rlhfkit.config import Config

# a process that allocates, writes and frees a 64 MiB tensor ten times and prints the minor page
# faults of the last five (the first ones fault their pages in whatever the setting; a small
# allocation left in the freed block can make the next tensor grow the heap once or twice more)
CYCLES = """
import resource, sys, torch
from rlhfkit.utils import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("unavailable"); raise SystemExit
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 << 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[5:]))
"""


def faults(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True).stdout.strip()


def test_a_freed_tensor_comes_back_without_page_faults():
    kept = faults("keep")
    if kept == "unavailable":
        pytest.skip("not glibc's malloc: keep_freed_memory() changes nothing here")
    default = int(faults("default"))
    pages = (64 << 20) // 4096  # one tensor's worth of 4 KiB pages
    assert default > 4 * pages  # by default each 64 MiB tensor is mmapped, returned, faulted in again
    assert int(kept) < pages // 10


@pytest.mark.parametrize("setting, device, applied", [
    (True, "cpu", True), (False, "cpu", False), (True, "cuda", False)])
def test_setup_run_applies_it_on_a_cpu_unless_turned_off(setting, device, applied, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(utils, "keep_freed_memory", lambda: calls.append(1))
    cfg = Config().replace(run={"out_dir": str(tmp_path / "run"), "keep_freed_memory": setting, "device": device})
    utils.setup_run(cfg, write=False)
    assert bool(calls) == applied
