"""Learning rates and logging: the RL commands' schedule (a warm-up, then constant, linear or
cosine) by hand and across a killed-and-resumed run; the logging interval (run.log_every); and
the rates a key left unset takes from what the model starts from (model.regime: a model rlhfkit
built from scratch, a pretrained checkpoint, a pretrained one through LoRA)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import ConfigError, dump_config, load_config
from rlhfkit.models.forward import SCRATCH_MARK
from rlhfkit.trainers.rl_setup import set_lr

# ppo.steps 10, warm-up 2: steps 0 and 1 at 1/2 and 2/2 of the peak, then each schedule over the
# 8 steps after the warm-up, f = (step - 2) / 8: linear 1 - f, cosine (1 + cos(pi f)) / 2
HAND = {
    "constant": {0: 0.5, 1: 1.0, 2: 1.0, 6: 1.0, 9: 1.0},
    "linear": {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.75, 6: 0.5, 9: 0.125},  # f = 2/8, 4/8, 7/8
    # f = 2/8: (1 + cos(pi/4)) / 2 = (1 + 0.70710678) / 2; f = 7/8: (1 + cos(7pi/8)) / 2 = (1 - 0.92387953) / 2
    "cosine": {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.8535533905932737, 6: 0.5, 9: 0.038060233744356624},
}


@pytest.mark.parametrize("warmup", ["ppo.warmup_steps=2", "ppo.warmup_ratio=0.15"])  # ceil(0.15 * 10) = 2
@pytest.mark.parametrize("schedule", list(HAND))
def test_rl_learning_rates_by_hand(schedule, warmup):
    pc = load_config(overrides=["ppo.steps=10", "ppo.lr=1e-3", "ppo.value_lr=1e-2", f"ppo.lr_schedule={schedule}",
                                warmup]).ppo
    actor, critic = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [actor]}, {"params": [critic]}])
    for step, share in HAND[schedule].items():
        assert set_lr(opt, pc, step) == pytest.approx(1e-3 * share, rel=1e-12), step
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * share, 1e-2 * share], rel=1e-12)


def test_schedule_and_sampling_keys_are_checked():
    for bad, key in [(["ppo.warmup_steps=2", "ppo.warmup_ratio=0.1"], "ppo.warmup_steps=2 and ppo.warmup_ratio"),
                     (["ppo.warmup_ratio=1.5"], "ppo.warmup_ratio"), (["ppo.lr_schedule=step"], "ppo.lr_schedule"),
                     (["ppo.min_p=1.5"], "ppo.min_p"), (["ppo.repetition_penalty=0"], "ppo.repetition_penalty"),
                     (["run.log_every=-1"], "run.log_every"), (["model.regime=finetuned"], "model.regime")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(overrides=bad)


def _grpo_args(models, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlhfkit", "grpo", f"model.name={models.policy}", f"run.out_dir={out}",
            "reward.function=rlhfkit.tasks.doubling:format_reward", "ppo.steps=6", "ppo.batch_size=8",
            "ppo.minibatch_size=4", "ppo.group_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0", "ppo.stop_at=0",
            "eval.batch_size=512", "eval.max_new_tokens=4", "run.checkpoint_every=2", "accel.threads=1",
            "run.progress=false", *extra]


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_continues_the_schedule_exactly(tiny_models, tmp_path):
    """Killed inside step 3 (after its rollout; the newest checkpoint is after 2 steps) and resumed,
    a cosine schedule with a warm-up logs the rates of an unbroken run, which are the hand-computed
    ones, and ends with the same weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    schedule = ("ppo.lr=1e-3", "ppo.lr_schedule=cosine", "ppo.warmup_steps=2")
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert subprocess.run(_grpo_args(tiny_models, whole, *schedule), env=env).returncode == 0
    args = _grpo_args(tiny_models, broken, *schedule)
    killed = subprocess.run(args, env={**env, "RLHFKIT_FAULT": "rollout@3"})
    assert killed.returncode == -signal.SIGKILL
    assert subprocess.run([*args, "--resume"], env=env).returncode == 0
    a, b = _rows(whole), _rows(broken)
    assert a == b and [r["step"] for r in b] == list(range(6))
    # warm-up 2 of 6 steps, then f = (step - 2) / 4: (1 + cos(pi f)) / 2 = 1, 0.85355, 0.5, 0.14645
    want = [0.5, 1.0, 1.0, 0.8535533905932737, 0.5, 0.14644660940672627]
    assert [r["policy/lr"] for r in b] == pytest.approx([1e-3 * s for s in want], rel=1e-9)
    wa, wb = (load_file(str(out / "policy" / "model.safetensors")) for out in (whole, broken))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------- run.log_every


