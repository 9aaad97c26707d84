"""Direct preference optimisation (Rafailov et al. 2023): no reward model, no sampling.

The policy is trained on a fixed set of (prompt, chosen, rejected) pairs with the sigmoid
DPO loss of :func:`rlhfkit.core.dpo_loss`; the reference is a frozen copy of the starting
policy, whose log-probs are computed once for the whole set (``dpo.precompute_ref``) or
by a reference forward per batch.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..core import dpo_loss, logprobs_from_logits
from ..evaluate import evaluate_task
from ..models import disable_dropout, freeze, load_policy, load_tokenizer, position_ids_from_mask
from ..tasks import get_task
from ..utils import MetricsLogger, UpdateGuard, make_accelerator, mean_stats, progress, setup_run
from .reward import encode_triples, stack_pairs

LOSS_FIELDS = ("input_ids", "attention_mask", "loss_mask")


def sequence_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of log pi(response tokens | prefix) per row: ``[2B, T]`` -> ``[2B]``.

    ``loss_mask[:, t]`` marks token t as a response token (predicted by position t - 1)."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    logps = logprobs_from_logits(logits[:, :-1], ids[:, 1:])  # [2B, T-1]
    return torch.where(loss_mask[:, 1:].bool(), logps, 0.0).sum(-1)  # [2B]


def train_dpo(cfg: Config, policy_path: str | None = None) -> dict:
    """DPO on the task's preference pairs (``run.task``); saves the policy to ``<out_dir>/policy``."""
    out = setup_run(cfg)
    accelerator = make_accelerator(cfg)
    device = accelerator.device
    dc = cfg.dpo
    policy_path = policy_path or cfg.model.name
    if not policy_path:
        raise ValueError("DPO needs a policy to start from: set model.name=PATH")
    trc = cfg.model.trust_remote_code
    tok = load_tokenizer(policy_path, trc)
    policy = disable_dropout(load_policy(policy_path, trust_remote_code=trc)).to(device).train()
    ref = freeze(load_policy(policy_path, trust_remote_code=trc)).to(device)
    task = get_task(cfg.run.task)
    triples = task.TaskData(cfg.run.seed + 3).preference_pairs(dc.num_pairs, cfg.reward.hard_negatives)
    enc = encode_triples(tok, triples)
    n_pairs = len(triples)
    ref_cache = None
    if dc.precompute_ref:
        with torch.no_grad():  # one reference pass over the whole set, reused every epoch
            ref_cache = torch.cat([
                sequence_logprobs(ref, *stack_pairs(enc, torch.arange(i, min(n_pairs, i + 512)), device, LOSS_FIELDS)).view(2, -1)
                for i in range(0, n_pairs, 512)
            ], dim=1)  # [2, N]: row 0 chosen, row 1 rejected
    opt = torch.optim.AdamW(policy.parameters(), lr=dc.lr, weight_decay=0.0)
    log = MetricsLogger(out / "metrics.jsonl", cfg)
    guard = UpdateGuard(cfg.run.max_bad_updates, "dpo")
    gen = torch.Generator().manual_seed(cfg.run.seed)
    order = torch.randperm(n_pairs, generator=gen)
    train_s, pos, reached, history = 0.0, 0, None, []
    bar = progress(range(dc.steps), desc="dpo", enabled=cfg.run.progress)
    for step in bar:
        t0 = time.perf_counter()
        if pos + dc.batch_size > n_pairs:  # next epoch
            order, pos = torch.randperm(n_pairs, generator=gen), 0
        idx = order[pos : pos + dc.batch_size]
        pos += dc.batch_size
        ids, attn, rmask = stack_pairs(enc, idx, device, LOSS_FIELDS)
        logps = sequence_logprobs(policy, ids, attn, rmask).view(2, -1)  # [2, B]
        if ref_cache is not None:
            ref_logps = ref_cache[:, idx.to(ref_cache.device)]
        else:
            with torch.no_grad():
                ref_logps = sequence_logprobs(ref, ids, attn, rmask).view(2, -1)
        loss, stats = dpo_loss(logps[0], logps[1], ref_logps[0], ref_logps[1], dc.beta)
        if dc.nll_coef:  # keep the chosen answers likely: DPO alone may win by only pushing rejected down
            n_chosen = rmask[: len(idx), 1:].sum()
            nll = -logps[0].sum() / n_chosen
            loss = loss + dc.nll_coef * nll
            stats["dpo/chosen_nll"] = nll.detach()
        opt.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        if guard.ok(loss, torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)):
            opt.step()
        train_s += time.perf_counter() - t0
        row = mean_stats([stats])
        if (dc.eval_every and (step + 1) % dc.eval_every == 0) or step == dc.steps - 1:
            ev = evaluate_task(task, policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
            row.update({"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"]})
            if dc.stop_at_format and ev["format_acc"] >= dc.stop_at_format:
                reached = {"step": step + 1, "train_s": train_s}
        row["time/train_s"], row["guard/skipped_updates"] = train_s, guard.skipped
        history.append(log.log(step, row))
        bar.set_postfix(loss=f"{row['dpo/loss']:.3f}", acc=f"{row['dpo/accuracy']:.2f}")
        if reached:
            break
    log.close()
    policy.save_pretrained(Path(out) / "policy")
    tok.save_pretrained(Path(out) / "policy")
    final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
    return {"path": str(Path(out) / "policy"), "seconds": train_s, "steps": len(history), "reached": reached,
            "final": final}
