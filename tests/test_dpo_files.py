"""SFT and the reward model on the user's files: SFT logs a held-out ``eval/loss`` (``data.eval_path``
or ``data.eval_fraction``), the reward model evaluates ``data.eval_path``'s pairs. Held-out numbers
are checked against a hand computation: each sequence scored alone, unpadded, by the saved model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhfkit.tasks import doubling
from rlhfkit.trainers.reward import train_reward_model
from rlhfkit.trainers.sft import train_sft
from rlhfkit.utils import read_jsonl

TOK = doubling.make_tokenizer()


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def task_pairs(n: int, seed: int) -> list[dict]:
    """The doubling task's pairs as records, less those whose rejected answer is the chosen one
    without its EOS: tokenised, every response is closed by EOS, so the two would be equal."""
    triples = doubling.DoublingData(seed).preference_pairs(2 * n)
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in triples if c != r + "E"][:n]


def token_ids(tok, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Prompt ids (BOS as the tokenizer adds it) and response ids closed by EOS."""
    resp = tok(response, add_special_tokens=False)["input_ids"]
    return tok(prompt)["input_ids"], resp + ([] if resp[-1:] == [tok.eos_token_id] else [tok.eos_token_id])


@torch.no_grad()
def response_logprob(model, tok, prompt: str, response: str) -> tuple[float, int]:
    """Summed log-prob of the response tokens (EOS included) and their count: one sequence, no padding."""
    head, resp = token_ids(tok, prompt, response)
    ids = torch.tensor([head + resp])
    logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp[len(head) - 1 :].sum().item(), len(resp)


# --------------------------------------------------------------------------- SFT and the reward model


def test_sft_eval_loss_is_the_held_out_mean_token_nll(tiny_models, tiny_config, tmp_path):
    demos = [{"prompt": f"数字:{n}x2=", "completion": str(2 * n)} for n in (5, 123, 4567, 89, 31)]
    held = [{"prompt": "数字:77x2=", "completion": "154"}, {"prompt": "数字:9999x2=", "completion": "19998"},
            {"prompt": "小写:3x2=", "completion": "六"}]
    cfg = tiny_config(tmp_path / "out", model={"name": tiny_models.policy},
                      data={"path": write_jsonl(tmp_path / "sft.jsonl", demos),
                            "eval_path": write_jsonl(tmp_path / "held.jsonl", held)},
                      sft={"steps": 5, "batch_size": 4, "eval_every": 2, "micro_batch_size": 1})
    res = train_sft(cfg)
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/loss" in r] == [1, 3, 4]
    policy = AutoModelForCausalLM.from_pretrained(res["path"])
    nll, n = 0.0, 0
    for d in held:  # the mean over every held-out target token, not a mean of per-example means
        lp, k = response_logprob(policy, TOK, d["prompt"], d["completion"])
        nll, n = nll - lp, n + k
    assert rows[-1]["eval/loss"] == pytest.approx(nll / n, rel=1e-5)
    assert res["eval_loss"] == rows[-1]["eval/loss"]


def test_reward_model_evaluates_the_eval_path_pairs(tiny_models, tiny_config, tmp_path):
    held = task_pairs(5, seed=9)
    cfg = tiny_config(tmp_path / "out", model={"name": tiny_models.policy},
                      data={"path": write_jsonl(tmp_path / "train.jsonl", task_pairs(12, seed=8)),
                            "eval_path": write_jsonl(tmp_path / "held.jsonl", held)},
                      reward={"steps": 3, "batch_size": 4, "lr": 1e-2})
    res = train_reward_model(cfg)
    rm = AutoModelForSequenceClassification.from_pretrained(res["path"])
    deltas = []
    with torch.no_grad():
        for p in held:
            scores = [rm(torch.tensor([sum(token_ids(TOK, p["prompt"], p[k]), [])])).logits.item()
                      for k in ("chosen", "rejected")]
            deltas.append(scores[0] - scores[1])
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
    assert row["eval/rm/accuracy"] == pytest.approx(sum(d > 0 for d in deltas) / 5)
    assert row["eval/rm/delta"] == pytest.approx(sum(deltas) / 5, rel=1e-4, abs=1e-6)
    assert res["accuracy"] == row["eval/rm/accuracy"]
