"""``accel.offload``: AdamW's moments and the frozen models' weights leave the device between the
phases that read them, and come back unchanged: a run with it trains exactly as one without.

On a CPU host and device memory are one, so there these tests check the mechanics (separate
copies made and dropped at the right points) and the arithmetic;
``RLHFKIT_TEST_DEVICE=cuda pytest tests/test_offload.py`` runs the first two on a GPU, where they
also check the device memory given back. What it saves in a training step is measured by
``benchmarks/real_step.py``'s ``rlhfkit_grpo_ckpt_offload`` row."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file

import rlhfkit.trainers.rl as rl
import rlhfkit.trainers.rl_setup as rl_setup
from rlhfkit.accel.offload import HostMoments, host_empty, offload_frozen, on_device
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.run.checkpoint import latest_checkpoint
from rlhfkit.tasks import doubling
from rlhfkit.utils import read_jsonl

TOK = doubling.make_tokenizer()
DEV = torch.device(os.environ.get("RLHFKIT_TEST_DEVICE", "cpu"))


def _allocated() -> int:
    return torch.cuda.memory_allocated(DEV) if DEV.type == "cuda" else 0


def _held(tensors) -> int:
    """Device bytes the CUDA caching allocator counts for ``tensors``: blocks of 512-byte multiples."""
    return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(3, len(TOK), (4, 7), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _step(model, optimizer, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_host_buffers_take_a_copy_exactly_pinned_on_cuda_whatever_accel_enabled():
    """An offload buffer is host memory of the shape and dtype asked for, pinned where CUDA runs
    (so the copies queue on the stream) with the accelerated operations off too."""
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    buf = host_empty(x.shape, x.dtype)
    assert buf.device.type == "cpu" and buf.shape == x.shape and buf.dtype == x.dtype
    assert buf.is_pinned() == torch.cuda.is_available()
    buf.copy_(x.to(DEV), non_blocking=buf.is_pinned())
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(buf, x)


def test_moments_leave_and_come_back_as_fresh_copies_and_training_is_unchanged():
    plain, moved = (build_tiny_policy(TOK, 0, n_layer=1, n_head=2, n_embd=16).to(DEV) for _ in range(2))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (plain, moved)]
    moments = HostMoments(opts[1], DEV)
    moments.to_host()
    moments.to_device()  # before the first step there is no state: both are no-ops
    for step in range(3):
        _step(plain, opts[0], _batch(step))
        if step:
            moments.to_device()
        _step(moved, opts[1], _batch(step))
        used = {(p, k): v.clone() for p, s in opts[1].state.items() for k, v in s.items()}
        ptrs = {key: opts[1].state[key[0]][key[1]].data_ptr() for key in used}
        gone = [weakref.ref(v) for s in opts[1].state.values() for v in s.values()]
        before = _allocated()
        moments.to_host()
        assert all(r() is None for r in gone)  # nothing holds the device copies any more
        for (p, k), v in used.items():  # host buffers now: equal values, not the tensors the step used
            away = opts[1].state[p][k]
            assert away is moments.away[p][k][0] and away.device.type == "cpu"
            assert away.data_ptr() != ptrs[p, k] and torch.equal(away, v.cpu())
        if DEV.type == "cuda":  # their memory is given back (on an H200 the second round gave 3 KiB more)
            assert before - _allocated() >= _held(used.values())
    moments.to_device()
    for p, s in opts[1].state.items():
        for k, v in s.items():  # device copies, not the host buffers (which the next step would overwrite)
            assert v.data_ptr() != moments.away[p][k][0].data_ptr()
    for a, b in zip(plain.parameters(), moved.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    state0, state1 = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    for i in state0:
        for k in state0[i]:
            torch.testing.assert_close(state0[i][k], state1[i][k], rtol=0, atol=0)


def test_frozen_weights_are_on_the_device_only_inside_blocks_and_nested_blocks_copy_once():
    ref = build_tiny_policy(TOK, 1, n_layer=1, n_head=2, n_embd=16).to(DEV).eval()
    ref.lm_head.weight = ref.transformer.wte.weight  # tied, as most hub checkpoints: one parameter, moved once
    ids = _batch(0)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    params = list(ref.parameters())
    before = _allocated()
    offload_frozen(ref, DEV)
    host = [p.data_ptr() for p in params]
    assert all(p.device.type == "cpu" for p in params)
    weights = _held(params)
    if DEV.type == "cuda":
        assert before - _allocated() == weights
    with on_device(ref):
        inside = [p.data_ptr() for p in params]
        assert not set(inside) & set(host) and all(p.device == want.device for p in params)  # copies
        if DEV.type == "cuda":
            assert before - _allocated() == 0
        with on_device(ref):
            assert [p.data_ptr() for p in params] == inside  # not copied again
        assert [p.data_ptr() for p in params] == inside  # the inner block's end keeps them
        with torch.no_grad():
            torch.testing.assert_close(ref(input_ids=ids).logits, want, rtol=0, atol=0)
    assert [p.data_ptr() for p in params] == host
    if DEV.type == "cuda":
        assert before - _allocated() == weights
    with on_device(None):  # no model (no reference under LoRA): nothing to do
        pass


@pytest.mark.parametrize("algo,sections", [
    ("grpo", {}),  # a reference (full fine-tuning, KL in the loss) and a reward model
    ("ppo", {"ppo": {"value_model": "separate"}}),  # the critic's moments travel too
])
def test_a_run_with_offload_trains_exactly_as_one_without(algo, sections, tiny_models, tiny_config, tmp_path,
                                                          monkeypatch, no_plots):
    """Defaults of the command otherwise; three steps, each evaluated and checkpointed. During the
    rollout and the evaluation the moments are in host buffers and the frozen models hold their
    host copies; during the experience pass the frozen models are on the device. A checkpoint
    written with the moments away resumes to the same end."""
    seen = []
    rollout, experience, evaluate = rl.rollout, rl.make_experience, rl.evaluate

    def spy_rollout(run, ac, train_ac, tok, records, step, *a, **kw):
        if step is not None and offload:
            seen.append(("rollout", holder.moments_away(), holder.frozen_at_home()))
        return rollout(run, ac, train_ac, tok, records, step, *a, **kw)

    def spy_evaluate(*a, **kw):
        if offload:
            seen.append(("evaluate", holder.moments_away(), holder.frozen_at_home()))
        return evaluate(*a, **kw)

    def spy_experience(*a, **kw):
        if offload:
            seen.append(("experience", holder.moments_away(), holder.frozen_at_home()))
        return experience(*a, **kw)

    class holder:  # what start_offload set up, read by the spies
        moments = frozen = None

        @classmethod
        def moments_away(cls):
            opt = cls.moments.optimizer
            away = cls.moments.away
            return bool(opt.state) and all(v is away.get(p, {}).get(k, (None,))[0]
                                           for p, s in opt.state.items() for k, v in s.items())

        @classmethod
        def frozen_at_home(cls):
            return all(p.data_ptr() == h.data_ptr() for m in cls.frozen for p, h in m._rlhfkit_offload["host"])

    start = rl_setup.start_offload

    def spy_start(run, optimizer, *frozen):
        holder.moments = start(run, optimizer, *frozen)
        holder.frozen = [m for m in frozen if m is not None]
        return holder.moments

    monkeypatch.setattr(rl, "rollout", spy_rollout)
    monkeypatch.setattr(rl, "make_experience", spy_experience)
    monkeypatch.setattr(rl, "evaluate", spy_evaluate)
    monkeypatch.setattr(rl_setup, "start_offload", spy_start)
    results = []
    for offload in (False, True):
        out = tmp_path / f"offload_{offload}"
        cfg = tiny_config(out, model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                          run={"checkpoint_every": 1, "device": "cpu"},  # the mechanics, on any host
                          accel={"offload": offload},
                          ppo={"algo": algo, "steps": 3, "eval_every": 1, "lr": 1e-2,
                               **sections.get("ppo", {})})
        with pytest.warns(UserWarning, match="saves no memory") if offload else contextlib.nullcontext():
            rl.train_rl(cfg)
        if offload:  # checkpoints are written with the moments away: resume from the next-to-last
            whole = list(seen)
            shutil.rmtree(latest_checkpoint(out))
            seen.clear()
            with pytest.warns(UserWarning, match="saves no memory"):
                rl.train_rl(cfg.replace(run={"resume": True}))
            assert seen == [("rollout", True, True), ("experience", True, False), ("evaluate", True, True)] * 2
        rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_jsonl(out / "metrics.jsonl")]
        results.append((rows, load_file(str(out / "policy" / "model.safetensors"))))
    assert len(holder.frozen) == 2  # the reference and the reward model
    assert results[0][0] == results[1][0]
    for k, v in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], v, rtol=0, atol=0)
    # the evaluation before step 0 and the first step's rollout come before any moment exists; each
    # evaluation after an update runs with the moments away (the reward model is put on the device
    # inside it, not seen from here)
    assert whole == [("evaluate", False, True), ("rollout", False, True), ("experience", False, False),
                     ("evaluate", True, True)] + [("rollout", True, True), ("experience", True, False),
                                                  ("evaluate", True, True)] * 2



def test_a_frozen_model_holding_a_trained_weight_stays_and_fsdp_is_refused():
    from types import SimpleNamespace

    from rlhfkit.config import Config

    policy, ref = (build_tiny_policy(TOK, seed, n_layer=1, n_head=2, n_embd=16) for seed in (0, 1))
    optimizer = torch.optim.AdamW(policy.parameters())
    on = Config().replace(accel={"offload": True})
    run = SimpleNamespace(accelerator=None, device=torch.device("cpu"), cfg=on)
    with pytest.warns(UserWarning, match="saves no memory"):
        rl_setup.start_offload(run, optimizer, ref, policy)  # e.g. a reward model object that is the policy
    assert hasattr(ref, "_rlhfkit_offload") and not hasattr(policy, "_rlhfkit_offload")
    fsdp = SimpleNamespace(accelerator=SimpleNamespace(distributed_type="FSDP"), device=torch.device("cpu"), cfg=on)
    with pytest.raises(ValueError, match="one process or under DDP"):
        rl_setup.start_offload(fsdp, optimizer, ref)
    off = SimpleNamespace(accelerator=None, device=torch.device("cpu"), cfg=Config())
    assert rl_setup.start_offload(off, optimizer, ref) is None  # off by default


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
                    reason="malloc_trim is glibc's")
def test_release_free_memory_returns_the_heaps_holes_between_live_tensors():
    """What the RL loop calls between a step's phases: tensors freed between tensors still alive
    stay resident on glibc's heap until ``release_free_memory`` hands their pages back."""
    from rlhfkit.accel.heap import release_free_memory

    big = torch.ones(6 * 2**20)  # 24 MiB: mmapped, and freeing it raises glibc's mmap threshold above
    del big  # the 4 MiB tensors below, which then come from the heap as PyTorch's do in a step
    kept, freed = [], []
    for i in range(64):
        (kept if i % 2 else freed).append(torch.ones(2**20))
    del freed  # 32 holes of 4 MiB, each between two live tensors: nothing for free() to trim
    before = _rss_mib()
    release_free_memory()
    after = _rss_mib()
    assert before - after > 96, (before, after)  # of the 128 MiB freed
    assert all(float(t[0]) == 1.0 for t in kept)  # the live ones untouched


