"""Reward functions (``reward.function``) and environments (``env.class``) loaded by import path and
checked before torch and the models load (:func:`check_before_loading`): a misspelt name fails at once."""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import CALLABLE_PLACEHOLDER, Config
from .data import precheck
from .tasks import get_task


class RewardError(ValueError):
    """A reward source failed or returned something unusable; the message names it."""


USER_FILE_MODULE = "_rlhfkit_user_"  # prefix of the modules of reward files named by their path


def function_name(fn) -> str:
    """``module:qualname``, or ``path/to/file.py:qualname`` for a function of a file named by its path."""
    module = getattr(fn, "__module__", None) or "?"
    if module.startswith(USER_FILE_MODULE):
        module = getattr(sys.modules.get(module), "__file__", module)
    return module + ":" + getattr(fn, "__qualname__", repr(fn))


def load_reward_function(spec: str | Callable, key: str = "reward.function",
                         noun: str = "function") -> Callable[..., list[float]]:
    """``'package.module:name'`` or ``'path/to/file.py:name'`` (``name`` may be qualified) -> the callable,
    looked for where Python looks, then in the current directory; errors name ``key`` and ``noun``."""
    if callable(spec):
        return spec
    if spec == CALLABLE_PLACEHOLDER:
        raise ValueError(f"{key}={spec!r}: the run this config comes from was given a Python callable with no "
                         "importable name (a lambda, something defined in __main__); pass it again from Python "
                         f"or name an importable one as 'package.module:{noun}'")
    module, _, name = spec.rpartition(":")  # the last colon: a Windows path has one of its own
    if not module or not name:
        raise ValueError(f"{key}={spec!r} must look like 'package.module:{noun}' or 'path/to/file.py:{noun}'")
    try:
        fn = _import_file(module) if module.endswith(".py") else _import_module(module)
        for part in name.split("."):  # a qualified name: 'module:Class.method'
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}={spec!r} cannot be loaded: {e}; name a Python file "
                         f"('path/to/file.py:{noun}') or a module that is installed, on PYTHONPATH or in the "
                         "current directory, and that defines that name") from None
    if not callable(fn):
        raise ValueError(f"{key}={spec!r} is not callable")
    return fn


def _import_module(module: str):
    """``importlib.import_module``, else the current directory's module (not on the command's path)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        here = Path.cwd()
        if e.name != top or not ((here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file()):
            raise
        if str(here) not in sys.path:
            sys.path.append(str(here))  # appended: an installed module of the same name still wins
        importlib.invalidate_caches()
        return importlib.import_module(module)


def _import_file(path: str):
    """The module of a ``.py`` file, imported once per path (its directory joins ``sys.path``)."""
    import importlib.util

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no such file {path}")
    name = f"{USER_FILE_MODULE}{file.stem}_{zlib.crc32(str(file).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: a dataclass or pickle in it looks itself up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def split_specs(spec) -> list:
    """``'a:f, b:g'`` -> ``['a:f', 'b:g']`` (any comma-separated key); a callable or a list passes through."""
    if callable(spec):
        return [spec]
    if isinstance(spec, (list, tuple)):
        return list(spec)
    return [s.strip() for s in str(spec).split(",") if s.strip()]


CALL_ARGUMENTS = ("prompts", "completions", "completion_ids", "finished")  # every call's, beside the columns


def check_call(fn: Callable, columns: Sequence[str] | None) -> None:
    """RewardError naming ``fn`` when it cannot take ``CALL_ARGUMENTS`` and one keyword per column
    (``columns`` None: not known yet, each parameter without a default taken for one)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    given = columns if columns is not None else \
        [p.name for p in sig.parameters.values() if p.default is p.empty and p.kind in named]
    try:
        sig.bind(**dict.fromkeys([*CALL_ARGUMENTS, *given]))
    except TypeError as e:
        listed = "not known yet" if columns is None else ", ".join(columns) or "none"
        raise RewardError(f"reward function {function_name(fn)} cannot take the arguments it is called with, "
                          f"{', '.join(CALL_ARGUMENTS)} and the data's columns ({listed}): {e}; take **kwargs "
                          "for those it does not read") from None


def source_name(fn: Callable) -> str:
    """The name a reward function's scores are logged under (``reward/<name>``)."""
    return getattr(fn, "__name__", "function")


def named_weights(names: list[str], cfg: Config) -> tuple[list[str], list[float], tuple[str, ...]]:
    """``(names, weights, accuracy)`` of the sources ``names`` (the model first): names made unique (``_2``
    ...), ``reward.weights`` (empty: all 1), ``eval.accuracy_reward``'s sources; ValueError if they misfit."""
    rc = cfg.reward
    weights = [float(w) for w in split_specs(rc.weights)] if rc.weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(f"reward.weights={rc.weights!r} gives {len(weights)} weight(s) for {len(names)} reward "
                         f"source(s) ({', '.join(names)}): give one per source, the reward model first")
    unique = [name if (k := names[:i + 1].count(name)) == 1 else f"{name}_{k}" for i, name in enumerate(names)]
    accuracy = tuple(split_specs(cfg.eval.accuracy_reward))
    unknown = [a for a in accuracy if a not in unique]
    if unknown:
        raise ValueError(f"eval.accuracy_reward={cfg.eval.accuracy_reward!r} names no reward source "
                         f"({', '.join(unknown)}); the sources are: {', '.join(unique)}")
    return unique, weights, accuracy


def check_reward_config(cfg: Config, columns: Sequence[str] | None) -> None:
    """Every ``reward.function`` loads and takes its arguments (``columns``: the records', None when not
    known yet), and the weights and accuracy sources fit the sources."""
    fns = [load_reward_function(spec) for spec in split_specs(cfg.reward.function)]
    for fn in fns:
        check_call(fn, columns)
    named_weights([*(["reward_model"] if cfg.reward.name else []), *map(source_name, fns)], cfg)


class EnvError(ValueError):
    """An environment failed or returned something unusable; the message names it."""


def env_name(env) -> str:
    """``module:Name``, or ``path/to/file.py:Name`` for a class of a file named by its path."""
    return function_name(env if isinstance(env, type) else type(env))


def environment_factory(spec) -> Callable[[], object]:
    """What ``env.class`` names -> a maker of a fresh environment per episode: a class (or its import
    path) called with no arguments, or an instance deep-copied."""
    if isinstance(spec, str):
        spec = load_reward_function(spec, key="env.class", noun="Name")  # loaded as reward functions are
    playable = callable(getattr(spec, "reset", None)) and callable(getattr(spec, "step", None))
    if isinstance(spec, type):
        if not playable:
            raise EnvError(f"env.class={env_name(spec)} has no reset and step methods: subclass "
                           "rlhfkit.envs.environment.Environment")
        return spec
    if playable:
        return lambda: copy.deepcopy(spec)
    raise EnvError(f"env.class={spec!r} is neither an environment class nor an instance: subclass "
                   "rlhfkit.envs.environment.Environment")


def check_before_loading(cfg: Config) -> None:
    """A local ``data.path``'s records, the reward (with the records' or the task's columns) and
    ``env.class``, checked before torch and the models load."""
    if cfg.data.path:
        examples = precheck("prompts", cfg.data.path)
        columns = None if examples is None else list(examples[0].meta)  # None: a hub dataset, a directory ...
    else:
        task = get_task(cfg.run.task)
        columns = list(task.columns(task.eval_prompts()[0]))
    check_reward_config(cfg, columns)
    if cfg.env.cls:
        environment_factory(cfg.env.cls)
