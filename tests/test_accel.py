"""Every accelerated implementation of a name in rlhfkit.ops (and of its accelerated forward's
operations, rlhfkit.accel.primitives) against its reference.

``accel.enabled=on`` registers whatever rlhfkit.accel has that runs on this machine; each
name it took is checked here against the plain PyTorch reference (values, gradients where it
has a backward, each dtype it claims), calling the implementation directly with inputs of the
kind it takes. A name that nothing accelerates here is skipped, with the reason. The rest of
the suite runs on the references (conftest.py); ``pytest --accel on`` runs it accelerated.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhfkit import ops
from rlhfkit.accel import primitives
from rlhfkit.cli.main import main
from rlhfkit.config import Config, ConfigError, load_config
from rlhfkit.rollout.generate import _entropy, sample_tokens
from rlhfkit.utils import read_jsonl

F32, BF16 = torch.float32, torch.bfloat16


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=F32, seed=0, grad=False) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype).requires_grad_(grad)


@contextlib.contextmanager
def _one_thread():
    """Some paths are taken on one thread only (where they were measured to pay)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _close(ours, ref, atol=1e-5, rtol=1e-5):
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), ref if isinstance(ref, tuple) else (ref,)):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a.detach(), b.detach(), atol=atol, rtol=rtol)


def _grads(fn, leaves):
    """``fn``'s output and the gradients of a fixed random projection of it wrt ``leaves``."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    (out.float() * _randn(*out.shape, seed=9)).sum().backward()
    return (out, *(t.grad for t in leaves))


def _no_worse(ours, ref, exact, slack=1.5):
    """Half-precision results each at least about as close to the float64 ones as PyTorch's own."""
    for a, b, e in zip(ours, ref, exact):
        err_ours, err_ref = ((t.detach().double() - e.detach()).abs().mean() for t in (a, b))
        assert err_ours <= slack * err_ref + 1e-6, (float(err_ours), float(err_ref))


# --------------------------------------------------------------------------- the products (float32)

def _big_weight(n=400, k=320):
    """A weight above accel's size limit for the oneDNN products (smaller ones stay on PyTorch's)."""
    from rlhfkit.accel import gemm

    w = _randn(n, k, seed=1)
    assert w.numel() >= gemm.MIN_WEIGHT
    return w


def check_linear(impl, ref, dtype):
    x, w, b = _randn(9, 320), _big_weight(), _randn(400, seed=2)
    _close(_grads(impl, [x, w, b]), _grads(ref, [x, w, b]), atol=1e-4)


def check_add_linear(impl, ref, dtype):
    res, x, w, b = _randn(9, 400, seed=3), _randn(9, 320), _big_weight(), _randn(400, seed=2)
    _close(_grads(impl, [res, x, w, b]), _grads(ref, [res, x, w, b]), atol=1e-4)
    _close(_grads(lambda r, x, w: impl(r, x, w), [res, x, w]), _grads(lambda r, x, w: ref(r, x, w), [res, x, w]),
           atol=1e-4)


def check_mm(impl, ref, dtype):
    a, m = _randn(9, 320), _big_weight().t()
    _close(impl(a, m), ref(a, m), atol=1e-4)


def check_mm_out(impl, ref, dtype):
    a, m = _randn(9, 320), _big_weight().t()
    out, want = torch.zeros(12, 400), torch.zeros(12, 400)
    impl(a, m, out[2:11])
    ref(a, m, want[2:11])
    _close(out, want, atol=1e-4)


def check_grad_weight(impl, ref, dtype):
    g, x, w = _randn(9, 400), _randn(9, 320, seed=4), _big_weight()
    _close(impl(g, x, w), ref(g, x, w), atol=1e-4)


def check_addmm_(impl, ref, dtype):
    a, m, out = _randn(9, 320), _big_weight().t(), _randn(9, 400, seed=5)
    _close(impl(out.clone(), a, m), ref(out.clone(), a, m), atol=1e-4)


# --------------------------------------------------------------------------- activations and the norm

def check_gelu_tanh(impl, ref, dtype):
    x = _randn(37, 64) * 3
    _close(impl(x), ref(x.clone()), atol=1e-6)


def check_gelu_tanh_gate(impl, ref, dtype):
    x = _randn(37, 64) * 3
    _close(impl(x), ref(x), atol=1e-6)


