"""A run directory is never damaged: a new run refuses one that holds an earlier run (unless it
continues it with --resume or replaces it with run.overwrite=true), refuses one a live run holds
whatever it is told, and a run stopped by bad input before its first step leaves no directory
behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfkit.cli.demo import start_demo_dir
from rlhfkit.cli.main import main
from rlhfkit.config import Config, ConfigError
from rlhfkit.utils import LOCK_FILE, check_out_dir, lock_run_dir, release_run_dir, run_dir_holder


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def boom(prompts, completions, **columns):
    raise ValueError("reward broke")


def gated(prompts, completions, **columns):
    """A reward that holds its run at step 0 until the test opens the gate (``RLHFKIT_TEST_GATE``)."""
    gate = Path(os.environ["RLHFKIT_TEST_GATE"])
    (gate / "started").touch()
    deadline = time.monotonic() + 180
    while not (gate / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never opened the gate")
        time.sleep(0.05)
    return [0.0] * len(completions)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture
def grpo_args(tiny_models, tmp_path, no_plots):
    """A two-step GRPO run on the tiny models into tmp_path/run (one checkpoint after step 1)."""
    return ["grpo", f"model.name={tiny_models.policy}", f"run.out_dir={tmp_path / 'run'}", "run.progress=false",
            "reward.function=rlhfkit.tasks.doubling:exact_reward", "ppo.steps=2", "ppo.batch_size=8",
            "ppo.minibatch_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0", "ppo.stop_at=0",
            "run.checkpoint_every=1"]


def test_a_rerun_is_refused_in_one_line_and_every_file_stays_byte_identical(grpo_args, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(grpo_args) == 0
    before = snapshot(out)
    assert {"config.yaml", "metrics.jsonl", "samples.jsonl"} <= set(before)
    capsys.readouterr()
    # the same command, a changed config, and one whose reward fails at step 0 (which once cut
    # samples.jsonl and trajectories.jsonl to 0 bytes and added a TensorBoard file)
    for extra in ([], ["ppo.kl_coef=0.5"], ["reward.function=test_run_dir:boom"]):
        assert main([*grpo_args, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"rlhfkit grpo: error: run.out_dir {out} holds an earlier run (checkpoints/, "
                                 "config.yaml, metrics.jsonl ...)")
        assert "--resume" in err[0] and "run.overwrite=true" in err[0]
        assert snapshot(out) == before


def test_overwrite_replaces_the_earlier_run_and_keeps_other_files(grpo_args, tmp_path):
    out = tmp_path / "run"
    assert main(grpo_args) == 0
    (out / "notes.txt").write_text("mine")
    # the earlier run's TensorBoard file, marked (the new run's file may get the same name: the
    # name holds the time in whole seconds)
    (old_tb,) = (out / "tb").iterdir()
    with open(old_tb, "ab") as f:
        f.write(b"earlier run")
    assert main([*grpo_args, "ppo.steps=1", "run.checkpoint_every=0", "run.overwrite=true"]) == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # the new run's one step, not appended to the two earlier ones
    assert not (out / "checkpoints").exists()  # the earlier run's checkpoints went with it
    tb = list((out / "tb").iterdir())  # one TensorBoard file, the new run's
    assert len(tb) == 1 and b"earlier run" not in tb[0].read_bytes()
    assert "steps: 1\n" in (out / "config.yaml").read_text()
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_continues_the_run_the_refusal_protects(grpo_args, tmp_path):
    out = tmp_path / "run"
    assert main(grpo_args) == 0  # a checkpoint after step 0
    samples = (out / "samples.jsonl").read_bytes()
    assert main([*grpo_args, "--resume"]) == 0  # step 1 again, from the checkpoint
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # cut back to the checkpoint, not appended
    assert (out / "samples.jsonl").read_bytes() == samples
    with pytest.raises(ConfigError, match="not both"):
        check_out_dir(Config().replace(run={"out_dir": str(out), "resume": True, "overwrite": True}))


def test_a_live_run_keeps_its_directory_from_a_second_run(grpo_args, tmp_path, capsys):
    """A second process in a live run's directory is refused, whatever it is told: replacing it,
    continuing it, or a plain rerun (which, the live run having logged no step yet, would
    otherwise replace it without asking); the live run then finishes whole."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    args = [*grpo_args, "run.tensorboard=false"]
    env = {**os.environ, "RLHFKIT_TEST_GATE": str(gate),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    live = subprocess.Popen([sys.executable, "-m", "rlhfkit", *args, "reward.function=test_run_dir:gated"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(gate / "started", live)  # inside step 0's reward: the directory started, nothing logged
        before = snapshot(out)
        assert "config.yaml" in before and before["metrics.jsonl"] == b""
        for extra in (["run.overwrite=true"], ["--resume"], []):
            assert main([*args, *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1, err
            assert err[0].startswith(f"rlhfkit grpo: error: run.out_dir {out} is in use by a live run "
                                     f"(process {live.pid} on "), err[0]
            assert snapshot(out) == before
        (gate / "go").touch()
        _, stderr = live.communicate(timeout=300)
    finally:
        (gate / "go").touch()
        if live.poll() is None:
            live.kill()
    assert live.returncode == 0, stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert run_dir_holder(out) is None  # the lock went with the process
    assert main([*args, "--resume"]) == 0  # free again: continued (at its end, nothing left to run)


def test_the_lock_goes_with_a_killed_process_and_on_release(tmp_path):
    out = tmp_path / "run"
    code = ("import sys, time; from rlhfkit.utils import lock_run_dir; lock_run_dir(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert run_dir_holder(out).startswith(f"process {holder.pid} on ")
        with pytest.raises(ConfigError, match=f"in use by a live run \\(process {holder.pid} "):
            lock_run_dir(out)
        with pytest.raises(ConfigError, match="in use by a live run"):
            check_out_dir(Config().replace(run={"out_dir": str(out), "overwrite": True}))
    finally:
        holder.kill()
        holder.wait()
    assert run_dir_holder(out) is None  # killed without a word: the kernel dropped its lock
    lock_run_dir(out)
    lock_run_dir(out)  # again in the same process: nothing
    assert run_dir_holder(out) is None  # held here, not by another process
    other = subprocess.run([sys.executable, "-c", code.replace("time.sleep(600)", "pass"), str(out)],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and f"in use by a live run (process {os.getpid()} " in other.stderr
    release_run_dir(out)
    other = subprocess.run([sys.executable, "-c", code.replace("time.sleep(600)", "pass"), str(out)],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0 and other.stdout == "held\n", other.stderr


def test_bad_data_leaves_no_run_directory(tiny_models, tmp_path, capsys):
    out = tmp_path / "fresh"
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"question": "no prompt column"}\n')
    assert main(["grpo", f"model.name={tiny_models.policy}", f"run.out_dir={out}", f"data.path={bad}",
                 "reward.function=rlhfkit.tasks.doubling:exact_reward", "ppo.max_new_tokens=4"]) == 2
    assert "prompt" in capsys.readouterr().err
    assert not out.exists()


def test_a_run_that_stopped_before_its_first_step_is_replaced_without_asking(grpo_args, tmp_path, capsys):
    """Fix the reward function and run the same command again: the failed run left only its
    config and empty logs, nothing to lose."""
    out = tmp_path / "run"
    assert main([*grpo_args, "reward.function=test_run_dir:boom"]) == 2
    assert "reward broke" in capsys.readouterr().err
    assert (out / "config.yaml").exists() and (out / "metrics.jsonl").read_text() == ""
    assert main(grpo_args) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "test_run_dir:boom" not in (out / "config.yaml").read_text()
    assert len(list((out / "tb").iterdir())) == 1  # the failed run's TensorBoard file went with it


def test_files_that_are_not_a_run_do_not_count(grpo_args, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "prompts.jsonl").write_text("{}\n")
    assert main([*grpo_args, "ppo.steps=1"]) == 0
    assert (out / "prompts.jsonl").read_text() == "{}\n"


def test_the_demo_replaces_an_earlier_demo_but_not_another_run(tmp_path):
    demo = tmp_path / "demo"
    for stage in ("pretrain", "reward", "grpo"):
        (demo / stage).mkdir(parents=True)
        (demo / stage / "config.yaml").write_text("x")
    (demo / "metrics.jsonl").write_text("{}\n")
    (demo / "mine.txt").write_text("kept")
    start_demo_dir(Config().replace(run={"out_dir": str(demo)}))
    assert sorted(p.name for p in demo.iterdir()) == [LOCK_FILE, "mine.txt"]
    other = tmp_path / "ppo"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds an earlier run"):
        start_demo_dir(Config().replace(run={"out_dir": str(other)}))
    assert (other / "metrics.jsonl").exists()
    start_demo_dir(Config().replace(run={"out_dir": str(other), "overwrite": True}))
    assert not (other / "metrics.jsonl").exists()


@pytest.mark.slow
def test_the_demo_runs_twice_into_the_same_directory(tmp_path, capsys):
    """make demo twice: the second replaces the first (as make demo's users expect), whole."""
    out = tmp_path / "demo"
    argv = ["demo", f"run.out_dir={out}", "run.progress=false", "model.n_layer=1", "model.n_embd=16",
            "model.n_head=2", "pretrain.steps=3", "pretrain.batch_size=8", "reward.steps=2", "reward.batch_size=8",
            "reward.eval_pairs=16", "ppo.steps=1", "ppo.batch_size=8", "ppo.minibatch_size=8",
            "ppo.critic_warmup_steps=0", "eval.batch_size=512"]
    assert main(argv) == 0
    first = json.loads((out / "summary.json").read_text())
    (out / "notes.txt").write_text("mine")
    assert main([*argv, "pretrain.steps=4"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((out / "summary.json").read_text())["algos"]["ppo"]["steps"] == first["algos"]["ppo"]["steps"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # the second run's one PPO step, not two
    assert "steps: 4\n" in (out / "pretrain" / "config.yaml").read_text()  # the second run's stages
    assert (out / "notes.txt").read_text() == "mine"
