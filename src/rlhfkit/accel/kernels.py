"""rlhfkit's compiled pieces (``csrc/cpu_kernels.c``), float32 on a CPU (but for a bfloat16 LM head and decode step).

At a small model's sizes PyTorch's CPU ops spend more on set-up than on arithmetic. On the
tiny doubling GPT-2's rollout (64 rows, 4 heads, ~20 positions, a 42-token vocabulary),
``scaled_dot_product_attention`` took ~110 us a call for ~1 us of arithmetic, the tanh-GELU
four element-wise passes, and each sampling step ~12 small ops. Three loops do the same work
in one pass each:

* :func:`attention` / :func:`decode_attention`: softmax attention for short contexts (the
  latter bound once per rollout to a decode loop's buffers, appending to the KV cache too);
* :func:`gelu_tanh`: ``x * sigmoid(c1 x + c3 x^3)``, optionally writing the gate for a backward;
* :func:`swiglu` / :func:`swiglu_backward`: a Llama MLP's ``silu(gate) * up`` and its gradients
  (recomputing the activation the forward did not keep) in one pass each;
* :func:`block_attention`: at the other end, causal attention too large for the loop above, on
  one thread: oneDNN products over blocks of queries, each with only the keys it may see, and
  a compiled masked softmax between them (forward and backward);
* :class:`Sampler`: tempered log-softmax, inverse-CDF draw, log-prob, entropy, EOS bookkeeping;
* :func:`head_lse_bf16` / :func:`head_grad_bf16`: a bfloat16 LM head's log-probs and their
  gradient wrt the logits, read from the bfloat16 logits directly (an exception to float32:
  PyTorch's route converts each chunk to float32 first and runs five passes over it);
* :func:`rms_norm_bf16`: a bfloat16 RMS norm and its backward, one pass a row each way (the
  backward of ``F.rms_norm`` in bfloat16 is about ten element-wise passes);
* :func:`decode_attention_bf16`: a bfloat16 model's decode step on a CPU with AVX-512 BF16
  (compiled for it alone, chosen at run time), its keys read once for the heads that share
  them and a group's prompt once for its rows, with software prefetching: PyTorch's attention
  read the cache at about half of what one core streams.

Together they took the tiny rollout from 2.35x to ~3.3x ``transformers``' ``generate``
(``benchmarks/rollout.py``, ``benchmarks/RESULTS.md``).

The C file is compiled on first use with the system's C compiler (``$CC`` or ``cc``; ~0.5 s)
into ``$RLHFKIT_CACHE/kernels`` (default ``~/.cache/rlhfkit``), under a name that hashes the
source, the compiler and its flags (AVX2 when ATen itself uses it), and loaded with
:mod:`ctypes`: no Python headers, no build step at install. Without a compiler :func:`available`
is False and :mod:`rlhfkit.ops` keeps PyTorch's ops; results agree to rounding (~1e-7), as
``tests/test_accel.py`` checks.

Callers use them for float32 CPU tensors when the work is small enough (:func:`worth_it`;
a decode step at any size on one thread) or, for :func:`block_attention`, large enough
(:func:`block_usable`): in generation, in the reference and reward forwards, and in training
forwards, where the attention and the GELU run their compiled backward passes.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
_I64 = ctypes.c_int64
_lib = None  # the loaded library, False once loading failed
_lock = threading.Lock()

# Work (B x H x Tq x Tk x head_dim) above which PyTorch's attention, blocked and threaded, is as
# fast or faster, on one thread and on several; a decode step (one query a row) has no limit on
# one thread (benchmarks/ACCEL_EVIDENCE.md)
SMALL_ONE_THREAD, SMALL_THREADED = 1 << 24, 1 << 21
MAX_KEYS, MAX_HEAD_DIM = 16384, 512  # as csrc/cpu_kernels.c (one query's scores live on its stack)


def _flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno"]
    capability = torch.backends.cpu.get_cpu_capability()  # what ATen itself dispatches to here
    if platform.machine() in ("x86_64", "AMD64") and capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]  # 8 floats per instruction: one vector of the kernel
    return flags


def _cache_dir() -> Path:
    return Path(os.environ.get("RLHFKIT_CACHE") or Path.home() / ".cache" / "rlhfkit") / "kernels"


def _build() -> Path:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} not on PATH)")
    flags = _flags()
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([cc, *flags, platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: processes starting together (one per rank) never
    # load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired as err:
            raise OSError(f"{cc} did not finish in {err.timeout:.0f} s") from err
        if done.returncode:
            raise OSError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    """The loaded library with its functions typed, or False when it cannot be had."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    _lib = _typed(ctypes.CDLL(str(_build())))
                except OSError as err:  # no compiler, a failed build, an unwritable cache, an unloadable library
                    log.warning("rlhfkit: compiled CPU kernels unavailable, using PyTorch's ops (%s; "
                                "RLHFKIT_CACHE sets where they are built)", err)
                    _lib = False
    return _lib


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument and result types of the C functions (ctypes would otherwise pass ints as 32-bit)."""
    ptr, f32, i64, status = ctypes.c_void_p, ctypes.c_float, _I64, ctypes.c_int
    strides = [i64] * 15  # q, k, v, bias, out: (batch, head, position) each
    signatures = {
        "rlhfkit_attend": ([ptr] * 6 + [i64] * 6 + [f32] + strides, status),
        "rlhfkit_attend_backward": ([ptr] * 10 + [i64] * 6 + [f32] + strides, status),
        "rlhfkit_decode_attend": ([ptr] * 4 + [i64] * 5 + [f32], status),
        "rlhfkit_decode_attend_bf16": ([ptr] * 6 + [i64] * 6 + [f32] + [i64] * 12, status),
        "rlhfkit_block_softmax": ([ptr] * 3 + [i64] * 4 + [f32, ctypes.c_int], None),
        "rlhfkit_block_softmax_backward": ([ptr] * 3 + [i64] * 2 + [f32], None),
        "rlhfkit_gelu_tanh": ([ptr] * 3 + [i64], None),
        "rlhfkit_gelu_tanh_backward": ([ptr] * 4 + [i64], None),
        "rlhfkit_swiglu": ([ptr] * 3 + [i64], None),
        "rlhfkit_swiglu_backward": ([ptr] * 6 + [i64], None),
        "rlhfkit_sample": ([ptr, i64, i64, i64, f32, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ptr], i64),
        "rlhfkit_head_lse_bf16": ([ptr, i64, i64, i64, ptr, ptr, ptr], None),
        "rlhfkit_head_grad_bf16": ([ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64], None),
        "rlhfkit_rms_norm_bf16": ([ptr] * 4 + [i64, i64, f32], None),
        "rlhfkit_rms_norm_backward_bf16": ([ptr] * 6 + [i64, i64], None),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def _required() -> ctypes.CDLL:
    """The library, for callers that checked :func:`available` (or :func:`worth_it`) first."""
    lib = _load()
    if not lib:
        raise RuntimeError("the compiled kernels are not available (see kernels.available())")
    return lib


def available() -> bool:
    """True when the compiled kernels can be used (built or loaded now if need be)."""
    return bool(_load())


def usable(like: torch.Tensor, work: int, keys: int, head_dim: int, queries: int = 0) -> bool:
    """Whether attention over tensors like ``like`` with ``work = B x H x Tq x Tk x head_dim``
    and ``keys`` keys should run here: float32 on a CPU, small enough work (any work on one
    thread when each row has ``queries == 1``: a decode step), the kernel available."""
    one_thread = torch.get_num_threads() == 1
    limit = (work if queries == 1 else SMALL_ONE_THREAD) if one_thread else SMALL_THREADED
    return (like.device.type == "cpu" and like.dtype == torch.float32 and work <= limit and keys <= MAX_KEYS
            and head_dim <= MAX_HEAD_DIM and available())


def sampler_usable(B: int, V: int) -> bool:
    """Whether :class:`Sampler` should sample ``B`` rows of a ``V``-token vocabulary (on one
    thread always; on several, PyTorch's threaded ops win once the logits are large)."""
    return (torch.get_num_threads() == 1 or B * V <= SMALL_THREADED) and available()


def worth_it(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`attention` should replace PyTorch's for ``q [B, H, Tq, D]``, ``k, v [B, Hkv, Tk, D]``
    (:func:`usable`; with autograd the compiled backward runs too)."""
    B, H, Tq, D = q.shape
    return k.dtype == q.dtype == v.dtype and usable(q, B * H * Tq * k.shape[2] * D, k.shape[2], D, Tq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + bias) v`` with grouped heads, as
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None], scale=scale, enable_gqa=True)``.

    Args:
        q: ``[B, H, Tq, D]``; k, v: ``[B, Hkv, Tk, D]``, ``H`` a multiple of ``Hkv``. Any
            strides, except that ``D`` must be contiguous.
        bias: ``[B, Tq | 1, Tk]`` additive float32 mask (0 attend, -inf never); broadcast
            dimensions may have stride 0. Each query must be allowed at least one key. No
            gradient flows to it.
        out: optional ``[B, H, Tq, D]`` destination (any strides, ``D`` contiguous), e.g. a
            transposed view so that heads land side by side for the output projection; not
            with autograd.
    Returns ``out`` (by default a ``[B, H, Tq, D]`` view of ``[B, Tq, H, D]``). When grad is
    enabled and q, k or v requires it, the result is differentiable (a compiled backward).
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if out is not None:
            raise ValueError("attention: out= is not supported with autograd")
        return _Attention.apply(q, k, v, bias, scale)
    return _attend(q, k, v, bias, scale, out, None)


def _attend(q, k, v, bias, scale, out, lse):
    lib = _required()
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if out is None:
        out = q.new_empty((B, Tq, H, D)).transpose(1, 2)  # [B, H, Tq, D] view of heads side by side
    tensors = (q, k, v, bias, out)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
            or any(t.stride(-1) != 1 for t in (q, k, v, out)) or k.dim() != 4 or v.shape != k.shape
            or k.shape[0] != B or out.shape != q.shape
            or bias.dim() != 3 or bias.shape[0] != B or bias.shape[1] not in (1, Tq) or bias.shape[2] != Tk):
        raise ValueError(f"attention: unsupported inputs q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)} bias {tuple(bias.shape)} (float32 CPU, contiguous head_dim)")
    if lib.rlhfkit_attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr(), out.data_ptr(),
                          None if lse is None else lse.data_ptr(), B, H, Hkv, Tq, Tk, D, scale,
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_bias_strides(bias),
                          *out.stride()[:3]):
        raise ValueError(f"attention: head_dim {D} (<= {MAX_HEAD_DIM}), keys {Tk} (<= {MAX_KEYS}) or heads "
                         f"{H}/{Hkv} not supported by the kernel")
    return out


def _bias_strides(bias: torch.Tensor) -> tuple[int, int, int]:
    bs = bias.stride()
    return bs[0], bs[1] if bias.shape[1] > 1 else 0, bs[2]


class _Attention(torch.autograd.Function):
    """:func:`attention` with its backward: the forward saves each query's log-sum-exp, the
    backward recomputes the probabilities from it (as flash attention does) in one compiled
    pass. At a training minibatch's sizes (32 rows x 4 heads x 19 positions) PyTorch's CPU
    attention spends ~0.75 ms per layer on forward and backward, mostly set-up."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        B, H, Tq, _ = q.shape
        lse = q.new_empty((B, H, Tq))
        out = _attend(q, k, v, bias, scale, None, lse)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if gout.stride() != out.stride():  # the kernel reads the gradient with out's strides
            gout = torch.empty_like(out).copy_(gout)
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        dq = q.new_empty((B, H, Tq, D))
        dk, dv = k.new_zeros((B, Hkv, Tk, D)), v.new_zeros((B, Hkv, Tk, D))
        if _load().rlhfkit_attend_backward(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr(), out.data_ptr(), gout.data_ptr(),
                lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), B, H, Hkv, Tq, Tk, D, ctx.scale,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_bias_strides(bias), *out.stride()[:3]):
            raise ValueError("attention backward: sizes the forward accepted were refused")  # never expected
        return dq, dk, dv, None, None


def decode_attention(qkv: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, scale: float):
    """One decode step's attention over a pre-allocated cache, as a call ``step(t)`` bound to
    fixed buffers: copies the step's key and value from ``qkv`` into cache column ``t``, then
    attends with its query over columns ``0 .. t``, writing ``out``.

    Layouts (contiguous float32 CPU): ``qkv [B, 3, H, D]`` (query, key, value of this step),
    ``kv [B, 2, H, T_max, D]`` (keys, values), ``bias [B, T_max]`` (additive key mask),
    ``out [B, H, D]``. For a decode loop that writes ``qkv`` in place each step: checks, pointers
    and sizes are taken once, the copy and the attention are one call (each tensor op costs a
    few microseconds, about what the attention itself costs at a tiny model's sizes)."""
    lib = _required()
    B, three, H, D = qkv.shape
    T_max = kv.shape[3]
    tensors = (qkv, kv, bias, out)
    if (three != 3 or kv.shape != (B, 2, H, T_max, D) or bias.shape != (B, T_max) or out.shape != (B, H, D)
            or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)):
        raise ValueError(f"decode_attention: unsupported buffers qkv {tuple(qkv.shape)} kv {tuple(kv.shape)} "
                         f"bias {tuple(bias.shape)} out {tuple(out.shape)} (contiguous float32 CPU)")
    step_fn = lib.rlhfkit_decode_attend
    head = (qkv.data_ptr(), kv.data_ptr(), bias.data_ptr(), out.data_ptr(), B, H, D, T_max)

    def step(t: int) -> None:
        if step_fn(*head, t, scale):
            raise ValueError(f"decode_attention: column {t} outside the cache ({T_max}, at most {MAX_KEYS}) "
                             f"or head_dim {D} above {MAX_HEAD_DIM}")

    step.buffers = tensors  # the memory behind the pointers lives as long as the call
    return step


