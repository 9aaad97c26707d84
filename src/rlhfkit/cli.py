"""Command line: ``rlhfkit COMMAND [--config FILE] [section.key=value ...]`` (``rlhfkit -h`` lists them).

Each command is a thin wrapper over a Python function that a notebook can call the same
way (``rlhfkit.demo.run_demo(cfg)``, ``rlhfkit.trainers.rl.train_rl(cfg)`` ...).
"""

from __future__ import annotations

import argparse
import json
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
    "eval": "greedy held-out evaluation of a policy (a path, or a run directory)",
    "report": "write RUN_DIR/report.html: curves, samples and the per-token trajectory view (no network)",
    "gridworld": "grid-world cat: REINFORCE or PPO (gridworld.algo) through the same core losses",
}

DEFAULT_OUT = {"demo": "runs/demo", "pretrain": "runs/pretrain", "rm": "runs/rm", "ppo": "runs/ppo",
               "grpo": "runs/grpo", "rloo": "runs/rloo", "reinforce": "runs/reinforce", "dpo": "runs/dpo",
               "sft": "runs/sft", "eval": "runs/eval", "gridworld": "runs/gridworld"}
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhfkit", description="RLHF for language models: reward models and PPO.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == "eval":
            sp.add_argument("path", help="policy directory (HF format) or a run directory containing policy/")
        if name == "report":
            sp.add_argument("path", help="run directory (holding metrics.jsonl, config.yaml ...)")
            sp.add_argument("--screenshot", action="store_true",
                            help="also save report.png beside it with headless Chromium (must be installed)")
            continue
        sp.add_argument("--config", help="YAML config file (sections: run, model, pretrain, reward, ppo, eval)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl_coef=0.1 run.seed=3")
    return p


def _config(args) -> Config:
    """Defaults <- the task's defaults <- the command's algorithm defaults <- file <- overrides."""
    from .tasks import get_task

    def build(task_defaults: dict) -> Config:
        base = Config().replace(**task_defaults).replace(run={"out_dir": DEFAULT_OUT[args.command]},
                                                          ppo=ALGO_DEFAULTS.get(args.command, {}))
        return load_config(args.config, args.overrides, base=base)

    cfg = build({})
    task_defaults = getattr(get_task(cfg.run.task), "CONFIG_DEFAULTS", {})
    return build(task_defaults) if task_defaults else cfg


def _policy_dir(path: str) -> str:
    p = Path(path)
    for cand in (p, p / "policy", p / "ppo" / "policy"):
        if (cand / "config.json").exists():
            return str(cand)
    raise FileNotFoundError(f"no model found at {path}: expected a directory with config.json (or policy/config.json)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from .utils import TrainingError  # torch comes with it: not before `rlhfkit -h` is answered

    hf_logging.disable_progress_bar()  # per-file load/save bars would drown our own
    if args.command == "report":
        return _report(args)
    try:
        cfg = _config(args)
        if args.command == "demo":
            from .demo import run_demo

            run_demo(cfg)
        elif args.command == "pretrain":
            from .trainers.pretrain import pretrain

            print(json.dumps(pretrain(cfg), indent=2))
        elif args.command == "rm":
            from .trainers.reward import train_reward_model

            print(json.dumps(train_reward_model(cfg), indent=2))
        elif args.command in ALGO_DEFAULTS:
            from .trainers.rl import train_rl

            print(json.dumps(train_rl(cfg), indent=2))
        elif args.command == "sft":
            from .trainers.sft import train_sft

            print(json.dumps(train_sft(cfg), indent=2))
        elif args.command == "dpo":
            from .trainers.dpo import train_dpo

            print(json.dumps(train_dpo(cfg), indent=2))
        elif args.command == "eval":
            from .evaluate import evaluate_path

            print(json.dumps(evaluate_path(_policy_dir(args.path), cfg), indent=2))
        elif args.command == "gridworld":
            from .tasks.gridworld import train_gridworld

            res = train_gridworld(cfg)
            every = max(1, len(res["returns"]) // 10)
            curve = "  ".join(f"{i}:{r:.1f}" for i, r in enumerate(res["returns"]) if i % every == 0)
            print(f"{res['algo']}, seed {res['seed']}, {res['seconds']:.1f}s -> {res['out_dir']}")
            print(res["policy"])
            print(f"mean return by iteration: {curve}  last:{res['returns'][-1]:.1f}")
            verdict = "optimal" if res["optimal"] else "NOT optimal"
            print(f"greedy return {res['greedy_return']:g}, optimum {res['optimal_return']:g}: {verdict}")
    except (ConfigError, FileNotFoundError, ValueError) as e:  # bad input: config, data, paths, models
        print(f"rlhfkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # the inputs were fine but the run diverged
        print(f"rlhfkit {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _report(args) -> int:
    import subprocess

    from .report import screenshot, write_report

    try:
        path = write_report(args.path)
        print(f"report: {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if args.screenshot:
            print(f"screenshot: {screenshot(path, path.with_suffix('.png'))}")
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"rlhfkit report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