def test_log_every_writes_every_nth_step_and_every_evaluation(tiny_config, tiny_models, tmp_path, no_plots):
    """run.log_every=3 over 7 steps evaluated every 2: rows after steps 0, 3 and 6 and after every
    evaluation (1, 3, 5, 6), each equal to the row an every-step run writes there; the
    evaluations and checkpoints are the every-step run's."""
    from rlhfkit.trainers.rl import train_rl

    def run(name: str, log_every: int) -> list[dict]:
        cfg = tiny_config(tmp_path / name, model={"name": tiny_models.policy},
                          reward={"function": "rlhfkit.tasks.doubling:format_reward"},
                          ppo={"algo": "grpo", "steps": 7, "eval_every": 2},
                          run={"out_dir": str(tmp_path / name), "progress": False, "checkpoint_every": 2,
                               "log_every": log_every})
        assert train_rl(cfg)["steps"] == 7  # the steps run, not the rows written
        return _rows(tmp_path / name)

    every, sparse = run("every", 0), run("sparse", 3)
    assert [r["step"] for r in every] == list(range(7))  # the RL commands' own interval: every step
    assert [r["step"] for r in sparse] == [0, 1, 3, 5, 6]
    assert sparse == [every[r["step"]] for r in sparse]
    assert [r["step"] for r in sparse if "eval/exact_acc" in r] == [1, 3, 5, 6]
    names = [sorted(p.name for p in (tmp_path / n / "checkpoints").iterdir()) for n in ("every", "sparse")]
    assert names[0] == names[1] == ["step-00000004", "step-00000006"]


def test_log_every_replaces_a_commands_own_interval(tiny_config, tiny_models, tmp_path):
    from rlhfkit.trainers.sft import train_sft

    def steps(name: str, **run) -> list[int]:
        train_sft(tiny_config(tmp_path / name, model={"name": tiny_models.policy}, sft={"steps": 12},
                              run={"out_dir": str(tmp_path / name), "progress": False, **run}))
        return [r["step"] for r in _rows(tmp_path / name)]

    assert steps("own") == [0, 10, 11]  # sft's own: every 10 steps and the last
    assert steps("every2", log_every=2) == [0, 2, 4, 6, 8, 10, 11]


# --------------------------------------------------------------------------- model.regime


@pytest.fixture(scope="module")
def checkpoint(tiny_models, tmp_path_factory) -> str:
    """The tiny policy as a checkpoint trained elsewhere: without the mark rlhfkit writes into the
    models it builds from scratch."""
    out = tmp_path_factory.mktemp("pretrained") / "policy"
    shutil.copytree(tiny_models.policy, out)
    config = json.loads((out / "config.json").read_text())
    del config[SCRATCH_MARK]
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _sft_lr(tiny_config, path: Path, policy: str, capsys, sft=None, model=None) -> tuple[float, str]:
    """SFT for one step (its lr at step 0: the peak over the warm-up, if any) and the line it printed."""
    from rlhfkit.trainers.sft import train_sft

    capsys.readouterr()
    train_sft(tiny_config(path, sft={"steps": 1, "warmup_steps": None, **(sft or {})},
                          model={"name": policy, **(model or {})}))
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("learning rates:")]
    assert len(printed) == 1
    return _rows(path)[0]["sft/lr"], printed[0]


