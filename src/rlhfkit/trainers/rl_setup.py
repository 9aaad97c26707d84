"""The RL loop's set-up and bookkeeping (checks, models, optimizer, data, resume, outputs, final
save) in one :class:`RLSetup`; the loop itself stays in ``trainers.rl``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

from ..accel.offload import HostMoments, offload_frozen
from ..config import Config, PPOConfig
from ..data.prompts import PromptData, prompt_data
from ..envs.environment import EpisodeMaker
from ..models.forward import (
    ValueHead,
    add_lora,
    context_window,
    disable_dropout,
    enable_gradient_checkpointing,
    load_scalar_model,
    load_tokenizer,
    policy_with_reference,
    quiet_load_report,
    resolve_dtype,
)
from ..models.precision import keep_master_weights
from ..rollout.experience import ActorCritic, Experience, RLState, completions_per_prompt
from ..rollout.generate import decode_responses
from ..rollout.rewards import Reward, build_reward, other_tokenizer
from ..run.checkpoint import latest_checkpoint
from ..run.distributed import full_state_dict, shard_frozen
from ..run.trajectories import TrajectoryWriter
from ..tasks import get_task
from ..utils import cut_file, file_size
from .common import Engine, Run, lr_scale


@dataclasses.dataclass
class RLSetup:
    """What the loop reads. ``pc``: ppo with the learning rates and ``max_new_tokens`` resolved;
    ``local_pc``: with this process's ``minibatch_size``. ``train_ac``: ``ac`` as accelerate
    prepared it. ``warm_engine``: the critic warm-up's (under DDP around the wrapper)."""

    run: Run
    pc: PPOConfig
    local_pc: PPOConfig
    ac: ActorCritic
    train_ac: Any
    ref: Any
    scorer: Reward
    tok: Any
    optimizer: torch.optim.Optimizer
    engine: Engine
    warm_engine: Engine
    moments: HostMoments | None
    data: PromptData
    env: EpisodeMaker | None
    repeats: int
    baseline: dict = dataclasses.field(default_factory=dict)
    shown: float = math.nan  # the progress line's last evaluated stop metric
    st: RLState | None = None
    best: BestWeights | None = None
    samples: Any = None
    trajectories: TrajectoryWriter | None = None


def setup_rl(cfg: Config, policy_path: str | None, reward_path: str | None,
             evaluate: Callable[[RLSetup], dict]) -> RLSetup:
    """Check the config, build the models, optimizer and data, evaluate the starting policy with
    ``evaluate`` (step 0's ``baseline/eval/*``; not on a resume) and restore a checkpoint."""
    policy_path = policy_path or cfg.model.name
    cfg = cfg.replace(reward={"name": reward_path}) if reward_path else cfg
    s = build_rl(cfg, policy_path)
    resuming = cfg.run.resume and latest_checkpoint(s.run.out) is not None
    s.baseline = {} if resuming else evaluate(s)
    start_state(s, None if resuming else choose_stop_metric(s.pc, s.baseline))
    return s


def build_rl(cfg: Config, policy_path: str) -> RLSetup:
    """The run, the models, the optimizer (prepared for the engine), ``accel.offload`` and the data."""
    repeats, pc = check_rl_config(cfg, policy_path), cfg.ppo
    run = Run(cfg, pc.algo, pc.steps)
    refuse_untested_engines(run.accelerator, cfg)
    run.shard.local_size(pc.batch_size, "ppo.batch_size", repeats)  # whole groups on every process
    local_mb = run.shard.local_size(pc.minibatch_size, "ppo.minibatch_size")
    ac, ref, scorer, tok = build_models(cfg, policy_path, run.device)
    # the learning rates left unset by model.regime (the critic's only when there is one)
    rates = run.learning_rates(ac.policy, "ppo.lr", *(["ppo.value_lr"] if ac.has_critic else []))
    pc = dataclasses.replace(pc, lr=rates["ppo.lr"], value_lr=rates.get("ppo.value_lr"))
    local_pc = dataclasses.replace(pc, minibatch_size=local_mb)
    optimizer = make_optimizer(ac, pc)
    train_ac, optimizer = run.prepare(ac, optimizer, micro_batch=local_pc.minibatch_size)
    shard_frozen(run.accelerator, ref, *scorer.models)  # FSDP: no whole copy of them per process
    engine = run.engine(train_ac)
    moments = start_offload(run, optimizer, ref, *scorer.models)
    warm_engine = dataclasses.replace(engine, model=None, sync=tuple(ac.critic_parameters())) \
        if isinstance(train_ac, torch.nn.parallel.DistributedDataParallel) else engine
    context = context_window(ac.policy, ac.critic)  # prompts + new tokens must fit it: checked (or cut) here
    data = prompt_data(cfg, tok, get_task(cfg.run.task), context)
    env = EpisodeMaker(cfg.env, context) if cfg.env.cls else None
    # resolved (check_rl_config: set with data.path): dr_grpo divides by it, the over-long penalty ramps to it
    n = pc.max_new_tokens or data.task.MAX_NEW_TOKENS
    pc, local_pc = (dataclasses.replace(c, max_new_tokens=n) for c in (pc, local_pc))
    return RLSetup(run, pc, local_pc, ac, train_ac, ref, scorer, tok, optimizer, engine, warm_engine, moments,
                   data, env, repeats)


