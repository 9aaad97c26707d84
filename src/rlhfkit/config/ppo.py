"""The RL commands' ``ppo`` section, one small dataclass per concern, every key named ``ppo.<key>``; each key
in detail, beside TRL's, OpenRLHF's and DeepSpeed-Chat's: docs/algorithms/ppo.md and grpo.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

from .base import ConfigError, Section, key

# The keys that depend on ppo.algo: one left unset (None) takes its algorithm's value (LORA_DEFAULTS' with
# model.lora_r > 0) and follows later changes of either; one the user set keeps it. Why: docs/algorithms/.
ALGO_KEYS = ("group_size", "kl_coef", "kl_estimator", "kl_in_loss", "normalize_reward", "forward_kl_coef")
_CRITIC_FREE = {"normalize_reward": False, "kl_in_loss": True, "kl_estimator": "k3", "kl_coef": 0.3,
                "group_size": 4, "forward_kl_coef": 0.0}
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {"algo": "ppo", "normalize_reward": True, "kl_in_loss": False, "kl_estimator": "k1", "kl_coef": 0.2,
            "group_size": 8, "forward_kl_coef": 0.1},
    "grpo": {"algo": "grpo", **_CRITIC_FREE},
    "rloo": {"algo": "rloo", **_CRITIC_FREE},
    "reinforce": {"algo": "reinforce", **_CRITIC_FREE, "group_size": 8},  # unused (ppo.samples_per_prompt)
}
# a LoRA policy: no KL term for the critic-free commands, no forward-KL term for ppo (docs/real-models.md)
LORA_DEFAULTS: dict[str, dict[str, Any]] = {**{algo: {"kl_coef": 0.0} for algo in ("grpo", "rloo", "reinforce")},
                                            "ppo": {"forward_kl_coef": 0.0}}
# the loss types that reduce each sequence to its token mean first: a sequence-level ratio then weighs
# every sequence alike, as GSPO's objective does
PER_SEQUENCE_LOSSES = ("grpo", "sapo")


@dataclass(frozen=True)
class PPOBatches:
    """What runs and on how many rows: the algorithm, the rollout, its minibatches and passes."""
    algo: Literal["ppo", "grpo", "rloo", "reinforce"] = key("ppo", "Advantage estimator: 'ppo' (critic + GAE), "
        "'grpo' (group-relative), 'rloo' (leave-one-out), 'reinforce' (batch-mean baseline). Set by the command "
        "(rlhfkit ppo/grpo/rloo/reinforce).")
    steps: int = key(200, "Rollout + update iterations (upper bound; see stop_at).")
    batch_size: int = key(64, "Completions per rollout (prompts x group_size for grpo/rloo).")
    group_size: int = key(None, "Completions per prompt for grpo/rloo (unset: config.ALGO_DEFAULTS).")
    samples_per_prompt: int = key(1, "Completions per prompt for ppo/reinforce, in consecutive rows.")
    minibatch_size: int = key(32, "Sequences per optimizer step.")
    micro_batch_size: int = key(0, "Sequences per forward and backward pass, per process; the gradient equals the "
        "whole minibatch's (0 = the whole minibatch at once).")
    ppo_epochs: int = key(2, "Passes over each rollout (TRL's num_iterations).")
    minibatch_draw: Literal["epoch", "rollout"] = key("epoch", "How a rollout's rows (groups or prompts) "
        "are dealt into minibatches: anew every 'epoch', or once per 'rollout' (TRL's GRPOTrainer).")


@dataclass(frozen=True)
class PPOOptimizer:
    """The AdamW learning rates, their schedule and the gradient clip."""
    lr: float | None = key(None, "Actor learning rate (AdamW). Unset: by model.regime (config.REGIME_DEFAULTS).")
    value_lr: float | None = key(None, "Critic learning rate. Unset: by model.regime, ten times the actor's.")
    lr_schedule: Literal["constant", "linear", "cosine"] = key("constant", "Both learning rates after the warm-up "
        "over ppo.steps: constant, linear decay to 0 (TRL's default) or cosine to 0.")
    warmup_steps: int = key(0, "Linear warm-up of both learning rates over the first this many steps (0 = none).")
    warmup_ratio: float = key(0.0, "Warm-up as a share of ppo.steps (rounded up); or ppo.warmup_steps.")
    max_grad_norm: float = key(1.0, "Gradient-norm clip, per model.")


@dataclass(frozen=True)
class PPOSampling:
    """How the rollout draws responses, and what its log-probs are used for."""
    max_new_tokens: int | None = key(None, "Longest response sampled (None: the built-in task's longest answer; "
        "required with data.path).")
    temperature: float = key(1.0, "Sampling temperature (log-probs are taken under the same temperature).")
    top_k: int = key(0, "Sample each token from the top_k most likely ones only (0 = off); the samples are then "
        "off-policy (see sampling_correction).")
    top_p: float = key(1.0, "Nucleus sampling: the smallest set of most likely tokens holding top_p of the "
        "probability (after top_k); 1.0 = off.")
    min_p: float = key(0.0, "Keep tokens at least min_p times the top one's probability (MinP); 0 = off.")
    repetition_penalty: float = key(1.0, "transformers' repetition penalty on tokens already in the prompt or "
        "response; 1.0 = off, > 1 discourages repeats.")
    sampling_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                 "sequence_mask"] = key("none", "With top_k / top_p / min_p / "
        "repetition_penalty: weigh each token's policy loss by pi_old / q per token or sequence, capped or masked "
        "at sampling_correction_cap (TRL's mode names).")
    sampling_correction_cap: float = key(2.0, "The cap of ppo.sampling_correction's weights (TRL's "
        "vllm_importance_sampling_clip_max).")
    stop: tuple[str, ...] = key((), "Stop strings, a YAML list: a response ends, as at EOS, once its new text "
        "contains one (the held-out evaluation uses them too). Empty = none.")


@dataclass(frozen=True)
class PPORewards:
    """How a response's scores become the advantages' input: scaling, normalising, penalties, filters."""
    scale_rewards: Literal["group", "batch", "advantages", "none"] = key("batch", "grpo, rloo, reinforce: divide "
        "the centred scores by the std of the prompt's 'group', of the 'batch', of the 'advantages' themselves, "
        "or by nothing ('none').")
    normalize_reward: bool = key(None, "Normalise scores with running mean/std before clipping; unset: true for "
        "ppo, false for the others (config.ALGO_DEFAULTS).")
    score_clip: float = key(5.0, "Clip the reward score to +-score_clip, before any group or batch statistic.")
    missing_eos_penalty: float = key(0.0, "Subtracted from the score of responses that never emit EOS (0 = off).")
    overlong_buffer: int = key(0, "DAPO's soft over-long punishment over the last this many tokens before "
        "max_new_tokens (0 = off).")
    overlong_penalty: float = key(1.0, "The over-long penalty at max_new_tokens, in the reward's units (DAPO: 1).")
    filter_zero_std_groups: bool = key(False, "grpo, rloo: leave groups whose scores are all equal out of the "
        "update (DAPO's dynamic filtering, without resampling). One process only.")
    mask_truncated_completions: bool = key(False, "Leave completions cut at max_new_tokens out of the losses; "
        "they still count in the baselines (TRL's option). One process only.")


@dataclass(frozen=True)
class PPOKL:
    """The penalty that keeps the policy near the reference: its weight, estimator and placement."""
    kl_coef: float = key(None, "beta, the weight of the KL penalty (TRL's beta). Unset: by algorithm and LoRA "
        "(config.ALGO_DEFAULTS, config.LORA_DEFAULTS).")
    kl_estimator: Literal["k1", "k2", "k3"] = key(None, "Per-token KL estimator: k1 = -log r, k2 = (log r)^2 / 2, "
        "k3 = r - 1 - log r, with log r = log ref - log pi. Unset: k1 for ppo, k3 for the others.")
    kl_in_loss: bool = key(None, "Put the KL penalty in the loss (needs k2 or k3) instead of the reward. Unset: "
        "false for ppo, true for the others.")
    forward_kl_coef: float = key(None, "With the KL in the reward, the weight of a k3 loss term beside it (the "
        "forward KL). Unset: 0.1 for ppo, else 0.")
    adaptive_kl: bool = key(False, "Adapt beta with the proportional controller towards kl_target.")
    kl_target: float = key(0.5, "Target per-sequence KL of the adaptive controller.")
    kl_horizon: int = key(10000, "Horizon (in samples) of the adaptive controller.")


@dataclass(frozen=True)
class PPOLoss:
    """The policy loss: its reduction, ratio, clip and entropy bonus."""
    loss_type: Literal["token_mean", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = key("token_mean", "How "
        "every per-token loss is reduced over a minibatch (TRL's names); 'cispo' and 'sapo' also change the "
        "policy loss.")
    clip_range: float = key(0.2, "PPO ratio clip epsilon.")
    epsilon_high: float | None = key(None, "The ratio's upper clip 1 + epsilon_high (unset: clip_range; DAPO: "
        "0.28); with loss_type=cispo the largest importance weight (unset: 5.0).")
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = key("token", "The policy loss's "
        "ratio: per 'token' (PPO), per 'sequence' (GSPO), or GSPO's value with per-token gradients "
        "('sequence_token').")
    sapo_temperature_pos: float = key(1.0, "loss_type=sapo: the gate's temperature on tokens with a positive "
        "advantage (TRL's default).")
    sapo_temperature_neg: float = key(1.05, "loss_type=sapo: the gate's temperature on tokens with a zero or "
        "negative advantage (TRL's default).")
    entropy_coef: float = key(0.0, "Entropy bonus weight, reduced by ppo.loss_type as every per-token loss.")


@dataclass(frozen=True)
class PPOCritic:
    """ppo's critic and advantages: which value model, GAE, whitening, the value loss."""
    value_model: Literal["separate", "shared"] | None = key(None, "'shared': a value head on the actor (unset: "
        "the default); 'separate': a value model of its own (unset: when value.name, value.lora or ppo.value_init "
        "is set).")
    value_init: Literal["reward", "policy"] | None = key(None, "A separate value model's start: the reward model "
        "('reward'; unset: it, or the policy without reward.name) or the policy ('policy'); value.name overrides "
        "both.")
    gamma: float = key(1.0, "Discount.")
    lam: float = key(0.95, "GAE lambda.")
    whiten_advantages: bool = key(True, "Whiten the GAE advantages over every process's response tokens.")
    vf_coef: float = key(0.5, "Weight of the value loss.")
    value_clip_range: float | None = key(None, "Value clip around the rollout-time values; None disables it.")
    critic_warmup_steps: int = key(3, "Initial steps that update only the critic.")


