"""One RL step, phase by phase: rlhfkit vs TRL on the same model and batch, with peak memory.

A step is rollout (sampling 64 completions, up to 8 tokens), experience (log-probs, reference,
values, rewards, advantages) and update (the optimizer steps on that batch). Each contender
runs in its own process pinned to the same core with one torch thread, takes
``--warmup`` steps, then reports the median of ``--steps`` measured ones, per phase.

    PPO   rlhfkit PPO vs TRL's PPOTrainer (``trl.experimental.ppo``, which exists up to
          trl 1.12: run from a separate virtualenv, ``--trl112-python``, by default
          ``.venv-trl112/bin/python``; skipped with a note when it is missing). Same schedule
          for both: batch 64, 2 epochs x 2 minibatches of 32, a value model initialised from
          the pairwise reward model, which also scores; KL 0.2 (k1) in the reward and no KL
          loss term (rlhfkit's ppo.forward_kl_coef=0, as TRL's PPO).
    GRPO  rlhfkit GRPO (its defaults: 16 prompts x 4 samples, 2 epochs x 2 minibatches of 32,
          k3 KL 0.3 in the loss) vs TRL's GRPOTrainer (configured as in time_to_accuracy.py:
          8 prompts x 8 samples, one optimizer step on the 64 completions, k3 KL 0.1 in the
          loss); both compute reference log-probs; reward: the task's exact-match verifier. A
          third row runs rlhfkit GRPO on TRL's schedule (8 x 8, one update of 64, KL 0.1) for
          a like-for-like step.

``--clock cpu`` times each process's CPU seconds instead of wall seconds (for a machine
shared with other jobs). Phases of TRL are timed from the outside: generation by wrapping its generation function,
experience up to the first update forward (PPO) or the end of
``_generate_and_score_completions`` (GRPO), update to the end of the step. TRL's PPOTrainer
calls ``gc.collect()`` between its experience pass and its update (0.3-0.5 s here), which this
clock counts as experience: at these tiny sizes it is most of that phase. Peak memory is
the process's peak resident set (``ru_maxrss``: model, optimizer state, activations and the
libraries each contender imports), plus ``torch.cuda.max_memory_allocated`` on a GPU.

    python benchmarks/ppo_step.py                 # PPO and GRPO, tiny doubling GPT-2
    python benchmarks/ppo_step.py --algo grpo --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    DEFAULT_OUT,
    PhaseClock,
    add_record_args,
    code_version,
    peak_rss_mib,
    pinned_cmd,
    prepare,
    quiet_hf,
    record,
    versions,
    worker_setup,
)

RESULT = "RESULT "
ROWS = {
    "ppo": ["rlhfkit_ppo", "trl_ppo"],
    "grpo": ["rlhfkit_grpo", "rlhfkit_grpo_trl_schedule", "trl_grpo"],
}
NAMES = {"rlhfkit_ppo": "rlhfkit PPO", "trl_ppo": "TRL PPOTrainer 1.12", "rlhfkit_grpo": "rlhfkit GRPO",
         "rlhfkit_grpo_trl_schedule": "rlhfkit GRPO, TRL's schedule", "trl_grpo": "TRL GRPOTrainer"}
SCHEDULE = {"rlhfkit_ppo": "2x2 of 32", "trl_ppo": "2x2 of 32", "rlhfkit_grpo": "16x4, 2x2 of 32",
            "rlhfkit_grpo_trl_schedule": "8x8, 1x1 of 64", "trl_grpo": "8x8, 1x1 of 64"}


def median_phases(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# --------------------------------------------------------------------------- rlhfkit


def run_rlhfkit(kind: str, paths: dict, args) -> dict:
    from rlhfkit.config import ALGO_DEFAULTS, Config
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.utils import read_jsonl

    algo = "ppo" if kind == "rlhfkit_ppo" else "grpo"
    out = Path(args.out) / f"step_{kind}"
    shutil.rmtree(out, ignore_errors=True)  # a run appends to an existing metrics.jsonl: start clean
    ppo = {**ALGO_DEFAULTS[algo], "steps": args.warmup + args.steps, "stop_at": 0.0, "eval_every": 0,
           "critic_warmup_steps": 0}
    if algo == "ppo":  # TRL's PPOTrainer trains a value model of its own and has no KL loss term: the same arithmetic
        ppo.update(value_model="separate", forward_kl_coef=0.0)
    if kind == "rlhfkit_grpo_trl_schedule":
        ppo.update(group_size=8, ppo_epochs=1, minibatch_size=64, kl_coef=0.1)
    reward = {"name": paths["rm"]} if algo == "ppo" else {"function": "rlhfkit.tasks.doubling:exact_reward"}
    cfg = Config().replace(run={"out_dir": str(out), "seed": args.seed, "progress": False}, accel={"threads": 1},
                           ppo=ppo, reward=reward)
    train_rl(cfg, paths["base"])
    rows = read_jsonl(out / "metrics.jsonl")[args.warmup:]
    return [{"rollout": r["time/rollout_s"], "experience": r["time/experience_s"], "update": r["time/update_s"]}
            for r in rows]


# --------------------------------------------------------------------------- TRL


def run_trl_grpo(paths: dict, args) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from bench_common import clock_grpo_trainer, exact_reward_with_ids, trl_grpo_config
    from rlhfkit.models.forward import load_policy
    from rlhfkit.tasks import doubling

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(paths["base"])
    model = load_policy(paths["base"])
    steps = args.warmup + args.steps
    dataset = Dataset.from_dict({"prompt": [p.text for p in doubling.DoublingData(args.seed + 2).prompts(steps * 8)]})
    config = trl_grpo_config(str(Path(args.out) / "step_trl_grpo"), args.seed, steps)
    clock = PhaseClock()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_reward_with_ids(tok), args=config, train_dataset=dataset,
                          processing_class=tok)
    clock_grpo_trainer(trainer, clock)
    trainer.train()
    return clock.rows[args.warmup:]


def run_trl_ppo(paths: dict, args) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    from rlhfkit.models.forward import disable_dropout, freeze, load_policy, load_scalar_model
    from rlhfkit.tasks import doubling

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(paths["base"])
    policy = disable_dropout(load_policy(paths["base"]))
    ref = freeze(load_policy(paths["base"]))
    reward = freeze(load_scalar_model(paths["rm"]))
    value = disable_dropout(load_scalar_model(paths["rm"]))
    steps = args.warmup + args.steps
    texts = [p.text for p in doubling.DoublingData(args.seed + 2).prompts(steps * 64)]
    dataset = Dataset.from_dict({"input_ids": tok(texts)["input_ids"]})
    config = PPOConfig(output_dir=str(Path(args.out) / "step_trl_ppo"), learning_rate=3e-4,
                       lr_scheduler_type="constant", per_device_train_batch_size=64, gradient_accumulation_steps=1,
                       num_mini_batches=2, num_ppo_epochs=2, total_episodes=steps * 64, response_length=8,
                       stop_token="eos", temperature=1.0, kl_coef=0.2, kl_estimator="k1", whiten_rewards=False,
                       cliprange_value=1e6, vf_coef=0.5, local_rollout_forward_batch_size=64,
                       num_sample_generations=0, bf16=False, use_cpu=True, seed=args.seed, logging_steps=10,
                       report_to="none", save_strategy="no", disable_tqdm=True, log_level="error")
    clock = PhaseClock()
    generation, forward = mod.batch_generation, mod.forward

    def timed_generation(*a, **kw):
        clock.start()
        out = generation(*a, **kw)
        clock.mark("rollout")
        return out

    def timed_forward(model, *a, **kw):
        if isinstance(model, mod.PolicyAndValueWrapper):  # the first update forward ends "experience"
            clock.mark("experience")
        return forward(model, *a, **kw)

    class Clock(TrainerCallback):
        def on_step_end(self, a, s, control, **kw):
            clock.end("update")

    mod.batch_generation, mod.forward = timed_generation, timed_forward
    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset, callbacks=[Clock()])
    trainer.train()
    return clock.rows[args.warmup:]


# --------------------------------------------------------------------------- driver


def worker(args) -> None:
    paths = worker_setup(args)
    runs = {"trl_grpo": run_trl_grpo, "trl_ppo": run_trl_ppo}
    steps = runs[args.worker](paths, args) if args.worker in runs else run_rlhfkit(args.worker, paths, args)
    phases = median_phases(steps)
    phases["total"] = phases["rollout"] + phases["experience"] + phases["update"]
    times = [s["rollout"] + s["experience"] + s["update"] for s in steps]  # every measured step
    # this process's libraries: TRL's PPOTrainer runs under another Python
    print(RESULT + json.dumps({"phases": phases, "times_s": times, "peak_rss_mib": peak_rss_mib(),
                               "versions": versions()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", nargs="+", default=["ppo", "grpo"], choices=list(ROWS))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="'cpu' times CPU seconds of each contender's process (for a machine shared with other jobs)")
    ap.add_argument("--trl112-python", default=".venv-trl112/bin/python",
                    help="a Python with trl==1.12.* and rlhfkit installed, for TRL's PPOTrainer")
    ap.add_argument("--worker", choices=[r for rows in ROWS.values() for r in rows], help=argparse.SUPPRESS)
    add_record_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    quiet_hf()
    prepare(args.out)
    results = {}
    for algo in args.algo:
        for kind in ROWS[algo]:
            python = sys.executable
            if kind == "trl_ppo":
                python = args.trl112_python
                if not Path(python).exists():
                    print(f"skipping TRL PPOTrainer: {python} not found (python -m venv .venv-trl112 && "
                          ".venv-trl112/bin/pip install torch==2.13.0 'trl==1.12.*' -e .)")
                    continue
            elif kind == "trl_grpo":
                try:
                    import trl  # noqa: F401
                except ImportError:
                    print("skipping TRL GRPOTrainer: TRL is not installed (pip install -e .[bench])")
                    continue
            cmd = pinned_cmd(args.core, __file__, "--worker", kind, "--steps", str(args.steps), "--warmup",
                             str(args.warmup), "--seed", str(args.seed), "--core", str(args.core), "--out", args.out,
                             "--clock", args.clock)
            cmd[cmd.index(sys.executable)] = python
            env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
            at = code_version()  # the code the worker imports now
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            if proc.returncode or not lines:
                print(f"{NAMES[kind]} failed (exit {proc.returncode}); skipped:\n{proc.stderr[-3000:]}")
                continue
            results[kind] = res = json.loads(lines[-1][len(RESULT):])
            settings = {"algo": algo, "schedule": SCHEDULE[kind], "steps": args.steps, "warmup": args.warmup,
                        "clock": args.clock, "completions": 64, "max_new_tokens": 8}
            record("ppo_step", {"contender": kind, "settings": settings, "seeds": [args.seed], "times_s": res["times_s"],
                                "phase_median_s": res["phases"], "peak_mib": res["peak_rss_mib"],
                                "versions": res["versions"], "threads": 1}, args, at=at)
            print(f"  {NAMES[kind]}: {results[kind]['phases']['total'] * 1e3:.1f} ms/step", flush=True)
    unit = "CPU milliseconds" if args.clock == "cpu" else "milliseconds"
    print(f"\nOne RL step of 64 completions (<= 8 tokens), tiny doubling GPT-2, one core (taskset -c {args.core}), "
          f"1 torch thread; median of {args.steps} steps after {args.warmup} warm-up; {unit}")
    print(f"{'contender':<32}{'updates':>16}{'rollout':>9}{'experience':>12}{'update':>8}{'total':>8}"
          f"{'peak RSS':>11}")
    for kind, r in results.items():
        p = {k: v * 1e3 for k, v in r["phases"].items()}
        print(f"{NAMES[kind]:<32}{SCHEDULE[kind]:>16}{p['rollout']:>9.1f}{p['experience']:>12.1f}{p['update']:>8.1f}"
              f"{p['total']:>8.1f}{r['peak_rss_mib']:>8.0f} MiB")
    for ours, theirs in (("rlhfkit_ppo", "trl_ppo"), ("rlhfkit_grpo", "trl_grpo"),
                         ("rlhfkit_grpo_trl_schedule", "trl_grpo")):
        if ours in results and theirs in results:
            ratio = results[ours]["phases"]["total"] / results[theirs]["phases"]["total"]
            print(f"{NAMES[ours]} / {NAMES[theirs]} step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