def decode_bf16_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether :func:`decode_attention_bf16` should compute a decode step: ``q [B, H, 1, D]``,
    ``k, v [B, Hkv, Tk, D]`` and an additive ``bias [B, 1, 1, Tk]``, all bfloat16 on a CPU with
    AVX-512 BF16, ``D`` contiguous, a multiple of 32 and at most 256, at most 8 heads a key head,
    one thread, the compiled kernels available."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == bias.dtype == torch.bfloat16 and Tq == 1
            and v.shape == k.shape and k.shape[0] == B and bias.shape == (B, 1, 1, Tk) and D % 32 == 0 and D <= 256
            and Tk > 0 and 0 < Hkv and H % Hkv == 0 and H // Hkv <= 8
            and all(t.stride(-1) == 1 for t in (q, k, v, bias)) and torch.get_num_threads() == 1
            and _avx512_bf16() and available())


_AVX512_BF16: bool | None = None


def _avx512_bf16() -> bool:
    """Whether this CPU has AVX-512 BF16 (and BW): read from its flags once (a read of
    ``/proc/cpuinfo`` costs about 30 us, and every layer of a decode step asks)."""
    global _AVX512_BF16
    if _AVX512_BF16 is None:
        from . import gemm

        _AVX512_BF16 = {"avx512_bf16", "avx512bw"} <= gemm.cpu_flags()
    return _AVX512_BF16


