"""Where one update micro-batch's time goes on a CPU: rlhfkit's forward and backward of the
policy loss, against the same arithmetic run part by part.

The micro-batch is one of ``real_step.py``'s: by default its ``reasoning`` workload's, a group of
8 rows sharing a 64-token prompt with 512 completion tokens each, on SmolLM2-135M-Instruct's
shape (30 layers, width 576, 9 heads / 3 key-value heads, MLP 1536, vocabulary 49152, tied
embeddings), full fine-tuning, float32, one thread. Random weights (the arithmetic does not
depend on them; ``--model DIR`` loads a fetched model instead). The parts, each with the shapes
the update runs (each group's prompt once, ``rlhfkit.accel.forward.response_hidden_states``):

- ``update``: the whole thing, ``lean.response_hidden_states`` then the LM head's log-probs
  (``logprobs.chunked_token_logprobs``) and a loss of them, backward, gradients dropped;
- ``body products``: every linear layer's three products as bare calls of ``rlhfkit.accel.gemm``
  (forward ``x @ W.T``, input gradient ``g @ W``, weight gradient ``g.T @ x``) on the same
  number of rows, each layer's weights their own tensors: what the layers would cost if nothing
  else ran (oneDNN on non-Intel CPUs with AVX-512, MKL elsewhere, as ``rlhfkit.accel.gemm.enabled`` picks);
- ``attention``: the causal attention of both streams of every layer, forward and backward,
  through ``lean._attend`` (the routing the update takes: PyTorch's attention, or where oneDNN's
  products are in use the blocked kernel of ``rlhfkit.accel.kernels``); its FLOP count is every query against every
  key it is handed, masked or not;
- ``head``: ``logprobs.chunked_token_logprobs`` on hidden states of the update's shape, forward and
  backward (each chunk's logits twice, the hidden states' and the weight's gradients);
- ``the rest``: ``update`` less the three parts: norms, rotary embeddings, the SwiGLU, copies,
  the embedding's gradient, autograd's own work.

Each round runs the four measurements one after another (so the CPU's drift hits them alike);
one warm-up round, then ``--repeats`` rounds; the table gives each part's median seconds, its
share of the update's median, its FLOP and its rate.

    python benchmarks/update_profile.py --core 1
    python benchmarks/update_profile.py --prompts 4 --group 4 --prompt-len 128 --new 64   # a short micro-batch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhfkit.accel import forward as lean
from rlhfkit.accel import gemm
from rlhfkit.models import logprobs
from rlhfkit.models.forward import UPDATE_LOGITS, position_ids_from_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import add_record_args, commit, cpu, peak_rss_mib, pin_to_core, record  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
               max_position_embeddings=8192, rms_norm_eps=1e-5, attention_dropout=0.0)


def build(args) -> torch.nn.Module:
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
    model.config.use_cache = False
    return model.train()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Parts:
    """The micro-batch and the four measurements of the module's docstring."""

    def __init__(self, model: torch.nn.Module, args):
        cfg = model.config
        self.model, self.U, self.B, self.P = model, args.prompts, args.prompts * args.group, args.prompt_len
        self.C, self.I, self.L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or self.C // self.H
        self.V = cfg.vocab_size
        prompts = torch.randint(0, self.V, (self.U, self.P)).repeat_interleave(args.group, 0)
        self.ids = torch.cat([prompts, torch.randint(0, self.V, (self.B, args.new))], 1)
        self.mask = torch.ones_like(self.ids)
        self.pos = position_ids_from_mask(self.mask)
        shared = lean.shared_prompts(self.ids, self.mask, self.P)
        if shared is None:
            raise SystemExit("the rows' prompts are not shared enough for the update to run them once: --group > 1")
        self.first, self.rows = shared
        self.targets = self.ids[:, self.P:].flatten()
        self.T_in = self.ids.shape[1] - 1  # the update does not run the last column
        self.R_in = self.T_in - self.P  # response columns run
        self.head_rows = self.targets.numel()
        self.chunk = max(1, UPDATE_LOGITS // self.V)
        # bare products: each layer's own weights, [out, in] as the model's
        shapes = [(self.H * self.D, self.C), (self.Hkv * self.D, self.C), (self.Hkv * self.D, self.C),
                  (self.C, self.H * self.D), (self.I, self.C), (self.I, self.C), (self.C, self.I)]
        self.weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(self.L)]
        n = max(self.U * self.P, self.B * self.R_in)
        self.acts = {k: torch.randn(n, k) for k in {i for _, i in shapes} | {o for o, _ in shapes}}

    def head_loss(self, h, weight):  # the head's log-probs and a token-level loss of them
        return logprobs.chunked_token_logprobs(h, weight, None, self.targets, 1.0, self.chunk)[0].sum() * (
            -1.0 / self.head_rows)

    def update(self) -> None:
        m = self.model
        h = lean.response_hidden_states(m, self.ids, self.mask, self.pos, self.P, self.first, self.rows)
        self.head_loss(h.flatten(0, 1), m.get_output_embeddings().weight).backward()
        m.zero_grad(set_to_none=True)

    def layer_rows(self, layer: int) -> list[tuple[int, int]]:
        """(rows through q/k/v, rows through o and the MLP) of each stream: the prompt stream's
        last layer runs only each prompt's last column after its keys and values."""
        n_p = self.U * self.P
        last = layer == self.L - 1
        return [(n_p, self.U if last else n_p), (self.B * self.R_in, self.B * self.R_in)]

    def body_products(self) -> None:
        for layer, ws in enumerate(self.weights):
            for n_qkv, n_rest in self.layer_rows(layer):
                for j, w in enumerate(ws):
                    n = n_qkv if j < 3 else n_rest
                    x, g = self.acts[w.shape[1]][:n], self.acts[w.shape[0]][:n]
                    gemm.linear(x, w)
                    gemm.mm(g, w)
                    gemm.grad_weight(g, x, w)

    def body_flop(self) -> float:
        total = 0
        for layer, ws in enumerate(self.weights):
            for n_qkv, n_rest in self.layer_rows(layer):
                total += sum(3 * 2 * (n_qkv if j < 3 else n_rest) * w.numel() for j, w in enumerate(ws))
        return total

    def attention_inputs(self):
        full = lean._full_mask(self.mask[:, : self.T_in])
        mask_p, mask_r = full[self.first, :, : self.P, : self.P], full[:, :, self.P:, :]
        D = self.D

        def leaf(*shape):
            return torch.randn(*shape, requires_grad=True)

        prompt = (leaf(self.U, self.H, self.P, D), leaf(self.U, self.Hkv, self.P, D), leaf(self.U, self.Hkv, self.P, D),
                  mask_p)
        resp = (leaf(self.B, self.H, self.R_in, D), leaf(self.B, self.Hkv, self.T_in, D),
                leaf(self.B, self.Hkv, self.T_in, D), mask_r)
        return prompt, resp

    def attention(self) -> None:
        scale, groups = self.D**-0.5, self.H // self.Hkv
        prompt, resp = self.attention_inputs()
        for layer in range(self.L):
            for q, k, v, mask in (prompt, resp):
                queries = q[:, :, -1:] if layer == self.L - 1 and q is prompt[0] else q
                out = lean._attend(queries, k, v, mask[:, :, -queries.shape[2]:], scale, groups)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    def attention_flop(self) -> float:
        per = 7 * 2 * self.D * self.H  # QK^T and PV forward, five products backward
        last_p = self.U * 1 * self.P
        return per * ((self.L - 1) * self.U * self.P * self.P + last_p + self.L * self.B * self.R_in * self.T_in)

    def head(self) -> None:
        h = torch.randn(self.head_rows, self.C, requires_grad=True)
        w = self.model.get_output_embeddings().weight
        self.head_loss(h, w).backward()
        self.model.zero_grad(set_to_none=True)

    def head_flop(self) -> float:
        return 4 * 2 * self.head_rows * self.C * self.V


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1, help="distinct prompts in the micro-batch")
    ap.add_argument("--group", type=int, default=8, help="rows per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=512, help="completion tokens")
    ap.add_argument("--model", help="a fetched model's directory (default: SmolLM2-135M's shape, random weights)")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds after one warm-up round")
    ap.add_argument("--core", type=int, help="pin the process to this core")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/update_profile", help="where rows go without --record")
    add_record_args(ap)
    args = ap.parse_args()
    if args.core is not None:
        pin_to_core(args.core)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    parts = Parts(build(args), args)
    runs = {"update": parts.update, "body products": parts.body_products, "attention": parts.attention,
            "head": parts.head}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.repeats + 1):
        this = {name: timed(fn) for name, fn in runs.items()}
        print(f"round {r}{' (warm-up)' if not r else ''}: " + ", ".join(f"{k} {t:.2f} s" for k, t in this.items()),
              flush=True)
        for name, t in this.items():
            if r:
                times[name].append(t)
    settings = {"prompts": args.prompts, "group": args.group, "prompt_tokens": args.prompt_len, "new_tokens": args.new,
                "model": args.model or "smollm2-135m shape, random", "products": "oneDNN" if gemm.enabled() else "MKL"}
    for name, ts in times.items():
        record("update_profile", {"contender": name, "settings": settings, "seeds": [args.seed], "times_s": ts,
                                  "peak_mib": peak_rss_mib()}, args)
    med = {k: statistics.median(v) for k, v in times.items()}
    flop = {"body products": parts.body_flop(), "attention": parts.attention_flop(), "head": parts.head_flop()}
    med["the rest"] = med["update"] - med["body products"] - med["attention"] - med["head"]
    flop["update"] = sum(flop.values())
    print(f"\n{parts.B} rows ({parts.U} prompt(s) of {parts.P} tokens x {args.group}) x {args.new} new tokens, "
          f"{parts.L} layers, width {parts.C}, vocabulary {parts.V}; float32, one thread; commit {commit()}, "
          f"{cpu()}, torch {torch.__version__}, products on "
          f"{'oneDNN' if gemm.enabled() else 'MKL'}; medians of {args.repeats} rounds (min-max)")
    print(f"{'part':15} {'seconds':>22} {'share':>6} {'GFLOP':>8} {'GFLOP/s':>8}")
    for name in ("update", "body products", "attention", "head", "the rest"):
        spread = f"({min(times[name]):.2f}-{max(times[name]):.2f})" if name in times else ""
        rate = f"{flop[name] / 1e9 / med[name]:8.0f}" if name in flop and med[name] > 0 else f"{'':8}"
        gf = f"{flop[name] / 1e9:8.0f}" if name in flop else f"{'':8}"
        print(f"{name:15} {med[name]:8.2f} {spread:>13} {med[name] / med['update']:6.0%} {gf} {rate}")


if __name__ == "__main__":
    main()