def check_gelu_tanh_backward(impl, ref, dtype):
    x, grad = _randn(37, 64) * 3, _randn(37, 64, seed=1)
    _, s = primitives.reference("gelu_tanh_gate")(x)
    _close(impl(x, s, grad), ref(x, s, grad.clone()), atol=1e-6)


def check_swiglu(impl, ref, dtype):
    gate, up = _randn(37, 96) * 3, _randn(37, 96, seed=1)
    _close(impl(gate, up), ref(gate, up), atol=1e-6)


def check_swiglu_backward(impl, ref, dtype):
    gate, up, grad = _randn(37, 96) * 3, _randn(37, 96, seed=1), _randn(37, 96, seed=2)
    for want_act in (True, False):
        _close(impl(gate, up, grad.clone(), want_act), ref(gate, up, grad.clone(), want_act), atol=1e-6)


def check_rms_norm(impl, ref, dtype):
    x, w = _randn(37, 576, dtype=dtype) * 2, (1 + _randn(576, seed=1) / 4).to(dtype)
    exact = _grads(lambda x, w: ref(x, w, 1e-6), [x.double(), w.double()])
    _no_worse(_grads(lambda x, w: impl(x, w, 1e-6), [x, w]), _grads(lambda x, w: ref(x, w, 1e-6), [x, w]), exact)


# --------------------------------------------------------------------------- attention

def _padded_causal(B, Tq, Tk):
    """``[B, Tq, Tk]`` boolean: causal with the queries last, row b left-padded by b keys (a
    query still sees its own position: every query one key at least)."""
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).expand(B, Tq, Tk).clone()
    for b in range(B):
        allowed[b, :, :b] = False
    return allowed | torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq).triu(Tk - Tq)


def _additive(allowed, dtype):
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def check_attention(impl, ref, dtype):
    if dtype == F32:  # a short context, forward and backward
        q, k, v = _randn(3, 4, 5, 16), _randn(3, 2, 7, 16, seed=1), _randn(3, 2, 7, 16, seed=2)
        bias = _additive(_padded_causal(3, 5, 7), F32)[:, None]
        assert ref(q, k, v, bias, 0.25) is None
        _close(_grads(lambda q, k, v: impl(q, k, v, bias, 0.25), [q, k, v]),
               _grads(lambda q, k, v: _sdpa(q, k, v, bias, 0.25), [q, k, v]), atol=2e-6)
        return
    q, k, v = _randn(4, 6, 1, 64, dtype=dtype), _randn(4, 2, 40, 64, dtype=dtype, seed=1), _randn(
        4, 2, 40, 64, dtype=dtype, seed=2)  # a bfloat16 decode step
    bias = _additive(_padded_causal(4, 1, 40), dtype)[:, None]
    with _one_thread():
        out = impl(q, k, v, bias, 0.125)
    if out is None:
        pytest.skip("the bfloat16 decode attention needs AVX-512 BF16, which this CPU lacks")
    exact = _sdpa(q.double(), k.double(), v.double(), bias.double(), 0.125)
    _no_worse((out,), (_sdpa(q, k, v, bias, 0.125),), exact)


def check_causal_attention(impl, ref, dtype):
    """Two blocks of queries, grouped heads, left padding, forward and backward."""
    q, k, v = _randn(2, 3, 200, 16), _randn(2, 1, 200, 16, seed=1), _randn(2, 1, 200, 16, seed=2)
    mask = _padded_causal(2, 200, 200)
    with _one_thread():
        assert impl(q, k, v, mask, 0.25) is not None
        ours = _grads(lambda q, k, v: impl(q, k, v, mask, 0.25), [q, k, v])
    _close(ours, _grads(lambda q, k, v: _sdpa(q, k, v, mask[:, None], 0.25), [q, k, v]), atol=1e-5)


def check_decode_attention(impl, ref, dtype):
    B, H, D, T, t = 3, 4, 16, 10, 6
    kv = _randn(B, 2, H, T, D)
    kv[:, :, :, t:] = float("nan")  # columns not written yet
    qkv, bias, out = _randn(B, 3, H, D, seed=1), torch.zeros(B, T), torch.empty(B, H, D)
    bias[0, :2] = float("-inf")
    impl(qkv, kv, bias, out, D**-0.5)(t)
    assert torch.equal(kv[:, :, :, t], qkv[:, 1:])  # the step's key and value landed
    want = _sdpa(qkv[:, 0, :, None], kv[:, 0, :, : t + 1], kv[:, 1, :, : t + 1], bias[:, None, None, : t + 1], D**-0.5)
    _close(out, want[:, :, 0], atol=2e-6)


