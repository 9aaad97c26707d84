"""One RL step at real model sizes: rlhfkit's GRPO (and PPO) against TRL's GRPOTrainer, phase by
phase, with the peak resident memory of each phase and the tokens each contender pushes through
the model, so a time ratio can be split into less arithmetic and a faster implementation.

Models (float32), ``--size``:

    gpt2     GPT-2 small's config, random init: 12 layers, width 768, 12 heads, vocabulary 50257 (124M)
    qwen     Qwen2.5-0.5B's config, random init: 24 layers, width 896, 14 heads / 2 KV heads, MLP
             4864, vocabulary 151936, tied embeddings (494M)
    smollm2  the real chat model SmolLM2-135M-Instruct (``rlhfkit fetch-model
             smollm2-135m-instruct``, cached; loaded as is): 30 layers, width 576, 9 heads / 3 KV
             heads, vocabulary 49152, tied embeddings (135M)
    smollm2-init  the same model's config, tokenizer and generation config with random weights:
             the same arithmetic where the converted weights cannot travel (``--shape-from DIR``:
             a directory holding them, by default the fetched model's)

The random-init models get a byte-level BPE tokenizer of the model's full vocabulary, trained
here with ``tokenizers`` on the Python standard library's sources; ``--layers`` keeps fewer of
their layers (cached under ``--out``). Prompts are windows of those sources, each exactly the
workload's prompt length in the model's tokenizer (plain text, no chat template), in a JSONL file.

Workloads, ``--workload`` (``--prompt-tokens``, ``--new-tokens``, ``--groups``, ``--group-size``
and ``--micro`` override one knob):

    short      16 prompts of 128 tokens x 4 samples x 64 new tokens, micro-batches of 16
    reasoning  8 prompts of 64 tokens x 8 samples x 512 new tokens, micro-batches of 8 (one
               group; 8 x 576 positions, 1.5x a short micro-batch's 16 x 192)

Both keep 64 completions per step. Every completion runs to the new-token limit, so a real
model that would stop early does the same work in both libraries: the worker gives rlhfkit's
rollout an EOS id no token has (``rl.eos_token_ids``), TRL ``generation_kwargs={"min_new_tokens":
R}`` (its EOS logits masked until then); each run checks the completions' mean length. Everything
runs on a CPU (TRL ``use_cpu=True``), so the ratios are CPU ratios, unless ``--device cuda``:
then every row runs on the GPU (float32 weights, TF32 matrix products for both libraries), the
phases are timed after the GPU's queued work, and the peaks are the CUDA allocator's
(``torch.cuda.max_memory_allocated``, reset at each phase); TRL's head then scores completion
positions only as shipped (its Triton path), so the ``_compact`` rows are not run there. Temperature 1, no top-k /
top-p; reward: a cheap function of the text (share of letters), the same callable for both. One
optimizer step of the 64 completions, a k3 KL term of weight 0.3 in the loss against the
reference (the base model; with LoRA the base with the adapter disabled), scores divided by
the batch's std, dropout off.

Rows (``--rows``; default: the GRPO rows without LoRA that the device runs):

    rlhfkit_grpo           ``rlhfkit grpo``'s defaults but one epoch of one minibatch of 64
                           (``ppo.ppo_epochs=1 ppo.minibatch_size=64 ppo.micro_batch_size=MICRO``);
                           each group's prompt runs once in the rollout's prefill, the reference
                           forward and the update (``rlhfkit.accel.forward.repeated_rows`` /
                           ``shared_prompts``), no gradient checkpointing
    rlhfkit_grpo_unshared  the same with every row's prompt run in full: a benchmark-only switch
                           in the worker makes ``rlhfkit.accel.forward.repeated_rows`` and
                           ``rlhfkit.accel.forward.shared_prompts`` return None (what they do when sharing
                           does not pay); the positions of TRL's completion-position rows
                           through the head, and through the body but the last column
    rlhfkit_grpo_graph     the first row with ``accel.cuda_graph=true``: each decode step replayed as
                           a CUDA graph (GPU only; on a CPU the same fixed-shape step runs eagerly),
                           its attention the Triton kernel of ``rlhfkit.triton_decode`` where Triton
                           imports; ``rlhfkit_grpo_graph_torchattn`` and
                           ``rlhfkit_grpo_graph_ckpt_offload_torchattn`` keep PyTorch's attention
                           over bands of columns (``accel.enabled=off``), as before that kernel
    rlhfkit_grpo_ckpt      the first row with ``model.gradient_checkpointing=true``: the update's
                           shared-prompt forward keeps each layer's input only and runs the layer
                           again in the backward; rollout and reference as in the first row
    rlhfkit_grpo_ckpt_offload  ``rlhfkit_grpo_ckpt`` with ``accel.offload=true``: AdamW's moments in
                           host memory from the step's start to the update, the reference's
                           weights there outside the experience pass (GPU only; on a CPU host
                           and device memory are one). The moments' copy to the host is timed
                           as the rollout's, their copy back as the update's
    rlhfkit_grpo_graph_ckpt_offload  the three switches together (GPU only)
    rlhfkit_grpo_offheap   the first row with ``accel.update_off_heap=true``: during the update every
                           tensor of 1 MiB or more mapped on its own and handed back when freed
                           (glibc; CPU only, not in the default rows). ``rlhfkit_grpo_offheap_thp``
                           adds ``THP_MEM_ALLOC_ENABLE=1`` (below)
    rlhfkit_grpo_jemalloc  the first row in a worker with jemalloc in place of glibc's malloc
                           (``LD_PRELOAD``, as ``accel.malloc=jemalloc`` sets it: the system's
                           library, Debian's ``libjemalloc2``);
                           ``rlhfkit_grpo_tcmalloc`` the same with tcmalloc
                           (``libtcmalloc-minimal4``), ``trl_grpo_compact_jemalloc`` and
                           ``trl_grpo_compact_ckpt_tcmalloc`` TRL's rows on them. CPU only, not in
                           the default rows
    rlhfkit_grpo_mkl       the first row with ``accel.enabled=off``: the model's own transformers
                           forward and every operation on its PyTorch reference, so every float32
                           product on MKL (``F.linear`` / ``mm``, as TRL's run) and no compiled
                           kernel either (CPU only, not in the default rows)
    rlhfkit_grpo_onednn    the first row with ``accel.enabled=on``: oneDNN's products (and the
                           blocked attention) whatever the CPU; on an AMD one with AVX-512 this is the
                           first row
    trl_grpo               trl 1.16 GRPOTrainer: ``per_device_train_batch_size=MICRO``,
                           ``gradient_accumulation_steps=64/MICRO`` (one generation of 64 per
                           optimizer step), ``num_generations=G``, ``beta=0.3``,
                           ``scale_rewards='batch'``, ``disable_dropout=True``, loss 'dapo' (its
                           default; its k3 term weighted by the importance ratio, its default
                           ``use_bias_correction_kl``), ``gradient_checkpointing=False``. On a CPU
                           (no Triton on a CUDA or XPU device) its fused log-prob head projects
                           every prompt and completion position but the last onto the vocabulary
                           and keeps the completion ones
    trl_grpo_compact       the same, its head scoring the completion positions only, as it does on
                           CUDA: the worker replaces the name ``_use_triton`` in
                           ``trl.trainer.utils`` (where the head picks its path) by a function
                           returning True; the tile kernels keep their own, so the tiles still run
                           in torch. ``tests/test_trl_completion_scoring.py`` checks that the
                           per-token log-probs and gradients match the stock path
    trl_grpo_ckpt          ``trl_grpo`` at TRL's own default, ``gradient_checkpointing=True``
    trl_grpo_compact_ckpt  both: TRL's checkpointing and GPU head (the rest as above: float32,
                           beta 0.3, where TRL's own defaults are bf16 and beta 0)
    trl_grpo_compact_keep  ``trl_grpo_compact`` in a process whose glibc malloc keeps freed memory
                           (:func:`keep_freed_memory`, called by the worker before anything else):
                           an environment setting any PyTorch program can take; CPU only, not in
                           the default rows. ``rlhfkit_grpo_keep`` is the same for rlhfkit
    trl_grpo_compact_thp   ``trl_grpo_compact`` with ``THP_MEM_ALLOC_ENABLE=1`` in the worker's
                           environment: PyTorch's CPU allocator aligns tensors of 2 MiB and more
                           to 2 MiB and asks the kernel for transparent huge pages there
                           (``madvise``), so large tensors fault in 2 MiB at a time and their
                           products miss the TLB less (where the system's THP setting is
                           ``madvise`` or ``always``). Read once, before PyTorch's first
                           allocation, so only the environment can set it; the worker records
                           the huge pages it holds after the run. ``rlhfkit_grpo_thp`` is the
                           same for rlhfkit; CPU only, not in the default rows

and ``rlhfkit_grpo_lora``, ``trl_grpo_lora``, ``trl_grpo_compact_lora`` (LoRA r 16, alpha 32,
every linear layer but the head; ``rlhfkit_grpo_lora_bf16`` and ``trl_grpo_compact_lora_bf16``
the same on a bfloat16 base, rlhfkit at ``model.dtype=bfloat16`` and TRL at ``bf16=True``, its
default, with the model loaded in bfloat16: peft keeps both adapters in float32 beside the bf16
products; TRL runs peft's forward, rlhfkit its lean one, which does the same arithmetic;
``trl_grpo_compact_ckpt_lora_bf16`` the TRL one at its default checkpointing), the full
fine-tuning pair ``rlhfkit_grpo_master_bf16`` (``model.dtype=bfloat16 model.master_weights=true``:
float32 weights, the policy's forwards and backward on bfloat16 copies of them, the reference
loaded in bfloat16) and ``trl_grpo_compact_master_bf16`` (the model loaded in float32, TRL at
``bf16=True``: autocast, its reference in float32 under it too; ``trl_grpo_compact_ckpt_master_bf16``
at its default checkpointing), ``rlhfkit_ppo`` and ``rlhfkit_ppo_lora`` (a separate critic
started from the policy, through its own adapter with LoRA, ``ppo.value_model=separate``; KL 0.2 in the reward;
64 distinct prompts a step; TRL 1.16 has no PPO trainer, so these rows show what the critic costs).

Per step each row also gets the positions it runs through the model's body (all layers) and
through the LM head, counted from the workload: with P prompt tokens, R new tokens, U groups of
G and B = U G rows, the rollout runs P prompt positions per distinct prompt (rlhfkit; per row in
TRL and the unshared row) and R - 1 decode
positions per row; a scoring forward (reference, update) runs B (P + R) positions in TRL, and in
rlhfkit U P + B (R - 1) when prompts are shared, B (P + R - 1) otherwise (it does not run the last
column, which predicts nothing, since commit d64422e: runs stored before it ran B more; the critic
of the PPO rows runs every column); checkpointing runs the update's forward twice; the update
backpropagates through its positions once. "Body arithmetic" counts a backward position as two
forward ones (with LoRA the frozen weights get no gradient, so there a backward costs less; the
count is the same for both libraries). The head scores one row per sampled token in the rollout,
then B R rows per scoring forward for rlhfkit and TRL's completion-position rows, B (P + R - 1)
for TRL's stock rows on a CPU.

What a ratio is made of: rlhfkit_grpo / trl_grpo is the product of three measured ratios,
printed under the table when the four rows ran:

    rlhfkit_grpo / rlhfkit_grpo_unshared    shared prompts: less arithmetic (any device)
    rlhfkit_grpo_unshared / trl_grpo_compact  the same positions through body and head: implementation
    trl_grpo_compact / trl_grpo             TRL's head scoring every position: less arithmetic, CPU only

The body-arithmetic ratio printed beside each time ratio is what counting alone predicts.

Protocol: each (row, run) is its own process pinned to ``--core`` (``taskset``) with one torch
thread, ``--warmup`` steps (default 1) then ``--steps`` measured ones (default 3); the rows run
one after another, never two at a time, in the listed order on even runs and reversed on odd
ones, ``--runs`` times (default 3). Per phase: seconds and the phase's peak resident set
(``VmHWM`` after resetting it through ``/proc/self/clear_refs`` at each phase boundary);
``loaded`` is the resident set when the first step starts. A run's figure is the median of its
measured steps (peaks: their maximum); the table gives the median over runs and the min-max
over runs. Every run is appended to ``--out/results.jsonl`` (with ``--record``, to the committed
``benchmarks/results/real_step.jsonl``) with its commit and machine; the table reads
every stored run of the same setting (size, layers, workload, steps, warm-up, seed), run numbers
go on from the stored ones (so the order keeps alternating across calls: three calls with
``--runs 1`` make one ``--runs 3``), and ``--report`` prints the table without running
anything. TRL's phases are timed from the outside: rollout to the end of its ``_generate``,
experience to the end of ``_generate_and_score_completions`` (reference log-probs, rewards,
advantages), update to the end of the optimizer step.

    python benchmarks/real_step.py --size gpt2 --workload short          # the CPU's seven rows x 3 runs
    python benchmarks/real_step.py --size smollm2 --workload reasoning --rows rlhfkit_grpo trl_grpo_compact
    python benchmarks/real_step.py --size gpt2 --layers 1 --prompt-tokens 8 --new-tokens 4 --groups 2 \\
        --group-size 2 --micro 2 --steps 1 --warmup 0 --runs 1 --core 1    # seconds: does every row run?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    PhaseClock,
    add_record_args,
    clock_grpo_trainer,
    code_version,
    marked,
    pin_to_core,
    pinned_cmd,
    quiet_hf,
    record,
    results_path,
    stored_results,
)
from rlhfkit.accel import malloc  # noqa: E402

RESULT = "RESULT "
DEFAULT_OUT = "runs/bench_real"
LR, KL = 1e-5, 0.3
LORA = {"r": 16, "alpha": 32.0}
SIZES = {
    "gpt2": {"vocab": 50257, "layers": 12},
    "qwen": {"vocab": 151936, "layers": 24},
    "smollm2": {"vocab": 49152, "layers": 30, "fetch": "smollm2-135m-instruct"},
    "smollm2-init": {"vocab": 49152, "layers": 30, "shape_of": "smollm2-135m-instruct"},
}
WORKLOADS = {
    "short": {"prompt_tokens": 128, "new_tokens": 64, "groups": 16, "group_size": 4, "micro": 16},
    "reasoning": {"prompt_tokens": 64, "new_tokens": 512, "groups": 8, "group_size": 8, "micro": 8},
}
NAMES = {
    "rlhfkit_grpo": "rlhfkit GRPO",
    "rlhfkit_grpo_unshared": "rlhfkit GRPO, prompts unshared",
    "rlhfkit_grpo_ckpt": "rlhfkit GRPO, checkpointing",
    "rlhfkit_grpo_graph": "rlhfkit GRPO, CUDA-graph decode",
    "rlhfkit_grpo_ckpt_offload": "rlhfkit GRPO, checkpointing, offload",
    "rlhfkit_grpo_graph_ckpt_offload": "rlhfkit GRPO, graph, ckpt, offload",
    "trl_grpo": "TRL, CPU head (all positions)",
    "trl_grpo_compact": "TRL, completion positions",
    "trl_grpo_ckpt": "TRL, CPU head, checkpointing",
    "trl_grpo_compact_ckpt": "TRL, compl. pos., checkpointing",
    "rlhfkit_grpo_lora": "rlhfkit GRPO, LoRA",
    "trl_grpo_lora": "TRL, CPU head, LoRA",
    "trl_grpo_compact_lora": "TRL, compl. pos., LoRA",
    "rlhfkit_ppo": "rlhfkit PPO",
    "rlhfkit_ppo_lora": "rlhfkit PPO, LoRA",
    "rlhfkit_grpo_mkl": "rlhfkit GRPO, accel off",
    "rlhfkit_grpo_onednn": "rlhfkit GRPO, oneDNN products",
    "rlhfkit_grpo_keep": "rlhfkit GRPO, freed memory kept",
    "trl_grpo_compact_keep": "TRL, compl. pos., freed memory kept",
    "rlhfkit_grpo_thp": "rlhfkit GRPO, huge pages",
    "trl_grpo_compact_thp": "TRL, compl. pos., huge pages",
    "rlhfkit_grpo_offheap": "rlhfkit GRPO, update off the heap",
    "rlhfkit_grpo_offheap_thp": "rlhfkit GRPO, off heap, huge pages",
    "rlhfkit_grpo_jemalloc": "rlhfkit GRPO, jemalloc",
    "rlhfkit_grpo_tcmalloc": "rlhfkit GRPO, tcmalloc",
    "trl_grpo_compact_jemalloc": "TRL, compl. pos., jemalloc",
    "trl_grpo_compact_ckpt_tcmalloc": "TRL, compl. pos., ckpt, tcmalloc",
    "rlhfkit_grpo_graph_torchattn": "rlhfkit GRPO, graph, PyTorch attention",
    "rlhfkit_grpo_graph_ckpt_offload_torchattn": "rlhfkit GRPO, graph+ckpt+offload, PyTorch attn.",
    "rlhfkit_grpo_lora_bf16": "rlhfkit GRPO, LoRA, bf16 base",
    "trl_grpo_compact_lora_bf16": "TRL, compl. pos., LoRA, bf16",
    "trl_grpo_compact_ckpt_lora_bf16": "TRL, compl. pos., ckpt, LoRA, bf16",
    "rlhfkit_grpo_master_bf16": "rlhfkit GRPO, bf16 on fp32 weights",
    "trl_grpo_compact_master_bf16": "TRL, compl. pos., bf16=True, fp32 weights",
    "trl_grpo_compact_ckpt_master_bf16": "TRL, compl. pos., ckpt, bf16=True, fp32 weights",
}
ROWS = list(NAMES)
GRPO_ROWS = ROWS[:10]  # without LoRA; the defaults: all but the CUDA-graph and offload ones on a CPU, the _compact ones on CUDA
# (numerator, denominator, what the ratio shows)
RATIOS = [
    ("rlhfkit_grpo", "trl_grpo", "both as shipped, on a CPU"),
    ("rlhfkit_grpo", "trl_grpo_compact", "TRL scoring completion positions, as on a GPU"),
    ("rlhfkit_grpo_unshared", "trl_grpo_compact", "same positions through body and head: implementation"),
    ("rlhfkit_grpo", "rlhfkit_grpo_unshared", "shared prompts, within rlhfkit"),
    ("rlhfkit_grpo", "rlhfkit_grpo_mkl", "the default products against MKL's (TRL's), within rlhfkit (1 where MKL is the default)"),
    ("rlhfkit_grpo_onednn", "rlhfkit_grpo_mkl", "oneDNN's products against MKL's (TRL's), within rlhfkit"),
    ("rlhfkit_grpo_mkl", "trl_grpo_compact", "TRL scoring completion positions, both on MKL"),
    ("rlhfkit_grpo", "trl_grpo_compact_keep", "TRL scoring completion positions, its malloc keeping freed memory"),
    ("rlhfkit_grpo_keep", "rlhfkit_grpo", "malloc keeping freed memory, within rlhfkit"),
    ("rlhfkit_grpo_offheap", "rlhfkit_grpo", "the update's tensors off the heap, within rlhfkit"),
    ("rlhfkit_grpo_offheap_thp", "rlhfkit_grpo_offheap", "huge pages for the update's tensors off the heap"),
    ("rlhfkit_grpo_offheap", "trl_grpo_compact_ckpt", "rlhfkit's update off the heap, TRL at its defaults as on a GPU"),
    ("trl_grpo_compact_keep", "trl_grpo_compact", "malloc keeping freed memory, within TRL"),
    ("rlhfkit_grpo_jemalloc", "rlhfkit_grpo", "jemalloc in place of glibc's malloc, within rlhfkit"),
    ("rlhfkit_grpo_tcmalloc", "rlhfkit_grpo", "tcmalloc in place of glibc's malloc, within rlhfkit"),
    ("rlhfkit_grpo_jemalloc", "trl_grpo_compact_jemalloc", "both on jemalloc, TRL scoring completion positions"),
    ("rlhfkit_grpo_tcmalloc", "trl_grpo_compact_ckpt", "rlhfkit on tcmalloc, TRL at its defaults as on a GPU"),
    ("rlhfkit_grpo_tcmalloc", "trl_grpo_compact_ckpt_tcmalloc", "both on tcmalloc, TRL at its defaults as on a GPU"),
    ("rlhfkit_grpo_thp", "trl_grpo_compact_thp", "both on huge pages, TRL scoring completion positions"),
    ("rlhfkit_grpo_thp", "rlhfkit_grpo", "huge pages, within rlhfkit"),
    ("trl_grpo_compact_thp", "trl_grpo_compact", "huge pages, within TRL"),
    ("trl_grpo_compact", "trl_grpo", "TRL's CPU head scoring every position, within TRL"),
    ("rlhfkit_grpo", "trl_grpo_ckpt", "TRL at its default checkpointing, CPU head"),
    ("rlhfkit_grpo", "trl_grpo_compact_ckpt", "TRL at its defaults as on a GPU"),
    ("rlhfkit_grpo_ckpt", "trl_grpo_compact_ckpt", "both checkpointing, TRL scoring completion positions"),
    ("rlhfkit_grpo_lora", "trl_grpo_lora", "LoRA, both as shipped"),
    ("rlhfkit_grpo_lora", "trl_grpo_compact_lora", "LoRA, TRL scoring completion positions"),
    ("rlhfkit_grpo_lora_bf16", "trl_grpo_compact_lora_bf16", "LoRA on a bf16 base, TRL at bf16=True, completion positions"),
    ("rlhfkit_grpo_lora_bf16", "trl_grpo_compact_ckpt_lora_bf16", "LoRA on a bf16 base, TRL at bf16=True and its default checkpointing"),
    ("rlhfkit_grpo_lora_bf16", "rlhfkit_grpo_lora", "a bf16 base under LoRA, within rlhfkit"),
    ("trl_grpo_compact_lora_bf16", "trl_grpo_compact_lora", "a bf16 base under LoRA and bf16=True, within TRL"),
    ("rlhfkit_grpo_master_bf16", "trl_grpo_compact_master_bf16",
     "full fine-tuning, bf16 products on fp32 weights: model.master_weights against TRL at bf16=True"),
    ("rlhfkit_grpo_master_bf16", "trl_grpo_compact_ckpt_master_bf16",
     "full fine-tuning, bf16 products on fp32 weights, TRL at bf16=True and its default checkpointing"),
    ("rlhfkit_grpo_master_bf16", "rlhfkit_grpo", "bf16 products on fp32 weights against fp32, within rlhfkit"),
    ("trl_grpo_compact_master_bf16", "trl_grpo_compact", "bf16=True on fp32 weights against fp32, within TRL"),
]
PHASES = ("rollout", "experience", "update")
GPU_NAMES = {"trl_grpo": "TRL (head: completion positions)", "trl_grpo_ckpt": "TRL, checkpointing",
             "trl_grpo_lora": "TRL, LoRA"}
GPU_RATIOS = [
    ("rlhfkit_grpo", "trl_grpo", "both as shipped on a GPU: TRL scores completion positions only"),
    ("rlhfkit_grpo_unshared", "trl_grpo", "same positions through body and head: implementation"),
    ("rlhfkit_grpo", "rlhfkit_grpo_unshared", "shared prompts, within rlhfkit"),
    ("rlhfkit_grpo", "trl_grpo_ckpt", "TRL at its default checkpointing"),
    ("rlhfkit_grpo_ckpt", "trl_grpo_ckpt", "both checkpointing"),
    ("rlhfkit_grpo_graph", "trl_grpo", "rlhfkit decoding through a CUDA graph"),
    ("rlhfkit_grpo_graph", "rlhfkit_grpo", "the CUDA graph, within rlhfkit"),
    ("rlhfkit_grpo_ckpt_offload", "trl_grpo_ckpt", "rlhfkit checkpointing with offload, TRL at its default"),
    ("rlhfkit_grpo_ckpt_offload", "rlhfkit_grpo_ckpt", "offload, within rlhfkit"),
    ("rlhfkit_grpo_graph_ckpt_offload", "trl_grpo_ckpt", "rlhfkit's three switches, TRL at its default"),
    ("rlhfkit_grpo_graph", "rlhfkit_grpo_graph_torchattn", "the Triton decode attention, within the graph"),
    ("rlhfkit_grpo_graph_ckpt_offload", "rlhfkit_grpo_graph_ckpt_offload_torchattn",
     "the Triton decode attention, within the three switches"),
    ("rlhfkit_grpo_lora", "trl_grpo_lora", "LoRA, both as shipped"),
]


def row_name(row: str, device: str = "cpu") -> str:
    return GPU_NAMES.get(row, NAMES[row]) if device == "cuda" else NAMES[row]


def row_spec(row: str) -> dict:
    """What a row name turns on: library, algorithm and the switches after them."""
    lib, algo, *flags = row.split("_")
    return {"lib": lib, "algo": algo, "lora": "lora" in flags, "ckpt": "ckpt" in flags,
            "unshared": "unshared" in flags, "compact": "compact" in flags, "graph": "graph" in flags,
            "offload": "offload" in flags, "mkl": "mkl" in flags, "onednn": "onednn" in flags, "keep": "keep" in flags,
            "thp": "thp" in flags, "offheap": "offheap" in flags,
            "torchattn": "torchattn" in flags, "bf16": "bf16" in flags, "master": "master" in flags, "malloc": next((f for f in flags if f in malloc.LIBRARIES), None)}


def letter_share(prompts, completions, **kw) -> list[float]:
    """The benchmark's reward: the share of letters in each completion's text (cheap, and it
    varies between samples, so advantages are not all zero)."""
    return [sum(ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]


def positions(row: str, wl: dict) -> dict:
    """Positions through the model's body per phase (forward; ``backward``: those the update
    backpropagates) and through the LM head per step, counted from the workload (module docstring)."""
    s = row_spec(row)
    P, R, U, G = wl["prompt_tokens"], wl["new_tokens"], wl["groups"], wl["group_size"]
    B = U * G
    if s["algo"] == "ppo":  # 64 distinct prompts; the critic (every column) beside the reference and the policy
        both = B * (P + R - 1) + B * (P + R)
        return {"rollout": B * P + B * (R - 1), "experience": both, "update": both * (2 if s["ckpt"] else 1),
                "backward": both, "head": B * R * 3}
    # rlhfkit on a bf16 base: the sampler's bf16 log-probs are not the training forward's, so its
    # experience runs the policy beside the reference (in float32 the sampler's are reused); runs stored
    # between 1d496f7 and the removal of the deferred old log-probs ran the reference alone there, and
    # before 1d496f7 the LoRA policy ran peft's forward, prompts unshared
    shared = s["lib"] == "rlhfkit" and not s["unshared"]
    policy_again = 2 if s["lib"] == "rlhfkit" and s["bf16"] else 1
    # rlhfkit's scoring forwards do not run the last column (it predicts nothing); TRL's run it
    last = 0 if s["lib"] == "rlhfkit" else B
    scoring = (U * P + B * (R - 1) if shared else B * (P + R - 1)) + last
    head_rows = B * (P + R - 1) if s["lib"] == "trl" and not s["compact"] else B * R
    return {"rollout": (U if shared else B) * P + B * (R - 1),
            "experience": scoring * policy_again, "update": scoring * (2 if s["ckpt"] else 1), "backward": scoring,
            "head": B * R + (1 + policy_again) * head_rows}


def body_work(pos: dict) -> int:
    """Forward-position equivalents through the body: a backward position costs about two forward ones."""
    return sum(pos[k] for k in PHASES) + 2 * pos["backward"]


# --------------------------------------------------------------------------- switches


@contextlib.contextmanager
def unshared_prompts():
    """rlhfkit runs every row's prompt in full: its two detectors of repeated prompts
    (the rollout's prefill, the reference and update forwards) answer None, as they do when
    sharing does not pay. Benchmark-only."""
    from rlhfkit.accel import forward as lean
    from rlhfkit.rollout import experience

    saved = lean.repeated_rows, lean.shared_prompts, experience.repeated_rows
    lean.repeated_rows = lambda *a, **kw: None
    lean.shared_prompts = lambda *a, **kw: None
    experience.repeated_rows = lean.repeated_rows
    try:
        yield
    finally:
        lean.repeated_rows, lean.shared_prompts, experience.repeated_rows = saved


@contextlib.contextmanager
def completion_only_scoring():
    """TRL 1.16's fused log-prob head scores only the positions that have a label (the
    completion tokens), as it does where Triton runs; on a CPU it projects every position.
    The head asks ``trl.trainer.utils._use_triton(device)`` when it runs; that name is replaced
    there only, so the tile kernels (``trl.kernels.chunked_logprob``) keep their own and run in
    torch. Benchmark-only."""
    import trl.trainer.utils as trl_utils

    if not callable(getattr(trl_utils, "_use_triton", None)):
        raise SystemExit("this TRL has no trl.trainer.utils._use_triton: the completion-position rows need "
                         "TRL 1.16's fused log-prob head (pip install -e .[bench])")
    saved = trl_utils._use_triton
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = saved


# --------------------------------------------------------------------------- assets


def corpus(megabytes: int) -> list[str]:
    """The Python standard library's sources (sorted, up to ``megabytes``): text that exists offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        size = path.stat().st_size
        if total + size > megabytes * 2**20:
            continue
        texts.append(path.read_bytes().decode("utf-8", "replace"))
        total += size
    return texts


