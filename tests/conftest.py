"""Shared fixtures: tiny random-init models saved the way a user's checkpoints are, and a
config factory sized so that every trainer runs end to end in a second or two."""

from __future__ import annotations

import os

# Triton (a dev dependency on Linux) decides at import whether its kernels run under the
# interpreter, and transformers imports it: on a CPU the Triton decode attention
# (rlhfkit.triton_decode) can be tested only if the interpreter is on before any import.
if os.environ.get("RLHFKIT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every test, and every command a test starts (a subprocess inherits the variable), runs the
# plain PyTorch reference of each operation: accel.enabled defaults to $RLHFKIT_ACCEL. Run the
# suite with `--accel on` (or `auto`) to run it with the accelerated operations instead;
# tests/test_accel.py checks each of them against its reference whatever this says.
os.environ.setdefault("RLHFKIT_ACCEL", "off")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch

from rlhfkit import ops
from rlhfkit.config import Config
from rlhfkit.models.forward import build_tiny_policy, build_tiny_scalar_model
from rlhfkit.tasks import doubling

TINY_ARCH = {"n_layer": 1, "n_head": 2, "n_embd": 16}


def _share_cores_among_xdist_workers() -> None:
    """Under pytest-xdist (``make test``: ``-n 2``) each worker gets its share of the cores. By
    default torch starts a thread per core in every worker; N workers then run N times as many
    threads as cores, which (OpenMP threads waiting on each other) made the end-to-end tests
    many times slower, not merely twice. ``OMP_NUM_THREADS`` passes the share on to the commands
    tests start in subprocesses (those that pin their own thread count keep it)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_cores_among_xdist_workers()

# make test hands whole files to its two workers in collection order (--dist loadfile
# --no-loadscope-reorder), each worker taking the next file when it runs low. Three files hold
# two thirds of the suite's test time (at commit e574628 on the 2-core CPU: kill-and-resume 269 s,
# the end-to-end demo run 241 s, the DDP/FSDP launches 147 s, of 860 s); in name order the
# resume file started last and ran alone at the end (570 s of wall time for 860 s of tests).
# Collected first, the two largest start at once, one per worker, and the rest fills in behind.
LONGEST_FIRST = ("test_resume.py", "test_e2e.py", "test_distributed.py")


def pytest_addoption(parser):
    parser.addoption("--accel", choices=ops.MODES, default=None,
                     help="accel.enabled for every test and command the tests run (default: $RLHFKIT_ACCEL, "
                          "which conftest.py sets to off)")


def pytest_configure(config):
    """The suite's accel.enabled, chosen once at the start (ops.configure: the public call a run makes)."""
    if config.getoption("accel"):
        os.environ["RLHFKIT_ACCEL"] = config.getoption("accel")
    ops.configure(os.environ["RLHFKIT_ACCEL"])


@pytest.fixture
def accel_on():
    """The accelerated operations that run on this machine registered for one test (``accel.enabled=on``),
    and the suite's choice back afterwards."""
    ops.configure("on")
    yield ops.chosen()
    ops.configure(os.environ["RLHFKIT_ACCEL"])


@pytest.fixture
def accel_off():
    """Every operation on its reference for one test, whatever ``--accel`` chose for the suite."""
    ops.configure("off")
    yield
    ops.configure(os.environ["RLHFKIT_ACCEL"])


def pytest_collection_modifyitems(config, items):
    """Move the longest files to the front (stable: every other file, and every test within a
    file, keeps its order); every worker collects the same order, as xdist requires."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """``.policy`` and ``.reward``: directories with a random-init tiny GPT-2 (causal LM / scalar
    head) and the doubling tokenizer, written by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("tiny_models")
    tok = doubling.make_tokenizer()
    for name, model in (("policy", build_tiny_policy(tok, 0, **TINY_ARCH)),
                        ("reward", build_tiny_scalar_model(tok, 1, **TINY_ARCH))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return SimpleNamespace(root=root, policy=str(root / "policy"), reward=str(root / "reward"))


@pytest.fixture
def no_plots(monkeypatch):
    """Skip the RL run's PNG plots (matplotlib is most of a tiny run's time; they are tested in e2e)."""
    import rlhfkit.run.plots

    monkeypatch.setattr(rlhfkit.run.plots, "plot_ppo", lambda history, out_dir: [])


@pytest.fixture
def tiny_config():
    """``tiny_config(out_dir, **sections)``: a validated Config with few, small steps everywhere."""

    def make(out_dir, **sections) -> Config:
        small = {
            "run": {"out_dir": str(out_dir), "progress": False},
            "model": dict(TINY_ARCH),
            "pretrain": {"steps": 3, "batch_size": 8, "warmup_steps": 1},
            "reward": {"steps": 3, "batch_size": 8, "eval_pairs": 16},
            "ppo": {"steps": 2, "batch_size": 8, "minibatch_size": 4, "max_new_tokens": 4, "eval_every": 0,
                    "critic_warmup_steps": 0, "stop_at": 0.0, "group_size": 4},
            "sft": {"steps": 3, "batch_size": 4, "warmup_steps": 1},
            "dpo": {"steps": 3, "batch_size": 4, "num_pairs": 16, "eval_every": 0},
            "eval": {"batch_size": 512, "max_new_tokens": 4},
        }
        for sec, values in sections.items():
            small.setdefault(sec, {}).update(values)
        return Config().replace(**small)

    return make


def pytest_terminal_summary(terminalreporter):
    """Print the bad-input suite's count: cases tried, cases handled (passed)."""
    tried, handled = set(), set()
    for kind in ("passed", "failed", "error"):
        for rep in terminalreporter.stats.get(kind, []):
            if "test_bad_inputs.py::test_bad_input[" in getattr(rep, "nodeid", ""):
                tried.add(rep.nodeid)
                if kind == "passed" and rep.when == "call":
                    handled.add(rep.nodeid)
    if tried:
        terminalreporter.write_line(
            f"bad-input suite: {len(tried)} bad inputs tried, {len(handled)} handled with a clear error or a "
            "documented policy"
        )