def check_graphed_decode_attention(impl, ref, dtype):
    """Reads the step's column from a tensor and only the columns written so far (NaN after them)."""
    B, H, Hkv, D, T, t = 3, 4, 2, 16, 40, 21
    kv = _randn(B, 2, Hkv, T, D)
    kv[:, :, :, t + 1:] = float("nan")
    q, bias = _randn(B, H, 1, D, seed=1), torch.zeros(B, T)
    bias[1, :5] = float("-inf")
    attend = impl(kv, H)
    if attend is None:
        pytest.skip("Triton's decode attention runs on CUDA, or on a CPU under its interpreter (TRITON_INTERPRET=1)")
    got = attend(q, kv[:, 0], kv[:, 1], bias, torch.tensor([t]), D**-0.5)
    want = _sdpa(q, kv[:, 0, :, : t + 1], kv[:, 1, :, : t + 1], bias[:, None, None, : t + 1], D**-0.5)
    _close(got, want, atol=2e-6, rtol=0)


# --------------------------------------------------------------------------- the LM head, sampling, packing

def _logits(dtype):
    z = (_randn(23, 1003) * 4).to(dtype)
    z[3, 7] = float("-inf")  # a banned token
    return z, torch.randint(0, 1003, (23,), generator=_gen(1))


def check_head_lse(impl, ref, dtype):
    z, t = _logits(dtype)
    assert ref(z, t) is None
    lse, picked = impl(z, t)
    _close((lse, picked), (torch.logsumexp(z.float(), -1), z.float().gather(1, t[:, None])[:, 0]), atol=1e-5)


def check_head_grad(impl, ref, dtype):
    z, t = _logits(dtype)
    coef = _randn(23, seed=2)
    lse = torch.logsumexp(z.float(), -1)
    want = coef[:, None] * (F.one_hot(t, 1003).float() - torch.softmax(z.float(), -1))
    got = impl(z, lse, coef, t)
    assert got.dtype == dtype
    _close(got.float(), want.to(dtype).float(), atol=1e-6, rtol=1e-2)


def check_sampler(impl, ref, dtype):
    """Same tokens (for draws not within float error of a CDF boundary), log-probs, entropies and
    EOS bookkeeping as rollout.sample_tokens on log_softmax(logits / temperature)."""
    B, R, V, temperature, eos = 64, 4, 42, 0.7, 3
    logits, u = _randn(R, B, V) * 3, torch.rand(B, R, generator=_gen(1))
    assert ref(B, R, V, temperature, eos) is None
    sampler, alive = impl(B, R, V, temperature, eos), torch.ones(B, dtype=torch.bool)
    for t in range(R):
        n_alive = sampler.step(t, logits[t], u[:, t])
        logp = torch.log_softmax(logits[t] / temperature, -1)
        cdf = logp.exp().cumsum(-1)
        clear = ((cdf - (1 - u[:, t, None]) * cdf[:, -1:]).abs() > 1e-5).all(-1)  # far from every boundary
        assert clear.float().mean() > 0.9
        assert torch.equal(sampler.tokens[clear, t], sample_tokens(logp, u=u[:, t])[clear])
        took = sampler.tokens[:, t]
        _close(sampler.logprobs[:, t], logp.gather(1, took[:, None])[:, 0], atol=2e-6, rtol=1e-6)
        _close(sampler.entropy[:, t], _entropy(logp), atol=2e-5, rtol=2e-6)
        alive &= took != eos
        assert n_alive == int(alive.sum()) and torch.equal(sampler.alive, alive)


def check_pack(impl, ref, dtype):
    """The same numbers bit for bit as F.linear and addmm on the weight itself."""
    x, w, b, res = _randn(64, 96, dtype=dtype), _randn(208, 96, dtype=dtype, seed=1), _randn(
        208, dtype=dtype, seed=2), _randn(64, 208, dtype=dtype, seed=3)
    assert ref(w, 64) is w
    packed = impl(w, 64)
    assert not isinstance(packed, torch.Tensor)
    with torch.no_grad():
        assert torch.equal(packed(x, b), F.linear(x, w, b))
        assert torch.equal(packed.add(res, x), torch.addmm(res, x, w.t()))


