"""Tests for rlhfkit.config: defaults, YAML, dotted overrides, validation, immutability."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from rlhfkit.config import Config, ConfigError, PPOConfig, dump_config, from_dict, load_config, save_config


def raises(match: str):
    return pytest.raises(ConfigError, match=re.escape(match))


def test_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.ppo.kl_coef == 0.2
    assert cfg.ppo.kl_estimator == "k1"
    assert cfg.ppo.value_clip_range is None
    assert cfg.run.seed == 0 and cfg.model.name == ""
    assert from_dict({}) == Config()  # missing sections take defaults


def test_dotted_overrides_parse_values():
    cfg = load_config(
        overrides=["ppo.lr=1e-4", "ppo.kl_in_loss=true", "ppo.kl_estimator=k2", "run.seed=3", "ppo.kl_coef=1", "model.name=gpt2"]
    )
    # YAML reads '1e-4' (no dot) as a string; the float field still gets a float.
    assert cfg.ppo.lr == 1e-4 and isinstance(cfg.ppo.lr, float)
    assert cfg.ppo.kl_in_loss is True
    assert cfg.run.seed == 3
    assert cfg.ppo.kl_coef == 1.0 and isinstance(cfg.ppo.kl_coef, float)  # int widened to float
    assert cfg.model.name == "gpt2"
    assert cfg.ppo.steps == PPOConfig().steps  # untouched keys keep defaults


def test_optional_float_override_and_null():
    assert load_config(overrides=["ppo.value_clip_range=0.2"]).ppo.value_clip_range == 0.2
    assert load_config(overrides=["ppo.value_clip_range=1e-1"]).ppo.value_clip_range == 0.1
    # later overrides win: set, then switched off again with null
    cfg = load_config(overrides=["ppo.value_clip_range=0.2", "ppo.value_clip_range=null"])
    assert cfg.ppo.value_clip_range is None
    with raises("ppo.value_clip_range"):
        load_config(overrides=["ppo.value_clip_range=abc"])


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("run:\n  seed: 7\nppo:\n  kl_coef: 0.05\n  steps: 10\n  value_clip_range: 0.3\n")
    cfg = load_config(path, ["ppo.steps=20"])
    assert cfg.ppo.steps == 20  # override beats the file
    assert cfg.ppo.kl_coef == 0.05 and cfg.run.seed == 7 and cfg.ppo.value_clip_range == 0.3
    assert cfg.ppo.lr == PPOConfig().lr  # neither file nor override: default
    assert load_config(path).ppo.steps == 10


def test_yaml_file_errors(tmp_path):
    with raises("does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppp:\n  steps: 3\n")
    with raises("Did you mean 'ppo'"):  # the file's section: no key to complete it with
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("ppo:\n  kl_cof: 0.1\n")
    with raises("Did you mean 'ppo.kl_coef'"):
        load_config(typo)


def test_unknown_key_suggests():
    with raises("Did you mean 'ppo.kl_coef'"):  # the full dotted key to type
        load_config(overrides=["ppo.kl_cof=0.1"])
    with raises("ppo.kl_cof"):  # the message names the key
        load_config(overrides=["ppo.kl_cof=0.1"])


def test_unknown_section():
    with raises("unknown config section 'ppp'"):
        load_config(overrides=["ppp.kl_coef=0.1"])
    with raises("Did you mean 'ppo.kl_coef'"):
        load_config(overrides=["ppp.kl_coef=0.1"])
    with raises("unknown config section"):
        from_dict({"nope": {}})


def test_malformed_override():
    with raises("section.key=value"):
        load_config(overrides=["ppo.kl_coef"])


@pytest.mark.parametrize(
    "override",
    [
        "ppo.steps=abc",  # int given a string
        "ppo.steps=1.5",  # int given a float: no silent truncation
        "ppo.steps=true",  # bool is an int subclass in Python, not in a config
        "ppo.kl_coef=abc",  # float given a non-number
        "ppo.kl_coef=false",
        "ppo.whiten_advantages=3",  # bool given an int
        "model.name=null",  # str given None
    ],
)
def test_wrong_type(override):
    key = override.split("=")[0]
    with raises(f"config key '{key}'"):
        load_config(overrides=[override])


def test_literal_violation():
    with raises("must be one of ['k1', 'k2', 'k3']"):
        load_config(overrides=["ppo.kl_estimator=k9"])
    assert load_config(overrides=["ppo.kl_estimator=k3"]).ppo.kl_estimator == "k3"
    with raises("ppo.value_model"):
        load_config(overrides=["ppo.value_model=both"])


def test_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ppo.kl_coef = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ppo = PPOConfig(steps=1)


def test_replace_copies_and_validates():
    cfg = Config()
    new = cfg.replace(ppo={"steps": 3, "kl_coef": 1}, run={"seed": 9})
    assert new.ppo.steps == 3 and new.ppo.kl_coef == 1.0 and new.run.seed == 9
    assert cfg.ppo.steps == PPOConfig().steps  # original untouched
    assert new.reward == cfg.reward
    with raises("Did you mean 'ppo.steps'"):
        cfg.replace(ppo={"stepz": 3})
    with raises("must be one of"):
        cfg.replace(ppo={"kl_estimator": "k9"})
    with raises("ppo.steps"):
        cfg.replace(ppo={"steps": "many"})
    with raises("unknown config section"):
        cfg.replace(ppx={"steps": 3})


def test_save_load_round_trip(tmp_path):
    cfg = load_config(
        overrides=[
            "ppo.lr=1e-4",
            "ppo.value_clip_range=0.2",
            "ppo.kl_estimator=k2",
            "run.out_dir=runs/数字 test",  # unicode and a space survive the YAML dump
            "model.name=123",  # a str that looks like an int stays a str
            "run.progress=false",
        ]
    )
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    back = load_config(path)
    assert back == cfg
    assert back.model.name == "123" and back.run.out_dir == "runs/数字 test"
    # None survives too
    save_config(Config(), path)
    assert load_config(path) == Config()


def test_generation_settings(tmp_path):
    cfg = load_config(overrides=["ppo.top_k=20", "ppo.top_p=0.9", 'ppo.stop=["\\n\\n", "User:", "a,b"]'])
    assert (cfg.ppo.top_k, cfg.ppo.top_p) == (20, 0.9)
    assert cfg.ppo.stop == ("\n\n", "User:", "a,b")  # a list: any character may be in a stop string
    assert load_config(overrides=["ppo.stop='###'"]).ppo.stop == ("###",)  # one string: a list of one
    assert load_config(overrides=["ppo.stop="]).ppo.stop == () == PPOConfig().stop
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    for bad, key in [("ppo.top_p=0", "ppo.top_p"), ("ppo.top_p=1.5", "ppo.top_p"), ("ppo.top_k=-1", "ppo.top_k"),
                     ('ppo.stop=["x", ""]', "ppo.stop"), ("ppo.stop=[[1]]", "ppo.stop"),
                     ("ppo.stop=###", "ppo.stop")]:  # unquoted, YAML reads a comment: an error, not "no stop"
        with raises(key):
            load_config(overrides=[bad])


def test_sections_built_from_python_are_checked_like_the_command_line():
    from rlhfkit.config import ModelConfig, RewardConfig, RunConfig

    with raises("config key 'ppo.steps' expects int, got '3' (str)") as from_python:
        PPOConfig(steps="3")
    with raises("config key 'ppo.steps' expects int, got '3' (str)") as from_cli:
        load_config(overrides=["ppo.steps='3'"])
    assert str(from_python.value) == str(from_cli.value)
    with raises("config key 'ppo.batch_size' must be >= 1, got 0"):
        PPOConfig(batch_size=0)  # ranges too
    with raises("config key 'ppo.kl_estimator' must be one of ['k1', 'k2', 'k3'], got 'k9'"):
        PPOConfig(kl_estimator="k9")
    with raises("config key 'model.lora_alpha' expects float, got 'big' (str)"):
        ModelConfig(lora_alpha="big")
    assert PPOConfig(kl_coef=1).kl_coef == 1.0 and type(PPOConfig(kl_coef=1).kl_coef) is float
    assert RunConfig(out_dir=tmp_path_like()).out_dir == "runs/x"  # a pathlib.Path is taken as its string
    # every section names its own key
    for f in dataclasses.fields(Config):
        cls = type(getattr(Config(), f.name))
        first = next(g for g in dataclasses.fields(cls) if g.type in ("int", "float", "bool", "str")
                     or g.type.startswith("Literal["))
        with raises(f"config key '{f.name}.{first.name}' "):
            cls(**{first.name: object()})
    with raises("config key 'reward.function' expects str | callable | list of (str | callable), got True"):
        RewardConfig(function=True)


def tmp_path_like():
    from pathlib import Path

    return Path("runs") / "x"


def my_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_reward_callables_from_python_and_what_config_yaml_records(tmp_path):
    from rlhfkit.config import RewardConfig
    from rlhfkit.rollout.rewards import load_reward_function

    assert RewardConfig(function=my_reward).function is my_reward
    both = RewardConfig(function=[my_reward, "rlhfkit.tasks.doubling:exact_reward"])
    assert both.function == (my_reward, "rlhfkit.tasks.doubling:exact_reward")  # frozen: a tuple
    cfg = Config().replace(reward={"function": [my_reward, lambda prompts, completions, **kw: [1.0]]})
    save_config(cfg, tmp_path / "config.yaml")  # no RepresenterError
    back = load_config(tmp_path / "config.yaml")
    assert back.reward.function == ("test_config:my_reward", "<callable>")
    assert load_reward_function("test_config:my_reward") is my_reward
    with pytest.raises(ValueError, match="was given a Python callable with no importable name"):
        load_reward_function("<callable>")


# what `rlhfkit ALGO` has always run with: group_size, kl_coef, kl_estimator, kl_in_loss, normalize_reward
COMMAND_VALUES = {"ppo": (8, 0.2, "k1", False, True), "grpo": (4, 0.3, "k3", True, False),
                  "rloo": (4, 0.3, "k3", True, False), "reinforce": (8, 0.3, "k3", True, False)}


@pytest.mark.parametrize("algo", list(COMMAND_VALUES))
def test_the_python_api_has_the_defaults_of_the_command_line(algo, capsys):
    from rlhfkit.cli.main import main

    assert main([algo, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["ppo"]
    keys = ("group_size", "kl_coef", "kl_estimator", "kl_in_loss", "normalize_reward")
    assert tuple(printed[k] for k in keys) == COMMAND_VALUES[algo]  # the command's values did not move
    # every way of asking for the algorithm from Python gives the whole section the command prints
    assert Config(ppo=PPOConfig(algo=algo)).to_dict()["ppo"] == printed
    assert Config().replace(ppo={"algo": algo}).to_dict()["ppo"] == printed
    assert load_config(overrides=[f"ppo.algo={algo}"]).to_dict()["ppo"] == printed
    other = "ppo" if algo != "ppo" else "grpo"  # and switching back and forth
    assert Config().replace(ppo={"algo": other}).replace(ppo={"algo": algo}).to_dict()["ppo"] == printed


def test_keys_the_user_sets_win_over_the_algorithm_defaults(tmp_path):
    assert PPOConfig(algo="grpo", kl_coef=0.1).kl_coef == 0.1
    cfg = Config().replace(ppo={"algo": "grpo", "group_size": 8, "kl_in_loss": False, "kl_estimator": "k1"})
    assert (cfg.ppo.group_size, cfg.ppo.kl_coef, cfg.ppo.kl_in_loss, cfg.ppo.kl_estimator) == (8, 0.3, False, "k1")
    assert Config().replace(ppo={"steps": 3}).replace(ppo={"algo": "rloo"}).ppo.steps == 3  # other keys stay
    assert load_config(overrides=["ppo.kl_coef=0.05", "ppo.algo=grpo"]).ppo.kl_coef == 0.05  # in any order
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  algo: reinforce\n  normalize_reward: true\n")
    cfg = load_config(path)
    assert (cfg.ppo.normalize_reward, cfg.ppo.kl_coef, cfg.ppo.kl_estimator) == (True, 0.3, "k3")
    # a saved config.yaml (every key written out) reads back as it was
    saved = Config().replace(ppo={"algo": "grpo", "kl_coef": 0.7})
    (tmp_path / "saved.yaml").write_text(dump_config(saved))
    assert load_config(tmp_path / "saved.yaml") == saved


def test_loss_type_and_importance_sampling_level():
    import typing

    from rlhfkit.core import AGGREGATIONS

    # every loss_type the config accepts is a registered aggregation, and the other way round
    assert set(typing.get_args(typing.get_type_hints(PPOConfig)["loss_type"])) == set(AGGREGATIONS)
    cfg = load_config(overrides=["ppo.loss_type=dr_grpo", "ppo.importance_sampling_level=sequence"])
    assert (cfg.ppo.loss_type, cfg.ppo.importance_sampling_level) == ("dr_grpo", "sequence")
    assert (PPOConfig().loss_type, PPOConfig().importance_sampling_level) == ("token_mean", "token")
    with raises("config key 'ppo.loss_type' must be one of"):
        load_config(overrides=["ppo.loss_type=seq_mean"])
    with raises("config key 'ppo.importance_sampling_level' must be one of"):
        load_config(overrides=["ppo.importance_sampling_level=row"])


def test_cispo_and_sapo_keys():
    from rlhfkit.core import SurrogateOptions
    from rlhfkit.trainers.rl import surrogate_options

    cfg = load_config(overrides=["ppo.loss_type=sapo", "ppo.sapo_temperature_neg=2"])
    assert surrogate_options(cfg.ppo)[3:] == (1.0, 2.0)  # TRL's positive default, the negative one set
    # cispo's cap: ScaleRL's 5 when unset (TRL's fallback would be its epsilon, 0.2), else epsilon_high
    assert surrogate_options(load_config(overrides=["ppo.loss_type=cispo"]).ppo).cap == 5.0
    assert surrogate_options(load_config(overrides=["ppo.loss_type=cispo", "ppo.epsilon_high=3"]).ppo).cap == 3.0
    # the clipped losses read epsilon_high as the upper clip
    assert surrogate_options(load_config(overrides=["ppo.epsilon_high=0.28"]).ppo).clip_high == 0.28
    assert surrogate_options(PPOConfig()) == SurrogateOptions()
    with raises("ppo.epsilon_high=0.2 with ppo.loss_type=cispo caps every importance weight below 1"):
        load_config(overrides=["ppo.loss_type=cispo", "ppo.epsilon_high=0.2"])
    for key in ("epsilon_high", "sapo_temperature_pos", "sapo_temperature_neg"):
        with raises(f"config key 'ppo.{key}' must be > 0, got 0"):
            load_config(overrides=[f"ppo.{key}=0"])


def test_overlong_penalty_keys():
    assert PPOConfig().overlong_buffer == 0  # off by default
    with raises("config key 'ppo.overlong_buffer' must be >= 0"):
        load_config(overrides=["ppo.overlong_buffer=-1"])
    with raises("ppo.overlong_buffer=9 is longer than ppo.max_new_tokens=8"):
        load_config(overrides=["ppo.max_new_tokens=8", "ppo.overlong_buffer=9"])
    assert load_config(overrides=["ppo.max_new_tokens=8", "ppo.overlong_buffer=8"]).ppo.overlong_buffer == 8


def test_a_lora_policy_takes_the_lora_defaults_for_the_keys_left_unset(tmp_path):
    from rlhfkit.config import ALGO_DEFAULTS, LORA_DEFAULTS, ModelConfig

    assert LORA_DEFAULTS["grpo"] == {"kl_coef": 0.0} and LORA_DEFAULTS["ppo"] == {"forward_kl_coef": 0.0}
    for algo in ALGO_DEFAULTS:
        want = {**ALGO_DEFAULTS[algo], **LORA_DEFAULTS.get(algo, {})}
        ways = [load_config(overrides=[f"ppo.algo={algo}", "model.lora_r=16"]),
                load_config(overrides=["model.lora_r=16", f"ppo.algo={algo}"]),
                Config(model=ModelConfig(lora_r=16), ppo=PPOConfig(algo=algo)),
                Config().replace(ppo={"algo": algo}).replace(model={"lora_r": 16}),
                Config().replace(model={"lora_r": 16}).replace(ppo={"algo": algo})]
        for cfg in ways:
            assert {k: getattr(cfg.ppo, k) for k in want} == want, algo
        # LoRA off again: the algorithm's own defaults come back
        off = ways[0].replace(model={"lora_r": 0}).ppo
        assert (off.kl_coef, off.forward_kl_coef) == (ALGO_DEFAULTS[algo]["kl_coef"], ALGO_DEFAULTS[algo]["forward_kl_coef"])
    # a key the user sets wins, from the command line, a file or Python
    assert load_config(overrides=["ppo.algo=grpo", "model.lora_r=16", "ppo.kl_coef=0.3"]).ppo.kl_coef == 0.3
    assert Config(model=ModelConfig(lora_r=16), ppo=PPOConfig(algo="grpo", kl_coef=0.1)).ppo.kl_coef == 0.1
    (tmp_path / "c.yaml").write_text("model:\n  lora_r: 8\nppo:\n  algo: rloo\n  kl_coef: 0.05\n")
    assert load_config(tmp_path / "c.yaml").ppo.kl_coef == 0.05
    # a saved LoRA run's config.yaml reads back as it was (its resume)
    saved = load_config(overrides=["ppo.algo=grpo", "model.lora_r=16"])
    (tmp_path / "saved.yaml").write_text(dump_config(saved))
    assert load_config(tmp_path / "saved.yaml") == saved and saved.ppo.kl_coef == 0.0


def test_the_critic_is_a_value_head_on_the_policy_unless_a_separate_one_is_configured(tmp_path):
    from rlhfkit.config import ValueConfig

    assert Config().ppo.value_model == "shared" and load_config().ppo.value_model == "shared"
    # each key that configures a separate value model asks for one, from every way in: (its value, unset)
    for key, (value, unset) in {"value.name": ("runs/critic", ""), "value.lora": (True, False),
                                "ppo.value_init": ("policy", None)}.items():
        sec, name = key.split(".")
        ways = [load_config(overrides=[f"{key}={value}"]), Config().replace(**{sec: {name: value}}),
                load_config(overrides=["ppo.value_model=shared"]).replace(**{sec: {name: value}})]
        for cfg in ways:
            assert cfg.ppo.value_model == "separate", key
        # unset again, the default comes back
        assert ways[0].replace(**{sec: {name: unset}}).ppo.value_model == "shared", key
        if sec == "value":  # beside an explicit shared head: a clear error (they name a model to build)
            with raises(f"ppo.value_model=shared puts the value head on the policy, but {key}"):
                load_config(overrides=["ppo.value_model=shared", f"{key}={value}"])
    # ppo.value_init beside a shared head names nothing to load: a config.yaml saved before the head
    # was the default records value_init: reward for a shared run too, and still reads back
    (tmp_path / "old.yaml").write_text("ppo:\n  value_model: shared\n  value_init: reward\n")
    assert load_config(tmp_path / "old.yaml").ppo.value_model == "shared"
    assert Config(value=ValueConfig(name="runs/critic")).ppo.value_model == "separate"
    assert Config(ppo=PPOConfig(value_init="reward")).ppo.value_model == "separate"
    assert load_config(overrides=["ppo.value_model=separate"]).ppo.value_model == "separate"  # explicit, nothing else
    # a saved run's config.yaml reads back as it was (its resume), either way
    for cfg in (Config(), load_config(overrides=["value.name=runs/critic"])):
        (tmp_path / "saved.yaml").write_text(dump_config(cfg))
        assert load_config(tmp_path / "saved.yaml") == cfg


SPEED_KEYS = {"run.threads": 1, "run.malloc": "", "ppo.cuda_graph": True, "ppo.offload": True,
              "ppo.update_off_heap": True, "ppo.reuse_rollout_logprobs": False}


@pytest.mark.parametrize("old", sorted(SPEED_KEYS))
def test_a_speed_key_moved_to_accel_is_refused_by_its_old_name_on_every_route(old, tmp_path):
    """The keys that only make a run faster live in the accel section; their old names stop with
    one line that names the new key, from Python, Config.replace, a YAML file and an override."""
    sec, key = old.split(".")
    new, value = f"accel.{key}", SPEED_KEYS[old]
    section = {"run": Config().run, "ppo": Config().ppo}[sec]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({sec: {key: value}}))
    routes = [lambda: type(section)(**{key: value}), lambda: dataclasses.replace(section, **{key: value}),
              lambda: Config().replace(**{sec: {key: value}}), lambda: from_dict({sec: {key: value}}),
              lambda: load_config(path), lambda: load_config(overrides=[f"{old}={value}"])]
    for route in routes:
        with pytest.raises(ConfigError) as err:
            route()
        assert str(err.value) == (f"config key '{old}' is now '{new}' (a speed setting, in the accel section): "
                                  f"write {new}=... instead")
    assert getattr(load_config(overrides=[f"{new}={value}"]).accel, key) == value  # the new name works


def test_the_ppo_section_is_built_by_concern_and_keeps_flat_keys():
    """PPOConfig is one small dataclass a concern; every key keeps its flat name ppo.<key>, in one group."""
    from rlhfkit.config import key_docs, key_groups

    groups = key_groups()["ppo"]
    headings = [h for h, _, _ in groups]
    assert headings[:3] == ["Batches", "Optimizer", "Sampling"] and {"Loss", "KL", "Guards"} <= set(headings)
    keys = [k for _, _, ks in groups for k in ks]
    assert keys == [f.name for f in dataclasses.fields(PPOConfig)] == list(key_docs()["ppo"])
    assert all(0 < len(about.splitlines()) <= 2 for _, about, _ in groups)  # each concern says what it holds
    assert "temperature" in next(ks for h, _, ks in groups if h == "Sampling")
    assert "kl_coef" in next(ks for h, _, ks in groups if h == "KL")
    assert Config().replace(ppo={"temperature": 0.7}).ppo.temperature == 0.7
    assert [(h, ks) for h, _, ks in key_groups()["run"]] == [("", list(key_docs()["run"]))]  # other sections: one group


def test_every_keys_help_is_one_or_two_lines():
    """Every key has help, and it fits two lines of 100 columns; the details live on the docs pages."""
    import textwrap

    from rlhfkit.config import key_docs

    docs = {f"{sec}.{key}": doc for sec, section in key_docs().items() for key, doc in section.items()}
    assert len(docs) == sum(len(section) for section in Config().to_dict().values())
    long = [key for key, doc in docs.items() if not doc or len(textwrap.wrap(doc, 100)) > 2]
    assert not long, f"keys without help or whose help runs over two lines: {long}"


def test_the_chat_and_lora_keys_are_checked_by_the_range_table():
    """model.lora_r, chat.temperature and chat.max_new_tokens have their ranges in RANGES like every other
    key, so the config reference shows them and their errors read like every range error."""
    from rlhfkit.config import POSITIVE, RANGES

    assert (RANGES["model.lora_r"], RANGES["chat.temperature"], RANGES["chat.max_new_tokens"]) == ((0, None),) * 2 + (
        (1, None),)
    assert "chat.temperature" in POSITIVE and "chat.max_new_tokens" not in POSITIVE
    with raises("config key 'model.lora_r' must be >= 0, got -1"):
        load_config(overrides=["model.lora_r=-1"])
    with raises("config key 'chat.temperature' must be > 0, got 0.0"):
        load_config(overrides=["chat.temperature=0"])
    with raises("config key 'chat.max_new_tokens' must be >= 1, got 0"):
        load_config(overrides=["chat.max_new_tokens=0"])