def decode_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                          shared: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """A bfloat16 decode step's attention, ``F.scaled_dot_product_attention(q, k, v,
    attn_mask=bias, scale=scale, enable_gqa=True)`` for the inputs :func:`decode_bf16_usable`
    accepts: scores and softmax in float32, the probabilities rounded to bfloat16 for their
    product with the values (as PyTorch's bfloat16 attention does), the output rounded once.
    Returns ``[B, H, 1, D]``, a view of ``[B, 1, H, D]``; no autograd.

    ``shared = (rows [B] int64, P)``: row ``b``'s first ``P`` keys and values are the same as row
    ``rows[b]``'s (rows that share a prompt, as :func:`rlhfkit.accel.forward.prefill` copies them) and are
    read there: one copy a group leaves memory.

    PyTorch's attention read the cache at about half of what one core streams
    (benchmarks/ACCEL_EVIDENCE.md)."""
    lib = _required()
    B, H, _, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    src, P = (None, 0) if shared is None else shared
    if src is not None and (src.dtype != torch.int64 or src.shape != (B,) or not src.is_contiguous()
                            or src.device.type != "cpu"):
        raise ValueError(f"decode_attention_bf16: shared rows must be a contiguous int64 CPU tensor [{B}]")
    out = q.new_empty((B, 1, H, D)).transpose(1, 2)
    status = lib.rlhfkit_decode_attend_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr(),
                                            out.data_ptr(), None if src is None else src.data_ptr(), P,
                                            B, H, Hkv, Tk, D, scale, q.stride(0), q.stride(1),
                                            *k.stride()[:3], *v.stride()[:3], bias.stride(0), bias.stride(3),
                                            out.stride(0), out.stride(1))
    if status:
        why = {2: "this CPU has no AVX-512 BF16", 3: f"shared rows outside 0..{B - 1}"}.get(status, "shapes")
        raise ValueError(f"decode_attention_bf16: unsupported inputs q {tuple(q.shape)} k {tuple(k.shape)} ({why})")
    return out


