"""PPO steps of a 0.5B-class Qwen2-shaped model with LoRA, phase by phase, with peak memory.

The model is a random-init ``Qwen2ForCausalLM`` of Qwen2.5-0.5B's shape (24 layers, width
896, GQA 14/2 heads, vocabulary 151936: 494M parameters), built here and saved with
``save_pretrained`` beside the doubling task's tokenizer, so it loads through the same code
path a hub id takes. The run is ``rlhfkit ppo`` as a user would start it:

* policy: the base with a LoRA adapter (``model.lora_r``); the reference is the same modules
  with the adapter switched off (no second copy of the weights);
* reward: a second 0.5B-shaped model with a scalar head (``AutoModelForSequenceClassification``);
* critic: a separate value model initialised from the reward model, trained through its own
  LoRA adapter (``value.lora=true``) plus its scalar head;
* weights in ``model.dtype`` (bf16 by default), batch ``--batch`` prompts, responses of
  ``--new-tokens`` (random weights never emit EOS, so every row runs the full length).

It prints each step's rollout / experience / update seconds, generated tokens per second and
``torch.cuda.max_memory_allocated`` (on a GPU). The first step includes CUDA warm-up.

    python benchmarks/lora_step.py                          # on the GPU, bf16
    python benchmarks/lora_step.py --device cpu --dtype float32 --layers 2 --batch 8 --new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def build(out: Path, layers: int, device: str, dtype: torch.dtype) -> tuple[str, str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from rlhfkit.tasks import doubling

    tok = doubling.make_tokenizer()
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    paths = []
    for name, cls, extra in (("policy", Qwen2ForCausalLM, {}), ("reward", Qwen2ForSequenceClassification,
                                                                 {"num_labels": 1})):
        torch.manual_seed(len(paths))
        with torch.device(device):  # initialise in place
            model = cls(Qwen2Config(**{**cfg.to_dict(), **extra})).to(dtype)
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        paths.append(str(out / name))
        del model
    return paths[0], paths[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--layers", type=int, default=24, help="24 = Qwen2.5-0.5B's depth")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--minibatch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    from rlhfkit.config import Config
    from rlhfkit.trainers.rl import train_rl

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        policy, reward = build(tmp, args.layers, args.device, dtype)
        print(f"built and saved policy + reward model in {time.perf_counter() - t0:.1f} s")
        cfg = Config().replace(
            run={"out_dir": str(tmp / "run"), "device": args.device, "progress": False},
            model={"name": policy, "dtype": args.dtype, "lora_r": args.lora_r, "lora_alpha": 2.0 * args.lora_r,
                   "gradient_checkpointing": args.gradient_checkpointing},
            reward={"name": reward}, value={"lora": True},
            ppo={"algo": "ppo", "steps": args.steps, "batch_size": args.batch, "minibatch_size": args.minibatch,
                 "ppo_epochs": 1, "max_new_tokens": args.new_tokens, "critic_warmup_steps": 0, "eval_every": 0,
                 "stop_at": 0.0, "value_init": "reward", "trajectories_every": 0},
            eval={"batch_size": 512, "max_new_tokens": 8},
        )
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        train_rl(cfg)
        rows = [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl", encoding="utf-8")]
    print(f"\nPPO with LoRA r={args.lora_r}, {args.layers} layers x 896 wide, vocabulary 151936, {args.dtype}, "
          f"{args.device}; batch {args.batch} x {args.new_tokens} new tokens, minibatches of {args.minibatch}")
    print(f"{'step':>4} {'rollout s':>10} {'experience s':>13} {'update s':>9} {'step s':>7} {'gen tok/s':>10} "
          f"{'peak GiB':>9}")
    for r in rows:
        if "time/rollout_s" not in r:
            continue
        total = r["time/rollout_s"] + r["time/experience_s"] + r["time/update_s"]
        gen = args.batch * r.get("response/length", args.new_tokens) / r["time/rollout_s"]
        peak = r.get("memory/peak_allocated_gib", float("nan"))
        print(f"{r['step']:>4} {r['time/rollout_s']:>10.2f} {r['time/experience_s']:>13.2f} {r['time/update_s']:>9.2f} "
              f"{total:>7.2f} {gen:>10.0f} {peak:>9.2f}")


if __name__ == "__main__":
    main()
