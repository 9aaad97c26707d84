"""Policy optimisation for language models: PPO, GRPO, RLOO and REINFORCE in one loop.

PPO has four roles: actor, critic, reward model, reference. GRPO, RLOO and REINFORCE drop
the critic and differ only in the advantage estimator
(:func:`rlhfkit.experience.sequence_advantages`); the rollout, experience and update code is
shared. One loop, read top to bottom in :func:`train_rl`:

    1. rollout     sample responses from left-padded prompts (KV cache)        rollout.generate
    2. experience  one no-grad pass: old log-probs, reference log-probs, values,
                   reward scores -> shaped rewards -> GAE (or a group baseline) experience.make_experience
    3. update      ppo_epochs x shuffled minibatches: clipped policy loss +
                   vf_coef * clipped value loss - entropy_coef * entropy        ppo_update
    4. log         every diagnostic (docs/design.md), sample completions
    5. evaluate    greedy completions of the held-out prompts, every eval_every steps
    6. checkpoint  every run.checkpoint_every steps (exact resume)

Where the score lands: :func:`rlhfkit.core.shaped_rewards` adds it to the last valid
response token -- the EOS when one was emitted, else the last sampled token.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
import warnings

import torch
from safetensors.torch import save_file

from ..callables import check_before_loading
from ..checkpoint import fault_point, latest_checkpoint
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
    token_policy_loss,
    value_loss,
)
from ..distributed import full_state_dict, full_weights, rollout_uniforms, shard_frozen
from ..envs import EpisodeMaker, episode_stats, play
from ..evaluate import evaluate_rewards, evaluate_sharded
from ..experience import (
    ActorCritic,
    Experience,
    RLState,
    completions_per_prompt,
    deferred_stats,
    make_experience,
)
from ..models import (
    ValueHead,
    add_lora,
    context_window,
    disable_dropout,
    enable_gradient_checkpointing,
    eval_mode,
    load_scalar_model,
    load_tokenizer,
    policy_with_reference,
    quiet_load_report,
    resolve_dtype,
)
from ..offload import HostMoments, offload_frozen
from ..precision import compute_weights, keep_master_weights
from ..prompts import PromptData, prompt_data, prompt_tensors
from ..rewards import Reward, build_reward, other_tokenizer
from ..rollout import Rollout, decode_responses, eos_token_ids, generate, sampling_settings
from ..tasks import get_task
from ..trajectories import TrajectoryWriter
from ..utils import (
    UpdateGuard,
    cut_file,
    file_size,
    gradient_buffer,
    mean_stats,
    release_free_memory,
    tensors_off_heap,
)
from .common import Engine, Run, lr_scale


def surrogate_options(pc: PPOConfig) -> SurrogateOptions:
    """The policy objective's knobs from the config: ``ppo.epsilon_high`` is the clipped losses'
    upper clip and cispo's cap (unset there: 5.0), as in TRL."""
    if pc.loss_type == "cispo":
        return SurrogateOptions(cap=5.0 if pc.epsilon_high is None else pc.epsilon_high)
    return SurrogateOptions(clip_low=pc.clip_range, clip_high=pc.epsilon_high, temperature_pos=pc.sapo_temperature_pos,
                            temperature_neg=pc.sapo_temperature_neg)


# the policy's per-token loss (policy objective, KL term, entropy bonus) computed inside the
# chunked LM head, whose logits are then built once instead of again in the backward
# (logprobs.chunked_token_loss); False: always from the returned log-probs
FUSED_TOKEN_LOSS = True


