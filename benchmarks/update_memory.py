"""Peak memory of one PPO policy update at Qwen2.5-0.5B's shape on CPU: the full ``[b, R, V]``
logits against the chosen tokens' log-probs computed in chunks (``models.UPDATE_LOGITS``,
``logprobs.chunked_token_logprobs``).

Model: a random-init ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's config (hidden 896, 14 attention
heads / 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings, ``--layers`` decoder
layers: 24 is the real depth), float32 on CPU, nothing downloaded; a LoRA adapter (r 8, alpha 16,
all linear layers, the head left out as peft does for ``all-linear``) through
``models.add_lora``, as ``model.lora_r`` does it.

Update: one minibatch of ``--rows`` sequences of ``--prompt`` prompt + ``--response`` response
tokens (random ids, every response full length), old log-probs and advantages random; one
forward, the clipped policy loss (plus the entropy bonus when ``--entropy-coef`` > 0) and one
backward, through ``trainers.rl.minibatch_loss`` on a critic-free ``ActorCritic`` -- what
``ppo_update`` runs per minibatch. The optimizer step (a few MB of LoRA weights) is left out.

Variants, each in a fresh subprocess pinned to one core (``taskset``, one torch thread):

* ``full``: ``ActorCritic.logits_budget`` set above the batch's logits, so the head computes the whole
  ``[b, R, V]`` logits and autograd keeps them (and their float32 softmax) for the backward;
* ``chunked``: the default ``UPDATE_LOGITS`` (2**24 logits: 110 rows of a 151936 vocabulary).

Memory is the process's resident set: ``RSS before`` once the model and the batch are built,
``peak`` the high-water mark (``resource.getrusage(...).ru_maxrss``) during the update, after
resetting it through ``/proc/self/clear_refs`` (Linux; without the reset the peak would be the
whole process's, model building included, and the table says so).

Recorded at c4e58dd on a 2-core x86-64 CPU (one core used, the other busy with another job, so
the seconds are noisy; the memory is not), float32, LoRA r 8:

Qwen2.5-0.5B's full shape, 24 layers, minibatch 8 x (32 prompt + 32 response) tokens (defaults)::

    logits    entropy chunk rows  RSS before   peak RSS  peak - before  seconds        loss
    full            0          -    2264 MiB   5102 MiB       2838 MiB     26.2    0.100309
    chunked         0        110    2264 MiB   4701 MiB       2437 MiB     27.9    0.100309
    full         0.01          -    2264 MiB   5584 MiB       3321 MiB     35.8   -0.017213
    chunked      0.01        110    2264 MiB   4690 MiB       2427 MiB     31.4   -0.017213

Longer responses, 4 of the 24 layers (vocabulary and width unchanged), minibatch
16 x (32 + 128) tokens (``--layers 4 --rows 16 --response 128``)::

    logits    entropy chunk rows  RSS before   peak RSS  peak - before  seconds        loss
    full            0          -    1107 MiB   7310 MiB       6203 MiB     67.6    0.163292
    chunked         0        110    1107 MiB   2654 MiB       1547 MiB     71.5    0.163292
    full         0.01          -    1107 MiB  10871 MiB       9764 MiB     89.2    0.045771
    chunked      0.01        110    1107 MiB   2752 MiB       1645 MiB     43.3    0.045771

At 8 x 32 response tokens the 24 layers' activations make up most of what the update adds, and
the chunks save 0.4 GiB (0.9 GiB with the entropy bonus); what the full logits cost grows with
rows x response length x vocabulary, and at 16 x 128 the chunks save 4.5 GiB (7.9 GiB with the
entropy bonus). The losses agree to the printed digits.

    python benchmarks/update_memory.py                         # 24 layers, entropy bonus 0 and 0.01
    python benchmarks/update_memory.py --layers 4 --entropy-coef 0
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    add_record_args,
    pin_to_core,
    pinned_cmd,
    proc_status_mib,
    quiet_hf,
    record,
    reset_peak_rss,
)

RESULT = "RESULT "
VOCAB = 151936


def build(layers: int, logits_budget: int):
    """The LoRA-wrapped Qwen2.5-0.5B-shaped policy in a critic-free ActorCritic whose head runs
    in chunks above ``logits_budget`` logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhfkit.models.forward import add_lora, disable_dropout
    from rlhfkit.rollout.experience import ActorCritic

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    policy = disable_dropout(add_lora(Qwen2ForCausalLM(cfg), r=8, alpha=16.0)).train()
    return ActorCritic(policy, logits_budget=logits_budget)