def test_the_rl_loop_releases_free_memory_before_each_phase(tiny_models, tiny_config, tmp_path, monkeypatch,
                                                            no_plots):
    """``rlhfkit grpo`` hands the freed heap back before each step's rollout, experience pass and
    update, so each phase's peak is its own."""
    calls = []
    for name in ("rollout", "make_experience", "ppo_update"):
        real = getattr(rl, name)
        monkeypatch.setattr(rl, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(rl, "release_free_memory", lambda: calls.append("release"))
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      run={"device": "cpu"}, ppo={"algo": "grpo", "steps": 2, "eval_every": 0})
    rl.train_rl(cfg)
    phases = ["release", "rollout", "release", "make_experience", "release", "ppo_update"]
    assert calls == phases * 2, calls


def test_gradient_buffer_sums_the_same_gradients_in_one_buffer_and_leaves_unused_ones_none():
    """The update's gradients go to one buffer off the heap: bit for bit the sums autograd makes
    without it, over three micro-batches; a parameter no loss reaches keeps ``.grad`` None (so the
    optimizer skips it, as without the buffer); FSDP and DeepSpeed opt out, and so does a model
    under ``GRADIENT_BUFFER_MIN`` trained numbers (``min_numbers=0`` takes this small one)."""
    from rlhfkit.accel.heap import gradient_buffer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    unused = torch.nn.Parameter(torch.randn(4))
    params = [*model.parameters(), unused]
    xs = [torch.randn(7, 6) for _ in range(3)]

    def grads(buffered: bool, enabled: bool = True, min_numbers: int | None = None):
        for p in params:
            p.grad = None
        kw = {} if min_numbers is None else {"min_numbers": min_numbers}
        with gradient_buffer(params, enabled=enabled, **kw) if buffered else contextlib.nullcontext():
            for x in xs:
                model(x).square().mean().backward()
        return [None if p.grad is None else p.grad.clone() for p in params], {p.grad.untyped_storage().data_ptr()
                                                                             for p in params if p.grad is not None}

    plain, plain_storages = grads(False)
    _, too_small = grads(True)
    assert len(too_small) == 4  # 57 numbers: under the bound, autograd's own gradients
    buffered, storages = grads(True, min_numbers=0)
    assert buffered[-1] is None and plain[-1] is None
    assert all(torch.equal(a, b) for a, b in zip(plain[:-1], buffered[:-1]))
    assert len(plain_storages) == 4 and len(storages) == 1  # one block each without the buffer, one in all with it
    _, opted_out = grads(True, enabled=False, min_numbers=0)
    assert len(opted_out) == 4
    before = [p.grad for p in model.parameters()]
    model(xs[0]).sum().backward()  # after the block: autograd's own accumulation, into the same tensors
    assert all(p.grad is g for p, g in zip(model.parameters(), before))


# Run in a fresh interpreter: glibc serves a request from a free chunk of its heap before asking
# for a new mapping, whatever the threshold, so the free chunks earlier tests leave in a worker's
# heap would decide where the tensors below land.
_OFF_HEAP_PROBE = """
import os, torch
from rlhfkit.accel.heap import tensors_off_heap

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def freed_mib(hole_mib=24):
    hole = torch.ones(hole_mib << 18)  # float32: hole_mib MiB, pages touched
    after = [torch.ones(1 << 18) for _ in range(128)]  # 1 MiB each, kept: some land above it
    before = resident_mib()
    del hole
    drop = before - resident_mib()
    del after
    return drop

with tensors_off_heap():
    off_heap = freed_mib()
on_heap = freed_mib()  # the threshold now 32 MiB: both sizes come from the heap
with tensors_off_heap(enabled=False):
    opted_out = freed_mib()
print(off_heap, on_heap, opted_out)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_tensors_off_heap_return_a_freed_tensor_between_live_ones_to_the_system():
    """Inside the block a tensor of 1 MiB or more is mapped on its own, so freeing it while the
    tensors allocated after it are alive lowers the resident set by its size; on glibc's heap
    (the threshold it leaves behind, 32 MiB) the same pages stay resident as a hole."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # glibc's malloc, not another
    done = subprocess.run([sys.executable, "-c", _OFF_HEAP_PROBE], capture_output=True, text=True, timeout=300,
                          env=env, check=True)
    off_heap, on_heap, opted_out = map(float, done.stdout.split())
    assert off_heap > 23, off_heap
    assert on_heap < 1, on_heap
    assert opted_out < 1, opted_out
