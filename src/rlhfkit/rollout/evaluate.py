"""Evaluation of a policy: a task's held-out prompts by its verifier; prompt records by the rewards."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..core import kl_from_logits, masked_sum
from ..data.prompts import PromptRecord, file_records, prompt_limit, prompt_tensors
from ..models.forward import (
    context_window,
    load_policy,
    load_tokenizer,
    policy_dir,
    policy_forward,
    same_tokenizer,
)
from ..models.loading import eval_mode
from ..run.distributed import Shard
from ..tasks import get_task
from ..utils import resolve_device, write_jsonl
from .generate import Rollout, decode_responses, eos_token_ids, generate, sampling_settings
from .rewards import build_reward, completion_texts

ACCURACIES = ("format_acc", "exact_acc", "answer_acc")  # a task's verdicts, as shares of its held-out prompts


def _rollouts(policy, tokenizer, records: list, device, batch_size: int, max_new_tokens: int, **sampling):
    """``(chunk, rollout)`` of each ``batch_size`` records completed by ``policy`` in eval mode."""
    with eval_mode(policy):
        for i in range(0, len(records), batch_size):
            chunk = records[i : i + batch_size]
            ids, mask = prompt_tensors(tokenizer, chunk, device)
            yield chunk, generate(policy, ids, mask, max_new_tokens, eos_token_ids(policy, tokenizer),
                                  tokenizer.pad_token_id, tokenizer=tokenizer, **sampling)


@torch.no_grad()
def evaluate_task(task: ModuleType, policy, tokenizer, device, batch_size: int = 512,
                  max_new_tokens: int | None = None, prompts: list | None = None, stop: Sequence[str] = ()) -> dict:
    """Greedy completions of the task's held-out prompts scored by its verifier: ``{"format_acc",
    "exact_acc", "answer_acc", "examples": [(prompt, completion, format, exact), ...]}``."""
    prompts = prompts if prompts is not None else task.eval_prompts()
    rollouts = _rollouts(policy, tokenizer, [PromptRecord(p.text) for p in prompts], device, batch_size,
                         max_new_tokens or task.MAX_NEW_TOKENS, greedy=True, stop=stop)
    completions = [c for _, out in rollouts for c in decode_responses(tokenizer, out.response_ids, out.response_mask)]
    verdicts = [task.verify(p, c) for p, c in zip(prompts, completions)]
    return {**{k: sum(v[k.removesuffix("_acc")] for v in verdicts) / len(prompts) for k in ACCURACIES},
            "examples": [(p.text, c, v["format"], v["exact"]) for p, c, v in zip(prompts, completions, verdicts)]}


def evaluate_sharded(task, policy, tokenizer, device, shard: Shard, batch_size: int = 512,
                     max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> dict:
    """:func:`evaluate_task` over processes: global accuracies, this process's examples."""
    prompts = task.eval_prompts()
    if not shard.distributed:
        return evaluate_task(task, policy, tokenizer, device, batch_size, max_new_tokens, prompts, stop)
    mine = prompts[shard.span(len(prompts))]
    ev = evaluate_task(task, policy, tokenizer, device, batch_size, max_new_tokens, mine, stop) if mine \
        else {**dict.fromkeys(ACCURACIES, 0.0), "examples": []}
    counts = torch.tensor([ev[k] * len(mine) for k in ACCURACIES], dtype=torch.float64,
                          device=shard.accelerator.device)
    totals = shard.sum(counts) / len(prompts)
    return {**{k: float(v) for k, v in zip(ACCURACIES, totals.tolist())}, "examples": ev["examples"]}


def evaluate_path(path: str, cfg) -> dict:
    """Evaluate a saved policy (HF directory, hub id or LoRA adapter) on ``run.task``; writes ``eval.json``."""
    device = resolve_device(cfg.run.device)
    policy, tok = _load(path, cfg, device)
    ev = evaluate_task(get_task(cfg.run.task), policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens,
                       stop=cfg.ppo.stop)
    result = {"path": path, "task": cfg.run.task, **{k: ev[k] for k in ACCURACIES},
              "examples": [{"prompt": p, "completion": c, "format": f, "exact": e} for p, c, f, e in ev["examples"][:12]]}
    _write_eval(cfg, result)
    return result


def _write_eval(cfg, result: dict, samples: list[dict] | None = None) -> None:
    """``eval.json`` (and ``eval_samples.jsonl``) in ``run.out_dir``."""
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if samples is not None:
        write_jsonl(out / "eval_samples.jsonl", samples)
    (out / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")


@dataclass
class ScoredCompletions:
    """Completions of prompt records and their scores, one entry per record, in order."""

    completions: list[str]  # decoded responses, special tokens removed (what a reward function reads)
    finished: list[bool]  # True where the response ended with EOS
    total: torch.Tensor  # [n] float64: the reward's weighted total
    scores: dict[str, torch.Tensor]  # each source's [n] float64 score, by name
    accuracy: list[str] = field(default_factory=list)  # the declared 0/1 sources that define eval/accuracy
    kl: torch.Tensor | None = None  # [n] float64: completion_kl to the reference, when one was given


@torch.no_grad()
def completion_kl(policy, reference, roll: Rollout) -> torch.Tensor:
    """``[B]``: the exact KL(pi(.|x, y_<t) || pi_ref(.|x, y_<t)) summed over each completion of ``roll``
    (EOS included); both models share its tokenizer."""
    ids, mask, P = roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1]  # [B, T]
    logits, _ = policy_forward(policy, ids, mask, P)  # [B, R, V]
    ref_logits, _ = policy_forward(reference, ids, mask, P)  # [B, R, V]
    return masked_sum(kl_from_logits(logits, ref_logits), roll.response_mask, dim=1)  # [B]


