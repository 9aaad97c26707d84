"""Command line: ``rlhfkit COMMAND [--config FILE] [section.key=value ...]`` (``rlhfkit -h`` lists them).

Each command is a thin wrapper over a Python function that a notebook can call the same
way (``rlhfkit.demo.run_demo(cfg)``, ``rlhfkit.trainers.rl.train_rl(cfg)`` ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import ALGO_DEFAULTS, Config, ConfigError, load_config

COMMANDS = {
    "demo": "pretrain -> reward model -> PPO -> evaluation on the doubling task (runs/demo)",
    "pretrain": "pretrain a tiny GPT-2 on unprefixed doubling text",
    "rm": "train a reward model on preference pairs (model.name = policy to start from)",
    "ppo": "PPO with a critic: model.name = policy, reward.name = reward model (or reward.function)",
    "grpo": "GRPO: group-relative advantages, KL as a k3 loss term, no critic",
    "rloo": "RLOO: leave-one-out baseline over group_size samples per prompt, no critic",
    "reinforce": "REINFORCE with a batch-mean baseline, no critic",
    "dpo": "DPO on preference pairs: no reward model, no sampling (model.name = policy)",
    "sft": "supervised fine-tuning: model.name = policy, data.path = JSONL of demonstrations",
    "eval": "greedy held-out evaluation of a policy (a run directory, an HF model directory or hub id)",
    "chat": "talk to a policy (run directory or HF model directory); /quit or Ctrl-D leaves",
    "report": "write RUN_DIR/report.html: curves, samples and the per-token trajectory view (no network)",
    "gridworld": "grid-world cat: REINFORCE or PPO (gridworld.algo) through the same core losses",
}

# the training loops that write checkpoints (run.checkpoint_every) and can continue from them
RESUMABLE = ("pretrain", "rm", "ppo", "grpo", "rloo", "reinforce", "dpo", "sft")

DEFAULT_OUT = {"demo": "runs/demo", "pretrain": "runs/pretrain", "rm": "runs/rm", "ppo": "runs/ppo",
               "grpo": "runs/grpo", "rloo": "runs/rloo", "reinforce": "runs/reinforce", "dpo": "runs/dpo",
               "sft": "runs/sft", "eval": "runs/eval", "gridworld": "runs/gridworld", "chat": "runs/chat"}
DEBUG_HELP = "show the full traceback of an error instead of one line (also: RLHFKIT_DEBUG=1)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhfkit", description="RLHF for language models: reward models and PPO.",
                                epilog="Errors in the input are one line and exit code 2; --debug (or "
                                       "RLHFKIT_DEBUG=1) shows the full traceback instead.")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        # after the command too; SUPPRESS: absent here, it leaves the global flag's value alone
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        if name in ("eval", "chat"):
            sp.add_argument("path", help="policy directory (HF format, or a LoRA adapter directory), a hub id, "
                                         "or a run directory containing policy/")
        if name == "report":
            sp.add_argument("path", help="run directory (holding metrics.jsonl, config.yaml ...)")
            sp.add_argument("--screenshot", action="store_true",
                            help="also save report.png beside it with headless Chromium (must be installed)")
            continue
        sp.add_argument("--config", help="YAML config file (sections: run, model, pretrain, reward, ppo, eval)")
        if name in RESUMABLE:
            sp.add_argument("--resume", action="store_true",
                            help="continue from the newest checkpoint in run.out_dir (same as run.resume=true)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl_coef=0.1 run.seed=3")
    return p


def _config(args) -> Config:
    """Defaults <- the task's defaults <- the command's algorithm defaults <- file <- overrides."""
    from .tasks import get_task

    def build(task_defaults: dict) -> Config:
        base = Config().replace(**task_defaults).replace(run={"out_dir": DEFAULT_OUT[args.command]},
                                                          ppo=ALGO_DEFAULTS.get(args.command, {}))
        overrides = [*args.overrides, *(["run.resume=true"] if getattr(args, "resume", False) else [])]
        return load_config(args.config, overrides, base=base)

    cfg = build({})
    task_defaults = getattr(get_task(cfg.run.task), "CONFIG_DEFAULTS", {})
    return build(task_defaults) if task_defaults else cfg


def _policy_dir(path: str) -> str:
    """A model directory (``config.json``, or a LoRA ``adapter_config.json``), the ``policy/`` of a
    run directory, or, when no such directory exists, the string itself as a hub id."""
    p = Path(path)
    for cand in (p, p / "policy", p / "ppo" / "policy"):
        if (cand / "config.json").exists() or (cand / "adapter_config.json").exists():
            return str(cand)
    if not p.exists() and path.count("/") == 1 and not path.startswith((".", "/")):
        return path  # "org/name": a hub id, resolved by from_pretrained
    raise FileNotFoundError(f"no model found at {path}: expected a directory with config.json (or policy/config.json)")


def _emit(result) -> None:
    """Print a command's summary once: from the main process of a distributed launch."""
    from .utils import is_main_process

    if is_main_process():
        print(json.dumps(result, indent=2))


