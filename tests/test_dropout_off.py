"""RL compares two forwards of one policy (the sampler's and the update's), so every dropout of
every role must be off: the adapter's (``model.lora_dropout``), the model's own modules and the
probabilities its config hands to functional dropout (Llama's ``attention_dropout``), for the
policy, the reference, the critic (``value.lora`` too) and the reward model.

Checked on checkpoints saved with their dropouts on (GPT-2 with the hub's 0.1 everywhere, a
Llama with ``attention_dropout=0.1``), through ``build_models`` and the loop's own steps:
the sampler's log-probs equal the training forward's, the first minibatch of every rollout
has ratio 1 (also after optimizer steps, once the adapter is no longer zero), at lr = 0 the
ratio stays 1 over every minibatch, and a value model gives the same values twice.
SFT and reward-model training keep the adapter's dropout: one forward per loss term. DPO turns
it off too by default (``dpo.disable_dropout``, TRL's ``disable_dropout=True``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import rlhfkit.rollout.rewards
from hf_helpers import chat_tokenizer
from rlhfkit.config import Config, regime_value
from rlhfkit.models.forward import build_tiny, eval_mode, is_lora, policy_with_reference
from rlhfkit.rollout.experience import make_experience
from rlhfkit.rollout.generate import generate
from rlhfkit.trainers.rl import ppo_update
from rlhfkit.trainers.rl_setup import build_models, make_optimizer

CPU = torch.device("cpu")
PROMPTS = ["数字:1234x2=", "Where is Pune?", "大写:77x2=", "小写:505x2="]
DROPOUT_NAMES = ("dropout", "pdrop", "layerdrop", "jitter")
# what each architecture's config turns on, as hub checkpoints do (GPT-2 ships 0.1 everywhere)
DROPOUTS = {"gpt2": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
            "llama": {"attention_dropout": 0.1}}


def active_dropouts(model: nn.Module) -> list[str]:
    """Every dropout of ``model`` that would act in train mode: dropout modules with p > 0,
    and dropout probabilities > 0 kept as module or config attributes (peft's config too)."""
    found, configs = [], []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)) and m.p > 0:
            found.append(f"{name}.p")
        configs.append(getattr(m, "config", None))
        found += [f"{name}.{k}" for k, v in vars(m).items()
                  if any(d in k for d in DROPOUT_NAMES) and isinstance(v, float) and v > 0]
    configs += list(getattr(model, "peft_config", {}).values())
    for cfg in configs:
        if cfg is not None:
            found += [f"config.{k}" for k, v in vars(cfg).items()
                      if any(d in k for d in DROPOUT_NAMES) and isinstance(v, float) and v > 0]
    return found


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Policies and a reward model saved with their dropouts on."""
    root, tok = tmp_path_factory.mktemp("dropout_hub"), chat_tokenizer()
    paths = {}
    for i, arch in enumerate(DROPOUTS):
        for scalar in (False, True):
            model = build_tiny(arch, tok, seed=i, scalar=scalar)
            for key, p in DROPOUTS[arch].items():
                setattr(model.config, key, p)
            if scalar:  # scores spread apart, so group advantages are not zero and the policy moves
                gen = torch.Generator().manual_seed(i)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5 * torch.randn(p.shape, generator=gen))
            path = root / f"{arch}{'_rm' if scalar else ''}"
            model.save_pretrained(path)
            tok.save_pretrained(path)
            paths[arch, scalar] = str(path)
    # the checkpoints really do carry dropout: loaded plainly, it is there
    from rlhfkit.models.forward import load_policy

    assert all(active_dropouts(load_policy(paths[arch, False])) for arch in DROPOUTS)
    return paths


def rl_config(hub, arch: str, tmp_path, model=(), ppo=(), value=()) -> Config:
    return Config().replace(
        run={"out_dir": str(tmp_path), "progress": False}, accel={"threads": 1},
        model={"name": hub[arch, False], **dict(model)},
        reward={"name": hub[arch, True]},
        ppo={"algo": "grpo", "kl_in_loss": True, "kl_estimator": "k3", "group_size": 4, "batch_size": 16,
             "minibatch_size": 4, "ppo_epochs": 2, "lr": 1e-2, "max_new_tokens": 6, "critic_warmup_steps": 0,
             "value_init": "policy", **dict(ppo)},
        value=dict(value))


def build(cfg: Config, monkeypatch):
    """``build_models``, keeping hold of the reward model it loads."""
    loaded = []

    def recording(*args, **kwargs):
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    load = rlhfkit.rollout.rewards.load_scalar_model
    monkeypatch.setattr(rlhfkit.rollout.rewards, "load_scalar_model", recording)
    ac, ref, scorer, tok = build_models(cfg, cfg.model.name, CPU)
    assert len(loaded) == 1
    return ac, ref, scorer, tok, loaded[0]


def rl_steps(cfg: Config, ac, ref, scorer, tok, steps: int, lr: float | None = None):
    """The loop's steps (rollout in eval mode, experience, update) with one optimizer (every
    learning rate ``lr`` when given: the config refuses 0); yields ``(experience stats,
    per-minibatch stats)`` of each step."""
    pc = cfg.ppo
    # the learning rates train_rl gives these models, which rlhfkit built from scratch
    opt = make_optimizer(ac, dataclasses.replace(pc, lr=regime_value(cfg, "ppo.lr", "scratch"),
                                                 value_lr=regime_value(cfg, "ppo.value_lr", "scratch")))
    for group in opt.param_groups if lr is not None else []:
        group["lr"] = lr
    texts = [t for t in PROMPTS for _ in range(pc.group_size)]
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    for step in range(steps):
        with eval_mode(ac.policy):
            roll = generate(ac.policy, enc["input_ids"], enc["attention_mask"], pc.max_new_tokens, tok.eos_token_id,
                            tok.pad_token_id, pc.temperature, generator=torch.Generator().manual_seed(step),
                            value_head=ac.value_head)
        exp, stats = make_experience(ac, ref, scorer, roll, pc, pc.kl_coef)
        mb = ppo_update(ac, opt, exp, pc, pc.kl_coef, generator=torch.Generator().manual_seed(step),
                        logprob_gap="policy/logprob_gap" not in stats)
        yield stats, mb


def assert_ratio_one(stats: dict, mb: list[dict], every_minibatch: bool = False):
    gap = float(stats.get("policy/logprob_gap", mb[0].get("policy/logprob_gap", float("nan"))))
    assert gap <= 1e-5, f"the sampler's and the training forward's log-probs differ by {gap}"
    for s in mb if every_minibatch else mb[:1]:
        assert s["policy/approx_kl"].item() < 1e-7 and s["policy/clipfrac"].item() == 0.0, s


def assert_no_dropout(ac, ref, rm):
    roles = {"policy": ac.policy, "critic": ac.critic, "reward model": rm,
             "reference": getattr(ref, "peft_model", ref)}
    for role, model in roles.items():
        if model is not None:
            assert active_dropouts(model) == [], f"{role}: {active_dropouts(model)}"


def test_lora_with_dropout_keeps_ratio_one_over_rollouts(hub, tmp_path, monkeypatch):
    """GPT-2 (config dropouts 0.1) with a LoRA adapter at model.lora_dropout=0.3: the adapter is
    zero at the first rollout, where its dropout cannot show; from the second on it is not."""
    cfg = rl_config(hub, "gpt2", tmp_path, model={"lora_r": 4, "lora_dropout": 0.3})
    ac, ref, scorer, tok, rm = build(cfg, monkeypatch)
    assert is_lora(ac.policy)
    assert_no_dropout(ac, ref, rm)
    for step, (stats, mb) in enumerate(rl_steps(cfg, ac, ref, scorer, tok, steps=3)):
        assert_ratio_one(stats, mb)
        if step == 0:  # the update moved the adapter off zero: the later checks are real
            lora_b = [p for n, p in ac.policy.named_parameters() if "lora_B" in n]
            assert max(p.abs().max().item() for p in lora_b) > 1e-3


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("lr", [0.0, 1e-2], ids=["lr0", "lr1e-2"])
def test_llama_attention_dropout_with_checkpointing_keeps_ratio_one(hub, tmp_path, monkeypatch, lr, lora):
    """A Llama config's attention_dropout is functional dropout (no module to find), and gradient
    checkpointing sends the training forward through Hugging Face's code in train mode."""
    cfg = rl_config(hub, "llama", tmp_path, model={"gradient_checkpointing": True, "lora_r": lora,
                                                   "lora_dropout": 0.3})
    ac, ref, scorer, tok, rm = build(cfg, monkeypatch)
    assert_no_dropout(ac, ref, rm)
    for stats, mb in rl_steps(cfg, ac, ref, scorer, tok, steps=3, lr=lr):
        assert_ratio_one(stats, mb, every_minibatch=lr == 0.0)