def start_state(s: RLSetup, stop_metric: str | None) -> None:
    """The loop's counters, ``ppo.keep_best``, a resumed checkpoint's state and the output files."""
    pc = s.pc
    s.st = RLState(pc, stop_metric, len(s.data.eval_records or ()))
    if pc.keep_best and not s.st.stop_metric:
        raise ValueError("ppo.keep_best=true keeps the best-evaluated policy, but this run has no held-out prompts "
                         "to evaluate: set data.eval_path or data.eval_fraction")
    s.best = BestWeights(s.ac) if pc.keep_best else None
    resumed = s.run.restore({"actor_critic": s.ac}, {"optimizer": s.optimizer}, data=s.data.train)
    if resumed:
        s.st.load_state_dict(resumed)
    evaluations = pc.steps // pc.eval_every + bool(pc.steps % pc.eval_every) if pc.eval_every else 1
    s.st.watch.announce(eval_metrics(s.data, s.scorer, s.env), evaluations)  # one warning: the guards left off
    s.shown = s.baseline.get(s.st.stop_metric, math.nan)
    s.samples, s.trajectories = open_outputs(s.run, resumed)


def build_models(cfg: Config, policy_path: str, device):
    """``(actor_critic, ref, scorer, tokenizer)``; a critic for ``ppo`` only, sharing the policy's
    tokenizer (it reads the policy's tokens)."""
    pc, rc, mc = cfg.ppo, cfg.reward, cfg.model
    trc = mc.trust_remote_code
    tok = load_tokenizer(policy_path, trust_remote_code=trc)
    # RL compares the sampler's forward with the update's: every dropout off, the adapter's too
    policy, ref = policy_with_reference(policy_path, mc, device, adapter_dropout=False)
    scorer = build_reward(cfg, tok, device)
    if pc.algo != "ppo":
        return ActorCritic(policy), ref, scorer, tok
    if pc.value_model == "shared":
        return ActorCritic(policy, value_head=ValueHead(policy.config.hidden_size).to(device)), ref, scorer, tok
    # value_init reward (or unset): from the reward model when there is one; with reward functions alone, the policy
    from_rm = pc.value_init != "policy" and isinstance(rc.name, str) and rc.name  # not a model object
    critic_src = cfg.value.name or (rc.name if from_rm else policy_path)
    if other_tokenizer(critic_src, tok, trc) is not None:
        raise ValueError(f"the value model {critic_src} has a different tokenizer from the policy's; the critic "
                         "reads the policy's tokens: use ppo.value_init=policy or a value.name that shares it")
    with quiet_load_report():  # from a causal LM: its LM head unused, a fresh scalar head
        critic = disable_dropout(load_scalar_model(critic_src, "float32" if mc.master_weights else mc.dtype, trc,
                                                   ignore_mismatched_sizes=True))
    if mc.master_weights:
        keep_master_weights(critic, resolve_dtype(mc.dtype))
    if critic.config.pad_token_id is None:
        critic.config.pad_token_id = tok.pad_token_id
    if cfg.value.lora:
        if not mc.lora_r:
            raise ValueError("value.lora needs model.lora_r > 0 (the adapter's rank and targets)")
        critic = disable_dropout(add_lora(critic, mc.lora_r, mc.lora_alpha, 0.0, mc.lora_target_modules,
                                          trainable_head=True))
    if mc.gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    return ActorCritic(policy, critic=critic.to(device).train()), ref, scorer, tok