# ------------------------------------------------------------------ causal attention by blocks

QUERY_BLOCK = 128  # queries of a head a block: their scores for 576 keys, 3 heads at once, ~0.9 MB
# Scores a key head (heads reading it x queries x keys) from which the blocks beat PyTorch's
# attention on one thread (below it the Python around each block costs more than it saves); the
# blocks run only where oneDNN's products do, slower elsewhere (benchmarks/ACCEL_EVIDENCE.md)
MIN_BLOCK_SCORES = 1 << 15


def block_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether :func:`block_attention` should compute ``q [B, H, Tq, D]`` over ``k, v [B, Hkv, Tk, D]``
    under the boolean ``mask``: float32 on a CPU, one thread, at least ``MIN_BLOCK_SCORES``
    scores a key head (``H / Hkv x Tq x Tk``: never the batch size, so a micro-batch computes
    its rows as the whole batch would), oneDNN's products in use (:func:`rlhfkit.accel.gemm.enabled`)
    and the compiled kernels available."""
    from . import gemm

    H, Tq = q.shape[1], q.shape[2]
    Hkv, Tk = k.shape[1], k.shape[2]
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and mask.dtype == torch.bool
            and torch.get_num_threads() == 1 and 0 < Hkv and H % Hkv == 0 and Tq <= Tk
            and H // Hkv * Tq * Tk >= MIN_BLOCK_SCORES and gemm.enabled() and available())


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal masked attention, ``softmax(scale * q k^T, masked) v`` with grouped heads, as
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)``.

    ``q [B, H, Tq, D]``; ``k, v [B, Hkv, Tk, D]``; ``mask [B, Tq, Tk]`` boolean (True: may
    attend), which must be causal with the queries at the last ``Tq`` of the ``Tk`` positions:
    query ``i`` sees no key after ``Tk - Tq + i``, and at least one key. Returns a ``[B, H, Tq, D]``
    view of ``[B, Tq, H, D]``; differentiable in q, k and v.

    For each row and key head, a block of ``QUERY_BLOCK`` queries of every head that reads it is
    one oneDNN product with the keys the block can see (the causal bound: later keys are never
    multiplied), a compiled masked softmax, and one product with the values. The backward
    computes the probabilities again from each query's log-sum-exp (flash attention's
    recompute), so only that is kept. PyTorch's CPU flash attention computes every key of
    every query block, causal or not (benchmarks/ACCEL_EVIDENCE.md)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockAttention.apply(q, k, v, mask, scale)
    return _block_forward(q, k, v, mask, scale)[0]


def _blocks(Tq: int, Tk: int):
    """``(r0, r1, n)``: each block of queries and the number of keys its last query may see."""
    for r0 in range(0, Tq, QUERY_BLOCK):
        r1 = min(Tq, r0 + QUERY_BLOCK)
        yield r0, r1, Tk - Tq + r1


def _block_inputs(q, k, v, mask):
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if (k.shape != (B, Hkv, Tk, D) or v.shape != k.shape or mask.shape != (B, Tq, Tk) or Tq > Tk
            or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (q, k, v))):
        raise ValueError(f"block_attention: unsupported inputs q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)} mask {tuple(mask.shape)}")
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    return k.contiguous(), v.contiguous(), mask


def _block_forward(q, k, v, mask, scale):
    from . import gemm

    lib = _required()
    k, v, mask = _block_inputs(q, k, v, mask)
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    g = H // Hkv
    out = q.new_empty((B, Tq, H, D)).transpose(1, 2)
    lse = q.new_empty((B, H, Tq))
    row = q.new_empty(g * QUERY_BLOCK)
    ms = mask.stride(1)
    for b in range(B):
        for hk in range(Hkv):
            heads = slice(hk * g, (hk + 1) * g)
            K, V = k[b, hk], v[b, hk]
            for r0, r1, n in _blocks(Tq, Tk):
                m = r1 - r0
                s = gemm._onednn(q[b, heads, r0:r1].reshape(g * m, D), K[:n], None)  # [g*m, n] scores
                mrow = mask[b, r0]  # held until the call returns
                lib.rlhfkit_block_softmax(s.data_ptr(), mrow.data_ptr(), row.data_ptr(), g, m, n, ms, scale, 0)
                out[b, heads, r0:r1] = gemm._onednn(s, V[:n].t(), None).view(g, m, D)
                lse[b, heads, r0:r1] = row[: g * m].view(g, m)
    return out, lse


class _BlockAttention(torch.autograd.Function):
    """:func:`block_attention` with its backward, block by block as the forward: the
    probabilities again from the saved log-sum-exp, ``dV += P^T dO``, ``dP = dO V^T``,
    ``dS = scale P (dP - rowsum(dO * O))``, ``dQ = dS K``, ``dK += dS^T Q``, every product on oneDNN."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        out, lse = _block_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gout):
        from . import gemm

        q, k, v, mask, out, lse = ctx.saved_tensors
        lib = _required()
        k, v, mask = _block_inputs(q, k, v, mask)
        B, H, Tq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        g, scale, ms = H // Hkv, ctx.scale, mask.stride(1)
        delta = (gout * out).sum(-1)  # [B, H, Tq]: dO . O of each query
        dq = q.new_empty((B, H, Tq, D))
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for b in range(B):
            for hk in range(Hkv):
                heads = slice(hk * g, (hk + 1) * g)
                K, V = k[b, hk], v[b, hk]
                for r0, r1, n in _blocks(Tq, Tk):
                    m = r1 - r0
                    qb = q[b, heads, r0:r1].reshape(g * m, D)
                    go = gout[b, heads, r0:r1].reshape(g * m, D)
                    # (the tensors behind every pointer are held by a name until the call returns)
                    row_lse, row_delta = lse[b, heads, r0:r1].contiguous(), delta[b, heads, r0:r1].contiguous()
                    p = gemm._onednn(qb, K[:n], None)  # [g*m, n]: the scores, then the probabilities
                    mrow = mask[b, r0]
                    lib.rlhfkit_block_softmax(p.data_ptr(), mrow.data_ptr(), row_lse.data_ptr(), g, m, n, ms, scale, 1)
                    dv[b, hk, :n] += gemm._onednn(p.t(), go.t(), None)
                    ds = gemm._onednn(go, V[:n], None)  # [g*m, n]: dP, then dS
                    lib.rlhfkit_block_softmax_backward(ds.data_ptr(), p.data_ptr(), row_delta.data_ptr(), g * m, n,
                                                       scale)
                    dq[b, heads, r0:r1] = gemm._onednn(ds, K[:n].t(), None).view(g, m, D)
                    dk[b, hk, :n] += gemm._onednn(ds.t(), qb.t(), None)
        return dq, dk, dv, None, None


