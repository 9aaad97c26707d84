"""Pretraining a tiny GPT-2 from scratch on a task's text (``run.task``).

Plain next-token loss, padding ignored. On the doubling task the result doubles numbers but
chooses the answer's character set at random, so it obeys a prefix only about a third of the
time; on the city-facts task it knows the facts but answers tersely.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..checkpoint import Checkpointer, loop_state, restore_loop_state
from ..config import Config
from ..evaluate import evaluate_task
from ..models import build_tiny_policy, masked_lm_loss
from ..tasks import get_task
from ..utils import MetricsLogger, UpdateGuard, is_main_process, make_accelerator, progress, setup_run


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up then cosine decay to ``floor`` of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    return f


def pretrain(cfg: Config) -> dict:
    """Train the base policy; saves it (HF format) to ``<out_dir>/policy``. Returns a summary."""
    out = setup_run(cfg)
    accelerator = make_accelerator(cfg)
    device = accelerator.device
    task = get_task(cfg.run.task)
    tok = task.make_tokenizer()
    pc = cfg.pretrain
    model = build_tiny_policy(tok, cfg.run.seed, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
                              n_embd=cfg.model.n_embd, n_positions=task.N_POSITIONS).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.lr, weight_decay=pc.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(pc.warmup_steps, pc.steps))
    data = task.TaskData(cfg.run.seed)
    guard = UpdateGuard(cfg.run.max_bad_updates, "pretrain")
    ckpt = Checkpointer.from_config(cfg, out, enabled=is_main_process())
    trained, opts, scheds = {"model": model}, {"optimizer": opt}, {"scheduler": sched}
    resumed = ckpt.restore(trained, opts, scheds, steps=pc.steps) or {}
    if resumed:
        restore_loop_state(resumed, guard, data)
    start = resumed.get("step", 0)
    log = MetricsLogger(out / "metrics.jsonl", cfg, resume=resumed.get("metrics"))
    t0 = time.perf_counter() - resumed.get("seconds", 0.0)
    bar = progress(range(start, pc.steps), desc="pretrain", enabled=cfg.run.progress, total=pc.steps, initial=start)
    for step in bar:
        # texts end with the EOS character; right padding is fine, positions come from the mask
        enc = tok(data.pretrain_texts(pc.batch_size), padding=True, padding_side="right", return_tensors="pt")
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        loss = masked_lm_loss(model, ids, mask, mask)  # every real token after BOS is a target
        accelerator.backward(loss)
        if guard.ok(loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == pc.steps - 1:
            log.log(step, {"train/loss": loss, "train/lr": sched.get_last_lr()[0],
                           "guard/skipped_updates": guard.skipped})
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if ckpt.due(step + 1, step == pc.steps - 1):
            ckpt.save(step + 1, trained, opts, loop_state(step + 1, log, guard, data,
                                                          seconds=time.perf_counter() - t0), scheds)
    seconds = time.perf_counter() - t0
    ev = evaluate_task(task, model, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
    log.log(pc.steps, {"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"],
                       "eval/answer_acc": ev["answer_acc"]})
    log.close()
    save_dir = Path(out) / "policy"
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    return {"path": str(save_dir), "seconds": seconds, "format_acc": ev["format_acc"],
            "exact_acc": ev["exact_acc"], "answer_acc": ev["answer_acc"]}
