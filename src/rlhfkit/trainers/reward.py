"""Reward model: a transformer with a scalar head, trained on chosen/rejected pairs.

Loss: Bradley-Terry, ``-logsigmoid(r_chosen - r_rejected - margin)``. Logged every few
steps: ``rm/loss``, ``rm/accuracy`` and ``rm/delta`` (mean chosen - rejected, which grows
as the model separates the pair), and the same on held-out pairs at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config
from ..core import bradley_terry_loss
from ..models import build_tiny_scalar_model, load_policy, sequence_scores
from ..tasks import doubling
from ..utils import MetricsLogger, make_accelerator, mean_stats, progress, setup_run


def encode_pairs(tokenizer, pairs: list[tuple[str, str, str]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows first, then rejected rows: ``[2B, T]`` ids and mask (one forward per batch)."""
    texts = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def pair_scores(model, tokenizer, pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = encode_pairs(tokenizer, pairs, device)
    scores = sequence_scores(model, ids, mask)  # [2B]
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def evaluate_pairs(model, tokenizer, pairs, device, batch_size: int = 256) -> dict[str, float]:
    was_training = model.training
    model.eval()
    rows = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        _, stats = bradley_terry_loss(*pair_scores(model, tokenizer, chunk, device))
        rows.append(stats)
    model.train(was_training)
    return mean_stats(rows)


def held_out_pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
    """Preference pairs on the evaluation operands (never seen in training)."""
    import random

    rng = random.Random(seed)
    out = []
    for p in doubling.eval_prompts()[:n]:
        other = rng.choice([s for s in doubling.SET_NAMES if s != p.charset])
        out.append((p.text, doubling.answer_text(p.number, p.charset), doubling.answer_text(p.number, other)))
    return out


def train_reward_model(cfg: Config, policy_path: str | None = None) -> dict:
    """Train the reward model; saves it to ``<out_dir>/reward_model``. Returns a summary.

    Args:
        policy_path: pretrained policy whose backbone initialises the reward model when
            ``reward.init_from == 'policy'`` (defaults to ``model.name``).
    """
    out = setup_run(cfg)
    accelerator = make_accelerator(cfg)
    device = accelerator.device
    rc = cfg.reward
    tok = doubling.make_tokenizer()
    model = build_tiny_scalar_model(tok, cfg.run.seed + 1, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
                                    n_embd=cfg.model.n_embd)
    if rc.init_from == "policy":
        path = policy_path or cfg.model.name
        if not path:
            raise ValueError("reward.init_from=policy needs a pretrained policy: set model.name=PATH "
                             "(or reward.init_from=scratch)")
        base = load_policy(path)
        # the backbone only: the LM head has no counterpart in a scalar model
        missing, unexpected = model.base_model.load_state_dict(base.base_model.state_dict(), strict=False)
        if unexpected:
            raise ValueError(f"policy at {path} does not match the reward backbone: unexpected {unexpected[:3]}")
    model.to(device).train()
    if rc.freeze_backbone:
        model.base_model.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=rc.lr, weight_decay=0.0)
    data = doubling.DoublingData(cfg.run.seed + 1)
    log = MetricsLogger(out / "metrics.jsonl")
    t0 = time.perf_counter()
    bar = progress(range(rc.steps), desc="reward model", enabled=cfg.run.progress)
    for step in bar:
        chosen, rejected = pair_scores(model, tok, data.preference_pairs(rc.batch_size, rc.hard_negatives), device)
        loss, stats = bradley_terry_loss(chosen, rejected, rc.margin or None, rc.center_coef)
        accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == rc.steps - 1:
            log.log(step, stats)
            bar.set_postfix(acc=f"{stats['rm/accuracy'].item():.2f}", delta=f"{stats['rm/delta'].item():.2f}")
    seconds = time.perf_counter() - t0
    ev = evaluate_pairs(model, tok, held_out_pairs(rc.eval_pairs, cfg.run.seed), device)
    log.log(rc.steps, {f"eval/{k}": v for k, v in ev.items()})
    log.close()
    save_dir = Path(out) / "reward_model"
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    return {"path": str(save_dir), "seconds": seconds, "accuracy": ev["rm/accuracy"], "delta": ev["rm/delta"]}
