"""Configuration: nested dataclasses, YAML files, dotted overrides, validation.

``load_config(path, ["ppo.kl_coef=0.1", "run.seed=3"])`` reads the YAML (if any), applies
the overrides in order, type-checks every value and returns a frozen :class:`Config`.
Unknown keys and ill-typed values raise :class:`ConfigError` naming the key (with a
"did you mean" suggestion), before any work starts.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import math
import os
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The settings of the `ppo` section that depend on the algorithm (ppo.algo): the one source of
# these defaults for the command line (rlhfkit ppo/grpo/rloo/reinforce sets ppo.algo) and the
# Python API alike. A key of ALGO_KEYS left unset (None) takes its algorithm's value when the
# section is built (PPOConfig(algo="grpo") has GRPO's) and stays unset in the config: changing
# ppo.algo or model.lora_r later, with Config.replace, a config file or an override, moves it to
# the new algorithm's and policy's value, while a key the user set keeps that value on every route
# (null sets it back to unset).
ALGO_KEYS = ("group_size", "kl_coef", "kl_estimator", "kl_in_loss", "normalize_reward", "forward_kl_coef")
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    # PPO normalises scores with running statistics, so its KL penalty in the reward (k1, beta
    # 0.2) pulls as hard on a reward of any scale; the k3 loss term of weight 0.1 beside it pulls
    # on the forward KL(ref || pi), which the reverse KL leaves free for answers no longer sampled.
    # Both held the toy tasks' three rewards (exact verifier, Bradley-Terry model, label
    # classifier) better than either alone: benchmarks/archive/code-evidence.md.
    "ppo": {"algo": "ppo", "normalize_reward": True, "kl_in_loss": False, "kl_estimator": "k1", "kl_coef": 0.2,
            "group_size": 8, "forward_kl_coef": 0.1},
    # The critic-free commands share one recipe, chosen on the doubling task across its three
    # rewards (benchmarks/robustness.py): k3 as a loss term with beta 0.3, scores divided by the
    # batch's std (scale_rewards=batch), groups of 4. GRPO's per-group std with a small beta
    # collapsed on the learned rewards; groups of 4 reached the target in fewer steps than 8.
    # The runs behind each choice: benchmarks/archive/code-evidence.md.
    "grpo": {"algo": "grpo", "normalize_reward": False, "kl_in_loss": True, "kl_estimator": "k3", "kl_coef": 0.3,
             "group_size": 4, "forward_kl_coef": 0.0},
    "rloo": {"algo": "rloo", "normalize_reward": False, "kl_in_loss": True, "kl_estimator": "k3", "kl_coef": 0.3,
             "group_size": 4, "forward_kl_coef": 0.0},
    # group_size is unused by reinforce (samples_per_prompt says how many per prompt)
    "reinforce": {"algo": "reinforce", "normalize_reward": False, "kl_in_loss": True, "kl_estimator": "k3",
                  "kl_coef": 0.3, "group_size": 8, "forward_kl_coef": 0.0},
}
# A LoRA policy (model.lora_r > 0) takes these instead, for the keys of ALGO_KEYS left unset.
# The critic-free commands drop the KL term: on a pretrained chat model it held the answer's
# format still, while the LoRA rank already keeps the policy near its base (the reference is the
# base with the adapter off), and guard/reward_tradeoff and guard/kl_high say when a run drifts.
# PPO keeps k1 0.2 in the reward without the forward-KL loss term, as measured on the chat model.
# The runs: benchmarks/archive/code-evidence.md.
LORA_DEFAULTS: dict[str, dict[str, Any]] = {**{algo: {"kl_coef": 0.0} for algo in ("grpo", "rloo", "reinforce")},
                                            "ppo": {"forward_kl_coef": 0.0}}
# k3 as a loss term pulls on the forward KL(ref || pi), not on the reverse KL(pi || ref) that the
# objective names (PPOConfig.kl_estimator); it is TRL's GRPO with use_bias_correction_kl=False (its
# default, True, weighs k3 by the ratio, whose gradient is k2's), and k2 (the reverse KL's gradient)
# at the same beta held no better on the three rewards


# the loss types that reduce each sequence to its token mean first (PPOConfig.loss_type): a
# sequence-level ratio then weighs every sequence alike, as GSPO's objective does
PER_SEQUENCE_LOSSES = ("grpo", "sapo")

# The learning rates by what the trained model starts from (model.regime), for the keys left
# unset (None); resolved where the model is loaded (rlhfkit.trainers.common.Run.learning_rates).
# 'scratch': random weights trained by rlhfkit (the built-in tasks' tiny models): the rates their
# learning tests and benchmarks were tuned at. 'pretrained': a checkpoint trained elsewhere,
# fine-tuned in full: TRL's defaults (SFT 2e-5 without warm-up, DPO and GRPO 1e-6), since the
# scratch rates wrecked a chat model in a few steps (benchmarks/pretrained_defaults.py). The reward
# model's rate (TRL: 1e-4) and the critic's, ten times the actor's (TRL: the actor's), are
# rlhfkit's choices. 'lora': ten times the full rates (TRL's rule for adapters), but for RL, which
# keeps the rates measured on the real chat model with LoRA (tests/test_real_learning.py).
REGIME_DEFAULTS: dict[str, dict[str, float | int]] = {
    "scratch": {"sft.lr": 1e-3, "sft.warmup_steps": 20, "dpo.lr": 1e-3, "reward.lr": 1e-3, "ppo.lr": 3e-4,
                "ppo.value_lr": 3e-3},
    "pretrained": {"sft.lr": 2e-5, "sft.warmup_steps": 0, "dpo.lr": 1e-6, "reward.lr": 1e-5, "ppo.lr": 1e-6,
                   "ppo.value_lr": 1e-5},
    "lora": {"sft.lr": 2e-4, "sft.warmup_steps": 0, "dpo.lr": 1e-5, "reward.lr": 1e-4, "ppo.lr": 3e-4,
             "ppo.value_lr": 3e-3},
}
# how the start of a run names each regime
REGIME_NAMES = {"scratch": "trained from scratch", "pretrained": "pretrained checkpoint",
                "lora": "pretrained checkpoint (LoRA)"}


def key_value(cfg: Config, key: str) -> Any:
    """The value of the dotted ``key`` (``'sft.lr'``) in ``cfg``."""
    sec, name = key.split(".")
    return getattr(getattr(cfg, sec), name)


def regime_value(cfg: Config, key: str, regime: str) -> Any:
    """The dotted ``key`` of REGIME_DEFAULTS: the config's own value, or when it is unset (None)
    the value ``regime`` gives it."""
    value = key_value(cfg, key)
    return REGIME_DEFAULTS[regime][key] if value is None else value


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names it and says how to fix it."""


class Section:
    """Base of the section dataclasses: every value is type-checked and range-checked (RANGES)
    when the section is built, from Python as from the command line: ``PPOConfig(steps="3")``
    raises the ConfigError that ``ppo.steps='3'`` does. An int given to a float key becomes a
    float, a path-like given to a str key its string, a list a tuple (frozen all the way)."""

    def __post_init__(self):
        section = _section_name(type(self))
        for name, tp in _hints(type(self)).items():
            key = f"{section}.{name}"
            value = getattr(self, name)
            checked = _coerce(value, tp, key)
            if checked is not value:
                object.__setattr__(self, name, checked)  # frozen: the one place a value is normalised
            _check_range(key, checked)


