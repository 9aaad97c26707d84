"""Float32 linear layers on a CPU through oneDNN instead of MKL, and bfloat16 weights packed for decode steps.

PyTorch computes a float32 ``F.linear`` / ``mm`` / ``addmm`` on a CPU with MKL's sgemm; it also
ships oneDNN, whose inner product ``torch.compile``'s CPU backend calls. On AMD CPUs with
AVX-512 oneDNN's products ran up to about 2x MKL's rate; on Intel's CPUs and on CPUs without
AVX-512 MKL was as fast or faster (``benchmarks/ACCEL_EVIDENCE.md``), so :func:`enabled` says
yes only on the former, unless ``accel.enabled=on`` forces it (:func:`configure`).

Both libraries accumulate in float32; results differ by rounding. Which library computes a
product depends on the weight only (at least :data:`MIN_WEIGHT` elements: oneDNN's set-up costs
more than a small weight's product), never on the number of rows, so a batch split into
micro-batches or over processes computes each row as the whole batch does.

:func:`linear`, :func:`add_linear`, :func:`mm`, :func:`mm_out`, :func:`addmm_` and
:func:`grad_weight` are registered as :mod:`rlhfkit.ops`' names of the same names; where
autograd records a graph through them, :class:`_AddLinear` gives the product its backward.
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

# weights (N x K) below which products stay on MKL: oneDNN's set-up (about 10 us a call) costs more
# than a small weight's product over a few rows; the limit sits between the tiny models' largest
# weights and a real model's smallest projections (benchmarks/ACCEL_EVIDENCE.md)
MIN_WEIGHT = 100_000
_available: bool | None = None
_enabled: bool | None = None
_force = False


def _cpuinfo(field: str) -> str | None:
    """The value of the first line of Linux's ``/proc/cpuinfo`` that starts with ``field``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``) from Linux's ``/proc/cpuinfo``,
    else from :func:`platform.processor` (Windows names the vendor there), or ``""``."""
    vendor = _cpuinfo("vendor_id")
    if vendor is not None:
        return vendor
    name = platform.processor()
    return next((v for v in ("GenuineIntel", "AuthenticAMD") if v in name), "")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ...) from Linux's ``/proc/cpuinfo``, or an
    empty set where that file does not list them."""
    return frozenset((_cpuinfo("flags") or "").split())


def configure(force: bool = False) -> None:
    """``force``: oneDNN's products wherever they run, not only where they were measured faster
    (``accel.enabled=on``); every check is made again at the next product."""
    global _available, _enabled, _packing, _force
    _available = _enabled = _packing = None
    _force = force


def available() -> bool:
    """Whether oneDNN's linear runs here (PyTorch built with it); checked once with a small
    product against ``F.linear``."""
    global _available
    if _available is None:
        _available = False
        if torch.backends.mkldnn.is_available():
            try:
                x, w = torch.randn(3, 5), torch.randn(4, 5)
                _available = bool(torch.allclose(_onednn(x, w, None), F.linear(x, w), atol=1e-5))
            except (RuntimeError, AttributeError):  # an op this build lacks
                pass
    return _available


def enabled() -> bool:
    """Whether products take oneDNN's path here: :func:`available`, and, unless forced
    (:func:`configure`), an x86 CPU that is not Intel's and has AVX-512 (``avx512f``).

    MKL runs AVX2 code on AMD's CPUs, oneDNN AVX-512 wherever the CPU has it; on Intel's CPUs MKL
    runs its own kernels and was as fast or faster (benchmarks/ACCEL_EVIDENCE.md). Elsewhere (no
    flags to read, another architecture) PyTorch's default stays: not measured."""
    global _enabled
    if _enabled is None:
        _enabled = available() and (_force or (cpu_vendor() != "GenuineIntel" and "avx512f" in cpu_flags()))
    return _enabled


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _fits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Float32 on a CPU, a 2-D weight of at least ``MIN_WEIGHT`` elements, some rows, oneDNN
    :func:`enabled` here."""
    if not (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.dim() == 2 and x.numel()):
        return False
    if b is not None and b.dtype != torch.float32:
        return False
    return w.numel() >= MIN_WEIGHT and enabled()


def _tracked(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: ``x [..., K]``, ``w [N, K]`` (a transposed view is fine) -> ``[..., N]``."""
    if not _fits(x, w, b):
        return F.linear(x, w, b)
    if _tracked(x, w, b):
        return _AddLinear.apply(None, x, w, b)
    return _onednn(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])