@pytest.mark.parametrize("arch", list(DROPOUTS))
def test_lora_value_model_gives_the_same_values_twice(hub, tmp_path, monkeypatch, arch):
    """PPO's separate critic through its own LoRA adapter (value.lora) at lora_dropout=0.3."""
    cfg = rl_config(hub, arch, tmp_path, model={"lora_r": 4, "lora_dropout": 0.3,
                                                "gradient_checkpointing": arch == "llama"},
                    ppo={"algo": "ppo", "kl_in_loss": False, "kl_estimator": "k1"}, value={"lora": True})
    ac, ref, scorer, tok, rm = build(cfg, monkeypatch)
    assert is_lora(ac.critic) and ac.critic.training
    assert_no_dropout(ac, ref, rm)
    with torch.no_grad():  # a non-zero adapter, so its dropout would show
        for n, p in ac.critic.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.5)
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    P = enc["input_ids"].shape[1] - 3
    first = ac.critic_values(enc["input_ids"], enc["attention_mask"], P)
    second = ac.critic_values(enc["input_ids"], enc["attention_mask"], P)
    assert torch.equal(first, second)
    for stats, mb in rl_steps(cfg, ac, ref, scorer, tok, steps=2):
        assert_ratio_one(stats, mb)


def test_sft_keeps_the_adapter_dropout(hub):
    """Outside RL the adapter's dropout is regularisation, as model.lora_dropout says; the
    model's own dropouts are off there too."""
    mc = dataclasses.replace(Config().model, lora_r=4, lora_dropout=0.3)
    policy, _ = policy_with_reference(hub["llama", False], mc, CPU, reference=False)
    found = active_dropouts(policy)
    assert found and all("lora_dropout" in name for name in found), found


@pytest.mark.parametrize("disable", [True, False])
def test_dpo_turns_the_adapter_dropout_off_unless_asked(disable, tiny_models, tiny_config, tmp_path, monkeypatch):
    """dpo.disable_dropout (default True, TRL's disable_dropout): the policy DPO trains has no
    dropout left, the LoRA adapter's included; False keeps model.lora_dropout on the adapter."""
    import rlhfkit.trainers.dpo as dpo

    built = []

    def spy(*args, **kwargs):
        policy, ref = policy_with_reference(*args, **kwargs)
        built.append(policy)
        return policy, ref

    monkeypatch.setattr(dpo, "policy_with_reference", spy)
    cfg = tiny_config(tmp_path, model={"name": tiny_models.policy, "lora_r": 4, "lora_dropout": 0.3},
                      dpo={"steps": 1, "disable_dropout": disable})
    assert Config().dpo.disable_dropout
    dpo.train_dpo(cfg)
    found = active_dropouts(built[0])
    if disable:
        assert found == []
    else:
        assert found and all("lora_dropout" in name for name in found), found
