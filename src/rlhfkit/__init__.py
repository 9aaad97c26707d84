"""rlhfkit: reinforcement learning from human feedback for language models.

The public surface is what this package exports: the config classes, ``Environment``, ``ToolEnvironment``
and one function per command (rlhfkit.api); every other module is internal and may move. Names are
imported on first use, so ``import rlhfkit`` does not import torch.
"""

__version__ = "0.2.0"

_CONFIG = ("Config", "ConfigError", "load_config", "RunConfig", "ModelConfig", "PretrainConfig", "RewardConfig",
           "ValueConfig", "ChatConfig", "PPOConfig", "DataConfig", "SFTConfig", "DPOConfig", "EvalConfig",
           "DemoConfig", "GridworldConfig", "EnvConfig", "AccelConfig")
_COMMANDS = ("ppo", "grpo", "rloo", "reinforce", "dpo", "sft", "reward_model", "pretrain", "evaluate", "demo")
# public name -> the module that defines it
_WHERE = {**dict.fromkeys(_CONFIG, "config"), **dict.fromkeys(_COMMANDS, "api"),
          "Environment": "envs.environment", "ToolEnvironment": "envs.tools"}

__all__ = ["__version__", *_CONFIG, "Environment", "ToolEnvironment", *_COMMANDS]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rlhfkit' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
