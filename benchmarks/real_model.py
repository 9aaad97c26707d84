"""The real chat model against TRL: rlhfkit GRPO and PPO with their defaults, TRL's GRPOTrainer on
its own defaults and on rlhfkit's GRPO schedule, on SmolLM2-135M-Instruct with LoRA.

Task (``examples/real_model``): "In which country is the city of Jaipur? Answer with the
country's name only.", 98 training and 32 held-out cities (``make_data.py``), three rewards
weighted 1, 1, 1 (``rewards.py``: ``exact``, the 0/1 verifier; ``contains``, the country
appears; ``brevity``, 1 / words), 16 completions of at most 16 tokens per step, LoRA r 16
(alpha 16, dropout 0, every linear layer but the head: rlhfkit's defaults, and the same
``peft.LoraConfig`` for TRL), float32, no gradient checkpointing. The model is
``rlhfkit fetch-model smollm2-135m-instruct`` (cached).

Contenders (one step = one rollout of 16 completions for all of them):

    rlhfkit_grpo   ``rlhfkit grpo`` defaults for a LoRA policy: groups of 4, scores divided by
                   the batch's std, no KL term (beta 0: config.LORA_DEFAULTS), 2 epochs of one
                   minibatch of 16 (the default minibatch of 32 holds the whole batch), Adam
                   3e-4 constant, token mean
    rlhfkit_ppo    ``rlhfkit ppo`` defaults: 16 prompts, one sample each, a value head on the
                   policy (trained at 3e-3; ``--override ppo.value_model=separate``: a critic
                   model of its own, started from the policy and fully trained), 3 critic
                   warm-up steps, running score normalisation, k1 KL 0.2 in the reward, GAE,
                   2 epochs of one minibatch of 16
    trl_defaults   TRL 1.16 GRPOTrainer, GRPOConfig defaults: groups of 8 (2 prompts a step),
                   each group's std, beta 0 (no reference model), loss 'dapo', one iteration
                   per generation, linear learning-rate decay to 0 over --steps; besides the
                   task's sizes above (per_device_train_batch_size 16: one optimizer step per
                   rollout), float32 and no checkpointing (its defaults are bf16 and
                   checkpointing), the learning rate is rlhfkit's 3e-4 (--trl-lr; TRL's 1e-6
                   is meant for full fine-tuning of billion-parameter models)
    trl_schedule   TRL GRPOTrainer on rlhfkit_grpo's schedule: num_generations 4,
                   scale_rewards 'batch', beta 0 (rlhfkit's default for a LoRA policy; when
                   set, k3 in the loss as rlhfkit computes it: use_bias_correction_kl off),
                   num_iterations 2, one optimizer step per minibatch of 16 (per-device batch =
                   minibatch, steps_per_generation = batch / minibatch), loss 'bnpo' (a token
                   mean over the optimizer step's rows without gradient accumulation: rlhfkit's
                   token_mean), Adam 3e-4 constant

What then still differs in the arithmetic (printed after the table too): the samplers (rlhfkit's
own KV-cache decoder; TRL's ``model.generate``) draw from the same distribution but not the same
samples; rlhfkit clips scores at +-5 (the rewards here lie in [0, 3]: no effect); rlhfkit's old
log-probs are the sampler's own, TRL's a separate forward (equal to ~1e-6); TRL shuffles its
prompts with its own generator; rlhfkit clips the gradient norm of the policy (and of a critic
separately), TRL of every trained weight (the same with no critic).

Measured per run: steps (rollouts) until the held-out greedy exact (``eval/accuracy``: the share
of the 32 held-out cities answered with the country's name alone), evaluated every
--eval-every steps, reaches --target; seconds per step for each phase (rollout, experience,
update; the mean over the steps run, evaluation excluded: rlhfkit's own ``time/*_s``, TRL timed
from the outside: rollout = ``_generate``, experience = the rest of
``_generate_and_score_completions``, update = the rest of each optimizer step); training
seconds to the target; the process's peak resident set; held-out exact / contains / brevity at
the last evaluation. Every contender is evaluated by the same function
(``rlhfkit.rollout.evaluate.evaluate_rewards``: greedy, 16 new tokens, the same reward functions).

Each (contender, seed) runs in its own process pinned to --core (``taskset``) with one torch
thread, one after another, the contenders' order reversed on every other seed so that none
always runs first. A full run (4 contenders x 3 seeds x up to 60 steps) takes hours on one
core; ``--steps 2 --seeds 0 --eval-every 1`` checks that every contender runs.

    python benchmarks/real_model.py                                  # 3 seeds, all contenders
    python benchmarks/real_model.py --contenders rlhfkit_grpo trl_schedule --seeds 0 1 2 3
    python benchmarks/real_model.py --contenders rlhfkit_ppo --override ppo.kl_coef=0   # a variant, kept apart
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    add_record_args,
    code_version,
    pin_to_core,
    pinned_cmd,
    quiet_hf,
    record,
    results_path,
    stored_results,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "real_model"
MODEL = "smollm2-135m-instruct"
RESULT = "RESULT "
DEFAULT_OUT = "runs/bench_real_model"
BATCH, NEW_TOKENS, LORA_R = 16, 16, 16
REWARDS = ("exact", "contains", "brevity")
PHASES = ("rollout", "experience", "update")


@dataclass(frozen=True)
class TaskRewards:
    """A task's reward functions (names in the Python file ``file``, the 0/1 verifier first:
    it is the held-out target), their weights and the completion length."""

    file: Path
    names: tuple[str, ...]
    weights: tuple[float, ...]
    new_tokens: int = NEW_TOKENS

    def spec(self) -> str:
        return ",".join(f"{self.file}:{name}" for name in self.names)

    def functions(self) -> list:
        """The callables, loaded as ``reward.function`` loads them."""
        from rlhfkit.rollout.rewards import load_reward_function

        return [load_reward_function(f"{self.file}:{name}") for name in self.names]


CITIES = TaskRewards(EXAMPLE / "rewards.py", REWARDS, (1.0, 1.0, 1.0))
CONTENDERS = {
    "rlhfkit_grpo": "rlhfkit GRPO",
    "rlhfkit_ppo": "rlhfkit PPO",
    "trl_defaults": "TRL, its defaults",
    "trl_schedule": "TRL, rlhfkit's schedule",
}


# --------------------------------------------------------------------------- settings


def rlhfkit_config(algo: str, paths: dict, out: Path, seed: int, args, task: TaskRewards = CITIES):
    """``rlhfkit <algo>``'s defaults on the task: only the task's sizes, the files, LoRA r 16 and
    the benchmark's bookkeeping (evaluation, stopping, one thread, no samples) are set; the
    algorithm's keys come from its defaults for a LoRA policy (config.LORA_DEFAULTS), then
    ``--override`` (a variant of the defaults, stored and reported apart from them)."""
    from rlhfkit.config import Config, load_config

    cfg = Config().replace(
        run={"out_dir": str(out), "seed": seed, "progress": False, "overwrite": True, "tensorboard": False},
        accel={"threads": 1},
        model={"name": paths["model"], "lora_r": LORA_R},
        data={"path": paths["train"], "eval_path": paths["held"]},
        reward={"function": task.spec(), "weights": ",".join(f"{w:g}" for w in task.weights)},
        ppo={"algo": algo, "batch_size": BATCH, "max_new_tokens": task.new_tokens, "steps": args.steps,
             "eval_every": args.eval_every, "stop_at": args.target, "stop_metric": "eval/accuracy",
             "samples_per_log": 0, "trajectories_every": 0},
    )
    return load_config(None, args.override, base=cfg) if args.override else cfg


def trl_settings(kind: str, args, task: TaskRewards = CITIES) -> dict:
    """GRPOConfig keyword arguments of a TRL contender (see the module docstring)."""
    from rlhfkit.config import Config, regime_value

    common = {"max_completion_length": task.new_tokens, "bf16": False, "gradient_checkpointing": False, "use_cpu": True,
              "gradient_accumulation_steps": 1}
    if kind == "trl_defaults":
        return {**common, "per_device_train_batch_size": BATCH, "learning_rate": args.trl_lr}
    cfg = rlhfkit_config("grpo", {"model": "", "train": "", "held": ""}, Path("."), 0, args)
    pc, lr = cfg.ppo, regime_value(cfg, "ppo.lr", "lora")  # the real chat model through LoRA
    minibatch = min(pc.minibatch_size, pc.batch_size)
    assert pc.algo == "grpo" and pc.kl_in_loss and pc.kl_estimator == "k3" and pc.loss_type == "token_mean"
    assert Config().model.lora_alpha == 16.0 and not pc.top_k and pc.top_p == 1.0
    return {**common, "num_generations": pc.group_size, "per_device_train_batch_size": minibatch,
            "steps_per_generation": pc.batch_size // minibatch, "num_iterations": pc.ppo_epochs,
            "learning_rate": lr, "lr_scheduler_type": pc.lr_schedule, "beta": pc.kl_coef,
            "scale_rewards": pc.scale_rewards, "loss_type": "bnpo", "epsilon": pc.clip_range,
            "use_bias_correction_kl": False,  # TRL's default weights k3 by the ratio (rlhfkit's k2 gradient)
            "temperature": pc.temperature, "max_grad_norm": pc.max_grad_norm}


# --------------------------------------------------------------------------- rlhfkit


def variant_suffix(args) -> str:
    """A run directory's suffix for --override runs (none for the defaults)."""
    return "_" + "_".join(o.replace(".", "-").replace("=", "-") for o in args.override) if args.override else ""


