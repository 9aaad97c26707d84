"""The test tiers as a machine without the optional dependencies meets them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_the_long_tier_skips_with_a_reason_without_deepspeed(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs", "-m",
                           "long", str(ROOT / "tests" / "test_distributed.py"), f"--basetemp={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTEST_XDIST_WORKER_COUNT": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]  # once: errors (ModuleNotFoundError: No module named 'deepspeed')
    assert out.split()[0] == "ssss", out[-3000:]  # the 4 long tests, each skipped
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all(line.endswith("deepspeed is not installed: `make test-long` installs it "
                                         "(pip install -e '.[deepspeed]')") for line in reasons), out[-3000:]
