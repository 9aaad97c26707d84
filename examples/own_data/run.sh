#!/usr/bin/env bash
# The SFT -> reward model -> PPO / GRPO / DPO pipeline on files, end to end on a laptop CPU.
#
# The files come from the built-in city-facts task (`rlhfkit export-task cities DIR`), so the
# numbers can be compared with `rlhfkit demo run.task=cities`; any files in the same formats
# work the same way (docs/data.md). Usage: examples/own_data/run.sh [OUT_DIR]
# (PYTHON, RLHFKIT: see examples/env.sh)
set -euo pipefail
OUT=${1:-runs/own_data}
. "$(cd "$(dirname "$0")" && pwd)/../env.sh"
TASK=(run.task=cities model.n_layer=3 model.n_embd=96)   # the base model's size (built from scratch)
RERUN=run.overwrite=true   # running the script again replaces its earlier runs under OUT_DIR

# 0. a base model that knows the facts but answers tersely, and the task's data as files
$RLHFKIT pretrain $RERUN "${TASK[@]}" pretrain.steps=600 run.out_dir="$OUT/base"
$RLHFKIT export-task cities "$OUT/data"

# 1. a reward model from the preference file, held-out pairs from their own file
$RLHFKIT rm $RERUN model.name="$OUT/base/policy" data.path="$OUT/data/prefs.jsonl" \
    data.eval_path="$OUT/data/prefs_eval.jsonl" reward.steps=300 run.out_dir="$OUT/rm"

# 2. PPO on the prompt file with the reward model; the verifier (which reads each record's
#    'country' column) rides along with weight 0, so eval/accuracy reports held-out exactness.
#    The learned reward is over-optimised after ~15-20 steps: stop at 0.95 held-out accuracy
$RLHFKIT ppo $RERUN model.name="$OUT/base/policy" data.path="$OUT/data/prompts.jsonl" \
    data.eval_path="$OUT/data/eval_prompts.jsonl" reward.name="$OUT/rm/reward_model" \
    reward.function=rlhfkit.tasks.cities:exact_reward reward.weights=1,0 ppo.max_new_tokens=32 ppo.lr=1e-4 \
    ppo.steps=40 ppo.eval_every=5 ppo.stop_metric=eval/accuracy ppo.stop_at=0.95 run.out_dir="$OUT/ppo"

# 3. GRPO on the same prompts with the verifier itself as the reward
$RLHFKIT grpo $RERUN model.name="$OUT/base/policy" data.path="$OUT/data/prompts.jsonl" \
    data.eval_path="$OUT/data/eval_prompts.jsonl" reward.function=rlhfkit.tasks.cities:exact_reward \
    ppo.max_new_tokens=32 ppo.lr=1e-4 ppo.steps=20 ppo.eval_every=10 ppo.stop_at=0 run.out_dir="$OUT/grpo"

# 4. DPO on the preference file, no reward model, no sampling
$RLHFKIT dpo $RERUN model.name="$OUT/base/policy" data.path="$OUT/data/prefs.jsonl" \
    data.eval_path="$OUT/data/prefs_eval.jsonl" dpo.lr=3e-4 dpo.steps=50 dpo.eval_every=25 run.out_dir="$OUT/dpo"

# 5. every policy on the held-out prompts, scored by the verifier, against the base
for algo in ppo grpo dpo; do
  $RLHFKIT eval "$OUT/$algo" data.path="$OUT/data/eval_prompts.jsonl" ppo.max_new_tokens=32 \
      reward.function=rlhfkit.tasks.cities:exact_reward eval.baseline="$OUT/base/policy" run.out_dir="$OUT/eval_$algo"
done
