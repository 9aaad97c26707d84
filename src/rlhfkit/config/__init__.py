"""Configuration: nested frozen dataclasses (config.sections, config.ppo), YAML files, dotted overrides.
``load_config(path, ["ppo.kl_coef=0.1"])`` returns a validated :class:`Config`; an unknown key or an ill-typed
value raises :class:`ConfigError` naming the key, with a "did you mean", before any work starts."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .base import (
    MOVED_KEYS,
    POSITIVE,
    RANGES,
    ConfigError,
    Section,
    _hints,
    check_moved,
    type_name,
)
from .ppo import ALGO_DEFAULTS, ALGO_KEYS, LORA_DEFAULTS, PER_SEQUENCE_LOSSES, PPOConfig
from .sections import (
    REGIME_DEFAULTS,
    REGIME_NAMES,
    AccelConfig,
    ChatConfig,
    DataConfig,
    DemoConfig,
    DPOConfig,
    EnvConfig,
    EvalConfig,
    GridworldConfig,
    ModelConfig,
    PretrainConfig,
    RewardConfig,
    RunConfig,
    SFTConfig,
    ValueConfig,
)
from .trl import TRL_KEYS, trl_hint

__all__ = ["ALGO_DEFAULTS", "ALGO_KEYS", "LORA_DEFAULTS", "MOVED_KEYS", "PER_SEQUENCE_LOSSES", "POSITIVE", "RANGES",
           "REGIME_DEFAULTS", "REGIME_NAMES", "TRL_KEYS", "AccelConfig", "ChatConfig", "Config", "ConfigError",
           "DataConfig", "DemoConfig", "DPOConfig", "EnvConfig", "EvalConfig", "GridworldConfig", "ModelConfig",
           "PPOConfig", "PretrainConfig", "RewardConfig", "RunConfig", "Section", "SFTConfig", "ValueConfig",
           "callable_name", "dump_config", "from_dict", "key_docs", "key_groups", "key_types",
           "key_value", "load_config", "parse_override", "regime_value", "save_config", "type_name"]


def key_value(cfg: Config, key: str) -> Any:
    """The value of the dotted ``key`` (``'sft.lr'``) in ``cfg``."""
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


def regime_value(cfg: Config, key: str, regime: str) -> Any:
    """The dotted ``key`` of REGIME_DEFAULTS: the config's own value, or when unset (None) ``regime``'s."""
    value = key_value(cfg, key)
    return REGIME_DEFAULTS[regime][key] if value is None else value


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    gridworld: GridworldConfig = field(default_factory=GridworldConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    accel: AccelConfig = field(default_factory=AccelConfig)

    def __post_init__(self):
        # the ppo section's unset algorithm keys take this policy's values (LORA_DEFAULTS with LoRA)
        values = {k: v for k, v in algo_defaults(self.ppo.algo, bool(self.model.lora_r)).items()
                  if k in self.ppo._defaulted and getattr(self.ppo, k) != v}
        # the critic: a model of its own only when value.name or value.lora names one, or ppo.value_init
        # asks for one without ppo.value_model (older saved configs record value_init: reward for every run)
        model_keys = [k for k, on in (("value.name", self.value.name), ("value.lora", self.value.lora)) if on]
        if self.ppo.value_model is None:
            values["value_model"] = "separate" if model_keys or self.ppo.value_init is not None else "shared"
        elif self.ppo.value_model == "shared" and model_keys:
            raise ConfigError(f"ppo.value_model=shared puts the value head on the policy, but {' and '.join(model_keys)} "
                              "configure a separate value model: drop them, or set ppo.value_model=separate")
        if values:
            ppo = dataclasses.replace(self.ppo, **values)
            object.__setattr__(ppo, "_defaulted", self.ppo._defaulted)
            object.__setattr__(self, "ppo", ppo)

    def to_dict(self) -> dict[str, Any]:
        """``{section: {key: value}}``, a tuple as a list, a callable as itself (:func:`dump_config`: YAML)."""
        return {f.name: {g.name: list(v) if isinstance(v, tuple) else v
                         for g in dataclasses.fields(sec) for v in [getattr(sec, g.name)]}
                for f in dataclasses.fields(self) for sec in [getattr(self, f.name)]}

    def _as_given(self) -> dict[str, Any]:
        """:meth:`to_dict` with the unset algorithm keys as None, so that a copy's follow its ppo.algo and
        model.lora_r while the keys the user set keep their values."""
        data = self.to_dict()
        data["ppo"].update(dict.fromkeys(self.ppo._defaulted))
        return data

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some fields changed: ``cfg.replace(ppo={"steps": 3})`` (validated)."""
        data = self._as_given()
        for sec, values in sections.items():
            for key, val in values.items():
                _set(data, f"{sec}.{key}", val)
        follow_value_model(data, {f"{s}.{k}" for s, v in sections.items() for k in v})
        return from_dict(data)