def check_rl_config(cfg: Config, policy_path: str | None) -> int:
    """Refuse settings the loop cannot run; returns the rows per prompt in a batch."""
    pc = cfg.ppo
    if not policy_path or not (cfg.reward.name or cfg.reward.function or cfg.env.cls):
        raise ValueError(f"{pc.algo} needs a pretrained policy and a reward: set model.name=PATH and "
                         "reward.name=PATH (a reward model), reward.function=module:callable or env.class=module:Name "
                         "(an environment's rewards)")
    if cfg.data.path and not pc.max_new_tokens:
        raise ValueError("ppo.max_new_tokens must be set with data.path: the longest response to sample "
                         "for your prompts (e.g. ppo.max_new_tokens=256)")
    if pc.algo in ("grpo", "rloo") and pc.batch_size % pc.group_size:
        raise ValueError(f"ppo.batch_size ({pc.batch_size}) must be a multiple of ppo.group_size ({pc.group_size})")
    if pc.samples_per_prompt < 1 or pc.batch_size % pc.samples_per_prompt:
        raise ValueError(f"ppo.samples_per_prompt ({pc.samples_per_prompt}) must be >= 1 and divide ppo.batch_size "
                         f"({pc.batch_size})")
    check_critic_warmup(pc)
    return completions_per_prompt(pc)


def check_critic_warmup(pc: PPOConfig) -> None:
    """ppo: refuse a critic warm-up as long as the run, warn when it takes over half of it."""
    warm, steps = pc.critic_warmup_steps, pc.steps
    if pc.algo != "ppo" or not warm:
        return
    if warm >= steps:
        raise ValueError(f"ppo.critic_warmup_steps={warm} covers every one of ppo.steps={steps}: the policy would "
                         f"never be updated; set ppo.critic_warmup_steps below {steps} (0: no warm-up) or raise "
                         "ppo.steps")
    if 2 * warm > steps:
        warnings.warn(f"ppo.critic_warmup_steps={warm} of ppo.steps={steps}: the policy is updated on the last "
                      f"{steps - warm} step(s) only", UserWarning, stacklevel=2)


def refuse_untested_engines(accelerator, cfg: Config) -> None:
    """Stop before any work where DeepSpeed would fail late or run RL differently from one process,
    or where an option is one-process only."""
    kind = getattr(accelerator, "distributed_type", None)
    if kind == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise ValueError("RL under DeepSpeed ZeRO-3 is not supported: generation runs the policy's layers, whose "
                         "weights ZeRO-3 holds partitioned; use ZeRO-2 or DDP (with LoRA for big models)")
    left_out = [k for k in ("filter_zero_std_groups", "mask_truncated_completions") if getattr(cfg.ppo, k)]
    if left_out and getattr(accelerator, "num_processes", 1) > 1:
        raise ValueError(f"ppo.{left_out[0]} runs on one process only: the rows it leaves out of the update differ "
                         "between processes, which would then take different numbers of optimizer steps")
    if kind == "DEEPSPEED" and cfg.ppo.algo == "ppo":
        raise ValueError("ppo under DeepSpeed is not supported: its engine clips one gradient norm over the actor "
                         "and the critic together, where rlhfkit clips each to ppo.max_grad_norm, so the update "
                         "differs from the single-process one; use DDP, or grpo / rloo / reinforce (no critic)")


def make_optimizer(ac: ActorCritic, pc: PPOConfig) -> torch.optim.Optimizer:
    """AdamW over the actor's trainable weights (``ppo.lr``) and the critic's (``ppo.value_lr``)."""
    groups = [{"params": [p for p in ac.policy.parameters() if p.requires_grad], "lr": pc.lr}]
    if ac.has_critic:
        groups.append({"params": ac.critic_parameters(), "lr": pc.value_lr})
    return torch.optim.AdamW(groups, weight_decay=0.0, fused=True)  # one kernel per step


