#!/usr/bin/env bash
# GRPO with LoRA on a real pretrained chat model (SmolLM2-135M-Instruct), offline, on one CPU core:
# the city-country task (which country is a city in, answered with the country's name alone),
# 98 training and 32 held-out cities, rewards from examples/real_model/rewards.py.
# Usage: examples/real_model/run.sh [OUT_DIR] [overrides...]
#   MODEL_DIR=DIR: the model fetched to a directory of your own; PYTHON, RLHFKIT: see examples/env.sh
set -euo pipefail
OUT=${1:-runs/real_model}; shift || true
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../env.sh"

MODEL=$(model_dir smollm2-135m-instruct)          # fetched on the first call, cached after
$PYTHON "$HERE/make_data.py" "$OUT/data"

# exact is the 0/1 verifier (eval/accuracy); contains and brevity shape it: the base answers in
# whole sentences, so exact alone would give groups without any signal
taskset -c 0 $RLHFKIT grpo run.overwrite=true model.name="$MODEL" model.lora_r=16 \
    data.path="$OUT/data/prompts.jsonl" data.eval_path="$OUT/data/held.jsonl" \
    reward.function="$HERE/rewards.py:exact,$HERE/rewards.py:contains,$HERE/rewards.py:brevity" \
    reward.weights=1,1,1 ppo.batch_size=16 ppo.max_new_tokens=16 ppo.steps=60 ppo.eval_every=10 \
    ppo.stop_at=0 accel.threads=1 run.out_dir="$OUT/grpo" "$@"
