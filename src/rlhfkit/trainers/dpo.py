"""Direct preference optimisation (Rafailov et al. 2023): no reward model, no sampling.

The policy is trained on a fixed set of (prompt, chosen, rejected) pairs with the sigmoid
DPO loss of :func:`rlhfkit.core.dpo_loss`; the reference is a frozen copy of the starting
policy (or, with LoRA, the policy with its adapter disabled), whose log-probs are computed
once for the whole set (``dpo.precompute_ref``) or by a reference forward per batch. Under
``accelerate launch`` each process takes its share of every batch of pairs
(``dpo.batch_size`` is global).
"""

from __future__ import annotations

import time

import torch

from ..config import Config
from ..core import dpo_loss, logprobs_from_logits, position_ids_from_mask
from ..data import encode_triples, stack_pairs
from ..distributed import clip_grad_norm, full_weights
from ..evaluate import evaluate_sharded
from ..models import load_tokenizer, policy_with_reference
from ..tasks import get_task
from ..utils import mean_stats
from .common import Run

LOSS_FIELDS = ("input_ids", "attention_mask", "loss_mask")


def sequence_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of log pi(response tokens | prefix) per row: ``[2B, T]`` -> ``[2B]``.

    ``loss_mask[:, t]`` marks token t as a response token (predicted by position t - 1)."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    logps = logprobs_from_logits(logits[:, :-1], ids[:, 1:])  # [2B, T-1]
    return torch.where(loss_mask[:, 1:].bool(), logps, 0.0).sum(-1)  # [2B]


def reference_logprobs(ref, enc: dict, shard, device) -> torch.Tensor:
    """The reference's summed response log-probs of every pair, ``[2, N]`` (row 0 chosen, row 1
    rejected): one pass over the whole set, chunks dealt round-robin to the processes, summed."""
    n_pairs = enc["chosen_input_ids"].shape[0]
    cache = torch.zeros((2, n_pairs), device=device)  # [2, N]
    with torch.no_grad():
        for k, i in enumerate(range(0, n_pairs, 512)):
            if k % shard.world == shard.rank:
                idx = torch.arange(i, min(n_pairs, i + 512))
                cache[:, idx] = sequence_logprobs(ref, *stack_pairs(enc, idx, device, LOSS_FIELDS)).view(2, -1)
    return shard.sum(cache)


def train_dpo(cfg: Config, policy_path: str | None = None) -> dict:
    """DPO on the task's preference pairs (``run.task``); saves the policy to ``<out_dir>/policy``."""
    dc = cfg.dpo
    policy_path = policy_path or cfg.model.name
    if not policy_path:
        raise ValueError("DPO needs a policy to start from: set model.name=PATH")
    run = Run(cfg, "dpo", dc.steps)
    shard, device = run.shard, run.device
    shard.local_size(dc.batch_size, "dpo.batch_size")
    tok = load_tokenizer(policy_path, cfg.model.trust_remote_code)
    policy, ref = policy_with_reference(policy_path, cfg.model, device)
    task = get_task(cfg.run.task)
    enc = encode_triples(tok, task.TaskData(cfg.run.seed + 3).preference_pairs(dc.num_pairs, cfg.reward.hard_negatives))
    n_pairs = enc["chosen_input_ids"].shape[0]
    ref_cache = reference_logprobs(ref, enc, shard, device) if dc.precompute_ref else None  # reused every epoch
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=dc.lr, weight_decay=0.0)
    train_policy, opt = run.prepare(policy, opt, micro_batch=dc.batch_size // shard.world)  # DDP
    params = [p for p in policy.parameters() if p.requires_grad]  # FSDP2 replaces them in prepare
    gen = torch.Generator().manual_seed(cfg.run.seed)
    order = torch.randperm(n_pairs, generator=gen)
    train_s, pos, reached = 0.0, 0, None
    resumed = run.restore({"policy": policy}, {"optimizer": opt}, generator=gen)
    if resumed:  # the epoch's order and the position in it, too
        order, pos, train_s = torch.tensor(resumed["order"]), resumed["pos"], resumed["train_s"]
    for step in run.steps():
        t0 = time.perf_counter()
        if pos + dc.batch_size > n_pairs:  # next epoch
            order, pos = torch.randperm(n_pairs, generator=gen), 0
        idx = shard.take(order[pos : pos + dc.batch_size])  # this process's pairs of the global batch
        pos += dc.batch_size
        loss, row = dpo_step(train_policy, ref, ref_cache, enc, idx, dc, shard, device)
        opt.zero_grad(set_to_none=True)
        run.accelerator.backward(loss)
        row["dpo/grad_norm"] = clip_grad_norm(run.accelerator, params, 1.0)
        if run.guard.ok(loss, row["dpo/grad_norm"]):
            opt.step()
        train_s += time.perf_counter() - t0
        if (dc.eval_every and (step + 1) % dc.eval_every == 0) or step == dc.steps - 1:
            with full_weights(train_policy):
                ev = evaluate_sharded(task, policy, tok, device, shard, cfg.eval.batch_size, cfg.eval.max_new_tokens)
            row.update({"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"]})
            if dc.stop_at_format and ev["format_acc"] >= dc.stop_at_format:
                reached = {"step": step + 1, "train_s": train_s}
        row["time/train_s"] = train_s
        last_row = run.log(step, row, loss=f"{row['dpo/loss']:.3f}", acc=f"{row['dpo/accuracy']:.2f}")
        if reached:
            break
        run.checkpoint(step, order=order.tolist(), pos=pos, train_s=train_s)
    run.close()
    save_dir = run.save_model(policy, tok, "policy", adapter="policy_adapter")  # LoRA: merged in policy/
    final = {k: v for k, v in last_row.items() if k.startswith("eval/")}
    return {"path": str(save_dir), "seconds": train_s, "steps": step + 1, "reached": reached, "final": final}


def dpo_step(train_policy, ref, ref_cache, enc: dict, idx: torch.Tensor, dc, shard, device):
    """The loss on pairs ``idx`` (this process's share) and its stats, averaged over processes."""
    ids, attn, rmask = stack_pairs(enc, idx, device, LOSS_FIELDS)
    logps = sequence_logprobs(train_policy, ids, attn, rmask).view(2, -1)  # [2, B]
    if ref_cache is not None:
        ref_logps = ref_cache[:, idx.to(ref_cache.device)]
    else:
        with torch.no_grad():
            ref_logps = sequence_logprobs(ref, ids, attn, rmask).view(2, -1)
    loss, stats = dpo_loss(logps[0], logps[1], ref_logps[0], ref_logps[1], dc.beta)
    if dc.nll_coef:  # keep the chosen answers likely: DPO alone may win by only pushing rejected down
        chosen_mask = rmask[: len(idx), 1:]
        # a token mean: the weight makes the processes' average the mean over all their tokens
        nll = -logps[0].sum() / chosen_mask.sum() * shard.token_weight(chosen_mask)
        loss = loss + dc.nll_coef * nll
        stats["dpo/chosen_nll"] = nll.detach()
    return loss, shard.mean(mean_stats([stats]))  # the DPO terms are means over pairs, equal on every process
