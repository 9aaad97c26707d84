"""Policy optimisation for language models: PPO, GRPO, RLOO and REINFORCE in one loop.

PPO has four roles: actor, critic, reward model, reference. GRPO, RLOO and REINFORCE drop
the critic and differ only in the advantage estimator (:func:`sequence_advantages`); the
rollout, experience and update code is shared. One loop, read top to bottom in
:func:`train_rl`:

    rollout     sample responses from left-padded prompts (KV cache)          rollout.generate
    experience  one no-grad pass: old log-probs, reference log-probs, values,
                reward scores -> shaped rewards -> GAE (or a group baseline)  make_experience
    update      ppo_epochs x shuffled minibatches: clipped policy loss +
                vf_coef * clipped value loss - entropy_coef * entropy          ppo_update
    log         every DESIGN.md diagnostic, samples, periodic greedy eval

Where the score lands: :func:`rlhfkit.core.shaped_rewards` adds it to the last valid
response token -- the EOS when one was emitted, else the last sampled token.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import kernels
from ..checkpoint import Checkpointer, cut_file, fault_point, file_size, loop_state, restore_loop_state
from ..config import Config, PPOConfig
from ..core import (
    adaptive_kl_coef,
    entropy_from_logits,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    shaped_rewards,
    value_loss,
)
from ..distributed import (
    Shard,
    clip_grad_norm,
    evaluate_sharded,
    full_state_dict,
    full_weights,
    prepare,
    rollout_uniforms,
)
from ..evaluate import decode_responses, tokenize_prompts
from ..models import (
    ValueHead,
    add_lora,
    disable_dropout,
    enable_gradient_checkpointing,
    eval_mode,
    freeze,
    load_scalar_model,
    load_tokenizer,
    policy_forward,
    policy_with_reference,
    quiet_load_report,
    same_tokenizer,
    save_policy,
    sequence_logits,
    sequence_scores,
    token_values,
    unwrap,
)
from ..rollout import Rollout, generate
from ..tasks import get_task
from ..trajectories import TrajectoryWriter
from ..utils import MetricsLogger, UpdateGuard, make_accelerator, mean_stats, progress, setup_run, to_float


@dataclass
class Experience:
    """A rollout plus everything the update needs; every ``[B, R]`` tensor is response-aligned.

    Fields:
        input_ids, attention_mask: ``[B, T]`` prompt + response (T = P + R).
        prompt_len:     P, the column where responses start.
        response_ids:   ``[B, R]`` actions a_t.
        response_mask:  ``[B, R]`` 1 up to and including the first EOS.
        old_logprobs:   ``[B, R]`` log pi_old(a_t|s_t), recomputed by the training forward.
        ref_logprobs:   ``[B, R]`` log pi_ref(a_t|s_t).
        old_values:     ``[B, R]`` V_old(s_t).
        score:          ``[B]`` reward-model score (after penalties/normalisation, before clip).
        rewards:        ``[B, R]`` shaped per-token rewards.
        advantages:     ``[B, R]`` GAE advantages (whitened if configured).
        returns:        ``[B, R]`` GAE returns (value targets).
        raw_advantages: ``[B, R]`` GAE advantages before whitening (PPO only; for the report).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    score: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    raw_advantages: torch.Tensor | None = None


class RunningMoments:
    """Running mean / std of scalar rewards (parallel Welford), for reward normalisation."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        n, mean = x.numel(), x.float().mean().item()
        m2 = ((x.float() - mean) ** 2).sum().item()
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / max(1, self.count - 1)) if self.count > 1 else 1.0


class ActorCritic(torch.nn.Module):
    """The trained models: the actor and a shared value head, a separate value model, or no
    critic at all (GRPO / RLOO / REINFORCE: values are then ``None``)."""

    def __init__(self, policy, value_head: ValueHead | None = None, critic=None):
        super().__init__()
        if value_head is not None and critic is not None:
            raise ValueError("give at most one of value_head (shared) or critic (separate)")
        self.policy, self.value_head, self.critic = policy, value_head, critic

    @property
    def has_critic(self) -> bool:
        return self.value_head is not None or self.critic is not None

    def forward(self, input_ids, attention_mask, prompt_len: int, temperature: float = 1.0, detach_value=False):
        """Response-aligned ``logits [B, R, V]`` (tempered) and ``values [B, R]``."""
        logits, values = policy_forward(self.policy, input_ids, attention_mask, prompt_len, self.value_head,
                                        detach_value)
        if self.critic is not None:
            values = self.critic_values(input_ids, attention_mask, prompt_len)  # [B, R]
        return logits / temperature, values

    def critic_values(self, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
        """A separate value model's ``values [B, R]`` (response-aligned)."""
        return token_values(self.critic, input_ids, attention_mask)[:, prompt_len - 1 : -1]

    def critic_parameters(self):
        return list((self.value_head or self.critic).parameters()) if self.has_critic else []


