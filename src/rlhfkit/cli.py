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

from .config import ALGO_DEFAULTS, Config, ConfigError, dump_config, load_config

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
# the config sections (or single keys) each command reads, listed by `rlhfkit CMD --help`
RL_SECTIONS = ("run", "model", "reward", "ppo", "value", "data", "eval")
COMMAND_SECTIONS: dict[str, tuple[str, ...]] = {
    "demo": ("run", "model", "pretrain", "reward", "ppo", "value", "dpo", "data", "eval", "demo"),
    "pretrain": ("run", "model", "pretrain", "eval"),
    "rm": ("run", "model", "reward", "data"),
    **dict.fromkeys(ALGO_DEFAULTS, RL_SECTIONS),
    "dpo": ("run", "model", "dpo", "eval", "reward.hard_negatives"),
    "sft": ("run", "model", "data", "sft"),
    "eval": ("run", "model", "eval"),
    "chat": ("run", "model", "chat"),
    "gridworld": ("run", "gridworld"),
}
DEBUG_HELP = "show the full traceback of an error instead of one line (also: RLHFKIT_DEBUG=1)"


def _defaults(command: str, task_defaults: dict | None = None) -> Config:
    """The config a command starts from: the task's defaults, then its output directory and its
    algorithm's defaults (ALGO_DEFAULTS)."""
    return Config().replace(**(task_defaults or {})).replace(run={"out_dir": DEFAULT_OUT[command]},
                                                             ppo=ALGO_DEFAULTS.get(command, {}))


def first_sentence(text: str) -> str:
    """The first sentence of a description, on one line (a period inside brackets or after
    'e.g'/'i.e' does not end it)."""
    text, depth = " ".join(text.split()), 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth <= 0 and text[i + 1 : i + 2] in (" ", "") and not text[:i].endswith(("e.g", "i.e")):
            return text[: i + 1]
    return text


def keys_help(command: str) -> str:
    """The epilog of ``rlhfkit CMD --help``: the output directory, then every key the command reads
    with its type, default and description (from the docstrings in rlhfkit/config.py)."""
    from textwrap import fill

    from .config import key_docs, key_types

    cfg, docs, types = _defaults(command).to_dict(), key_docs(), key_types()
    lines = [f"Writes to {DEFAULT_OUT[command]}/ unless run.out_dir says otherwise.", "",
             fill("Config keys (section.key=value on the command line, or a section: mapping in --config FILE) "
                  "with this command's defaults; run.task=cities brings its own for some, and --print-config "
                  "shows the resolved config:", 100)]
    for entry in COMMAND_SECTIONS[command]:
        sec, _, only = entry.partition(".")
        lines += ["", f"{sec}:"]
        for key, doc in docs[sec].items():
            if only and key != only:
                continue
            lines.append(f"  {sec}.{key}: {types[sec][key]} = {cfg[sec][key]!r}")
            lines.append(fill(first_sentence(doc), 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: its key listing (``keys_help``) is built only when its help is shown."""

    command = ""

    def format_help(self) -> str:
        if self.epilog is None and self.command in COMMAND_SECTIONS:
            self.epilog = keys_help(self.command)
        return super().format_help()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhfkit", description="RLHF for language models: reward models and PPO.",
                                epilog="Errors in the input are one line and exit code 2; --debug (or "
                                       "RLHFKIT_DEBUG=1) shows the full traceback instead.")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    for name, help_text in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.command = name  # its epilog, the keys it reads, is built when its help is shown
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
        sections = ", ".join(dict.fromkeys(e.partition(".")[0] for e in COMMAND_SECTIONS[name]))
        sp.add_argument("--config", help=f"YAML config file (sections: {sections}; the keys are listed below)")
        sp.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults, --config file, overrides) as YAML and exit")
        if name in RESUMABLE:
            sp.add_argument("--resume", action="store_true",
                            help="continue from the newest checkpoint in run.out_dir (same as run.resume=true)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl_coef=0.1 run.seed=3")
    return p


def _config(args) -> Config:
    """Defaults <- the task's defaults <- the command's algorithm defaults <- file <- overrides."""
    from .tasks import get_task

    def build(task_defaults: dict) -> Config:
        overrides = [*args.overrides, *(["run.resume=true"] if getattr(args, "resume", False) else [])]
        sections = [e.partition(".")[0] for e in COMMAND_SECTIONS[args.command]]
        return load_config(args.config, overrides, base=_defaults(args.command, task_defaults), prefer=sections)

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
        print(json.dumps(result, indent=2, ensure_ascii=False))  # prompts and answers as people write them


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
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
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
