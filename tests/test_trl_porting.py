"""Porting from TRL: its key names answered with rlhfkit's (config.TRL_KEYS), the porting table of
docs/ppo_walkthrough.md (section 10) rendered from the same rows, and the warning TRL gives for a
sequence-level ratio under a loss that sums tokens."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from rlhfkit.config import TRL_KEYS, Config, ConfigError, PPOConfig, from_dict, load_config

WALKTHROUGH = Path(__file__).resolve().parents[1] / "docs" / "ppo_walkthrough.md"
TRL_CONFIGS = {"ppo": "GRPO, RLOO", "dpo": "DPO", "sft": "SFT"}  # the TRL configs each section takes over


def trl_keys_table() -> str:
    """The markdown table of docs/ppo_walkthrough.md's "TRL's key names", one row per TRL_KEYS entry."""
    rows = ["| TRL config | TRL key | rlhfkit key | what differs |", "|---|---|---|---|"]
    for sec, names in TRL_KEYS.items():
        for name, (key, note) in names.items():
            rows.append(f"| {TRL_CONFIGS[sec]} | `{name}` | {f'`{key}`' if key else 'none'} | {note} |")
    return "\n".join(rows)


def test_the_walkthrough_shows_every_trl_key_as_the_mapping_gives_it():
    assert trl_keys_table() in WALKTHROUGH.read_text(encoding="utf-8"), (
        "docs/ppo_walkthrough.md, section 10: replace the table under \"TRL's key names\" with\n" + trl_keys_table())


def test_every_trl_name_maps_to_a_real_key_and_the_asked_ones_are_there():
    keys = {f"{sec}.{k}" for sec, values in Config().to_dict().items() for k in values}
    for sec, names in TRL_KEYS.items():
        assert sec in TRL_CONFIGS
        for name, (key, note) in names.items():
            assert key == "" or key in keys, (sec, name, key)
            assert note and not note.endswith("."), (sec, name)
    asked = {"learning_rate", "num_generations", "num_iterations", "temperature", "max_prompt_length",
             "max_completion_length", "beta", "epsilon", "per_device_train_batch_size",
             "gradient_accumulation_steps", "lr_scheduler_type", "warmup_ratio"}
    assert asked <= set(TRL_KEYS["ppo"])


