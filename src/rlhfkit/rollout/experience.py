"""Experience: a rollout scored and turned into what the update needs, in one pass without grad:
old and reference log-probs, values and scores, then shaped per-token rewards and advantages /
returns (GAE with a critic, a group or batch baseline without); ``[B, R]`` response-aligned."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace

import torch

from ..config import PPOConfig
from ..core import (
    explained_variance,
    gae,
    group_advantages,
    group_mean_se,
    kl_estimate,
    last_token_index,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    reinforce_advantages,
    rloo_advantages,
    sampling_correction_weights,
    shaped_rewards,
    zero_std_groups,
)
from ..models.forward import UPDATE_LOGITS, ValueHead, policy_forward, token_logprobs, token_values, unwrap
from ..models.precision import compute_weights
from ..registry import repeated_rows
from ..run.distributed import Shard
from ..run.watch import HackingWatch, SignalWatch
from ..utils import to_float
from .generate import Rollout
from .rewards import RewardError, Scorer


@dataclass(kw_only=True)
class Experience:
    """A rollout plus everything the update needs, built by keyword; ``[B, R]`` response-aligned."""

    input_ids: torch.Tensor  # [B, T] prompt + response
    attention_mask: torch.Tensor  # [B, T]
    prompt_len: int
    response_ids: torch.Tensor  # [B, R] the actions
    response_mask: torch.Tensor  # [B, R] 1 up to and including the first EOS
    old_logprobs: torch.Tensor  # log pi_old(a_t|s_t): a policy forward's, or the sampler's (reuse_rollout)
    ref_logprobs: torch.Tensor  # log pi_ref(a_t|s_t)
    old_values: torch.Tensor  # V_old(s_t)
    score: torch.Tensor  # [B] the reward after penalties / normalisation, before the clip
    rewards: torch.Tensor  # shaped per-token rewards
    advantages: torch.Tensor  # GAE's (whitened if asked) or the baseline's, times the sampling correction
    returns: torch.Tensor
    raw_advantages: torch.Tensor | None = None  # GAE's unwhitened
    loss_rows: torch.Tensor | None = None  # [B] bool, the rows the update trains on (select); None: all

    def select(self, rows: torch.Tensor) -> Experience:
        """The experience of ``rows`` (``[B]`` bool, or indices) alone: every per-row tensor cut to
        them. A row left out is out of every token mean of the update, its normaliser included."""
        cut = {f.name: getattr(self, f.name)[rows] for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **cut)


class RunningMoments:
    """Running mean / std of scalar rewards (parallel Welford), for reward normalisation."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        if not x.numel():  # no scored row this step
            return
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
    """The trained models: the actor and a shared value head, a separate value model, or no critic
    (values None). ``logits_budget``: the logits above which the LM head runs in row chunks."""

    def __init__(self, policy, value_head: ValueHead | None = None, critic=None, logits_budget: int = UPDATE_LOGITS):
        super().__init__()
        if value_head is not None and critic is not None:
            raise ValueError("give at most one of value_head (shared) or critic (separate)")
        self.policy, self.value_head, self.critic = policy, value_head, critic
        self.logits_budget = logits_budget

    @property
    def has_critic(self) -> bool:
        return self.value_head is not None or self.critic is not None

    def forward(self, input_ids, attention_mask, prompt_len: int, temperature: float = 1.0, detach_value=False,
                response_ids: torch.Tensor | None = None, entropy: bool = False):
        """Tempered ``logits [B, R, V]`` and ``values [B, R]``; given ``response_ids``,
        :func:`~rlhfkit.models.forward.token_logprobs`'s ``(logprobs, entropy, values)``. A
        ``forward``, so DDP / FSDP see every weight."""
        if response_ids is not None:
            logprobs, ent, values = token_logprobs(
                self.policy, input_ids, attention_mask, prompt_len, response_ids, temperature, self.value_head,
                detach_value, entropy, logits_budget=self.logits_budget)
        else:
            logits, values = policy_forward(self.policy, input_ids, attention_mask, prompt_len, self.value_head,
                                            detach_value)
        if self.critic is not None:
            values = self.critic_values(input_ids, attention_mask, prompt_len)  # [B, R]
        if response_ids is None:
            return logits / temperature, values
        return logprobs, ent, values

    def critic_values(self, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
        """A separate value model's ``values [B, R]`` (response-aligned)."""
        return token_values(self.critic, input_ids, attention_mask)[:, prompt_len - 1 : -1]

    def critic_parameters(self):
        return list((self.value_head or self.critic).parameters()) if self.has_critic else []


def sequence_advantages(score: torch.Tensor, pc: PPOConfig) -> torch.Tensor:
    """``[B] -> [B]``: one advantage per completion for the critic-free estimators."""
    if pc.algo == "grpo":
        return group_advantages(score, pc.group_size, pc.scale_rewards)
    if pc.algo == "rloo":
        return rloo_advantages(score, pc.group_size, pc.scale_rewards)
    if pc.algo == "reinforce":
        return reinforce_advantages(score, pc.scale_rewards)
    raise ValueError(f"no sequence-level advantage for algo {pc.algo!r}")


def completions_per_prompt(pc: PPOConfig) -> int:
    """A prompt's completions: ``group_size`` (grpo, rloo), else ``samples_per_prompt``; 1: no groups."""
    return pc.group_size if pc.algo in ("grpo", "rloo") else pc.samples_per_prompt


def zero_std_rows(score: torch.Tensor, pc: PPOConfig) -> torch.Tensor | None:
    """``[B]`` bool: rows whose group's clipped scores are all equal; None when groups are of 1.
    Each process holds whole groups, so its rows' flags are the global batch's."""
    G = completions_per_prompt(pc)
    if G < 2:
        return None
    return zero_std_groups(score.clamp(-pc.score_clip, pc.score_clip), G).repeat_interleave(G)  # [B]


def loss_rows(zero_std: torch.Tensor | None, finished: torch.Tensor, pc: PPOConfig) -> torch.Tensor | None:
    """``[B]`` bool, the rows the update trains on (``ppo.filter_zero_std_groups``,
    ``ppo.mask_truncated_completions``); None when neither is on."""
    keep = None
    if pc.filter_zero_std_groups and zero_std is not None:
        keep = ~zero_std
    if pc.mask_truncated_completions:
        keep = finished.bool() if keep is None else keep & finished.bool()
    return keep


EXPERIENCE_LOGITS = 2**28  # 1 GiB of float32 logits per experience forward chunk


def row_chunks(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in consecutive chunks of at most ``size`` rows, cutting a run of identical prompts
    (:func:`repeated_rows`) only when it alone is longer, so each chunk runs a group's prompt once
    (groups of 8, ``size`` 10: chunks of 8; ``size`` 3: 3 + 3 + 2 a group)."""
    B, device = prompt_ids.shape[0], prompt_ids.device
    runs = repeated_rows(prompt_ids, prompt_mask) if size < B else None
    if runs is None:
        return list(torch.arange(B, device=device).split(size))
    ends = [*runs[0].tolist()[1:], B]  # where each run stops
    spans, start, end = [], 0, 0
    for stop in ends:
        if stop - start > size and end > start:  # this run does not fit after the chunk so far
            spans.append((start, end))
            start = end
        while stop - start > size:  # a run longer than a chunk, cut in chunks of its own
            spans.append((start, start + size))
            start += size
        end = stop
    spans.append((start, B))
    return [torch.arange(a, b, device=device) for a, b in spans]


def reuse_rollout(roll: Rollout, ac: ActorCritic, allowed: bool = True) -> bool:
    """Whether :func:`make_experience` takes the old log-probs, entropies and (shared head) values
    from the rollout instead of a policy forward: ``allowed`` (``accel.reuse_rollout_logprobs``),
    computed alike (``Rollout.forward_logprobs``) and complete (a shared head's values present)."""
    return (allowed and roll.forward_logprobs and roll.entropy is not None
            and (ac.value_head is None or roll.values is not None))


@torch.no_grad()
def experience_forwards(ac: ActorCritic, ref, roll: Rollout, pc: PPOConfig, reuse: bool,
                        chunk_logits: int = EXPERIENCE_LOGITS) -> dict[str, torch.Tensor]:
    """``old_logprobs``, ``ref_logprobs``, ``entropy`` ``[B, R]`` and ``old_values`` (or None) of a
    rollout, in row chunks of at most ``chunk_logits // (R * V)`` rows cut between groups
    (:func:`row_chunks`), the reference's LM head chunked as the policy's; ``reuse``: the policy's
    from the sampler."""
    ids, mask, P = roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1]
    B, R = roll.response_ids.shape
    vocab = unwrap(ac.policy).get_output_embeddings().out_features
    chunk = max(1, min(B, chunk_logits // max(1, R * vocab)))
    parts = []
    # model.master_weights: the bfloat16 copies, once for the pass, of the models it runs (with reuse, a
    # value head's values come with the rollout)
    with compute_weights(ac if not reuse else ac.critic if ac.value_head is None else None):
        for rows in row_chunks(roll.prompt_ids, mask[:, :P], chunk):
            resp = roll.response_ids[rows]
            if reuse:
                logprobs, values, entropy = roll.logprobs[rows], None, roll.entropy[rows]
                if ac.value_head is not None:
                    values = roll.values[rows]
                elif ac.critic is not None:
                    values = ac.critic_values(ids[rows], mask[rows], P)
            else:
                logprobs, entropy, values = ac(ids[rows], mask[rows], P, pc.temperature, response_ids=resp, entropy=True)
            ref_logprobs, _, _ = token_logprobs(ref, ids[rows], mask[rows], P, resp, pc.temperature,
                                                 logits_budget=ac.logits_budget)
            parts.append((logprobs, values, entropy, ref_logprobs))
    names = ("old_logprobs", "old_values", "entropy", "ref_logprobs")
    return {k: None if v[0] is None else torch.cat(v) for k, v in zip(names, zip(*parts))}  # [B, R] each


def overlong_scores(roll: Rollout, pc: PPOConfig) -> torch.Tensor:
    """``[B]`` DAPO's over-long penalties (``ppo.overlong_buffer``); an episode's: the sum of its turns'."""
    lengths = roll.response_mask.sum(-1, keepdim=True) if roll.turn_lengths is None else roll.turn_lengths  # [B, *]
    return overlong_penalty(lengths, pc.max_new_tokens, pc.overlong_buffer, pc.overlong_penalty).sum(-1)


def final_scores(scorer: Scorer, roll: Rollout, pc: PPOConfig, reward_stats: RunningMoments | None,
                 shard: Shard, records=None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(raw_score [B], score [B], {source: [B]})``: the reward plus an environment's turn rewards;
    then with the missing-EOS and over-long penalties and the running normalisation (over every
    process's rows); each source's scores. NaN: a response no reward scored."""
    raw_score, parts = scorer.score(roll, records)  # [B]
    if roll.turn_rewards is not None:
        raw_score = raw_score.nan_to_num(0.0) + roll.turn_rewards.sum(-1)  # [B]
    score = raw_score - pc.missing_eos_penalty * (~roll.finished).float()
    if pc.overlong_buffer:
        score = score + overlong_scores(roll, pc)  # [B]
    if reward_stats is not None:
        rows = shard.gather_rows(score)
        reward_stats.update(rows[~rows.isnan()])
        score = (score - reward_stats.mean) / (reward_stats.std + 1e-8)
    return raw_score, score, parts


@torch.no_grad()
def token_rewards(roll: Rollout, score: torch.Tensor, kl: torch.Tensor, beta: float, pc: PPOConfig,
                  reward_stats: RunningMoments | None) -> torch.Tensor:
    """Per-token rewards ``[B, R]``: ``score`` on the last token, -beta * ``kl`` on each; with ppo an
    environment's turn rewards on each turn's last token, the rest of the return on the last."""
    rmask = roll.response_mask
    if pc.algo != "ppo" or roll.turn_rewards is None:
        return shaped_rewards(score, kl, rmask, beta, pc.score_clip)
    scale = 1.0 if reward_stats is None else 1.0 / (reward_stats.std + 1e-8)  # the normalisation's
    earlier = (roll.turn_rewards * scale).scatter(1, last_token_index(rmask)[:, None], 0.0)  # [B, R]
    return shaped_rewards(score - earlier.sum(-1), kl, rmask, beta, pc.score_clip) + earlier


def correct_sampling(roll: Rollout, old_logprobs: torch.Tensor, advantages: torch.Tensor, pc: PPOConfig,
                     shard: Shard) -> tuple[torch.Tensor, dict]:
    """``(advantages, stats)``: the advantages reweighed by pi_old / q (``ppo.sampling_correction``;
    q: the distribution the sampler drew from)."""
    rmask, stats = roll.response_mask, {}
    if roll.kept_logmass is not None:  # top-k / top-p: the tokens came from q = pi / Z
        stats["rollout/kept_mass"] = shard.apply_rows(masked_mean, roll.kept_logmass.exp(), rmask)
    if pc.sampling_correction != "none":  # a positive factor on the policy loss
        log_w = old_logprobs - roll.logprobs + (0.0 if roll.kept_logmass is None else roll.kept_logmass)  # [B, R]
        weights = sampling_correction_weights(log_w, rmask, pc.sampling_correction, pc.sampling_correction_cap)
        advantages = advantages * weights  # [B, R]
        stats["policy/sampling_weight"] = shard.apply_rows(masked_mean, weights, rmask)
    return advantages, stats


def response_stats(roll: Rollout, pc: PPOConfig, shard: Shard) -> dict:
    """Length, EOS rate (and its standard error over prompt groups, ``guard/eos_collapse``) and the
    share cut at ``max_new_tokens``."""
    return {"response/length": roll.response_mask.sum(-1).float().mean(),
            "response/eos_rate": roll.finished.float().mean(),
            "response/eos_rate_se": shard.apply_rows(lambda f: group_mean_se(f, completions_per_prompt(pc)),
                                                     roll.finished.float()),
            "response/truncated_rate": (~roll.finished).float().mean()}  # 1 - eos_rate


def make_experience(
    ac: ActorCritic, ref, scorer: Scorer, roll: Rollout, pc: PPOConfig, kl_coef: float,
    reward_stats: RunningMoments | None = None, shard: Shard | None = None, records=None,
    chunk_logits: int = EXPERIENCE_LOGITS, reuse_logprobs: bool = True,
) -> tuple[Experience, dict[str, float]]:
    """Score a rollout and turn it into advantages and returns: PPO's GAE over shaped per-token
    rewards, or the critic-free baseline of each sequence's score (minus beta * KL unless the KL is
    a loss term) on every token. Whitening, baselines and normalisation see every ``shard``'s rows;
    ``reuse_logprobs``: ``accel.reuse_rollout_logprobs``."""
    shard = shard or Shard()
    rmask = roll.response_mask
    valid = rmask.bool()
    reuse = reuse_rollout(roll, ac, reuse_logprobs)
    raw_score, score, parts = final_scores(scorer, roll, pc, reward_stats, shard, records)
    unscored = raw_score.isnan()  # [B]: no reward scored it (every function returned None)
    if pc.algo == "ppo" and bool(unscored.any()):
        raise RewardError(f"every reward function returned None for {int(unscored.sum())} of {len(unscored)} "
                          "completions: ppo's critic needs a return for each; give them a score in one function, or "
                          "use grpo, rloo or reinforce, where such a completion has advantage 0 (TRL's rule)")
    beta = 0.0 if pc.kl_in_loss else kl_coef
    zero_std = zero_std_rows(score, pc)  # [B] or None
    keep = loss_rows(zero_std, roll.finished, pc)  # [B] or None
    f = experience_forwards(ac, ref, roll, pc, reuse, chunk_logits=chunk_logits)
    old_logprobs, ref_logprobs, old_values = f["old_logprobs"], f["ref_logprobs"], f["old_values"]
    kl = kl_estimate(old_logprobs, ref_logprobs, pc.kl_estimator)  # [B, R]
    raw_advantages = None
    rewards = token_rewards(roll, score, kl, beta, pc, reward_stats)  # [B, R]
    if pc.algo == "ppo":
        advantages, returns = gae(rewards, old_values, rmask, pc.gamma, pc.lam)
        raw_advantages = advantages
        if pc.whiten_advantages:
            advantages = shard.apply_rows(masked_whiten, advantages, rmask)
    else:
        seq_adv = shard.apply_rows(lambda s: sequence_advantages(s, pc), rewards.sum(-1))  # [B]: score - beta*KL
        seq_adv = seq_adv.nan_to_num(0.0)  # an unscored row's (NaN, out of the baselines): 0, as in TRL
        advantages = torch.where(valid, seq_adv[:, None].expand_as(rewards), 0.0)  # [B, R]
        old_values = returns = torch.zeros_like(rewards)
        # an unscored row is written with score 0 (samples, trajectories) and counts so in rlhf_reward
        score, rewards = score.nan_to_num(0.0), rewards.nan_to_num(0.0)
    advantages, sampling = correct_sampling(roll, old_logprobs, advantages, pc, shard)
    kl_seq = torch.where(valid, kl_estimate(old_logprobs, ref_logprobs, "k1"), 0.0).sum(-1)  # [B]
    stats = {
        "objective/score": raw_score.nanmean(),  # over the scored rows
        "objective/kl": kl_seq.mean(),
        "objective/rlhf_reward": rewards.sum(-1).mean() if not pc.kl_in_loss else (score - kl_coef * kl_seq).mean(),
        "objective/entropy": shard.apply_rows(masked_mean, f["entropy"], rmask),  # a token mean
        "objective/kl_coef": kl_coef,
        "value/explained_var": shard.apply_rows(explained_variance, old_values, returns, rmask) if ac.has_critic else 0.0,
        **response_stats(roll, pc, shard),
        **{f"reward/{name}": s.nanmean() for name, s in parts.items()},  # over the rows each scored
        **sampling,
    }
    if not reuse:  # the sampler's log-probs against the forward's: where a silent off-policy mismatch shows
        stats["policy/logprob_gap"] = torch.where(valid, (roll.logprobs - old_logprobs).abs(), 0.0).max()
    if pc.overlong_buffer:  # the mean over-long penalty added to the scores
        stats["objective/overlong_penalty"] = overlong_scores(roll, pc).mean()
    if zero_std is not None:  # TRL's name; groups of 1 have no such share, and it is not logged
        stats["frac_reward_zero_std"] = shard.apply_rows(lambda z: z.mean(), zero_std.float())  # global batch
    if keep is not None:
        stats["policy/trained_frac"] = keep.float().mean()
    exp = Experience(input_ids=roll.input_ids, attention_mask=roll.attention_mask, prompt_len=roll.prompt_ids.shape[1],
                     response_ids=roll.response_ids, response_mask=rmask, old_logprobs=old_logprobs,
                     ref_logprobs=ref_logprobs, old_values=old_values, score=score, rewards=rewards,
                     advantages=advantages, returns=returns, raw_advantages=raw_advantages, loss_rows=keep)
    return exp, {k: to_float(v) for k, v in stats.items()}


class RLState:
    """The loop's state beyond the step: KL coefficient, training seconds, reward statistics, watches."""

    def __init__(self, pc: PPOConfig, stop_metric: str | None = None, eval_prompts: int = 0):
        self.kl_coef, self.train_s = pc.kl_coef, 0.0
        self.reward_stats = RunningMoments() if pc.normalize_reward else None
        self.reached: dict | None = None
        # the held-out metric the run stops on (ppo.stop_metric, or the one its evaluation logs)
        self.stop_metric = stop_metric or pc.stop_metric
        self.watch = HackingWatch(pc.guard_kl, pc.guard_eos, pc.guard_eval_drop, self.stop_metric,
                                  pc.batch_size, tradeoff=pc.guard_tradeoff,
                                  eval_prompts=eval_prompts)
        self.signals = SignalWatch("ppo.group_size" if pc.algo in ("grpo", "rloo") else "ppo.samples_per_prompt")

    def state_dict(self) -> dict:
        m = self.reward_stats
        return {"kl_coef": self.kl_coef, "train_s": self.train_s, "watch": self.watch.state_dict(),
                "signals": self.signals.state_dict(), "reward_stats": None if m is None else [m.count, m.mean, m.m2],
                "stop_metric": self.stop_metric}

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef, self.train_s = state["kl_coef"], state["train_s"]
        self.stop_metric = self.watch.metric = state.get("stop_metric", self.stop_metric)
        self.watch.load_state_dict(state["watch"])
        if "signals" in state:  # checkpoints written before the signal watch have none
            self.signals.load_state_dict(state["signals"])
        if self.reward_stats is not None and state.get("reward_stats") is None:
            # written with ppo.normalize_reward=false: there are no statistics to carry over
            warnings.warn("the checkpoint was written with ppo.normalize_reward=false: the reward statistics "
                          "start fresh at this step", RuntimeWarning, stacklevel=2)
        elif self.reward_stats is not None:
            self.reward_stats.count, self.reward_stats.mean, self.reward_stats.m2 = state["reward_stats"]