def policy_token_loss(exp: Experience, mb: torch.Tensor, pc: PPOConfig, kl_coef: float):
    """The policy's part of :func:`minibatch_loss` (objective, KL term, entropy bonus) as
    ``fn(logp, ent, s, e)``: the part of the aggregated loss that the flattened ``[b * R]``
    positions ``s .. e-1`` contribute, from their log-probs and entropies alone
    (:func:`rlhfkit.models.token_logprobs`). Each aggregation is linear in the per-token
    losses, so its weight for each token (what autograd gives as ``d aggregate / d x``) turns
    it into a sum over tokens. None where a token's loss reads other tokens (a sequence-level
    importance ratio)."""
    if pc.importance_sampling_level != "token":
        return None
    objective, options = policy_objective(pc.loss_type), surrogate_options(pc)._replace(clip_low=pc.clip_range)
    kind, coef = (pc.kl_estimator, kl_coef) if pc.kl_in_loss else ("k3", pc.forward_kl_coef)

    @functools.cache  # built on the first call: a forward whose head is not chunked (a small vocabulary) never calls it
    def per_token():
        rmask = exp.response_mask[mb]
        with torch.enable_grad():
            x = torch.zeros(rmask.shape, dtype=exp.old_logprobs.dtype, device=rmask.device, requires_grad=True)
            weights = torch.autograd.grad(aggregate(x, rmask, pc.loss_type, pc.max_new_tokens or 0), x)[0].flatten()
        ref = exp.ref_logprobs[mb].flatten() if (pc.kl_in_loss or coef) else None
        return (weights, rmask.bool().flatten(), exp.old_logprobs[mb].flatten(),
                exp.advantages[mb].expand_as(rmask).flatten(), ref)

    def fn(logp, ent, s, e):
        weights, valid, old, adv, ref = per_token()
        v = valid[s:e]
        # deferred: the old log-probs are this forward's own (no optimizer step since the rollout)
        per = token_policy_loss(logp, logp.detach() if exp.deferred else old[s:e], adv[s:e], v, objective, options)
        if ref is not None:
            per = per + coef * kl_estimate(logp, ref[s:e], kind)
        if ent is not None and pc.entropy_coef:  # a deferred experience may ask for the entropies for its stats
            per = per - pc.entropy_coef * ent
        return (weights[s:e] * torch.where(v, per, torch.zeros_like(per))).sum()

    return fn