def run_rlhfkit(algo: str, paths: dict, args) -> dict:
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.utils import read_jsonl

    out = Path(args.out) / (f"rlhfkit_{algo}_{args.seed}" + variant_suffix(args))
    cfg = rlhfkit_config(algo, paths, out, args.seed, args)
    res = train_rl(cfg)
    rows = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    reached = res["reached"]
    return {"steps": reached["steps"] if reached else len(rows), "reached": reached is not None,
            "train_s": reached["train_s"] if reached else res["seconds"],
            "phase_s": {k: statistics.mean(r[f"time/{k}_s"] for r in rows) for k in PHASES},
            "base": {k: rows[0][f"baseline/eval/reward/{k}"] for k in REWARDS},
            "last": {k: evals[-1][f"eval/reward/{k}"] for k in REWARDS} if evals else {}}


# --------------------------------------------------------------------------- TRL


def held_out_evaluator(paths: dict, args, task: TaskRewards = CITIES):
    """rlhfkit's own held-out evaluation (the function its RL loop calls), for a TRL model."""
    from rlhfkit.data.prompts import prompt_data
    from rlhfkit.models.forward import load_tokenizer
    from rlhfkit.rollout.evaluate import evaluate_rewards
    from rlhfkit.rollout.rewards import build_reward

    cfg = rlhfkit_config("grpo", paths, Path(args.out) / "unused", args.seed, args, task)
    tok = load_tokenizer(paths["model"])
    records = prompt_data(cfg, tok, None).eval_records
    reward = build_reward(cfg, tok, torch.device("cpu"))

    def evaluate(model) -> dict[str, float]:
        was_training = model.training
        model.eval()
        ev = evaluate_rewards(model, tok, records, reward, torch.device("cpu"), batch_size=cfg.eval.batch_size,
                              max_new_tokens=task.new_tokens)
        model.train(was_training)
        return {k: ev[f"eval/reward/{k}"] for k in task.names}

    return evaluate