def algo_defaults(algo: str, lora: bool) -> dict[str, Any]:
    """The values of ALGO_KEYS left unset under ``algo``: ALGO_DEFAULTS', LORA_DEFAULTS' for a LoRA policy."""
    return {**ALGO_DEFAULTS.get(algo, {}), **(LORA_DEFAULTS.get(algo, {}) if lora else {})}


def follow_value_model(data: dict[str, Any], given: set[str]) -> None:
    """Unset ppo.value_model when value.name, value.lora or ppo.value_init is ``given`` without it, for
    Config to resolve again (a saved config.yaml records every shared head)."""
    ppo = data.get("ppo")
    if isinstance(ppo, dict) and "ppo.value_model" not in given and given & {"value.name", "value.lora", "ppo.value_init"}:
        ppo["value_model"] = None


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


def _key_suggestion(data: dict, section: str | None, name: str, prefer: Sequence[str] = ()) -> str:
    """" Did you mean ...?" for an unknown key ``name`` (in ``section``, or with none): dotted keys, the
    sections in ``prefer`` (a command's own) first; for a name of TRL's, its rlhfkit key (TRL_KEYS)."""
    order = [s for s in dict.fromkeys([*prefer, *data]) if isinstance(data.get(s), dict)]
    # a TRL name: in the section given, or in the first section holding the name as a key of its own or TRL's
    first = section or next((s for s in order if name in data[s] or name in TRL_KEYS.get(s, {})), "")
    if first and name not in data[first] and (hint := trl_hint(first, name)):
        return hint
    if section is not None:
        close = difflib.get_close_matches(name, list(data[section]), n=1)
        if close:
            return f" Did you mean '{section}.{close[0]}'?"
    found = [f"{s}.{name}" for s in order if name in data[s]]  # the same key in another section
    if not found:
        near = set(difflib.get_close_matches(name, {k for s in order for k in data[s]}, n=3))
        found = [f"{s}.{k}" for s in order for k in data[s] if k in near]
    if len(found) == 1:
        return f" Did you mean '{found[0]}'?"
    if found:
        return f" Did you mean {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}?"
    if section is not None:
        return f" Valid keys: {', '.join(sorted(data[section]))}."
    return f" Sections: {', '.join(order)}."


# keys whose natural name is a Python keyword: the name users write -> the field
KEY_ALIASES = {"env.class": "env.cls"}


def _set(data: dict, dotted: str, value: Any, prefer: Sequence[str] = ()) -> None:
    """``data[section][key] = value`` for ``'section.key'``; ConfigError naming the key to use if none."""
    dotted = KEY_ALIASES.get(dotted, dotted)
    sec, _, rest = dotted.partition(".")
    if "." not in dotted:
        if dotted not in data:  # a key without its section
            raise ConfigError(f"unknown config key '{dotted}': keys are written section.key."
                              f"{_key_suggestion(data, None, dotted, prefer)}")
        data[dotted] = value
        return
    if not isinstance(data.get(sec), dict):
        close = difflib.get_close_matches(sec, [s for s in data if isinstance(data[s], dict)], n=1)
        hint = f" Did you mean '{close[0]}.{rest}'?" if close and rest in data[close[0]] else _suggest(sec, data)
        raise ConfigError(f"unknown config section '{sec}' (top level).{hint}")
    _check_key(data, sec, rest, prefer)
    data[sec][rest] = value