Scorer = Callable[[Rollout], torch.Tensor]


def retokenize(roll: Rollout, tokenizer, rm_tokenizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout in another model's vocabulary: ``(ids [B, T'], mask [B, T'])``.

    Prompt and response are decoded to text without special tokens, joined, and, where the
    response ended with the policy's EOS, closed with the reward model's own EOS; the text
    is then tokenised by ``rm_tokenizer`` (its BOS / template post-processing included)."""
    prompts = tokenizer.batch_decode(roll.prompt_ids, skip_special_tokens=True)
    lengths = roll.response_mask.sum(-1).tolist()
    responses = tokenizer.batch_decode([r[:n] for r, n in zip(roll.response_ids.tolist(), lengths)],
                                       skip_special_tokens=True)
    eos = rm_tokenizer.eos_token or ""
    texts = [p + r + (eos if done else "") for p, r, done in zip(prompts, responses, roll.finished.tolist())]
    enc = rm_tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=True)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def reward_model_scorer(reward_model, tokenizer=None, rm_tokenizer=None) -> Scorer:
    """Score = the reward model's scalar at the last attended token of prompt + response.

    With ``rm_tokenizer`` (a reward model whose vocabulary differs from the policy's) the
    texts are re-tokenised first (:func:`retokenize`); else the policy's ids are read as is."""

    def score(roll: Rollout) -> torch.Tensor:
        if rm_tokenizer is None:
            return sequence_scores(reward_model, roll.input_ids, roll.attention_mask)
        return sequence_scores(reward_model, *retokenize(roll, tokenizer, rm_tokenizer, roll.input_ids.device))

    return score


def classifier_scorer(classifier, tokenizer, label_fn: Callable[[str], int], rm_tokenizer=None) -> Scorer:
    """Score = the classifier's logit, at the last attended token, of the label the prompt asks
    for (seed 002's reward: a classifier of the answer's character set)."""

    def score(roll: Rollout) -> torch.Tensor:
        if rm_tokenizer is None:
            logits = sequence_logits(classifier, roll.input_ids, roll.attention_mask)  # [B, L]
        else:
            logits = sequence_logits(classifier, *retokenize(roll, tokenizer, rm_tokenizer, roll.input_ids.device))
        prompts = tokenizer.batch_decode(roll.prompt_ids, skip_special_tokens=True)
        labels = torch.tensor([label_fn(p) for p in prompts], device=logits.device)  # [B]
        return logits.gather(1, labels[:, None]).squeeze(1)  # [B]

    return score


def function_scorer(fn: Callable[..., list[float]], tokenizer) -> Scorer:
    """Score = ``fn(prompts, completions)`` on decoded text (a task verifier, a heuristic ...).

    Policy for a bad return value: stop with a ``ValueError`` naming the function and the fix --
    not exactly one number per completion, or any NaN/inf. Nothing is skipped or patched up: a
    NaN score would reach the advantages of the whole batch, and a silently dropped row would
    bias the baseline. A function that cannot judge a completion should give it a low score.
    """
    name = getattr(fn, "__module__", "?") + ":" + getattr(fn, "__qualname__", repr(fn))

    def score(roll: Rollout) -> torch.Tensor:
        prompts = tokenizer.batch_decode(roll.prompt_ids, skip_special_tokens=True)
        completions = decode_responses(tokenizer, roll.response_ids, roll.response_mask)
        values, n = fn(prompts, completions), len(completions)
        fix = f"return a list of {n} floats, one per completion, in order"
        try:
            out = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values), dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"reward function {name} returned {type(values).__name__} {str(values)[:60]!r}, "
                             f"not numbers: {fix}") from None
        if out.shape != (n,):
            raise ValueError(f"reward function {name} returned {out.numel()} scores (shape {tuple(out.shape)}) "
                             f"for {n} completions: {fix}")
        bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"reward function {name} returned {len(bad)} non-finite score(s) (NaN/inf) for {n} "
                             f"completions, e.g. {out[bad[0]].item()} for {completions[bad[0]]!r}: give every "
                             "completion a finite score (a low one if it cannot be judged)")
        return out.to(roll.response_ids.device)

    return score


