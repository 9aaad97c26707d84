"""Per-token trajectories for the report's trajectory view.

PPO explainers walk through one sample ("Where is Pune? Pune is in India."): a column per token,
a row per quantity -- log-prob, reference log-prob, KL, the reward that lands on the last
token only, the critic's value, the GAE advantage, the return, and the mask that keeps
prompt and padding out of the loss. This module saves exactly that table for a few rows of
the batch at chosen steps, so ``rlhfkit report`` can draw it for a real run.

``trajectories.jsonl`` holds one JSON object per saved row::

    {"step": 12, "index": 5, "algo": "ppo", "prompt": "...", "response": "...",
     "score": 2.31, "kl_coef": 0.2, "kl_estimator": "k1", "kl_in_loss": false,
     "tokens": ["P", "P", "数", ...],            # one decoded string per column (T = P + R)
     "segment": ["padding", "padding", "prompt", ..., "response", ..., "padding"],
     "rows": {"mask": [0, 0, 0, ..., 1, 1, 0], "logprob": [null, ..., -0.12, ...], ...}}

Columns follow the model's input: left padding, prompt, response, then the padding after
the EOS; in a multi-turn episode (rlhfkit.envs) the response holds the model's turns and, marked
``observation``, the environment's messages between them. Rows (``ROWS``) are ``null`` where a
quantity is undefined (prompt and padding columns of the response-aligned tensors); ``mask``,
``score`` and ``reward`` are 0 there.
Critic-free algorithms (GRPO, RLOO, REINFORCE) have no value, raw advantage or return rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .core import kl_estimate, last_token_index
from .utils import cut_file

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


def trajectory_records(exp, tokenizer, pc, kl_coef: float, step: int, n: int) -> list[dict]:
    """``n`` rows of an experience batch as per-token records (see the module docstring).

    The rows are spread over the batch's score ranks (lowest and highest first), so a
    saved step shows a good and a bad sample side by side.
    """
    B = exp.input_ids.shape[0]
    n = min(n, B)
    if n <= 0:
        return []
    order = torch.argsort(exp.score.float().cpu(), stable=True).tolist()  # ascending score
    ranks = [0] if n == 1 else [round(i * (B - 1) / (n - 1)) for i in range(n)]
    picks = list(dict.fromkeys(order[r] for r in ranks))
    P = exp.prompt_len
    rmask = exp.response_mask.cpu()
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, pc.kl_estimator).cpu()  # [B, R]
    score = exp.score.float().cpu()
    if pc.score_clip is not None:
        score = score.clamp(-pc.score_clip, pc.score_clip)
    last = last_token_index(rmask)  # [B]
    has_critic = pc.algo == "ppo"
    response_rows = {"logprob": exp.old_logprobs, "ref_logprob": exp.ref_logprobs, "kl": kl,
                     "reward": exp.rewards, "advantage": exp.advantages}
    if has_critic:
        response_rows.update({"value": exp.old_values, "return": exp.returns})
        if exp.raw_advantages is not None:
            response_rows["advantage_raw"] = exp.raw_advantages
    response_rows = {k: v.detach().float().cpu() for k, v in response_rows.items()}
    ids = exp.input_ids.cpu()
    attn = exp.attention_mask.cpu()
    records = []
    for b in picks:
        T = ids.shape[1]
        segment = []
        for t in range(T):
            if t < P:
                segment.append("prompt" if attn[b, t] else "padding")
            else:
                # a multi-turn episode's observations: read by the model, out of the losses
                segment.append("response" if rmask[b, t - P] else "observation" if attn[b, t] else "padding")
        rows: dict[str, list] = {"mask": [1 if s == "response" else 0 for s in segment]}
        for name in ROWS:
            if name == "mask":
                continue
            if name == "score":
                col = [0.0] * T
                col[P + int(last[b])] = _round(score[b])
                rows[name] = col
                continue
            if name not in response_rows:
                continue
            vals = response_rows[name][b]
            zero_outside = name == "reward"
            rows[name] = [
                _round(vals[t - P]) if segment[t] == "response" else (0.0 if zero_outside else None)
                for t in range(T)
            ]
        resp_ids = [int(i) for i, m in zip(ids[b, P:].tolist(), attn[b, P:].tolist()) if m]  # observations kept
        prompt_ids = [int(i) for i, m in zip(ids[b, :P].tolist(), attn[b, :P].tolist()) if m]
        records.append({
            "step": step,
            "index": b,
            "algo": pc.algo,
            "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=True),
            "response": tokenizer.decode(resp_ids, skip_special_tokens=True),
            "score": _round(score[b]),
            "kl_coef": _round(kl_coef),
            "kl_estimator": pc.kl_estimator,
            "kl_in_loss": bool(pc.kl_in_loss),
            "tokens": [tokenizer.decode([int(i)]) for i in ids[b].tolist()],
            "segment": segment,
            "rows": rows,
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

    def wanted(self, step: int, last: bool) -> bool:
        return self._fh is not None and (step == 0 or last or (step + 1) % self.every == 0)

    def maybe_write(self, step: int, last: bool, exp, tokenizer, pc, kl_coef: float) -> None:
        if not self.wanted(step, last):
            return
        for rec in trajectory_records(exp, tokenizer, pc, kl_coef, step, self.per_step):
            self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