@dataclass(frozen=True)
class RunConfig(Section):
    out_dir: str = "runs/demo"
    """Directory this command writes (config, metrics, checkpoints, plots)."""
    seed: int = 0
    """Seed for Python, NumPy and torch RNGs and the task's data generators."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda'."""
    threads: int = 0
    """torch intra-op threads; 0 keeps torch's default."""
    malloc: str = ""
    """The C allocator under every CPU tensor: '' = the C library's, 'tcmalloc' or 'jemalloc' (a
    system library, e.g. Debian's libtcmalloc-minimal4) or a path; preloaded by restarting the
    command once (``rlhfkit.accel.malloc``). Both keep a CPU update's resident set lower than glibc's."""
    progress: bool = True
    """Show progress bars."""
    task: Literal["doubling", "cities"] = "doubling"
    """Built-in task giving the tokenizer, data and evaluation: 'doubling' (the number-doubling tutorial task) or 'cities'
    ("Where is Pune?" -> "Pune is in India.", the sample PPO explainers walk through)."""
    max_bad_updates: int = 5
    """An optimizer update whose loss or gradient norm is NaN/inf is skipped (warning, counted in
    guard/skipped_updates); this many skipped in a row stop the run with an error."""
    log_every: int = 0
    """Write a metrics row (metrics.jsonl, TensorBoard, trackers, the progress line) every this many
    optimizer steps, and after the last step and every evaluation; 0 = the command's own interval
    (every step for ppo, grpo, rloo, reinforce and dpo, 10 for sft and rm, 20 for pretrain).
    Evaluations and checkpoints keep their own schedules."""
    tensorboard: bool = True
    """Write every logged metric as TensorBoard events under OUT_DIR/tb/ too (tensorboardX);
    view with ``tensorboard --logdir OUT_DIR``."""
    trackers: str = ""
    """Extra experiment trackers, comma-separated: 'wandb', 'trackio' (each must be installed;
    empty = none)."""
    checkpoint_every: int = 100
    """Write a checkpoint (trainable weights, optimizer, RNG states, data position, counters) to
    OUT_DIR/checkpoints/ every this many optimizer steps of the RL, SFT, DPO, reward and
    pretraining loops; 0 = never. Written to a temporary directory, then renamed."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept; older ones are deleted."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run.out_dir (``--resume`` on the command
    line); starts from step 0 when there is none. Use the same config as the interrupted run."""
    overwrite: bool = False
    """Replace an earlier run in run.out_dir: its files (config.yaml, metrics.jsonl, samples,
    checkpoints/, tb/, saved models ...) are deleted before the new run writes; other files there
    stay. Without it (or run.resume) a run.out_dir holding an earlier run is refused."""


