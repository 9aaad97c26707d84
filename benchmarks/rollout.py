"""Rollout throughput: rlhfkit.rollout.generate.generate vs transformers' ``generate``, same model.

Both sample (temperature 1, no top-k / top-p) from the same left-padded prompts with a KV
cache (transformers: its default ``DynamicCache``), for the same number of new tokens: EOS
is disabled for both (rlhfkit gets ``eos_token_id=-1``, transformers a generation config
without one), so every row generates exactly ``--new-tokens`` tokens and tokens/s compare
like for like. Calls are interleaved and repeated; the table shows the best of the repeats
(``--stat median`` for the median). A third row,
``rlhfkit (HF forward)``, runs rlhfkit's decode loop through the model's own forward
(``lean=False``), to separate the decode loop from the lean forward.

Models (random init except ``tiny``):
    tiny        the pretrained doubling GPT-2 (2 layers, 64 wide), batch 64 x 8 new tokens,
                the RL rollout of the time-to-accuracy benchmark
    gpt2-small  GPT-2 small config (124M parameters, vocabulary 50257)
    qwen-0.5b   a Qwen2.5-0.5B-shaped config (494M parameters, GQA 14/2 heads, vocabulary 151936)

CPU runs pin themselves to one core (``--core``) with one torch thread. On a GPU
(``--device cuda --dtype bf16``) the table adds the model FLOP utilisation: generated
tokens/s x FLOPs per token (2 x parameters in the matmuls + attention over the context) /
the device's peak (``--peak-tflops``, by default 989 for H100/H200 bf16 dense).

    python benchmarks/rollout.py                                   # tiny + gpt2-small on CPU
    python benchmarks/rollout.py --models gpt2-small --batch 32 --new-tokens 128
    python benchmarks/rollout.py --device cuda --dtype bf16 --models qwen-0.5b gpt2-small
    python benchmarks/rollout.py --models tiny --clock cpu --record   # into benchmarks/results/rollout.jsonl

``--clock cpu`` times the process's CPU seconds instead of wall seconds (CPU runs: one pinned
thread), which other jobs on a shared machine disturb much less.

Every (model, runner) of a run is one row with every call's seconds (``bench_common.record``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    DEFAULT_OUT,
    add_record_args,
    peak_rss_mib,
    pin_to_core,
    prepare,
    quiet_hf,
    record,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def build(name: str, device, dtype, out: str):
    """``(model, vocab_size, eos_id_of_the_checkpoint)`` on ``device`` in ``dtype``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    if name == "tiny":
        from rlhfkit.models.forward import load_policy

        model = load_policy(prepare(out)["base"])
    elif name == "gpt2-small":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif name == "qwen-0.5b":
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0,
                          eos_token_id=1, pad_token_id=2)
        torch.manual_seed(0)
        with torch.device(device):  # initialise in place: 0.5B parameters
            model = Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(name)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as rlhfkit with eos=-1
    return model, model.config.vocab_size


def prompts(name: str, batch: int, prompt_len: int, vocab: int, device, out: str):
    """Left-padded prompts: the doubling task's for ``tiny``, random tokens of ragged length
    (between half and all of ``prompt_len``) otherwise."""
    if name == "tiny":
        from transformers import AutoTokenizer

        from rlhfkit.rollout.generate import tokenize_prompts
        from rlhfkit.tasks import doubling

        tok = AutoTokenizer.from_pretrained(prepare(out)["base"])
        return (*tokenize_prompts(tok, [p.text for p in doubling.DoublingData(0).prompts(batch)], device),
                tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    pad = 2 if name == "qwen-0.5b" else 0
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad).to(device), mask.to(device), pad


def flops_per_token(model, context: float) -> float:
    """2 x matmul parameters (embedding look-ups excluded, the LM head included) + attention
    (QK^T and AV: 4 x layers x context x attention width)."""
    cfg = model.config
    head = model.get_output_embeddings().weight  # may be tied to the input embedding
    skip = {id(head), id(model.get_input_embeddings().weight)}
    n = head.numel() + sum(p.numel() for name, p in model.named_parameters()
                           if p.dim() == 2 and id(p) not in skip and "wpe" not in name)
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    width = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * cfg.num_attention_heads
    return 2 * n + 4 * layers * context * width


