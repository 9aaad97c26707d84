"""The base of every config section: type and range checks, the error they raise, moved keys."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import os
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and says how to fix it."""


ConfigError.__module__ = "rlhfkit.config"  # its public name, as tracebacks and the API reference show it


# keys that moved to another section: the old dotted name -> the new one. Every route that sets a
# key (the command line, a config file, Config.replace, a section's constructor) refuses the old name.
MOVED_KEYS = {
    "run.threads": "accel.threads", "run.malloc": "accel.malloc", "ppo.cuda_graph": "accel.cuda_graph",
    "ppo.offload": "accel.offload", "ppo.update_off_heap": "accel.update_off_heap",
}


def key(default: Any, doc: str) -> Any:
    """A section's field: its default and its help (what ``rlhfkit CMD --help`` and the config reference print)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def check_moved(dotted: str) -> None:
    """ConfigError naming the new key when ``dotted`` is a key that moved (MOVED_KEYS)."""
    if dotted in MOVED_KEYS:
        new = MOVED_KEYS[dotted]
        raise ConfigError(f"config key '{dotted}' is now '{new}' (a speed setting, in the accel section): "
                          f"write {new}=... instead")


class Section:
    """Base of the section dataclasses: every value is type-checked and range-checked (RANGES)
    when the section is built, from Python as from the command line: ``PPOConfig(steps="3")``
    raises the ConfigError that ``ppo.steps='3'`` does. An int given to a float key becomes a
    float, a path-like given to a str key its string, a list a tuple (frozen all the way)."""

    def __new__(cls, /, *args, **kwargs):  # positional-only: env.cls is a key
        for name in kwargs:  # PPOConfig(cuda_graph=True): the key's new place, not a TypeError
            check_moved(f"{_section_name(cls)}.{name}")
        return super().__new__(cls)

    def __post_init__(self):
        section = _section_name(type(self))
        for name, tp in _hints(type(self)).items():
            key = f"{section}.{name}"
            value = getattr(self, name)
            checked = _coerce(value, tp, key)
            if checked is not value:
                object.__setattr__(self, name, checked)  # frozen: the one place a value is normalised
            _check_range(key, checked)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_name(cls: type) -> str:
    """``PPOConfig`` -> ``'ppo'``: the section a class's keys are written under."""
    return cls.__name__.removesuffix("Config").lower()