def _check_same(name: str, *tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.shape != tensors[0].shape
           for t in tensors):
        raise ValueError(f"{name}: contiguous float32 CPU tensors of one shape")


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x, approximate="tanh")`` in one pass, as ``x * sigmoid(c1 x + c3 x^3)``; ``out``
    may be ``x`` (in place). With ``gate``, also writes ``sigmoid(c1 x + c3 x^3)`` there (for
    :func:`gelu_tanh_backward`). Contiguous float32 CPU tensors of one shape; no autograd."""
    lib = _required()
    out = torch.empty_like(x) if out is None else out
    _check_same("gelu_tanh", x, out, *(() if gate is None else (gate,)))
    lib.rlhfkit_gelu_tanh(x.data_ptr(), out.data_ptr(), None if gate is None else gate.data_ptr(), x.numel())
    return out


def gelu_tanh_backward(x: torch.Tensor, gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`gelu_tanh` at ``x`` times ``grad``, from the ``gate`` its forward
    saved: ``grad * (s + s (1 - s) x (c1 + 3 c3 x^2))``, one pass instead of six ops."""
    lib = _required()
    grad = grad.contiguous()
    out = torch.empty_like(x)
    _check_same("gelu_tanh_backward", x, gate, grad, out)
    lib.rlhfkit_gelu_tanh_backward(x.data_ptr(), gate.data_ptr(), grad.data_ptr(), out.data_ptr(), x.numel())
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (a Llama MLP's gate). Contiguous float32 CPU tensors of
    one shape; no autograd."""
    lib = _required()
    _check_same("swiglu", gate, up)
    act = torch.empty_like(gate)
    lib.rlhfkit_swiglu(gate.data_ptr(), up.data_ptr(), act.data_ptr(), gate.numel())
    return act


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor,
                    want_act: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The gradients wrt ``gate`` and ``up`` of :func:`swiglu` times ``grad``, and with
    ``want_act`` the activation again, in one pass: ``(act or None, d_gate, d_up)``."""
    lib = _required()
    grad = grad.contiguous()
    _check_same("swiglu_backward", gate, up, grad)
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    act = torch.empty_like(gate) if want_act else None
    lib.rlhfkit_swiglu_backward(gate.data_ptr(), up.data_ptr(), grad.data_ptr(), None if act is None else act.data_ptr(),
                                dg.data_ptr(), du.data_ptr(), gate.numel())
    return act, dg, du


class Sampler:
    """The sampling step of :func:`rlhfkit.rollout.generate.generate` in one call per step, for float32
    CPU logits ``[B, V]``: tempered softmax, inverse-CDF draw with the row's uniform, the
    token's log-prob and the distribution's entropy, the EOS bookkeeping. Replaces ~12 tensor
    ops (log_softmax, exp, cumsum, searchsorted, the alive mask and its check) of a few
    microseconds each with one pass over the logits.

    ``tokens, logprobs, entropy [B, R]`` and ``alive [B]`` (bool) are filled as steps go;
    ``step(t, logits, u)`` samples column ``t`` with ``u [B]`` uniforms and returns how many
    rows have not emitted ``eos`` yet."""

    def __init__(self, B: int, R: int, V: int, temperature: float, eos: int):
        lib = _required()
        self.tokens = torch.empty((B, R), dtype=torch.long)
        self.logprobs = torch.empty((B, R))
        self.entropy = torch.empty((B, R))
        self.alive = torch.ones(B, dtype=torch.bool)
        self._work = torch.empty(2 * V)
        self._fn, self._B, self._V, self._R = lib.rlhfkit_sample, B, V, R
        self._temperature, self._eos = float(temperature), int(eos)
        esize = self.tokens.element_size()  # the column t of each output is at offset t
        self._ptrs = (self.tokens.data_ptr(), self.logprobs.data_ptr(), self.entropy.data_ptr(), esize)

    def step(self, t: int, logits: torch.Tensor, u: torch.Tensor) -> int:
        B, V = self._B, self._V
        if (logits.shape != (B, V) or logits.dtype != torch.float32 or logits.device.type != "cpu"
                or logits.stride(1) != 1 or u.shape != (B,) or u.dtype != torch.float32 or u.device.type != "cpu"
                or not 0 <= t < self._R):
            raise ValueError(f"Sampler.step: logits {tuple(logits.shape)} {logits.dtype}, u {tuple(u.shape)} "
                             f"{u.dtype}, step {t} (expected float32 CPU [{B}, {V}], [{B}], step < {self._R})")
        tok, lp, ent, esize = self._ptrs
        return self._fn(logits.data_ptr(), B, V, logits.stride(0), self._temperature, u.data_ptr(), u.stride(0),
                        self._eos, tok + t * esize, self._R, lp + t * 4, ent + t * 4, self._R,
                        self.alive.data_ptr(), self._work.data_ptr())


# ------------------------------------------------------------------ bfloat16 log-prob head

def head_usable(z: torch.Tensor) -> bool:
    """Whether :func:`head_lse_bf16` / :func:`head_grad_bf16` take the logits ``z``: bfloat16
    ``[n, V]`` on a CPU with contiguous rows, and the compiled kernels available. PyTorch's route converts
    each chunk to float32 first and runs five passes over it (benchmarks/ACCEL_EVIDENCE.md)."""
    return z.dtype == torch.bfloat16 and z.device.type == "cpu" and z.dim() == 2 and z.stride(1) == 1 and available()


def head_lse_bf16(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp [n], z[r, targets[r]] [n])`` in float32 of bfloat16 logits ``z [n, V]``."""
    n, V = z.shape
    t = targets.contiguous().long()
    if t.shape != (n,) or (n and not (0 <= int(t.min()) and int(t.max()) < V)):
        raise ValueError(f"head_lse_bf16: targets {tuple(t.shape)} for logits {tuple(z.shape)}, each in [0, {V})")
    lse, picked = z.new_empty(n, dtype=torch.float32), z.new_empty(n, dtype=torch.float32)
    _required().rlhfkit_head_lse_bf16(z.data_ptr(), n, V, z.stride(0), t.data_ptr(), lse.data_ptr(), picked.data_ptr())
    return lse, picked


def head_grad_bf16(z: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``coef[r] (onehot(targets[r]) - softmax(z[r]))`` as bfloat16 ``[n, V]``: the gradient wrt
    the logits ``z`` of ``sum_r coef[r] logp_r``, given each row's logsumexp ``lse [n]`` (from
    :func:`head_lse_bf16`), computed in float32 and rounded once."""
    n, V = z.shape
    t, lse, coef = targets.contiguous().long(), lse.contiguous().float(), coef.contiguous().float()
    if t.shape != (n,) or lse.shape != (n,) or coef.shape != (n,) or (n and not (0 <= int(t.min()) and int(t.max()) < V)):
        raise ValueError(f"head_grad_bf16: lse {tuple(lse.shape)}, coef {tuple(coef.shape)}, targets {tuple(t.shape)} "
                         f"for logits {tuple(z.shape)}")
    g = z.new_empty((n, V))
    _required().rlhfkit_head_grad_bf16(z.data_ptr(), n, V, z.stride(0), lse.data_ptr(), coef.data_ptr(), t.data_ptr(),
                                       g.data_ptr(), V)
    return g


# ------------------------------------------------------------------ bfloat16 RMS norm


def rms_norm_bf16_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm_bf16` computes ``F.rms_norm(x, x.shape[-1:], weight, eps)``:
    bfloat16 CPU tensors, a 1-D weight as wide as ``x``'s rows, the compiled kernels available."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] and x.numel() > 0 and available())


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, x.shape[-1:], weight, eps)`` for bfloat16 CPU tensors
    (:func:`rms_norm_bf16_usable`): each row's statistics and product in float32, rounded once,
    one pass a row; differentiable in ``x`` and ``weight`` (one pass a row again, saving only
    each row's ``rstd`` beside ``x``). PyTorch's bfloat16
    backward is about ten element-wise passes (benchmarks/ACCEL_EVIDENCE.md)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormBF16.apply(x, weight, eps)
    return _rms_norm_forward(x, weight, eps)[0]


def _rms_norm_forward(x, weight, eps):
    lib = _required()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    w = weight.contiguous()
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32)
    lib.rlhfkit_rms_norm_bf16(x2.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), *x2.shape, eps)
    return y.view(x.shape), x2, rstd


class _RMSNormBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        lib = _required()
        g = grad.reshape(x2.shape).contiguous()
        w = weight.contiguous()
        dx = torch.empty_like(x2)
        dw = torch.zeros(x2.shape[1], dtype=torch.float32) if ctx.needs_input_grad[1] else None
        lib.rlhfkit_rms_norm_backward_bf16(x2.data_ptr(), w.data_ptr(), g.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                                           None if dw is None else dw.data_ptr(), *x2.shape)
        return dx.view(grad.shape), None if dw is None else dw.to(weight.dtype), None
