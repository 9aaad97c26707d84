"""One function per command, running what ``rlhfkit COMMAND`` runs and returning the summary it prints.

Each takes ``config`` (a YAML path, a mapping of sections, a :class:`~rlhfkit.Config` or None), ``overrides``
(dotted keys or sections) and the shortcuts ``model`` (``model.name``), ``data`` and ``eval_data`` (a path, a
``datasets.Dataset`` or a list of dicts, written to ``run.out_dir`` as JSONL) and ``reward_funcs``
(``reward.function``); docs/reference/api.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .cli.main import DATA_KIND, RESUMABLE, resolve_config, run_command
from .config import Config

ConfigSource = Config | Mapping[str, Any] | str | os.PathLike | None
DataSource = str | os.PathLike | Sequence[Mapping[str, Any]] | Any | None  # Any: a datasets.Dataset
RewardFuncs = str | Callable[..., Any] | Sequence[str | Callable[..., Any]] | None


def ppo(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
        eval_data: DataSource = None, reward_funcs: RewardFuncs = None,
        overrides: Mapping[str, Any] | None = None) -> dict:
    """PPO with a critic (``rlhfkit ppo``) on ``data``'s prompts, scored by ``reward.name`` and/or
    ``reward_funcs``."""
    return run("ppo", **locals())


def grpo(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
         eval_data: DataSource = None, reward_funcs: RewardFuncs = None,
         overrides: Mapping[str, Any] | None = None) -> dict:
    """GRPO (``rlhfkit grpo``): group-relative advantages, no critic."""
    return run("grpo", **locals())


def rloo(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
         eval_data: DataSource = None, reward_funcs: RewardFuncs = None,
         overrides: Mapping[str, Any] | None = None) -> dict:
    """RLOO (``rlhfkit rloo``): a leave-one-out baseline over each prompt's samples, no critic."""
    return run("rloo", **locals())


def reinforce(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
              eval_data: DataSource = None, reward_funcs: RewardFuncs = None,
              overrides: Mapping[str, Any] | None = None) -> dict:
    """REINFORCE with a batch-mean baseline (``rlhfkit reinforce``)."""
    return run("reinforce", **locals())


def dpo(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
        eval_data: DataSource = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """DPO on ``data``'s preference pairs (``rlhfkit dpo``)."""
    return run("dpo", **locals())


def sft(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
        eval_data: DataSource = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """Supervised fine-tuning on ``data``'s demonstrations (``rlhfkit sft``)."""
    return run("sft", **locals())


def reward_model(config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
                 eval_data: DataSource = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """A reward model trained on ``data``'s preference pairs (``rlhfkit rm``)."""
    return run("rm", **locals())


def pretrain(config: ConfigSource = None, *, overrides: Mapping[str, Any] | None = None) -> dict:
    """Pretrain a tiny GPT-2 on the built-in task's text (``rlhfkit pretrain``)."""
    return run("pretrain", **locals())


def evaluate(path: str | os.PathLike, config: ConfigSource = None, *, data: DataSource = None,
             reward_funcs: RewardFuncs = None, overrides: Mapping[str, Any] | None = None) -> dict:
    """Evaluate the policy at ``path`` (``rlhfkit eval PATH``): on ``data``'s prompts scored by
    the rewards, or, without data, on the built-in task's held-out prompts."""
    return run("eval", config, data=data, reward_funcs=reward_funcs, overrides=overrides, path=os.fspath(path))


def demo(config: ConfigSource = None, *, overrides: Mapping[str, Any] | None = None) -> dict:
    """Pretrain, reward model, RL and evaluation on the built-in task (``rlhfkit demo``)."""
    return run("demo", **locals())


def run(command: str, config: ConfigSource = None, *, model: str | None = None, data: DataSource = None,
        eval_data: DataSource = None, reward_funcs: RewardFuncs = None,
        overrides: Mapping[str, Any] | None = None, path: str | None = None) -> dict:
    """``rlhfkit COMMAND`` (its name on the command line, e.g. ``'rm'``, ``'eval'``) from Python."""
    given = dict(overrides or {})
    if model is not None:
        given["model.name"] = model
    if reward_funcs is not None:
        one = isinstance(reward_funcs, str) or callable(reward_funcs)
        given["reward.function"] = reward_funcs if one else list(reward_funcs)
    cfg = resolve_config(command, config, given)
    return run_command(command, _with_data(command, cfg, data, eval_data), path)


def _with_data(command: str, cfg: Config, data: DataSource, eval_data: DataSource) -> Config:
    """``cfg`` reading ``data`` and ``eval_data``: a path as it is, in-memory records (checked first, so an
    error names their place in the list) from the JSONL file they are written to in ``run.out_dir``."""
    from .data import precheck, write_jsonl
    from .utils import check_out_dir

    paths = {}
    for key, source, name in (("path", data, "data.jsonl"), ("eval_path", eval_data, "eval_data.jsonl")):
        if isinstance(source, (str, os.PathLike)):
            paths[key] = os.fspath(source)
        elif source is not None:
            if command in RESUMABLE:  # an earlier run's data file stays when the run is refused
                check_out_dir(cfg)
            precheck(DATA_KIND[command], source)
            paths[key] = write_jsonl(source, Path(cfg.run.out_dir) / name)
    return cfg.replace(data=paths) if paths else cfg