def run_trl(kind: str, paths: dict, args, task: TaskRewards = CITIES) -> dict:
    """One TRL run to the held-out target (``task``'s verifier at ``args.target``); its
    evaluations are returned too (``evals``: the step and each reward's held-out mean)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.config import Config
    from rlhfkit.utils import read_jsonl

    torch.manual_seed(args.seed)
    settings = trl_settings(kind, args, task)
    per_rollout = settings.get("steps_per_generation", 1) * settings.get("num_iterations", 1)  # optimizer steps
    config = GRPOConfig(output_dir=str(Path(args.out) / f"{kind}_{args.seed}"), max_steps=args.steps * per_rollout,
                        seed=args.seed, logging_steps=10**6, log_level="error", report_to="none",
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **settings)
    mc = Config().model
    lora = LoraConfig(r=LORA_R, lora_alpha=mc.lora_alpha, lora_dropout=mc.lora_dropout,
                      target_modules=mc.lora_target_modules, task_type="CAUSAL_LM")
    tok = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    evaluate = held_out_evaluator(paths, args, task)
    base = evaluate(model)
    state = {"rollout": 0.0, "experience": 0.0, "update": 0.0, "rollouts": 0, "t0": 0.0, "inner0": 0.0,
             "reached": None, "last": {}, "evals": [{"step": 0, **base}]}

    def timed(fn, phase):
        def wrapper(*a, **kw):
            t, inner = time.perf_counter(), state["rollout"]
            out = fn(*a, **kw)
            state[phase] += time.perf_counter() - t - (state["rollout"] - inner if phase == "experience" else 0.0)
            state["rollouts"] += phase == "experience"
            return out
        return wrapper

    class TimeAndEvaluate(TrainerCallback):
        def on_step_begin(self, a, s, control, **kw):
            state["t0"], state["inner0"] = time.perf_counter(), state["rollout"] + state["experience"]

        def on_step_end(self, a, s, control, **kw):
            step_s = time.perf_counter() - state["t0"]
            state["update"] += step_s - (state["rollout"] + state["experience"] - state["inner0"])
            done = s.global_step // per_rollout  # rollouts whose every optimizer step has run
            if s.global_step % per_rollout == 0 and (done % args.eval_every == 0 or done == args.steps):
                state["last"] = evaluate(kw["model"])  # not timed
                state["evals"].append({"step": done, **state["last"]})
                print(f"{kind} seed {args.seed} step {done}: {state['last']}", file=sys.stderr, flush=True)
                if state["last"][task.names[0]] >= args.target:
                    state["reached"] = done
                    control.should_training_stop = True
            return control

    dataset = Dataset.from_list(read_jsonl(paths["train"]))
    trainer = GRPOTrainer(model=model, reward_funcs=task.functions(), args=config, train_dataset=dataset,
                          processing_class=tok, peft_config=lora, callbacks=[TimeAndEvaluate()])
    trainer._generate = timed(trainer._generate, "rollout")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "experience")
    trainer.train()
    n = max(1, state["rollouts"])
    train_s = state["rollout"] + state["experience"] + state["update"]
    return {"steps": state["reached"] or state["rollouts"], "reached": state["reached"] is not None,
            "train_s": train_s, "phase_s": {k: state[k] / n for k in PHASES}, "base": base, "last": state["last"],
            "evals": state["evals"]}


# --------------------------------------------------------------------------- driver


def prepare(out: Path) -> dict[str, str]:
    """The fetched model and the task's files (cached)."""
    from rlhfkit.cli.fetch import fetch_model

    sys.path.insert(0, str(EXAMPLE))
    import make_data

    data = out / "data"
    if not (data / "held.jsonl").exists():
        make_data.main(data)
    return {"model": fetch_model(MODEL)["dir"], "train": str(data / "prompts.jsonl"), "held": str(data / "held.jsonl")}


