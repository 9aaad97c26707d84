"""Pretraining a tiny GPT-2 from scratch on a task's text (``run.task``): next-token loss,
padding ignored."""

from __future__ import annotations

import torch

from ..config import Config
from ..models.forward import build_tiny_policy, masked_lm_loss
from ..rollout.evaluate import evaluate_task
from ..tasks import get_task
from .common import Run, lr_lambda


def pretrain(cfg: Config) -> dict:
    """Train the base policy; saves it (HF format) to ``<out_dir>/policy``. Returns a summary."""
    pc = cfg.pretrain
    run = Run(cfg, "pretrain", pc.steps, log_every=20)
    task = get_task(cfg.run.task)
    tok = task.make_tokenizer()
    model = build_tiny_policy(tok, cfg.run.seed, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
                              n_embd=cfg.model.n_embd, n_positions=task.N_POSITIONS).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.lr, weight_decay=pc.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(pc.warmup_steps, pc.steps))
    data, engine = task.TaskData(cfg.run.seed), run.engine(model)
    run.restore({"model": model}, {"optimizer": opt}, {"scheduler": sched}, data=data)
    for step in run.steps():
        # texts end with the EOS character; right padding is fine, positions come from the mask
        enc = tok(data.pretrain_texts(pc.batch_size), padding=True, padding_side="right", return_tensors="pt")
        ids, mask = enc["input_ids"].to(run.device), enc["attention_mask"].to(run.device)
        loss = masked_lm_loss(model, ids, mask, mask)  # every real token after BOS is a target
        engine.backward(loss)
        engine.update(opt, model.parameters(), loss)
        lr = sched.get_last_lr()[0]  # this step's rate, before the scheduler moves on
        sched.step()
        if run.log_due(step):
            run.log(step, {"train/loss": loss, "train/lr": lr}, loss=f"{loss.item():.4f}")
        run.checkpoint(step)
    seconds = run.seconds
    ev = evaluate_task(task, model, tok, run.device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
    run.log(pc.steps, {"eval/format_acc": ev["format_acc"], "eval/exact_acc": ev["exact_acc"],
                       "eval/answer_acc": ev["answer_acc"]})
    run.close()
    save_dir = run.save_model(model, tok, "policy")
    return {"path": str(save_dir), "seconds": seconds, "format_acc": ev["format_acc"],
            "exact_acc": ev["exact_acc"], "answer_acc": ev["answer_acc"]}
