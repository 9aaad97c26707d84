"""The config sections other than ``ppo`` (config.ppo): one frozen dataclass a section."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import ConfigError, Section, key

# The learning rates left unset (None) by what the model starts from (model.regime), resolved at loading:
# tuned from scratch, TRL's if pretrained, ten times those with LoRA (RL's measured); docs/real-models.md.
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


@dataclass(frozen=True)
class RunConfig(Section):
    out_dir: str = key("runs/demo", "Directory this command writes (config, metrics, checkpoints, plots).")
    seed: int = key(0, "Seed for Python, NumPy and torch RNGs and the task's data generators.")
    device: str = key("auto", "'auto' (CUDA when available), 'cpu' or 'cuda'.")
    progress: bool = key(True, "Show progress bars.")
    task: Literal["doubling", "cities"] = key("doubling", "Built-in task giving the tokenizer, data and "
        """evaluation: 'doubling' (the tutorial task) or 'cities' ("Where is Pune?" -> "Pune is in India.").""")
    max_bad_updates: int = key(5, "Stop with an error after this many optimizer updates in a row skipped for a "
        "NaN/inf loss or gradient norm (each counted in guard/skipped_updates).")
    log_every: int = key(0, "Write a metrics row every this many optimizer steps, and after the last step and "
        "every evaluation; 0 = the command's own interval.")
    tensorboard: bool = key(True, "Write the metrics as TensorBoard events in OUT_DIR/tb/ too.")
    trackers: str = key("", "Extra experiment trackers, comma-separated: 'wandb', 'trackio' (each must be "
        "installed; empty = none).")
    checkpoint_every: int = key(100, "Checkpoint to OUT_DIR/checkpoints/ every N optimizer steps; 0 = never.")
    keep_checkpoints: int = key(2, "Newest checkpoints kept; older ones are deleted.")
    resume: bool = key(False, "Continue from the newest complete checkpoint in run.out_dir (``--resume``); use "
        "the same config.")
    overwrite: bool = key(False, "Replace an earlier run in run.out_dir (its files are deleted first); without "
        "it, or run.resume, such a directory is refused.")


@dataclass(frozen=True)
class ModelConfig(Section):
    name: str = key("", "Policy: a local path or hub id of a causal LM; empty builds the task's tiny GPT-2.")
    n_layer: int = key(2, "Tiny GPT-2 depth (only when building from scratch).")
    n_head: int = key(4, "Tiny GPT-2 attention heads.")
    n_embd: int = key(64, "Tiny GPT-2 width.")
    trust_remote_code: bool = key(False, "Run the checkpoint's own model code (only if you trust it).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = key("float32", "Weight dtype of every loaded "
        "model: 'auto' keeps the checkpoint's own; bfloat16 with LoRA or model.master_weights for large models.")
    master_weights: bool = key(False, "With model.dtype=bfloat16, full fine-tuning in bfloat16 arithmetic on "
        "float32 weights and AdamW (TRL's bf16=True); off with LoRA.")
    gradient_checkpointing: bool = key(False, "Recompute activations in the backward (less memory, slower).")
    lora_r: int = key(0, "Policy LoRA rank (peft; 0 = all weights); the reference is the policy without it.")
    lora_alpha: float = key(16.0, "LoRA scaling numerator: the update is (lora_alpha / lora_r) * B @ A.")
    lora_dropout: float = key(0.0, "Dropout on the LoRA input for sft, dpo and rm; the RL commands set it to 0.")
    lora_target_modules: str = key("all-linear", "Comma-separated module names the adapter wraps (e.g. "
        "'q_proj,v_proj'), or 'all-linear'.")
    regime: Literal["auto", "scratch", "pretrained"] = key("auto", "What the trained model starts from, which "
        "picks the learning rates left unset (config.REGIME_DEFAULTS); 'auto' reads rlhfkit's from-scratch mark "
        "in config.json.")

    def __post_init__(self):
        super().__post_init__()
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
    steps: int = key(1000, "Optimizer steps of next-token training on unprefixed task text.")
    batch_size: int = key(128, "Sequences per step.")
    lr: float = key(3e-3, "Peak AdamW learning rate (linear warm-up, cosine decay to 10%).")
    warmup_steps: int = key(50, "Linear warm-up steps.")
    weight_decay: float = key(0.01, "AdamW weight decay.")


@dataclass(frozen=True)
class RewardConfig(Section):
    name: str | Callable[..., Any] = key("", "Reward model for RL: a local path or hub id "
        "(AutoModelForSequenceClassification); from Python also a loaded model.")
    kind: Literal["pairwise", "classifier"] = key("pairwise", "'pairwise': Bradley-Terry on chosen/rejected "
        "pairs, one scalar; 'classifier': a head over the task's labels, the reward the logit of the label the "
        "prompt asks for.")
    label_function: str = key("", "For a classifier reward model: 'module:name' mapping a prompt to the wanted "
        "label index (empty: the task's ``label_of_prompt``).")
    function: str | Callable[..., Any] | list[str | Callable[..., Any]] = key("", "Reward functions 'module:name' "
        "or 'path/to/file.py:name', comma-separated (from Python also callables); added to the reward model's "
        "score. See docs/data.md.")
    weights: str = key("", "Weights of the reward sources, comma-separated: the reward model first, then each "
        "reward.function; empty: all 1.")
    steps: int = key(150, "Optimizer steps of Bradley-Terry training.")
    batch_size: int = key(64, "Preference pairs per step.")
    lr: float | None = key(None, "AdamW learning rate. Unset: by model.regime (config.REGIME_DEFAULTS).")
    margin: float = key(0.0, "Required gap r_chosen - r_rejected in the loss (0 for plain Bradley-Terry).")
    center_coef: float = key(0.01, "Weight of mean((r_c + r_r)^2), keeping scores comparable across prompts.")
    hard_negatives: float = key(0.5, "Share of pairs whose rejected answer mixes sets or lacks EOS (0 = only "
        "other-set answers).")
    freeze_backbone: bool = key(False, "Train only the scalar head, the backbone frozen.")
    init_from: str = key("policy", "Backbone from the pretrained 'policy' or from 'scratch' (random init).")
    eval_pairs: int = key(512, "Held-out pairs for rm/accuracy and rm/delta.")
    micro_batch_size: int = key(0, "Pairs per forward and backward pass, per process; the gradient equals the "
        "whole batch's (0 = the whole batch at once).")


@dataclass(frozen=True)
class ValueConfig(Section):
    name: str = key("", "Separate value model: path or hub id, given a scalar head (empty: ppo.value_init).")
    lora: bool = key(False, "Train the separate value model through LoRA (model.lora_*), its head in full.")


@dataclass(frozen=True)
class ChatConfig(Section):
    greedy: bool = key(True, "Greedy decoding; False samples with chat.temperature.")
    temperature: float = key(0.7, "Sampling temperature when chat.greedy is False.")
    max_new_tokens: int = key(128, "Longest reply.")
    system: str = key("", "System message put first in the chat template's conversation (empty: none).")
    history: bool = key(True, "Keep earlier turns in the conversation (False: every prompt starts afresh).")


@dataclass(frozen=True)
class DataConfig(Section):
    path: str = key("", "Your training data: a JSONL / JSON / Parquet / CSV file, a saved dataset directory or a "
        "hub id; empty: the built-in task's. Formats: docs/data.md.")
    split: str = key("", "Split of a dataset directory or hub id (empty: 'train').")
    eval_path: str = key("", "Held-out data, formatted as data.path (empty: data.eval_fraction of it).")
    eval_fraction: float = key(0.0, "Share of data.path held out when data.eval_path is empty (0: none).")
    max_prompt_length: int = key(512, "Longest RL prompt in tokens, at most the context less the new tokens.")
    max_length: int = key(512, "Longest tokenized example (prompt, completion, EOS), at most the context.")
    truncation: Literal["left", "error"] = key("left", "Too long: 'left' drops prompt tokens from the start, "
        "'error' stops with the record named.")
    completion_only: bool = key(True, "SFT loss on completion tokens only (False: every token after the first).")
    packing: bool = key(False, "Pack several examples into each max_length row (see rlhfkit.data.pack_sft).")


@dataclass(frozen=True)
class SFTConfig(Section):
    steps: int = key(300, "Optimizer steps.")
    batch_size: int = key(32, "Rows per step.")
    lr: float | None = key(None, "Peak AdamW learning rate (linear warm-up, cosine decay to a tenth). Unset: by "
        "model.regime (config.REGIME_DEFAULTS).")
    warmup_steps: int | None = key(None, "Linear warm-up steps. Unset: by model.regime.")
    eval_every: int = key(0, "Held-out loss (eval/loss) every N steps and at the end (0 = only at the end).")
    micro_batch_size: int = key(0, "Rows per forward and backward pass, per process; the gradient equals the "
        "whole batch's (0 = the whole batch at once).")
    assistant_turns: Literal["all", "last"] = key("all", 'Assistant turns of a "messages" record trained: '
        "'all' (TRL's assistant_only_loss) or 'last'.")


@dataclass(frozen=True)
class DPOConfig(Section):
    beta: float = key(0.1, "Inverse temperature of DPO's implicit reward.")
    steps: int = key(300, "Optimizer steps (upper bound; stops early at stop_at_format).")
    batch_size: int = key(64, "Preference pairs per step.")
    lr: float | None = key(None, "AdamW learning rate. Unset: by model.regime (config.REGIME_DEFAULTS).")
    num_pairs: int = key(4096, "Pairs in the built-in task's preference set; with data.path, all the file's.")
    loss: Literal["sigmoid", "ipo", "ipo_sum"] = key("sigmoid", "'sigmoid': DPO's; 'ipo': IPO's over per-token "
        "mean log-probs (TRL's); 'ipo_sum': IPO's over summed log-probs (the paper's). See "
        "docs/algorithms/dpo.md.")
    nll_coef: float = key(1.0, "Weight of an NLL term on the chosen answers, per token (RPO); 0 = plain DPO.")
    disable_dropout: bool = key(True, "Turn every dropout off, LoRA's too (TRL's disable_dropout).")
    precompute_ref: bool = key(True, "Reference log-probs once, before training (False: once per batch).")
    eval_every: int = key(25, "Held-out evaluation every N steps and at the end (0 = only at the end).")
    stop_at_format: float = key(0.0, "Stop at this held-out format accuracy (0: never; built-in task only).")
    micro_batch_size: int = key(0, "Pairs per forward and backward pass, per process; the gradient equals the "
        "whole batch's (0 = the whole batch at once).")


@dataclass(frozen=True)
class EvalConfig(Section):
    batch_size: int = key(512, "Prompts per greedy-decoding batch.")
    greedy: bool = key(True, "Greedy held-out completions (False: sampled at ppo.temperature, fixed seed).")
    max_new_tokens: int | None = key(None, "Longest answer decoded (None: the task's longest answer; with "
        "data.path, ppo.max_new_tokens).")
    accuracy_reward: str = key("", "Reward source(s) whose 0/1 scores define eval/accuracy (comma-separated); "
        "empty: those declared binary (``fn.binary = True``).")
    baseline: str = key("", "A model or run directory scored on the same prompts, for win rates.")


@dataclass(frozen=True)
class DemoConfig(Section):
    algos: str = key("ppo", "Comma-separated algorithms the demo runs after pretraining and the reward model: any "
        "of ppo, grpo, rloo, reinforce and dpo.")


@dataclass(frozen=True)
class GridworldConfig(Section):
    algo: Literal["reinforce", "ppo"] = key("reinforce", "'reinforce' (returns-to-go, batch-mean baseline) or "
        "'ppo' (value head, GAE, clipped loss).")
    iterations: int = key(100, "Rollout + update iterations.")
    episodes_per_iter: int = key(32, "Episodes sampled per iteration (the batch B of the [B, T] tensors).")
    lr: float = key(1e-2, "Adam learning rate (policy and value networks).")
    gamma: float = key(0.95, "Discount of the training targets (the reported return is undiscounted).")
    lam: float = key(0.9, "GAE lambda (ppo).")
    drunk: float = key(0.0, "Chance a move goes in a uniformly random direction, not the intended one.")
    max_steps: int = key(20, "Moves per episode before it is cut off.")
    hidden: int = key(32, "Hidden width of the policy and value MLPs.")
    ppo_epochs: int = key(4, "Passes over each rollout (ppo).")
    minibatches: int = key(2, "Minibatches of episodes per pass (ppo).")
    clip_range: float = key(0.2, "PPO ratio clip epsilon.")
    vf_coef: float = key(0.5, "Weight of the value loss (ppo).")
    entropy_coef: float = key(0.01, "Weight of the entropy bonus.")
    reward_scale: float = key(0.01, "Factor on the training rewards, so the critic's targets are of order 1.")


@dataclass(frozen=True)
class EnvConfig(Section):
    cls: Any = key("", "Multi-turn environment for the RL commands (written ``env.class``): a "
        "rlhfkit.envs.environment.Environment 'module:Name' or 'path/to/file.py:Name'; empty: single-turn.")
    max_turns: int = key(0, "Most model turns per episode (0: the environment's own ``max_turns``).")
    max_tokens: int = key(0, "Most tokens per episode, prompt and observations included (0: the env's own).")


@dataclass(frozen=True)
class AccelConfig(Section):
    enabled: Literal["auto", "on", "off"] = field(default_factory=lambda: os.environ.get("RLHFKIT_ACCEL") or "auto",
        metadata={"doc": "Faster implementations of the core's operations (rlhfkit.accel): 'auto' where they pay, "
                  "'on' wherever they run, 'off' plain PyTorch only (default: $RLHFKIT_ACCEL, else 'auto')."})
    threads: int = key(0, "torch intra-op threads; 0 keeps torch's default.")
    malloc: str = key("", "The C allocator under every CPU tensor: '' = the C library's, 'tcmalloc', 'jemalloc' "
        "or a library's path; the command restarts once with it preloaded (Linux).")
    cuda_graph: bool = key(False, "Replay each decode step of the rollout as a CUDA graph (CUDA, the accelerated "
        "forward's models): fewer kernel launches, the same tokens up to rounding.")
    offload: bool = key(False, "Keep in host memory what a phase of the RL step does not read (AdamW's moments, "
        "the frozen models): a lower GPU peak; one process or DDP.")
    update_off_heap: bool = key(False, "CPU with glibc: during the RL update, map every tensor of 1 MiB or more "
        "on its own, returned to the system when freed (a lower peak resident set).")
    reuse_rollout_logprobs: bool = key(True, "Take the old log-probs (a shared head's values, the entropies) from "
        "the sampler where it computed them as the training forward does, instead of a policy forward.")

    def __post_init__(self):
        if isinstance(self.enabled, bool):  # YAML reads a bare on / off as a boolean
            object.__setattr__(self, "enabled", "on" if self.enabled else "off")
        super().__post_init__()
