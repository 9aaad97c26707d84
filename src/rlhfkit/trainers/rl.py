"""Policy optimisation for language models: PPO, GRPO, RLOO and REINFORCE in one loop.

PPO has four roles: actor, critic, reward model, reference. GRPO, RLOO and REINFORCE drop the
critic and differ only in the advantage estimator (:func:`rlhfkit.rollout.experience.sequence_advantages`).
:func:`train_rl` reads top to bottom (docs/ppo_walkthrough.md walks through one step):

    0. set-up      models, optimizer, data, baseline evaluation, resume     rl_setup.setup_rl
    1. rollout     sample responses from left-padded prompts (KV cache)     rollout -> rollout.generate
    2. experience  one no-grad pass: old and reference log-probs, values,
                   scores -> shaped rewards -> advantages and returns      experience.make_experience
    3. update      ppo_epochs x shuffled minibatches: clipped policy loss
                   + vf_coef * clipped value loss - entropy_coef * entropy  update_step -> ppo_update
    4. log         every diagnostic (docs/design.md), sample completions    log_step
    5. evaluate    the held-out prompts, every eval_every steps            evaluate
    6. checkpoint  every run.checkpoint_every steps (exact resume)          rl_setup.save_checkpoint
"""

from __future__ import annotations

import functools
import math
import time

import torch

from ..accel.heap import gradient_buffer, release_free_memory, tensors_off_heap
from ..config import Config, PPOConfig
from ..core import (
    AGGREGATIONS,
    SurrogateOptions,
    adaptive_kl_coef,
    aggregate,
    aggregation_count,
    kl_estimate,
    masked_mean,
    policy_loss,
    policy_objective,
    value_loss,
)
from ..data.prompts import PromptData, prompt_tensors
from ..envs.environment import EpisodeMaker, episode_stats, play
from ..models.forward import eval_mode
from ..models.precision import compute_weights
from ..rollout.evaluate import evaluate_rewards, evaluate_sharded
from ..rollout.experience import ActorCritic, Experience, completions_per_prompt, make_experience
from ..rollout.generate import Rollout, eos_token_ids, generate, sampling_settings
from ..rollout.rewards import Reward
from ..run.checkpoint import fault_point
from ..run.distributed import full_weights, rollout_uniforms
from ..utils import UpdateGuard, mean_stats
from .common import Engine, Run
from .rl_setup import RLSetup, finish_rl, save_checkpoint, set_lr, setup_rl, step_timings, write_samples

GAP = ("policy/logprob_gap",)  # the one stat a reduction takes the maximum of


def train_rl(cfg: Config, policy_path: str | None = None, reward_path: str | None = None) -> dict:
    """Run ``ppo.algo`` on the prompts of ``data.path`` or the task; writes metrics, samples,
    trajectories, plots and models under ``run.out_dir``; stops when ``ppo.stop_metric`` reaches
    ``ppo.stop_at``. Under ``accelerate launch`` each process takes its shard of every batch."""
    s = setup_rl(cfg, policy_path, reward_path, held_out)  # step 0
    for step in s.run.steps():
        records, exp, stats = rl_step(s, step)  # steps 1-3
        log_step(s, step, records, exp, stats)  # steps 4-5
        if s.st.reached is not None:
            break
        fault_point("step_end", step)
        save_checkpoint(s, step)  # step 6
    return finish_rl(s)


