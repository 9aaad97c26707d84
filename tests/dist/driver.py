"""Runs one step of every trainer through the CLI; launched by tests/test_distributed.py with one
process (plain python), with two (``accelerate launch``) and on two nodes of one process each
(``torchrun --nnodes 2``). Usage: driver.py OUT POLICY RM [RUN ...]: the named runs only, else all."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from rlhfkit.cli.main import main
from rlhfkit.models import forward as models
from rlhfkit.trainers import rl_setup

out, policy, rm = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
common = ["run.device=cpu", "accel.threads=1", "run.progress=false", "run.seed=0", f"model.name={policy}"]
# the RL commands run with their own defaults (batch 64 in minibatches of 32, two epochs, groups of 4
# for grpo / rloo, 3 critic warm-up steps for ppo) for two steps -- ppo for four, the last one past
# the warm-up: a minibatch holds rows of both processes' shards in proportions that vary
defaults = ["ppo.steps=2", f"reward.name={rm}"]
# smaller runs for the variants: one step, batch 8
rl = ["ppo.steps=1", "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.ppo_epochs=2", "ppo.critic_warmup_steps=0",
      "ppo.max_new_tokens=6", f"reward.name={rm}"]
runs = {  # run name: (command, overrides)
    "ppo": ("ppo", [*defaults, "ppo.steps=4"]),
    # a critic warm-up step on a shared value head (the actor gets no gradient), then a full step: the
    # actor's optimizer state must be as in one process (no zero gradients stepped during the warm-up)
    "ppo_warmup": ("ppo", [*rl, "ppo.critic_warmup_steps=1", "ppo.value_model=shared", "ppo.steps=2"]),
    "grpo": ("grpo", defaults),
    "rloo": ("rloo", defaults),
    "reinforce": ("reinforce", defaults),
    "ppo_separate": ("ppo", [*rl, "ppo.value_model=separate"]),  # a critic model of its own (ppo: a value head on the policy)
    # LoRA on the policy (the reference: the adapter switched off) and on the critic
    "ppo_lora": ("ppo", [*rl, "model.lora_r=4", "model.lora_alpha=8", "value.lora=true"]),
    "grpo_lora": ("grpo", [*rl, "ppo.group_size=4", "model.lora_r=4", "model.lora_alpha=8"]),
    # the user's prompt file (3 prompts: the second step starts a new pass), its columns read by the
    # verifier, weighted with the reward model; held-out prompts scored by both on every step
    # (minibatches of one group: each is held whole by one process, and the other runs a zero-weight pass)
    "grpo_file": ("grpo", [*rl, "ppo.group_size=4", "ppo.minibatch_size=4", "ppo.steps=2", "ppo.eval_every=1",
                           "ppo.stop_at=0",
                           f"data.path={Path(policy).parent / 'prompts.jsonl'}",
                           f"data.eval_path={Path(policy).parent / 'held.jsonl'}",
                           "reward.function=rlhfkit.tasks.doubling:format_reward", "reward.weights=1,2"]),
    # GRPO's per-sequence mean (ppo.loss_type=grpo, weighted by rows, not tokens) with GSPO's sequence
    # ratios, in micro-batches: minibatches of 3 groups of 2 hold 4 rows of one process and 2 of the other
    "grpo_seqmean": ("grpo", [*rl, "ppo.batch_size=12", "ppo.minibatch_size=6", "ppo.group_size=2",
                              "ppo.loss_type=grpo", "ppo.importance_sampling_level=sequence", "ppo.micro_batch_size=2"]),
    # gradient checkpointing: the lean forward checkpoints each layer itself, the group's prompt shared
    "grpo_ckpt": ("grpo", [*rl, "ppo.group_size=4", "model.gradient_checkpointing=true"]),
    # AdamW's moments and the reference in host memory outside the phases that read them (under DDP the
    # optimizer is accelerate's wrapper)
    "grpo_offload": ("grpo", [*rl, "ppo.group_size=4", "accel.offload=true"]),
    # multi-turn episodes (three turns, observations between them, per-turn rewards): the environment's
    # rewards alone (grpo), and added to the reward model's score with GAE over the turns (ppo)
    "grpo_env": ("grpo", [*rl[:-1], "ppo.group_size=4", f"env.class={Path(__file__).parent / 'echo_env.py'}:Echo"]),
    "ppo_env": ("ppo", [*rl, f"env.class={Path(__file__).parent / 'echo_env.py'}:Echo"]),
    # full fine-tuning on bfloat16 copies of float32 weights (model.master_weights), in micro-batches
    # of 3 rows: each process's bfloat16 gradients summed into float32 ones, DDP's all-reduce in float32
    "grpo_master": ("grpo", [*rl, "ppo.group_size=4", "model.dtype=bfloat16", "model.master_weights=true",
                             "ppo.micro_batch_size=3"]),
    # DPO, SFT and the reward model with their default batches, for two steps
    "dpo": ("dpo", ["dpo.steps=2", "dpo.num_pairs=64"]),
    "sft": ("sft", ["sft.steps=2"]),
    "rm": ("rm", ["reward.steps=2", "reward.eval_pairs=64"]),
}
# ppo and grpo with their defaults once more, their update's log-probs computed a few rows of logits
# at a time as at a real vocabulary, where 2**24 logits a chunk is ~340 rows of SmolLM2's 49,152 ids:
# a logits budget (ActorCritic's logits_budget) of 4 rows of the doubling task's 42 ids takes that path (each
# process scaling its share of the global token mean)
runs.update({f"{name}_chunked": runs[name] for name in ("ppo", "grpo")})
CHUNK_LOGITS = 4 * 42
# the same in micro-batches of 3 rows per process (gradient sync on the last one only)
runs.update({f"{name}_micro": (cmd, [*args, f"{'reward' if cmd == 'rm' else cmd}.micro_batch_size=3"])
             for name, (cmd, args) in list(runs.items()) if name in ("ppo", "dpo", "sft", "rm")})
only = sys.argv[4:]
if unknown := set(only) - set(runs):
    sys.exit(f"unknown runs {sorted(unknown)}; known: {list(runs)}")
chunked_calls = 0
chunked_token_logprobs = models.chunked_token_logprobs


def counted_chunked_token_logprobs(*args, **kwargs):
    global chunked_calls
    if torch.is_grad_enabled():  # the update's calls, not the experience pass's
        chunked_calls += 1
    return chunked_token_logprobs(*args, **kwargs)


models.chunked_token_logprobs = counted_chunked_token_logprobs
actor_critic = rl_setup.ActorCritic
for name, (cmd, args) in runs.items():
    if only and name not in only:
        continue
    chunked_calls = 0  # the _chunked runs build their actor-critic with the small budget (an argument)
    rl_setup.ActorCritic = (functools.partial(actor_critic, logits_budget=CHUNK_LOGITS) if name.endswith("_chunked")
                            else actor_critic)
    if main([cmd, *common, *args, f"run.out_dir={out / name}"]) != 0:
        sys.exit(f"rlhfkit {cmd} ({name}) failed")
    print(f"chunked update calls in {name}: {chunked_calls}", flush=True)  # every process prints its own

from accelerate import PartialState  # noqa: E402  (the state the trainers ran under)

state = PartialState()
if state.is_main_process:
    (out / "world.json").write_text(json.dumps({"num_processes": state.num_processes,
                                                "distributed_type": str(state.distributed_type)}))
