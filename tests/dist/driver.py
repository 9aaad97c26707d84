"""Runs one step of every trainer through the CLI; launched by tests/test_distributed.py with one
process (plain python), with two (``accelerate launch``) and on two nodes of one process each
(``torchrun --nnodes 2``). Usage: driver.py OUT POLICY RM [RUN ...]: the named runs only, else all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlhfkit.cli import main

out, policy, rm = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
common = ["run.device=cpu", "run.threads=1", "run.progress=false", "run.seed=0", f"model.name={policy}"]
rl = ["ppo.steps=1", "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.ppo_epochs=2", "ppo.critic_warmup_steps=0",
      "ppo.max_new_tokens=6", f"reward.name={rm}"]
runs = {  # run name: (command, overrides)
    "ppo": ("ppo", rl),
    # a critic warm-up step on a shared value head (the actor gets no gradient), then a full step: the
    # actor's optimizer state must be as in one process (no zero gradients stepped during the warm-up)
    "ppo_warmup": ("ppo", [*rl, "ppo.critic_warmup_steps=1", "ppo.value_model=shared", "ppo.steps=2"]),
    "grpo": ("grpo", [*rl, "ppo.group_size=4"]),
    "rloo": ("rloo", [*rl, "ppo.group_size=4"]),
    "reinforce": ("reinforce", rl),
    "ppo_shared": ("ppo", [*rl, "ppo.value_model=shared"]),  # a value head on the policy's last hidden states
    # LoRA on the policy (the reference: the adapter switched off) and on the critic
    "ppo_lora": ("ppo", [*rl, "model.lora_r=4", "model.lora_alpha=8", "value.lora=true"]),
    "grpo_lora": ("grpo", [*rl, "ppo.group_size=4", "model.lora_r=4", "model.lora_alpha=8"]),
    # the user's prompt file (3 prompts: the second step starts a new pass), its columns read by the
    # verifier, weighted with the reward model; held-out prompts scored by both on every step
    "grpo_file": ("grpo", [*rl, "ppo.group_size=4", "ppo.steps=2", "ppo.eval_every=1", "ppo.stop_at=0",
                           f"data.path={Path(policy).parent / 'prompts.jsonl'}",
                           f"data.eval_path={Path(policy).parent / 'held.jsonl'}",
                           "reward.function=rlhfkit.tasks.doubling:format_reward", "reward.weights=1,2"]),
    "dpo": ("dpo", ["dpo.steps=1", "dpo.batch_size=8", "dpo.num_pairs=64"]),
    "sft": ("sft", ["sft.steps=1", "sft.batch_size=8"]),
    "rm": ("rm", ["reward.steps=1", "reward.batch_size=8", "reward.eval_pairs=64"]),
}
# the same in micro-batches of 3 rows per process (gradient sync on the last one only)
runs.update({f"{name}_micro": (cmd, [*args, f"{'reward' if cmd == 'rm' else cmd}.micro_batch_size=3"])
             for name, (cmd, args) in list(runs.items()) if name in ("ppo", "dpo", "sft", "rm")})
only = sys.argv[4:]
if unknown := set(only) - set(runs):
    sys.exit(f"unknown runs {sorted(unknown)}; known: {list(runs)}")
for name, (cmd, args) in runs.items():
    if only and name not in only:
        continue
    if main([cmd, *common, *args, f"run.out_dir={out / name}"]) != 0:
        sys.exit(f"rlhfkit {cmd} ({name}) failed")

from accelerate import PartialState  # noqa: E402  (the state the trainers ran under)

state = PartialState()
if state.is_main_process:
    (out / "world.json").write_text(json.dumps({"num_processes": state.num_processes,
                                                "distributed_type": str(state.distributed_type)}))