def type_name(tp: Any) -> str:
    """How a key's type reads in messages and help: ``int``, ``float | None``, ``'k1' | 'k2'``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is collections.abc.Callable:
        return "callable"
    if origin is list:
        return f"list of ({type_name(typing.get_args(tp)[0])})"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}' must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is tuple:  # tuple[str, ...]: a YAML list, one value as a list of one, "" as none (null is
        # an error: YAML reads an unquoted '#...' as a comment, and that must not turn stop strings off silently)
        value = [] if value == "" else value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce(v, typing.get_args(tp)[0], key) for v in value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' expects {type_name(tp)}, got {value!r} ({type(value).__name__})")
    if origin is collections.abc.Callable:
        if callable(value):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(v, typing.get_args(tp)[0], key) for v in value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads '1e-4' (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # a NaN rate or coefficient would reach the weights silently
                raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
            return value if type(value) is float else number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, os.PathLike):  # a pathlib.Path from Python
            return os.fspath(value)
    else:
        return value
    raise ConfigError(f"config key '{key}' expects {type_name(tp)}, got {value!r} ({type(value).__name__})")


# --------------------------------------------------------------------------- value ranges

# What the types cannot say: (lowest, highest) allowed, None for unbounded; checked after every
# load/replace so a zero batch or a negative rate stops the run before any work, with its key.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "run.max_bad_updates": (1, None), "run.checkpoint_every": (0, None),
    "run.keep_checkpoints": (1, None), "run.log_every": (0, None), "accel.threads": (0, None),
    "model.n_layer": (1, None), "model.n_head": (1, None), "model.n_embd": (1, None),
    "pretrain.steps": (1, None), "pretrain.batch_size": (1, None), "pretrain.lr": (0, None),
    "pretrain.warmup_steps": (0, None), "pretrain.weight_decay": (0, None),
    "reward.steps": (1, None), "reward.batch_size": (1, None), "reward.lr": (0, None),
    "reward.center_coef": (0, None), "reward.hard_negatives": (0, 1), "reward.eval_pairs": (1, None),
    "reward.micro_batch_size": (0, None),
    "ppo.group_size": (2, None), "ppo.steps": (1, None), "ppo.batch_size": (1, None),
    "ppo.minibatch_size": (1, None), "ppo.ppo_epochs": (1, None), "ppo.lr": (0, None), "ppo.value_lr": (0, None),
    "ppo.max_new_tokens": (1, None), "ppo.temperature": (0, None), "ppo.top_k": (0, None), "ppo.top_p": (0, 1),
    "ppo.min_p": (0, 1), "ppo.repetition_penalty": (0, None), "ppo.warmup_steps": (0, None), "ppo.warmup_ratio": (0, 1),
    "ppo.sampling_correction_cap": (1, None),
    "ppo.kl_coef": (0, None), "ppo.forward_kl_coef": (0, None),
    "ppo.kl_target": (0, None), "ppo.kl_horizon": (1, None), "ppo.gamma": (0, 1), "ppo.lam": (0, 1),
    "ppo.clip_range": (0, None), "ppo.value_clip_range": (0, None), "ppo.vf_coef": (0, None),
    "ppo.epsilon_high": (0, None), "ppo.sapo_temperature_pos": (0, None), "ppo.sapo_temperature_neg": (0, None),
    "ppo.entropy_coef": (0, None), "ppo.score_clip": (0, None), "ppo.max_grad_norm": (0, None),
    "ppo.missing_eos_penalty": (0, None), "ppo.overlong_buffer": (0, None), "ppo.overlong_penalty": (0, None),
    "ppo.critic_warmup_steps": (0, None), "ppo.eval_every": (0, None),
    "ppo.stop_at": (0, None), "ppo.samples_per_log": (0, None), "ppo.micro_batch_size": (0, None), "ppo.guard_kl": (0, None),
    "ppo.guard_eos": (0, 1), "ppo.guard_eval_drop": (0, 1), "ppo.guard_tradeoff": (0, 1),
    "data.max_length": (2, None), "data.max_prompt_length": (1, None), "data.eval_fraction": (0, 0.9),
    "sft.steps": (1, None), "sft.batch_size": (1, None), "sft.lr": (0, None), "sft.warmup_steps": (0, None),
    "sft.eval_every": (0, None), "sft.micro_batch_size": (0, None),
    "dpo.beta": (0, None), "dpo.steps": (1, None), "dpo.batch_size": (1, None), "dpo.lr": (0, None),
    "dpo.num_pairs": (1, None), "dpo.nll_coef": (0, None), "dpo.eval_every": (0, None),
    "dpo.stop_at_format": (0, 1), "dpo.micro_batch_size": (0, None),
    "eval.batch_size": (1, None), "eval.max_new_tokens": (1, None),
    "gridworld.iterations": (1, None), "gridworld.episodes_per_iter": (1, None), "gridworld.lr": (0, None),
    "gridworld.gamma": (0, 1), "gridworld.lam": (0, 1), "gridworld.drunk": (0, 1), "gridworld.max_steps": (1, None),
    "gridworld.hidden": (1, None), "gridworld.ppo_epochs": (1, None), "gridworld.minibatches": (1, None),
    "gridworld.clip_range": (0, None), "gridworld.vf_coef": (0, None), "gridworld.entropy_coef": (0, None),
    "gridworld.reward_scale": (0, None), "env.max_turns": (0, None), "env.max_tokens": (0, None),
}
# rates, scales and coefficients that must be strictly positive (0 would train nothing or divide by 0)
POSITIVE = {"pretrain.lr", "reward.lr", "ppo.lr", "ppo.value_lr", "ppo.temperature", "ppo.top_p", "ppo.kl_target",
            "ppo.repetition_penalty",
            "ppo.clip_range", "ppo.epsilon_high", "ppo.sapo_temperature_pos", "ppo.sapo_temperature_neg", "ppo.value_clip_range", "ppo.score_clip", "ppo.max_grad_norm", "sft.lr", "dpo.beta",
            "dpo.lr", "gridworld.lr", "gridworld.clip_range", "gridworld.reward_scale"}


def _check_range(key: str, value: Any) -> None:
    """ConfigError when ``value`` is outside the range RANGES gives ``key`` (if any)."""
    if value is None or key not in RANGES:  # an optional key left unset, or a key without a range
        return
    lo, hi = RANGES[key]
    if key in POSITIVE and value <= 0:
        raise ConfigError(f"config key '{key}' must be > 0, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"config key '{key}' must be {want}, got {value!r}")
