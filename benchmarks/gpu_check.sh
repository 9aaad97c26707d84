#!/bin/bash
# The GPU checks in one go, for a machine with one CUDA GPU and little time on it:
#   1. the CUDA tests of the decode paths: tests/test_triton_decode.py and the fixed-shape
#      (CUDA-graph) decode of tests/test_lean.py, PyTorch's attention and Triton's;
#      FULL_TESTS=1 runs all of tests/test_lean.py and tests/test_offload.py instead;
#   2. update_peak.py on the `short` row that meets the time goal there (graph, checkpointing,
#      offload): every tensor alive at its update's peak, by what made it (OUT_DIR/update_peak.txt);
#   3. real_step.py's GPU rows, one process each, in two rounds (the second in another order),
#      until BUDGET seconds have passed (no row starts after that); OUT_DIR/results.jsonl and a
#      log are copied to COPY_TO (if set) after every row.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]          # default runs/gpu_check; BUDGET=420 by default
#
# WHEELS=DIR installs the wheels in DIR first (no index, into /tmp/site): TRL and what the
# machine's Python lacks, for a machine without the network (on an H200 image with torch
# 2.11.0+cu130: trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, tensorboardX and
# transformers 5.24.0 were enough). SHAPE_FROM=DIR is the directory
# with SmolLM2-135M-Instruct's config and tokenizer for the `short` rows (default: the model
# `rlhfkit fetch-model smollm2-135m-instruct` saved); without it those rows are left out.
# TOKENIZER=DIR: a GPT-2-sized tokenizer real_step.py trained before (its OUT_DIR/tokenizer_gpt2),
# copied in so the machine does not train one. RLHFKIT_BENCH_COMMIT=SHA dates the stored rows where
# the machine's copy of the tree has no git history or a stale one. `real_step.py ... --out
# OUT_DIR --report` prints the tables again.
set -u
OUT_DIR=${1:-runs/gpu_check}
BUDGET=${BUDGET:-420}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
mkdir -p "$OUT_DIR"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

[ -n "${TOKENIZER:-}" ] && [ ! -d "$OUT_DIR/tokenizer_gpt2" ] && cp -r "$TOKENIZER" "$OUT_DIR/tokenizer_gpt2"
save() { [ -n "${COPY_TO:-}" ] && cp "$OUT_DIR/results.jsonl" "$OUT_DIR/log.txt" "$OUT_DIR/tests.txt" \
  "$OUT_DIR/update_peak.txt" "$COPY_TO/" 2>/dev/null; true; }

echo "== CUDA tests [$(el) s]"
if [ -n "${FULL_TESTS:-}" ]; then TESTS="tests/test_lean.py tests/test_offload.py tests/test_triton_decode.py"; K=""
else TESTS="tests/test_triton_decode.py tests/test_lean.py"; K="triton or fixed_shape"; fi
RLHFKIT_TEST_DEVICE=cuda timeout 150 python3 -m pytest -rf -p no:cacheprovider -W ignore $TESTS ${K:+-k "$K"} \
  > "$OUT_DIR/tests.txt" 2>&1
save; grep -E "^FAILED|[0-9]+ (passed|failed)" "$OUT_DIR/tests.txt"

SHAPE_FROM=${SHAPE_FROM:-$HOME/.cache/rlhfkit/models/smollm2-135m-instruct}
R="--device cuda --size gpt2 --workload reasoning --runs 1 --out $OUT_DIR"
S="--device cuda --size smollm2-init --shape-from $SHAPE_FROM --workload short --runs 1 --out $OUT_DIR"
[ -f "$SHAPE_FROM/config.json" ] || { echo "no $SHAPE_FROM/config.json: the short rows are left out"; S=""; }
if [ -n "$S" ]; then
  echo "== update_peak.py, short, graph + checkpointing + offload [$(el) s]"
  timeout 150 python3 benchmarks/update_peak.py --device cuda --size smollm2-init --shape-from "$SHAPE_FROM" \
    --workload short --rows rlhfkit_grpo_graph_ckpt_offload --out "$OUT_DIR" > "$OUT_DIR/update_peak.txt" 2>&1
  save; grep -A 14 "^update's phase peak" "$OUT_DIR/update_peak.txt"
fi
# round 1, then round 2 in another order; the long completions (GPT-2 small's shape) first
for spec in "R rlhfkit_grpo_graph" "R trl_grpo_ckpt" "R rlhfkit_grpo_graph_ckpt_offload" "R trl_grpo" \
            "R rlhfkit_grpo_graph_torchattn" \
            "S rlhfkit_grpo_graph" "S trl_grpo_ckpt" "S rlhfkit_grpo_graph_ckpt_offload" "S trl_grpo" \
            "R trl_grpo_ckpt" "R rlhfkit_grpo_graph_ckpt_offload" "R trl_grpo" "R rlhfkit_grpo_graph" \
            "S trl_grpo" "S rlhfkit_grpo_graph_ckpt_offload" "S trl_grpo_ckpt" "S rlhfkit_grpo_graph" \
            "R rlhfkit_grpo_graph_torchattn" "R rlhfkit_grpo_graph_ckpt_offload_torchattn" "R rlhfkit_grpo"; do
  set -- $spec
  [ "$(el)" -gt "$BUDGET" ] && { echo "$BUDGET s spent: stopping before $spec"; break; }
  if [ "$1" = S ]; then [ -n "$S" ] || continue; args=$S; else args=$R; fi
  echo "== $spec [$(el) s]"
  timeout 150 python3 benchmarks/real_step.py $args --rows "$2" >> "$OUT_DIR/log.txt" 2>&1
  grep -E "run [0-9]+:|Error|Traceback" "$OUT_DIR/log.txt" | tail -1
  save
done
echo "== tables [$(el) s]"
python3 benchmarks/real_step.py $R --report 2>&1 | tail -12 | tee "$OUT_DIR/reasoning.txt"
[ -n "$S" ] && python3 benchmarks/real_step.py $S --report 2>&1 | tail -12 | tee "$OUT_DIR/short.txt"
echo "done in $(el) s"