def add_linear(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``res + F.linear(x, w, b)``, shaped as ``res`` (the product's shape, or its rows flattened).
    PyTorch's path without a bias is one ``addmm``, the residual as its accumulator."""
    if _fits(x, w, b) and res.dtype == torch.float32:
        if _tracked(res, x, w, b):
            return _AddLinear.apply(res, x, w, b)
        return _onednn(x.reshape(-1, x.shape[-1]), w, b).add_(res.reshape(-1, w.shape[0])).view(res.shape)
    if b is not None:
        return res + F.linear(x, w, b).view(res.shape)
    return torch.addmm(res.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t()).view(res.shape)


def mm(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``a @ m`` for ``a [M, K]``, ``m [K, N]``: :func:`linear` with ``m.t()`` as the weight."""
    return linear(a, m.t())


def mm_out(a: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ m`` (``out [M, N]`` written, e.g. a block of rows of a bigger tensor)."""
    if _fits(a, m.t(), None):
        return out.copy_(_onednn(a, m.t(), None))
    return torch.mm(a, m, out=out)


def grad_weight(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a.T @ b``, a weight's gradient (``g.T @ x`` for ``x @ w.T``; ``x.T @ g`` for GPT-2's
    ``x @ w``), on oneDNN's path when ``weight``'s forward product takes it: the rows ``a`` and
    ``b`` share are summed over, and which library sums them depends on the weight, not on
    how many rows there are."""
    if _fits(b, weight, None) and a.dtype == torch.float32:
        return _onednn(a.t(), b.t(), None)
    return a.t() @ b


def addmm_(out: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``out += a @ m`` in place (``out [M, N]``, no graph recorded)."""
    if _fits(a, m.t(), None):
        return out.add_(_onednn(a, m.t(), None))
    return out.addmm_(a, m)


class _AddLinear(torch.autograd.Function):
    """``res + x @ w.T + b`` (``res`` may be None) under autograd, its three products through
    oneDNN: the forward, the input gradient ``g @ w`` and the weight gradient ``g.T @ x``. Saves
    what autograd's ``addmm`` saves (``x`` and ``w``)."""

    @staticmethod
    def forward(ctx, res, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.res_shape = None if res is None else res.shape
        y = _onednn(x.reshape(-1, x.shape[-1]), w, b)
        if res is not None:
            return y.add_(res.reshape(y.shape)).view(res.shape)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_res, need_x, need_w, need_b = ctx.needs_input_grad
        g = grad.reshape(-1, w.shape[0])  # [M, N]
        grad_x = mm(g, w).view(x.shape) if need_x else None
        grad_w = grad_weight(g, x.reshape(-1, x.shape[-1]), w) if need_w else None
        grad_b = g.sum(0) if need_b else None
        grad_res = grad.reshape(ctx.res_shape) if need_res else None
        return grad_res, grad_x, grad_w, grad_b


# --------------------------------------------------------------------------- packed bfloat16 weights
#
# A bfloat16 ``F.linear`` on a CPU with AVX-512 BF16 converts the weight into oneDNN's blocked
# layout at every call, a third of a decode step's product; a weight packed once for a generation
# call (:class:`Packed`) computes the same numbers bit for bit without it (:func:`packing` checks
# that here before it is used; benchmarks/ACCEL_EVIDENCE.md).
_packing: bool | None = None


def packing() -> bool:
    """Whether bfloat16 weights can be packed here: oneDNN with bfloat16 support (PyTorch's own
    bf16 products then run on it), and a packed product, with a
    bias and with a residual, equal bit for bit to ``F.linear`` / ``addmm`` (checked once)."""
    global _packing
    if _packing is None:
        _packing = False
        if torch.backends.mkldnn.is_available():
            try:
                if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                    g = torch.Generator().manual_seed(0)
                    x, w, res = (torch.randn(shape, generator=g).bfloat16() for shape in ((24, 96), (80, 96), (24, 80)))
                    b = torch.randn(80, generator=g).bfloat16()
                    p = Packed(w)
                    _packing = bool(torch.equal(p._product(x, b), F.linear(x, w, b))
                                    and torch.equal(p._product(x, None, res), torch.addmm(res, x, w.t())))
            except (RuntimeError, AttributeError):  # an op this build lacks
                pass
    return _packing


class Packed:
    """A bfloat16 weight ``[N, K]`` with a copy packed for oneDNN's matmul, made at the first
    product over at most ``rows`` rows (a decode step's) without a graph recorded; other calls
    (a prefill's many rows, a training forward) take ``F.linear`` on the weight itself. The
    packed copy lives as long as this object: one generation call. ``keep=False``: packed at
    once and the weight not kept (a copy made for the call, such as LoRA's stacked ``[W; A]``,
    is then freed), for callers that only ask for products this packs."""

    __slots__ = ("weight", "rows", "packed", "out_features", "dtype")

    def __init__(self, weight: torch.Tensor, rows: int | None = None, keep: bool = True):
        self.rows, self.out_features, self.dtype = rows, weight.shape[0], weight.dtype
        self.weight, self.packed = weight, None
        if not keep:
            self.packed = _pack(weight, rows or 64)  # the row count: a hint
            self.weight = None

    def _packs(self, x2: torch.Tensor) -> bool:
        ok = (self.rows is None or x2.shape[0] <= self.rows) and not torch.is_grad_enabled() and x2.dtype == self.dtype
        if not ok and self.weight is None:
            raise RuntimeError("a weight packed without keeping it computes no-grad products of its own dtype "
                               f"over at most {self.rows} rows")
        return ok

    def _product(self, x2: torch.Tensor, b: torch.Tensor | None, res: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            self.packed = _pack(self.weight, x2.shape[0])
        if res is None:
            return torch.ops.mkldnn._linear_pointwise(x2, self.packed, b, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x2, res, self.packed, b, "add")  # as addmm(res, x2, w.T)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, b)``."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self._packs(x2):
            return F.linear(x, self.weight, b)
        return self._product(x2, b).view(*x.shape[:-1], self.out_features)

    def add(self, res: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`add_linear` with this weight: ``res + F.linear(x, weight, b)``, shaped as ``res``."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self._packs(x2):
            return add_linear(res, x, self.weight, b)
        if b is not None:  # add_linear's order: the biased product rounded, then the sum
            return res + self._product(x2, b).view(res.shape)
        return self._product(x2, None, res.reshape(x2.shape[0], -1)).view(res.shape)


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout for products over about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packable(w: torch.Tensor) -> bool:
    """A 2-D bfloat16 CPU weight, and :func:`packing` works here."""
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and packing()