def load_reward_function(spec: str) -> Callable[..., list[float]]:
    """``'package.module:name'`` -> the callable."""
    if ":" not in spec:
        raise ValueError(f"reward.function={spec!r} must look like 'package.module:function'")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.function={spec!r} cannot be loaded: {e}; the module must be importable "
                         "(installed or on PYTHONPATH) and define that name") from None
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r} is not callable")
    return fn


def sequence_advantages(score: torch.Tensor, pc: PPOConfig) -> torch.Tensor:
    """One advantage per completion for the critic-free estimators: ``[B] -> [B]``."""
    if pc.algo == "grpo":
        return group_advantages(score, pc.group_size, pc.scale_rewards)
    if pc.algo == "rloo":
        return rloo_advantages(score, pc.group_size)
    if pc.algo == "reinforce":
        return score - score.mean()
    raise ValueError(f"no sequence-level advantage for algo {pc.algo!r}")


EXPERIENCE_LOGITS = 2**28  # 1 GiB of float32 logits per experience forward chunk


def reuse_rollout(roll: Rollout, ac: ActorCritic, pc: PPOConfig) -> bool:
    """Whether :func:`make_experience` takes the old log-probs, entropies and (shared head)
    values from the rollout instead of a policy forward: allowed by ``ppo.reuse_rollout_logprobs``,
    computed alike (``Rollout.forward_logprobs``) and complete (a shared head's values present)."""
    return (pc.reuse_rollout_logprobs and roll.forward_logprobs and roll.entropy is not None
            and (ac.value_head is None or roll.values is not None))


