#!/usr/bin/env bash
# The whole RLHF pipeline with LoRA on a real pretrained chat model (SmolLM2-135M-Instruct),
# offline, on one CPU core, on files in TRL's conversational formats:
#
#   SFT on chat demonstrations -> a reward model on preference pairs -> PPO (LoRA policy and a
#   LoRA critic, on the reward model) and GRPO (the exact-answer verifier plus the reward model)
#   -> DPO on the same pairs; every policy evaluated against the base on 32 held-out cities.
#
# The task: "In which country is the city of Jaipur? Answer with the country's name only." The
# base answers in whole sentences and often names the wrong country (held-out exact 0.00,
# contains 0.53); the answer is checked exactly, so tuning cannot fake it, and a one-word answer
# keeps every stage short. Files: examples/real_model/make_pipeline_data.py.
#
# Usage: examples/real_model/pipeline.sh [OUT_DIR]   (runs/real_pipeline by default)
#   MODEL_DIR=DIR: the model fetched to a directory of your own; PYTHON, RLHFKIT: see examples/env.sh
#   CORE=1 picks the CPU core; SFT_STEPS=8 RM_STEPS=10 PPO_STEPS=6 GRPO_STEPS=8 DPO_STEPS=10 the
#   stages' lengths (SFT_STEPS=3 leaves the later stages more to do: docs/real-models.md)
# Writes OUT_DIR/{data,sft,rm,ppo,grpo,dpo,eval_*,times}/ and prints the table of
# examples/real_model/pipeline_table.py (held-out numbers, CPU and wall seconds per stage).
set -euo pipefail
OUT=${1:-runs/real_pipeline}
CORE=${CORE:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../env.sh"
RW="$HERE/rewards.py"
COMMON=(run.overwrite=true accel.threads=1 run.progress=false run.checkpoint_every=0 model.lora_r=16)
mkdir -p "$OUT/times"

# each stage pinned to one core, its CPU seconds (user + sys), wall seconds and peak RSS recorded
stage() {
    local name=$1; shift
    echo "== $name: $*" | cut -c1-300
    /usr/bin/time -f "%U %S %e %M" -o "$OUT/times/$name.txt" taskset -c "$CORE" "$@"
}

[ -n "${MODEL_DIR:-}" ] || stage fetch $RLHFKIT fetch-model smollm2-135m-instruct   # a no-op once cached
BASE=$(model_dir smollm2-135m-instruct)
$PYTHON "$HERE/make_pipeline_data.py" "$OUT/data" --sft 32
D=$OUT/data

# 1. SFT with LoRA on 32 one-word demonstrations (8 steps of 8)
stage sft $RLHFKIT sft "${COMMON[@]}" model.name="$BASE" data.path="$D/sft.jsonl" \
    sft.steps=${SFT_STEPS:-8} sft.batch_size=8 sft.lr=1e-3 sft.warmup_steps=1 run.out_dir="$OUT/sft"

# 2. a reward model from the SFT policy (its backbone with LoRA, a new scalar head) on the pairs
stage rm $RLHFKIT rm "${COMMON[@]}" model.name="$OUT/sft/policy" data.path="$D/prefs.jsonl" \
    data.eval_path="$D/prefs_eval.jsonl" reward.steps=${RM_STEPS:-10} reward.batch_size=8 reward.lr=1e-3 \
    run.out_dir="$OUT/rm"

# 3. PPO on the reward model alone, a LoRA critic started from it (one critic-only step first);
#    the verifier rides along with weight 0, logged as reward/exact. The held-out evaluation is
#    stage 6's, so the runs themselves read no held-out prompts
stage ppo $RLHFKIT ppo "${COMMON[@]}" model.name="$OUT/sft/policy" data.path="$D/prompts.jsonl" \
    reward.name="$OUT/rm/reward_model" reward.function="$RW:exact" reward.weights=1,0 value.lora=true \
    ppo.critic_warmup_steps=1 ppo.batch_size=16 ppo.minibatch_size=16 ppo.ppo_epochs=1 ppo.max_new_tokens=16 \
    ppo.steps=${PPO_STEPS:-6} ppo.stop_at=0 run.out_dir="$OUT/ppo"

# 4. GRPO on the verifier plus the reward model (groups of 4)
stage grpo $RLHFKIT grpo "${COMMON[@]}" model.name="$OUT/sft/policy" data.path="$D/prompts.jsonl" \
    reward.name="$OUT/rm/reward_model" reward.function="$RW:exact" reward.weights=1,1 ppo.batch_size=16 \
    ppo.max_new_tokens=16 ppo.steps=${GRPO_STEPS:-8} ppo.stop_at=0 run.out_dir="$OUT/grpo"

# 5. DPO on the pairs (the reference is the SFT policy: the adapter switched off)
stage dpo $RLHFKIT dpo "${COMMON[@]}" model.name="$OUT/sft/policy" data.path="$D/prefs.jsonl" \
    data.eval_path="$D/prefs_eval.jsonl" dpo.steps=${DPO_STEPS:-10} dpo.batch_size=8 dpo.lr=5e-4 \
    dpo.precompute_ref=false dpo.eval_every=0 run.out_dir="$OUT/dpo"

# 6. every policy greedily on the held-out cities against the base: the verifier's accuracy, the
#    share naming the right country, win rates under each reward, KL to the base along its answers
for policy in sft ppo grpo dpo; do
    stage "eval_$policy" $RLHFKIT eval "$OUT/$policy" data.path="$D/held.jsonl" \
        reward.name="$OUT/rm/reward_model" reward.function="$RW:exact,$RW:contains" reward.weights=1,1,0 \
        eval.max_new_tokens=24 eval.baseline="$BASE" accel.threads=1 run.out_dir="$OUT/eval_$policy"
done
$PYTHON "$HERE/pipeline_table.py" "$OUT"