def build_tokenizer(vocab: int, texts: list[str]):
    """A byte-level BPE tokenizer of exactly ``vocab`` entries (EOS and pad included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    if bpe.get_vocab_size() != vocab:
        sys.exit(f"the corpus gave a vocabulary of {bpe.get_vocab_size()}, not {vocab}: raise corpus()'s size")
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", padding_side="left")


def build_model(size: str, layers: int, tok):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    ids = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    torch.manual_seed(0)
    if size == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=1024, **ids))
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **ids))


def write_prompts(path: Path, tok, length: int, count: int) -> None:
    """``count`` windows of the standard library's sources that the tokenizer reads back as
    exactly ``length`` tokens (a window whose decoded text re-tokenizes otherwise is skipped)."""
    ids = tok("".join(corpus(4)), add_special_tokens=False)["input_ids"]
    kept = []
    for start in range(0, len(ids) - length, length):
        text = tok.decode(ids[start:start + length])
        if len(tok(text)["input_ids"]) == length:
            kept.append(text)
            if len(kept) == count:
                break
    if len(kept) < count:
        sys.exit(f"only {len(kept)} prompts of {length} tokens in the corpus, {count} needed: raise write_prompts()'s corpus")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in kept))
    tmp.replace(path)


def shaped_like(src: Path, model_dir: Path):
    """A model with ``src``'s config, tokenizer and generation config and random weights, saved
    to ``model_dir``; returns the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if not (src / "config.json").exists():
        sys.exit(f"{src} holds no config.json: pass --shape-from a directory with the model's config and tokenizer")
    print(f"building a random-init model shaped like {src} (cached) ...", flush=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return tok


def prepare(out: Path, size: str, layers: int, prompt_tokens: int, prompts: int,
            shape_from: str | None = None) -> dict[str, str]:
    """The model directory (weights + tokenizer) and the prompt file, built once under ``out``."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    prompt_file = out / f"prompts_{size}_{prompt_tokens}.jsonl"
    if "fetch" in SIZES[size]:
        from rlhfkit.cli.fetch import fetch_model

        model_dir = Path(fetch_model(SIZES[size]["fetch"])["dir"])
    else:
        model_dir = out / f"{size}_{layers}l"
    enough = prompt_file.exists() and len(prompt_file.read_text().splitlines()) >= prompts
    if (model_dir / "config.json").exists() and enough:
        return {"model": str(model_dir), "prompts": str(prompt_file)}
    quiet_hf()
    if (model_dir / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(model_dir)
    elif "shape_of" in SIZES[size]:
        if shape_from is None:
            from rlhfkit.cli.fetch import fetch_model

            shape_from = fetch_model(SIZES[size]["shape_of"])["dir"]
        tok = shaped_like(Path(shape_from), model_dir)
    else:
        tok_dir = out / f"tokenizer_{size}"
        if (tok_dir / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(tok_dir)
        else:
            print(f"training a {SIZES[size]['vocab']}-token BPE tokenizer (cached) ...", flush=True)
            tok = build_tokenizer(SIZES[size]["vocab"], corpus(30 if SIZES[size]["vocab"] <= 60000 else 120))
            tok.save_pretrained(tok_dir)
        print(f"building the {size} model, {layers} layers (cached) ...", flush=True)
        model = build_model(size, layers, tok)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    write_prompts(prompt_file, tok, prompt_tokens, prompts)
    return {"model": str(model_dir), "prompts": str(prompt_file)}


# --------------------------------------------------------------------------- contenders


def measured(clock: PhaseClock, warmup: int) -> dict:
    """The measured steps' seconds and peaks per phase, and the resident set at the first step."""
    return {"steps": [{"seconds": r, "peak_mib": p} for r, p in zip(clock.rows[warmup:], clock.peaks[warmup:])],
            "loaded_mib": clock.rss_at_first_start}


def run_rlhfkit(row: str, paths: dict, wl: dict, args) -> dict:
    import rlhfkit.trainers.rl as rl
    import rlhfkit.trainers.rl_setup as rl_setup
    from rlhfkit.config import ALGO_DEFAULTS, Config

    s = row_spec(row)
    # on: oneDNN's products on any CPU; off: PyTorch's own ops (as TRL computes them), and PyTorch's
    # attention in a CUDA graph's decode step
    accel = "on" if s["onednn"] else "off" if s["mkl"] or s["torchattn"] else "auto"
    B = wl["groups"] * wl["group_size"]
    out = Path(args.out) / f"step_{args.size}_{args.layers}l_{row}"
    shutil.rmtree(out, ignore_errors=True)
    ppo = {**ALGO_DEFAULTS[s["algo"]], "steps": args.warmup + args.steps, "batch_size": B, "ppo_epochs": 1,
           "minibatch_size": B, "micro_batch_size": wl["micro"], "max_new_tokens": wl["new_tokens"], "lr": LR,
           "stop_at": 0.0, "eval_every": 0, "critic_warmup_steps": 0, "samples_per_log": 0, "trajectories_every": 0}
    if s["algo"] == "grpo":
        ppo.update(group_size=wl["group_size"], kl_coef=KL)
    else:  # the rows measure what a critic model of its own costs (positions() counts its forwards)
        ppo.update(value_model="separate")
    model = {"name": paths["model"], "gradient_checkpointing": s["ckpt"], "dtype": "bfloat16" if s["bf16"] else "float32",
             "master_weights": s["master"]}
    if s["lora"]:
        model.update(lora_r=LORA["r"], lora_alpha=LORA["alpha"])
    cfg = Config().replace(
        run={"out_dir": str(out), "seed": args.seed, "progress": False, "checkpoint_every": 0,
             "tensorboard": False, "device": args.device},
        model=model, ppo=ppo, value={"lora": s["lora"]}, reward={"function": "real_step:letter_share"},
        accel={"enabled": accel, "threads": 1, "offload": s["offload"], "update_off_heap": s["offheap"],
               "cuda_graph": s["graph"] and s["algo"] == "grpo"},
        data={"path": paths["prompts"], "max_prompt_length": wl["prompt_tokens"]})
    clock = PhaseClock(cuda=args.device == "cuda")
    rl.rollout = marked(rl.rollout, clock, "rollout", start=True)
    rl.make_experience = marked(rl.make_experience, clock, "experience")
    rl.ppo_update = marked(rl.ppo_update, clock, "update", end=True)
    rl_setup.start_offload = opening_offload(rl_setup.start_offload, clock)
    rl.eos_token_ids = lambda model, tok: [-1]  # no token ends a completion: each runs to max_new_tokens
    with unshared_prompts() if s["unshared"] else contextlib.nullcontext():
        rl.train_rl(cfg)
    lengths = [json.loads(line).get("response/length") for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {**measured(clock, args.warmup), "completion_tokens": [x for x in lengths if x is not None]}


def opening_offload(start, clock: PhaseClock):
    """``rl_setup.start_offload`` whose moments' copy to the host, the first thing a step does, opens
    the step (so it is timed with the rollout); the copy back runs between the experience mark
    and the update's, so it is timed with the update."""

    def wrapped(*a, **kw):
        moments = start(*a, **kw)
        if moments is not None:
            to_host = moments.to_host

            def opening():
                clock.start()
                to_host()

            moments.to_host = opening
        return moments

    return wrapped


def run_trl(row: str, paths: dict, wl: dict, args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.utils import read_jsonl

    s = row_spec(row)
    B = wl["groups"] * wl["group_size"]
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    # bf16=True on float32 weights (master): autocast, the Trainer's mixed precision for full fine-tuning
    half = s["bf16"] and not s["master"]
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.bfloat16 if half else torch.float32)
    steps = args.warmup + args.steps
    prompts = [r["prompt"] for r in read_jsonl(paths["prompts"])][:steps * wl["groups"]]
    config = GRPOConfig(
        output_dir=str(Path(args.out) / f"step_{args.size}_{args.layers}l_{row}"), learning_rate=LR,
        lr_scheduler_type="constant", beta=KL, num_generations=wl["group_size"],
        per_device_train_batch_size=wl["micro"], gradient_accumulation_steps=B // wl["micro"],
        max_completion_length=wl["new_tokens"], generation_kwargs={"min_new_tokens": wl["new_tokens"]},
        scale_rewards="batch", disable_dropout=True, temperature=1.0, max_steps=steps, bf16=s["bf16"],
        gradient_checkpointing=s["ckpt"], use_cpu=args.device == "cpu", seed=args.seed, logging_steps=1000, log_level="error",
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    peft_config = None
    if s["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    clock = PhaseClock(cuda=args.device == "cuda")
    trainer = GRPOTrainer(model=model, reward_funcs=letter_share, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=peft_config)
    clock_grpo_trainer(trainer, clock)
    lengths, score = [], trainer._generate_and_score_completions

    def scored(*a, **kw):  # the generation's mean completion length, a check that none stopped early
        batch = score(*a, **kw)
        lengths.append(batch["completion_mask"].sum(1).float().mean().item())
        return batch

    trainer._generate_and_score_completions = scored
    with completion_only_scoring() if s["compact"] else contextlib.nullcontext():
        trainer.train()
    return {**measured(clock, args.warmup), "completion_tokens": lengths}


# --------------------------------------------------------------------------- driver


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory in this process: no block served by its own ``mmap``
    (``M_MMAP_MAX`` 0) and the heap's free top never returned (``M_TRIM_THRESHOLD`` -1), so a
    large tensor freed and allocated again reuses pages instead of faulting fresh zeroed ones in
    (what ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...`` does from
    the environment)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # noqa: B018 -- glibc only: raises AttributeError elsewhere
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if libc.mallopt(-4, 0) != 1 or libc.mallopt(-1, -1) != 1:  # M_MMAP_MAX, M_TRIM_THRESHOLD
        raise RuntimeError("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD")


def worker(args) -> None:
    pin_to_core(args.core)
    if row_spec(args.worker)["keep"]:
        keep_freed_memory()
    lib = row_spec(args.worker)["malloc"]
    if lib and not malloc.loaded(malloc.resolve(lib)):
        raise SystemExit(f"the {args.worker} row's worker runs without {malloc.resolve(lib)} preloaded")
    quiet_hf()
    if args.device == "cuda":  # the same matrix-product precision for both libraries: TF32
        torch.set_float32_matmul_precision("high")
    wl, paths = json.loads(args.wl), json.loads(args.paths)
    result = (run_trl if args.worker.startswith("trl") else run_rlhfkit)(args.worker, paths, wl, args)
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    result["huge_mib"] = anon_huge_mib()
    print(RESULT + json.dumps(result), flush=True)


def anon_huge_mib() -> float | None:
    """MiB of this process's memory on transparent huge pages now (``AnonHugePages`` in
    ``/proc/self/smaps_rollup``), or None where the kernel does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def summarise(result: dict) -> dict:
    """One run: the median of its measured steps per phase (and of their totals), each phase's
    largest peak, and the peak over the run."""
    steps = result["steps"]
    sec = {k: statistics.median(s["seconds"][k] for s in steps) for k in PHASES}
    sec["total"] = statistics.median(sum(s["seconds"][k] for k in PHASES) for s in steps)
    peak = {k: max(s["peak_mib"][k] for s in steps) for k in PHASES}
    return {"seconds": sec, "times_s": [sum(s["seconds"][k] for k in PHASES) for s in steps], "peak_mib": peak, "loaded_mib": result["loaded_mib"],
            "peak_rss_mib": max(result["loaded_mib"], *peak.values()), "completion_tokens": result["completion_tokens"],
            "huge_mib": result.get("huge_mib"), **({"gpu": result["gpu"]} if "gpu" in result else {})}


def run_one(row: str, run: int, setting: dict, paths: dict, args) -> dict | None:
    cmd = pinned_cmd(args.core, __file__, "--worker", row, "--size", args.size, "--layers", str(args.layers),
                     "--device", args.device,
                     "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                     "--core", str(args.core), "--out", args.out, "--wl", json.dumps(setting["workload"]),
                     "--paths", json.dumps(paths))
    env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # huge pages only where the row asks for them
    if row_spec(row)["thp"]:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if row_spec(row)["malloc"]:
        env["LD_PRELOAD"] = malloc.resolve(row_spec(row)["malloc"])  # as ``accel.malloc`` preloads it
    at = code_version()  # the code the worker imports now, whatever is checked out when it ends
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        print(f"  {row_name(row, args.device)}, run {run}: failed (exit {proc.returncode}); skipped:\n{proc.stderr[-3000:]}", flush=True)
        return None
    res = summarise(json.loads(lines[-1][len(RESULT):]))
    spec = row_spec(row)
    allocator = {"allocator": spec["malloc"]} if spec["malloc"] else {}  # the worker's, not this process's
    record("real_step", {"row": row, "contender": row, "run": run, **setting, "seeds": [args.seed], **res, **allocator,
                         "threads": 1}, args, args.device, "bf16" if spec["bf16"] else "fp32", at)  # --report reads them back
    lengths = res["completion_tokens"]
    short = "" if lengths and min(lengths) == setting["workload"]["new_tokens"] else f" (completion tokens {lengths}!)"
    huge = f", {res['huge_mib']:.0f} MiB of it on huge pages at the end" if res["huge_mib"] else ""
    print(f"  {row_name(row, args.device)}, run {run}: {res['seconds']['total']:.1f} s/step, "
          f"peak {res['peak_rss_mib']:.0f} MiB{huge} "
          f"({time.perf_counter() - t0:.0f} s wall){short}", flush=True)
    return res


def stored(args, setting: dict) -> dict[str, list[dict]]:
    """The stored runs (``bench_common.results_path``) made with this setting, by row."""
    found: dict[str, list[dict]] = {}
    for rec in stored_results(results_path("real_step", args), setting):
        found.setdefault(rec["row"], []).append(rec)
    return found


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)``, or the one value."""
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def print_table(results: dict[str, list[dict]], setting: dict, args) -> None:
    wl = setting["workload"]
    runs = sorted({len(v) for v in results.values()})
    commits = sorted({r["commit"] for v in results.values() for r in v})
    cpus = sorted({r["machine"]["cpu"] if "machine" in r else r.get("cpu", "not recorded") for v in results.values() for r in v})
    gpu = setting.get("device") == "cuda"
    name = lambda row: row_name(row, "cuda" if gpu else "cpu")  # noqa: E731
    where = (f"each row alone on the GPU ({', '.join(sorted({r.get('gpu', '?') for v in results.values() for r in v}))}),"
             f" float32 weights, TF32 matrix products" if gpu else "float32 (bfloat16 where a row says bf16); each row alone on one core, 1 torch thread")
    memory = "peak allocated GPU memory" if gpu else "peak resident set"
    print(f"\nOne RL step, {args.size} with {args.layers} layers ({SIZES[args.size]['vocab']}-token vocabulary); "
          f"{wl['groups']} prompts of {wl['prompt_tokens']} tokens x {wl['group_size']} samples x {wl['new_tokens']} new "
          f"tokens, one optimizer step in micro-batches of {wl['micro']}; {where}; "
          f"{setting['warmup']} warm-up + {setting['steps']} measured step(s) a run, {'/'.join(map(str, runs))} run(s), "
          f"commit {', '.join(commits)}, CPU {' / '.join(cpus)}. Seconds: median over runs of each run's median step (min-max over runs); "
          f"{memory} in MiB; positions per step through the model's body (forward, backward) and its LM head")
    print(f"{'row':<34}{'rollout':>20}{'experience':>20}{'update':>22}{'step':>22}{'peak MiB':>20}"
          f"{'body fwd':>10}{'body bwd':>10}{'head':>10}")
    for row, recs in results.items():
        sec = [spread([r["seconds"][k] for r in recs], ".1f") for k in (*PHASES, "total")]
        pos = positions(row, wl)
        body = sum(pos[k] for k in PHASES)
        print(f"{name(row):<34}{sec[0]:>20}{sec[1]:>20}{sec[2]:>22}{sec[3]:>22}"
              f"{spread([r['peak_rss_mib'] for r in recs], '.0f'):>20}{body:>10,}{pos['backward']:>10,}{pos['head']:>10,}")
    print(f"\n{'row':<34}{'loaded':>10}{'rollout':>10}{'experience':>12}{'update':>10}   peak MiB per phase (median over runs)"
          f"   body positions per phase")
    for row, recs in results.items():
        m = {k: statistics.median(r["peak_mib"][k] for r in recs) for k in PHASES}
        pos = positions(row, wl)
        print(f"{name(row):<34}{statistics.median(r['loaded_mib'] for r in recs):>10.0f}{m['rollout']:>10.0f}"
              f"{m['experience']:>12.0f}{m['update']:>10.0f}   "
              f"{pos['rollout']:,} / {pos['experience']:,} / {pos['update']:,}")
    print()
    # rlhfkit / TRL as the product of the ratios of neighbouring rows in the chain, each labelled
    chain = ["rlhfkit_grpo", "rlhfkit_grpo_unshared", "trl_grpo"] if gpu else \
        ["rlhfkit_grpo", "rlhfkit_grpo_unshared", "trl_grpo_compact", "trl_grpo"]
    parts = ["shared prompts", "implementation", "TRL's CPU head scoring every position"]
    if all(r in results for r in chain):
        t = {r: statistics.median(x["seconds"]["total"] for x in results[r]) for r in chain}
        factors = " x ".join(f"{t[a] / t[b]:.2f}x ({what})" for a, b, what in zip(chain, chain[1:], parts))
        print(f"{name(chain[0])} / {name(chain[-1])}: {t[chain[0]] / t[chain[-1]]:.2f}x = {factors}")
    for ours, theirs, what in GPU_RATIOS if gpu else RATIOS:
        if ours in results and theirs in results:
            t = [statistics.median(r["seconds"]["total"] for r in results[x]) for x in (ours, theirs)]
            m = [statistics.median(r["peak_rss_mib"] for r in results[x]) for x in (ours, theirs)]
            b = [body_work(positions(x, wl)) for x in (ours, theirs)]
            print(f"{name(ours)} / {name(theirs)}: step time {t[0] / t[1]:.2f}x, peak memory {m[0] / m[1]:.2f}x, "
                  f"body arithmetic {b[0] / b[1]:.2f}x ({what})")


def model_layers(size: str, layers: int | None) -> int:
    """The layers a ``--size`` runs with: ``--layers`` for the random-init sizes, the model's own
    for the fetched and shaped ones (exits if ``--layers`` asks for another count there)."""
    spec = SIZES[size]
    if ("fetch" in spec or "shape_of" in spec) and layers not in (None, spec["layers"]):
        sys.exit(f"--layers applies to gpt2 and qwen; {size} keeps its model's layers")
    return layers or spec["layers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="gpt2")
    ap.add_argument("--layers", type=int, help="decoder layers of a random-init model (default: the real model's)")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="short")
    for knob in WORKLOADS["short"]:
        ap.add_argument("--" + knob.replace("_", "-"), type=int, help=f"override the workload's {knob}")
    ap.add_argument("--rows", nargs="+", choices=ROWS,
                    help="default: the GRPO rows without LoRA: on a CPU all but the CUDA-graph and offload "
                         "ones; on CUDA all but the _compact ones")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps before the measured ones, per run")
    ap.add_argument("--runs", type=int, default=3, help="runs of every row, in alternating order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0, help="the core every row runs on, one row at a time")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where every row runs (cuda: one GPU; the _compact rows are CPU-only)")
    ap.add_argument("--shape-from", help="smollm2-init: the directory whose config and tokenizer the model takes")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--report", action="store_true",
                    help="run nothing: print the table from --out/results.jsonl (with --record: from the record)")
    add_record_args(ap)
    ap.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--wl", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.layers = model_layers(args.size, args.layers)
    if args.rows is None:
        args.rows = [r for r in GRPO_ROWS if not (row_spec(r)["graph"] or row_spec(r)["offload"] if args.device == "cpu"
                                                  else row_spec(r)["compact"])]
    if args.device == "cuda" and any(row_spec(r)["compact"] for r in args.rows):
        sys.exit("on CUDA TRL's head scores completion positions only as shipped: leave the _compact rows out")
    wl = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in WORKLOADS[args.workload].items()}
    B = wl["groups"] * wl["group_size"]
    if B % wl["micro"]:
        sys.exit(f"--micro ({wl['micro']}) must divide the {B} completions of a step")
    setting = {"size": args.size, "layers": args.layers, "workload": wl, "steps": args.steps, "warmup": args.warmup,
               "seed": args.seed}
    if args.device == "cuda":  # CPU runs were stored without the key: only GPU runs carry it
        setting["device"] = "cuda"
    if not args.report:
        if any(r.startswith("trl") for r in args.rows):
            try:
                import trl  # noqa: F401
            except ImportError:
                sys.exit("TRL is not installed: pip install -e .[bench] (or leave the trl_* rows out with --rows)")
        # one call at a time per --out: a second would clear the rows' run directories under the
        # first and continue its run numbering (rlhfkit.utils' run lock, on the whole folder)
        from rlhfkit.utils import lock_run_dir, run_dir_holder

        if holder := run_dir_holder(args.out):
            sys.exit(f"--out {args.out} is in use by another call ({holder}): wait for it, or choose another --out")
        lock_run_dir(args.out)
        ppo = any(row_spec(r)["algo"] == "ppo" for r in args.rows)
        paths = prepare(Path(args.out), args.size, args.layers, wl["prompt_tokens"],
                        max(256, (args.warmup + args.steps) * (B if ppo else wl["groups"])), args.shape_from)
        # runs go on from those stored for this setting: three calls with --runs 1 alternate like one with --runs 3
        first = 1 + max((r["run"] for recs in stored(args, setting).values() for r in recs), default=-1)
        t0 = time.perf_counter()
        for run in range(first, first + args.runs):
            for row in args.rows if run % 2 == 0 else args.rows[::-1]:
                run_one(row, run, setting, paths, args)
        print(f"{time.perf_counter() - t0:.0f} s in all", flush=True)
    found = stored(args, setting)
    print_table({r: found[r] for r in args.rows if r in found}, setting, args)


if __name__ == "__main__":
    main()
