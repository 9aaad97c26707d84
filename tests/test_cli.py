"""The command line as a newcomer meets it: errors answered at once and in one line (the
traceback on request), help that lists every key, the resolved config printed."""

from __future__ import annotations

import subprocess
import sys
import time


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfkit", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_a_mistyped_key_is_answered_before_torch_is_imported():
    run_cli("ppo", "ppo.kl_cof=1")  # warm the file cache: the timing below is the command's own
    t0 = time.perf_counter()
    done = run_cli("ppo", "ppo.kl_cof=1")
    seconds = time.perf_counter() - t0
    assert done.returncode == 2 and "ppo.kl_cof" in done.stderr
    assert seconds < 2.0, f"a config error took {seconds:.2f} s"  # ~0.2 s; importing torch alone takes seconds
    code = ("import sys\nfrom rlhfkit.cli import main\n"
            "assert main(['ppo', 'ppo.kl_cof=1']) == 2\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules)\n"
            "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout
