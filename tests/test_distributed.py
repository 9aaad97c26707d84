"""Data parallelism through accelerate: two CPU processes (gloo) compute what one process computes.

Each command runs with its own defaults for a few steps (PPO past its critic warm-up; GRPO, RLOO and
REINFORCE two steps of batch 64 in minibatches of 32 over two epochs; DPO, SFT and the reward model
two steps of their default batches), plus variants (a warm-up step on a shared value head, LoRA, a
prompt file in minibatches of one group, micro-batches of 3 rows, one update a rollout whose forward
gives the old log-probs, GRPO's per-sequence mean loss with
GSPO's sequence ratios, whose processes are weighted by rows, GRPO with gradient checkpointing, and
PPO and GRPO with their defaults again, their update's loss computed inside a chunked LM head as at
a real vocabulary), once in a single process and once under ``accelerate launch`` with two
processes, each taking half of every global batch. The logged losses, gradient norms and statistics
and the saved weights must agree (1e-4), which holds only if sharding reproduces the single-process
batch, sampling does not depend on the split, every minibatch holds the same rows of the global
batch as in one process (whichever process holds them), batch-wide statistics are gathered,
token-mean losses are reweighted, a critic warm-up leaves the actor's optimizer state alone and
metrics are reduced; and only the main process may write files.

PPO and GRPO (the prompt-file run) also run on two "nodes" of one process each, started as two
separate launches on this machine (``--nnodes 2`` / ``--num_machines 2``, node rank 0 and 1,
rendezvous on 127.0.0.1): once with plain ``torchrun`` (accelerate reads torchrun's environment)
and once with ``accelerate launch``. Each node runs in its own working directory with the same
relative ``run.out_dir``, as two machines without a shared file system would: node 1 (a local
main process, not the global one) must leave no file there, and node 0's metrics and weights
must match the 1-process run's.

DeepSpeed (``make test-long``, which installs it; rlhfkit does not depend on it): SFT under the
ZeRO-2 and ZeRO-3 example configs and GRPO under ZeRO-2 run on two CPU processes (gloo) and must
match the 1-process run as well; PPO under ZeRO-2 and RL under ZeRO-3 must be refused with the
reason.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ports import launch_port
from rlhfkit.models.forward import build_tiny_policy, build_tiny_scalar_model
from rlhfkit.tasks import doubling
from rlhfkit.tasks.doubling import make_tokenizer
from rlhfkit.utils import read_jsonl

# two launches of every trainer (one and two processes, a module fixture) feed every test here
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).parent / "dist" / "driver.py"
TOL = 1e-4
RUNS = ("ppo", "ppo_warmup", "ppo_separate", "ppo_lora", "grpo", "grpo_lora", "grpo_file", "grpo_seqmean", "grpo_ckpt",
        "grpo_offload", "rloo",
        "reinforce", "dpo", "sft", "rm", "ppo_micro", "dpo_micro", "sft_micro", "rm_micro", "grpo_env", "ppo_env",
        "ppo_chunked", "grpo_chunked")
# RL under FSDP2 (examples/accelerate/fsdp.yaml, GPT2Block layers): a shared value head (ppo's default), a separate critic,
# the three critic-free estimators, LoRA (PPO with an adapter on the critic too, GRPO) and multi-turn
# environments (GRPO, PPO), matched to the
# 1-process run at FSDP_TOL
FSDP_RUNS = ("ppo", "ppo_separate", "grpo", "rloo", "reinforce", "ppo_lora", "grpo_lora", "grpo_file", "grpo_env", "ppo_env")
FSDP_TOL = 1e-5
NODE_RUNS = ("ppo", "grpo_file")  # what the 2-node launches run (a few seconds each)
# what runs under each DeepSpeed example config; PPO (a second prepared model, the critic) and
# ZeRO-3 rollouts (sharded weights) do not work, see docs/scale-out.md
DEEPSPEED_RUNS = {"zero2": ("sft", "grpo_file"), "zero3": ("sft",)}
# the DeepSpeed tests (marked long) need the optional dependency; make test-long installs it
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed: `make test-long` installs it "
                                            "(pip install -e '.[deepspeed]')")
EXAMPLES = Path(__file__).parents[1] / "examples" / "accelerate"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    tok = make_tokenizer()
    arch = dict(n_layer=2, n_head=2, n_embd=32)
    policy, rm = build_tiny_policy(tok, seed=0, **arch), build_tiny_scalar_model(tok, seed=1, **arch)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in rm.parameters():  # spread the random reward model's scores (0.02-std init scores all alike)
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        # raise the EOS logit by ~2 on average: responses end at different lengths, so the processes'
        # shards hold different token counts and token means must be reweighted to agree
        ids = tok(["数字:1234x2=5", "小写:4321x2=八"], return_tensors="pt")["input_ids"]
        h = policy.transformer(ids).last_hidden_state.mean((0, 1))  # [H]
        policy.lm_head.weight[tok.eos_token_id] += 2.0 * h / h.square().sum()
    for model, name in ((policy, "policy"), (rm, "rm")):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    for name, numbers in (("prompts.jsonl", (1234, 4321, 2718)), ("held.jsonl", (1111, 2222, 3333, 4444, 5555))):
        rows = [{"prompt": doubling.Prompt(n, doubling.SET_NAMES[n % 3]).text,
                 **doubling.columns(doubling.Prompt(n, doubling.SET_NAMES[n % 3]))} for n in numbers]
        (root / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    env = ENV
    args = [str(root / "policy"), str(root / "rm")]
    # --multi_gpu selects the torch.distributed launcher; on CPU the processes join with gloo
    # (accelerate 1.x sends a bare --cpu multi-process launch to mpirun instead)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(launch_port())]
    procs = {
        1: subprocess.Popen([sys.executable, str(DRIVER), str(root / "one"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        2: subprocess.Popen([*launch, str(DRIVER), str(root / "two"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    for n, proc in procs.items():
        log, _ = proc.communicate(timeout=480)
        assert proc.returncode == 0, f"{n}-process run failed:\n{log[-6000:]}"
        (root / f"{n}-process.log").write_text(log)
    return root / "one", root / "two"


def test_ddp_is_not_asked_to_search_for_unused_parameters(runs):
    """A critic warm-up leaves the actor without gradients; its steps go around the DDP wrapper, so
    DDP never needs find_unused_parameters=True, nor warns about its cost on every later step."""
    log = (runs[1].parent / "2-process.log").read_text()
    assert "ppo_warmup" in os.listdir(runs[1]) and "find_unused_parameters" not in log


def _launch_nodes(launcher: str, root: Path, port: int) -> list[list[str]]:
    """The commands of node 0 and node 1 (one process each) of a 2-node launch that rendezvous
    on 127.0.0.1:port, as they would be typed on two machines."""
    if launcher == "torchrun":  # python -m torch.distributed.run is the torchrun script
        node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(port), "--node_rank"]
    else:  # --num_processes counts the processes of all machines
        node = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--machine_rank"]
    args = [str(DRIVER), "out", str(root / "policy"), str(root / "rm"), *NODE_RUNS]  # out: relative
    return [[*node, str(rank), *args] for rank in (0, 1)]


@pytest.fixture(scope="module", params=["torchrun", "accelerate"])
def two_nodes(request, runs):
    """``(node 0's out dir, node 1's working directory)`` of a 2-node launch of NODE_RUNS; each
    node runs in its own working directory with the relative out dir ``out``."""
    root = runs[0].parent
    cwds = [root / f"{request.param}-node{rank}" for rank in (0, 1)]
    procs = []
    for cmd, cwd in zip(_launch_nodes(request.param, root, launch_port()), cwds):
        cwd.mkdir()
        with open(root / f"{cwd.name}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 300
    try:  # a node that fails leaves the other waiting in the rendezvous or a collective: stop it
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, \
            f"{request.param} node {rank} failed ({p.returncode}):\n{(root / f'{cwds[rank].name}.log').read_text()[-6000:]}"
    return cwds[0] / "out", cwds[1]


# The reward model's fresh head scores every pair near 0 in its first steps, so the share of pairs
# ranked right flips on near-ties when micro-batches pad the pairs differently (scores equal to ~1e-7);
# rm/delta and rm/loss, continuous, carry the comparison of micro-batched reward-model runs
NEAR_TIES = ("rm/accuracy",)


def _metric_diffs(a_dir: Path, b_dir: Path, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """Largest |a - b| over the logged steps of every metric (wall-clock fields and ``skip``
    aside) of two runs; both must have logged the same steps and the same metrics as None."""
    a, b = read_jsonl(a_dir / "metrics.jsonl"), read_jsonl(b_dir / "metrics.jsonl")
    assert len(a) == len(b) >= 1  # one row per logged step: written once, by the main process
    diffs = {}
    for ra, rb in zip(a, b):
        for k in (k for k in ra if not k.startswith(("time/", "throughput/")) and k != "step" and k not in skip):
            va, vb = ra[k], rb[k]
            assert (va is None) == (vb is None), k
            if va is not None:
                diffs[k] = max(diffs.get(k, 0.0), abs(va - vb))
    return diffs


def _assert_weights_match(a: Path, b: Path) -> None:
    """The saved ``model.safetensors`` in directories ``a`` and ``b`` hold the same weights."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    diff = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    # Adam's first step moves every weight by about lr * g / |g|: float noise in a near-zero gradient
    # can show up to ~lr in a few weights (1.7e-5 on one of 10^4 in the reward model), while a wrong
    # batch would move most of them by O(lr). Hence a bound on the mean and a looser one on the max.
    assert math.isfinite(diff.max().item()) and diff.mean().item() < 1e-7 and diff.max().item() < 1e-3, \
        (diff.mean().item(), diff.max().item())


def test_two_processes_really_ran(runs):
    one, two = runs
    assert json.loads((one / "world.json").read_text())["num_processes"] == 1
    world = json.loads((two / "world.json").read_text())
    assert world["num_processes"] == 2 and "MULTI_CPU" in world["distributed_type"]


@pytest.mark.accel_twice
@pytest.mark.parametrize("cmd", RUNS)
def test_first_step_matches_one_process(runs, cmd):
    one, two = runs
    diffs = _metric_diffs(one / cmd, two / cmd, skip=NEAR_TIES if cmd == "rm_micro" else ())
    a = read_jsonl(one / cmd / "metrics.jsonl") + read_jsonl(two / cmd / "metrics.jsonl")
    keys = list(diffs)
    assert any("loss" in k for k in keys) and any("grad_norm" in k for k in keys), keys
    if cmd == "ppo_warmup":  # warm-up: only the value head learned; then the actor too
        assert [r["policy/grad_norm"] == 0.0 for r in a] == [True, False, True, False]
    if cmd == "grpo_file":  # both rewards, the held-out scores and the second pass are there
        assert {"reward/reward_model", "reward/format_reward", "eval/reward", "eval/accuracy"} <= set(a[-1])
        assert [r["data/epoch"] for r in a] == [0, 1, 0, 1]
    print(f"\n{cmd}: max |1 process - 2 processes| over {len(diffs)} metrics = {max(diffs.values()):.2e}; "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(diffs.items()) if "loss" in k or "grad_norm" in k))
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, bad


@pytest.mark.parametrize("cmd", ["ppo", "dpo", "sft", "rm"])
def test_micro_batches_on_two_processes_match_whole_batches_on_one(runs, cmd):
    """Gradient accumulation under DDP (no gradient sync but on the last micro-batch) gives the
    update of the whole global batch in one process: the same metrics and weights."""
    one, two = runs
    bad = {k: v for k, v in _metric_diffs(one / cmd, two / f"{cmd}_micro", skip=NEAR_TIES).items() if not v <= TOL}
    assert not bad, bad
    weights = "reward_model" if cmd == "rm" else "policy"
    _assert_weights_match(one / cmd / weights, two / f"{cmd}_micro" / weights)


@pytest.mark.parametrize("cmd", ["ppo", "grpo"])
def test_update_through_the_chunked_head_on_two_processes(runs, cmd):
    """At a real vocabulary the update's log-probs come from the chunked LM head
    (``logprobs.chunked_token_logprobs``), each process scaling its rows' share of the global token mean:
    the commands' defaults on that path (``driver.py``'s ``*_chunked`` runs) must give, on two
    processes, the metrics and weights of one process, and in one process those of the full logits."""
    one, two = runs
    for n, log in ((1, "1-process.log"), (2, "2-process.log")):
        # found anywhere in the log: two processes share one pipe, and a progress bar may share the line
        calls = [int(c) for c in re.findall(rf"chunked update calls in {cmd}_chunked: (\d+)", (one.parent / log).read_text())]
        assert len(calls) == n and min(calls) > 0, calls  # every process took the path
    assert not {k: v for k, v in _metric_diffs(one / cmd, one / f"{cmd}_chunked").items() if not v <= TOL}
    _assert_weights_match(one / cmd / "policy", one / f"{cmd}_chunked" / "policy")
    _assert_weights_match(one / f"{cmd}_chunked" / "policy", two / f"{cmd}_chunked" / "policy")


def test_master_weights_on_two_processes_match_one_to_bfloat16_rounding(runs):
    """``model.master_weights`` under DDP, in micro-batches (``driver.py``'s ``grpo_master``): each
    process sums its micro-batches' bfloat16 gradients into float32 ones, which DDP averages. The
    products of a 4-row micro-batch and of a 3-row one round differently in bfloat16, so the
    runs agree to that rounding, not to float32's; the second epoch's differences of log-probs
    (the approximate KL, the KL loss) carry it most: 0.55% apart at most, the weights 0.44% of
    how far the step moved them (at commit b015228). Bounds: 2% for both. A lost process's
    gradients would move the weights elsewhere, and a sum for a mean would double the gradient
    norm."""
    one, two = runs
    a, b = read_jsonl(one / "grpo_master" / "metrics.jsonl"), read_jsonl(two / "grpo_master" / "metrics.jsonl")
    assert len(a) == len(b) == 1 and a[0]["policy/grad_norm"] > 0.1
    bad = {k: (v, b[0][k]) for k, v in a[0].items() if isinstance(v, float) and not k.startswith(("time/", "throughput/"))
           and not abs(v - b[0][k]) <= 2e-2 * max(abs(v), 1e-2)}
    assert not bad, bad
    start = load_file(one.parent / "policy" / "model.safetensors")
    wa = load_file(one / "grpo_master" / "policy" / "model.safetensors")
    assert {w.dtype for w in wa.values()} == {torch.float32}
    moved = torch.cat([(wa[k] - start[k]).abs().flatten() for k in wa]).mean()
    assert _weight_diffs(one / "grpo_master" / "policy", two / "grpo_master" / "policy").mean() < 0.02 * moved


@pytest.mark.parametrize("cmd,weights", [("ppo", "policy"), ("grpo", "policy"), ("grpo_file", "policy"), ("dpo", "policy"),
                                         ("sft", "policy"), ("rm", "reward_model")])
@pytest.mark.accel_twice
def test_saved_weights_match_one_process(runs, cmd, weights):
    one, two = runs
    _assert_weights_match(one / cmd / weights, two / cmd / weights)


def test_only_the_main_process_writes_samples(runs):
    one, two = runs
    for cmd in ("ppo", "grpo", "grpo_file"):
        sa = read_jsonl(one / cmd / "samples.jsonl")
        sb = read_jsonl(two / cmd / "samples.jsonl")
        assert sa == sb  # the first rows of the global batch, sampled identically, written once


def test_two_nodes_ran_and_only_the_global_main_process_wrote(two_nodes):
    out, node1 = two_nodes
    world = json.loads((out / "world.json").read_text())
    assert world["num_processes"] == 2 and "MULTI_CPU" in world["distributed_type"]
    for cmd in NODE_RUNS:
        assert (out / cmd / "metrics.jsonl").is_file() and (out / cmd / "samples.jsonl").is_file()
    # node 1's process is its node's local main process but not the global one: it writes nothing
    # (it may create the empty run directories)
    assert [p for p in node1.rglob("*") if not p.is_dir()] == []


@pytest.mark.parametrize("cmd", NODE_RUNS)
def test_two_nodes_match_one_process(runs, two_nodes, cmd):
    one, out = runs[0], two_nodes[0]
    diffs = _metric_diffs(one / cmd, out / cmd)
    print(f"\n{cmd}: max |1 process - 2 nodes| over {len(diffs)} metrics = {max(diffs.values()):.2e}")
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, bad
    _assert_weights_match(one / cmd / "policy", out / cmd / "policy")
    assert read_jsonl(one / cmd / "samples.jsonl") == read_jsonl(out / cmd / "samples.jsonl")


@pytest.fixture(scope="module", params=sorted(DEEPSPEED_RUNS))
def deepspeed_run(request, runs):
    """``(out dir, run names)`` of a 2-process launch with examples/accelerate/deepspeed_<stage>.yaml."""
    root, names = runs[0].parent, DEEPSPEED_RUNS[request.param]
    out = root / f"deepspeed-{request.param}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(EXAMPLES / f"deepspeed_{request.param}.yaml"), "--num_processes", "2",
           "--main_process_port", str(launch_port()), str(DRIVER), str(out), str(root / "policy"), str(root / "rm"),
           *names]
    proc = subprocess.run(cmd, env={**ENV, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, f"DeepSpeed {request.param} run failed:\n{proc.stdout[-6000:]}"
    return out, names


@pytest.mark.long
@needs_deepspeed
def test_deepspeed_matches_one_process(runs, deepspeed_run):
    out, names = deepspeed_run
    world = json.loads((out / "world.json").read_text())
    assert world["num_processes"] == 2 and "DEEPSPEED" in world["distributed_type"], world
    for cmd in names:
        diffs = _metric_diffs(runs[0] / cmd, out / cmd)
        print(f"\n{out.name} {cmd}: max |1 process - 2 processes| over {len(diffs)} metrics = {max(diffs.values()):.2e}")
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, (cmd, bad)
        _assert_weights_match(runs[0] / cmd / "policy", out / cmd / "policy")


@pytest.mark.parametrize("config,cmd,extra,reason", [
    pytest.param("deepspeed_zero2", "ppo", ["ppo.critic_warmup_steps=0"],
                 "clips one gradient norm over the actor and the critic",
                 marks=[pytest.mark.long, needs_deepspeed]),
    pytest.param("deepspeed_zero3", "grpo", [], "ZeRO-3 holds partitioned", marks=[pytest.mark.long, needs_deepspeed]),
    ("fsdp", "sft", ["model.master_weights=true", "model.dtype=bfloat16"], "model.master_weights runs on one process"),
])
def test_engines_refuse_what_would_fail_or_differ_from_one_process(runs, tmp_path, config, cmd, extra, reason):
    """PPO under DeepSpeed (a critic clipped together with the actor) and RL under ZeRO-3
    (generation on partitioned weights) stop at once with the reason, instead of running a
    different update or failing after the training."""
    root = runs[0].parent
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLES / f"{config}.yaml"),
              "--num_processes", "2", "--main_process_port", str(launch_port()),
              *(["--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"] if config == "fsdp" else []),
              "-m", "rlhfkit", cmd, "run.device=cpu", "run.progress=false", f"model.name={root / 'policy'}",
              f"reward.name={root / 'rm'}", "ppo.steps=1", "ppo.max_new_tokens=4", *extra,
              f"run.out_dir={tmp_path / 'out'}"]
    proc = subprocess.run(launch, env={**ENV, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode != 0 and reason in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "out" / "policy").exists()


@pytest.fixture(scope="module")
def fsdp_run(runs):
    """The out dir of a 2-process launch of FSDP_RUNS with examples/accelerate/fsdp.yaml on CPU (gloo)."""
    root = runs[0].parent
    out = root / "fsdp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLES / "fsdp.yaml"),
           "--num_processes", "2", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block", "--main_process_port",
           str(launch_port()), str(DRIVER), str(out), str(root / "policy"), str(root / "rm"), *FSDP_RUNS]
    proc = subprocess.run(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, f"FSDP run failed:\n{proc.stdout[-6000:]}"
    # every run but grpo_env (its environment alone scores) reads a reward model; all but the LoRA
    # ones hold a reference copy: both are sharded too
    sharded = [line for line in proc.stdout.splitlines() if "frozen model(s)" in line]
    assert sharded == [f"FSDP: {2 - cmd.endswith('_lora') - (cmd == 'grpo_env')} frozen model(s) (reference, reward "
                       "model) sharded too" for cmd in FSDP_RUNS], sharded
    return out


def _weight_diffs(a: Path, b: Path, skip: str | None = None) -> torch.Tensor:
    """|a - b| over every saved weight of two ``model.safetensors`` directories (names containing
    ``skip`` left out)."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa if skip is None or skip not in k])


@pytest.mark.parametrize("cmd", FSDP_RUNS)
def test_fsdp_matches_one_process(runs, fsdp_run, cmd):
    """One RL step with the policy (and critic) sharded per layer over two processes: the
    generation on gathered weights, the experience pass, the update and the clipped gradient
    norms give the 1-process metrics and saved weights."""
    world = json.loads((fsdp_run / "world.json").read_text())
    assert world["num_processes"] == 2 and "FSDP" in world["distributed_type"], world
    one, out = runs[0] / cmd, fsdp_run / cmd
    diffs = _metric_diffs(one, out)
    assert any("grad_norm" in k for k in diffs), diffs
    print(f"\nfsdp {cmd}: max |1 process - 2 processes| over {len(diffs)} metrics = {max(diffs.values()):.2e}")
    bad = {k: v for k, v in diffs.items() if not v <= FSDP_TOL}
    assert not bad, bad
    # two Adam steps (ppo_epochs=2): where a weight's two gradients nearly cancel, m / sqrt(v) turns
    # rounding-level gradient differences into a few percent of a step of lr (ppo's shared head, with the
    # scores normalised: one weight of 29k off by 1.1e-5); the mean stays at rounding
    policy = _weight_diffs(one / "policy", out / "policy")
    assert policy.mean().item() < 1e-8 and policy.max().item() < 1e-4, (policy.mean().item(), policy.max().item())
    assert read_jsonl(one / "samples.jsonl") == read_jsonl(out / "samples.jsonl")
    if cmd.endswith("_lora"):  # the adapter, written from the gathered shards
        a = load_file(one / "policy_adapter" / "adapter_model.safetensors")
        b = load_file(out / "policy_adapter" / "adapter_model.safetensors")
        assert a.keys() == b.keys() and any("lora_B" in k for k in a)
        assert max((a[k] - b[k]).abs().max().item() for k in a) < FSDP_TOL
        assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 0  # the step moved the adapter
    if cmd in ("ppo_separate", "ppo_lora"):
        # the attention key biases' gradient is zero in exact arithmetic (a key bias adds the same
        # amount to every score of a query): Adam turns its rounding noise into steps of ~value_lr,
        # under DDP as well; every other weight of the critic must match
        # (critic steps at value_lr 3e-3, ten times the policy's lr, so its rounding walk is longer; a
        # wrong batch would move most weights by O(value_lr))
        critic = _weight_diffs(one / "value_model", out / "value_model", skip="c_attn.bias")
        assert critic.mean().item() < 1e-7 and critic.max().item() < 1e-4, (critic.mean().item(), critic.max().item())
    if cmd == "ppo":
        a, b = load_file(one / "value_head.safetensors"), load_file(out / "value_head.safetensors")
        assert max((a[k] - b[k]).abs().max().item() for k in a) < FSDP_TOL
