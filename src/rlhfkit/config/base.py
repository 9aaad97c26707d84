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


# keys that moved to another section: the old dotted name -> the new one, refused on every route
MOVED_KEYS = {"run.threads": "accel.threads", "run.malloc": "accel.malloc", "ppo.cuda_graph": "accel.cuda_graph",
              "ppo.offload": "accel.offload", "ppo.update_off_heap": "accel.update_off_heap",
              "ppo.reuse_rollout_logprobs": "accel.reuse_rollout_logprobs"}


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
    """Base of the section dataclasses: every value is type- and range-checked (RANGES) when the section is
    built, from Python as from the command line (``PPOConfig(steps="3")`` fails as ``ppo.steps='3'``)."""

    def __new__(cls, /, *args, **kwargs):  # positional-only: env.cls is a key
        for name in kwargs:  # PPOConfig(cuda_graph=True): the key's new place, not a TypeError
            check_moved(f"{_section_name(cls)}.{name}")
        return super().__new__(cls)

    def __post_init__(self):
        section = _section_name(type(self))
        for name, tp in _hints(type(self)).items():
            value = getattr(self, name)
            checked = _coerce(value, tp, f"{section}.{name}")
            if checked is not value:
                object.__setattr__(self, name, checked)  # frozen: the one place a value is normalised
            _check_range(f"{section}.{name}", checked)


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
    """``value`` as a ``tp`` (an int as a float, a number or path as a str, a list as a tuple), or ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key '{key}' must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:  # tuple[str, ...]: a YAML list, one value as a list of one, "" as none (null is
        # an error: YAML reads an unquoted '#...' as a comment, and that must not turn stop strings off silently)
        value = [] if value == "" else value if isinstance(value, (list, tuple)) else [value]
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        return tuple(_coerce(v, args[0], key) for v in value)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
    elif tp is float and (number or isinstance(value, str)):  # PyYAML reads '1e-4' (no dot) as a string
        try:
            as_float = float(value)
        except ValueError:
            as_float = None
        if as_float is not None and not math.isfinite(as_float):  # a NaN rate would reach the weights silently
            raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
        if as_float is not None:
            return value if type(value) is float else as_float
    elif tp is str and (number or isinstance(value, (str, os.PathLike))):  # a pathlib.Path from Python
        return str(value) if number else os.fspath(value)
    elif origin is collections.abc.Callable and callable(value) or tp is bool and isinstance(value, bool):
        return value
    elif tp is int and number and isinstance(value, int):
        return value
    elif tp not in (bool, int, float, str) and origin not in (collections.abc.Callable, list):  # Any
        return value
    raise ConfigError(f"config key '{key}' expects {type_name(tp)}, got {value!r} ({type(value).__name__})")


# What the types cannot say, checked when a section is built so that a zero batch or a negative rate stops
# the run before any work: ``section: key lowest..highest`` (a blank bound: unbounded; '>0': strictly
# positive, a rate, scale or coefficient where 0 would train nothing or divide by 0).
_RANGE_TABLE = """
run: max_bad_updates 1.., checkpoint_every 0.., keep_checkpoints 1.., log_every 0..
accel: threads 0..
model: n_layer 1.., n_head 1.., n_embd 1.., lora_r 0..
pretrain: steps 1.., batch_size 1.., lr >0.., warmup_steps 0.., weight_decay 0..
reward: steps 1.., batch_size 1.., lr >0.., center_coef 0.., hard_negatives 0..1, eval_pairs 1..,
    micro_batch_size 0..
ppo: group_size 2.., steps 1.., batch_size 1.., minibatch_size 1.., ppo_epochs 1.., lr >0..,
    value_lr >0.., max_new_tokens 1.., temperature >0.., top_k 0.., top_p >0..1, min_p 0..1,
    repetition_penalty >0.., warmup_steps 0.., warmup_ratio 0..1, sampling_correction_cap 1..,
    kl_coef 0.., forward_kl_coef 0.., kl_target >0.., kl_horizon 1.., gamma 0..1, lam 0..1,
    clip_range >0.., value_clip_range >0.., vf_coef 0.., epsilon_high >0.., sapo_temperature_pos >0..,
    sapo_temperature_neg >0.., entropy_coef 0.., score_clip >0.., max_grad_norm >0..,
    missing_eos_penalty 0.., overlong_buffer 0.., overlong_penalty 0.., critic_warmup_steps 0..,
    eval_every 0.., stop_at 0.., samples_per_log 0.., micro_batch_size 0.., guard_kl 0.., guard_eos 0..1,
    guard_eval_drop 0..1, guard_tradeoff 0..1
data: max_length 2.., max_prompt_length 1.., eval_fraction 0..0.9
sft: steps 1.., batch_size 1.., lr >0.., warmup_steps 0.., eval_every 0.., micro_batch_size 0..
dpo: beta >0.., steps 1.., batch_size 1.., lr >0.., num_pairs 1.., nll_coef 0.., eval_every 0..,
    stop_at_format 0..1, micro_batch_size 0..
eval: batch_size 1.., max_new_tokens 1..
gridworld: iterations 1.., episodes_per_iter 1.., lr >0.., gamma 0..1, lam 0..1, drunk 0..1,
    max_steps 1.., hidden 1.., ppo_epochs 1.., minibatches 1.., clip_range >0.., vf_coef 0..,
    entropy_coef 0.., reward_scale >0..
env: max_turns 0.., max_tokens 0..
chat: temperature >0.., max_new_tokens 1..
"""


def _ranges(table: str) -> tuple[dict[str, tuple[float | None, float | None]], set[str]]:
    """``{dotted key: (lowest, highest)}`` (None: unbounded) and the keys marked '>0', from the table above."""
    ranges, positive = {}, set()
    for line in table.strip().replace("\n    ", " ").splitlines():
        section, _, items = line.partition(":")
        for item in items.split(","):
            name, bounds = item.split()
            key = f"{section}.{name}"
            ranges[key] = tuple(None if b == "" else float(b) if "." in b else int(b)
                                for b in bounds.lstrip(">").split(".."))
            if bounds.startswith(">"):
                positive.add(key)
    return ranges, positive


RANGES, POSITIVE = _ranges(_RANGE_TABLE)


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