@dataclass(frozen=True)
class PPOEvaluation:
    """When the held-out evaluation runs, and the metric that stops the run and picks the best."""
    eval_every: int = key(5, "Greedy evaluation on the held-out set every N steps (0 = only at the end).")
    stop_at: float = key(0.99, "Stop once the held-out metric ppo.stop_metric reaches this (0 = run all steps).")
    stop_metric: str = key("", "Held-out metric for stop_at, keep_best and the eval-drop watch (empty: the first "
        "of eval/exact_acc, eval/accuracy, eval/reward the evaluation logs).")
    keep_best: bool = key(False, "Save the policy (and critic) at the best stop metric, not the last step's.")


@dataclass(frozen=True)
class PPOGuards:
    """The reward-hacking watch (rlhfkit.run.watch): each flags a guard/* metric; 0 turns it off."""
    guard_kl: float = key(1.5, "Flag guard/kl_high when the KL per response token exceeds this many nats while "
        "ppo.stop_metric has fallen below its best.")
    guard_eos: float = key(0.5, "Flag guard/eos_collapse at an EOS rate below this share of its early mean.")
    guard_eval_drop: float = key(0.15, "Flag guard/eval_drop when ppo.stop_metric falls more than this share "
        "below its best.")
    guard_tradeoff: float = key(0.3, "Flag guard/reward_tradeoff when one reward source falls more than this "
        "share while the total rose.")


