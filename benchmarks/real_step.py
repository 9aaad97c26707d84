"""One RL step at real model sizes: rlhfkit's GRPO and PPO against TRL's GRPOTrainer, phase by
phase, with the peak resident memory of each phase.

Models (random init, float32, nothing downloaded), each with a byte-level BPE tokenizer of
the model's full vocabulary trained here with ``tokenizers`` on the Python standard library's
sources (cached under ``--out``):

    gpt2   GPT-2 small's config: 12 layers, width 768, 12 heads, vocabulary 50257 (124M)
    qwen   Qwen2.5-0.5B's config: 24 layers, width 896, 14 heads / 2 KV heads, MLP 4864,
           vocabulary 151936, tied embeddings (494M); ``--layers`` keeps fewer of the layers

Step: 16 prompts of 128 tokens (windows of the same sources, from a JSONL file) x 4 samples x
64 new tokens (the random-init models do not stop early), temperature 1, no top-k / top-p;
reward: a cheap function of the text (share of letters), the same callable for both
libraries. Both take one optimizer step of the 64 completions, in micro-batches of 16, with
a k3 KL term of weight 0.3 in the loss against the reference (the base model; with LoRA the
base with the adapter disabled), scores divided by the batch's std, dropout off and no
gradient checkpointing (``--checkpointing`` turns it on for every contender):

    rlhfkit GRPO       ``rlhfkit grpo``'s defaults but one epoch of one minibatch of 64
                       (``ppo.ppo_epochs=1 ppo.minibatch_size=64 ppo.micro_batch_size=16``)
    rlhfkit PPO        ``rlhfkit ppo`` with a separate critic started from the policy, the
                       same schedule, no critic warm-up (KL 0.2 in the reward, its default)
    TRL GRPOTrainer    trl 1.16: ``per_device_train_batch_size=16``,
                       ``gradient_accumulation_steps=4`` (one generation of 64 per optimizer
                       step), ``num_generations=4``, ``beta=0.3``, ``scale_rewards='batch'``,
                       ``disable_dropout=True``, loss 'dapo' (its default)

each full fine-tuning and LoRA (r 16, alpha 32, every linear layer but the head; PPO's critic
through its own adapter, ``value.lora``). TRL has no PPO trainer in 1.16, so the PPO rows have
no TRL counterpart; they show what the critic costs.

Every contender runs in its own process pinned to one core (``taskset``) with one torch
thread, ``--warmup`` steps then ``--steps`` measured ones (medians). ``--cores 0 1`` runs two
contenders at a time, one per core, an rlhfkit one beside a TRL one where the list allows
(the two share the memory bus; ``--cores 0`` runs them one after another). Per phase: seconds
and the phase's peak resident set (``VmHWM`` after resetting it through
``/proc/self/clear_refs`` at each phase boundary); ``loaded`` is the resident set when the
first step starts (libraries, the models, no optimizer state yet). TRL's phases are timed from
the outside: rollout to the end of its ``_generate``, experience to the end of
``_generate_and_score_completions`` (reference log-probs, rewards, advantages), update to the
end of the optimizer step.

    python benchmarks/real_step.py --size gpt2                     # all rows, GPT-2 small
    python benchmarks/real_step.py --size qwen --layers 6 --rows rlhfkit_grpo trl_grpo
"""

from __future__ import annotations

import argparse
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

from bench_common import PhaseClock, clock_grpo_trainer, marked, pin_to_core, pinned_cmd, quiet_hf  # noqa: E402

RESULT = "RESULT "
DEFAULT_OUT = "runs/bench_real"
PROMPT_TOKENS, GROUPS, GROUP_SIZE, NEW_TOKENS, MICRO = 128, 16, 4, 64, 16
LR, KL = 1e-5, 0.3
LORA = {"r": 16, "alpha": 32.0}
SIZES = {
    "gpt2": {"vocab": 50257, "layers": 12},
    "qwen": {"vocab": 151936, "layers": 24},
}
ROWS = ["rlhfkit_grpo", "trl_grpo", "rlhfkit_grpo_lora", "trl_grpo_lora", "rlhfkit_ppo", "rlhfkit_ppo_lora"]
NAMES = {"rlhfkit_grpo": "rlhfkit GRPO", "trl_grpo": "TRL GRPOTrainer", "rlhfkit_grpo_lora": "rlhfkit GRPO, LoRA",
         "trl_grpo_lora": "TRL GRPOTrainer, LoRA", "rlhfkit_ppo": "rlhfkit PPO", "rlhfkit_ppo_lora": "rlhfkit PPO, LoRA"}
