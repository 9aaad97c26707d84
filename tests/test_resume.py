"""Checkpoints and exact resume: a run killed with SIGKILL and resumed ends as an unbroken one.

Each RL run here is the command a user types (``python -m rlhfkit ppo ...``) in its own
process, killed at several points: inside a step (after the rollout), in the middle of writing
a checkpoint (files written, directory not yet renamed), and from outside at a random moment.
After every kill ``--resume`` continues it. The metrics (all but wall-clock times), samples,
trajectories and final weights must equal those of a run that was never interrupted. A GRPO
run sharded by FSDP over two processes, whose checkpoints every process writes its shards of,
is killed while writing one and resumed the same way.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ports import launch_port
from rlhfkit.config import PPOConfig
from rlhfkit.rollout.experience import RLState
from rlhfkit.run.checkpoint import Checkpointer, latest_checkpoint

STEPS = 12


def _prompt_file(path: Path) -> Path:
    """Five doubling prompts with the columns the verifier reads: 12 steps of 2 prompts make ~5 passes."""
    from rlhfkit.tasks import doubling

    prompts = [doubling.Prompt(1000 + 7 * i, doubling.SET_NAMES[i % 3]) for i in range(5)]
    path.write_text("".join(json.dumps({"prompt": p.text, **doubling.columns(p)}, ensure_ascii=False) + "\n"
                            for p in prompts), encoding="utf-8")
    return path


def _args(algo: str, models, out: Path) -> list[str]:
    if algo == "grpo-file":  # the user's prompt file: its position (pass, order) must come back too
        prompts = _prompt_file(out.parent / "prompts.jsonl")
        return [*_args("grpo", models, out), f"data.path={prompts}", "data.eval_fraction=0.2",
                "reward.function=rlhfkit.tasks.doubling:exact_reward", "ppo.stop_metric=eval/accuracy"]
    if algo == "grpo-master":  # float32 weights run as bfloat16 copies: only the float32 ones are state
        return [*_args("grpo", models, out), "model.dtype=bfloat16", "model.master_weights=true"]
    args = [sys.executable, "-m", "rlhfkit", algo, f"model.name={models.policy}", f"run.out_dir={out}",
            f"ppo.steps={STEPS}", "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4",
            "ppo.eval_every=4", "ppo.stop_at=0", "ppo.trajectories_every=3", "eval.batch_size=512",
            "eval.max_new_tokens=4", "run.checkpoint_every=2", "accel.threads=1", "run.progress=false"]
    if algo == "ppo":  # critic warm-up, adaptive KL, reward normalisation and the lr carry across steps
        args += [f"reward.name={models.reward}", "ppo.critic_warmup_steps=3", "ppo.adaptive_kl=true",
                 "ppo.normalize_reward=true", "ppo.lr_schedule=linear"]
    else:
        args += ["reward.function=rlhfkit.tasks.doubling:format_reward", "ppo.group_size=4"]
    return args


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(args: list[str], fault: str | None = None) -> int:
    env = {**ENV, **({"RLHFKIT_FAULT": fault} if fault else {})}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:  # pytest shows what a test printed when it fails: the run's own error
        print(f"exit {done.returncode}: {' '.join(args[-6:])}\n{done.stderr[-6000:]}")
    return done.returncode


def _rows(out: Path) -> list[dict]:
    with open(out / "metrics.jsonl", encoding="utf-8") as fh:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))}
                for line in fh]


def _kill_from_outside(args: list[str], out: Path, rows: int) -> int:
    """Start the run and SIGKILL it once metrics.jsonl holds ``rows`` rows (wherever it is then)."""
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text(encoding="utf-8").count("\n") >= rows:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    return proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [pytest.param("ppo", marks=pytest.mark.accel_twice),
                                  pytest.param("grpo", marks=pytest.mark.accel_twice), "grpo-file", "grpo-master"])
def test_killed_and_resumed_run_ends_as_an_unbroken_one(algo, tiny_models, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert _run(_args(algo, tiny_models, whole)) == 0
    args = _args(algo, tiny_models, broken)

    # 1. inside step 5 (0-based), after its rollout: the checkpoint after 4 steps is the newest
    assert _run(args, fault="rollout@5") == -signal.SIGKILL
    assert latest_checkpoint(broken).name == "step-00000004"
    # 2. resumed, then killed while writing the checkpoint after 8 steps: a temporary directory
    #    holds the files, no step-00000008 exists, so the next resume starts at 6
    assert _run([*args, "--resume"], fault="checkpoint_write@8") == -signal.SIGKILL
    assert latest_checkpoint(broken).name == "step-00000006"
    assert list((broken / "checkpoints").glob(".tmp-step-00000008-*"))
    # 3. resumed, then killed from outside at a random moment after a random number of steps
    rows = random.Random(os.getpid()).randint(8, STEPS - 1)
    assert _kill_from_outside([*args, "--resume"], broken, rows) == -signal.SIGKILL
    # 4. resumed to the end
    assert _run([*args, "--resume"]) == 0
    assert not list((broken / "checkpoints").glob(".tmp-*"))  # the half-written one was cleared

    a, b = _rows(whole), _rows(broken)
    assert [r["step"] for r in b] == list(range(STEPS))  # no step missing or logged twice
    assert a == b  # every loss, KL, score, advantage statistic, grad norm and eval accuracy
    if algo == "grpo-file":
        assert a[-1]["data/epoch"] >= 3 and "eval/accuracy" in a[-1]  # several passes, held-out scored
    for name in ("samples.jsonl", "trajectories.jsonl"):
        assert (whole / name).read_bytes() == (broken / name).read_bytes(), name
    wa, wb = load_file(str(whole / "policy" / "model.safetensors")), load_file(str(broken / "policy" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoints_are_pruned_and_a_mismatched_resume_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = Checkpointer(tmp_path, every=1, keep=2)
    for step in range(1, 5):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        ck.save(step, {"m": model}, {"opt": opt}, {"note": step})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = Checkpointer(tmp_path, resume=True).restore({"m": fresh}, {"opt": fresh_opt})
    assert state["step"] == 4 and state["note"] == 4
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="does not fit the model"):
        Checkpointer(tmp_path, resume=True).restore({"m": torch.nn.Linear(3, 3)}, {})
    with pytest.raises(ValueError, match="holds modules"):
        Checkpointer(tmp_path, resume=True).restore({"other": fresh}, {})
    assert Checkpointer(tmp_path / "elsewhere", resume=True).restore({"m": fresh}, {}) is None  # nothing to resume
    # a PPO run resumed with the other kind of critic: the message names the key that chooses it
    ppo = {kind: torch.nn.ModuleDict({"policy": torch.nn.Linear(3, 2), kind: torch.nn.Linear(3, 1)})
           for kind in ("critic", "value_head")}
    Checkpointer(tmp_path / "ppo", every=1).save(1, {"actor_critic": ppo["critic"]}, {}, {})
    with pytest.raises(ValueError, match=r"unexpected \['critic.bias'.*set ppo.value_model as the run had it"):
        Checkpointer(tmp_path / "ppo", resume=True).restore({"actor_critic": ppo["value_head"]}, {})
    with pytest.raises(ValueError, match="only 4 steps"):  # a budget that ends at or before the checkpoint
        Checkpointer(tmp_path, resume=True).restore({"m": fresh}, {"opt": fresh_opt}, steps=4)


def test_switching_normalize_reward_on_at_resume_starts_the_statistics_fresh():
    """A checkpoint written with ppo.normalize_reward off holds no reward statistics: resuming with
    it on warns once and starts them at zero (it raised a TypeError on unpacking None)."""
    old = RLState(PPOConfig(normalize_reward=False))
    old.kl_coef = 0.07
    resumed = RLState(PPOConfig(normalize_reward=True))
    with pytest.warns(RuntimeWarning, match="ppo.normalize_reward=false"):
        resumed.load_state_dict(json.loads(json.dumps(old.state_dict())))
    assert resumed.kl_coef == 0.07  # the rest of the state still comes back
    m = resumed.reward_stats
    assert (m.count, m.mean, m.m2) == (0, 0.0, 0.0)
    m.update(torch.tensor([1.0, 3.0]))
    assert (m.count, m.mean, m.std) == (2, 2.0, pytest.approx(2**0.5))
    # the other way round the statistics are simply not used
    back = RLState(PPOConfig(normalize_reward=False))
    back.load_state_dict(resumed.state_dict())
    assert back.reward_stats is None


def _kill_after_checkpoint(args: list[str], out: Path, steps_done: int) -> int:
    """Start the run and SIGKILL it as soon as the checkpoint after ``steps_done`` steps exists."""
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = out / "checkpoints" / f"step-{steps_done:08d}"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if target.exists():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    return proc.wait(timeout=60)


SUPERVISED = {  # command, its step budget, where it saves the trained weights
    "pretrain": (["pretrain", "pretrain.steps=12", "pretrain.batch_size=8", "pretrain.warmup_steps=2",
                  "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "eval.max_new_tokens=4"], "policy"),
    "rm": (["rm", "reward.steps=12", "reward.batch_size=8", "reward.eval_pairs=16"], "reward_model"),
    "sft": (["sft", "sft.steps=12", "sft.batch_size=4", "sft.warmup_steps=2"], "policy"),
    "dpo": (["dpo", "dpo.steps=12", "dpo.batch_size=4", "dpo.num_pairs=16", "dpo.eval_every=0",
             "eval.max_new_tokens=4"], "policy"),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(SUPERVISED))
def test_supervised_loops_resume_exactly(command, tiny_models, tmp_path):
    argv, saved = SUPERVISED[command]
    base = [sys.executable, "-m", "rlhfkit", *argv, "run.checkpoint_every=2", "accel.threads=1", "run.progress=false",
            "run.tensorboard=false", *([] if command == "pretrain" else [f"model.name={tiny_models.policy}"])]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert _run([*base, f"run.out_dir={whole}"]) == 0
    args = [*base, f"run.out_dir={broken}"]
    assert _run(args, fault="checkpoint_write@4") == -signal.SIGKILL  # mid-write: resumes from 2
    assert latest_checkpoint(broken).name == "step-00000002"
    assert _kill_after_checkpoint([*args, "--resume"], broken, 8) == -signal.SIGKILL  # just after a checkpoint
    assert _run([*args, "--resume"]) == 0
    assert _rows(whole) == _rows(broken)
    wa = load_file(str(whole / saved / "model.safetensors"))
    wb = load_file(str(broken / saved / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


FSDP_STEPS = 4


def _fsdp_args(models, out: Path) -> list[str]:
    """A grpo run under examples/accelerate/fsdp.yaml on two CPU processes (gloo), the policy
    sharded per GPT2Block, a checkpoint after every step."""
    port = launch_port()
    config = Path(__file__).parents[1] / "examples" / "accelerate" / "fsdp.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
              "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block", "--main_process_port", str(port), "-m", "rlhfkit"]
    args = _args("grpo", models, out)[3:]  # the command and overrides, without `python -m rlhfkit`
    return [*launch, *args, "run.device=cpu", f"ppo.steps={FSDP_STEPS}", "run.checkpoint_every=1"]


@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_from_its_shards_as_an_unbroken_one(tiny_models, tmp_path):
    """Two FSDP processes, killed while writing the checkpoint after 3 steps (that of step 2
    complete): the shards every process wrote come back, and the resumed run ends with the
    metrics and final policy of an unbroken one, a plain directory transformers loads."""
    from transformers import AutoModelForCausalLM

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert _run(_fsdp_args(tiny_models, whole)) == 0
    assert _run(_fsdp_args(tiny_models, broken), fault="checkpoint_write@3") != 0
    ckpt = latest_checkpoint(broken)
    assert ckpt.name == "step-00000002" and list((broken / "checkpoints").glob(".tmp-step-00000003-*"))
    assert {p.name for p in ckpt.glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"} and (ckpt / "sharded").is_dir()
    assert not list(ckpt.glob("*.safetensors"))  # nothing gathered on one process
    assert _run([*_fsdp_args(tiny_models, broken), "--resume"]) == 0
    assert not list((broken / "checkpoints").glob(".tmp-*"))

    a, b = _rows(whole), _rows(broken)
    assert [r["step"] for r in b] == list(range(FSDP_STEPS)) and a == b
    assert (whole / "samples.jsonl").read_bytes() == (broken / "samples.jsonl").read_bytes()
    wa, wb = load_file(str(whole / "policy" / "model.safetensors")), load_file(str(broken / "policy" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    loaded = AutoModelForCausalLM.from_pretrained(broken / "policy")
    assert all(torch.equal(p, wb[n]) for n, p in loaded.named_parameters() if n in wb)
