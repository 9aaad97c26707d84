"""Greedy evaluation of a policy on a task's held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch

from .distributed import Shard
from .models import load_policy, load_tokenizer
from .prompts import prompt_tensors
from .rollout import decode_responses, generate, tokenize_prompts
from .tasks import doubling, get_task
from .utils import resolve_device


@torch.no_grad()
def evaluate_task(task: ModuleType, policy, tokenizer, device, batch_size: int = 512,
                  max_new_tokens: int | None = None, prompts: list | None = None) -> dict:
    """Greedy decoding on the task's held-out prompts (doubling: 512, cities: 130), scored by
    its verifier.

    Returns ``{"format_acc", "exact_acc", "answer_acc", "examples": [(prompt, completion, format, exact), ...]}``.
    """
    prompts = prompts if prompts is not None else task.eval_prompts()
    max_new_tokens = max_new_tokens or task.MAX_NEW_TOKENS
    was_training = policy.training
    policy.eval()
    fmt = exact = answer = 0
    examples = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids, mask = tokenize_prompts(tokenizer, [p.text for p in chunk], device)
        out = generate(policy, ids, mask, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, greedy=True)
        for p, c in zip(chunk, decode_responses(tokenizer, out.response_ids, out.response_mask)):
            v = task.verify(p, c)
            fmt += v["format"]
            exact += v["exact"]
            answer += v["answer"]
            examples.append((p.text, c, v["format"], v["exact"]))
    policy.train(was_training)
    n = len(prompts)
    return {"format_acc": fmt / n, "exact_acc": exact / n, "answer_acc": answer / n, "examples": examples}


def evaluate_sharded(task, policy, tokenizer, device, shard: Shard, batch_size: int = 512,
                     max_new_tokens: int | None = None) -> dict:
    """:func:`rlhfkit.evaluate.evaluate_task` with the held-out prompts split over processes
    (contiguous shards) and the counts summed: every process gets the global accuracies; the
    examples are this process's (the main process holds the first ones, as with one process)."""
    prompts = task.eval_prompts()
    if not shard.distributed:
        return evaluate_task(task, policy, tokenizer, device, batch_size, max_new_tokens, prompts)
    n = len(prompts)
    lo, hi = n * shard.rank // shard.world, n * (shard.rank + 1) // shard.world
    ev = evaluate_task(task, policy, tokenizer, device, batch_size, max_new_tokens, prompts[lo:hi]) \
        if hi > lo else {"format_acc": 0.0, "exact_acc": 0.0, "answer_acc": 0.0, "examples": []}
    keys = ("format_acc", "exact_acc", "answer_acc")
    counts = torch.tensor([ev[k] * (hi - lo) for k in keys], dtype=torch.float64, device=shard.accelerator.device)
    totals = shard.sum(counts) / n
    return {**{k: float(v) for k, v in zip(keys, totals.tolist())}, "examples": ev["examples"]}


def evaluate_doubling(policy, tokenizer, device, batch_size: int = 512, max_new_tokens: int | None = None,
                      prompts: list[doubling.Prompt] | None = None) -> dict:
    """:func:`evaluate_task` on the doubling task."""
    return evaluate_task(doubling, policy, tokenizer, device, batch_size, max_new_tokens, prompts)


def evaluate_path(path: str, cfg) -> dict:
    """Load a saved policy (any HF causal-LM directory or hub id, or a LoRA adapter directory)
    and evaluate it on ``run.task``; writes ``eval.json`` to ``run.out_dir``."""
    device = resolve_device(cfg.run.device)
    tok = load_tokenizer(path, cfg.model.trust_remote_code)
    policy = load_policy(path, cfg.model.dtype, cfg.model.trust_remote_code).to(device)
    ev = evaluate_task(get_task(cfg.run.task), policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
    result = {"path": path, "task": cfg.run.task, "format_acc": ev["format_acc"], "exact_acc": ev["exact_acc"], "answer_acc": ev["answer_acc"],
              "examples": [{"prompt": p, "completion": c, "format": f, "exact": e} for p, c, f, e in ev["examples"][:12]]}
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
    return result


@torch.no_grad()
def evaluate_rewards(policy, tokenizer, records: list, reward, device, shard: Shard | None = None,
                     batch_size: int = 512, max_new_tokens: int = 64, greedy: bool = True,
                     temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Completions of held-out prompt records (greedy, or sampled with a fixed seed) scored by
    the training reward: ``eval/reward`` (the weighted total's mean), ``eval/reward/<source>``
    and, when some source gives only 0 or 1, ``eval/accuracy`` (the share of completions that
    every such source scores 1). The records are split over processes; the means are global."""
    shard = shard or Shard()
    n = len(records)
    lo, hi = n * shard.rank // shard.world, n * (shard.rank + 1) // shard.world
    names = list(reward.weights)
    totals, parts = [torch.zeros(0, dtype=torch.float64)], {name: [torch.zeros(0, dtype=torch.float64)] for name in names}
    was_training = policy.training
    policy.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(lo, hi, batch_size):
        chunk = records[i : min(hi, i + batch_size)]
        ids, mask = prompt_tensors(tokenizer, chunk, device)
        roll = generate(policy, ids, mask, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
                        temperature, greedy=greedy, generator=gen)
        total, scores = reward.score(roll, chunk)
        totals.append(total.double().cpu())
        for name in names:
            parts[name].append(scores[name].double().cpu())
    policy.train(was_training)
    total = torch.cat(totals)  # [n_local]
    by_source = torch.stack([torch.cat(parts[name]) for name in names])  # [S, n_local]
    # sums over every process: total, each source, and each source's count of scores other than 0/1
    binary = (by_source == 0) | (by_source == 1)  # [S, n_local]
    sums = torch.cat([total.sum()[None], by_source.sum(1), (~binary).sum(1).double()])
    sums = shard.sum(sums.to(device)).cpu() if shard.distributed else sums
    S = len(names)
    out = {"eval/reward": float(sums[0] / n)}
    out.update({f"eval/reward/{name}": float(sums[1 + j] / n) for j, name in enumerate(names)})
    is01 = sums[1 + S :] == 0  # [S]: sources that gave only 0 or 1, on every process
    if bool(is01.any()):
        correct = (by_source[is01] == 1).all(0).double().sum()[None]
        correct = shard.sum(correct.to(device)).cpu() if shard.distributed else correct
        out["eval/accuracy"] = float(correct / n)
    return out