PAIRS = [("rlhfkit_grpo", "trl_grpo"), ("rlhfkit_grpo_lora", "trl_grpo_lora")]
PHASES = ("rollout", "experience", "update")


def letter_share(prompts, completions, **kw) -> list[float]:
    """The benchmark's reward: the share of letters in each completion's text (cheap, and it
    varies between samples, so advantages are not all zero)."""
    return [sum(ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]


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


def prepare(out: Path, size: str, layers: int, prompts: int) -> dict[str, str]:
    """The model directory (weights + tokenizer) and the prompt file, built once under ``out``."""
    model_dir = out / f"{size}_{layers}l"
    prompt_file = out / f"prompts_{size}.jsonl"
    if (model_dir / "config.json").exists() and prompt_file.exists():
        return {"model": str(model_dir), "prompts": str(prompt_file)}
    quiet_hf()
    tok_dir = out / f"tokenizer_{size}"
    if (tok_dir / "tokenizer.json").exists():
        from transformers import AutoTokenizer

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
    ids = tok("".join(corpus(1)))["input_ids"]
    with open(prompt_file, "w") as fh:
        for i in range(prompts):
            window = ids[i * PROMPT_TOKENS:(i + 1) * PROMPT_TOKENS]
            fh.write(json.dumps({"prompt": tok.decode(window)}) + "\n")
    return {"model": str(model_dir), "prompts": str(prompt_file)}


# --------------------------------------------------------------------------- contenders


def medians(clock: PhaseClock, warmup: int) -> dict:
    rows, peaks = clock.rows[warmup:], clock.peaks[warmup:]
    return {"seconds": {k: statistics.median(r[k] for r in rows) for k in PHASES},
            "peak_mib": {k: max(p[k] for p in peaks) for k in PHASES}, "loaded_mib": clock.rss_at_first_start}


def run_rlhfkit(kind: str, paths: dict, args) -> dict:
    import rlhfkit.trainers.rl as rl
    from rlhfkit.config import ALGO_DEFAULTS, Config

    algo = "ppo" if kind.startswith("rlhfkit_ppo") else "grpo"
    lora = kind.endswith("_lora")
    out = Path(args.out) / f"step_{args.size}_{args.layers}l_{kind}"
    shutil.rmtree(out, ignore_errors=True)
    ppo = {**ALGO_DEFAULTS[algo], "steps": args.warmup + args.steps, "batch_size": GROUPS * GROUP_SIZE,
           "ppo_epochs": 1, "minibatch_size": GROUPS * GROUP_SIZE, "micro_batch_size": MICRO,
           "max_new_tokens": NEW_TOKENS, "lr": LR, "stop_at": 0.0, "eval_every": 0, "critic_warmup_steps": 0,
           "samples_per_log": 0, "trajectories_every": 0}
    if algo == "grpo":
        ppo.update(group_size=GROUP_SIZE, kl_coef=KL)
    model = {"name": paths["model"], "gradient_checkpointing": args.checkpointing}
    if lora:
        model.update(lora_r=LORA["r"], lora_alpha=LORA["alpha"])
    cfg = Config().replace(
        run={"out_dir": str(out), "seed": args.seed, "progress": False, "threads": 1, "checkpoint_every": 0,
             "tensorboard": False},
        model=model, ppo=ppo, value={"lora": lora}, reward={"function": "real_step:letter_share"},
        data={"path": paths["prompts"], "max_prompt_length": PROMPT_TOKENS})
    clock = PhaseClock()
    rl.rollout = marked(rl.rollout, clock, "rollout", start=True)
    rl.make_experience = marked(rl.make_experience, clock, "experience")
    rl.ppo_update = marked(rl.ppo_update, clock, "update", end=True)
    rl.train_rl(cfg)
    return medians(clock, args.warmup)


def run_trl(kind: str, paths: dict, args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.utils import read_jsonl

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    steps = args.warmup + args.steps
    prompts = [r["prompt"] for r in read_jsonl(paths["prompts"])][:steps * GROUPS]
    config = GRPOConfig(
        output_dir=str(Path(args.out) / f"step_{args.size}_{args.layers}l_{kind}"), learning_rate=LR, lr_scheduler_type="constant",
        beta=KL, num_generations=GROUP_SIZE, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GROUPS * GROUP_SIZE // MICRO, max_completion_length=NEW_TOKENS,
        scale_rewards="batch", disable_dropout=True, temperature=1.0, max_steps=steps, bf16=False,
        gradient_checkpointing=args.checkpointing, use_cpu=True, seed=args.seed, logging_steps=1000,
        log_level="error", report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    peft_config = None
    if kind.endswith("_lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    clock = PhaseClock()
    trainer = GRPOTrainer(model=model, reward_funcs=letter_share, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=peft_config)
    clock_grpo_trainer(trainer, clock)
    trainer.train()
    return medians(clock, args.warmup)


# --------------------------------------------------------------------------- driver


def worker(args) -> None:
    pin_to_core(args.core)
    quiet_hf()
    paths = {"model": str(Path(args.out) / f"{args.size}_{args.layers}l"),
             "prompts": str(Path(args.out) / f"prompts_{args.size}.jsonl")}
    result = (run_trl if args.worker.startswith("trl") else run_rlhfkit)(args.worker, paths, args)
    result["seconds"]["total"] = sum(result["seconds"][k] for k in PHASES)
    result["peak_rss_mib"] = max(result["loaded_mib"], *result["peak_mib"].values())
    print(RESULT + json.dumps(result), flush=True)


def launch(kind: str, core: int, args) -> subprocess.Popen:
    cmd = pinned_cmd(core, __file__, "--worker", kind, "--size", args.size, "--layers", str(args.layers),
                     "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                     "--core", str(core), "--out", args.out, *(["--checkpointing"] if args.checkpointing else []))
    env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def collect(kind: str, proc: subprocess.Popen, t0: float) -> dict | None:
    stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        print(f"{NAMES[kind]} failed (exit {proc.returncode}); skipped:\n{stderr[-3000:]}", flush=True)
        return None
    result = json.loads(lines[-1][len(RESULT):])
    print(f"  {NAMES[kind]}: {result['seconds']['total']:.1f} s/step, peak {result['peak_rss_mib']:.0f} MiB "
          f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
    return result


def print_table(results: dict, args) -> None:
    print(f"\nOne RL step, {args.size} shape with {args.layers} layers ({SIZES[args.size]['vocab']}-token vocabulary), "
          f"float32, {GROUPS} prompts x {GROUP_SIZE} samples x {NEW_TOKENS} new tokens, prompts of {PROMPT_TOKENS} "
          f"tokens, one optimizer step in micro-batches of {MICRO}; one core per contender, 1 torch thread; median "
          f"of {args.steps} step(s) after {args.warmup} warm-up; seconds, and each phase's peak resident set in MiB")
    print(f"{'contender':<24}{'rollout':>9}{'experience':>12}{'update':>9}{'total':>9}   {'loaded':>7}"
          f"{'rollout':>9}{'experience':>12}{'update':>9}{'peak':>8}")
    for kind, r in results.items():
        s, m = r["seconds"], r["peak_mib"]
        print(f"{NAMES[kind]:<24}{s['rollout']:>9.1f}{s['experience']:>12.1f}{s['update']:>9.1f}{s['total']:>9.1f}   "
              f"{r['loaded_mib']:>7.0f}{m['rollout']:>9.0f}{m['experience']:>12.0f}{m['update']:>9.0f}"
              f"{r['peak_rss_mib']:>8.0f}")
    for ours, theirs in PAIRS:
        if ours in results and theirs in results:
            t = results[ours]["seconds"]["total"] / results[theirs]["seconds"]["total"]
            m = results[ours]["peak_rss_mib"] / results[theirs]["peak_rss_mib"]
            print(f"{NAMES[ours]} / {NAMES[theirs]}: step time {t:.2f}x, peak memory {m:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="gpt2")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the real model's)")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=ROWS)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, nargs="+", default=[0], help="cores to run contenders on, one each at a time")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing for every contender")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.layers = args.layers or SIZES[args.size]["layers"]
    if args.worker:
        return worker(args)
    if any(r.startswith("trl") for r in args.rows):
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: pip install -e .[bench] (or leave the trl_* rows out with --rows)")
    prepare(Path(args.out), args.size, args.layers, max(256, (args.warmup + args.steps) * GROUPS))
    results, queue, t0 = {}, list(args.rows), time.perf_counter()
    while queue:
        batch = []
        for core in args.cores:  # an rlhfkit row beside a TRL row where the queue allows
            if not queue:
                break
            want = "trl" if batch and not batch[-1][0].startswith("trl") else "rlhfkit"
            kind = next((k for k in queue if k.startswith(want)), queue[0])
            queue.remove(kind)
            batch.append((kind, launch(kind, core, args)))
        for kind, proc in batch:
            if (r := collect(kind, proc, t0)) is not None:
                results[kind] = r
    print_table({k: results[k] for k in args.rows if k in results}, args)


if __name__ == "__main__":
    main()
