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

import importlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

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
from ..evaluate import decode_responses, evaluate_task, tokenize_prompts
from ..models import (
    ValueHead,
    disable_dropout,
    freeze,
    load_policy,
    load_scalar_model,
    load_tokenizer,
    policy_forward,
    sequence_logits,
    sequence_scores,
    token_values,
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
            values = token_values(self.critic, input_ids, attention_mask)[:, prompt_len - 1 : -1]  # [B, R]
        return logits / temperature, values

    def critic_parameters(self):
        return list((self.value_head or self.critic).parameters()) if self.has_critic else []


Scorer = Callable[[Rollout], torch.Tensor]


def reward_model_scorer(reward_model) -> Scorer:
    """Score = the reward model's scalar at the last attended token of prompt + response."""
    return lambda roll: sequence_scores(reward_model, roll.input_ids, roll.attention_mask)


def classifier_scorer(classifier, tokenizer, label_fn: Callable[[str], int]) -> Scorer:
    """Score = the classifier's logit, at the last attended token, of the label the prompt asks
    for (seed 002's reward: a classifier of the answer's character set)."""

    def score(roll: Rollout) -> torch.Tensor:
        logits = sequence_logits(classifier, roll.input_ids, roll.attention_mask)  # [B, L]
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


@torch.no_grad()
def make_experience(
    ac: ActorCritic, ref, scorer: Scorer, roll: Rollout, pc: PPOConfig, kl_coef: float,
    reward_stats: RunningMoments | None = None,
) -> tuple[Experience, dict[str, float]]:
    """Score a rollout and turn it into advantages and returns (no grad).

    PPO: per-token shaped rewards (-beta*KL, score on the last token) -> GAE with the critic.
    GRPO / RLOO / REINFORCE: the sequence score (minus beta * sequence KL unless the KL is a
    loss term) -> a baseline from the other samples -> the same advantage on every token.
    """
    ids, mask, P = roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1]
    rmask = roll.response_mask
    valid = rmask.bool()
    logits, old_values = ac(ids, mask, P, pc.temperature)
    old_logprobs = logprobs_from_logits(logits, roll.response_ids)  # [B, R]
    ref_logits, _ = policy_forward(ref, ids, mask, P)
    ref_logprobs = logprobs_from_logits(ref_logits / pc.temperature, roll.response_ids)  # [B, R]
    raw_score = scorer(roll)  # [B]
    if not bool(torch.isfinite(raw_score).all()):  # a NaN here would reach every advantage of the batch
        raise ValueError(f"the reward gave non-finite scores to {int((~torch.isfinite(raw_score)).sum())} of "
                         f"{raw_score.numel()} responses: check the reward model's weights (reward.name) or function")
    score = raw_score - pc.missing_eos_penalty * (~roll.finished).float()
    if reward_stats is not None:
        reward_stats.update(score)
        score = (score - reward_stats.mean) / (reward_stats.std + 1e-8)
    kl = kl_estimate(old_logprobs, ref_logprobs, pc.kl_estimator)  # [B, R]
    reward_kl_coef = 0.0 if pc.kl_in_loss else kl_coef
    rewards = shaped_rewards(score, kl, rmask, reward_kl_coef, pc.score_clip)  # [B, R]
    raw_advantages = None
    if pc.algo == "ppo":
        advantages, returns = gae(rewards, old_values, rmask, pc.gamma, pc.lam)
        raw_advantages = advantages
        if pc.whiten_advantages:
            advantages = masked_whiten(advantages, rmask)
    else:
        seq_adv = sequence_advantages(rewards.sum(-1), pc)  # [B]: clipped score - beta * sequence KL
        advantages = torch.where(valid, seq_adv[:, None].expand_as(rewards), 0.0)  # [B, R]
        old_values = returns = torch.zeros_like(rewards)
    kl_seq = torch.where(valid, kl_estimate(old_logprobs, ref_logprobs, "k1"), 0.0).sum(-1)  # [B]
    stats = {
        "objective/score": raw_score.mean(),
        "objective/kl": kl_seq.mean(),
        "objective/rlhf_reward": rewards.sum(-1).mean() if not pc.kl_in_loss else (score - kl_coef * kl_seq).mean(),
        "objective/entropy": masked_mean(entropy_from_logits(logits), rmask),
        "objective/kl_coef": kl_coef,
        "value/explained_var": explained_variance(old_values, returns, rmask) if ac.has_critic else 0.0,
        "response/length": rmask.sum(-1).float().mean(),
        "response/eos_rate": roll.finished.float().mean(),
        # generation-time vs training-forward log-probs: a silent off-policy mismatch shows here
        "policy/logprob_gap": torch.where(valid, (roll.logprobs - old_logprobs).abs(), 0.0).max(),
    }
    exp = Experience(ids, mask, P, roll.response_ids, rmask, old_logprobs, ref_logprobs, old_values, score,
                     rewards, advantages, returns, raw_advantages)
    return exp, {k: to_float(v) for k, v in stats.items()}