def worker(args) -> None:
    pin_to_core(args.core)
    quiet_hf()
    paths = json.loads(args.paths)
    if args.worker.startswith("trl"):
        res = run_trl(args.worker, paths, args)
    else:
        res = run_rlhfkit(args.worker.removeprefix("rlhfkit_"), paths, args)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(RESULT + json.dumps(res), flush=True)


def run_one(contender: str, seed: int, paths: dict, args) -> dict:
    cmd = pinned_cmd(args.core, __file__, "--worker", contender, "--seed", str(seed), "--core", str(args.core),
                     "--out", args.out, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
                     "--target", str(args.target), "--trl-lr", str(args.trl_lr), "--paths", json.dumps(paths),
                     "--override", *args.override)
    env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
    at = code_version()  # the code the worker imports now
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"{contender} seed {seed} failed (exit {proc.returncode})")
    res = {**json.loads(lines[-1][len(RESULT):]), "seed": seed, "core": args.core}
    record("real_model", {"contender": contender, "steps_max": args.steps, "target": args.target,
                          "eval_every": args.eval_every, **({"overrides": args.override} if args.override else {}),
                          "seeds": [seed], "times_s": [res["train_s"]], "peak_mib": res["peak_rss_mib"], "threads": 1,
                          **res}, args, at=at)  # every run kept: --report merges runs made apart
    ph = res["phase_s"]
    held = "/".join(f"{res['last'][k]:.2f}" for k in REWARDS) if res["last"] else "-"
    print(f"  {CONTENDERS[contender]:<24} seed {seed}: {res['steps']:>3} steps{'' if res['reached'] else '*'} "
          f"{sum(ph.values()):6.1f} s/step (rollout {ph['rollout']:.1f}, experience {ph['experience']:.1f}, "
          f"update {ph['update']:.1f}), peak {res['peak_rss_mib']:.0f} MiB, held-out exact/contains/brevity {held} "
          f"({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return res


def stored_runs(args, contenders) -> dict[str, list[dict]]:
    """The runs in --out's results.jsonl made with this --steps/--target/--eval-every (the last one of
    each contender and seed), for contenders and seeds run apart, e.g. one seed per core."""
    found: dict[tuple[str, int], dict] = {}
    for row in stored_results(results_path("real_model", args), {"steps_max": args.steps, "target": args.target, "eval_every": args.eval_every}):
        if row.get("overrides", []) == args.override:  # the defaults and each variant apart
            found[row["contender"], row["seed"]] = row
    results = {c: [found[c, s] for s in args.seeds if (c, s) in found] for c in contenders}
    missing = [f"{c} seed {s}" for c in contenders for s in args.seeds if (c, s) not in found]
    if missing:
        print(f"not in {results_path('real_model', args)}: {', '.join(missing)}")
    return {c: rows for c, rows in results.items() if rows}


def settings_table(args, contenders) -> None:
    """What each contender computes, side by side: the arithmetic that differs."""
    from rlhfkit.config import regime_value

    def ours(algo):
        cfg = rlhfkit_config(algo, {"model": "", "train": "", "held": ""}, Path("."), 0, args)  # as the runs
        pc = cfg.ppo
        mb = min(pc.minibatch_size, pc.batch_size)
        kl = f"{pc.kl_estimator} {pc.kl_coef:g} in the {'loss' if pc.kl_in_loss else 'reward'}" if pc.kl_coef else "none (beta 0)"
        if pc.forward_kl_coef:
            kl += f", k3 {pc.forward_kl_coef:g} in the loss"
        group = f"{pc.group_size}" if algo == "grpo" else "1 (critic, GAE)"
        scale = pc.scale_rewards if algo == "grpo" else "running normalisation"
        rates = {key: regime_value(cfg, key, "lora") for key in ("ppo.lr", "ppo.value_lr")}  # LoRA on the real model
        lr = f"{rates['ppo.lr']:g} {pc.lr_schedule}" + (f" (critic {rates['ppo.value_lr']:g})" if algo == "ppo" else "")
        return [group, f"{pc.ppo_epochs} x {BATCH // mb}", lr, kl, scale, pc.loss_type]

    def trl(kind):
        s = {"num_generations": 8, "num_iterations": 1, "steps_per_generation": 1, "beta": 0.0,
             "scale_rewards": "group", "loss_type": "dapo", "lr_scheduler_type": "linear", **trl_settings(kind, args)}
        kl = f"k3 {s['beta']:g} in the loss" if s["beta"] else "none (beta 0)"
        return [str(s["num_generations"]), f"{s['num_iterations']} x {s['steps_per_generation']}",
                f"{s['learning_rate']:g} {s['lr_scheduler_type']}", kl, s["scale_rewards"], s["loss_type"]]

    make = {"rlhfkit_grpo": lambda: ours("grpo"), "rlhfkit_ppo": lambda: ours("ppo"),
            "trl_defaults": lambda: trl("trl_defaults"), "trl_schedule": lambda: trl("trl_schedule")}
    rows = {kind: make[kind]() for kind in contenders}
    head = ["completions/prompt", "epochs x opt. steps", "lr", "KL", "score scaling", "loss reduction"]
    width = [max(w, 2 + max(len(r[i]) for r in rows.values())) for i, w in enumerate([20, 21, 32, 22, 23, 15])]
    print("\nSettings (16 completions per step for all; LoRA r 16 alpha 16; float32):")
    print(f"{'contender':<26}" + "".join(f"{h:<{w}}" for h, w in zip(head, width)))
    for kind, cells in rows.items():
        print(f"{CONTENDERS[kind]:<26}" + "".join(f"{c:<{w}}" for c, w in zip(cells, width)))
    print("Also differs: the samplers (rlhfkit's decoder, TRL's model.generate: same distribution, other draws); "
          "rlhfkit clips scores at +-5 (none reached here); rlhfkit's old log-probs are the sampler's (TRL: a "
          "second forward, equal to ~1e-6); the prompt order; PPO's critic, warm-up and GAE have no TRL "
          "counterpart (TRL 1.16 has no PPOTrainer).")


def report(results: dict[str, list[dict]], args) -> None:
    cores = ",".join(sorted({str(r.get("core", args.core)) for rows in results.values() for r in rows}))
    print(f"\nSmolLM2-135M-Instruct + LoRA r 16, city-country task, {BATCH} completions of <= {NEW_TOKENS} tokens "
          f"per step; steps to held-out greedy exact >= {args.target} (32 cities, evaluated every {args.eval_every} "
          f"steps, at most {args.steps}); one core each (taskset -c {cores}), 1 torch thread; torch "
          f"{torch.__version__}")
    seeds = "".join(f"{'seed ' + str(s):>9}" for s in args.seeds)
    print(f"{'contender':<26}{seeds}{'median':>8}{'rollout':>9}{'exper.':>8}{'update':>8}{'s/step':>8}"
          f"{'s to target':>13}{'peak MiB':>10}   held-out exact/contains/brevity (last eval, mean)")
    for c, rows in results.items():
        by_seed = {r["seed"]: r for r in rows}
        cells = "".join(f"{str(by_seed[s]['steps']) + ('' if by_seed[s]['reached'] else '*') if s in by_seed else '-':>9}"
                        for s in args.seeds)
        ph = {k: statistics.mean(r["phase_s"][k] for r in rows) for k in PHASES}
        to_target = [r["train_s"] for r in rows if r["reached"]]
        t = f"{statistics.median(to_target):.0f}" if len(to_target) == len(rows) else "-"
        last = [r["last"] for r in rows if r["last"]]
        held = "/".join(f"{statistics.mean(x[k] for x in last):.2f}" for k in REWARDS) if last else "-"
        print(f"{CONTENDERS[c]:<26}{cells}{statistics.median(r['steps'] for r in rows):>8g}"
              f"{ph['rollout']:>9.1f}{ph['experience']:>8.1f}{ph['update']:>8.1f}{sum(ph.values()):>8.1f}"
              f"{t:>13}{max(r['peak_rss_mib'] for r in rows):>10.0f}   {held}")
    bases = {"/".join(f"{r['base'][k]:.3f}" for k in REWARDS) for rows in results.values() for r in rows}
    if bases:  # greedy and one evaluation function: every run should see the same base model
        print(f"base model, held-out exact/contains/brevity: {', '.join(sorted(bases))}"
              f"{'' if len(bases) == 1 else ' (runs disagree: the evaluations are not the same)'}")
    print(f"* not at the target after {args.steps} steps; s/step: the mean over every step run, evaluation "
          "excluded; s to target: the median training seconds, when every seed got there")
    settings_table(args, list(results))
    if args.override:
        print(f"rlhfkit runs with: {' '.join(args.override)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--core", type=int, default=0, help="CPU core every run is pinned to")
    ap.add_argument("--steps", "--max-steps", type=int, default=60, help="most steps (rollouts) per run")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.5, help="held-out greedy exact that ends a run")
    ap.add_argument("--trl-lr", type=float, default=3e-4, help="learning rate of the trl_defaults contender")
    ap.add_argument("--override", nargs="*", default=[],
                    help="dotted rlhfkit keys (ppo.kl_coef=0) for the rlhfkit contenders: a variant, stored and "
                         "reported apart from the defaults")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: print the table from the runs stored in --out/results.jsonl (with --record: "
                         "from the record)")
    add_record_args(ap)
    ap.add_argument("--worker", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    contenders = list(args.contenders)
    if args.override and any(c.startswith("trl") for c in contenders):
        sys.exit("--override applies to the rlhfkit contenders only: leave the trl_* contenders out")
    if args.report:
        return report(stored_runs(args, contenders), args)
    if any(c.startswith("trl") for c in contenders):
        try:
            import trl
        except ImportError:
            sys.exit("TRL is not installed: pip install -e .[bench] (or leave the trl_* contenders out)")
        if not trl.__version__.startswith("1.16"):
            print(f"note: TRL {trl.__version__} found; the benchmark was written against 1.16")
    quiet_hf()
    paths = prepare(Path(args.out))
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for i, seed in enumerate(args.seeds):
        for c in contenders if i % 2 == 0 else contenders[::-1]:  # nobody always runs first
            results[c].append(run_one(c, seed, paths, args))
    report(results, args)


if __name__ == "__main__":
    main()