def rl_step(s: RLSetup, step: int) -> tuple[list, Experience, dict]:
    """Rollout, experience and update of one step: the batch's records, experience and stats."""
    pc, st, shard = s.pc, s.st, s.run.shard
    t = [time.perf_counter()]
    if s.moments is not None:  # accel.offload: AdamW's moments wait in host memory until the update
        s.moments.to_host()
    # step 1. rollout: grpo / rloo take each prompt G times in a row, the grouping the baselines expect
    records = shard.take([r for r in s.data.train.batch(pc.batch_size // s.repeats) for _ in range(s.repeats)])
    release_free_memory()  # each phase's peak resident set its own, not the last phase's freed heap
    roll, episode = rollout(s.run, s.ac, s.train_ac, s.tok, records, step, pc.max_new_tokens, s.env)
    fault_point("rollout", step)
    t.append(time.perf_counter())
    # step 2. experience: scores, reference log-probs, values -> advantages and returns
    release_free_memory()
    # FSDP: the forwards call the modules themselves; model.master_weights: the policy's bf16 copies made here
    with full_weights(s.train_ac, s.ref, *s.scorer.models, compute=False):
        exp, stats = make_experience(s.ac, s.ref, s.scorer, roll, pc, st.kl_coef, st.reward_stats, shard, records,
                                     reuse_logprobs=s.run.cfg.accel.reuse_rollout_logprobs)
    stats = shard.mean({**stats, **episode}, maxed=GAP)
    t.append(time.perf_counter())
    # step 3. update
    stats.update(update_step(s, step, exp, gap="policy/logprob_gap" not in stats))
    t.append(time.perf_counter())
    st.train_s += t[3] - t[0]
    stats.update(step_timings(s.run, exp, t, st.train_s), **{"data/epoch": s.data.train.epoch})
    return records, exp, stats


def update_step(s: RLSetup, step: int, exp: Experience, gap: bool) -> dict:
    """``ppo_epochs`` x minibatches at this step's learning rate (a critic warm-up trains the
    value loss alone); the update's stats."""
    pc, st = s.pc, s.st
    warm = s.ac.has_critic and step < pc.critic_warmup_steps
    stats = {"policy/lr": set_lr(s.optimizer, pc, step)}
    # rows left out (filter_zero_std_groups, mask_truncated_completions) leave every token mean
    train_exp = exp if exp.loss_rows is None else exp.select(exp.loss_rows)
    if s.moments is not None:
        s.moments.to_device()
    release_free_memory()
    if len(train_exp.input_ids):  # none kept: no update this step
        stats.update(mean_stats(ppo_update(s.ac, s.optimizer, train_exp, s.local_pc, st.kl_coef,
                                           update_policy=not warm, engine=s.warm_engine if warm else s.engine,
                                           logprob_gap=gap, off_heap=s.run.cfg.accel.update_off_heap)))
    return stats


def log_step(s: RLSetup, step: int, records, exp: Experience, stats: dict) -> None:
    """Step 4 (the adaptive KL coefficient, samples, guards, the metrics row) and step 5 (the
    held-out evaluation when due, which may reach ``ppo.stop_at``)."""
    pc, st = s.pc, s.st
    if step == 0:  # the evaluation before any update, beside step 0's own
        stats.update({f"baseline/{k}": v for k, v in s.baseline.items()})
    if pc.adaptive_kl:
        st.kl_coef = adaptive_kl_coef(st.kl_coef, stats["objective/kl"], pc.kl_target, pc.kl_horizon, pc.batch_size)
    write_samples(s.samples, step, records, exp, s.tok, pc.samples_per_log)
    last = step == pc.steps - 1
    evaluated = s.run.eval_due(step, pc.eval_every)
    if evaluated:
        if s.moments is not None:  # the evaluation's rollouts need the moments no more than the step's
            s.moments.to_host()
        stats.update(held_out(s))
        s.shown = stats.get(st.stop_metric, s.shown)
        if s.best is not None:
            s.best.offer(step, stats.get(st.stop_metric))
        if st.reached is None and pc.stop_at and stats.get(st.stop_metric, -math.inf) >= pc.stop_at:
            st.reached = {"step": step, "steps": step + 1, "train_s": st.train_s}
    stats.update(st.watch.check(step, stats))  # reward-hacking signs: guard/* flags, one warning each
    st.signals.check(step, stats, pc.max_new_tokens)  # groups without reward variance, cut responses: warnings
    s.trajectories.maybe_write(step, last or st.reached is not None, exp, s.tok, pc, stats["objective/kl_coef"])
    metric = {st.stop_metric.rsplit("/", 1)[-1]: f"{s.shown:.3f}"} if st.stop_metric else {}
    s.run.log(step, stats, force=evaluated or st.reached is not None, score=f"{stats['objective/score']:.2f}",
              kl=f"{stats['objective/kl']:.3f}", **metric)


def surrogate_options(pc: PPOConfig) -> SurrogateOptions:
    """The policy objective's knobs from the config: ``ppo.epsilon_high`` is the clipped losses'
    upper clip and cispo's cap (unset there: 5.0), as in TRL."""
    if pc.loss_type == "cispo":
        return SurrogateOptions(cap=5.0 if pc.epsilon_high is None else pc.epsilon_high)
    return SurrogateOptions(clip_low=pc.clip_range, clip_high=pc.epsilon_high, temperature_pos=pc.sapo_temperature_pos,
                            temperature_neg=pc.sapo_temperature_neg)


def minibatch_loss(ac_model, exp: Experience, mb: torch.Tensor, pc: PPOConfig, kl_coef: float,
                   update_policy: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(loss, logprobs [b, R], stats)`` of minibatch rows ``mb``: the clipped value loss and,
    unless it is a critic warm-up, the clipped policy loss, entropy bonus and KL term, each
    reduced by the one aggregation ``pc.loss_type``."""
    rmask = exp.response_mask[mb]
    agg = functools.partial(aggregate, mask=rmask, kind=pc.loss_type, max_len=pc.max_new_tokens or 0)
    with_entropy = update_policy and bool(pc.entropy_coef)
    # log-probs (and entropies) of the chosen tokens straight from the forward: a big vocabulary's
    # [b, R, V] logits are never held whole (models.token_logprobs)
    logprobs, entropy, values = ac_model(exp.input_ids[mb], exp.attention_mask[mb], exp.prompt_len, pc.temperature,
                                         detach_value=not update_policy, response_ids=exp.response_ids[mb],
                                         entropy=with_entropy)  # [b, R] each
    loss, stats = torch.zeros((), device=logprobs.device), {}
    if values is not None:
        v_loss, stats = value_loss(values, exp.old_values[mb], exp.returns[mb], rmask, pc.value_clip_range,
                                   pc.loss_type, pc.max_new_tokens or 0)
        loss = pc.vf_coef * v_loss
    p_loss, p_stats = policy_loss(logprobs, exp.old_logprobs[mb], exp.advantages[mb], rmask, pc.clip_range,
                                  pc.loss_type, pc.max_new_tokens or 0, pc.importance_sampling_level,
                                  policy_objective(pc.loss_type), surrogate_options(pc))
    stats.update(p_stats)
    if update_policy:
        loss = loss + p_loss
        if with_entropy:
            loss = loss - pc.entropy_coef * agg(entropy)
        # the KL as the loss term (kl_in_loss), or beside the reward's KL a k3 term (forward_kl_coef)
        kind, coef = (pc.kl_estimator, kl_coef) if pc.kl_in_loss else ("k3", pc.forward_kl_coef)
        if pc.kl_in_loss or coef:
            kl = kl_estimate(logprobs, exp.ref_logprobs[mb], kind)  # [b, R]
            loss = loss + coef * agg(kl)
            stats["policy/kl_loss"] = masked_mean(kl.detach(), rmask)  # stats are token means, as policy_loss's
    return loss, logprobs, stats


def micro_batch_loss(model, exp: Experience, mb: torch.Tensor, pc: PPOConfig, kl_coef: float, update_policy: bool,
                     weight: float, gap: bool, rows: slice) -> tuple[torch.Tensor, dict]:
    """:func:`minibatch_loss` of ``mb[rows]`` scaled by its share of the minibatch (in
    ``pc.loss_type``'s unit) and ``weight``, the stats by its share of the tokens. An empty
    ``mb[rows]`` runs one row at weight 0: every process makes the same collectives."""
    sub = mb[rows]
    empty = len(sub) == 0
    if empty:
        sub = mb[:1] if len(mb) else torch.zeros(1, dtype=torch.long, device=mb.device)
    rmask = exp.response_mask[sub]
    loss, logprobs, stats = minibatch_loss(model, exp, sub, pc, kl_coef, update_policy)
    # each share is 1 when the micro-batch is the minibatch
    share = 0.0 if empty else rmask.sum() / exp.response_mask[mb].sum()
    loss_share = 0.0 if empty else (aggregation_count(rmask, pc.loss_type)
                                    / aggregation_count(exp.response_mask[mb], pc.loss_type))
    stats = {k: v * share for k, v in stats.items()}
    if gap:
        stats["policy/logprob_gap"] = torch.where(rmask.bool(), (logprobs.detach() - exp.old_logprobs[sub]).abs(),
                                                  0.0).max() * (not empty)
    return loss * loss_share * weight, stats


def minibatch_order(B: int, G: int, generator: torch.Generator | None) -> torch.Tensor:
    """One epoch's shuffled order of the *global* batch's ``B`` rows in blocks of ``G`` (a
    prompt's rows, and a GRPO group's zero-sum advantages, stay in one minibatch). Every process
    draws the same order, so a minibatch holds the same rows whatever the number of processes."""
    G = G if G > 1 and B % G == 0 else 1
    return (torch.randperm(B // G, generator=generator)[:, None] * G + torch.arange(G)).flatten()  # [B]


def ppo_update(
    ac: ActorCritic, optimizer, exp: Experience, pc: PPOConfig, kl_coef: float, update_policy: bool = True,
    generator: torch.Generator | None = None, engine: Engine | None = None, logprob_gap: bool = False,
    off_heap: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """``ppo_epochs`` passes over shuffled minibatches, ``pc.micro_batch_size`` rows a pass; the
    per-minibatch stats. ``update_policy=False``: the critic warm-up. ``exp`` holds this process's
    rows, weighted so the gradient and stats are the global minibatch's."""
    engine = engine or Engine(guard=UpdateGuard(where=pc.algo))
    model = engine.model if engine.model is not None else ac
    shard = engine.shard
    b = exp.input_ids.shape[0]  # this process's rows
    B, M = b * shard.world, pc.minibatch_size * shard.world  # the global batch and minibatch
    G = completions_per_prompt(pc)
    micro = pc.micro_batch_size
    all_stats = []
    order = None
    # CPU: the gradients in one buffer off the C heap, so they do not pin the activations' holes
    # (not where the engine places them itself)
    own_grads = getattr(engine.accelerator, "distributed_type", "NO") not in ("FSDP", "DEEPSPEED")
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    # CPU, on request: the activations off the C heap too, so what a micro-batch frees is not kept as holes
    off_heap = off_heap and any(p.device.type == "cpu" for p in trained)
    # the clipped groups, listed once rather than walked through the modules at every minibatch
    policy_params, critic_params = list(ac.policy.parameters()), ac.critic_parameters()
    with gradient_buffer(trained, enabled=own_grads), tensors_off_heap(enabled=off_heap):
        for _ in range(pc.ppo_epochs):
            if order is None or pc.minibatch_draw == "epoch":  # 'rollout': one partition, kept for every epoch
                order = minibatch_order(B, G, generator)
            for rows in order.split(M):
                mb = shard.local_rows(rows, b).to(exp.input_ids.device)
                most = max(shard.rows_per_process(rows, b))
                weight = shard.token_weight(exp.response_mask[mb])  # 1 with one process
                # the loss's own unit (tokens or rows: core.aggregation_count); the token weight's for a token mean
                loss_weight = shard.count_weight(aggregation_count(exp.response_mask[mb], pc.loss_type)) \
                    if AGGREGATIONS[pc.loss_type].unit != "tokens" else weight
                engine.zero_grad(optimizer)
                # no optimizer step yet on the first minibatch: the gap is to the policy that sampled
                gap = logprob_gap and not all_stats
                step = functools.partial(micro_batch_loss, model, exp, mb, pc, kl_coef, update_policy, loss_weight, gap)
                with compute_weights(model):  # model.master_weights: bf16 copies of this step's weights
                    loss, stats = engine.accumulate(len(mb), micro, step, maxed=GAP,
                                                    passes=-(-most // micro) if micro else 1)
                # every term is a token mean over the response mask but the gap
                stats = shard.mean(stats, weight, maxed=GAP)
                stats["policy/grad_norm"] = engine.clip(policy_params, pc.max_grad_norm)
                if ac.has_critic:
                    stats["value/grad_norm"] = engine.clip(critic_params, pc.max_grad_norm)
                if engine.guard.ok(loss, stats["policy/grad_norm"], stats.get("value/grad_norm", 0.0)):
                    engine.step(optimizer)
                all_stats.append(stats)
    # the last step's gradients are spent: freed now, not held through the next rollout (as TRL's Trainer)
    engine.zero_grad(optimizer)
    return all_stats


def sampler(run: Run, ac: ActorCritic, train_ac, tok, step: int | None, max_new_tokens: int):
    """``sample(turn, ids, mask, rows, n)``: ``n`` tokens after the left-padded contexts of this
    process's batch rows ``rows`` (None: all), drawn with the uniforms of ``(seed, step, turn)``
    (:func:`~rlhfkit.run.distributed.rollout_uniforms`); greedy when ``step`` is None."""
    cfg, pc = run.cfg, run.cfg.ppo

    def sample(turn: int, ids, mask, rows=None, n: int = max_new_tokens):
        u = None
        if step is not None:
            # draws keyed to (seed, step, turn, global row): the same samples with any number of processes
            u = rollout_uniforms(cfg.run.seed, step, pc.batch_size, max_new_tokens, run.shard.span(pc.batch_size), turn)
            u = (u if rows is None else u[rows])[:, :n].to(run.device)
        # the unwrapped policy (FSDP: root weights gathered); eval keeps the KV cache under checkpointing
        with eval_mode(ac.policy), full_weights(train_ac):
            return generate(ac.policy, ids, mask, n, eos_token_ids(ac.policy, tok), tok.pad_token_id,
                            pc.temperature, greedy=step is None, uniforms=u,
                            value_head=ac.value_head if cfg.accel.reuse_rollout_logprobs and step is not None else None,
                            stop=pc.stop, tokenizer=tok, graph=cfg.accel.cuda_graph, **sampling_settings(pc))

    return sample


def rollout(run: Run, ac: ActorCritic, train_ac, tok, records, step: int | None, max_new_tokens: int,
            env: EpisodeMaker | None = None) -> tuple[Rollout, dict]:
    """Sample this process's rows of the step's batch: one completion per record, or with an
    environment one episode per record (:func:`rlhfkit.envs.environment.play`); and the episodes' stats."""
    sample = sampler(run, ac, train_ac, tok, step, max_new_tokens)
    if env is None:
        return sample(0, *prompt_tensors(tok, records, run.device)), {}
    episodes = [env(record, tok) for record in records]
    roll = play(episodes, sample, tok, max_new_tokens, run.device)
    return roll, episode_stats(episodes, roll)


def evaluate(run: Run, ac: ActorCritic, train_ac, tok, data: PromptData, reward: Reward,
             max_new_tokens: int, env: EpisodeMaker | None = None) -> dict[str, float]:
    """Held-out metrics: the task's verifier's, the held-out records' rewards, or an environment's
    mean greedy return (``eval/reward``); nothing without held-out prompts."""
    cfg = run.cfg
    if env is not None:
        if not data.eval_records:
            return {}
        returns = []
        with full_weights(*reward.models):
            for i in range(0, len(data.eval_records), cfg.eval.batch_size):
                chunk = data.eval_records[i : i + cfg.eval.batch_size]
                roll, _ = rollout(run, ac, train_ac, tok, chunk, None, cfg.eval.max_new_tokens or max_new_tokens, env)
                # a reward function's None scores nothing here: the episode's return scores it (final_scores)
                returns += reward.score(roll, chunk)[0].nan_to_num(0.0).add(roll.turn_rewards.sum(-1)).tolist()
        return {"eval/reward": sum(returns) / len(returns)}
    if data.task is None and not data.eval_records:
        return {}  # before the block: no gathered weights, no master-weight copies for nothing
    with full_weights(train_ac, *reward.models):
        if data.task is not None:
            ev = evaluate_sharded(data.task, ac.policy, tok, run.device, run.shard, cfg.eval.batch_size,
                                  cfg.eval.max_new_tokens, cfg.ppo.stop)
            return {"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"]}
        return evaluate_rewards(ac.policy, tok, data.eval_records, reward, run.device, run.shard,
                                cfg.eval.batch_size, cfg.eval.max_new_tokens or max_new_tokens, cfg.eval.greedy,
                                cfg.ppo.temperature, cfg.run.seed, sampling_settings(cfg.ppo), cfg.ppo.stop)


def held_out(s: RLSetup) -> dict[str, float]:
    """:func:`evaluate` of the run's policy."""
    return evaluate(s.run, s.ac, s.train_ac, s.tok, s.data, s.scorer, s.pc.max_new_tokens, s.env)