def test_a_model_built_from_scratch_trains_at_the_toy_rates(tiny_config, tiny_models, tmp_path, capsys):
    assert json.loads(Path(tiny_models.policy, "config.json").read_text())[SCRATCH_MARK] is True
    lr, line = _sft_lr(tiny_config, tmp_path / "sft", tiny_models.policy, capsys)
    assert line == "learning rates: trained from scratch -> sft.lr 0.001, sft.warmup_steps 20"
    assert lr == pytest.approx(1e-3 / 20)  # step 0 of a 20-step warm-up


def test_a_pretrained_checkpoint_trains_at_fine_tuning_rates(tiny_config, checkpoint, tmp_path, capsys):
    lr, line = _sft_lr(tiny_config, tmp_path / "full", checkpoint, capsys)
    assert line == "learning rates: pretrained checkpoint -> sft.lr 2e-05, sft.warmup_steps 0"
    assert lr == pytest.approx(2e-5)  # no warm-up: the peak at step 0
    lr, line = _sft_lr(tiny_config, tmp_path / "lora", checkpoint, capsys, model={"lora_r": 4})
    assert line == "learning rates: pretrained checkpoint (LoRA) -> sft.lr 0.0002, sft.warmup_steps 0"
    lr, line = _sft_lr(tiny_config, tmp_path / "set", checkpoint, capsys, sft={"lr": 5e-4})
    assert line == "learning rates: pretrained checkpoint -> sft.lr 0.0005 (set), sft.warmup_steps 0"
    assert lr == pytest.approx(5e-4)
    lr, line = _sft_lr(tiny_config, tmp_path / "forced", checkpoint, capsys, model={"regime": "scratch"})
    assert line.startswith("learning rates: trained from scratch -> sft.lr 0.001") and lr == pytest.approx(5e-5)


def test_every_command_picks_its_rates_by_regime(tiny_config, checkpoint, tiny_models, tmp_path, capsys, no_plots):
    from rlhfkit.trainers.dpo import train_dpo
    from rlhfkit.trainers.reward import train_reward_model
    from rlhfkit.trainers.rl import train_rl

    def printed() -> str:
        return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("learning rates:"))

    capsys.readouterr()
    train_rl(tiny_config(tmp_path / "ppo", model={"name": checkpoint}, reward={"name": tiny_models.reward}))
    assert printed() == "learning rates: pretrained checkpoint -> ppo.lr 1e-06, ppo.value_lr 1e-05"
    assert _rows(tmp_path / "ppo")[0]["policy/lr"] == pytest.approx(1e-6)
    train_rl(tiny_config(tmp_path / "grpo", model={"name": checkpoint, "lora_r": 4}, ppo={"algo": "grpo"},
                         reward={"function": "rlhfkit.tasks.doubling:format_reward"}))
    assert printed() == "learning rates: pretrained checkpoint (LoRA) -> ppo.lr 0.0003"
    train_dpo(tiny_config(tmp_path / "dpo", model={"name": checkpoint}))
    assert printed() == "learning rates: pretrained checkpoint -> dpo.lr 1e-06"
    train_reward_model(tiny_config(tmp_path / "rm", model={"name": checkpoint}))
    assert printed() == "learning rates: pretrained checkpoint -> reward.lr 1e-05"
    train_reward_model(tiny_config(tmp_path / "rm_scratch", reward={"init_from": "scratch"}))
    assert printed() == "learning rates: trained from scratch -> reward.lr 0.001"


def test_pretraining_marks_its_model_and_unset_rates_stay_unset_in_the_config(tiny_config, tmp_path):
    from rlhfkit.trainers.pretrain import pretrain

    pretrain(tiny_config(tmp_path / "pre"))
    assert json.loads((tmp_path / "pre" / "policy" / "config.json").read_text())[SCRATCH_MARK] is True
    cfg = load_config(overrides=["dpo.lr=5e-6"]).replace(model={"lora_r": 8})  # a LoRA toggle keeps a set rate
    assert (cfg.sft.lr, cfg.sft.warmup_steps, cfg.ppo.lr, cfg.ppo.value_lr, cfg.reward.lr, cfg.dpo.lr) == \
        (None, None, None, None, None, 5e-6)
    assert "  lr: null" in dump_config(cfg) and "  lr: 5.0e-06" in dump_config(cfg)
