"""Supervised fine-tuning on demonstrations (prompt -> completion), any causal LM.

Loss: next-token cross-entropy on completion tokens only (``data.completion_only``), or on
every token; records in TRL's formats via :mod:`rlhfkit.data`; optional packing.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..data import encode_sft, load_sft, pack_sft
from ..models import load_policy, load_tokenizer, masked_lm_loss
from ..utils import MetricsLogger, UpdateGuard, make_accelerator, progress, setup_run
from .pretrain import lr_lambda


def train_sft(cfg: Config, policy_path: str | None = None, data_path: str | None = None) -> dict:
    """SFT of ``model.name`` on ``data.path``; saves to ``<out_dir>/policy``."""
    out = setup_run(cfg)
    accelerator = make_accelerator(cfg)
    device = accelerator.device
    sc, dc = cfg.sft, cfg.data
    policy_path, data_path = policy_path or cfg.model.name, data_path or dc.path
    if not policy_path or not data_path:
        raise ValueError("SFT needs a model and data: set model.name=PATH and data.path=FILE.jsonl")
    tok = load_tokenizer(policy_path, cfg.model.trust_remote_code, need_pad=False)  # rows pad with EOS if none
    model = load_policy(policy_path, trust_remote_code=cfg.model.trust_remote_code).to(device).train()
    enc = encode_sft(load_sft(data_path, tok), tok, dc.max_length, dc.truncation)
    if not dc.completion_only:  # every real token after the first is a target
        enc["loss_mask"] = enc["attention_mask"].clone()
    if dc.packing:
        enc = pack_sft(enc, dc.max_length, tok.pad_token_id or 0)
    n = enc["input_ids"].shape[0]
    opt = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(sc.warmup_steps, sc.steps))
    gen = torch.Generator().manual_seed(cfg.run.seed)
    log = MetricsLogger(out / "metrics.jsonl")
    guard = UpdateGuard(cfg.run.max_bad_updates, "sft")
    t0 = time.perf_counter()
    bar = progress(range(sc.steps), desc="sft", enabled=cfg.run.progress)
    for step in bar:
        idx = torch.randint(0, n, (min(sc.batch_size, n),), generator=gen)
        batch = {k: v[idx].to(device) for k, v in enc.items()}
        loss = masked_lm_loss(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                              batch.get("position_ids"))
        accelerator.backward(loss)
        if guard.ok(loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == sc.steps - 1:
            log.log(step, {"sft/loss": loss, "sft/lr": sched.get_last_lr()[0], "guard/skipped_updates": guard.skipped})
            bar.set_postfix(loss=f"{loss.item():.4f}")
    log.close()
    save_dir = Path(out) / "policy"
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    return {"path": str(save_dir), "seconds": time.perf_counter() - t0, "examples": n, "final_loss": loss.item()}
