"""DPO, SFT and the reward model on the user's files (TRL's conventions): DPO reads preference
pairs in every format the reward model reads, logs TRL's metric names, evaluates held-out pairs
(``data.eval_path`` / ``data.eval_fraction``) and offers IPO; SFT logs a held-out ``eval/loss``;
the reward model evaluates ``data.eval_path``'s pairs. Held-out numbers are checked against a
hand computation: each sequence scored alone, unpadded, by the saved model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_helpers import chat_tokenizer, save_tiny
from rlhfkit.tasks import doubling
from rlhfkit.trainers.dpo import train_dpo
from rlhfkit.trainers.reward import train_reward_model
from rlhfkit.trainers.sft import train_sft
from rlhfkit.utils import read_jsonl
from test_data import bot, user

TOK = doubling.make_tokenizer()
TRL_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
EVAL_KEYS = ("eval/loss", *(f"eval/{k}" for k in TRL_KEYS))


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


def hand_dpo_eval(policy, ref, tok, pairs: list[dict], beta: float, nll_coef: float, loss: str) -> dict:
    chosen, rejected, h, nll, n_tok = [], [], [], 0.0, 0
    for p in pairs:
        (pc, nc), (pr, nr) = (response_logprob(policy, tok, p["prompt"], p[k]) for k in ("chosen", "rejected"))
        rc, rr = response_logprob(ref, tok, p["prompt"], p["chosen"])[0], response_logprob(ref, tok, p["prompt"],
                                                                                             p["rejected"])[0]
        nll, n_tok = nll - pc, n_tok + nc
        if loss == "ipo":  # TRL's IPO: every log-prob a mean over its response's tokens
            pc, rc, pr, rr = pc / nc, rc / nc, pr / nr, rr / nr
        chosen.append(beta * (pc - rc))
        rejected.append(beta * (pr - rr))
        h.append((pc - rc) - (pr - rr))
    n = len(pairs)
    if loss in ("ipo", "ipo_sum"):
        pref = sum((x - 1 / (2 * beta)) ** 2 for x in h) / n
    else:
        pref = sum(-math.log(1 / (1 + math.exp(-beta * x))) for x in h) / n
    return {"eval/loss": pref + nll_coef * nll / n_tok,
            "eval/rewards/chosen": sum(chosen) / n, "eval/rewards/rejected": sum(rejected) / n,
            "eval/rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected)) / n,
            "eval/rewards/margins": sum(c - r for c, r in zip(chosen, rejected)) / n}


# --------------------------------------------------------------------------- DPO


@torch.no_grad()
def response_logits(model, tok, prompt: str, response: str) -> tuple[float, int]:
    """Sum over the response positions of the logits' mean over the vocabulary, and their count."""
    head, resp = token_ids(tok, prompt, response)
    logits = model(torch.tensor([head + resp])).logits[0, :-1].double()  # [T-1, V]
    return logits[len(head) - 1 :].mean(-1).sum().item(), len(resp)


def test_dpo_logs_trl_logps_and_logits_of_the_whole_batch(tiny_models, tiny_config, tmp_path):
    """logps/* (summed per response, averaged over pairs) and logits/* (averaged over every
    response token and the vocabulary) as TRL logs them, by hand: the first step's batch is every
    pair and the policy is still the starting model; micro-batches of 3 of the 8 pairs must not
    change the token means."""
    pairs = task_pairs(8, seed=3)
    cfg = tiny_config(tmp_path / "out", model={"name": tiny_models.policy},
                      data={"path": write_jsonl(tmp_path / "train.jsonl", pairs), "eval_fraction": 0.0},
                      dpo={"steps": 1, "batch_size": 8, "micro_batch_size": 3})
    train_dpo(cfg)
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]
    start = AutoModelForCausalLM.from_pretrained(tiny_models.policy)
    for kind in ("chosen", "rejected"):
        logps = [response_logprob(start, TOK, p["prompt"], p[kind])[0] for p in pairs]
        sums, counts = zip(*(response_logits(start, TOK, p["prompt"], p[kind]) for p in pairs))
        assert row[f"logps/{kind}"] == pytest.approx(sum(logps) / len(pairs), rel=1e-5)
        assert row[f"logits/{kind}"] == pytest.approx(sum(sums) / sum(counts), rel=1e-5, abs=1e-6)
    assert len({len(token_ids(TOK, p["prompt"], p["chosen"])[1]) for p in pairs}) > 1  # the lengths differ


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "ipo_sum"])
def test_dpo_from_a_pairs_file_logs_trl_metrics_and_held_out_pairs(loss, tiny_models, tiny_config, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", task_pairs(24, seed=1))
    held = task_pairs(3, seed=2)
    cfg = tiny_config(tmp_path / "out", model={"name": tiny_models.policy},
                      data={"path": train, "eval_path": write_jsonl(tmp_path / "held.jsonl", held)},
                      dpo={"steps": 4, "batch_size": 4, "eval_every": 2, "lr": 1e-2, "loss": loss})
    res = train_dpo(cfg)
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(rows) == 4
    for row in rows:  # every step: TRL's names for our numbers
        assert all(math.isfinite(row[k]) for k in TRL_KEYS)
        assert row["rewards/accuracies"] == row["dpo/accuracy"] and row["rewards/margins"] == row["dpo/margin"]
        assert row["rewards/chosen"] == row["dpo/chosen"] and row["rewards/rejected"] == row["dpo/rejected"]
        assert "eval/format_acc" not in row  # no greedy task evaluation for a file's pairs
    assert [r["step"] for r in rows if "eval/loss" in r] == [1, 3]  # every 2 steps, the last included
    beta = cfg.dpo.beta
    if loss != "sigmoid":  # first step: policy == reference, so h = 0 and the loss is (1 / (2 beta))^2
        assert rows[0]["dpo/loss"] == pytest.approx(1 / (4 * beta**2), rel=1e-5)
    else:
        assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), rel=1e-5)
    # the held-out metrics at the end are those of the saved policy against the starting one, by hand
    policy = AutoModelForCausalLM.from_pretrained(res["path"])
    ref = AutoModelForCausalLM.from_pretrained(tiny_models.policy)
    want = hand_dpo_eval(policy, ref, TOK, held, beta, cfg.dpo.nll_coef, loss)
    assert want["eval/rewards/chosen"] != 0.0  # the policy moved: the check is not of zeros
    for k in EVAL_KEYS:
        assert rows[-1][k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), k
    assert res["final"] == {k: rows[-1][k] for k in EVAL_KEYS}