def check_packable(impl, ref, dtype):
    assert impl(_randn(8, 4, dtype=dtype)) and not impl(_randn(8, 4)) and not ref(_randn(8, 4, dtype=dtype))


# --------------------------------------------------------------------------- the forward (against transformers')

def _tiny_llama():
    from rlhfkit.models.forward import build_tiny
    from rlhfkit.tasks import doubling

    tok = doubling.make_tokenizer()
    model = build_tiny("llama", tok, seed=3).eval()
    ids = torch.randint(4, len(tok), (4, 9), generator=_gen(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[2:] = ids[:2]  # rows 2, 3 repeat rows 0, 1: shared prompts
    mask[2:] = mask[:2]
    return model, ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def check_runs_forward(impl, ref, dtype):
    model = _tiny_llama()[0]
    assert impl(model) is True and ref(model) is None


def check_hidden_states(impl, ref, dtype):
    model, ids, mask, pos = _tiny_llama()
    assert ref(model, ids, mask, pos) is None
    want = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    _close(impl(model, ids, mask, pos)[mask.bool()], want[mask.bool()], atol=1e-5)


def check_response_hidden_states(impl, ref, dtype):
    model, ids, mask, pos = _tiny_llama()
    assert ref(model, ids, mask, pos, 5) is None
    want = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    _close(impl(model, ids, mask, pos, 5), want[:, 4:-1], atol=1e-5)
    _close(impl(model, ids, mask, pos, 5, True), want[:, 4:], atol=1e-5)


def check_decoder(impl, ref, dtype):
    model, ids, mask, pos = _tiny_llama()
    assert ref(model, ids[:, :5], mask[:, :5], pos[:, :5], 4) is None
    dec = impl(model, ids[:, :5], mask[:, :5], pos[:, :5], 4)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    _close(dec.logits, logits[:, 4], atol=1e-5)
    for t in range(5, 9):
        _close(dec.step(ids[:, t], pos[:, t]), logits[:, t], atol=1e-5)


CLAIMS = {  # name: (its check, the dtypes its accelerated implementation takes)
    "linear": (check_linear, [F32]), "add_linear": (check_add_linear, [F32]), "mm": (check_mm, [F32]),
    "mm_out": (check_mm_out, [F32]), "grad_weight": (check_grad_weight, [F32]), "addmm_": (check_addmm_, [F32]),
    "gelu_tanh": (check_gelu_tanh, [F32]), "gelu_tanh_gate": (check_gelu_tanh_gate, [F32]),
    "gelu_tanh_backward": (check_gelu_tanh_backward, [F32]), "swiglu": (check_swiglu, [F32]),
    "swiglu_backward": (check_swiglu_backward, [F32]), "rms_norm": (check_rms_norm, [BF16]),
    "attention": (check_attention, [F32, BF16]), "causal_attention": (check_causal_attention, [F32]),
    "decode_attention": (check_decode_attention, [F32]),
    "graphed_decode_attention": (check_graphed_decode_attention, [F32]),
    "head_lse": (check_head_lse, [BF16]), "head_grad": (check_head_grad, [BF16]), "sampler": (check_sampler, [F32]),
    "pack": (check_pack, [BF16]), "packable": (check_packable, [BF16]),
    "runs_forward": (check_runs_forward, [F32]), "hidden_states": (check_hidden_states, [F32]),
    "response_hidden_states": (check_response_hidden_states, [F32]), "decoder": (check_decoder, [F32]),
}


def _table(name: str):
    """Where ``name`` is registered: the core's names (rlhfkit.ops) or the forward's (``linear``: both)."""
    return ops if name in ops.REFERENCE else primitives


def test_every_name_has_a_check():
    assert set(CLAIMS) == set(ops.REFERENCE) | set(primitives.REFERENCE)


@pytest.mark.parametrize("name, dtype", [(name, dtype) for name, (_, dtypes) in CLAIMS.items() for dtype in dtypes],
                         ids=str)
def test_accelerated_equals_reference(name, dtype, accel_on):
    if name not in accel_on:
        pytest.skip(f"nothing in rlhfkit.accel computes {name} on this machine (a C compiler, oneDNN or Triton missing)")
    check, _ = CLAIMS[name]
    check(_table(name).get(name), _table(name).reference(name), dtype)


def test_the_core_and_the_forward_keep_one_registry():
    """``ops`` and ``accel.primitives`` are two tables of one registry: one shortcut reference, one
    reset by ``ops.configure``, and one finder of repeated prompt rows for the experience and the prefill."""
    from rlhfkit import registry
    from rlhfkit.accel import forward
    from rlhfkit.rollout import experience

    assert ops.reference("sampler") is primitives.reference("attention") is registry.not_taken
    assert experience.repeated_rows is forward.repeated_rows is registry.repeated_rows
    try:
        primitives.register("swiglu", primitives.reference("swiglu"), "test")
        assert primitives.chosen() == {"swiglu": "test"}
        ops.configure("off")
        assert primitives.chosen() == {} and primitives.get("swiglu") is primitives.reference("swiglu")
    finally:
        ops.configure(os.environ["RLHFKIT_ACCEL"])


def test_other_inputs_go_to_the_reference(accel_on):
    """Inputs an implementation does not take (float64 here) give the reference's numbers exactly."""
    x, gate = _randn(7, 12, dtype=torch.float64), _randn(7, 12, dtype=torch.float64, seed=1)
    for name, args in (("gelu_tanh", (x,)), ("swiglu", (gate, x)), ("linear", (x, gate)),
                       ("rms_norm", (x, gate[0], 1e-6))):
        assert torch.equal(_table(name).get(name)(*args), _table(name).reference(name)(*args)), name
    assert primitives.get("attention")(x[None, None], x[None, None], x[None, None], torch.zeros(1, 1, 7, 7,
                                                                                     dtype=torch.float64), 1.0) is None


def test_off_imports_nothing_of_accel_and_old_switches_warn():
    """accel.enabled=off registers nothing and never imports the accel package; a variable that
    used to switch it names the key that does now."""
    code = ("import sys, warnings; warnings.simplefilter('error'); from rlhfkit import ops\n"
            "assert ops.configure('off') == {}\n"
            "assert not [m for m in sys.modules if m.startswith('rlhfkit.accel')]\n"
            "import os; os.environ['RLHFKIT_KERNELS'] = '0'\n"
            "try:\n    ops.configure('off')\nexcept UserWarning as w:\n    print(w)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "RLHFKIT_KERNELS no longer read: set accel.enabled" in done.stdout
    assert done.stderr.strip() == "accel (off): none; reference: " + ", ".join(ops.REFERENCE)


def test_accel_enabled_from_the_command_line_and_the_environment(monkeypatch):
    """A bare on / off (YAML's booleans) is the mode; $RLHFKIT_ACCEL is the default, else auto."""
    assert load_config(overrides=["accel.enabled=on"]).accel.enabled == "on"
    assert load_config(overrides=["accel.enabled=off"]).accel.enabled == "off"
    monkeypatch.delenv("RLHFKIT_ACCEL")
    assert Config().accel.enabled == "auto"
    monkeypatch.setenv("RLHFKIT_ACCEL", "fast")
    with pytest.raises(ConfigError, match="config key 'accel.enabled' must be one of"):
        Config()


def test_a_run_with_acceleration_on_chooses_once_and_says_so(tiny_models, tmp_path, capsys):
    """``rlhfkit grpo accel.enabled=on``: trains, and prints the one line of what computes what
    once (the command and the trainer's set-up both configure, with the same result)."""
    try:
        assert main(["grpo", f"model.name={tiny_models.policy}", f"reward.name={tiny_models.reward}",
                     f"run.out_dir={tmp_path}", "run.progress=false", "ppo.steps=2", "ppo.batch_size=8",
                     "ppo.minibatch_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0", "ppo.group_size=4",
                     "model.n_layer=1", "accel.enabled=on"]) == 0
    finally:
        ops.configure(os.environ["RLHFKIT_ACCEL"])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("accel (")]
    assert len(said) == 2 and said[0].startswith("accel (on): ") and said[1].startswith("accel (off): ")
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2
