"""Time to accuracy on the doubling task: rlhfkit PPO and GRPO vs TRL's GRPOTrainer.

Every contender starts from the same pretrained doubling base, optimises the same reward and
stops once greedy exact accuracy on the 512 held-out prompts reaches the target (0.99),
checked every ``--eval-every`` rollouts. Each (contender, seed) runs in its own process
pinned to the same core (``taskset -c CORE``) with one torch thread, contenders interleaved
seed by seed so that they share the machine's conditions.

Time counts training only -- rollout + experience + update -- for every contender; the
periodic evaluation is excluded for all of them. rlhfkit measures the three phases itself
(``time/train_s``); for TRL a callback sums ``on_step_begin`` -> ``on_step_end`` of the
HF Trainer (generation, scoring, loss, backward and optimizer step; the dataloader fetch
and logging fall outside, to TRL's favour), and runs the same greedy evaluation
(``rlhfkit.rollout.evaluate.evaluate_task``) outside the timed span. A step is one rollout of
64 completions for everyone; TRL takes ``steps_per_generation x num_iterations`` optimizer
steps per rollout, and is evaluated once all of them have run. The table gives rollouts to
the target and seconds per rollout apart, median and min-max over the seeds: the first is
what the configuration buys, the second what a rollout's work costs (the implementation, and
arithmetic one library skips: docs/benchmarks.md).

Contenders (rlhfkit's from a small sweep on seeds 10-12, never on the reported seeds 0-2;
steps to 0.99 with the exact reward):

    rlhfkit_grpo  ``rlhfkit grpo`` defaults (config.ALGO_DEFAULTS): 16 prompts x 4 samples,
                  2 epochs x 2 minibatches of 32, Adam 3e-4, k3 KL in the loss (beta 0.3 since
                  commit f7bea22, chosen across three rewards by robustness.py; 0.05 before,
                  with each group's std dividing the scores), scores divided by the batch's
                  std, token-mean loss. (Groups of 8: 150-190 steps, of 4: 90-100; lr 5e-4 or
                  1e-3, KL 0 or 0.1, one epoch: all slower.)
    rlhfkit_ppo   ``rlhfkit ppo`` defaults (64 prompts, 2 x 2 minibatches of 32, KL 0.2 in the
                  reward, GAE, running score normalisation, a value head on the actor) with,
                  for the reward *function*, Adam at 6e-4: 75-95 steps and 35% less time per
                  step than a separate critic started from the policy (65-110 steps at 3e-4).
    trl_grpo      TRL 1.16's GRPOTrainer on GRPOConfig's defaults adapted to the task: 8 prompts
                  x 8 samples (``num_generations=8``), one optimizer step per rollout of 64
                  (``per_device_train_batch_size=64``, ``num_iterations=1``), loss 'dapo', each
                  group's std dividing the scores, ``max_completion_length=8``, float32, no
                  gradient checkpointing, constant learning rate 5e-4 (the default 1e-6 is for
                  billion-parameter models) and KL weight ``beta=0.1`` (k3 in the loss times
                  the importance ratio, ``use_bias_correction_kl``'s default), both from a
                  sweep (``bench_common.trl_grpo_config``). Earlier points, all with beta 0: lr
                  2e-4 (not at 0.99 after 400 steps), 3e-4 (295-365 steps), 5e-4 (250 steps on
                  one seed, not reached in 400 on the other), 7e-4 and 1e-3 (not reached);
                  ``num_generations=4``: no better (245-380).
    trl_schedule  GRPOTrainer on rlhfkit GRPO's schedule, read from ``rlhfkit grpo``'s resolved
                  config (:func:`trl_on_rlhfkit_schedule`): groups of 4, 2 optimizer steps of 32
                  rows per rollout (``steps_per_generation=2``), 2 passes (``num_iterations=2``),
                  lr 3e-4 constant, ``beta=0.3`` with k3 in the loss as rlhfkit computes it
                  (``use_bias_correction_kl=False``), ``scale_rewards='batch'``, loss 'bnpo'
                  (the token mean of one optimizer step's rows: rlhfkit's token_mean), epsilon
                  0.2, gradient clip 1, temperature 1. Left different: TRL shuffles the rollout's
                  rows once and keeps the two minibatches for both passes, rlhfkit draws new
                  minibatches of whole groups each epoch; rlhfkit clips scores to +-5 (no
                  effect on the 0/1 verifier); the sampling's random numbers.
    grpo_trl_schedule
                  rlhfkit GRPO on trl_grpo's configuration, read from ``trl_grpo_config``
                  (:func:`grpo_on_trl_schedule`; ``--trl-lr``, ``--trl-beta`` and
                  ``--trl-num-generations`` move both): 8 x 8, one minibatch of 64 and one epoch,
                  lr 5e-4, beta 0.1, each group's std, token mean. TRL's ratio-weighted k3 has, at
                  ratio 1 (one optimizer step per rollout), the reverse KL's gradient
                  ``beta * (log pi - log ref)`` per token: rlhfkit's k2 loss term, which this
                  contender uses.

``--trl-override KEY=VALUE ...`` sets further GRPOConfig keys of both TRL contenders (a sweep:
``num_generations=8``, ``num_iterations=1``, ``beta=0``, ``use_bias_correction_kl=true``, ...);
``--grpo-override`` / ``--ppo-override`` take rlhfkit's dotted keys (``ppo.kl_estimator=k2``).

Reward (``--reward``):
    exact       (default) the task's exact-match verifier, a Python callable: 1 if the answer is
                right and in the requested character set, else 0. TRL strips special tokens
                from the completions it passes, so its copy re-decodes ``completion_ids`` with
                EOS kept; the verifier then sees the same text as rlhfkit's.
    classifier  the doubling tutorial's label classifier (cached under --out): the logit of the character
                set the prompt asks for, at the last token of prompt + completion. rlhfkit uses
                its built-in classifier scorer, TRL the callable ``bench_common.ClassifierReward``;
                the script checks that both give the same numbers before it starts. It checks
                the character set, not the digits: only the KL term keeps the doubling right,
                and a weak one lets the policy game it (TRL GRPO at beta 0.1 stayed below 0.5
                exact for 300 rollouts; benchmarks/archive/SUMMARY.md, typed by hand).

``--clock cpu`` replaces wall seconds by each process's CPU seconds (for all contenders alike),
which other jobs on a shared machine disturb much less.

Needs TRL (``pip install -e .[bench]``); without it the TRL contenders are skipped with a note.

    python benchmarks/time_to_accuracy.py --clock cpu          # 3 seeds, all contenders
    python benchmarks/time_to_accuracy.py --seeds 0 --max-steps 5 --eval-every 5   # does each run?
    python benchmarks/time_to_accuracy.py --seeds 0 --contenders trl_grpo --trl-lr 1e-3
    python benchmarks/time_to_accuracy.py --seeds 10 11 --contenders trl_schedule --trl-override beta=0

``--record`` appends every (contender, seed) to ``benchmarks/results/time_to_accuracy.jsonl``;
``benchmarks/render.py`` renders the table of the docs from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    DEFAULT_OUT,
    TRL_GRPO_BETA,
    TRL_GRPO_LR,
    ClassifierReward,
    add_record_args,
    code_version,
    exact_reward_with_ids,
    peak_rss_mib,
    pinned_cmd,
    prepare,
    quiet_hf,
    record,
    trl_grpo_config,
    worker_setup,
)

CONTENDERS = {
    "rlhfkit_ppo": "rlhfkit PPO",
    "rlhfkit_grpo": "rlhfkit GRPO",
    "trl_grpo": "TRL GRPO",
    "trl_schedule": "TRL, rlhfkit's sched",
    "grpo_trl_schedule": "rlhfkit, TRL's sched",
}
TRL_CONTENDERS = ("trl_grpo", "trl_schedule")
RESULT = "RESULT "
# the settings each contender prints under the table
SHOWN_RLHFKIT = ("group_size", "batch_size", "minibatch_size", "ppo_epochs", "lr", "lr_schedule", "kl_coef",
                 "kl_estimator", "kl_in_loss", "forward_kl_coef", "scale_rewards", "normalize_reward", "loss_type", "clip_range",
                 "score_clip", "max_grad_norm", "temperature", "value_model")
SHOWN_TRL = ("num_generations", "generation_batch_size", "per_device_train_batch_size", "steps_per_generation",
             "num_iterations", "learning_rate", "lr_scheduler_type", "beta", "use_bias_correction_kl",
             "scale_rewards", "loss_type", "epsilon", "max_grad_norm", "temperature")


# --------------------------------------------------------------------------- rlhfkit


def grpo_on_trl_schedule(args) -> dict:
    """rlhfkit GRPO's ``ppo`` keys for TRL GRPO's configuration (``bench_common.trl_grpo_config``
    with this run's ``--trl-lr``, ``--trl-beta``, ``--trl-num-generations``): its groups, one
    optimizer step per rollout, its learning rate, KL weight, reward scaling, clip range,
    gradient clip and temperature. TRL's loss 'dapo' divides the sum over the generation
    batch's tokens by their count: with one optimizer step per generation batch that is
    rlhfkit's token mean over the minibatch. TRL 1.16 multiplies its k3 loss term by the
    importance ratio (``use_bias_correction_kl``, on by default), whose gradient at ratio 1 --
    one optimizer step per rollout -- is the reverse KL's, ``beta * (log pi - log ref)`` per
    token: rlhfkit's k2 loss term, not its k3 (the forward KL's gradient)."""
    c = trl_grpo_config("unused", 0, 1, args.trl_lr, args.trl_beta, args.trl_num_generations, args.batch_size)
    assert c.loss_type == "dapo" and c.gradient_accumulation_steps == 1 and c.steps_per_generation == 1
    assert c.generation_batch_size == c.per_device_train_batch_size == args.batch_size and c.num_iterations == 1
    assert not c.top_k and c.top_p == 1.0 and c.lr_scheduler_type == "constant" and c.weight_decay == 0.0
    assert c.epsilon_high in (None, c.epsilon) and c.importance_sampling_level == "token"
    return {"group_size": c.num_generations, "batch_size": c.generation_batch_size,
            "minibatch_size": c.per_device_train_batch_size, "ppo_epochs": c.num_iterations,
            "lr": c.learning_rate, "lr_schedule": "constant", "kl_coef": c.beta, "kl_in_loss": True,
            "kl_estimator": "k2" if c.use_bias_correction_kl else "k3", "scale_rewards": c.scale_rewards,
            "loss_type": "token_mean", "clip_range": c.epsilon, "max_grad_norm": c.max_grad_norm,
            "temperature": c.temperature}


def run_rlhfkit(algo: str, paths: dict, args) -> dict:
    from rlhfkit.config import ALGO_DEFAULTS, Config, load_config
    from rlhfkit.trainers.rl import train_rl

    name, on_trl = algo, algo == "grpo_trl_schedule"
    algo = "grpo" if on_trl else algo

    reward = ({"name": paths["classifier"]} if args.reward == "classifier"
              else {"function": "rlhfkit.tasks.doubling:exact_reward"})
    cfg = Config().replace(
        run={"out_dir": str(Path(args.out) / f"tta_rlhfkit_{name}_{args.seed}"), "seed": args.seed,
             "progress": False, "overwrite": True},
        accel={"threads": 1},
        ppo={**ALGO_DEFAULTS[algo], "stop_at": args.target, "steps": args.max_steps,
             "eval_every": args.eval_every},
        reward=reward,
    )
    if on_trl:
        cfg = cfg.replace(ppo=grpo_on_trl_schedule(args))
    if algo == "ppo" and args.reward == "exact":
        # the value head on the actor (the default) learns faster here at Adam 6e-4 (module docstring)
        cfg = cfg.replace(ppo={"lr": 6e-4})
    cfg = load_config(None, args.ppo_override if algo == "ppo" else args.grpo_override, base=cfg)
    res = train_rl(cfg, paths["base"])
    reached = res["reached"]
    return {"steps": reached["steps"] if reached else res["steps"],
            "train_s": reached["train_s"] if reached else res["seconds"],
            "reached": reached is not None, "final_exact": res["final"].get("eval/exact_acc"),
            "settings": {k: getattr(cfg.ppo, k) for k in SHOWN_RLHFKIT}}


# --------------------------------------------------------------------------- TRL


def trl_on_rlhfkit_schedule(args) -> dict:
    """GRPOConfig keywords for TRL on rlhfkit GRPO's schedule, read from ``rlhfkit grpo``'s
    resolved defaults (config.ALGO_DEFAULTS): its groups, ``batch_size / minibatch_size``
    optimizer steps per generation (``steps_per_generation``), ``ppo_epochs`` passes over each
    (``num_iterations``), its learning rate and schedule, KL weight (k3 in the loss, TRL's only
    form, without the importance ratio TRL 1.16 multiplies it by by default:
    ``use_bias_correction_kl=False``), reward scaling, clip range, gradient clip and
    temperature, and loss 'bnpo': TRL's token mean over one optimizer step's rows (no gradient
    accumulation here), which is rlhfkit's ``token_mean``."""
    from rlhfkit.config import Config, PPOConfig, regime_value

    pc = PPOConfig(algo="grpo", batch_size=args.batch_size)
    assert pc.kl_in_loss and pc.kl_estimator == "k3" and pc.loss_type == "token_mean"
    assert pc.batch_size % pc.minibatch_size == 0 and pc.minibatch_size % pc.group_size == 0
    assert not pc.top_k and pc.top_p == 1.0 and pc.epsilon_high is None and pc.importance_sampling_level == "token"
    assert pc.scale_rewards in ("group", "batch", "none")
    return {"num_generations": pc.group_size, "per_device_train_batch_size": pc.minibatch_size,
            "steps_per_generation": pc.batch_size // pc.minibatch_size, "num_iterations": pc.ppo_epochs,
            "learning_rate": regime_value(Config(ppo=pc), "ppo.lr", "scratch"),  # the doubling task's model
            "lr_scheduler_type": pc.lr_schedule, "beta": pc.kl_coef,
            "scale_rewards": pc.scale_rewards, "loss_type": "bnpo", "epsilon": pc.clip_range,
            "max_grad_norm": pc.max_grad_norm, "temperature": pc.temperature, "use_bias_correction_kl": False}


