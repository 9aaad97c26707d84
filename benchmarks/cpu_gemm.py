"""Float32 ``y = x @ W.T`` on a CPU: MKL (PyTorch's ``F.linear``) against oneDNN (``rlhfkit.gemm``).

The weights are SmolLM2-135M's (hidden 576, MLP 1536, 3 of 9 heads for keys and values, a
49,152-token head), and each layer's is a different tensor, cycled through 30 copies as a
forward cycles through its layers, so that a weight is not in cache when its product runs
(a single repeated weight flatters both). Rows: 64 (a decode step of 64 samples), 341 (a chunk
of the log-prob head), 512 and 1024 (an update micro-batch's shared prompts and its responses),
2048 (a prefill). Also the input
gradient ``g @ W`` (the backward's product through the same weight) and, at 512 and 2048 rows,
the weight gradient ``g.T @ x`` (``rlhfkit.gemm.grad_weight``). One thread, pinned with
``--core``; MKL and oneDNN take turns pass by pass (alternating which goes first), each
GFLOP/s is the median of ``--rounds`` passes over the copies and the ratio the median of the
passes' ratios, MKL's time over oneDNN's (above 1: oneDNN faster). rlhfkit uses oneDNN for
weights of at least ``rlhfkit.gemm.MIN_WEIGHT`` elements (192 x 576 and up here), whatever the
rows, on non-Intel CPUs with AVX-512 (``rlhfkit.gemm.enabled``).

    python benchmarks/cpu_gemm.py --core 1

``--bf16`` compares the float32 product with the bfloat16 one instead, both as PyTorch runs them
(``F.linear``: MKL for float32; oneDNN for bfloat16, on AMX tiles where the CPU has them), the
rows and weights as above: what a bfloat16 step could gain on this CPU's products. Its ratio is
float32's time over bfloat16's.

    python benchmarks/cpu_gemm.py --core 1 --bf16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from rlhfkit.accel import gemm  # noqa: E402

SHAPES = {"q, o (576 x 576)": (576, 576), "k, v (192 x 576)": (192, 576), "gate, up (1536 x 576)": (1536, 576),
          "down (576 x 1536)": (576, 1536), "head (49152 x 576)": (49152, 576)}
ROWS = (64, 341, 512, 1024, 2048)


def timed(fn, inputs, weights, rounds: int) -> float:
    for w in weights[:2]:
        fn(inputs, w)
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for w in weights:
            fn(inputs, w)
        per.append((time.perf_counter() - t) / len(weights))
    return statistics.median(per)


def paired(mkl, onednn, inputs, weights, rounds: int) -> tuple[float, float, float]:
    """MKL's median seconds a product, oneDNN's, and the median of the rounds' ratios (MKL over
    oneDNN): the two take turns round by round, in alternating order, so that a machine whose
    speed drifts between seconds (a shared VM) slows both alike."""
    a, b, ratios = [], [], []
    for r in range(rounds):
        pair = (mkl, onednn) if r % 2 == 0 else (onednn, mkl)
        t = {fn: timed(fn, inputs, weights, 1) for fn in pair}
        a.append(t[mkl])
        b.append(t[onednn])
        ratios.append(t[mkl] / t[onednn])
    return statistics.median(a), statistics.median(b), statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--bf16", action="store_true", help="float32 against bfloat16 products (both PyTorch's own)")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    if args.bf16:
        return bf16_table(args.rounds)
    if not gemm.available():
        sys.exit("oneDNN's linear is not available in this PyTorch build")
    onednn = gemm._onednn
    print(f"torch {torch.__version__}, one thread; GFLOP/s MKL -> oneDNN (ratio), rows x weight [N, K]")
    for name, (N, K) in SHAPES.items():
        copies = 1 if N * K > 1 << 24 else 30
        weights = [torch.randn(N, K) * 0.02 for _ in range(copies)]
        cells, grads, wgrads = [], [], []
        for M in ROWS:
            if M * N * K > 1 << 34:  # the head at 1024 and 2048 rows: not a decode or update chunk's shape
                cells.append(f"{M}: -")
                continue
            x, g = torch.randn(M, K), torch.randn(M, N)
            flop = 2 * M * N * K / 1e9
            a, b, ratio = paired(lambda x, w: F.linear(x, w), lambda x, w: onednn(x, w, None), x, weights,
                                 args.rounds)
            cells.append(f"{M}: {flop / a:.0f} -> {flop / b:.0f} ({ratio:.2f}x)")
            if M in (64, 1024):
                ratio = paired(lambda g, w: torch.mm(g, w), lambda g, w: onednn(g, w.t(), None), g, weights,
                               args.rounds)[2]
                grads.append(f"{M}: {ratio:.2f}x")
            if M in (512, 2048) and copies > 1:  # the weight gradient: no weight read, one product
                ratio = paired(lambda gx, _: gx[0].t() @ gx[1], lambda gx, _: onednn(gx[0].t(), gx[1].t(), None),
                               (g, x), weights[:3], args.rounds)[2]
                wgrads.append(f"{M}: {ratio:.2f}x")
        print(f"{name:22s} " + "   ".join(cells) + "   | g @ W " + "  ".join(grads)
              + ("   | g.T @ x " + "  ".join(wgrads) if wgrads else ""), flush=True)


def bf16_table(rounds: int) -> None:
    """GFLOP/s of ``F.linear`` in float32 and in bfloat16 (the same values rounded), paired as above."""
    flags = [f for f in ("amx_bf16", "avx512_bf16") if f in open("/proc/cpuinfo").read().split()]
    print(f"torch {torch.__version__}, one thread, CPU flags {', '.join(flags) or 'no bf16 ones'}; "
          "GFLOP/s float32 -> bfloat16 (float32's time over bfloat16's), rows x weight [N, K]")
    for name, (N, K) in SHAPES.items():
        copies = 1 if N * K > 1 << 24 else 30
        weights = [(w, w.bfloat16()) for w in (torch.randn(N, K) * 0.02 for _ in range(copies))]
        cells = []
        for M in ROWS:
            if M * N * K > 1 << 34:
                cells.append(f"{M}: -")
                continue
            x = torch.randn(M, K)
            flop = 2 * M * N * K / 1e9
            a, b, ratio = paired(lambda x, w: F.linear(x[0], w[0]), lambda x, w: F.linear(x[1], w[1]),
                                 (x, x.bfloat16()), weights, rounds)
            cells.append(f"{M}: {flop / a:.0f} -> {flop / b:.0f} ({ratio:.2f}x)")
        print(f"{name:22s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