def minibatch_loss(ac_model, exp: Experience, mb: torch.Tensor, pc: PPOConfig, kl_coef: float,
                   update_policy: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(loss, logprobs [b, R], stats)`` of minibatch rows ``mb``: the clipped value loss, and
    unless it is a critic warm-up the clipped policy loss, the entropy bonus and the KL term.
    Every part is a per-token loss reduced by the one aggregation ``pc.loss_type``
    (:func:`rlhfkit.core.aggregate`; TRL aggregates its policy + KL per-token loss alike).

    Where the LM head is taken in chunks (a big vocabulary), the policy's part is computed
    inside it (:func:`policy_token_loss`; the same loss, each chunk's logits built once): the
    log-probs then come back without a gradient and the parts below give the stats only.

    A deferred experience (:func:`rlhfkit.experience.defer_old_logprobs`) takes this forward's
    log-probs, detached, as the old ones (the policy has not stepped since it sampled), and gets
    them written into its ``old_logprobs`` rows (and the entropies into ``entropy``'s where the
    rollout had none: ``entropy_pending``)."""
    rmask = exp.response_mask[mb]
    agg = functools.partial(aggregate, mask=rmask, kind=pc.loss_type, max_len=pc.max_new_tokens or 0)
    with_entropy = update_policy and bool(pc.entropy_coef)
    token_loss = policy_token_loss(exp, mb, pc, kl_coef) if update_policy and FUSED_TOKEN_LOSS else None
    # log-probs (and entropies) of the chosen tokens straight from the forward: a big vocabulary's
    # [b, R, V] logits are never held whole (models.token_logprobs)
    out = ac_model(exp.input_ids[mb], exp.attention_mask[mb], exp.prompt_len, pc.temperature,
                   detach_value=not update_policy, response_ids=exp.response_ids[mb],
                   entropy=with_entropy or exp.entropy_pending,
                   **({} if token_loss is None else {"token_loss": token_loss}))  # [b, R] each
    logprobs, entropy, values = out[:3]
    fused = out[3] if len(out) > 3 else None  # a forward that ignores token_loss returns three
    loss, stats = torch.zeros((), device=logprobs.device), {}
    if exp.deferred:
        exp.old_logprobs[mb] = logprobs.detach()
        if exp.entropy_pending:
            exp.entropy[mb] = entropy.detach()
    if values is not None:
        v_loss, stats = value_loss(values, exp.old_values[mb], exp.returns[mb], rmask, pc.value_clip_range,
                                   pc.loss_type, pc.max_new_tokens or 0)
        loss = pc.vf_coef * v_loss
    p_loss, p_stats = policy_loss(logprobs, exp.old_logprobs[mb], exp.advantages[mb], rmask, pc.clip_range,
                                  pc.loss_type, pc.max_new_tokens or 0, pc.importance_sampling_level,
                                  policy_objective(pc.loss_type), surrogate_options(pc))
    stats.update(p_stats)
    if update_policy:
        loss = loss + (p_loss if fused is None else fused)
        if with_entropy and fused is None:
            loss = loss - pc.entropy_coef * agg(entropy)
        # the KL as the loss term (kl_in_loss), or beside the reward's KL a k3 term (forward_kl_coef)
        kind, coef = (pc.kl_estimator, kl_coef) if pc.kl_in_loss else ("k3", pc.forward_kl_coef)
        if pc.kl_in_loss or coef:
            kl = kl_estimate(logprobs, exp.ref_logprobs[mb], kind)  # [b, R]
            if fused is None:
                loss = loss + coef * agg(kl)
            stats["policy/kl_loss"] = masked_mean(kl.detach(), rmask)  # stats are token means, as policy_loss's
    return loss, logprobs, stats


def micro_batch_loss(model, exp: Experience, mb: torch.Tensor, pc: PPOConfig, kl_coef: float, update_policy: bool,
                     weight: float, gap: bool, rows: slice) -> tuple[torch.Tensor, dict]:
    """:func:`minibatch_loss` of the micro-batch ``mb[rows]``: the loss scaled by its share of the
    minibatch's tokens or rows, whichever ``pc.loss_type`` averages over
    (:func:`rlhfkit.core.aggregation_count`), and by the process's ``weight`` in that unit; the
    stats (token means) by its share of the minibatch's response tokens; with ``gap`` the stats
    add ``policy/logprob_gap``, the largest |log-prob - old log-prob| over its tokens.

    An empty ``mb[rows]`` (this process holds fewer of the minibatch's rows than another one)
    runs one of its rows with weight 0: every process then makes the same forward and backward
    calls, whose collectives (DDP's gradient all-reduce, FSDP's all-gathers) must pair up, and
    reports the same stats keys, at zero."""
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
    """One epoch's shuffled order of the *global* batch's ``B`` rows, in blocks of ``G`` rows (a
    prompt's rows stay together: its prompt is then computed once per minibatch,
    models.response_hidden, and a GRPO group's zero-sum advantages stay in one gradient step).
    Every process draws the same order (same seed, same draws), so a minibatch holds the same
    rows whatever the number of processes; each process then takes the rows it holds."""
    G = G if G > 1 and B % G == 0 else 1
    return (torch.randperm(B // G, generator=generator)[:, None] * G + torch.arange(G)).flatten()  # [B]


def ppo_update(
    ac: ActorCritic, optimizer, exp: Experience, pc: PPOConfig, kl_coef: float, update_policy: bool = True,
    generator: torch.Generator | None = None, engine: Engine | None = None, logprob_gap: bool = False,
    off_heap: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """``ppo_epochs`` passes over shuffled minibatches; returns per-minibatch stats in order.

    ``update_policy=False`` is the critic warm-up: only the value loss is applied (and with a
    shared head it stops at the head). ``engine`` (:class:`~rlhfkit.trainers.common.Engine`)
    runs the backward and the clipping and skips NaN/inf updates. Data parallel, ``exp`` holds
    this process's rows of the global batch, its model is ``ac`` as prepared by accelerate (DDP,
    FSDP) and ``pc.minibatch_size`` the per-process share: the minibatches are drawn over the
    global batch (:func:`minibatch_order`), each process computes the loss of the minibatch's
    rows it holds, and its shard rescales the loss by its share of the minibatch's tokens (or
    rows, for a ``pc.loss_type`` that averages over rows), so the synchronised gradient, and the
    reduced stats, are those of the global minibatch, as one process computes it (the synchronised gradient norms make every process's
    guard decide alike). ``logprob_gap``: the first minibatch's stats add ``policy/logprob_gap``,
    the largest |log-prob - old log-prob| over its tokens before any update (the old ones came
    from the sampler: :func:`rlhfkit.experience.reuse_rollout`). ``pc.micro_batch_size`` rows of
    a minibatch at a time go through the forward and backward passes, their gradients
    accumulated into the minibatch's (:meth:`~rlhfkit.trainers.common.Engine.accumulate`); every
    process makes as many passes as the one holding the most rows of the minibatch. ``off_heap``
    (``accel.update_off_heap``): the CPU update's tensors off the C heap.
    """
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
                step = functools.partial(micro_batch_loss, model, exp, mb, pc, kl_coef, update_policy, loss_weight,
                                         gap)
                n_passes = -(-most // micro) if micro else 1
                with compute_weights(model):  # model.master_weights: bf16 copies of this step's weights
                    loss, stats = engine.accumulate(len(mb), micro, step, maxed=("policy/logprob_gap",),
                                                    passes=n_passes)
                # every term is a token mean over the response mask but the gap
                stats = shard.mean(stats, weight, maxed=("policy/logprob_gap",))
                stats["policy/grad_norm"] = engine.clip(policy_params, pc.max_grad_norm)
                if ac.has_critic:
                    stats["value/grad_norm"] = engine.clip(critic_params, pc.max_grad_norm)
                if engine.guard.ok(loss, stats["policy/grad_norm"], stats.get("value/grad_norm", 0.0)):
                    engine.step(optimizer)
                all_stats.append(stats)
    # the last step's gradients are spent: free them now rather than at the next update's first
    # minibatch, so the rollout and the reference forward between updates do not hold a copy
    # of the trained weights' size (TRL's Trainer frees them after each step the same way)
    engine.zero_grad(optimizer)
    return all_stats


def build_models(cfg: Config, policy_path: str, device):
    """Load the roles. Returns ``(actor_critic, ref, scorer, tokenizer)``.

    The critic exists only for ``algo == 'ppo'``; the scorer is the reward model at
    ``reward.name`` or the callable at ``reward.function``. With LoRA (``model.lora_r``) the
    reference is the policy with its adapter disabled (no second copy). A reward model with
    its own tokenizer reads re-tokenised text; the critic reads the policy's tokens, so its
    source must share the policy's tokenizer.
    """
    pc, rc, mc = cfg.ppo, cfg.reward, cfg.model
    trc = mc.trust_remote_code
    tok = load_tokenizer(policy_path, trust_remote_code=trc)
    # RL compares the sampler's forward with the update's: every dropout off, the adapter's too
    policy, ref = policy_with_reference(policy_path, mc, device, adapter_dropout=False)
    scorer = build_reward(cfg, tok, device)
    if pc.algo != "ppo":
        ac = ActorCritic(policy)
    elif pc.value_model == "shared":
        hidden = policy.config.hidden_size
        ac = ActorCritic(policy, value_head=ValueHead(hidden).to(device))
    else:
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
        ac = ActorCritic(policy, critic=critic.to(device).train())
    return ac, ref, scorer, tok


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
    """ppo (the algorithm with a critic): refuse a critic warm-up as long as the run, which would
    save the policy it started from, and warn when it takes more than half of the steps. Steps
    count from the start of the run, a resumed one's too, so the check holds at a resume."""
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


def make_optimizer(ac: ActorCritic, pc: PPOConfig) -> torch.optim.Optimizer:
    """AdamW over the actor's trainable weights (``ppo.lr``) and the critic's (``ppo.value_lr``)."""
    groups = [{"params": [p for p in ac.policy.parameters() if p.requires_grad], "lr": pc.lr}]
    if ac.has_critic:
        groups.append({"params": ac.critic_parameters(), "lr": pc.value_lr})
    return torch.optim.AdamW(groups, weight_decay=0.0, fused=True)  # one kernel per step, ~20% faster on CPU


def set_lr(optimizer, pc: PPOConfig, step: int) -> float:
    """Learning rates for ``step`` after ``ppo.warmup_steps`` (or ``ppo.warmup_ratio`` of the steps)
    under ``ppo.lr_schedule`` (the groups of :func:`make_optimizer`); returns the actor's."""
    warmup = pc.warmup_steps or math.ceil(pc.warmup_ratio * pc.steps)
    scale = lr_scale(step, pc.steps, warmup, pc.lr_schedule)
    for group, lr in zip(optimizer.param_groups, (pc.lr, pc.value_lr)):
        group["lr"] = lr * scale
    return pc.lr * scale


def sampler(run: Run, ac: ActorCritic, train_ac, tok, step: int | None, max_new_tokens: int):
    """``sample(turn, ids, mask, rows, n)``: ``n`` tokens (at most ``max_new_tokens``) after the
    left-padded contexts of this process's batch rows ``rows`` (None: all), drawn with the
    uniforms of ``(seed, step, turn)`` (:func:`~rlhfkit.distributed.rollout_uniforms`); greedy
    when ``step`` is None (held-out evaluation)."""
    cfg, pc = run.cfg, run.cfg.ppo

    def sample(turn: int, ids, mask, rows=None, n: int = max_new_tokens):
        u = None
        if step is not None:
            # draws keyed to (seed, step, turn, global row): the same samples with any number of processes
            u = rollout_uniforms(cfg.run.seed, step, pc.batch_size, max_new_tokens, run.shard.rows(pc.batch_size), turn)
            u = (u if rows is None else u[rows])[:, :n].to(run.device)
        # the unwrapped policy (FSDP: root weights gathered); eval keeps the KV cache under checkpointing
        with eval_mode(ac.policy), full_weights(train_ac):
            return generate(ac.policy, ids, mask, n, eos_token_ids(ac.policy, tok), tok.pad_token_id,
                            pc.temperature, greedy=step is None, uniforms=u,
                            value_head=ac.value_head if pc.reuse_rollout_logprobs and step is not None else None,
                            stop=pc.stop, tokenizer=tok, graph=cfg.accel.cuda_graph, **sampling_settings(pc))

    return sample


def rollout(run: Run, ac: ActorCritic, train_ac, tok, records, step: int | None, max_new_tokens: int,
            env: EpisodeMaker | None = None) -> tuple[Rollout, dict]:
    """Sample this process's rows of the step's batch: one completion per record, or with an
    environment one episode per record (:func:`rlhfkit.envs.play`); and the episodes' stats."""
    sample = sampler(run, ac, train_ac, tok, step, max_new_tokens)
    if env is None:
        return sample(0, *prompt_tensors(tok, records, run.device)), {}
    episodes = [env(record, tok) for record in records]
    roll = play(episodes, sample, tok, max_new_tokens, run.device)
    return roll, episode_stats(episodes, roll)


def evaluate(run: Run, ac: ActorCritic, train_ac, tok, data: PromptData, reward: Reward,
             max_new_tokens: int, env: EpisodeMaker | None = None) -> dict[str, float]:
    """Held-out metrics: a built-in task's verifier (``eval/format_acc``, ``eval/exact_acc``), or
    the rewards on the held-out prompt records (``eval/reward``, ``eval/reward/<source>``,
    ``eval/accuracy``); with an environment, the mean return of greedy episodes of the
    held-out records (``eval/reward``); nothing when there are none."""
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


# what an empty ppo.stop_metric means: the first of these that the run's evaluation logs
DEFAULT_STOP_METRICS = ("eval/exact_acc", "eval/accuracy", "eval/reward")


def choose_stop_metric(pc: PPOConfig, baseline: dict[str, float]) -> str:
    """The held-out metric the run stops on (and keeps the best of), given the metrics of its
    first evaluation (``baseline``; empty when it has no held-out prompts): ``ppo.stop_metric``,
    which must be among them, or, when that is empty, the first of DEFAULT_STOP_METRICS logged
    ("" when none is: a warning if ppo.stop_at asks to stop)."""
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
    """The held-out metrics :func:`evaluate` logs for this run."""
    if env is not None:
        return {"eval/reward"} if data.eval_records else set()
    if data.task is not None:
        return {"eval/format_acc", "eval/exact_acc"}
    if not data.eval_records:
        return set()
    return {"eval/reward", *(f"eval/reward/{name}" for name in reward.weights),
            *(["eval/accuracy"] if reward.accuracy_sources() else [])}


def write_samples(fh, step: int, prompts, exp: Experience, tok, k: int) -> None:
    """The first ``k`` rows' prompts, completions and scores (decoded only for those rows)."""
    texts = decode_responses(tok, exp.response_ids[:k], exp.attention_mask[:k, exp.prompt_len :])  # observations kept
    for p, c, s in zip(prompts[:k], texts, exp.score[:k].tolist()):
        fh.write(json.dumps({"step": step, "prompt": p.text, "response": c, "score": round(s, 4)},
                            ensure_ascii=False) + "\n")


def open_outputs(run: Run, resumed: dict):
    """``samples.jsonl`` (sample completions) and the trajectory writer, cut back to a resumed
    checkpoint's offsets; on other processes than the main one, sinks that write nothing."""
    pc = run.cfg.ppo
    if resumed and run.is_main:
        cut_file(run.out / "samples.jsonl", resumed["samples_offset"])
    samples = open(run.out / "samples.jsonl" if run.is_main else os.devnull, "a" if resumed else "w",
                   encoding="utf-8")
    trajectories = TrajectoryWriter(run.out / "trajectories.jsonl", pc.trajectories_every if run.is_main else 0,
                                    pc.trajectories_per_step,  # the main process's rows: the batch's first
                                    resumed.get("trajectories_offset"))
    return samples, trajectories


def refuse_untested_engines(accelerator, cfg: Config) -> None:
    """Stop, with the reason and before any work, where DeepSpeed would fail late or run RL
    differently from one process (measured on two CPU processes against the 1-process run;
    docs/scale-out.md), or where an option differs from it. Every RL command runs under
    FSDP2, LoRA included."""
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


def start_offload(run: Run, optimizer, *frozen) -> HostMoments | None:
    """``accel.offload``: the frozen models' weights to host memory now (:mod:`rlhfkit.offload`) and
    the optimizer's moments each step (the returned :class:`~rlhfkit.offload.HostMoments`)."""
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


def train_rl(cfg: Config, policy_path: str | None = None, reward_path: str | None = None) -> dict:
    """Run ``cfg.ppo.algo`` (ppo, grpo, rloo or reinforce) on the prompts of ``data.path``, or of
    the built-in task (``run.task``) when it is unset.

    Writes metrics, samples, trajectories, plots and the trained models under ``run.out_dir``; stops
    early once the held-out metric ``ppo.stop_metric`` reaches ``ppo.stop_at`` (the starting
    policy is evaluated first: ``baseline/eval/*`` in step 0's row). Under
    ``accelerate launch`` each process takes its shard of every batch (``ppo.batch_size`` and
    ``ppo.minibatch_size`` are global) and the main process writes the files.
    """
    policy_path = policy_path or cfg.model.name
    cfg = cfg.replace(reward={"name": reward_path}) if reward_path else cfg
    repeats, pc = check_rl_config(cfg, policy_path), cfg.ppo
    check_before_loading(cfg)
    run = Run(cfg, pc.algo, pc.steps)
    refuse_untested_engines(run.accelerator, cfg)
    shard = run.shard
    shard.local_size(pc.batch_size, "ppo.batch_size", repeats)  # whole groups on every process
    local_pc = dataclasses.replace(pc, minibatch_size=shard.local_size(pc.minibatch_size, "ppo.minibatch_size"))
    ac, ref, scorer, tok = build_models(cfg, policy_path, run.device)
    # the learning rates left unset by model.regime (the critic's only when there is one)
    rates = run.learning_rates(ac.policy, "ppo.lr", *(["ppo.value_lr"] if ac.has_critic else []))
    pc, local_pc = (dataclasses.replace(c, lr=rates["ppo.lr"], value_lr=rates.get("ppo.value_lr"))
                    for c in (pc, local_pc))
    optimizer = make_optimizer(ac, pc)
    # DDP under accelerate launch (ac itself otherwise); generation and the experience pass use ac
    train_ac, optimizer = run.prepare(ac, optimizer, micro_batch=local_pc.minibatch_size)
    shard_frozen(run.accelerator, ref, *scorer.models)  # FSDP: no whole copy of them per process
    engine = run.engine(train_ac)
    moments = start_offload(run, optimizer, ref, *scorer.models)
    # a critic warm-up's backward leaves the actor out: under DDP it goes around the wrapper (whose
    # reducer would otherwise need find_unused_parameters=True on every step) and the critic's
    # gradients are averaged as DDP averages them
    warm_engine = dataclasses.replace(engine, model=None, sync=tuple(ac.critic_parameters())) \
        if isinstance(train_ac, torch.nn.parallel.DistributedDataParallel) else engine
    # prompts + new tokens must fit the models' context: checked (or cut) here, before the first step
    context = context_window(ac.policy, ac.critic)
    data = prompt_data(cfg, tok, get_task(cfg.run.task), context)
    env = EpisodeMaker(cfg.env, context) if cfg.env.cls else None
    max_new_tokens = pc.max_new_tokens or data.task.MAX_NEW_TOKENS  # check_rl_config: set with data.path
    # resolved: loss_type=dr_grpo divides by it, the over-long penalty ramps up to it
    pc, local_pc = (dataclasses.replace(c, max_new_tokens=max_new_tokens) for c in (pc, local_pc))
    # step 0. baseline: the held-out evaluation of the starting policy, before anything is written;
    # it names the metric the run stops on (a resumed run's checkpoint has it)
    resuming = cfg.run.resume and latest_checkpoint(run.out) is not None
    baseline = {} if resuming else evaluate(run, ac, train_ac, tok, data, scorer, max_new_tokens, env)
    st = RLState(pc, None if resuming else choose_stop_metric(pc, baseline), len(data.eval_records or ()))
    if pc.keep_best and not st.stop_metric:
        raise ValueError("ppo.keep_best=true keeps the best-evaluated policy, but this run has no held-out prompts "
                         "to evaluate: set data.eval_path or data.eval_fraction")
    best = BestWeights(ac) if pc.keep_best else None
    evaluations = pc.steps // pc.eval_every + bool(pc.steps % pc.eval_every) if pc.eval_every else 1
    # run.resume: every weight, optimizer moment, RNG, the data position and the counters
    # come back from the newest checkpoint, so the steps after it repeat those of an unbroken run
    resumed = run.restore({"actor_critic": ac}, {"optimizer": optimizer}, data=data.train)
    if resumed:
        st.load_state_dict(resumed)
    st.watch.announce(eval_metrics(data, scorer, env), evaluations)  # one warning naming the guards that are off
    samples, trajectories = open_outputs(run, resumed)
    shown = baseline.get(st.stop_metric, math.nan)  # the progress line's last evaluated value
    for step in run.steps():
        t0 = time.perf_counter()
        if moments is not None:  # accel.offload: AdamW's moments wait in host memory until the update
            moments.to_host()
        # step 1. rollout: grpo / rloo take each prompt G times in a row, the grouping the baselines expect
        records = shard.take([r for r in data.train.batch(pc.batch_size // repeats) for _ in range(repeats)])
        release_free_memory()  # each phase's peak resident set its own, not the last phase's freed heap
        roll, episode = rollout(run, ac, train_ac, tok, records, step, max_new_tokens, env)
        fault_point("rollout", step)
        t1 = time.perf_counter()
        # step 2. experience: scores, reference log-probs, values -> advantages and returns
        release_free_memory()
        # FSDP: the forwards below call the modules themselves; model.master_weights: the policy's
        # bfloat16 copies are made in the experience pass, only when it runs the policy (the
        # reference and reward models are never master-weight models)
        with full_weights(train_ac, ref, *scorer.models, compute=False):
            exp, stats = make_experience(ac, ref, scorer, roll, pc, st.kl_coef, st.reward_stats, shard, records)
        stats = shard.mean({**stats, **episode}, maxed=("policy/logprob_gap",))
        t2 = time.perf_counter()
        # step 3. update: ppo_epochs x minibatches (a critic warm-up trains the value loss alone)
        warm = ac.has_critic and step < pc.critic_warmup_steps
        stats["policy/lr"] = set_lr(optimizer, pc, step)
        # rows left out (filter_zero_std_groups, mask_truncated_completions) leave every token mean
        train_exp = exp if exp.loss_rows is None else exp.select(exp.loss_rows)
        if moments is not None:
            moments.to_device()
        release_free_memory()
        if len(train_exp.input_ids):  # none kept: no update this step
            stats.update(mean_stats(ppo_update(ac, optimizer, train_exp, local_pc, st.kl_coef, update_policy=not warm,
                                               engine=warm_engine if warm else engine,
                                               logprob_gap="policy/logprob_gap" not in stats and not exp.deferred,
                                               off_heap=cfg.accel.update_off_heap)))
        if exp.deferred:  # the update's forward wrote the old log-probs: the stats that read them
            stats.update(shard.mean(deferred_stats(exp, roll.logprobs, pc, st.kl_coef, shard),
                                    maxed=("policy/logprob_gap",)))
        t3 = time.perf_counter()
        st.train_s += t3 - t0
        # step 4. log: timings, the adaptive KL coefficient, sample completions
        stats.update(step_timings(run, exp, t0, t1, t2, t3, st.train_s), **{"data/epoch": data.train.epoch})
        if step == 0:  # the evaluation before any update, beside step 0's own
            stats.update({f"baseline/{k}": v for k, v in baseline.items()})
        if pc.adaptive_kl:
            st.kl_coef = adaptive_kl_coef(st.kl_coef, stats["objective/kl"], pc.kl_target, pc.kl_horizon, pc.batch_size)
        write_samples(samples, step, records, exp, tok, pc.samples_per_log)
        # step 5. evaluate: greedy completions of the held-out prompts
        last = step == pc.steps - 1
        evaluated = bool(pc.eval_every and (step + 1) % pc.eval_every == 0) or last
        if evaluated:
            if moments is not None:  # the evaluation's rollouts need the moments no more than the step's
                moments.to_host()
            stats.update(evaluate(run, ac, train_ac, tok, data, scorer, max_new_tokens, env))
            shown = stats.get(st.stop_metric, shown)
            if best is not None:
                best.offer(step, stats.get(st.stop_metric))
            if st.reached is None and pc.stop_at and stats.get(st.stop_metric, -math.inf) >= pc.stop_at:
                st.reached = {"step": step, "steps": step + 1, "train_s": st.train_s}
        stats.update(st.watch.check(step, stats))  # reward-hacking signs: guard/* flags, one warning each
        st.signals.check(step, stats, max_new_tokens)  # most groups without reward variance, most cut: one warning each
        trajectories.maybe_write(step, last or st.reached is not None, exp, tok, pc, stats["objective/kl_coef"])
        metric = {st.stop_metric.rsplit("/", 1)[-1]: f"{shown:.3f}"} if st.stop_metric else {}
        run.log(step, stats, force=evaluated or st.reached is not None, score=f"{stats['objective/score']:.2f}",
                kl=f"{stats['objective/kl']:.3f}", **metric)
        if st.reached is not None:
            break
        # step 6. checkpoint
        fault_point("step_end", step)
        if run.due(step, last):
            samples.flush()
            run.checkpoint(step, last, **st.state_dict(), samples_offset=file_size(run.out / "samples.jsonl"),
                           trajectories_offset=trajectories.position())
    samples.close()
    trajectories.close()
    saved_step = st.reached["step"] if st.reached else pc.steps - 1  # the last step run
    if best is not None and best.step is not None and best.step != saved_step:
        best.restore()  # the best evaluation's weights, not the last step's, are saved
        saved_step = best.step
    return {**finish_rl(run, ac, tok, st), "saved_step": saved_step}


class BestWeights:
    """``ppo.keep_best``: a CPU copy of the trainable weights (policy, critic; a LoRA adapter
    only) of the best evaluation so far; higher is better."""

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


def step_timings(run: Run, exp: Experience, t0: float, t1: float, t2: float, t3: float, train_s: float) -> dict:
    """Seconds per phase, throughput and (on a GPU) the peak allocated memory."""
    row = {"time/rollout_s": t1 - t0, "time/experience_s": t2 - t1, "time/update_s": t3 - t2, "time/train_s": train_s,
           "throughput/tokens_per_s": int(exp.attention_mask.sum()) / (t3 - t0)}
    if run.device.type == "cuda":  # high-water mark of the tensors allocated so far (models, states, activations)
        row["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(run.device) / 2**30
    return row


def finish_rl(run: Run, ac: ActorCritic, tok, st: RLState) -> dict:
    """Save the trained models and the plots; the run's summary."""
    from ..plots import plot_ppo  # matplotlib only when a run finishes

    run.close()
    history = run.rows()  # read back, not kept per step: memory stays flat over a long run
    policy_dir = run.save_model(ac.policy, tok, "policy", adapter="policy_adapter")  # LoRA: merged in policy/
    if ac.critic is not None:
        run.save_model(ac.critic, tok, "value_model")
    elif ac.value_head is not None:
        head = full_state_dict(ac.value_head)  # FSDP: gathered on every process (a collective)
        if run.is_main:
            save_file(head or ac.value_head.state_dict(), str(run.out / "value_head.safetensors"))
    if run.is_main:
        plot_ppo(history, run.out)
    run.shard.wait()
    final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    return {"path": str(policy_dir), "seconds": st.train_s, "steps": history[-1]["step"] + 1, "reached": st.reached,
            "final": final}