def trl_config(kind: str, args):
    """The GRPOConfig of a TRL contender: ``trl_grpo`` is ``bench_common.trl_grpo_config``,
    ``trl_schedule`` the same with :func:`trl_on_rlhfkit_schedule`'s keys; ``--trl-override``
    KEY=VALUE pairs go on top of either (a sweep)."""
    out = str(Path(args.out) / f"tta_{kind}_{args.seed}")
    keys = {} if kind == "trl_grpo" else trl_on_rlhfkit_schedule(args)
    for item in args.trl_override:
        key, value = item.split("=", 1)
        keys[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    per_rollout = keys.get("steps_per_generation", 1) * keys.get("num_iterations", 1)
    config = trl_grpo_config(out, args.seed, args.max_steps * per_rollout, args.trl_lr, args.trl_beta,
                             args.trl_num_generations, args.batch_size, keys)
    assert config.generation_batch_size == args.batch_size, "one generation batch is one rollout"
    return config


def run_trl_grpo(kind: str, paths: dict, args) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlhfkit.models.forward import load_policy
    from rlhfkit.rollout.evaluate import evaluate_task
    from rlhfkit.tasks import doubling

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(paths["base"])
    model = load_policy(paths["base"])
    reward = ClassifierReward(paths["classifier"]) if args.reward == "classifier" else exact_reward_with_ids(tok)
    config = trl_config(kind, args)
    per_rollout = config.steps_per_generation * config.num_iterations  # optimizer steps per rollout of 64
    prompts = doubling.DoublingData(args.seed + 2).prompts(args.max_steps * args.batch_size // config.num_generations)
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts]})

    state = {"train_s": 0.0, "t0": None, "reached": None, "exact": None}

    class TimeAndEval(TrainerCallback):
        def on_step_begin(self, a, s, control, **kw):
            state["t0"] = time.perf_counter()

        def on_step_end(self, a, s, control, **kw):
            state["train_s"] += time.perf_counter() - state["t0"]
            rollouts = s.global_step // per_rollout  # rollouts whose every optimizer step has run
            if s.global_step % per_rollout == 0 and rollouts % args.eval_every == 0:
                ev = evaluate_task(doubling, model, tok, "cpu")  # not timed
                state["exact"] = ev["exact_acc"]
                print(f"eval rollout {rollouts}: train {state['train_s']:.2f}s format {ev['format_acc']:.3f} "
                      f"exact {ev['exact_acc']:.3f}", file=sys.stderr, flush=True)
                if ev["exact_acc"] >= args.target:
                    state["reached"] = {"step": rollouts, "train_s": state["train_s"]}
                    control.should_training_stop = True
            return control

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[TimeAndEval()])
    trainer.train()
    reached = state["reached"]
    return {"steps": reached["step"] if reached else trainer.state.global_step // per_rollout,
            "train_s": reached["train_s"] if reached else state["train_s"],
            "reached": reached is not None, "final_exact": state["exact"],
            "settings": {k: getattr(getattr(config, k), "value", getattr(config, k)) for k in SHOWN_TRL}}


