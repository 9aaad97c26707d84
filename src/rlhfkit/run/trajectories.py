"""Per-token trajectories for the report's trajectory view: for a few rows of the batch at chosen
steps, a column per token and a row per quantity (log-prob, reference log-prob, KL, the score on
the last token, shaped reward, value, advantages, return, mask), as the PPO explainers draw one
sample. ``trajectories.jsonl``, one object per saved row, is described in docs/getting-started.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core import kl_estimate, last_token_index
from ..utils import cut_file

# row name -> what it shows (the report prints these as the table's row labels and legend)
ROWS = {
    "mask": "action mask: 1 on response tokens (they enter the losses), 0 on prompt and padding",
    "logprob": "log pi_old(a_t | s_t): the actor's log-prob of the sampled token",
    "ref_logprob": "log pi_ref(a_t | s_t): the frozen reference model's log-prob",
    "kl": "per-token KL estimate from the two log-probs (the estimator the run uses)",
    "score": "reward-model score (clipped), on the last response token only",
    "reward": "shaped reward: -kl_coef * KL on every response token, plus the score on the last",
    "value": "V_old(s_t): the critic's prediction of the return",
    "advantage_raw": "GAE advantage before whitening",
    "advantage": "advantage the policy loss uses (after whitening; the sequence advantage without a critic)",
    "return": "GAE return = raw advantage + value: the critic's target",
}


def _round(x: float) -> float:
    return round(float(x), 5)


def _segments(attn: list[int], rmask: list[int], P: int) -> list[str]:
    """Each column's part: padding, prompt, response, or a multi-turn episode's observation (read
    by the model, out of the losses)."""
    return ["prompt" if a else "padding" for a in attn[:P]] + [
        "response" if m else "observation" if a else "padding" for a, m in zip(attn[P:], rmask)]


def trajectory_records(exp, tokenizer, pc, kl_coef: float, step: int, n: int) -> list[dict]:
    """``n`` rows of an experience batch as per-token records, spread over the batch's score ranks
    (lowest and highest first), so a saved step shows a good and a bad sample side by side."""
    B, P, n = exp.input_ids.shape[0], exp.prompt_len, min(n, exp.input_ids.shape[0])
    if n <= 0:
        return []
    score = exp.score.float().cpu()
    order = torch.argsort(score, stable=True).tolist()  # ascending score
    picks = list(dict.fromkeys(order[r] for r in ([0] if n == 1 else [round(i * (B - 1) / (n - 1)) for i in range(n)])))
    if pc.score_clip is not None:
        score = score.clamp(-pc.score_clip, pc.score_clip)
    last = last_token_index(exp.response_mask.cpu())  # [B]
    per_token = {"logprob": exp.old_logprobs, "ref_logprob": exp.ref_logprobs,
                 "kl": kl_estimate(exp.old_logprobs, exp.ref_logprobs, pc.kl_estimator),
                 "reward": exp.rewards, "advantage": exp.advantages}  # [B, R] each
    if pc.algo == "ppo":  # the critic's rows
        per_token.update({"value": exp.old_values, "return": exp.returns, "advantage_raw": exp.raw_advantages})
    per_token = {k: v.detach().float().cpu() for k, v in per_token.items() if v is not None}
    ids, attn = exp.input_ids.cpu().tolist(), exp.attention_mask.cpu().tolist()
    records = []
    for b in picks:
        segment = _segments(attn[b], exp.response_mask[b].cpu().tolist(), P)
        T = len(segment)
        rows: dict[str, list] = {"mask": [int(s == "response") for s in segment]}
        for name in ROWS:
            if name == "score":
                rows[name] = [0.0] * T
                rows[name][P + int(last[b])] = _round(score[b])
            elif name in per_token:
                outside = 0.0 if name == "reward" else None
                rows[name] = [_round(per_token[name][b, t - P]) if s == "response" else outside
                              for t, s in enumerate(segment)]
        records.append({
            "step": step, "index": b, "algo": pc.algo,
            "prompt": tokenizer.decode([i for i, a in zip(ids[b][:P], attn[b][:P]) if a], skip_special_tokens=True),
            "response": tokenizer.decode([i for i, a in zip(ids[b][P:], attn[b][P:]) if a],  # observations kept
                                         skip_special_tokens=True),
            "score": _round(score[b]), "kl_coef": _round(kl_coef), "kl_estimator": pc.kl_estimator,
            "kl_in_loss": bool(pc.kl_in_loss), "tokens": [tokenizer.decode([i]) for i in ids[b]],
            "segment": segment, "rows": rows,
        })
    return records


class TrajectoryWriter:
    """Appends :func:`trajectory_records` to ``trajectories.jsonl`` at step 0, every ``every``
    steps and at the run's last step (``every == 0``: never; the file is then not created)."""

    def __init__(self, path: str | Path, every: int, per_step: int, resume_offset: int | None = None):
        self.path, self.every, self.per_step = Path(path), every, per_step
        self._fh = None
        if every > 0 and per_step > 0:
            if resume_offset is not None:  # continuing from a checkpoint: keep what was written up to it
                cut_file(self.path, resume_offset)
            self._fh = self.path.open("w" if resume_offset is None else "a", encoding="utf-8")

    def position(self) -> int:
        """Bytes written so far (for a checkpoint)."""
        if self._fh is None:
            return 0
        self._fh.flush()
        return self.path.stat().st_size

    def maybe_write(self, step: int, last: bool, exp, tokenizer, pc, kl_coef: float) -> None:
        if self._fh is None or not (step == 0 or last or (step + 1) % self.every == 0):
            return
        for rec in trajectory_records(exp, tokenizer, pc, kl_coef, step, self.per_step):
            self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