@torch.no_grad()
def complete_and_score(policy, tokenizer, records: list, reward, device, batch_size: int = 512,
                       max_new_tokens: int = 64, greedy: bool = True, temperature: float = 1.0,
                       seed: int = 0, shaping: dict | None = None,
                       stop: Sequence[str] = (), reference=None) -> ScoredCompletions:
    """Complete every record's prompt (greedy, or sampled from ``seed`` under ``shaping``) and score
    the completions by ``reward``; with a ``reference``, each one's :func:`completion_kl` too."""
    texts, finished, batches, kls = [], [], [], []  # batches: reward.score's (total, scores) of each
    gen = torch.Generator(device=device).manual_seed(seed)
    for chunk, roll in _rollouts(policy, tokenizer, records, device, batch_size, max_new_tokens, greedy=greedy,
                                 temperature=temperature, generator=gen, stop=stop, **(shaping or {})):
        batches.append(reward.score(roll, chunk))
        if reference is not None:
            kls.append(completion_kl(policy, reference, roll))
        texts += completion_texts(roll, tokenizer)[1]
        finished += roll.finished.tolist()
    cat = lambda xs: torch.cat([torch.zeros(0, dtype=torch.float64), *(x.double().cpu() for x in xs)])  # noqa: E731
    scores = {name: cat([s[name] for _, s in batches]) for name in reward.weights}
    return ScoredCompletions(texts, finished, cat([t for t, _ in batches]), scores, reward.accuracy_sources(),
                             cat(kls) if reference is not None else None)


def reward_means(scored: ScoredCompletions, shard: Shard | None = None, device=None) -> dict[str, float]:
    """``eval/reward`` (the total's mean), ``eval/reward/<source>``, ``eval/reward_std/<source>`` and
    ``eval/accuracy`` (the share every declared 0/1 source scored 1) over every process; NaN is left out."""
    shard = shard or Shard()
    names = list(scored.scores)
    by_source = torch.stack([scored.scores[name] for name in names]) if names else torch.zeros(0, len(scored.total))
    values = torch.cat([scored.total[None], by_source]).double()  # [1 + S, n_local]
    judged = correct = torch.zeros(len(scored.total), dtype=torch.bool)  # [n_local]
    if scored.accuracy:  # [S_acc, n_local] -> completions every declared source that scored them scores 1
        acc = by_source[[names.index(a) for a in scored.accuracy]]
        judged = ~acc.isnan().all(0)
        correct = judged & ((acc == 1) | acc.isnan()).all(0)
    filled = values.nan_to_num(0.0)
    sums = torch.cat([filled.sum(1), correct.double().sum()[None]])  # [2 + S]
    squares = filled[1:].square().sum(1)  # [S]
    counts = torch.cat([(~values.isnan()).double().sum(1), judged.double().sum()[None]])  # [2 + S]
    totals = torch.cat([sums, squares, counts])  # summed over every process
    totals = shard.sum(totals.to(device)).cpu() if shard.distributed else totals
    sums, squares, counts = totals.split([len(sums), len(squares), len(counts)])
    means = sums / counts
    scored_n = counts[1 : 1 + len(names)]  # [S] completions each source scored
    variances = ((squares - scored_n * means[1 : 1 + len(names)].square()) / (scored_n - 1).clamp(min=1)).clamp(min=0.0)
    means = means.tolist()
    out = {"eval/reward": means[0], **{f"eval/reward/{name}": means[1 + j] for j, name in enumerate(names)}}
    out.update({f"eval/reward_std/{name}": float(v.sqrt()) for name, v in zip(names, variances)})
    if scored.accuracy:
        out["eval/accuracy"] = means[-1]
    return out


def evaluate_rewards(policy, tokenizer, records: list, reward, device, shard: Shard | None = None,
                     batch_size: int = 512, max_new_tokens: int = 64, greedy: bool = True,
                     temperature: float = 1.0, seed: int = 0, shaping: dict | None = None,
                     stop: Sequence[str] = ()) -> dict[str, float]:
    """:func:`reward_means` of the held-out records' completions, the records split over processes."""
    shard = shard or Shard()
    scored = complete_and_score(policy, tokenizer, records[shard.span(len(records))], reward, device, batch_size, max_new_tokens,
                                greedy, temperature, seed, shaping, stop)
    return reward_means(scored, shard, device)


