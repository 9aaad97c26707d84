#!/usr/bin/env bash
# The calculator task on a real chat model (SmolLM2-135M-Instruct), offline, on one CPU core:
# products of a 3-digit and a 2-digit number, which the model cannot compute alone, with a
# calculator tool (calculator.py) offered through a ToolEnvironment.
#   1. SFT warm-up with LoRA on tool-use demonstrations (the base never writes a tool call):
#      8 questions, 4 steps of 8 -- 2 steps leave no greedy call, 8 solve the held-out set alone
#   2. GRPO with LoRA, the episodes played by env.class=calculator.py:CalculatorEnv
#   3. held-out accuracy of greedy episodes: the base without the tool, the base with the tool
#      offered, the warm-up, the GRPO policy (evaluate.py)
# Usage: examples/real_model/calculator/run.sh [OUT_DIR] [grpo overrides...]
# SFT_PAIRS (demonstrated questions, 2 records each) and SFT_STEPS size the warm-up; MODEL_DIR=DIR:
# the model fetched to a directory of your own; PYTHON, RLHFKIT: see examples/env.sh.
set -euo pipefail
OUT=${1:-runs/calculator}; shift || true
CORE=${CORE:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../../env.sh"
COMMON=(run.overwrite=true accel.threads=1 run.progress=false run.checkpoint_every=0 model.lora_r=16)
mkdir -p "$OUT/times"

# each stage pinned to one core, its CPU seconds (user + sys), wall seconds and peak RSS recorded
stage() {
    local name=$1; shift
    echo "== $name: $*" | cut -c1-300
    /usr/bin/time -f "%U %S %e %M" -o "$OUT/times/$name.txt" taskset -c "$CORE" "$@"
}

BASE=$(model_dir smollm2-135m-instruct)          # fetched on the first call, cached after
$PYTHON "$HERE/make_data.py" "$OUT/data" --sft "${SFT_PAIRS:-8}"
D=$OUT/data

stage sft $RLHFKIT sft "${COMMON[@]}" model.name="$BASE" data.path="$D/sft.jsonl" \
    sft.steps=${SFT_STEPS:-4} sft.batch_size=8 sft.lr=1e-3 sft.warmup_steps=1 sft.assistant_turns=last \
    run.out_dir="$OUT/sft"

stage grpo $RLHFKIT grpo "${COMMON[@]}" model.name="$OUT/sft/policy" data.path="$D/prompts.jsonl" \
    env.class="$HERE/calculator.py:CalculatorEnv" ppo.batch_size=16 ppo.max_new_tokens=40 \
    ppo.steps=10 ppo.eval_every=0 ppo.stop_at=0 run.out_dir="$OUT/grpo" "$@"

stage eval_base_no_tool $PYTHON "$HERE/evaluate.py" "$BASE" "$D/held_no_tool.jsonl" --no-tool --max-new-tokens 16 | tee "$OUT/eval_base_no_tool.txt"
stage eval_base_tool $PYTHON "$HERE/evaluate.py" "$BASE" "$D/held.jsonl" | tee "$OUT/eval_base_tool.txt"
stage eval_sft $PYTHON "$HERE/evaluate.py" "$OUT/sft/policy" "$D/held.jsonl" | tee "$OUT/eval_sft.txt"
stage eval_grpo $PYTHON "$HERE/evaluate.py" "$OUT/grpo/policy" "$D/held.jsonl" | tee "$OUT/eval_grpo.txt"