@torch.no_grad()
def make_experience(
    ac: ActorCritic, ref, scorer: Scorer, roll: Rollout, pc: PPOConfig, kl_coef: float,
    reward_stats: RunningMoments | None = None, shard: Shard | None = None,
) -> tuple[Experience, dict[str, float]]:
    """Score a rollout and turn it into advantages and returns (no grad).

    PPO: per-token shaped rewards (-beta*KL, score on the last token) -> GAE with the critic.
    GRPO / RLOO / REINFORCE: the sequence score (minus beta * sequence KL unless the KL is a
    loss term) -> a baseline from the other samples -> the same advantage on every token.

    ``shard`` (data parallel): whitening, baselines and reward normalisation see the rows of
    every process, so they equal the single-process values; the stats are this process's.
    """
    shard = shard or Shard()
    ids, mask, P = roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1]
    rmask = roll.response_mask
    valid = rmask.bool()
    # the forward passes in row chunks whose logits stay within EXPERIENCE_LOGITS (elements):
    # [B, R, V] logits of a 150k vocabulary would otherwise dominate the peak memory
    B, R = roll.response_ids.shape
    vocab = unwrap(ac.policy).get_output_embeddings().out_features
    chunk = max(1, min(B, EXPERIENCE_LOGITS // max(1, R * vocab)))
    # the sampler's log-probs (and shared-head values) when it computed them as the training
    # forward does: one policy forward less per step (ppo.reuse_rollout_logprobs)
    reuse = reuse_rollout(roll, ac, pc)
    parts = []
    for rows in torch.arange(B, device=ids.device).split(chunk):
        resp = roll.response_ids[rows]
        if reuse:
            logprobs, values, entropy = roll.logprobs[rows], None, roll.entropy[rows]
            if ac.value_head is not None:
                values = roll.values[rows]
            elif ac.critic is not None:
                values = ac.critic_values(ids[rows], mask[rows], P)
        else:
            logits, values = ac(ids[rows], mask[rows], P, pc.temperature)
            logprobs, entropy = logprobs_from_logits(logits, resp), entropy_from_logits(logits)
            del logits
        ref_logits, _ = policy_forward(ref, ids[rows], mask[rows], P)
        parts.append((logprobs, values, entropy, logprobs_from_logits(ref_logits / pc.temperature, resp)))
        del ref_logits
    old_logprobs, ref_logprobs = torch.cat([p[0] for p in parts]), torch.cat([p[3] for p in parts])  # [B, R]
    entropy = torch.cat([p[2] for p in parts])  # [B, R]
    old_values = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
    raw_score = scorer(roll)  # [B]
    if not bool(torch.isfinite(raw_score).all()):  # a NaN here would reach every advantage of the batch
        raise ValueError(f"the reward gave non-finite scores to {int((~torch.isfinite(raw_score)).sum())} of "
                         f"{raw_score.numel()} responses: check the reward model's weights (reward.name) or function")
    score = raw_score - pc.missing_eos_penalty * (~roll.finished).float()
    if reward_stats is not None:
        reward_stats.update(shard.gather_rows(score))
        score = (score - reward_stats.mean) / (reward_stats.std + 1e-8)
    kl = kl_estimate(old_logprobs, ref_logprobs, pc.kl_estimator)  # [B, R]
    reward_kl_coef = 0.0 if pc.kl_in_loss else kl_coef
    rewards = shaped_rewards(score, kl, rmask, reward_kl_coef, pc.score_clip)  # [B, R]
    raw_advantages = None
    if pc.algo == "ppo":
        advantages, returns = gae(rewards, old_values, rmask, pc.gamma, pc.lam)
        raw_advantages = advantages
        if pc.whiten_advantages:
            advantages = shard.apply_rows(masked_whiten, advantages, rmask)
    else:
        seq_adv = shard.apply_rows(lambda s: sequence_advantages(s, pc), rewards.sum(-1))  # [B]: score - beta*KL
        advantages = torch.where(valid, seq_adv[:, None].expand_as(rewards), 0.0)  # [B, R]
        old_values = returns = torch.zeros_like(rewards)
    kl_seq = torch.where(valid, kl_estimate(old_logprobs, ref_logprobs, "k1"), 0.0).sum(-1)  # [B]
    stats = {
        "objective/score": raw_score.mean(),
        "objective/kl": kl_seq.mean(),
        "objective/rlhf_reward": rewards.sum(-1).mean() if not pc.kl_in_loss else (score - kl_coef * kl_seq).mean(),
        "objective/entropy": shard.apply_rows(masked_mean, entropy, rmask),  # a token mean
        "objective/kl_coef": kl_coef,
        "value/explained_var": shard.apply_rows(explained_variance, old_values, returns, rmask) if ac.has_critic else 0.0,
        "response/length": rmask.sum(-1).float().mean(),
        "response/eos_rate": roll.finished.float().mean(),
    }
    if not reuse:  # generation-time vs training-forward log-probs: a silent off-policy mismatch shows here
        stats["policy/logprob_gap"] = torch.where(valid, (roll.logprobs - old_logprobs).abs(), 0.0).max()
    exp = Experience(ids, mask, P, roll.response_ids, rmask, old_logprobs, ref_logprobs, old_values, score,
                     rewards, advantages, returns, raw_advantages)
    return exp, {k: to_float(v) for k, v in stats.items()}


def ppo_update(
    ac: ActorCritic, optimizer, exp: Experience, pc: PPOConfig, kl_coef: float, update_policy: bool = True,
    generator: torch.Generator | None = None, accelerator=None, guard: UpdateGuard | None = None,
    shard: Shard | None = None, train_model=None, logprob_gap: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """``ppo_epochs`` passes over shuffled minibatches; returns per-minibatch stats in order.

    ``update_policy=False`` is the critic warm-up: only the value loss is applied (and with a
    shared head it stops at the head). ``accelerator`` (optional) does the backward pass and
    the gradient clipping. ``guard`` skips minibatch updates with a NaN/inf loss or gradient (a
    fresh one per call if None). Data parallel: ``train_model`` is ``ac`` as prepared by
    accelerate (DDP), ``pc.minibatch_size`` the per-process share, and ``shard`` rescales the
    token-mean loss so the synchronised gradient, and the reduced stats, are those of the global
    minibatch (the synchronised gradient norms make every process's guard decide alike).
    ``logprob_gap``: the first minibatch's stats add ``policy/logprob_gap``, the largest
    |log-prob - old log-prob| over its tokens before any update (the old ones came from the
    sampler: :func:`reuse_rollout`).
    """
    guard = guard or UpdateGuard(where=pc.algo)
    shard = shard or Shard()
    model = train_model if train_model is not None else ac
    B = exp.input_ids.shape[0]
    # rows of one prompt stay together in a minibatch (shuffled as blocks): its prompt is then
    # computed once per minibatch (models.response_hidden), and a GRPO group's zero-sum
    # advantages stay in one gradient step
    G = pc.group_size if pc.algo in ("grpo", "rloo") else pc.samples_per_prompt
    G = G if G > 1 and B % G == 0 else 1
    all_stats = []
    for _ in range(pc.ppo_epochs):
        perm = (torch.randperm(B // G, generator=generator)[:, None] * G + torch.arange(G)).flatten()
        perm = perm.to(exp.input_ids.device)
        for mb in perm.split(pc.minibatch_size):
            rmask = exp.response_mask[mb]
            logits, values = model(exp.input_ids[mb], exp.attention_mask[mb], exp.prompt_len, pc.temperature,
                                   detach_value=not update_policy)
            logprobs = logprobs_from_logits(logits, exp.response_ids[mb])  # [b, R]
            loss, stats = torch.zeros((), device=logits.device), {}
            if values is not None:
                v_loss, stats = value_loss(values, exp.old_values[mb], exp.returns[mb], rmask, pc.value_clip_range)
                loss = pc.vf_coef * v_loss
            p_loss, p_stats = policy_loss(logprobs, exp.old_logprobs[mb], exp.advantages[mb], rmask, pc.clip_range)
            stats.update(p_stats)
            if update_policy:
                loss = loss + p_loss
                if pc.entropy_coef:
                    entropy = masked_mean(entropy_from_logits(logits), rmask)
                    loss = loss - pc.entropy_coef * entropy
                if pc.kl_in_loss:
                    kl_term = masked_mean(kl_estimate(logprobs, exp.ref_logprobs[mb], pc.kl_estimator), rmask)
                    loss = loss + kl_coef * kl_term
                    stats["policy/kl_loss"] = kl_term.detach()
            weight = shard.token_weight(rmask)  # 1 with one process
            optimizer.zero_grad(set_to_none=True)
            if accelerator is not None:
                accelerator.backward(loss * weight)
            else:
                (loss * weight).backward()
            if logprob_gap and not all_stats:  # no optimizer step yet: the policy that sampled
                stats["policy/logprob_gap"] = torch.where(rmask.bool(), (logprobs.detach() - exp.old_logprobs[mb]).abs(),
                                                          0.0).max()
            # every term is a token mean over rmask but the gap
            stats = shard.mean(stats, weight, maxed=("policy/logprob_gap",))
            stats["policy/grad_norm"] = clip_grad_norm(accelerator, ac.policy.parameters(), pc.max_grad_norm)
            if ac.has_critic:
                stats["value/grad_norm"] = clip_grad_norm(accelerator, ac.critic_parameters(), pc.max_grad_norm)
            if guard.ok(loss, stats["policy/grad_norm"], stats.get("value/grad_norm", 0.0)):
                optimizer.step()
            all_stats.append(stats)
    return all_stats


def other_tokenizer(path: str, tok, trust_remote_code: bool = False):
    """The tokenizer saved with the model at ``path`` when it differs from ``tok`` (the policy's),
    else None. A model directory saved without tokenizer files is taken to share the policy's.
    One without a pad token pads with its EOS: it only batches the reward model's inputs, whose
    readout comes from the attention mask."""
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f))
                                       for f in ("tokenizer_config.json", "tokenizer.json")):
        return None
    own = load_tokenizer(path, trust_remote_code=trust_remote_code, need_pad=False)
    if same_tokenizer(own, tok):
        return None
    if own.pad_token_id is None:
        own.pad_token = own.eos_token
    return own


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
    policy, ref = policy_with_reference(policy_path, mc, device)
    if rc.function:
        scorer = function_scorer(load_reward_function(rc.function), tok)
    else:
        rm = freeze(load_scalar_model(rc.name, mc.dtype, trc, num_labels=None)).to(device)
        rm_tok = other_tokenizer(rc.name, tok, trc)  # None: the policy's token ids are read as they are
        if rm.config.num_labels > 1:  # a label classifier (seed 002), not a pairwise scalar
            label_fn = load_reward_function(rc.label_function) if rc.label_function else None
            if label_fn is None:
                task = get_task(cfg.run.task)
                if not hasattr(task, "label_of_prompt"):
                    raise ValueError(f"{rc.name} is a classifier with {rm.config.num_labels} labels but task "
                                     f"{cfg.run.task!r} has no labels: set reward.label_function=module:name")
                label_fn = task.label_of_prompt
            scorer = classifier_scorer(rm, tok, label_fn, rm_tok)
        else:
            scorer = reward_model_scorer(rm, tok, rm_tok)
    if pc.algo != "ppo":
        ac = ActorCritic(policy)
    elif pc.value_model == "shared":
        hidden = policy.config.hidden_size
        ac = ActorCritic(policy, value_head=ValueHead(hidden).to(device))
    else:
        if pc.value_init == "reward" and not (rc.name or cfg.value.name):
            raise ValueError("ppo.value_init=reward needs reward.name (a reward model to start the critic from); "
                             "use ppo.value_init=policy or value.name=PATH with a reward function")
        critic_src = cfg.value.name or (rc.name if pc.value_init == "reward" else policy_path)
        if other_tokenizer(critic_src, tok, trc) is not None:
            raise ValueError(f"the value model {critic_src} has a different tokenizer from the policy's; the critic "
                             "reads the policy's tokens: use ppo.value_init=policy or a value.name that shares it")
        # a classifier reward model has one logit per label: its backbone, a fresh scalar head
        with quiet_load_report():  # from a causal LM: its LM head unused, a fresh scalar head
            critic = disable_dropout(load_scalar_model(critic_src, mc.dtype, trc, ignore_mismatched_sizes=True))
        if critic.config.pad_token_id is None:
            critic.config.pad_token_id = tok.pad_token_id
        if cfg.value.lora:
            if not mc.lora_r:
                raise ValueError("value.lora needs model.lora_r > 0 (the adapter's rank and targets)")
            critic = add_lora(critic, mc.lora_r, mc.lora_alpha, mc.lora_dropout, mc.lora_target_modules,
                              trainable_head=True)
        if mc.gradient_checkpointing:
            enable_gradient_checkpointing(critic)
        ac = ActorCritic(policy, critic=critic.to(device).train())
    return ac, ref, scorer, tok


def train_rl(cfg: Config, policy_path: str | None = None, reward_path: str | None = None) -> dict:
    """Run ``cfg.ppo.algo`` (ppo, grpo, rloo or reinforce) on the task's prompts (``run.task``).

    Writes metrics, samples, trajectories, plots and the trained models under ``run.out_dir``; stops
    early once held-out greedy exact accuracy reaches ``ppo.stop_at_exact``. Under
    ``accelerate launch`` each process takes its shard of every batch (``ppo.batch_size`` and
    ``ppo.minibatch_size`` are global) and the main process writes the files.
    """
    from ..plots import plot_ppo  # matplotlib only when a run finishes

    out = setup_run(cfg)
    pc = cfg.ppo
    # a critic warm-up's backward skips the actor: DDP must look for unused parameters
    accelerator = make_accelerator(cfg, find_unused_parameters=pc.algo == "ppo" and pc.critic_warmup_steps > 0)
    shard = Shard(accelerator)
    device = accelerator.device
    policy_path = policy_path or cfg.model.name
    if reward_path:
        cfg = cfg.replace(reward={"name": reward_path})
    if not policy_path or not (cfg.reward.name or cfg.reward.function):
        raise ValueError(f"{pc.algo} needs a pretrained policy and a reward: set model.name=PATH and "
                         "reward.name=PATH (a reward model) or reward.function=module:callable")
    if pc.algo in ("grpo", "rloo") and pc.batch_size % pc.group_size:
        raise ValueError(f"ppo.batch_size ({pc.batch_size}) must be a multiple of ppo.group_size ({pc.group_size})")
    if pc.samples_per_prompt < 1 or pc.batch_size % pc.samples_per_prompt:
        raise ValueError(f"ppo.samples_per_prompt ({pc.samples_per_prompt}) must be >= 1 and divide ppo.batch_size "
                         f"({pc.batch_size})")
    repeats = pc.group_size if pc.algo in ("grpo", "rloo") else pc.samples_per_prompt
    shard.local_size(pc.batch_size, "ppo.batch_size", repeats)  # whole groups on every process
    local_pc = dataclasses.replace(pc, minibatch_size=shard.local_size(pc.minibatch_size, "ppo.minibatch_size"))
    ac, ref, scorer, tok = build_models(cfg, policy_path, device)
    if device.type == "cpu":
        kernels.available()  # compile the CPU kernels (first use only) now, not inside the first timed step
    groups = [{"params": [p for p in ac.policy.parameters() if p.requires_grad], "lr": pc.lr}]
    if ac.has_critic:
        groups.append({"params": ac.critic_parameters(), "lr": pc.value_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, fused=True)  # one kernel per step, ~20% faster on CPU
    # DDP under accelerate launch (ac itself otherwise); generation and the experience pass use ac
    train_ac, optimizer = prepare(accelerator, ac, optimizer, micro_batch=local_pc.minibatch_size)
    task = get_task(cfg.run.task)
    data = task.TaskData(cfg.run.seed + 2)
    max_new_tokens = pc.max_new_tokens or task.MAX_NEW_TOKENS
    reward_stats = RunningMoments() if pc.normalize_reward else None
    kl_coef = pc.kl_coef
    guard = UpdateGuard(cfg.run.max_bad_updates, pc.algo)
    train_s = 0.0
    reached = None
    # run.resume: every weight, optimizer moment, RNG, the data position and the counters below
    # come back from the newest checkpoint, so the steps after it repeat those of an unbroken run
    ckpt = Checkpointer.from_config(cfg, out, enabled=shard.is_main)
    trained, optimizers = {"actor_critic": ac}, {"optimizer": optimizer}
    resumed = ckpt.restore(trained, optimizers, steps=pc.steps) or {}
    start = resumed.get("step", 0)
    if resumed:
        restore_loop_state(resumed, guard, data)
        kl_coef, train_s = resumed["kl_coef"], resumed["train_s"]
        if reward_stats is not None:
            reward_stats.count, reward_stats.mean, reward_stats.m2 = resumed["reward_stats"]
        if shard.is_main:
            cut_file(out / "samples.jsonl", resumed["samples_offset"])
        print(f"resuming {pc.algo} from {resumed['path']} (step {start} of {pc.steps})", file=sys.stderr)
    log = MetricsLogger(out / "metrics.jsonl", cfg, enabled=shard.is_main, resume=resumed.get("metrics"))
    samples = open(out / "samples.jsonl" if shard.is_main else os.devnull, "a" if resumed else "w", encoding="utf-8")
    trajectories = TrajectoryWriter(out / "trajectories.jsonl", pc.trajectories_every if shard.is_main else 0,
                                    pc.trajectories_per_step,  # the main process's rows: the batch's first
                                    resumed.get("trajectories_offset"))
    bar = progress(range(start, pc.steps), desc=pc.algo, enabled=cfg.run.progress and shard.is_main,
                   total=pc.steps, initial=start)
    for step in bar:
        t0 = time.perf_counter()
        # grpo / rloo: each prompt G times in a row, the grouping the baselines expect
        prompts = shard.take([p for p in data.prompts(pc.batch_size // repeats) for _ in range(repeats)])
        ids, mask = tokenize_prompts(tok, [p.text for p in prompts], device)
        # draws keyed to (seed, step, global row): the same samples with any number of processes
        u = rollout_uniforms(cfg.run.seed, step, pc.batch_size, max_new_tokens, shard.rows(pc.batch_size))
        # the unwrapped policy (FSDP: root weights gathered); eval keeps the KV cache under checkpointing
        with eval_mode(ac.policy), full_weights(train_ac):
            roll = generate(ac.policy, ids, mask, max_new_tokens, tok.eos_token_id, tok.pad_token_id, pc.temperature,
                            uniforms=u.to(device), value_head=ac.value_head if pc.reuse_rollout_logprobs else None)
        fault_point("rollout", step)
        t1 = time.perf_counter()
        exp, stats = make_experience(ac, ref, scorer, roll, pc, kl_coef, reward_stats, shard)
        stats = shard.mean(stats, maxed=("policy/logprob_gap",))
        t2 = time.perf_counter()
        warm = ac.has_critic and step < pc.critic_warmup_steps
        mb_stats = ppo_update(ac, optimizer, exp, local_pc, kl_coef, update_policy=not warm, accelerator=accelerator,
                              guard=guard, shard=shard, train_model=train_ac,
                              logprob_gap="policy/logprob_gap" not in stats)
        t3 = time.perf_counter()
        train_s += t3 - t0
        stats.update(mean_stats(mb_stats))
        n_tokens = int(exp.attention_mask.sum())
        stats.update({"time/rollout_s": t1 - t0, "time/experience_s": t2 - t1, "time/update_s": t3 - t2,
                      "time/train_s": train_s, "throughput/tokens_per_s": n_tokens / (t3 - t0),
                      "guard/skipped_updates": guard.skipped})
        if device.type == "cuda":  # high-water mark of the tensors allocated so far (models, states, activations)
            stats["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if pc.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, stats["objective/kl"], pc.kl_target, pc.kl_horizon, pc.batch_size)
        k = pc.samples_per_log  # decode only the rows that are logged: this runs every step
        texts = decode_responses(tok, exp.response_ids[:k], exp.response_mask[:k])
        for p, c, s in zip(prompts[:k], texts, exp.score[:k].tolist()):
            samples.write(json.dumps({"step": step, "prompt": p.text, "response": c, "score": round(s, 4)},
                                     ensure_ascii=False) + "\n")
        last = step == pc.steps - 1
        if (pc.eval_every and (step + 1) % pc.eval_every == 0) or last:
            with full_weights(train_ac):
                ev = evaluate_sharded(task, ac.policy, tok, device, shard, cfg.eval.batch_size,
                                      cfg.eval.max_new_tokens)
            stats.update({"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"]})
            if reached is None and pc.stop_at_exact and ev["exact_acc"] >= pc.stop_at_exact:
                reached = {"step": step + 1, "train_s": train_s}
        trajectories.maybe_write(step, last or reached is not None, exp, tok, pc, stats["objective/kl_coef"])
        log.log(step, stats)
        bar.set_postfix(score=f"{stats['objective/score']:.2f}", kl=f"{stats['objective/kl']:.3f}",
                        exact=f"{stats.get('eval/exact_acc', float('nan')):.3f}")
        if reached is not None:
            break
        fault_point("step_end", step)
        if ckpt.due(step + 1, last):
            samples.flush()
            moments = None if reward_stats is None else [reward_stats.count, reward_stats.mean, reward_stats.m2]
            ckpt.save(step + 1, trained, optimizers, loop_state(
                step + 1, log, guard, data, kl_coef=kl_coef, train_s=train_s, reward_stats=moments,
                samples_offset=file_size(out / "samples.jsonl"), trajectories_offset=trajectories.position()))
    samples.close()
    trajectories.close()
    log.close()
    save_dir = Path(out)
    history = log.rows()  # read back, not kept per step: memory stays flat over a long run
    shard.wait()
    # FSDP: weights gathered on every process; None otherwise
    weights, critic_weights = full_state_dict(ac.policy), ac.critic is not None and full_state_dict(ac.critic)
    if shard.is_main:  # LoRA: the adapter alone in policy_adapter/, merged plain weights in policy/
        save_policy(ac.policy, tok, save_dir / "policy", save_dir / "policy_adapter", weights)
        if ac.critic is not None:
            save_policy(ac.critic, tok, save_dir / "value_model", state_dict=critic_weights or None)
        elif ac.value_head is not None:
            save_file(ac.value_head.state_dict(), str(save_dir / "value_head.safetensors"))
        plot_ppo(history, save_dir)
    shard.wait()
    final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    return {"path": str(save_dir / "policy"), "seconds": train_s, "steps": len(history), "reached": reached,
            "final": final}