# --------------------------------------------------------------------------- driver


def check_same_reward(paths: dict) -> float:
    """Largest gap between rlhfkit's built-in classifier scorer and the callable TRL gets."""
    from transformers import AutoTokenizer

    from rlhfkit.models.forward import freeze, load_policy, load_scalar_model
    from rlhfkit.rollout.generate import decode_responses, generate, tokenize_prompts
    from rlhfkit.rollout.rewards import classifier_scorer
    from rlhfkit.tasks import doubling

    tok = AutoTokenizer.from_pretrained(paths["base"])
    policy = load_policy(paths["base"]).eval()
    texts = [p.text for p in doubling.DoublingData(123).prompts(64)]
    ids, mask = tokenize_prompts(tok, texts, "cpu")
    roll = generate(policy, ids, mask, 8, tok.eos_token_id, tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    clf = freeze(load_scalar_model(paths["classifier"], num_labels=None))
    ours = classifier_scorer(clf, tok, doubling.label_of_prompt)(roll)
    theirs = ClassifierReward(paths["classifier"])(texts, decode_responses(tok, roll.response_ids, roll.response_mask))
    return float((ours - torch.tensor(theirs)).abs().max())


def worker(args) -> None:
    paths = worker_setup(args)
    if args.worker in TRL_CONTENDERS:
        res = run_trl_grpo(args.worker, paths, args)
    else:
        res = run_rlhfkit(args.worker.removeprefix("rlhfkit_"), paths, args)
    print(RESULT + json.dumps({**res, "peak_mib": peak_rss_mib()}), flush=True)


def trl_available() -> str | None:
    try:
        import trl
    except ImportError:
        return "TRL is not installed (pip install -e .[bench])"
    return None if trl.__version__.startswith("1.") else f"TRL {trl.__version__} found, the benchmark targets 1.x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--core", type=int, default=0, help="CPU core every contender is pinned to")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64, help="completions per rollout (TRL)")
    ap.add_argument("--reward", choices=["exact", "classifier"], default="exact")
    ap.add_argument("--trl-lr", type=float, default=TRL_GRPO_LR)
    ap.add_argument("--trl-beta", type=float, default=TRL_GRPO_BETA)
    ap.add_argument("--trl-num-generations", type=int, default=8)
    ap.add_argument("--trl-override", nargs="*", default=[],
                    help="GRPOConfig KEY=VALUE pairs for the TRL contenders (e.g. num_iterations=2 beta=0.3)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="'cpu' times CPU seconds of each contender's process (for a machine shared with other jobs)")
    ap.add_argument("--ppo-override", nargs="*", default=[], help="dotted overrides for rlhfkit PPO")
    ap.add_argument("--grpo-override", nargs="*", default=[], help="dotted overrides for rlhfkit GRPO")
    ap.add_argument("--worker", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_record_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    quiet_hf()
    paths = prepare(args.out)
    contenders = list(args.contenders)
    skipped = trl_available()
    if skipped:
        for c in TRL_CONTENDERS:
            if c in contenders:
                print(f"skipping {CONTENDERS[c]}: {skipped}")
                contenders.remove(c)
    if args.reward == "classifier":
        print(f"same reward check: rlhfkit scorer vs TRL callable, max |diff| = {check_same_reward(paths):.2e}")
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for seed in args.seeds:
        for c in contenders:
            cmd = pinned_cmd(args.core, __file__, "--worker", c, "--seed", str(seed), "--out", args.out,
                             "--target", str(args.target), "--eval-every", str(args.eval_every),
                             "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
                             "--reward", args.reward, "--trl-lr", str(args.trl_lr), "--trl-beta", str(args.trl_beta),
                             "--trl-num-generations", str(args.trl_num_generations), "--core", str(args.core),
                             "--clock", args.clock, "--trl-override", *args.trl_override,
                             "--ppo-override", *args.ppo_override, "--grpo-override", *args.grpo_override)
            env = {**os.environ, "RLHFKIT_BENCH_PINNED": "1", "OMP_NUM_THREADS": "1"}
            at = code_version()  # the code the worker imports now
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            if proc.returncode or not lines:
                print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
                raise SystemExit(f"{c} seed {seed} failed (exit {proc.returncode})")
            res = json.loads(lines[-1][len(RESULT):])
            results[c].append({"seed": seed, **res})
            record_run(c, seed, res, args, at)
            print(f"  {CONTENDERS[c]:<22} seed {seed}: {res['steps']:>4} steps {res['train_s']:7.2f} s "
                  f"reached={res['reached']} exact={res['final_exact']}", flush=True)
    report(results, args)


def record_run(contender: str, seed: int, res: dict, args, at: str) -> None:
    """One (contender, seed) as a row of the record: its settings and this run's options, the
    training seconds to the target (or to --max-steps) and the rollouts it took."""
    options = {"target": args.target, "eval_every": args.eval_every, "max_steps": args.max_steps,
               "batch_size": args.batch_size, "reward": args.reward, "clock": args.clock,
               "overrides": args.trl_override if contender in TRL_CONTENDERS
               else args.ppo_override if contender == "rlhfkit_ppo" else args.grpo_override}
    record("time_to_accuracy", {"contender": contender, "settings": {**res["settings"], **options}, "seeds": [seed],
                                "times_s": [res["train_s"]], "rollouts": res["steps"], "reached": res["reached"],
                                "final_exact": res["final_exact"], "peak_mib": res["peak_mib"], "threads": 1},
           args, at=at)


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of ``values``."""
    med = format(statistics.median(values), fmt)
    return med if len(values) == 1 else f"{med} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(results: dict[str, list[dict]], args) -> None:
    clock = "CPU seconds" if args.clock == "cpu" else "Training seconds"
    print(f"\n{clock} (rollout + experience + update, evaluation excluded) to greedy exact_acc >= "
          f"{args.target} on the 512 held-out prompts, checked every {args.eval_every} rollouts of "
          f"{args.batch_size}; reward: {args.reward}; one core (taskset -c {args.core}), 1 torch thread; "
          f"torch {torch.__version__}; seeds {' '.join(map(str, args.seeds))}; median (min-max) over seeds")
    print(f"{'contender':<22}{'rollouts per seed':>20}{'rollouts':>16}{'s / rollout':>22}{'s to target':>22}")
    medians = {}
    for c, rows in results.items():
        per_seed = " ".join(f"{r['steps']}{'' if r['reached'] else '*'}" for r in rows)
        per_step = [r["train_s"] / max(1, r["steps"]) for r in rows]
        medians[c] = statistics.median(r["train_s"] for r in rows)
        print(f"{CONTENDERS[c]:<22}{per_seed:>20}{spread([r['steps'] for r in rows], 'g'):>16}"
              f"{spread(per_step, '.3f'):>22}{spread([r['train_s'] for r in rows], '.1f'):>22}")
    for c, rows in results.items():
        print(f"  {CONTENDERS[c]}: {' '.join(f'{k}={v}' for k, v in rows[0]['settings'].items())}")
    if any(not r["reached"] for rows in results.values() for r in rows):
        print("* did not reach the target within --max-steps (its rollouts and time are lower bounds)")
    for base in TRL_CONTENDERS:
        if base in medians:
            for c in ("rlhfkit_ppo", "rlhfkit_grpo", "grpo_trl_schedule"):
                if c in medians:
                    print(f"{CONTENDERS[c]} / {CONTENDERS[base]} median time: {medians[c] / medians[base]:.2f}x")


if __name__ == "__main__":
    main()