def ppo_update(
    ac: ActorCritic, optimizer, exp: Experience, pc: PPOConfig, kl_coef: float, update_policy: bool = True,
    generator: torch.Generator | None = None, accelerator=None, guard: UpdateGuard | None = None,
) -> list[dict[str, torch.Tensor]]:
    """``ppo_epochs`` passes over shuffled minibatches; returns per-minibatch stats in order.

    ``update_policy=False`` is the critic warm-up: only the value loss is applied (and with a
    shared head it stops at the head). ``accelerator`` (optional) does the backward pass.
    ``guard`` skips minibatch updates with a NaN/inf loss or gradient (a fresh one per call if None).
    """
    guard = guard or UpdateGuard(where=pc.algo)
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
            logits, values = ac(exp.input_ids[mb], exp.attention_mask[mb], exp.prompt_len, pc.temperature,
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
            optimizer.zero_grad(set_to_none=True)
            if accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            stats["policy/grad_norm"] = torch.nn.utils.clip_grad_norm_(ac.policy.parameters(), pc.max_grad_norm)
            if ac.has_critic:
                stats["value/grad_norm"] = torch.nn.utils.clip_grad_norm_(ac.critic_parameters(), pc.max_grad_norm)
            if guard.ok(loss, stats["policy/grad_norm"], stats.get("value/grad_norm", 0.0)):
                optimizer.step()
            all_stats.append(stats)
    return all_stats


def build_models(cfg: Config, policy_path: str, device):
    """Load the roles. Returns ``(actor_critic, ref, scorer, tokenizer)``.

    The critic exists only for ``algo == 'ppo'``; the scorer is the reward model at
    ``reward.name`` or the callable at ``reward.function``.
    """
    pc, rc = cfg.ppo, cfg.reward
    trc = cfg.model.trust_remote_code
    tok = load_tokenizer(policy_path, trust_remote_code=trc)
    policy = disable_dropout(load_policy(policy_path, trust_remote_code=trc)).to(device).train()
    ref = freeze(load_policy(policy_path, trust_remote_code=trc)).to(device)
    if rc.function:
        scorer = function_scorer(load_reward_function(rc.function), tok)
    else:
        rm = freeze(load_scalar_model(rc.name, trust_remote_code=trc, num_labels=None)).to(device)
        if rm.config.num_labels > 1:  # a label classifier (seed 002), not a pairwise scalar
            label_fn = load_reward_function(rc.label_function) if rc.label_function else None
            if label_fn is None:
                task = get_task(cfg.run.task)
                if not hasattr(task, "label_of_prompt"):
                    raise ValueError(f"{rc.name} is a classifier with {rm.config.num_labels} labels but task "
                                     f"{cfg.run.task!r} has no labels: set reward.label_function=module:name")
                label_fn = task.label_of_prompt
            scorer = classifier_scorer(rm, tok, label_fn)
        else:
            scorer = reward_model_scorer(rm)
    if pc.algo != "ppo":
        ac = ActorCritic(policy)
    elif pc.value_model == "shared":
        ac = ActorCritic(policy, value_head=ValueHead(policy.config.hidden_size).to(device))
    else:
        if pc.value_init == "reward" and not rc.name:
            raise ValueError("ppo.value_init=reward needs reward.name (a reward model to start the critic from); "
                             "use ppo.value_init=policy with a reward function")
        critic_src = rc.name if pc.value_init == "reward" else policy_path
        # a classifier reward model has one logit per label: its backbone, a fresh scalar head
        critic = load_scalar_model(critic_src, trust_remote_code=trc, ignore_mismatched_sizes=True)
        critic = disable_dropout(critic).to(device).train()
        ac = ActorCritic(policy, critic=critic)
    return ac, ref, scorer, tok


def train_rl(cfg: Config, policy_path: str | None = None, reward_path: str | None = None) -> dict:
    """Run ``cfg.ppo.algo`` (ppo, grpo, rloo or reinforce) on the task's prompts (``run.task``).

    Writes metrics, samples, trajectories, plots and the trained models under ``run.out_dir``; stops early
    once held-out greedy exact accuracy reaches ``ppo.stop_at_exact``.
    """
    from ..plots import plot_ppo  # matplotlib only when a run finishes

    out = setup_run(cfg)
    accelerator = make_accelerator(cfg)
    device = accelerator.device
    pc = cfg.ppo
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
    ac, ref, scorer, tok = build_models(cfg, policy_path, device)
    groups = [{"params": ac.policy.parameters(), "lr": pc.lr}]
    if ac.has_critic:
        groups.append({"params": ac.critic_parameters(), "lr": pc.value_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, fused=True)  # one kernel per step, ~20% faster on CPU
    repeats = pc.group_size if pc.algo in ("grpo", "rloo") else pc.samples_per_prompt
    task = get_task(cfg.run.task)
    data = task.TaskData(cfg.run.seed + 2)
    max_new_tokens = pc.max_new_tokens or task.MAX_NEW_TOKENS
    reward_stats = RunningMoments() if pc.normalize_reward else None
    log = MetricsLogger(out / "metrics.jsonl", cfg)
    samples = (out / "samples.jsonl").open("w", encoding="utf-8")
    trajectories = TrajectoryWriter(out / "trajectories.jsonl", pc.trajectories_every, pc.trajectories_per_step)
    kl_coef = pc.kl_coef
    guard = UpdateGuard(cfg.run.max_bad_updates, pc.algo)
    train_s = 0.0
    reached = None
    bar = progress(range(pc.steps), desc=pc.algo, enabled=cfg.run.progress)
    for step in bar:
        t0 = time.perf_counter()
        # grpo / rloo: each prompt G times in a row, the grouping the baselines expect
        prompts = [p for p in data.prompts(pc.batch_size // repeats) for _ in range(repeats)]
        ids, mask = tokenize_prompts(tok, [p.text for p in prompts], device)
        roll = generate(ac.policy, ids, mask, max_new_tokens, tok.eos_token_id, tok.pad_token_id, pc.temperature)
        t1 = time.perf_counter()
        exp, stats = make_experience(ac, ref, scorer, roll, pc, kl_coef, reward_stats)
        t2 = time.perf_counter()
        warm = ac.has_critic and step < pc.critic_warmup_steps
        mb_stats = ppo_update(ac, optimizer, exp, pc, kl_coef, update_policy=not warm, accelerator=accelerator,
                              guard=guard)
        t3 = time.perf_counter()
        train_s += t3 - t0
        stats.update(mean_stats(mb_stats))
        n_tokens = int(exp.attention_mask.sum())
        stats.update({"time/rollout_s": t1 - t0, "time/experience_s": t2 - t1, "time/update_s": t3 - t2,
                      "time/train_s": train_s, "throughput/tokens_per_s": n_tokens / (t3 - t0),
                      "guard/skipped_updates": guard.skipped})
        if pc.adaptive_kl:
            kl_coef = adaptive_kl_coef(kl_coef, stats["objective/kl"], pc.kl_target, pc.kl_horizon, pc.batch_size)
        k = pc.samples_per_log  # decode only the rows that are logged: this runs every step
        texts = decode_responses(tok, exp.response_ids[:k], exp.response_mask[:k])
        for p, c, s in zip(prompts[:k], texts, exp.score[:k].tolist()):
            samples.write(json.dumps({"step": step, "prompt": p.text, "response": c, "score": round(s, 4)},
                                     ensure_ascii=False) + "\n")
        last = step == pc.steps - 1
        if (pc.eval_every and (step + 1) % pc.eval_every == 0) or last:
            ev = evaluate_task(task, ac.policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
            stats.update({"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"]})
            if reached is None and pc.stop_at_exact and ev["exact_acc"] >= pc.stop_at_exact:
                reached = {"step": step + 1, "train_s": train_s}
        trajectories.maybe_write(step, last or reached is not None, exp, tok, pc, stats["objective/kl_coef"])
        log.log(step, stats)
        bar.set_postfix(score=f"{stats['objective/score']:.2f}", kl=f"{stats['objective/kl']:.3f}",
                        exact=f"{stats.get('eval/exact_acc', float('nan')):.3f}")
        if reached is not None:
            break
    samples.close()
    trajectories.close()
    log.close()
    save_dir = Path(out)
    ac.policy.save_pretrained(save_dir / "policy")
    tok.save_pretrained(save_dir / "policy")
    if ac.critic is not None:
        ac.critic.save_pretrained(save_dir / "value_model")
    elif ac.value_head is not None:
        save_file(ac.value_head.state_dict(), str(save_dir / "value_head.safetensors"))
    history = log.rows()  # read back, not kept per step: memory stays flat over a long run
    plot_ppo(history, save_dir)
    final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    return {"path": str(save_dir / "policy"), "seconds": train_s, "steps": len(history), "reached": reached,
            "final": final}
