"""A value the user sets wins on every route into a config (command line, YAML, YAML + override,
dataclasses, chained ``Config.replace``), and a key left unset follows the algorithm (ppo.algo) and
the policy (model.lora_r): config.ALGO_DEFAULTS, config.LORA_DEFAULTS."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from rlhfkit.config import Config, ModelConfig, PPOConfig, load_config


def _cli(user, write, capsys):
    from rlhfkit.cli.main import main

    assert main(["grpo", "--print-config", "model.lora_r=8", *_overrides(user)]) == 0
    return load_config(write(yaml.safe_load(capsys.readouterr().out)))  # the config the command resolved


def _overrides(user):
    return [f"ppo.{k}={v}" for k, v in user.items()]


LORA, GRPO = ModelConfig(lora_r=8), {"algo": "grpo"}
# Every way of building a config: (build(user, write, capsys), the algorithm and LoRA it ends on),
# the user giving the ppo keys ``user`` at some point (``write``: a YAML file of a dict).
ROUTES = {
    "overrides": (lambda user, write, _: load_config(overrides=["ppo.algo=grpo", *_overrides(user), "model.lora_r=8"]),
                  "grpo", True),
    "overrides, LoRA first": (lambda user, write, _: load_config(
        overrides=["model.lora_r=8", *_overrides(user), "ppo.algo=grpo"]), "grpo", True),
    "command line": (_cli, "grpo", True),
    "yaml": (lambda user, write, _: load_config(write({"model": {"lora_r": 8}, "ppo": {**GRPO, **user}})), "grpo", True),
    "yaml + override on": (lambda user, write, _: load_config(write({"ppo": {**GRPO, **user}}), ["model.lora_r=8"]),
                           "grpo", True),
    "yaml + override off": (lambda user, write, _: load_config(
        write({"model": {"lora_r": 8}, "ppo": {**GRPO, **user}}), ["model.lora_r=0"]), "grpo", False),
    "dataclasses": (lambda user, write, _: Config(model=LORA, ppo=PPOConfig(**GRPO, **user)), "grpo", True),
    "dataclasses.replace on": (lambda user, write, _: dataclasses.replace(
        Config(ppo=PPOConfig(**GRPO, **user)), model=LORA), "grpo", True),
    "dataclasses.replace off": (lambda user, write, _: dataclasses.replace(
        Config(model=LORA, ppo=PPOConfig(**GRPO, **user)), model=ModelConfig()), "grpo", False),
    "replace, LoRA on after": (lambda user, write, _: Config().replace(ppo={**GRPO, **user}).replace(model={"lora_r": 8}),
                               "grpo", True),
    "replace, LoRA off after": (lambda user, write, _: Config().replace(model={"lora_r": 8}).replace(
        ppo={**GRPO, **user}).replace(model={"lora_r": 0}), "grpo", False),
    "replace, another key between": (lambda user, write, _: Config().replace(ppo={**GRPO, **user}).replace(
        run={"seed": 1}).replace(model={"lora_r": 8}), "grpo", True),
    "replace, algo changed after": (lambda user, write, _: Config().replace(ppo={"algo": "rloo", **user}).replace(
        model={"lora_r": 8}).replace(ppo=GRPO), "grpo", True),
    "replace, back to ppo": (lambda user, write, _: Config().replace(model={"lora_r": 8}, ppo={**GRPO, **user}).replace(
        ppo={"algo": "ppo"}), "ppo", True),
    "replace, back to ppo, LoRA off": (lambda user, write, _: Config().replace(model={"lora_r": 8}, ppo={
        **GRPO, **user}).replace(ppo={"algo": "ppo"}).replace(model={"lora_r": 0}), "ppo", False),
    "base + override": (lambda user, write, _: load_config(
        base=Config().replace(ppo={**GRPO, **user}), overrides=["model.lora_r=8"]), "grpo", True),
}


@pytest.mark.parametrize("user", [{}, {"kl_coef": 0.1}, {"kl_coef": 0.1, "group_size": 6}], ids=["unset", "kl", "kl+group"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_value_the_user_set_wins_on_every_route_and_an_unset_one_follows_the_defaults(route, user, tmp_path, capsys):
    from rlhfkit.config import ALGO_DEFAULTS, ALGO_KEYS, LORA_DEFAULTS

    def write(data):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    build, algo, lora = ROUTES[route]
    cfg = build(user, write, capsys)
    assert (cfg.ppo.algo, bool(cfg.model.lora_r)) == (algo, lora)
    want = {**ALGO_DEFAULTS[algo], **(LORA_DEFAULTS[algo] if lora else {}), **user}
    assert {k: getattr(cfg.ppo, k) for k in ALGO_KEYS} == {k: want[k] for k in ALGO_KEYS}
    # by hand: beta 0.3 for grpo, 0 with LoRA, 0.2 for ppo; ppo's forward-KL term 0.1, 0 with LoRA; the user's 0.1 stays
    assert cfg.ppo.kl_coef == (0.1 if user else {"grpo": 0.0 if lora else 0.3, "ppo": 0.2}[algo])
    if algo == "ppo":
        assert cfg.ppo.forward_kl_coef == (0.0 if lora else 0.1)


def test_a_later_replace_that_toggles_lora_keeps_the_users_beta():
    assert Config().replace(ppo={"algo": "grpo", "kl_coef": 0.1}).replace(model={"lora_r": 8}).ppo.kl_coef == 0.1
    lora = Config().replace(model={"lora_r": 8}).replace(ppo={"algo": "grpo", "kl_coef": 0.2})
    assert lora.replace(model={"lora_r": 0}).ppo.kl_coef == 0.2
    # null gives the key back to the algorithm and the policy
    assert lora.replace(ppo={"kl_coef": None}).ppo.kl_coef == 0.0
    assert load_config(base=lora, overrides=["ppo.kl_coef=null", "model.lora_r=0"]).ppo.kl_coef == 0.3