def _check_key(data: dict, sec: str, name: str, prefer: Sequence[str] = ()) -> None:
    """ConfigError for a key ``sec.name`` that moved or that section ``sec`` of ``data`` lacks."""
    check_moved(f"{sec}.{name}")
    if name not in data[sec]:
        raise ConfigError(f"unknown config key '{sec}.{name}'.{_key_suggestion(data, sec, name, prefer)}")


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested dict (missing keys take defaults)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    hints, sections = _hints(Config), {}
    keys = {s: _hints(c) for s, c in hints.items()}
    for sec, values in data.items():
        if sec not in hints:
            raise ConfigError(f"unknown config section '{sec}'.{_suggest(sec, hints)}")
        values = {} if values is None else values
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{sec}' must be a mapping, got {values!r}")
        for key in values:
            _check_key(keys, sec, key)
        sections[sec] = hints[sec](**values)  # type- and range-checked by Section.__post_init__
    cfg = Config(**sections)
    if cfg.model.n_embd % cfg.model.n_head:  # what a range cannot say
        raise ConfigError(f"config key 'model.n_embd' ({cfg.model.n_embd}) must be a multiple of "
                          f"model.n_head ({cfg.model.n_head})")
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``'ppo.kl_coef=0.1'`` -> ``('ppo.kl_coef', 0.1)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), base: Config | None = None,
                prefer: Sequence[str] = ()) -> Config:
    """Defaults (or ``base``) <- YAML file <- dotted overrides, validated; an unknown key's suggestions
    come from the sections in ``prefer`` (the command's own) first."""
    data, given = (base or Config())._as_given(), set()
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:  # one line: where it broke and why, not PyYAML's multi-line report
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}; "
                              "fix the syntax there") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        for sec, values in loaded.items():
            if sec not in data:  # a key without its section (TRL's config files are flat) or a mistyped section
                hint = _suggest(sec, data) if isinstance(values, dict) else _key_suggestion(data, None, sec, prefer)
                raise ConfigError(f"unknown config section '{sec}' in {path}.{hint}")
            for key, val in (values or {}).items():
                _set(data, f"{sec}.{key}", val, prefer)
                given.add(f"{sec}.{key}")
    for item in overrides:
        key, value = parse_override(item)
        _set(data, key, value, prefer)
        given.add(key)
    follow_value_model(data, given)
    return from_dict(data)


@functools.cache
def key_docs() -> dict[str, dict[str, str]]:
    """``{section: {key: help}}``, the help each field declares (config.base.key)."""
    return {sec: {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}
            for sec, cls in _hints(Config).items()}


def key_groups() -> dict[str, list[tuple[str, str, list[str]]]]:
    """``{section: [(heading, description, keys), ...]}``: the ``ppo`` section's keys by concern
    (``PPOSampling`` -> ``'Sampling'``, its docstring); any other section is one group."""
    return {sec: [(part.__name__.removeprefix("PPO"), inspect.cleandoc(part.__doc__), list(_hints(part)))
                  for part in reversed(cls.__bases__) if dataclasses.is_dataclass(part)]
            or [("", "", list(_hints(cls)))] for sec, cls in _hints(Config).items()}


def key_types() -> dict[str, dict[str, str]]:
    """``{section: {key: type as it reads in help}}`` (see :func:`type_name`)."""
    return {sec: {k: type_name(tp) for k, tp in _hints(cls).items()} for sec, cls in _hints(Config).items()}


CALLABLE_PLACEHOLDER = "<callable>"  # what config.yaml records for a callable with no importable name


def callable_name(fn: Callable) -> str:
    """``'module:qualname'`` of a function a later run can import, else ``'<callable>'`` (a lambda, a nested
    function, one defined in ``__main__`` such as a notebook's)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or module == "__main__" or not qual or "<" in qual:
        return CALLABLE_PLACEHOLDER
    return f"{module}:{qual}"


def _plain(value: Any) -> Any:
    if callable(value):
        return callable_name(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if not isinstance(value, (str, int, float, bool, type(None), dict)):  # an object (an environment)
        return CALLABLE_PLACEHOLDER
    return value


def dump_config(cfg: Config) -> str:
    """The config as YAML text (what ``config.yaml`` holds; ``load_config`` reads it back)."""
    plain = {sec: {k: _plain(v) for k, v in values.items()} for sec, values in cfg.to_dict().items()}
    return yaml.safe_dump(plain, sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(dump_config(cfg), encoding="utf-8")