@dataclass(frozen=True)
class ModelConfig(Section):
    name: str = ""
    """Policy: a local path or hub id of a causal LM; empty builds the task's tiny GPT-2."""
    n_layer: int = 2
    """Tiny GPT-2 depth (only when building from scratch)."""
    n_head: int = 4
    """Tiny GPT-2 attention heads."""
    n_embd: int = 64
    """Tiny GPT-2 width."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint's repository (off unless you trust it)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of every loaded model (policy, reference, reward, value): 'auto' keeps the
    checkpoint's own (bf16 for most hub LMs). float32 is the default: full fine-tuning keeps
    AdamW's updates exact; use bfloat16 with LoRA on a GPU for large models, or with
    model.master_weights=true to fine-tune every weight in bfloat16 arithmetic."""
    master_weights: bool = False
    """With model.dtype=bfloat16, full fine-tuning in bfloat16 arithmetic on float32 weights: the
    trained models' parameters, gradients and AdamW stay float32, their passes run on bfloat16
    copies (rlhfkit.precision). The full fine-tuning counterpart of TRL's bf16=True; off with LoRA."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of the trained models (less memory, ~30% more
    compute); rollouts run in eval mode, so the KV cache still works."""
    lora_r: int = 0
    """LoRA rank for the policy (peft); 0 trains all weights. With LoRA the reference is the same
    model with its adapter disabled, so the base weights are held once."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is (lora_alpha / lora_r) * B @ A."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input for sft, dpo and rm (every command turns the checkpoint's own off);
    the RL commands set it to 0 too: their sampler's and update's forwards must give a ratio of 1."""
    lora_target_modules: str = "all-linear"
    """Comma-separated module names the adapter wraps (e.g. 'q_proj,v_proj'), or 'all-linear'
    (every linear layer except the output head)."""
    regime: Literal["auto", "scratch", "pretrained"] = "auto"
    """What the trained model starts from, which picks the learning rates left unset
    (config.REGIME_DEFAULTS; printed at the start): 'scratch', 'pretrained' (with model.lora_r > 0
    the LoRA rates) or 'auto': 'scratch' when config.json carries rlhfkit's from-scratch mark."""

    def __post_init__(self):
        super().__post_init__()
        if self.lora_r < 0:
            raise ConfigError(f"model.lora_r must be >= 0 (0 = no LoRA), got {self.lora_r}")
        if self.lora_r and self.lora_alpha <= 0:
            raise ConfigError(f"model.lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.master_weights and self.dtype != "bfloat16":
            raise ConfigError(f"model.master_weights=true runs bfloat16 copies of float32 weights: set "
                              f"model.dtype=bfloat16 (got {self.dtype!r})")
        if self.master_weights and self.lora_r:
            raise ConfigError("model.master_weights=true is for full fine-tuning: a LoRA adapter (model.lora_r) is "
                              "float32 already beside its bfloat16 base; leave model.master_weights off")
        if self.lora_r and not self.lora_target_modules.strip():
            raise ConfigError("model.lora_target_modules is empty: name modules (e.g. 'q_proj,v_proj') "
                              "or use 'all-linear'")


@dataclass(frozen=True)
class PretrainConfig(Section):
    steps: int = 1000
    """Optimizer steps of next-token training on unprefixed task text."""
    batch_size: int = 128
    """Sequences per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""


@dataclass(frozen=True)
class RewardConfig(Section):
    name: str | Callable[..., Any] = ""
    """Reward model for RL: a local path or hub id (AutoModelForSequenceClassification). From
    Python also a loaded model object that reads the policy's tokens (config.yaml records it as
    '<callable>'; a PPO critic then starts from the policy)."""
    kind: Literal["pairwise", "classifier"] = "pairwise"
    """'pairwise': Bradley-Terry on chosen/rejected pairs, one scalar. 'classifier' (the doubling tutorial's): a
    head over the task's labels trained with cross-entropy; the reward is the logit of the label
    the prompt asks for (see label_function)."""
    label_function: str = ""
    """For a classifier reward model: 'module:name' mapping a prompt text to the wanted label index
    (empty: the task's ``label_of_prompt``)."""
    function: str | Callable[..., Any] | list[str | Callable[..., Any]] = ""
    """Reward functions 'module:name' (a module installed, on PYTHONPATH or in the current directory) or
    'path/to/file.py:name', comma-separated for several, each called as
    fn(prompts=, completions=, completion_ids=, finished=, **columns) -> list[float] (see
    rlhfkit.rewards); added to the reward model's score when reward.name is set too (e.g.
    rlhfkit.tasks.cities:exact_reward, which reads the 'country' column). From Python also the
    callable itself or a list of callables and names; config.yaml records a callable as
    'module:qualname', or '<callable>' when it has no importable name (a lambda, a function
    defined in a notebook's __main__)."""
    weights: str = ""
    """Weights of the reward sources, comma-separated, one per source: the reward model first
    (when reward.name is set), then each reward.function in order; empty: all 1."""
    steps: int = 150
    """Optimizer steps of Bradley-Terry training."""
    batch_size: int = 64
    """Preference pairs per step."""
    lr: float | None = None
    """AdamW learning rate. Unset: by model.regime (config.REGIME_DEFAULTS): 1e-3 from scratch,
    1e-5 for a pretrained checkpoint, 1e-4 with LoRA."""
    margin: float = 0.0
    """Required gap r_chosen - r_rejected in the loss (0 for plain Bradley-Terry)."""
    center_coef: float = 0.01
    """Weight of the centring term mean((r_c + r_r)^2): scores comparable across prompts."""
    hard_negatives: float = 0.5
    """Share of pairs whose rejected answer mixes sets or lacks EOS (0 = only other-set answers)."""
    freeze_backbone: bool = False
    """Train only the scalar head, backbone frozen, as reward-model explainers often do."""
    init_from: str = "policy"
    """'policy' starts the backbone from the pretrained policy, 'scratch' from random init."""
    eval_pairs: int = 512
    """Held-out pairs for rm/accuracy and rm/delta."""
    micro_batch_size: int = 0
    """Pairs per forward and backward pass, per process: each step's gradient is accumulated over
    micro-batches of this many pairs and equals the whole batch's (0 = the whole batch at once)."""


@dataclass(frozen=True)
class ValueConfig(Section):
    name: str = ""
    """Separate value model (PPO): a local path or hub id loaded with its backbone and a scalar head
    (a fresh one when the checkpoint has none); empty: ppo.value_init decides."""
    lora: bool = False
    """Train the separate value model through a LoRA adapter (model.lora_* settings but
    lora_dropout, which RL sets to 0); its scalar head stays fully trainable."""


@dataclass(frozen=True)
class ChatConfig(Section):
    greedy: bool = True
    """Greedy decoding; False samples with chat.temperature."""
    temperature: float = 0.7
    """Sampling temperature when chat.greedy is False."""
    max_new_tokens: int = 128
    """Longest reply."""
    system: str = ""
    """System message put first in the chat template's conversation (empty: none)."""
    history: bool = True
    """Keep earlier turns in the conversation (False: every prompt starts afresh)."""

    def __post_init__(self):
        super().__post_init__()
        if self.temperature <= 0:
            raise ConfigError(f"chat.temperature must be > 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"chat.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class PPOConfig(Section):
    """The RL commands' settings. Where TRL, OpenRLHF or DeepSpeed-Chat choose differently, the
    key says so (docs/ppo_walkthrough.md, section 10, has the table). Two choices have no key:
    the score lands on the last response token, the EOS when one was emitted (TRL's PPOTrainer
    and DeepSpeed-Chat put it one position past the EOS, OpenRLHF on it), and the policy loss
    is by default a token mean over the minibatch, micro-batches weighted by their share of its
    tokens (loss_type; TRL's PPO, OpenRLHF and DeepSpeed-Chat: a token mean per micro-batch;
    TRL's GRPO: loss_type 'dapo', a sum over the generation batch's tokens, in newer releases)."""

    algo: Literal["ppo", "grpo", "rloo", "reinforce"] = "ppo"
    """Advantage estimator: 'ppo' (critic + GAE), 'grpo' (group-relative), 'rloo' (leave-one-out),
    'reinforce' (batch-mean baseline). Set by the command (rlhfkit ppo/grpo/rloo/reinforce)."""
    group_size: int = None  # type: ignore[assignment]  # None: the algorithm's, see ALGO_DEFAULTS
    """Completions per prompt for grpo/rloo (batch_size / group_size prompts per rollout); unset:
    4 for grpo and rloo (config.ALGO_DEFAULTS)."""
    samples_per_prompt: int = 1
    """Completions per prompt for ppo/reinforce (grpo/rloo use group_size). More than one puts
    each prompt in consecutive rows, and rlhfkit computes a repeated prompt once in rollout,
    experience and update."""
    scale_rewards: Literal["group", "batch", "advantages", "none"] = "batch"
    """grpo, rloo, reinforce: divide the baseline-centred scores by the std of the prompt's group
    ('group' or true: GRPO's paper, TRL's and OpenRLHF's GRPO default), of the batch's raw scores
    ('batch', the default here: TRL's GRPO scale_rewards='batch'), re-centre them and divide by
    their own std ('advantages': TRL's RLOO normalize_advantages=True, not 'batch' with groups),
    or by nothing ('none' or false: Dr. GRPO, RLOO's paper, TRL's RLOO default); the std unbiased,
    plus a small epsilon, as in TRL (rlhfkit.core.scale_advantages). reinforce has no groups."""
    steps: int = 200
    """Rollout + update iterations (upper bound; see stop_at)."""
    batch_size: int = 64
    """Completions per rollout (= prompts for ppo/reinforce; prompts x group_size for grpo/rloo)."""
    minibatch_size: int = 32
    """Sequences per optimizer step; 32 reached the doubling task's target in fewer rollouts than
    16, with half the optimizer steps per rollout."""
    ppo_epochs: int = 2
    """Passes over each rollout (TRL's num_iterations, whose default is 1: with TRL's defaults a
    rollout is one optimizer step, here ppo_epochs x batch_size / minibatch_size, 4 by default)."""
    minibatch_draw: Literal["epoch", "rollout"] = "epoch"
    """How a rollout's rows are dealt into minibatches (whole groups or prompts, either way):
    'epoch' draws a new partition for every epoch; 'rollout' draws one per rollout and keeps it
    (and its order) for every epoch, as TRL's GRPOTrainer does with num_iterations > 1 (TRL
    shuffles rows, not groups)."""
    lr: float | None = None
    """Actor learning rate (AdamW). Unset: by model.regime (config.REGIME_DEFAULTS): 3e-4 from
    scratch and with LoRA, 1e-6 for a pretrained checkpoint trained in full (TRL's GRPO default)."""
    value_lr: float | None = None
    """Critic learning rate (value head or value model). Unset: ten times the actor's default of
    model.regime: 3e-3 from scratch and with LoRA, 1e-5 for a pretrained checkpoint in full."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Both learning rates over ppo.steps after the warm-up: constant (the default: linear decay
    slowed the doubling task's verifier), linear decay to 0 (TRL's default) or cosine to 0
    ((1 + cos(pi f)) / 2, f the share of those steps gone by); set from the step number alone."""
    warmup_steps: int = 0
    """Linear warm-up of both learning rates over the first this many steps (step k at (k + 1) /
    warmup_steps of the rate), before ppo.lr_schedule; 0 = none."""
    warmup_ratio: float = 0.0
    """The warm-up as a share of ppo.steps (rounded up), in [0, 1]; instead of ppo.warmup_steps."""
    max_new_tokens: int | None = None
    """Longest response sampled (None: the built-in task's longest answer; required with data.path)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are taken under the same temperature)."""
    top_k: int = 0
    """Sample each token from the top_k most likely ones only (0 = off; greedy evaluation ignores
    it). The samples are then off-policy: PPO's log-probs stay the full tempered policy's, the kept
    mass is logged as rollout/kept_mass, and ppo.sampling_correction reweighs by pi / q (TRL with
    vLLM corrects by default; without vLLM, as here by default, it does not)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of most likely tokens holding top_p of the
    probability (after top_k), in (0, 1]; 1.0 = off. Log-probs and correction as for top_k."""
    min_p: float = 0.0
    """Draw only from tokens whose probability is at least min_p times the most likely token's
    (transformers' MinPLogitsWarper, on the tempered distribution), in [0, 1]; 0 = off.
    Log-probs and correction as for top_k."""
    repetition_penalty: float = 1.0
    """Divide the logit of every token already in the prompt or response by this when positive,
    multiply when negative (transformers' RepetitionPenaltyLogitsProcessor, before the
    temperature); 1.0 = off, > 1 discourages repeats. Off-policy samples, as for top_k."""
    sampling_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                 "sequence_mask"] = "none"
    """With top_k / top_p: weigh each token's policy loss by the importance weight pi_old / q of
    the distribution it was drawn from (TRL's vllm_importance_sampling_mode names): per token
    ('token_*': w_t = Z_t, the kept mass, times exp(old log-prob - sampler's log-prob)) or per
    sequence ('sequence_*': the product over its tokens), capped at sampling_correction_cap
    ('*_truncate': min(w, cap)) or zeroed above it ('*_mask'). Over the kept tokens this makes the
    policy gradient's expectation pi's; tokens outside the kept set still get none. Z <= 1, so
    the cap acts only on a mismatch between the sampler's and the training forward's log-probs.
    The KL term and the value loss are not reweighed (TRL: the same). 'none': no weight."""
    sampling_correction_cap: float = 2.0
    """The cap of ppo.sampling_correction's weights: TRL's vllm_importance_sampling_clip_max
    (formerly vllm_importance_sampling_cap), whose default is 3.0; no lower bound, as TRL's
    vllm_importance_sampling_clip_min would give."""
    stop: tuple[str, ...] = ()
    """Stop strings, a YAML list (one string is a list of one; quote what YAML would read otherwise:
    ppo.stop='["###", "User:"]'): a response also ends, like at EOS, once its decoded new text
    contains one -- the token completing it is its last and the row counts as finished (no
    missing_eos_penalty; counted in response/eos_rate). The held-out evaluation uses them too.
    Empty = none."""
    cuda_graph: bool = False
    """Replay each decode step of the rollout as a CUDA graph (CUDA, the accelerated forward:
    GPT-2, Llama, Qwen2/3, Mistral): fewer kernel launches, the same tokens and log-probs up to rounding; with
    Triton one graph serves the whole rollout (accel.enabled=off: a graph per band
    of cache columns). Off by default: it pays where launches dominate (small layers, short completions)."""
    offload: bool = False
    """Keep in host memory what a phase of the step does not read (AdamW's moments outside the
    update, the reference and reward models outside the experience pass and evaluation): a lower
    GPU peak for the transfers' time, the same arithmetic. One process or DDP; no gain on a CPU."""
    update_off_heap: bool = False
    """CPU with glibc (Linux): during the update, give every tensor of 1 MiB or more its own mapping,
    returned to the system when freed (``rlhfkit.utils.tensors_off_heap``): a lower peak resident
    set for page faults at every allocation, the same arithmetic. Off by default for that time."""
    reuse_rollout_logprobs: bool = True
    """Take the experience pass's log-probs (and a shared head's values, the entropies) from the
    sampler where it computed them alike (the accelerated forward in float32, equal up to ~1e-6) instead
    of running the policy again; ``policy/logprob_gap`` reports the largest difference either way."""
    kl_coef: float = None  # type: ignore[assignment]
    """beta: weight of the KL penalty (which KL it pulls on: see kl_estimator; TRL's beta, whose GRPO
    default is 0 with full fine-tuning too). Unset: 0.2 for ppo, 0.3 for grpo, rloo and reinforce
    (config.ALGO_DEFAULTS); 0 for grpo, rloo and reinforce with a LoRA policy (model.lora_r > 0;
    config.LORA_DEFAULTS: on a pretrained chat model it held the answer's format still). TRL's GRPO weighs its k3 term by the ratio (see kl_estimator); TRL's RLOO: 0.05, k1
    summed over the response in the reward. PPO's per-token KL weight is 0.05 in TRL, 0.01 in
    OpenRLHF, 0.1 in DeepSpeed-Chat, all k1 in the reward as here; ppo adds a k3 loss term beside
    it (forward_kl_coef, 0.1): set both to 0 for no KL term at all."""
    kl_estimator: Literal["k1", "k2", "k3"] = None  # type: ignore[assignment]
    """Per-token KL estimator, with log r = log ref - log pi:
    k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. In the reward k1 pulls on the reverse
    KL(pi || ref); as a loss term (kl_in_loss) k2 pulls on the reverse KL, k3 on the FORWARD
    KL(ref || pi), k1 on nothing (refused): the table in docs/ppo_walkthrough.md, section 6
    (tests/test_kl_gradients.py). Unset: k1 for ppo, k3 for grpo, rloo and reinforce. TRL's GRPO
    default (k3 times the ratio, use_bias_correction_kl=True) has k2's gradient: port it as k2;
    use_bias_correction_kl=False as k3."""
    kl_in_loss: bool = None  # type: ignore[assignment]
    """Put the KL penalty in the loss (beta * token-mean of kl_estimator, GRPO style) instead of
    the reward; needs kl_estimator k2 (reverse KL) or k3 (forward KL), see kl_estimator. Unset:
    false for ppo, true for grpo, rloo and reinforce. ppo keeps k1 in the reward and adds a smaller
    k3 loss term beside it (forward_kl_coef): k3 alone drifted on the toy tasks' learned rewards."""
    forward_kl_coef: float = None  # type: ignore[assignment]
    """With the KL in the reward (kl_in_loss=false), the weight of a k3 loss term beside it, which
    pulls on the forward KL(ref || pi) that k1's reverse KL leaves free for answers no longer
    sampled. Unset: 0.1 for ppo (it removed PPO's stalls on the doubling task), else 0."""
    adaptive_kl: bool = False
    """Adapt beta with the proportional controller towards kl_target."""
    kl_target: float = 0.5
    """Target per-sequence KL of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (in samples) of the adaptive controller."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    clip_range: float = 0.2
    """PPO ratio clip epsilon."""
    loss_type: Literal["token_mean", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = "token_mean"
    """How every per-token loss (policy, KL term, entropy bonus, value loss) is reduced, one
    optimizer step's minibatch at a time (micro-batches and processes change nothing):
    'token_mean': sum / the minibatch's response tokens; 'grpo': each sequence's token mean, then
    the mean over sequences; 'dr_grpo': sum / (rows x max_new_tokens); 'bnpo', 'dapo': TRL's
    names, here the token mean (TRL's bnpo is one per micro-batch and process, its dapo divides by
    the generation batch's tokens: equal when one such batch is one optimizer step). Two also
    change the policy loss, as in TRL: 'cispo' (MiniMax-M1): -sg[min(ratio, epsilon_high)] * A *
    log pi, every token keeps a gradient, reduced by the token mean; 'sapo' (soft adaptive policy
    optimization): -A * sigmoid(tau * (ratio - 1)) * 4 / tau, a soft gate in place of the clip
    (tau: sapo_temperature_pos / _neg by the advantage's sign), reduced per sequence as 'grpo'.
    See docs/ppo_walkthrough.md, section 10."""
    epsilon_high: float | None = None
    """TRL's name. The clipped losses: the ratio's upper clip 1 + epsilon_high (unset: clip_range;
    DAPO's clip-higher: 0.28). loss_type=cispo: the largest importance weight itself, an absolute
    value >= 1 (unset: 5.0, ScaleRL's; TRL falls back to its epsilon, 0.2, which caps every weight
    at 0.2 and so scales an on-policy step's gradient by 0.2)."""
    sapo_temperature_pos: float = 1.0
    """loss_type=sapo: the gate's temperature on tokens with a positive advantage (TRL's name and
    default; a larger one shuts the gradient off sooner as the ratio leaves 1)."""
    sapo_temperature_neg: float = 1.05
    """loss_type=sapo: the gate's temperature on tokens with a zero or negative advantage (TRL's
    name and default; the paper keeps it above the positive one, for stability)."""
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    """The policy loss's ratio: 'token' (PPO); 'sequence' (GSPO, TRL's name): each row's
    exp(mean log-ratio), clipped per sequence -- GSPO used clip ranges near 3e-4 to 4e-4, not
    0.2; 'sequence_token' (GSPO-token): the same value, per-token gradients. Either sequence level
    with a ppo.loss_type that sums over tokens (all but grpo and sapo) weighs each sequence by its
    length, not GSPO's per-sequence objective: a warning, as TRL gives. TRL's RLOO takes one ratio
    per sequence, exp(summed log-ratio), clipped, and the mean over sequences; rlhfkit's rloo takes
    a ratio and clip per token, reduced by ppo.loss_type: on-policy its gradient is TRL's divided by
    the mean response length (token_mean)."""
    value_clip_range: float | None = None
    """Value clip around the rollout-time values; None disables it. The common 0.2 assumes
    returns of order 1: with scores of +-3 it lets the critic move 0.2 per step and stalls it."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, reduced by ppo.loss_type as every per-token loss (TRL's GRPO:
    a token mean whatever its loss_type, as here under token_mean, bnpo, dapo and cispo)."""
    score_clip: float = 5.0
    """Clip the reward score to +-score_clip before it is added -- and before any group or batch
    statistic (GRPO's mean and std). TRL does not clip; OpenRLHF clips to +-10 (for GRPO after
    its group normalisation); DeepSpeed-Chat to +-5."""
    whiten_advantages: bool = True
    """PPO: normalise the GAE advantages to mean 0 / std 1 over every response token of the
    rollout, across processes, with the unbiased (n - 1) variance. TRL's PPOTrainer: unbiased,
    over each process's batch; OpenRLHF: the population (n) variance; DeepSpeed-Chat: no
    whitening. (grpo, rloo, reinforce: see scale_rewards.)"""
    max_grad_norm: float = 1.0
    """Gradient-norm clip, per model."""
    value_model: Literal["separate", "shared"] | None = None
    """'shared' (unset: the default; fewer seconds a step and less memory at the same learning): a
    value head on the actor; 'separate' (unset: when value.name, value.lora or ppo.value_init is
    set): a value model of its own, as TRL's PPOTrainer, OpenRLHF and DeepSpeed-Chat use."""
    value_init: Literal["reward", "policy"] | None = None
    """A separate value model's start: the reward model ('reward', the meaning of unset: when
    reward.name is set; with reward functions alone, the policy) or the policy backbone
    ('policy'); value.name, when set, overrides both. Setting it asks for a separate value model
    when ppo.value_model is unset; beside ppo.value_model=shared it does nothing."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of responses that never emit EOS (0 = off; TRL's PPOTrainer
    has the same option, off by default): no default run on the toy tasks lost its EOS, and the
    hacking watch flags a fall of the EOS rate (guard_eos)."""
    overlong_buffer: int = 0
    """DAPO's soft over-long punishment (0 = off; DAPO: 4096 of 20480; TRL's
    get_soft_overlong_punishment): a response of L > max_new_tokens - overlong_buffer tokens (EOS
    included) loses overlong_penalty * (L - that) / overlong_buffer, after missing_eos_penalty and
    before normalisation and clipping; a multi-turn episode loses the sum over its model turns."""
    overlong_penalty: float = 1.0
    """The over-long penalty at max_new_tokens (DAPO: 1, in the reward's units)."""
    filter_zero_std_groups: bool = False
    """grpo, rloo: leave groups whose scores are all equal (logged: frac_reward_zero_std) out of the
    update, DAPO's dynamic filtering without resampling: the token means run over the kept rows and
    each minibatch holds ppo.minibatch_size kept rows (fewer optimizer steps). One process only."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens (no EOS or stop string; logged:
    response/truncated_rate) out of the update -- policy, KL, entropy and value losses -- TRL's
    option. As in TRL they keep their reward and still count in the baselines (group mean and std,
    whitening, reward normalisation); the token means run over the other rows' tokens, as with
    filter_zero_std_groups. One process only."""
    normalize_reward: bool = None  # type: ignore[assignment]
    """Normalise scores with running mean/std (over every step so far) before clipping; unset:
    true for ppo, false for the others (config.ALGO_DEFAULTS), so the KL weight means the same on any reward's scale.
    For grpo, rloo and reinforce with the KL as a loss term and scale_rewards=batch or group (their
    defaults) it changes the advantages only through score_clip. TRL's PPOTrainer does not
    normalise scores by default. Switched on at a resume from a checkpoint written with it off,
    the statistics start fresh (one warning)."""
    critic_warmup_steps: int = 3
    """Initial steps that update only the critic."""
    eval_every: int = 5
    """Greedy evaluation on the held-out set every N steps (0 = only at the end)."""
    stop_at: float = 0.99
    """Stop once the held-out metric ppo.stop_metric reaches this (0 = run all steps)."""
    stop_metric: str = ""
    """Held-out metric that ends the run early at ppo.stop_at (and that keep_best and the
    eval-drop watch follow): 'eval/exact_acc' (a built-in task's verifier), 'eval/accuracy' or
    'eval/reward' (held-out prompts scored by the rewards), 'eval/reward/<source>'. Empty: the
    first of eval/exact_acc, eval/accuracy, eval/reward that the run's evaluation logs. The
    evaluation before step 0 (logged as baseline/eval/* in step 0's row) must produce it, else
    the run stops there with the metrics it does log."""
    keep_best: bool = False
    """Save the policy (and critic) of the best evaluation on the stop metric since the start or the
    last --resume, not the last step's (TRL: load_best_model_at_end); a CPU copy of the trainable
    weights is kept for it, and the summary's saved_step names the step."""
    guard_kl: float = 1.5
    """Reward-hacking watch: flag (guard/kl_high) steps whose KL per response token, averaged over
    the last 5 steps, exceeds this many nats while ppo.stop_metric has fallen below its best beyond
    its noise; a high KL alone is no alarm (0 = off; off with a warning without the metric)."""
    guard_eos: float = 0.5
    """Flag (guard/eos_collapse) steps where the EOS rate, averaged over the last 5 steps, falls
    below this share of its mean over the first 10 steps, by more than 4.5 standard errors over
    the batch's prompt groups (response/eos_rate_se; a prompt can decide its completions' EOS)
    (0 = off)."""
    guard_eval_drop: float = 0.15
    """Flag (guard/eval_drop) evaluations where ppo.stop_metric, averaged over the last 3
    evaluations, is more than this share below its best such average (0.15: 0.9 -> under 0.765)
    and by more than 4.5 times the evaluations' own noise; from the 5th evaluation (0 = off).
    Off, with one warning at the start, when the run does not log ppo.stop_metric."""
    guard_tradeoff: float = 0.3
    """With several reward sources (reward.function=a,b,...), flag (guard/reward_tradeoff) an
    evaluation where one source's held-out mean fell more than this share below its value before
    training, and by more than 3.5 standard errors of that fall from the source's own spread over
    the held-out prompts (eval/reward_std/<source>), while the weighted total rose: the policy
    trades one term for another, e.g. a brevity term bought by dropping the fact another source
    checks (0 = off). See rlhfkit.watch."""
    samples_per_log: int = 4
    """Generations saved to samples.jsonl per step."""
    trajectories_every: int = 10
    """Save per-token trajectories (log-probs, KL, reward, value, advantages, returns, mask) to
    trajectories.jsonl at the first step, every N steps and the last step, for the trajectory
    view of ``rlhfkit report`` (0 = never)."""
    trajectories_per_step: int = 2
    """Rows of the batch saved each time, spread over the score ranks (lowest and highest first)."""
    micro_batch_size: int = 0
    """Sequences per forward and backward pass, per process: each minibatch's gradient is
    accumulated over micro-batches of this many rows, each loss weighted by its share of the
    minibatch's response tokens, so the update equals the whole minibatch's (0 = the whole
    minibatch at once)."""

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # the key was a bool before it had three values
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        # the keys left unset: Config resolves them for its policy (LORA_DEFAULTS), and Config.replace
        # and load_config(base=...) keep them unset
        object.__setattr__(self, "_defaulted", frozenset(k for k in ALGO_KEYS if getattr(self, k) is None))
        for key, value in ALGO_DEFAULTS.get(self.algo, {}).items():  # an unknown algo: named by the check below
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # frozen: the algorithm's default for a key left unset
        super().__post_init__()
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


@dataclass(frozen=True)
class DataConfig(Section):
    path: str = ""
    """Your training data: a JSONL / JSON / Parquet / CSV file, a ``Dataset.save_to_disk``
    directory or a hub dataset id. sft: demonstrations; rm and dpo: preference pairs; ppo, grpo,
    rloo, reinforce: prompts (every other column reaches the reward functions). Empty: the
    built-in task's generated data (run.task). Formats: docs/data.md."""
    split: str = ""
    """Split of a dataset directory or hub id (empty: 'train')."""
    eval_path: str = ""
    """Held-out data in the same format as data.path: RL prompts scored by the rewards every
    ppo.eval_every steps (eval/reward, eval/accuracy); pairs for dpo (eval/rewards/*, eval/loss
    every dpo.eval_every steps) and rm (eval/rm/*); demonstrations for sft (eval/loss). Empty:
    data.eval_fraction of data.path."""
    eval_fraction: float = 0.0
    """Share of data.path held out for evaluation when data.eval_path is empty (0: none; the
    reward model then holds out 10% of a file's pairs)."""
    max_prompt_length: int = 512
    """Longest RL prompt in tokens, lowered to the model's context less the new tokens; longer ones
    follow data.truncation."""
    max_length: int = 512
    """Longest tokenized example (prompt + completion + EOS), lowered to the model's context."""
    truncation: Literal["left", "error"] = "left"
    """Too long: 'left' drops prompt tokens from the start, 'error' stops with the record named."""
    completion_only: bool = True
    """SFT loss on completion tokens only (False: every token after the first)."""
    packing: bool = False
    """Pack several examples into each max_length row (see rlhfkit.data.pack_sft)."""


@dataclass(frozen=True)
class SFTConfig(Section):
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Rows per step."""
    lr: float | None = None
    """Peak AdamW learning rate (linear warm-up, cosine decay to a tenth). Unset: by model.regime
    (config.REGIME_DEFAULTS): 1e-3 from scratch, 2e-5 for a pretrained checkpoint (TRL's SFT
    default), 2e-4 with LoRA."""
    warmup_steps: int | None = None
    """Linear warm-up steps. Unset: by model.regime: 20 from scratch, none for a pretrained
    checkpoint (TRL's default: a fine-tuning run is often shorter than a warm-up)."""
    eval_every: int = 0
    """Held-out loss (eval/loss, the mean token NLL over data.eval_path or the data.eval_fraction
    share of data.path) every N steps and at the end (0 = only at the end)."""
    micro_batch_size: int = 0
    """Rows per forward and backward pass, per process: each step's gradient is accumulated over
    micro-batches of this many rows, each weighted by its share of the batch's target tokens, so
    it equals the whole batch's (0 = the whole batch at once)."""
    assistant_turns: Literal["all", "last"] = "all"
    """Assistant turns of a "messages" record trained: 'all' (TRL's assistant_only_loss) or 'last'."""


@dataclass(frozen=True)
class DPOConfig(Section):
    beta: float = 0.1
    """Inverse temperature of DPO's implicit reward."""
    steps: int = 300
    """Optimizer steps (upper bound; stops early at stop_at_format)."""
    batch_size: int = 64
    """Preference pairs per step."""
    lr: float | None = None
    """AdamW learning rate. Unset: by model.regime (config.REGIME_DEFAULTS): 1e-3 from scratch,
    1e-6 for a pretrained checkpoint (TRL's DPO default), 1e-5 with LoRA."""
    num_pairs: int = 4096
    """Size of the fixed preference set generated by the built-in task (reference log-probs are
    computed once for it); with data.path every pair of the file is used."""
    loss: Literal["sigmoid", "ipo", "ipo_sum"] = "sigmoid"
    """'sigmoid': DPO's -log sigmoid(beta * h); 'ipo': IPO's (h - 1/(2 beta))^2 (Azar et al. 2023)
    as TRL's loss_type='ipo', each log-prob averaged over its response's tokens; 'ipo_sum': the
    same over summed log-probs (the paper's form, and dpo.loss=ipo before it followed TRL), whose
    beta sets a gap over whole responses, not per token. h is the pair's log-ratio gap (log pi -
    log ref of chosen minus that of rejected), summed over the response tokens for 'sigmoid'. The
    logged rewards/* are beta x the log-ratios the loss uses: per-token means under 'ipo', where
    TRL logs beta x the summed log-ratios whatever its loss_type."""
    nll_coef: float = 1.0
    """Weight of the chosen answers' per-token NLL added to the preference loss (RPO); the default
    loss is DPO + NLL, TRL's loss_type=["sigmoid", "sft"] (TRL's default adds none); 0 = plain
    DPO, TRL's default. Plain DPO separated the doubling pairs without moving greedy accuracy;
    the NLL term is what made it learn the answers."""
    disable_dropout: bool = True
    """Turn every dropout off, the LoRA adapter's (model.lora_dropout) included, as TRL's
    disable_dropout=True; False keeps the adapter's dropout (the models' own stays off)."""
    precompute_ref: bool = True
    """Compute reference log-probs once before training (False: a reference forward per batch)."""
    eval_every: int = 25
    """Held-out evaluation every N steps and at the end (0 = only at the end): greedy format and
    exact accuracy on the built-in task, or, with data.path, the held-out pairs' eval/rewards/*
    and eval/loss (data.eval_path, or the data.eval_fraction share of data.path)."""
    stop_at_format: float = 0.0
    """Stop once held-out format accuracy reaches this (0 = run all steps; built-in task only)."""
    micro_batch_size: int = 0
    """Pairs per forward and backward pass, per process: each step's gradient is accumulated over
    micro-batches of this many pairs and equals the whole batch's (0 = the whole batch at once)."""


@dataclass(frozen=True)
class EvalConfig(Section):
    batch_size: int = 512
    """Prompts per greedy-decoding batch."""
    greedy: bool = True
    """Held-out completions by greedy decoding (False: sampled at ppo.temperature, fixed seed)."""
    max_new_tokens: int | None = None
    """Longest answer decoded (None: the task's longest answer; with data.path, ppo.max_new_tokens)."""
    accuracy_reward: str = ""
    """Reward source(s) whose 0/1 scores define eval/accuracy, the share of completions they all score 1
    (comma-separated, named as logged in reward/<name>); empty: the reward functions declared 0/1
    with ``fn.binary = True``, as the built-in tasks' verifiers are. No declared source, no
    eval/accuracy; a declared one that returns anything but 0 or 1 stops the run with its name."""
    baseline: str = ""
    """A model or run directory whose completions of the same prompts (data.path) are scored by the same
    rewards, for a win rate (empty: none)."""


@dataclass(frozen=True)
class DemoConfig(Section):
    algos: str = "ppo"
    """Comma-separated algorithms the demo runs after pretraining and the reward model, each from
    the same base: any of ppo, grpo, rloo, reinforce (RL with the reward model) and dpo."""


@dataclass(frozen=True)
class GridworldConfig(Section):
    algo: Literal["reinforce", "ppo"] = "reinforce"
    """'reinforce' (returns-to-go, batch-mean baseline) or 'ppo' (value head, GAE, clipped loss)."""
    iterations: int = 100
    """Rollout + update iterations."""
    episodes_per_iter: int = 32
    """Episodes sampled per iteration (the batch B of the [B, T] tensors)."""
    lr: float = 1e-2
    """Adam learning rate (policy and value networks)."""
    gamma: float = 0.95
    """Discount of the training targets (the reported return is undiscounted)."""
    lam: float = 0.9
    """GAE lambda (ppo)."""
    drunk: float = 0.0
    """Probability that a move goes in a uniformly random direction instead of the intended one."""
    max_steps: int = 20
    """Moves per episode before it is cut off."""
    hidden: int = 32
    """Hidden width of the policy and value MLPs."""
    ppo_epochs: int = 4
    """Passes over each rollout (ppo)."""
    minibatches: int = 2
    """Minibatches of episodes per pass (ppo)."""
    clip_range: float = 0.2
    """PPO ratio clip epsilon."""
    vf_coef: float = 0.5
    """Weight of the value loss (ppo)."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    reward_scale: float = 0.01
    """Rewards are multiplied by this for training, so the critic's targets are of order 1."""


@dataclass(frozen=True)
class EnvConfig(Section):
    cls: Any = ""
    """Multi-turn environment for the RL commands (written ``env.class``; see rlhfkit.envs): a
    subclass of rlhfkit.envs.Environment named 'module:Name' or 'path/to/file.py:Name', from
    Python also the class itself or an instance (copied for every episode). Each prompt record
    starts an episode; the model's turns and the environment's observations alternate until it
    says done or a limit is reached. Empty: one completion per prompt."""
    max_turns: int = 0
    """Most model turns per episode (0: the environment's own ``max_turns``)."""
    max_tokens: int = 0
    """Most tokens per episode, prompt and observations included (0: the environment's own
    ``max_tokens``); at most the model's context."""


@dataclass(frozen=True)
class AccelConfig(Section):
    enabled: Literal["auto", "on", "off"] = field(default_factory=lambda: os.environ.get("RLHFKIT_ACCEL") or "auto")
    """Faster implementations of the core's operations (rlhfkit.accel): 'auto' where they pay on this machine, 'on' wherever they run, 'off' plain PyTorch only (default: $RLHFKIT_ACCEL, else 'auto')."""

    def __post_init__(self):
        if isinstance(self.enabled, bool):  # YAML reads a bare on / off as a boolean
            object.__setattr__(self, "enabled", "on" if self.enabled else "off")
        super().__post_init__()


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
        # the algorithm keys the ppo section left unset take this policy's values (LORA_DEFAULTS with LoRA)
        values = {k: v for k, v in algo_defaults(self.ppo.algo, bool(self.model.lora_r)).items()
                  if k in self.ppo._defaulted and getattr(self.ppo, k) != v}
        # the critic: a model of its own only when one is configured. value.name and value.lora name a
        # model to build; ppo.value_init asks for one only when unset beside it (configs saved before
        # the head was the default record value_init: reward for every run, shared ones included)
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
        """``{section: {key: value}}``, a tuple as a list (what YAML, JSON and trackers take); a reward
        callable stays a callable (:func:`dump_config` gives the YAML text)."""
        return {f.name: {g.name: list(v) if isinstance(v, tuple) else v
                         for g in dataclasses.fields(sec) for v in [getattr(sec, g.name)]}
                for f in dataclasses.fields(self) for sec in [getattr(self, f.name)]}

    def _as_given(self) -> dict[str, Any]:
        """:meth:`to_dict` with the algorithm keys the user left unset as None, as they were given:
        what a copy is built from (``replace``, ``load_config(base=...)``), so that those keys follow
        a later ppo.algo or model.lora_r and the ones the user set keep their values."""
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
    """Unset (None) ppo.value_model when value.name, value.lora or ppo.value_init is among the dotted
    keys ``given`` without it, so that Config resolves it again (a saved config.yaml records the
    shared head of every run that had one)."""
    ppo = data.get("ppo")
    if isinstance(ppo, dict) and "ppo.value_model" not in given and given & {"value.name", "value.lora", "ppo.value_init"}:
        ppo["value_model"] = None


def _suggest(name: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" Did you mean '{prefix}{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


def _key_suggestion(data: dict, section: str | None, name: str, prefer: Sequence[str] = ()) -> str:
    """" Did you mean ...?" for an unknown key ``name`` (in ``section``, or given with none): the
    full dotted keys, from the sections in ``prefer`` (a command's own) first; for a name of TRL's
    config, the rlhfkit key that does its job (TRL_KEYS)."""
    order = [s for s in dict.fromkeys([*prefer, *data]) if isinstance(data.get(s), dict)]
    # a TRL name: in the section given, or in the first section holding the name as a key of its own or TRL's
    first = section or next((s for s in order if name in data[s] or name in TRL_KEYS.get(s, {})), "")
    if first and name not in data[first] and (hint := _trl_hint(first, name)):
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

# TRL's config keys -> (the rlhfkit key for the job, "" for none; what differs), by the rlhfkit
# section that takes over TRL's config: ppo for GRPOConfig and RLOOConfig, dpo for DPOConfig, sft
# for SFTConfig; read from TRL 1.16's source. An unknown key of such a name names its rlhfkit key
# (``ppo.num_generations=8``, ``num_generations=8``: "TRL's num_generations is ppo.group_size here");
# docs/ppo_walkthrough.md, section 10, shows every row.
TRL_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "ppo": {
        "learning_rate": ("ppo.lr", "the actor's AdamW rate, the critic's is ppo.value_lr; unset, it follows "
                                    "model.regime: TRL's 1e-6 for a pretrained model, 3e-4 with LoRA or from scratch"),
        "lr_scheduler_type": ("ppo.lr_schedule", "'constant', 'linear' or 'cosine'; TRL's default 'linear' decays "
                                                 "the rate to 0 over the run, rlhfkit's default is 'constant'"),
        "warmup_ratio": ("ppo.warmup_ratio", "the same share of the steps (or ppo.warmup_steps); none by default "
                                             "on both sides"),
        "num_generations": ("ppo.group_size", "completions per prompt for grpo and rloo, TRL's default 8, "
                                              "rlhfkit's 4; ppo.batch_size counts completions"),
        "generation_batch_size": ("ppo.batch_size", "completions per rollout"),
        "num_iterations": ("ppo.ppo_epochs", "passes over each rollout, TRL's default 1, rlhfkit's 2; TRL keeps one "
                           "shuffled split of the rollout for every pass: ppo.minibatch_draw=rollout"),
        "steps_per_generation": ("ppo.minibatch_size", "TRL's counts micro-batches, gradient_accumulation_steps by "
                                 "default: one optimizer step a generation batch; here a rollout takes "
                                 "ppo.batch_size / ppo.minibatch_size optimizer steps a pass, 64 / 32 = 2"),
        "per_device_train_batch_size": ("ppo.micro_batch_size", "rows per forward and backward pass, per process; "
                                        "one optimizer step takes per_device_train_batch_size x "
                                        "gradient_accumulation_steps x processes rows: ppo.minibatch_size"),
        "gradient_accumulation_steps": ("ppo.minibatch_size", "set the rows of one optimizer step "
                                        "(per_device_train_batch_size x gradient_accumulation_steps x processes) and "
                                        "the rows per pass (ppo.micro_batch_size); the passes follow"),
        "max_steps": ("ppo.steps", "TRL counts optimizer steps, rlhfkit rollouts (each ppo.ppo_epochs x "
                                   "ppo.batch_size / ppo.minibatch_size optimizer steps)"),
        "temperature": ("ppo.temperature", "the same, 1.0 by default; the log-probs are taken at it, as in TRL"),
        "max_prompt_length": ("data.max_prompt_length", "the longest prompt in tokens, cut from the left "
                              "(data.truncation); not a key of TRL 1.16's GRPOConfig and RLOOConfig"),
        "max_completion_length": ("ppo.max_new_tokens", "TRL's default 512; rlhfkit's: the built-in task's longest "
                                                        "answer, and required with data.path"),
        "beta": ("ppo.kl_coef", "TRL's GRPO 0.0 by default (k3 in the loss, times the ratio: see "
                                "use_bias_correction_kl), its RLOO 0.05 (k1 summed in the reward); rlhfkit's grpo, "
                                "rloo and reinforce 0.3 with full fine-tuning (k3 in the loss), 0 with LoRA"),
        "use_bias_correction_kl": ("ppo.kl_estimator", "TRL's default true multiplies its k3 term by the ratio, "
                                   "whose gradient is then k2's (the reverse KL's): ppo.kl_estimator=k2; false is "
                                   "k3, rlhfkit's default"),
        "epsilon": ("ppo.clip_range", "the ratio's lower clip (and upper, without ppo.epsilon_high), 0.2 in both"),
        "scale_rewards": ("ppo.scale_rewards", "TRL's GRPO divides by each group's std by default ('group'), "
                                               "rlhfkit by the batch's ('batch')"),
        "normalize_advantages": ("ppo.scale_rewards", "TRL's RLOO: true is ppo.scale_rewards=advantages, its "
                                                      "default false is 'none'; rlhfkit's default is 'batch'"),
        "loss_type": ("ppo.loss_type", "TRL's default 'dapo', rlhfkit's 'token_mean': the same when one "
                                       "generation batch is one optimizer step, as by TRL's default"),
        "entropy_coef": ("ppo.entropy_coef", "TRL adds the bonus as a token mean whatever its loss_type; "
                                             "rlhfkit reduces it by ppo.loss_type, as every per-token loss"),
        "importance_sampling_level": ("ppo.importance_sampling_level", "the same 'token' and 'sequence'; "
                                      "'sequence' with a ppo.loss_type that sums tokens (all but grpo and sapo) "
                                      "weighs each sequence by its length: a warning, as in TRL"),
        "vllm_importance_sampling_correction": ("ppo.sampling_correction", "TRL corrects vLLM's samples by "
                                                "default, rlhfkit its top-k / top-p samples only when asked"),
        "vllm_importance_sampling_mode": ("ppo.sampling_correction", "the same mode names; TRL's default "
                                                                     "'sequence_mask', rlhfkit's 'none'"),
        "vllm_importance_sampling_clip_max": ("ppo.sampling_correction_cap", "TRL's default 3.0, rlhfkit's 2.0; "
                                              "no lower bound (TRL's vllm_importance_sampling_clip_min)"),
        "vllm_importance_sampling_cap": ("ppo.sampling_correction_cap", "TRL's deprecated name of "
                                         "vllm_importance_sampling_clip_max (default 3.0); rlhfkit's 2.0"),
        "reward_weights": ("reward.weights", "comma-separated, one per source, the reward model (reward.name) "
                                             "first"),
    },
    "dpo": {
        "learning_rate": ("dpo.lr", "constant; TRL's default 1e-6 decays linearly to 0; unset, dpo.lr follows "
                                    "model.regime: 1e-6 for a pretrained model, 1e-5 with LoRA, 1e-3 from scratch"),
        "lr_scheduler_type": ("", "dpo.lr is constant; TRL decays it linearly to 0 by default"),
        "warmup_ratio": ("", "dpo has no learning-rate warm-up; TRL has none by default either"),
        "beta": ("dpo.beta", "the same, 0.1 by default"),
        "loss_type": ("dpo.loss", "'sigmoid' and 'ipo' (rewards/* logged from per-token means, TRL's from sums); "
                                  "TRL's ['sigmoid', 'sft'] is rlhfkit's default (dpo.nll_coef=1), TRL's default "
                                  "['sigmoid'] is dpo.nll_coef=0"),
        "per_device_train_batch_size": ("dpo.micro_batch_size", "pairs per forward and backward pass, per "
                                        "process; one optimizer step's pairs are dpo.batch_size"),
        "gradient_accumulation_steps": ("dpo.batch_size", "set the pairs of one optimizer step and the pairs per "
                                                          "pass (dpo.micro_batch_size); the passes follow"),
        "max_steps": ("dpo.steps", "the same: optimizer steps"),
        "max_length": ("data.max_length", "TRL's default 1024 keeps the start (cuts the completion), rlhfkit's "
                                          "512 drops prompt tokens from the start (data.truncation)"),
        "precompute_ref_log_probs": ("dpo.precompute_ref", "TRL's default false, rlhfkit's true"),
    },
    "sft": {
        "learning_rate": ("sft.lr", "the peak of a linear warm-up and a cosine decay to 10% of it; TRL's default "
                                    "2e-5 decays linearly to 0; unset, sft.lr follows model.regime (2e-5 for a "
                                    "pretrained model)"),
        "lr_scheduler_type": ("", "sft warms up linearly (sft.warmup_steps) and decays by a cosine to 10% of "
                                  "sft.lr; TRL decays linearly to 0 by default"),
        "warmup_ratio": ("sft.warmup_steps", "steps, not a share: warmup_ratio x sft.steps"),
        "per_device_train_batch_size": ("sft.micro_batch_size", "rows per forward and backward pass, per "
                                        "process; one optimizer step's rows are sft.batch_size"),
        "gradient_accumulation_steps": ("sft.batch_size", "set the rows of one optimizer step and the rows per "
                                                          "pass (sft.micro_batch_size); the passes follow"),
        "max_steps": ("sft.steps", "the same: optimizer steps"),
        "max_length": ("data.max_length", "TRL's default 1024 keeps the start, rlhfkit's 512 drops prompt tokens "
                                          "from the start (data.truncation)"),
        "packing": ("data.packing", "the same, off by default"),
        "completion_only_loss": ("data.completion_only", "TRL's default None: the completion only for "
                                                         "prompt-completion data; rlhfkit's true"),
    },
}


def _trl_hint(section: str, name: str) -> str:
    """" TRL's NAME is KEY here: WHAT DIFFERS." when ``name`` is a key of the TRL config that
    ``section`` takes over (TRL_KEYS), else ""."""
    if name not in TRL_KEYS.get(section, {}):
        return ""
    key, note = TRL_KEYS[section][name]
    return f" TRL's {name} {f'is {key} here' if key else 'has no rlhfkit key'}: {note}."


def _set(data: dict, dotted: str, value: Any, prefer: Sequence[str] = ()) -> None:
    """``data[section][key] = value`` for ``'section.key'``; ConfigError with the full dotted key
    to use when there is no such key."""
    dotted = KEY_ALIASES.get(dotted, dotted)
    keys = dotted.split(".")
    if len(keys) == 1:
        if keys[0] not in data:  # a key without its section
            raise ConfigError(f"unknown config key '{dotted}': keys are written section.key."
                              f"{_key_suggestion(data, None, dotted, prefer)}")
        data[dotted] = value
        return
    sec, rest = keys[0], ".".join(keys[1:])
    if not isinstance(data.get(sec), dict):
        close = difflib.get_close_matches(sec, [s for s in data if isinstance(data[s], dict)], n=1)
        hint = f" Did you mean '{close[0]}.{rest}'?" if close and rest in data[close[0]] else _suggest(sec, data)
        raise ConfigError(f"unknown config section '{sec}' (top level).{hint}")
    if rest not in data[sec]:
        raise ConfigError(f"unknown config key '{dotted}'.{_key_suggestion(data, sec, rest, prefer)}")
    data[sec][rest] = value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _section_name(cls: type) -> str:
    for f in dataclasses.fields(Config):
        if f.type in (cls, cls.__name__):
            return f.name
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


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested dict (missing keys take defaults)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    hints = typing.get_type_hints(Config)
    sections = {}
    for sec, values in data.items():
        if sec not in hints:
            raise ConfigError(f"unknown config section '{sec}'.{_suggest(sec, hints)}")
        cls = hints[sec]
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{sec}' must be a mapping, got {values!r}")
        fhints = _hints(cls)
        for key in values:
            if key not in fhints:
                keys = {s: _hints(c) for s, c in hints.items()}
                raise ConfigError(f"unknown config key '{sec}.{key}'.{_key_suggestion(keys, sec, key)}")
        sections[sec] = cls(**values)  # type- and range-checked by Section.__post_init__
    cfg = Config(**sections)
    check_values(cfg)
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
    """Defaults (or ``base``) <- YAML file <- dotted overrides, validated. ``prefer``: the sections
    an unknown key's suggestions come from first (the command's own)."""
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
    """``{section: {key: description}}``: the string literal under each field of the section
    dataclasses, read from this module's source, so ``rlhfkit CMD --help`` cannot drift from it."""
    import ast
    import inspect
    import sys

    by_class = {}
    for node in ast.parse(inspect.getsource(sys.modules[__name__])).body:
        if isinstance(node, ast.ClassDef):
            by_class[node.name] = {
                a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(node.body, node.body[1:])
                if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}
    return {sec: by_class.get(cls.__name__, {}) for sec, cls in _hints(Config).items()}


def key_types() -> dict[str, dict[str, str]]:
    """``{section: {key: type as it reads in help}}`` (see :func:`type_name`)."""
    return {sec: {k: type_name(tp) for k, tp in _hints(cls).items()} for sec, cls in _hints(Config).items()}


CALLABLE_PLACEHOLDER = "<callable>"  # what config.yaml records for a callable with no importable name


def callable_name(fn: Callable) -> str:
    """``'module:qualname'`` of a function a later run can import, else ``'<callable>'`` (a
    lambda, a nested function, one defined in ``__main__`` such as a notebook's)."""
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


# --------------------------------------------------------------------------- value ranges

# What the types cannot say: (lowest, highest) allowed, None for unbounded; checked after every
# load/replace so a zero batch or a negative rate stops the run before any work, with its key.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "run.threads": (0, None), "run.max_bad_updates": (1, None), "run.checkpoint_every": (0, None),
    "run.keep_checkpoints": (1, None), "run.log_every": (0, None),
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


def check_values(cfg: Config) -> None:
    """Raise ConfigError for the first value outside its range (see RANGES) or an inconsistent pair."""
    for key in RANGES:
        sec, name = key.split(".")
        _check_range(key, getattr(getattr(cfg, sec, None), name, None))
    if cfg.model.n_embd % cfg.model.n_head:
        raise ConfigError(f"config key 'model.n_embd' ({cfg.model.n_embd}) must be a multiple of "
                          f"model.n_head ({cfg.model.n_head})")