@dataclass(frozen=True)
class PPOLogging:
    """What each step writes beside its metrics: samples and per-token trajectories."""
    samples_per_log: int = key(4, "Generations saved to samples.jsonl per step.")
    trajectories_every: int = key(10, "Save per-token trajectories to trajectories.jsonl at the first, every N-th "
        "and the last step, for ``rlhfkit report`` (0 = never).")
    trajectories_per_step: int = key(2, "Rows saved each time, spread over the score ranks.")


@dataclass(frozen=True)
class PPOConfig(PPOLogging, PPOGuards, PPOEvaluation, PPOCritic, PPOLoss, PPOKL, PPORewards, PPOSampling,
                PPOOptimizer, PPOBatches, Section):
    """The RL commands' settings, one base a concern; fields run last base first (PPOBatches' first)."""

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # the key was a bool before it had three values
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        # the keys left unset: Config resolves them for its policy, Config.replace keeps them unset
        object.__setattr__(self, "_defaulted", frozenset(k for k in ALGO_KEYS if getattr(self, k) is None))
        for name, value in ALGO_DEFAULTS.get(self.algo, {}).items():  # an unknown algo: named by the check below
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        super().__post_init__()
        self._check_pairs()

    def _check_pairs(self) -> None:
        """ConfigError (or a warning) for keys that contradict each other."""
        if self.algo == "reinforce" and self.scale_rewards == "group":
            raise ConfigError("ppo.scale_rewards=group with reinforce: its baseline is the batch mean, there are no "
                              "groups; use ppo.scale_rewards=batch or none")
        if self.filter_zero_std_groups and self.algo not in ("grpo", "rloo"):
            raise ConfigError(f"ppo.filter_zero_std_groups needs grpo or rloo: under {self.algo} the baseline is not "
                              "the group's mean, so a group of equal scores still has advantages")
        if self.overlong_buffer and self.max_new_tokens is not None and self.overlong_buffer > self.max_new_tokens:
            raise ConfigError(f"ppo.overlong_buffer={self.overlong_buffer} is longer than ppo.max_new_tokens="
                              f"{self.max_new_tokens}: the penalty ramps up over the last overlong_buffer tokens "
                              "before max_new_tokens")
        if any(not s for s in self.stop):
            raise ConfigError(f"ppo.stop must hold non-empty strings, got {list(self.stop)!r}")
        if self.loss_type == "cispo" and self.epsilon_high is not None and self.epsilon_high < 1:
            raise ConfigError(f"ppo.epsilon_high={self.epsilon_high} with ppo.loss_type=cispo caps every importance "
                              "weight below 1 (an on-policy step's gradient scaled by it); the cap is an absolute "
                              "weight: use >= 1 (ScaleRL: 5.0), or leave it unset")
        if self.importance_sampling_level != "token" and self.loss_type not in PER_SEQUENCE_LOSSES:
            warnings.warn(f"ppo.importance_sampling_level={self.importance_sampling_level} with ppo.loss_type="
                          f"{self.loss_type} sums the sequence's ratio over its tokens, so each sequence weighs as "
                          "much as it is long, not GSPO's per-sequence objective; GSPO's setup is "
                          "ppo.loss_type=grpo", UserWarning, stacklevel=1)  # this line's: shown once per message
        if self.warmup_steps and self.warmup_ratio:
            raise ConfigError(f"ppo.warmup_steps={self.warmup_steps} and ppo.warmup_ratio={self.warmup_ratio} both set "
                              "the warm-up: set one of them (the other to 0)")
        if self.kl_in_loss and self.kl_estimator == "k1":
            raise ConfigError("ppo.kl_in_loss=true with ppo.kl_estimator=k1: k1 = log pi - log ref has a zero expected "
                              "gradient (E_pi[grad log pi] = 0), so as a loss term it is only noise; use "
                              "ppo.kl_estimator=k2 for the reverse KL's gradient (k3: the forward KL's), or move "
                              "the KL to the reward with ppo.kl_in_loss=false")
