"""TRL's config keys and the rlhfkit key that does each one's job, for the "did you mean" of an
unknown key (``ppo.num_generations=8``: "TRL's num_generations is ppo.group_size here")."""

from __future__ import annotations

# by the rlhfkit section that takes over TRL's config (ppo: GRPOConfig and RLOOConfig, dpo: DPOConfig, sft:
# SFTConfig), read from TRL 1.16's source: TRL's key -> (the rlhfkit key for the job, "" for none; what
# differs). docs/ppo_walkthrough.md, section 10, shows every row.
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
        "num_iterations": ("ppo.ppo_epochs", "passes over each rollout, TRL's default 1, rlhfkit's 2; TRL keeps "
            "one shuffled split of the rollout for every pass: ppo.minibatch_draw=rollout"),
        "steps_per_generation": ("ppo.minibatch_size", "TRL's counts micro-batches, gradient_accumulation_steps "
            "by default: one optimizer step a generation batch; here a rollout takes ppo.batch_size / "
            "ppo.minibatch_size optimizer steps a pass, 64 / 32 = 2"),
        "per_device_train_batch_size": ("ppo.micro_batch_size", "rows per forward and backward pass, per process; "
            "one optimizer step takes per_device_train_batch_size x gradient_accumulation_steps x processes rows: "
            "ppo.minibatch_size"),
        "gradient_accumulation_steps": ("ppo.minibatch_size", "set the rows of one optimizer step "
            "(per_device_train_batch_size x gradient_accumulation_steps x processes) and the rows per pass "
            "(ppo.micro_batch_size); the passes follow"),
        "max_steps": ("ppo.steps", "TRL counts optimizer steps, rlhfkit rollouts (each ppo.ppo_epochs x "
            "ppo.batch_size / ppo.minibatch_size optimizer steps)"),
        "temperature": ("ppo.temperature", "the same, 1.0 by default; the log-probs are taken at it, as in TRL"),
        "max_prompt_length": ("data.max_prompt_length", "the longest prompt in tokens, cut from the left "
            "(data.truncation); not a key of TRL 1.16's GRPOConfig and RLOOConfig"),
        "max_completion_length": ("ppo.max_new_tokens", "TRL's default 512; rlhfkit's: the built-in task's "
            "longest answer, and required with data.path"),
        "beta": ("ppo.kl_coef", "TRL's GRPO 0.0 by default (k3 in the loss, times the ratio: see "
            "use_bias_correction_kl), its RLOO 0.05 (k1 summed in the reward); rlhfkit's grpo, rloo and reinforce "
            "0.3 with full fine-tuning (k3 in the loss), 0 with LoRA"),
        "use_bias_correction_kl": ("ppo.kl_estimator", "TRL's default true multiplies its k3 term by the ratio, "
            "whose gradient is then k2's (the reverse KL's): ppo.kl_estimator=k2; false is k3, rlhfkit's default"),
        "epsilon": ("ppo.clip_range", "the ratio's lower clip (and upper, without ppo.epsilon_high), 0.2 in both"),
        "scale_rewards": ("ppo.scale_rewards", "TRL's GRPO divides by each group's std by default ('group'), "
            "rlhfkit by the batch's ('batch')"),
        "normalize_advantages": ("ppo.scale_rewards", "TRL's RLOO: true is ppo.scale_rewards=advantages, its "
            "default false is 'none'; rlhfkit's default is 'batch'"),
        "loss_type": ("ppo.loss_type", "TRL's default 'dapo', rlhfkit's 'token_mean': the same when one "
            "generation batch is one optimizer step, as by TRL's default"),
        "entropy_coef": ("ppo.entropy_coef", "TRL adds the bonus as a token mean whatever its loss_type; rlhfkit "
            "reduces it by ppo.loss_type, as every per-token loss"),
        "importance_sampling_level": ("ppo.importance_sampling_level", "the same 'token' and 'sequence'; "
            "'sequence' with a ppo.loss_type that sums tokens (all but grpo and sapo) weighs each sequence by its "
            "length: a warning, as in TRL"),
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
            "TRL's ['sigmoid', 'sft'] is rlhfkit's default (dpo.nll_coef=1), TRL's default ['sigmoid'] is "
            "dpo.nll_coef=0"),
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
            "2e-5 decays linearly to 0; unset, sft.lr follows model.regime (2e-5 for a pretrained model)"),
        "lr_scheduler_type": ("", "sft warms up linearly (sft.warmup_steps) and decays by a cosine to 10% of "
            "sft.lr; TRL decays linearly to 0 by default"),
        "warmup_ratio": ("sft.warmup_steps", "steps, not a share: warmup_ratio x sft.steps"),
        "per_device_train_batch_size": ("sft.micro_batch_size", "rows per forward and backward pass, per process; "
            "one optimizer step's rows are sft.batch_size"),
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


def trl_hint(section: str, name: str) -> str:
    """" TRL's NAME is KEY here: WHAT DIFFERS." for a key of the TRL config ``section`` takes over, else ""."""
    if name not in TRL_KEYS.get(section, {}):
        return ""
    key, note = TRL_KEYS[section][name]
    return f" TRL's {name} {f'is {key} here' if key else 'has no rlhfkit key'}: {note}."