def set_lr(optimizer, pc: PPOConfig, step: int) -> float:
    """The groups' learning rates at ``step`` under ``ppo.lr_schedule`` after ``ppo.warmup_steps``
    (or ``ppo.warmup_ratio`` of the steps); returns the actor's."""
    warmup = pc.warmup_steps or math.ceil(pc.warmup_ratio * pc.steps)
    scale = lr_scale(step, pc.steps, warmup, pc.lr_schedule)
    for group, lr in zip(optimizer.param_groups, (pc.lr, pc.value_lr)):
        group["lr"] = lr * scale
    return pc.lr * scale


def start_offload(run: Run, optimizer, *frozen) -> HostMoments | None:
    """``accel.offload``: the frozen models' weights to host memory now, the optimizer's moments
    each step (the returned :class:`~rlhfkit.accel.offload.HostMoments`)."""
    if not run.cfg.accel.offload:
        return None
    kind = getattr(run.accelerator, "distributed_type", None)
    if kind in ("FSDP", "DEEPSPEED"):
        raise ValueError(f"accel.offload runs on one process or under DDP; under {kind} the optimizer state and the "
                         "frozen models are sharded across processes already: leave it off")
    if run.device.type == "cpu":
        warnings.warn("accel.offload on a CPU saves no memory: host and device memory are one (the copies still run)",
                      UserWarning, stacklevel=2)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in frozen:  # one holding a trained weight (a reward model object that is the policy) stays
        if model is not None and not any(id(p) in trained for p in model.parameters()):
            offload_frozen(model, run.device)
    return HostMoments(optimizer, run.device)


# what an empty ppo.stop_metric means: the first of these that the run's evaluation logs
DEFAULT_STOP_METRICS = ("eval/exact_acc", "eval/accuracy", "eval/reward")


def choose_stop_metric(pc: PPOConfig, baseline: dict[str, float]) -> str:
    """The held-out metric the run stops on (and keeps the best of): ``ppo.stop_metric``, or the
    first of DEFAULT_STOP_METRICS its first evaluation logged ("" for none)."""
    if pc.stop_metric:
        if pc.stop_metric in baseline:
            return pc.stop_metric
        if not baseline:
            raise ValueError(f"ppo.stop_metric={pc.stop_metric!r}: this run has no held-out prompts to evaluate; "
                             "set data.eval_path or data.eval_fraction, or leave ppo.stop_metric empty")
        if pc.stop_metric == "eval/accuracy":  # logged only from rewards declared 0/1
            raise ValueError("ppo.stop_metric=eval/accuracy, but no reward source is declared 0/1, so it is never "
                             "logged: mark the verifier (fn.binary = True) or name it in eval.accuracy_reward")
        raise ValueError(f"ppo.stop_metric={pc.stop_metric!r} is not logged by this run's evaluation, which logs "
                         f"{', '.join(k for k in baseline if not k.startswith('eval/reward_std/'))}: name one of "
                         "those (or leave ppo.stop_metric empty)")
    found = next((k for k in DEFAULT_STOP_METRICS if k in baseline), "")
    if not found and pc.stop_at:
        warnings.warn(f"no held-out prompts to evaluate, so ppo.stop_at={pc.stop_at} cannot stop the run: set "
                      "data.eval_path or data.eval_fraction (or ppo.stop_at=0)", UserWarning, stacklevel=2)
    return found


def eval_metrics(data: PromptData, reward: Reward, env: EpisodeMaker | None = None) -> set[str]:
    """The held-out metrics :func:`rlhfkit.trainers.rl.evaluate` logs for this run."""
    if env is not None:
        return {"eval/reward"} if data.eval_records else set()
    if data.task is not None:
        return {"eval/format_acc", "eval/exact_acc"}
    if not data.eval_records:
        return set()
    return {"eval/reward", *(f"eval/reward/{name}" for name in reward.weights),
            *(["eval/accuracy"] if reward.accuracy_sources() else [])}


