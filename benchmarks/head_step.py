"""One micro-batch of completion positions through the LM head and GRPO's per-token loss, forward
and backward: TRL 1.16's chunked log-prob head against rlhfkit's.

Every contender computes the same numbers: the chosen tokens' log-probs under ``hidden @
weight.T`` (float32, never the whole ``[N, V]`` logits), GRPO's token-mean loss on them (PPO's
clipped ratio against old log-probs, plus 0.3 x k3 against reference log-probs), and the
gradients wrt the hidden states and the head's weight (full fine-tuning: the head is trained).

- ``trl``: ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` (what ``GRPOTrainer`` runs
  for the update's log-probs), the loss after it. Its CPU path (no Triton: the tiles are folded
  by torch ops) with log-probs only requested (``GRPOTrainer`` also asks for the entropies).
  Its backward computes every tile's logits again.
- ``rlhfkit``: ``logprobs.chunked_token_logprobs``, the loss after it; its backward also
  computes every chunk's logits again (each row's logsumexp kept from the forward).

Products per micro-batch of N rows (each ``2 N H V`` FLOP): 4 for both (logits, logits again,
the hidden states' gradient, the weight's).

Protocol: each (contender, run) is its own process pinned to ``--core`` with one torch thread;
one warm-up step, then ``--steps`` timed ones (the median is the run's figure); contenders one
after another, the order reversed on odd runs. Memory: the resident set's high-water mark during
the timed steps (``VmHWM``, reset through ``/proc/self/clear_refs``) less the resident set
before them, i.e. what the head and loss add on top of their inputs and the weight's gradient
buffer. The gradients of every contender are compared with the first one's (largest difference
relative to the largest gradient).

    python benchmarks/head_step.py                       # SmolLM2-135M's head, 1024 rows, 3 runs
    python benchmarks/head_step.py --rows 512 --vocab 151936 --hidden 896 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("trl", "rlhfkit")
BETA, CLIP = 0.3, 0.2


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args) -> None:
    import torch

    from rlhfkit.models.logprobs import chunked_token_logprobs

    torch.set_num_threads(1)
    N, H, V = args.rows, args.hidden, args.vocab
    gen = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = (torch.randn(V, H, generator=gen) * H**-0.5).requires_grad_()
    targets = torch.randint(V, (N,), generator=gen)
    chunk = max(1, 2**24 // V)  # rlhfkit's rows per chunk (models.UPDATE_LOGITS // V)
    with torch.no_grad():
        logp0, _ = chunked_token_logprobs(hidden, weight, None, targets, 1.0, chunk)
    old = logp0 + 0.05 * torch.randn(N, generator=gen)
    ref = logp0 + 0.2 * torch.randn(N, generator=gen)
    adv = torch.randn(N, generator=gen)

    def token_loss(lp, s, e):  # GRPO's per-token loss, token mean over the N rows
        ratio = torch.exp(lp - old[s:e])
        per = torch.maximum(-adv[s:e] * ratio, -adv[s:e] * ratio.clamp(1 - CLIP, 1 + CLIP))
        log_r = ref[s:e] - lp
        return ((per + BETA * (log_r.exp() - 1 - log_r)) / N).sum()

    if args.contender == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def loss_of(h):
            lp = ChunkedLogProbFunction.apply(h, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                                              1.0, ())[0]
            return token_loss(lp, 0, N)
    else:
        def loss_of(h):
            return token_loss(chunked_token_logprobs(h, weight, None, targets, 1.0, chunk)[0], 0, N)

    def step():
        h = hidden.clone().requires_grad_()
        t0 = time.perf_counter()
        loss = loss_of(h)
        t1 = time.perf_counter()
        (0.25 * loss).backward()  # a micro-batch's share of its minibatch
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, h.grad

    weight.grad = None
    step()  # warm-up: the weight's gradient buffer now exists, as in an update's later micro-batches
    fwd, bwd = [], []
    before = rss_mib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    for _ in range(args.steps):
        weight.grad = None
        a, b, grad_h = step()
        fwd.append(a)
        bwd.append(b)
    peak = rss_mib("VmHWM") - before
    if args.grads:
        torch.save({"hidden": grad_h, "weight": weight.grad}, args.grads)
    print(json.dumps({"forward": statistics.median(fwd), "backward": statistics.median(bwd),
                      "step": statistics.median(a + b for a, b in zip(fwd, bwd)), "peak_mib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024, help="completion positions in the micro-batch (16 x 64)")
    ap.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's width")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2-135M's vocabulary")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--grads", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.contender:
        return worker(args)
    results = {c: [] for c in args.contenders}
    tmp = tempfile.mkdtemp(prefix="head_step_")
    for run in range(args.runs):
        order = args.contenders if run % 2 == 0 else args.contenders[::-1]
        for c in order:
            cmd = ["taskset", "-c", str(args.core), sys.executable, __file__, "--contender", c, "--rows",
                   str(args.rows), "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--steps",
                   str(args.steps), "--seed", str(args.seed)]
            if run == 0:
                cmd += ["--grads", os.path.join(tmp, c + ".pt")]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode:
                sys.exit(f"{c} failed:\n{out.stderr[-3000:]}")
            results[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {run} {c}: {results[c][-1]}", flush=True)

    import torch

    want = torch.load(os.path.join(tmp, args.contenders[0] + ".pt"), weights_only=True)
    print(f"\none micro-batch: {args.rows} rows, hidden {args.hidden}, vocabulary {args.vocab}, float32, one thread "
          f"on core {args.core}; median (min-max) over {args.runs} runs of the median of {args.steps} steps")
    print(f"{'contender':18} {'forward s':>10} {'backward s':>11} {'step s':>22} {'added MiB':>10} {'grad diff':>10}")
    for c, rs in results.items():
        got = torch.load(os.path.join(tmp, c + ".pt"), weights_only=True)
        diff = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
        steps = [r["step"] for r in rs]
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"{c:18} {med('forward'):10.3f} {med('backward'):11.3f} "
              f"{statistics.median(steps):8.3f} ({min(steps):.3f}-{max(steps):.3f}) {med('peak_mib'):10.0f} "
              f"{diff:10.1e}")


if __name__ == "__main__":
    main()