def win_rate(model: torch.Tensor, baseline: torch.Tensor) -> float:
    """The share of prompts where ``model``'s score beats ``baseline``'s, a tie half, a NaN left out."""
    both = ~(model.isnan() | baseline.isnan())
    wins = (model > baseline).double() + 0.5 * (model == baseline).double()
    return float(wins[both].mean())


@dataclass
class _Completed:
    path: str
    tokenizer: object
    records: list
    reward: object
    scored: ScoredCompletions
    limit: object = None  # the prompt limit the records were encoded to


def _load(path: str, cfg, device) -> tuple:
    """``(policy, tokenizer)`` saved at ``path``."""
    return (load_policy(path, cfg.model.dtype, cfg.model.trust_remote_code, cfg.model.name).to(device),
            load_tokenizer(path, cfg.model.trust_remote_code))


def _complete_file_prompts(path: str, cfg, device, max_new_tokens: int, like: _Completed | None = None,
                           loaded: tuple | None = None, reference: tuple | None = None) -> _Completed:
    """The policy at ``path`` (``loaded``: in memory) completes and scores ``data.path``'s prompts,
    reusing ``like``'s prompts and reward where its tokenizer and prompt limit are the same."""
    policy, tok = loaded or _load(path, cfg, device)
    key = "eval.max_new_tokens" if cfg.eval.max_new_tokens else "ppo.max_new_tokens"
    limit = prompt_limit(cfg, context_window(policy), max_new_tokens, key)
    if like is not None and same_tokenizer(tok, like.tokenizer) and limit == like.limit:
        tok, records, reward = like.tokenizer, like.records, like.reward
    else:
        records = file_records(cfg.data.path, tok, cfg, limit=limit)
        reward = build_reward(cfg, tok, device)
    ec = cfg.eval
    ref = reference[0] if reference is not None and same_tokenizer(tok, reference[1]) else None
    scored = complete_and_score(policy, tok, records, reward, device, ec.batch_size, max_new_tokens, ec.greedy,
                                cfg.ppo.temperature, cfg.run.seed, sampling_settings(cfg.ppo), cfg.ppo.stop, ref)
    return _Completed(path, tok, records, reward, scored, limit)


def _score(x: torch.Tensor) -> float | None:
    """A score as JSON writes it: None (null) for NaN, a completion the reward did not score."""
    return None if bool(x.isnan()) else float(x)


def _sample_rows(model: _Completed, base: _Completed | None) -> list[dict]:
    """One JSONL row per prompt: the prompt and its columns, each policy's completion and scores."""
    rows = []
    for i, rec in enumerate(model.records):
        row = {"prompt": rec.original, **({"columns": rec.columns} if rec.columns else {})}
        for prefix, done in (("", model), ("baseline_", base)):
            if done is None:
                continue
            sc = done.scored
            row.update({f"{prefix}completion": sc.completions[i], f"{prefix}finished": sc.finished[i],
                        f"{prefix}scores": {k: _score(v[i]) for k, v in sc.scores.items()},
                        f"{prefix}reward": _score(sc.total[i])})
            if sc.kl is not None:
                row[f"{prefix}kl_to_baseline"] = float(sc.kl[i])
        rows.append(row)
    return rows


def evaluate_files(path: str, cfg, baseline: str | None = None) -> dict:
    """Score the policy at ``path``'s completions of ``data.path`` (with ``eval.baseline``: win rates and
    ``kl_to_baseline``, docs/data.md); writes ``eval_samples.jsonl`` and ``eval.json``, the result."""
    if not cfg.data.path:
        raise ValueError("data.path is empty: give the prompts to evaluate on (a JSONL of {\"prompt\": ...})")
    if not cfg.reward.name and not cfg.reward.function:
        raise ValueError("no reward to score the completions of data.path with: set reward.function=module:name "
                         "and/or reward.name=REWARD_MODEL_DIR")
    max_new_tokens = cfg.eval.max_new_tokens or cfg.ppo.max_new_tokens
    if not max_new_tokens:
        raise ValueError("set eval.max_new_tokens (or ppo.max_new_tokens) with data.path: the longest completion "
                         "to decode")
    baseline = baseline if baseline is not None else cfg.eval.baseline
    path, baseline = policy_dir(path), policy_dir(baseline) if baseline else None
    device = resolve_device(cfg.run.device)
    base_model = _load(baseline, cfg, device) if baseline else None
    model = _complete_file_prompts(path, cfg, device, max_new_tokens, reference=base_model)
    base = _complete_file_prompts(baseline, cfg, device, max_new_tokens, like=model, loaded=base_model) \
        if baseline else None
    result = {"path": path, "data": str(cfg.data.path), "prompts": len(model.records),
              "max_new_tokens": max_new_tokens, "greedy": cfg.eval.greedy, **reward_means(model.scored)}
    if base is not None:
        result["baseline"] = {"path": baseline, **reward_means(base.scored)}
        result["win_rate"] = win_rate(model.scored.total, base.scored.total)
        result["win_rates"] = {name: win_rate(model.scored.scores[name], base.scored.scores[name])
                               for name in model.scored.scores}
        if model.scored.kl is not None:
            result["kl_to_baseline"] = float(model.scored.kl.mean())
    _write_eval(cfg, result, _sample_rows(model, base))
    return result
