"""SFT of any causal LM on demonstrations: next-token cross-entropy on the completion tokens
(``data.completion_only``) or every token, optional packing and LoRA (docs/algorithms/sft.md)."""

from __future__ import annotations

import functools

import torch

from ..config import Config
from ..data import Limit, SFTExample, context_limit, encode_sft, hold_out, load_sft, pack_sft
from ..models.forward import context_window, eval_mode, load_tokenizer, masked_lm_loss, policy_with_reference
from ..models.precision import compute_weights
from ..run.distributed import Shard, full_weights
from ..tasks import get_task
from .common import LOSS_FIELDS, Run, lr_lambda, sequence_logprobs


def train_sft(cfg: Config, policy_path: str | None = None, data_path: str | None = None) -> dict:
    """SFT of ``model.name`` on ``data.path`` (unset: the task's demonstrations); saves to
    ``<out_dir>/policy``, logging held-out ``eval/loss`` every ``sft.eval_every`` steps and at the end."""
    sc = cfg.sft
    policy_path, data_path = policy_path or cfg.model.name, data_path or cfg.data.path
    if not policy_path:
        raise ValueError("SFT needs a model to start from: set model.name=PATH (and data.path=FILE.jsonl, "
                         "or nothing to use the task's demonstrations)")
    run = Run(cfg, "sft", sc.steps, log_every=10)
    shard, device = run.shard, run.device
    tok = load_tokenizer(policy_path, cfg.model.trust_remote_code, need_pad=False)  # rows pad with EOS if none
    model, _ = policy_with_reference(policy_path, cfg.model, device, reference=False)
    train, held = load_demonstrations(cfg, tok, data_path)
    context = context_window(model)  # every row fits the model's context: checked (or cut) before the first step
    enc = encode_demonstrations(cfg, tok, train, cfg.data.packing, context)
    eval_enc = encode_demonstrations(cfg, tok, held, False, context) if held else None  # as the examples come
    n = enc["input_ids"].shape[0]
    rates = run.learning_rates(model, "sft.lr", "sft.warmup_steps")  # by model.regime where unset
    train_model, opt, params, engine = run.optimize(model, rates["sft.lr"], sc.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(rates["sft.warmup_steps"], sc.steps))
    gen = torch.Generator().manual_seed(cfg.run.seed)
    run.restore({"model": model}, {"optimizer": opt}, {"scheduler": sched}, generator=gen)
    eval_loss, chunk = None, sc.micro_batch_size or max(1, sc.batch_size // shard.world)
    for step in run.steps():
        idx = shard.take(torch.randint(0, n, (min(sc.batch_size, n),), generator=gen), "sft.batch_size")
        batch = {k: v[idx].to(device) for k, v in enc.items()}
        # a mean over target tokens: weighted so the processes' average is the global token mean
        weight = shard.token_weight(batch["loss_mask"][:, 1:] != 0)
        with compute_weights(train_model):  # model.master_weights: bf16 copies of this step's weights
            loss, _ = engine.accumulate(len(idx), sc.micro_batch_size,
                                        functools.partial(micro_batch_loss, train_model, batch, weight))
        grad_norm = engine.update(opt, params, loss)
        lr = sched.get_last_lr()[0]  # this step's rate, before the scheduler moves on
        sched.step()
        evaluate = eval_enc is not None and run.eval_due(step, sc.eval_every)
        if run.log_due(step, evaluate):
            row = {**shard.mean({"sft/loss": loss.item()}), "sft/grad_norm": grad_norm, "sft/lr": lr}
            if evaluate:
                with full_weights(train_model):
                    row["eval/loss"] = eval_loss = heldout_loss(model, eval_enc, shard, device, chunk)
            run.log(step, row, force=evaluate, loss=f"{row['sft/loss']:.4f}")
        run.checkpoint(step)
    run.close()
    save_dir = run.save_model(model, tok, "policy", adapter="policy_adapter")  # LoRA: merged in policy/
    final_loss = shard.mean({"loss": loss.item()})["loss"]
    return {"path": str(save_dir), "seconds": run.seconds, "examples": n, "final_loss": final_loss,
            "eval_loss": eval_loss}


def micro_batch_loss(model, batch: dict, weight: float, rows: slice) -> tuple[torch.Tensor, dict]:
    """The token-mean loss of rows ``rows`` of ``batch``, scaled by their share of its target tokens
    and the process's token ``weight``."""
    targets = batch["loss_mask"][:, 1:] != 0
    share = targets[rows].sum() / targets.sum()  # 1 when the micro-batch is the batch
    loss = masked_lm_loss(model, batch["input_ids"][rows], batch["attention_mask"][rows], batch["loss_mask"][rows],
                          batch["position_ids"][rows] if "position_ids" in batch else None)
    return loss * share * weight, {}


@torch.no_grad()
def heldout_loss(model, enc: dict, shard: Shard, device, chunk: int) -> float:
    """Mean NLL per target token over every held-out row, chunks dealt round-robin to the processes."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [NLL sum, target tokens]
    with eval_mode(model):
        for rows in shard.chunks(enc["input_ids"].shape[0], chunk):
            ids, attn, lmask = (enc[f][rows].to(device) for f in LOSS_FIELDS)
            nll = -sequence_logprobs(model, ids, attn, lmask).double().sum()
            totals += torch.stack([nll, lmask[:, 1:].sum().double()])
    totals = shard.sum(totals)
    return float(totals[0] / totals[1])


def load_demonstrations(cfg: Config, tok, data_path: str | None) -> tuple[list[SFTExample], list[SFTExample]]:
    """``(train, held_out)`` demonstrations: ``data_path``'s or 2048 of the task's; held out:
    ``data.eval_path``'s, else ``data.eval_fraction`` of ``data_path``'s."""
    dc = cfg.data
    if data_path:
        examples = load_sft(data_path, tok, split=dc.split or None, turns=cfg.sft.assistant_turns)
    else:
        pairs = get_task(cfg.run.task).TaskData(cfg.run.seed + 4).sft_examples(2048)
        examples = [SFTExample(p, c, origin=f"{cfg.run.task}[{i}]") for i, (p, c) in enumerate(pairs)]
    if dc.eval_path:
        return examples, load_sft(dc.eval_path, tok, split=dc.split or None, turns=cfg.sft.assistant_turns)
    if data_path:
        return hold_out(examples, dc.eval_fraction, cfg.run.seed + 7, "demonstrations")
    return examples, []


def encode_demonstrations(cfg: Config, tok, examples: list[SFTExample], packing: bool,
                          context: int | None = None) -> dict[str, torch.Tensor]:
    """The demonstrations as ``encode_sft`` rows fitted to ``data.max_length`` and ``context``."""
    dc = cfg.data
    limit = context_limit("data.max_length", dc.max_length, context)
    enc = encode_sft(examples, tok, limit, dc.truncation)
    if not dc.completion_only:  # every real token after the first is a target
        enc["loss_mask"] = enc["attention_mask"].clone()
    if packing:
        enc = pack_sft(enc, limit.tokens if isinstance(limit, Limit) else limit, tok.pad_token_id or 0)
    return enc