@pytest.mark.parametrize("given, says", [
    ("ppo.num_generations=8", "unknown config key 'ppo.num_generations'. TRL's num_generations is ppo.group_size here: "),
    ("num_generations=8", "unknown config key 'num_generations': keys are written section.key. TRL's num_generations "
                          "is ppo.group_size here: "),
    ("ppo.beta=0.04", "TRL's beta is ppo.kl_coef here: "),
    ("beta=0.04", "TRL's beta is ppo.kl_coef here: "),  # no command: the RL section comes first
    ("ppo.learning_rate=1e-6", "TRL's learning_rate is ppo.lr here: "),
    ("ppo.num_iterations=1", "TRL's num_iterations is ppo.ppo_epochs here: "),
    ("ppo.epsilon=0.2", "TRL's epsilon is ppo.clip_range here: "),
    ("ppo.max_completion_length=64", "TRL's max_completion_length is ppo.max_new_tokens here: "),
    ("ppo.max_prompt_length=64", "TRL's max_prompt_length is data.max_prompt_length here: "),
    ("ppo.per_device_train_batch_size=4", "TRL's per_device_train_batch_size is ppo.micro_batch_size here: "),
    ("ppo.lr_scheduler_type=linear", "TRL's lr_scheduler_type is ppo.lr_schedule here: "),
    ("dpo.warmup_ratio=0.1", "TRL's warmup_ratio has no rlhfkit key: "),
    ("dpo.learning_rate=1e-6", "TRL's learning_rate is dpo.lr here: "),
    ("sft.warmup_ratio=0.1", "TRL's warmup_ratio is sft.warmup_steps here: "),
    ("sft.packing=true", "TRL's packing is data.packing here: "),
])
def test_a_trl_key_name_is_answered_with_the_rlhfkit_key(given, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as error:
        load_config(overrides=[given])
    assert "\n" not in str(error.value) and str(error.value).endswith(".")


def test_the_trl_hint_follows_the_command_and_every_way_in(tmp_path, capsys):
    from rlhfkit.cli.main import main

    for command, says in (("grpo", "TRL's beta is ppo.kl_coef here"), ("dpo", "Did you mean 'dpo.beta'?"),
                          ("sft", "TRL's learning_rate is sft.lr here")):
        name = "learning_rate" if command == "sft" else "beta"
        assert main([command, "--print-config", f"{name}=0.1"]) == 2
        assert says in capsys.readouterr().err
    assert main(["ppo", "ppo.beta=0.1"]) == 2  # another section's key of that name (dpo.beta) is not TRL's meaning
    assert "TRL's beta is ppo.kl_coef here" in capsys.readouterr().err
    # a YAML file, a flat one as TRL writes them, from_dict and Config.replace
    (tmp_path / "trl.yaml").write_text("ppo:\n  num_generations: 8\n")
    with pytest.raises(ConfigError, match="TRL's num_generations is ppo.group_size here"):
        load_config(tmp_path / "trl.yaml")
    (tmp_path / "flat.yaml").write_text("num_generations: 8\n")
    with pytest.raises(ConfigError, match="unknown config section 'num_generations' in .*TRL's num_generations is "
                                          "ppo.group_size here"):
        load_config(tmp_path / "flat.yaml")
    with pytest.raises(ConfigError, match="unknown config key 'ppo.num_generations'. TRL's num_generations"):
        from_dict({"ppo": {"num_generations": 8}})
    with pytest.raises(ConfigError, match="TRL's beta is ppo.kl_coef here"):
        Config().replace(ppo={"beta": 0.1})
    # rlhfkit's own keys keep their suggestions
    with pytest.raises(ConfigError, match=re.escape("Did you mean 'ppo.steps'?")):
        load_config(overrides=["ppo.stepz=3"])
    with pytest.raises(ConfigError, match=re.escape("Did you mean ppo.temperature, chat.temperature?")):
        load_config(overrides=["temperature=1.0"])


@pytest.mark.parametrize("level, loss_type, warns", [
    ("sequence", "token_mean", True), ("sequence", "dapo", True), ("sequence", "dr_grpo", True),
    ("sequence_token", "cispo", True), ("sequence", "grpo", False), ("sequence", "sapo", False),
    ("token", "token_mean", False)])
def test_a_sequence_ratio_under_a_loss_that_sums_tokens_warns_once(level, loss_type, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: a warning once per message
        for _ in range(3):
            load_config(overrides=[f"ppo.importance_sampling_level={level}", f"ppo.loss_type={loss_type}"])
    said = [str(w.message) for w in caught if "importance_sampling_level" in str(w.message)]
    assert said == ([f"ppo.importance_sampling_level={level} with ppo.loss_type={loss_type} sums the sequence's ratio "
                     "over its tokens, so each sequence weighs as much as it is long, not GSPO's per-sequence "
                     "objective; GSPO's setup is ppo.loss_type=grpo"] if warns else [])
    assert PPOConfig().importance_sampling_level == "token"  # the defaults say nothing


def test_rloos_per_token_ratio_has_trls_per_sequence_gradient_over_the_mean_length():
    """TRL's RLOO: loss = mean_i -A_i * exp(sum_t logp - sum_t old) (one ratio per sequence, clipped);
    rlhfkit's per-token ratio under token_mean: sum_it -A_i * exp(logp_t - old_t) / sum_i T_i. On-policy
    the gradients are sum_it A_i grad logp_t over N and over sum_i T_i: the ratio is N / sum_i T_i."""
    from rlhfkit.core import policy_loss

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)  # lengths 3, 5, 1
    logp = (-torch.rand(3, 5, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64)
    ours = torch.autograd.grad(policy_loss(logp, logp.detach(), adv, mask, 0.2)[0], logp)[0]
    seq_ratio = torch.exp(((logp - logp.detach()) * mask).sum(-1, keepdim=True))  # [B, 1]
    trl = torch.autograd.grad((-torch.min(seq_ratio * adv, seq_ratio.clamp(0.8, 1.2) * adv)).mean(), logp)[0]
    assert torch.allclose(ours, trl * mask * 3 / 9)  # N / sum T = 3 / 9: the mean length is 3


def test_trls_bias_corrected_k3_has_k2s_gradient_on_policy():
    """TRL's GRPO (use_bias_correction_kl=True): kl = k3 * exp(logp - sg[logp]). Its gradient is
    grad(k3) + k3 * grad(logp) = (1 - r + r - 1 - log r) grad(logp) = -log r grad(logp), which is
    grad(k2) = grad((log r)^2 / 2) = -log r grad(logp): port it as ppo.kl_estimator=k2."""
    from rlhfkit.core import kl_estimate

    logp = torch.tensor([-0.3, -2.0, -1.1], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.9, -1.2, -1.1], dtype=torch.float64)
    def grad(loss):
        return torch.autograd.grad(loss.sum(), logp)[0]

    trl = grad(kl_estimate(logp, ref, "k3") * torch.exp(logp - logp.detach()))
    assert torch.allclose(trl, grad(kl_estimate(logp, ref, "k2")))
    assert not torch.allclose(trl, grad(kl_estimate(logp, ref, "k3")))  # not rlhfkit's k3 term
