"""Greedy evaluation of a policy on a task's held-out prompts."""

from __future__ import annotations

from types import ModuleType

import torch

from .rollout import generate
from .tasks import doubling, get_task


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Decoded response text per row, special tokens kept (EOS matters), padding dropped."""
    lengths = response_mask.sum(-1).tolist()
    rows = [ids[:n] for ids, n in zip(response_ids.tolist(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


def tokenize_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding=True, return_tensors="pt", padding_side="left")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


@torch.no_grad()
def evaluate_task(task: ModuleType, policy, tokenizer, device, batch_size: int = 512,
                  max_new_tokens: int | None = None, prompts: list | None = None) -> dict:
    """Greedy decoding on the task's held-out prompts (doubling: 512, cities: 78), scored by
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


def evaluate_doubling(policy, tokenizer, device, batch_size: int = 512, max_new_tokens: int | None = None,
                      prompts: list[doubling.Prompt] | None = None) -> dict:
    """:func:`evaluate_task` on the doubling task."""
    return evaluate_task(doubling, policy, tokenizer, device, batch_size, max_new_tokens, prompts)


def evaluate_path(path: str, cfg) -> dict:
    """Load a saved policy (HF format) and evaluate it; writes ``eval.json`` to ``run.out_dir``."""
    import json
    from pathlib import Path

    from .models import load_policy, load_tokenizer
    from .utils import resolve_device

    device = resolve_device(cfg.run.device)
    tok = load_tokenizer(path, cfg.model.trust_remote_code)
    policy = load_policy(path, trust_remote_code=cfg.model.trust_remote_code).to(device)
    ev = evaluate_task(get_task(cfg.run.task), policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
    result = {"path": path, "task": cfg.run.task, "format_acc": ev["format_acc"], "exact_acc": ev["exact_acc"], "answer_acc": ev["answer_acc"],
              "examples": [{"prompt": p, "completion": c, "format": f, "exact": e} for p, c, f, e in ev["examples"][:12]]}
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False))
    return result