def test_dpo_eval_fraction_holds_out_a_seeded_share_and_zero_none(tiny_models, tiny_config, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", task_pairs(20, seed=3))
    for fraction, evaluated in ((0.2, True), (0.0, False)):
        out = tmp_path / f"out{fraction}"
        cfg = tiny_config(out, model={"name": tiny_models.policy}, data={"path": train, "eval_fraction": fraction},
                          dpo={"steps": 2, "batch_size": 4, "eval_every": 0})
        train_dpo(cfg)
        rows = read_jsonl(out / "metrics.jsonl")
        assert ("eval/loss" in rows[-1]) == evaluated and all("eval/loss" not in r for r in rows[:-1])


def test_conversational_pairs_with_a_chat_template(tiny_config, tmp_path):
    tok = chat_tokenizer()
    model = save_tiny(tmp_path / "qwen3", "qwen3", tok, seed=4)
    records = []
    for n in range(1, 9):
        q = [user(f"double {n}")]
        if n % 2:  # explicit prompt, answers as assistant messages
            records.append({"prompt": q, "chosen": [bot(str(2 * n))], "rejected": [bot(str(2 * n + 1))]})
        else:  # implicit prompt: two whole conversations sharing their first turn
            records.append({"chosen": [*q, bot(str(2 * n))], "rejected": [*q, bot(f"{n}?")]})
    held = [{"prompt": [user("double 21")], "chosen": [bot("42")], "rejected": [bot("21")]},
            {"chosen": [user("double 5"), bot("10")], "rejected": [user("double 5"), bot("55")]}]
    cfg = tiny_config(tmp_path / "out", model={"name": model},
                      data={"path": write_jsonl(tmp_path / "chat.jsonl", records),
                            "eval_path": write_jsonl(tmp_path / "held.jsonl", held)},
                      dpo={"steps": 3, "batch_size": 4, "lr": 1e-2})
    res = train_dpo(cfg)
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
    # the held-out pairs rendered by the template: prompt "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n"
    rendered = [{"prompt": tok.apply_chat_template([user("double 21")], tokenize=False, add_generation_prompt=True),
                 "chosen": "42<|im_end|>\n", "rejected": "21<|im_end|>\n"},
                {"prompt": tok.apply_chat_template([user("double 5")], tokenize=False, add_generation_prompt=True),
                 "chosen": "10<|im_end|>\n", "rejected": "55<|im_end|>\n"}]
    policy, ref = AutoModelForCausalLM.from_pretrained(res["path"]), AutoModelForCausalLM.from_pretrained(model)
    want = hand_dpo_eval(policy, ref, tok, rendered, cfg.dpo.beta, cfg.dpo.nll_coef, "sigmoid")
    for k in EVAL_KEYS:
        assert row[k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), k


def test_dpo_file_settings_that_cannot_work_are_refused(tiny_models, tiny_config, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", task_pairs(6, seed=1))
    cfg = tiny_config(tmp_path / "a", model={"name": tiny_models.policy}, data={"path": train},
                      dpo={"stop_at_format": 0.9})
    with pytest.raises(ValueError, match="stop_at_format"):
        train_dpo(cfg)
    cfg = tiny_config(tmp_path / "b", model={"name": tiny_models.policy}, data={"path": train}, dpo={"batch_size": 8})
    with pytest.raises(ValueError, match="dpo.batch_size=8 is more than the 6 training pairs"):
        train_dpo(cfg)


def test_the_task_route_is_unchanged_by_the_new_keys(tiny_models, tiny_config, tmp_path):
    cfg = tiny_config(tmp_path, model={"name": tiny_models.policy}, dpo={"steps": 2, "eval_every": 1})
    res = train_dpo(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("eval/format_acc" in r and "eval/exact_acc" in r and "eval/loss" not in r for r in rows)
    assert set(res["final"]) == {"eval/format_acc", "eval/exact_acc"}
    assert all(k in rows[0] for k in TRL_KEYS)


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