def debug_requested(args) -> bool:
    """``--debug`` or ``RLHFKIT_DEBUG`` set to anything but empty/0: errors keep their traceback."""
    return bool(getattr(args, "debug", False)) or os.environ.get("RLHFKIT_DEBUG", "").strip() not in ("", "0")


def _error(command: str, e: BaseException) -> None:
    message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
    print(f"rlhfkit {command}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    debug = debug_requested(args)
    if args.command == "report":
        return _report(args, debug)
    try:
        # the command line and the config are checked before torch and transformers are imported
        # (seconds): a mistyped key is answered at once
        cfg = _config(args)
        _run(args, cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # bad input: config, data, paths, models, rewards
        if debug:
            raise
        _error(args.command, e)
        return 2
    except RuntimeError as e:
        from .utils import TrainingError

        if debug or not isinstance(e, TrainingError):
            raise
        _error(args.command, e)  # the inputs were fine but the run diverged
        return 1
    return 0


def _run(args, cfg: Config) -> None:
    """Run the command on the resolved config (the heavy imports happen here)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file load/save bars would drown our own
    if args.command == "demo":
        from .demo import run_demo

        run_demo(cfg)
    elif args.command == "pretrain":
        from .trainers.pretrain import pretrain

        _emit(pretrain(cfg))
    elif args.command == "rm":
        from .trainers.reward import train_reward_model

        _emit(train_reward_model(cfg))
    elif args.command in ALGO_DEFAULTS:
        from .trainers.rl import train_rl

        _emit(train_rl(cfg))
    elif args.command == "sft":
        from .trainers.sft import train_sft

        _emit(train_sft(cfg))
    elif args.command == "dpo":
        from .trainers.dpo import train_dpo

        _emit(train_dpo(cfg))
    elif args.command == "eval":
        from .evaluate import evaluate_path

        _emit(evaluate_path(_policy_dir(args.path), cfg))
    elif args.command == "chat":
        from .chat import run_chat

        run_chat(_policy_dir(args.path), cfg)
    elif args.command == "gridworld":
        _gridworld(cfg)


def _gridworld(cfg: Config) -> None:
    from .tasks.gridworld import train_gridworld

    res = train_gridworld(cfg)
    every = max(1, len(res["returns"]) // 10)
    curve = "  ".join(f"{i}:{r:.1f}" for i, r in enumerate(res["returns"]) if i % every == 0)
    print(f"{res['algo']}, seed {res['seed']}, {res['seconds']:.1f}s -> {res['out_dir']}")
    print(res["policy"])
    print(f"mean return by iteration: {curve}  last:{res['returns'][-1]:.1f}")
    verdict = "optimal" if res["optimal"] else "NOT optimal"
    print(f"greedy return {res['greedy_return']:g}, optimum {res['optimal_return']:g}: {verdict}")


def _report(args, debug: bool = False) -> int:
    import subprocess

    from .report import screenshot, write_report

    try:
        path = write_report(args.path)
        print(f"report: {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if args.screenshot:
            print(f"screenshot: {screenshot(path, path.with_suffix('.png'))}")
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        if debug:
            raise
        _error("report", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