class BestWeights:
    """``ppo.keep_best``: a CPU copy of the trainable weights of the best evaluation so far."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.step, self.value, self.weights = module, None, -math.inf, {}

    def offer(self, step: int, value: float | None) -> None:
        """Keep the weights as they are after ``step`` when ``value`` beats every earlier one."""
        if value is None or not value > self.value:
            return
        self.step, self.value = step, value
        self.weights = {n: p.detach().to("cpu", copy=True) for n, p in self.module.named_parameters()
                        if p.requires_grad}

    @torch.no_grad()
    def restore(self) -> None:
        for n, p in self.module.named_parameters():
            if n in self.weights:
                p.copy_(self.weights[n].to(p.device))


def open_outputs(run: Run, resumed: dict):
    """``samples.jsonl`` and the trajectory writer, cut back to a resumed checkpoint's offsets
    (writing nothing off the main process)."""
    pc = run.cfg.ppo
    if resumed and run.is_main:
        cut_file(run.out / "samples.jsonl", resumed["samples_offset"])
    samples = open(run.out / "samples.jsonl" if run.is_main else os.devnull, "a" if resumed else "w",
                   encoding="utf-8")
    trajectories = TrajectoryWriter(run.out / "trajectories.jsonl", pc.trajectories_every if run.is_main else 0,
                                    pc.trajectories_per_step,  # the main process's rows: the batch's first
                                    resumed.get("trajectories_offset"))
    return samples, trajectories


def write_samples(fh, step: int, prompts, exp: Experience, tok, k: int) -> None:
    """The first ``k`` rows' prompts, completions and scores (decoded only for those rows)."""
    texts = decode_responses(tok, exp.response_ids[:k], exp.attention_mask[:k, exp.prompt_len :])  # observations kept
    for p, c, s in zip(prompts[:k], texts, exp.score[:k].tolist()):
        fh.write(json.dumps({"step": step, "prompt": p.text, "response": c, "score": round(s, 4)},
                            ensure_ascii=False) + "\n")


def step_timings(run: Run, exp: Experience, t: list[float], train_s: float) -> dict:
    """Seconds per phase (``t``: the phases' starts and the update's end), throughput and, on a
    GPU, the peak allocated memory."""
    row = {"time/rollout_s": t[1] - t[0], "time/experience_s": t[2] - t[1], "time/update_s": t[3] - t[2],
           "time/train_s": train_s, "throughput/tokens_per_s": int(exp.attention_mask.sum()) / (t[3] - t[0])}
    if run.device.type == "cuda":  # high-water mark of the tensors allocated so far (models, states, activations)
        row["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    return row


def save_checkpoint(s: RLSetup, step: int) -> None:
    """The checkpoint after ``step`` when one is due, with the output files' offsets."""
    if s.run.due(step):
        s.samples.flush()
        s.run.checkpoint(step, **s.st.state_dict(),
                         samples_offset=file_size(s.run.out / "samples.jsonl"),
                         trajectories_offset=s.trajectories.position())


def finish_rl(s: RLSetup) -> dict:
    """Close the outputs, save the models (``ppo.keep_best``: the best's) and plots; the summary."""
    from ..run.plots import plot_ppo  # matplotlib only when a run finishes

    run, ac, st = s.run, s.ac, s.st
    s.samples.close()
    s.trajectories.close()
    saved_step = st.reached["step"] if st.reached else s.pc.steps - 1  # the last step run
    if s.best is not None and s.best.step is not None and s.best.step != saved_step:
        s.best.restore()
        saved_step = s.best.step
    run.close()
    history = run.log_.rows()  # read back, not kept per step: memory stays flat over a long run
    policy_dir = run.save_model(ac.policy, s.tok, "policy", adapter="policy_adapter")  # LoRA: merged in policy/
    if ac.critic is not None:
        run.save_model(ac.critic, s.tok, "value_model")
    elif ac.value_head is not None:
        head = full_state_dict(ac.value_head)  # FSDP: gathered on every process (a collective)
        if run.is_main:
            save_file(head or ac.value_head.state_dict(), str(run.out / "value_head.safetensors"))
    if run.is_main:
        plot_ppo(history, run.out)
    run.shard.wait()
    final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    return {"path": str(policy_dir), "seconds": st.train_s, "steps": history[-1]["step"] + 1, "reached": st.reached,
            "final": final, "saved_step": saved_step}