def batch(rows: int, prompt: int, response: int):
    from rlhfkit.rollout.experience import Experience

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (rows, prompt + response), generator=gen)
    zeros = torch.zeros(rows, response)
    return Experience(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=prompt,
                      response_ids=ids[:, prompt:], response_mask=torch.ones(rows, response, dtype=torch.long),
                      old_logprobs=-12.0 + 0.1 * torch.randn(rows, response, generator=gen), ref_logprobs=zeros,
                      old_values=zeros, score=torch.zeros(rows), rewards=zeros,
                      advantages=torch.randn(rows, response, generator=gen), returns=zeros)


def worker(args) -> None:
    pin_to_core(args.core)
    quiet_hf()
    import rlhfkit.models.forward as models
    from rlhfkit.config import Config
    from rlhfkit.trainers.rl import minibatch_loss

    budget = models.UPDATE_LOGITS
    if args.worker == "full":
        budget = 2 * args.rows * args.response * VOCAB  # one chunk: the full-logits path
    ac = build(args.layers, budget)
    exp = batch(args.rows, args.prompt, args.response)
    pc = dataclasses.replace(Config().ppo, entropy_coef=args.entropy_coef, kl_in_loss=False)
    rows = torch.arange(args.rows)
    gc.collect()
    before = proc_status_mib("VmRSS")
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    loss, _, _ = minibatch_loss(ac, exp, rows, pc, kl_coef=0.0, update_policy=True)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    chunk = max(1, budget // VOCAB)
    print(RESULT + json.dumps({"before": before, "peak": peak, "reset": reset, "seconds": seconds,
                               "loss": loss.item(), "chunk_rows": min(chunk, args.rows * args.response)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B's depth)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--entropy-coef", type=float, nargs="+", default=[0.0, 0.01])
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--worker", choices=["full", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default="runs/update_memory", help="where rows go without --record")
    add_record_args(ap)
    args = ap.parse_args()
    if args.worker:
        args.entropy_coef = args.entropy_coef[0]
        return worker(args)
    pin_to_core(args.core)
    rows = []
    for coef in args.entropy_coef:
        for variant in ("full", "chunked"):
            cmd = pinned_cmd(args.core, __file__, "--worker", variant, "--layers", str(args.layers), "--rows",
                             str(args.rows), "--prompt", str(args.prompt), "--response", str(args.response),
                             "--entropy-coef", str(coef), "--core", str(args.core))
            env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            if proc.returncode or not lines:
                sys.exit(f"{variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            rows.append((variant, coef, res := json.loads(lines[-1][len(RESULT):])))
            settings = {"layers": args.layers, "rows": args.rows, "prompt_tokens": args.prompt,
                        "response_tokens": args.response, "entropy_coef": coef, "lora_r": 8, "vocab": VOCAB}
            record("update_memory", {"contender": variant, "settings": settings, "seeds": [0], "times_s": [res["seconds"]],
                                     "peak_mib": res["peak"], "before_mib": res["before"], "peak_reset": res["reset"],
                                     "threads": 1}, args)
            print(f"  {variant}, entropy_coef {coef}: done", flush=True)
    print(f"\nOne PPO policy update (forward + loss + backward), Qwen2.5-0.5B shape with {args.layers} layers, "
          f"vocabulary {VOCAB}, LoRA r 8, float32, CPU, one core; minibatch {args.rows} x ({args.prompt} prompt + "
          f"{args.response} response) tokens")
    print(f"{'logits':<9}{'entropy':>8}{'chunk rows':>11}{'RSS before':>12}{'peak RSS':>11}{'peak - before':>15}"
          f"{'seconds':>9}{'loss':>12}")
    for variant, coef, r in rows:
        chunk = "-" if variant == "full" else str(r["chunk_rows"])
        print(f"{variant:<9}{coef:>8g}{chunk:>11}{r['before']:>8.0f} MiB{r['peak']:>7.0f} MiB"
              f"{r['peak'] - r['before']:>11.0f} MiB{r['seconds']:>9.1f}{r['loss']:>12.6f}")
    if not all(r["reset"] for _, _, r in rows):
        print("(the peak RSS could not be reset before the update: the peaks include model building)")


if __name__ == "__main__":
    main()