def timed(fn, device, clock=time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - t0


def bench_model(name: str, args, device, dtype) -> list[dict]:
    from rlhfkit.rollout.generate import generate

    model, vocab = build(name, device, dtype, args.out)
    batch = args.batch or (64 if name == "tiny" else 16)
    new = args.new_tokens or (8 if name == "tiny" else 64)
    ids, mask, pad = prompts(name, batch, args.prompt_len, vocab, device, args.out)
    gen = torch.Generator(device=device).manual_seed(0)

    def ours(lean=True):
        out = generate(model, ids, mask, new, eos_token_id=-1, pad_token_id=pad, generator=gen, lean=lean)
        assert out.response_ids.shape == (batch, new)

    @torch.no_grad()
    def hf():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, pad_token_id=pad, use_cache=True)
        assert out.shape == (batch, ids.shape[1] + new), out.shape

    runs = {"rlhfkit": ours, "rlhfkit (HF forward)": lambda: ours(lean=False), "transformers generate": hf}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for fn in runs.values():  # warm-up (allocator, kernels, caches)
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, fn in runs.items():
            times[k].append(timed(fn, device, time.process_time if args.clock == "cpu" else time.perf_counter))
    tokens = batch * new
    context = ids.shape[1] + new / 2
    fpt = flops_per_token(model, context)
    rows = []
    for k, ts in times.items():
        sec = min(ts) if args.stat == "best" else statistics.median(ts)
        row = {"model": name, "runner": k, "batch": batch, "new": new, "s": sec, "tok_s": tokens / sec, "times_s": ts,
               "prompt_tokens": ids.shape[1]}
        if device.type == "cuda":
            row["mfu"] = row["tok_s"] * fpt / (args.peak_tflops * 1e12)
        rows.append(row)
    hf_rate = rows[-1]["tok_s"]
    for r in rows:
        r["vs_hf"] = r["tok_s"] / hf_rate
    params = sum(p.numel() for p in model.parameters())
    print(f"  {name}: {params / 1e6:.1f}M parameters, prompts {ids.shape[1]} tokens (left-padded), "
          f"{fpt / 1e9:.2f} GFLOP per generated token", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None, choices=["tiny", "gpt2-small", "qwen-0.5b"],
                    help="default: tiny gpt2-small on CPU, qwen-0.5b gpt2-small on CUDA")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--batch", type=int, default=0, help="default 64 for tiny, 16 otherwise")
    ap.add_argument("--new-tokens", type=int, default=0, help="default 8 for tiny, 64 otherwise")
    ap.add_argument("--prompt-len", type=int, default=32, help="longest random prompt (not tiny)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", choices=["best", "median"], default="best",
                    help="best of the repeats (least disturbed by other jobs, as timeit) or their median")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="'cpu' times this process's CPU seconds (one thread, pinned: for a machine shared with other "
                         "jobs; CPU runs only)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (default: by GPU name)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    add_record_args(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        ap.error("--clock cpu times CPU runs only: a GPU's work is not this process's CPU time")
    if device.type == "cpu":
        pin_to_core(args.core)
    quiet_hf()
    if device.type == "cuda" and not args.peak_tflops:
        gpu = torch.cuda.get_device_name(device)
        args.peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), 0.0)
        if not args.peak_tflops:
            raise SystemExit(f"unknown peak for {gpu}: pass --peak-tflops")
    models = args.models or (["tiny", "gpt2-small"] if device.type == "cpu" else ["qwen-0.5b", "gpt2-small"])
    rows = []
    for name in models:
        rows += bench_model(name, args, device, DTYPES[args.dtype])
    where = (f"one CPU core (taskset -c {args.core}), {torch.get_num_threads()} torch thread" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    print(f"\nRollout throughput, sampling at temperature 1, KV cache, {args.dtype}, {where}, {args.clock} clock; "
          f"{args.stat} of {args.repeats} calls each; torch {torch.__version__}")
    mfu = device.type == "cuda"
    print(f"{'model':<12}{'runner':<24}{'batch x new':>12}{'s/call':>9}{'tokens/s':>11}{'vs generate':>13}"
          + (f"{'MFU':>8}" if mfu else ""))
    for r in rows:
        print(f"{r['model']:<12}{r['runner']:<24}{str(r['batch']) + ' x ' + str(r['new']):>12}{r['s']:>9.4f}"
              f"{r['tok_s']:>11.0f}{r['vs_hf']:>12.2f}x" + (f"{r['mfu'] * 100:>7.2f}%" if mfu else ""))
    peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if mfu else peak_rss_mib()
    print(f"peak memory of the process: {peak_mib:.0f} MiB {'CUDA' if mfu else 'RSS'}")
    for r in rows:
        settings = {"model": r["model"], "batch": r["batch"], "new_tokens": r["new"], "prompt_tokens": r["prompt_tokens"],
                    "temperature": 1.0, "kv_cache": True, "warmup_calls": 1, "clock": args.clock}
        record("rollout", {"contender": r["runner"], "settings": settings, "seeds": [0], "times_s": r["times_s"],
                           "tokens_per_call": r["batch"] * r["new"], "peak_mib": peak_mib,
                           "peak_of": "the process, all runners" + (" (CUDA allocated)" if mfu else " (resident set)")},
               args, args.device, args.dtype)


if __name__ == "__main__":
    main()
