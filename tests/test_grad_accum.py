"""Gradient accumulation (``ppo/sft/dpo/reward.micro_batch_size``): an update whose minibatch goes
through the forward and backward passes in micro-batches is the update of the whole minibatch.

Each case runs one update twice, whole (``micro_batch_size=0``) and in micro-batches of 3 rows
of a minibatch whose size is not a multiple of 3, on tiny float32 models. The optimizer is
replaced by plain SGD that records the gradients it steps on, so the gradients themselves are
compared (Adam's first step is about ``lr * sign(g)`` and would hide a wrongly weighted one),
then the weights after the step (lr 1: a gradient error shows in full), then every logged
statistic. Token-mean losses (PPO, SFT, DPO's NLL term) meet rows of different lengths, and the
PPO and SFT cases check that weighting micro-batches by rows instead of tokens would fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import Config
from rlhfkit.core import AGGREGATIONS, logprobs_from_logits
from rlhfkit.models.forward import ValueHead, build_tiny_policy, build_tiny_scalar_model, disable_dropout
from rlhfkit.rollout.experience import ActorCritic, Experience
from rlhfkit.tasks import doubling
from rlhfkit.trainers import rl
from rlhfkit.trainers.rl import minibatch_loss, ppo_update
from rlhfkit.utils import read_jsonl

TOK = doubling.make_tokenizer()
ARCH = {"n_layer": 1, "n_head": 2, "n_embd": 16}
TOL = 1e-6


class RecordingSGD(torch.optim.Optimizer):
    """``p -= lr * p.grad``, keeping a copy of every gradient it stepped on."""

    def __init__(self, params, lr: float = 1.0, **_):  # weight_decay / fused of the AdamW it stands in for
        super().__init__(params, {"lr": lr})
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads.append(p.grad.detach().clone())
                    p.add_(p.grad, alpha=-group["lr"])


def assert_same_grads(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for ga, gb in zip(a, b):
        torch.testing.assert_close(ga, gb, atol=TOL, rtol=TOL)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((ga - gb).abs().max().item() for ga, gb in zip(a, b))


# --------------------------------------------------------------------------- PPO, through ppo_update

LENGTHS = [1, 6, 2, 5, 3, 6, 1, 4, 6, 2]  # response lengths: micro-batches of 3 hold 9, 14, 11 and 2 tokens


def _experience(ac: ActorCritic) -> Experience:
    """A hand-made batch of 10 rows with the response lengths above; old log-probs near the
    policy's own (ratios near 1, some clipped), random advantages, returns, values."""
    gen = torch.Generator().manual_seed(0)
    B, P, R = len(LENGTHS), 3, max(LENGTHS)
    rmask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # [B, R]
    prompt = torch.randint(4, len(TOK), (B, P), generator=gen)
    response = torch.where(rmask.bool(), torch.randint(4, len(TOK), (B, R), generator=gen), TOK.pad_token_id)
    ids, attn = torch.cat([prompt, response], 1), torch.cat([torch.ones(B, P, dtype=torch.long), rmask], 1)
    with torch.no_grad():
        logits, _ = ac(ids, attn, P)
        logprobs = logprobs_from_logits(logits, response)
    noise = lambda scale: scale * torch.randn(B, R, generator=gen)  # noqa: E731
    zeros = torch.zeros(B, R)
    return Experience(input_ids=ids, attention_mask=attn, prompt_len=P, response_ids=response, response_mask=rmask,
                      old_logprobs=logprobs + noise(0.3), ref_logprobs=logprobs + noise(0.2), old_values=noise(0.5),
                      score=torch.zeros(B), rewards=zeros, advantages=noise(1.0), returns=noise(1.0))


def _actor_critic(value_model: str) -> ActorCritic:
    policy = disable_dropout(build_tiny_policy(TOK, seed=3, **ARCH)).train()
    if value_model == "shared":
        head = ValueHead(ARCH["n_embd"])
        torch.nn.init.normal_(head.summary.weight, std=0.5)  # values that are not all 0
        return ActorCritic(policy, value_head=head)
    return ActorCritic(policy, critic=disable_dropout(build_tiny_scalar_model(TOK, seed=7, **ARCH)).train())


def _ppo_update(ac: ActorCritic, exp: Experience, micro: int, **ppo):
    pc = dataclasses.replace(Config().ppo, minibatch_size=len(LENGTHS), ppo_epochs=1, micro_batch_size=micro,
                             kl_in_loss=True, kl_estimator="k2", entropy_coef=0.05, value_clip_range=0.2, **ppo)
    opt = RecordingSGD([{"params": ac.policy.parameters()}, {"params": ac.critic_parameters()}], lr=1.0)
    stats = ppo_update(ac, opt, exp, pc, kl_coef=0.1, generator=torch.Generator().manual_seed(1))
    assert len(stats) == 1  # one minibatch: one optimizer step
    return opt.grads, stats[0]


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_ppo_micro_batches_give_the_minibatch_update(value_model):
    ac = _actor_critic(value_model)
    exp = _experience(ac)
    whole, split = copy.deepcopy(ac), copy.deepcopy(ac)
    grads, stats = _ppo_update(whole, exp, micro=0)
    micro_grads, micro_stats = _ppo_update(split, exp, micro=3)  # 10 rows: micro-batches of 3, 3, 3, 1
    assert_same_grads(grads, micro_grads)
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)
    assert stats.keys() == micro_stats.keys()
    for k in stats:  # the minibatch's statistics, not the last micro-batch's
        torch.testing.assert_close(torch.as_tensor(stats[k]).double(), torch.as_tensor(micro_stats[k]).double(),
                                   atol=TOL, rtol=TOL, msg=k)

    # weighting each micro-batch by its rows instead of its tokens would be caught: its gradient is far off
    naive = copy.deepcopy(ac)
    pc = dataclasses.replace(Config().ppo, kl_in_loss=True, kl_estimator="k2", entropy_coef=0.05, value_clip_range=0.2)
    mb = torch.arange(len(LENGTHS))
    for rows in mb.split(3):
        loss, _, _ = minibatch_loss(naive, exp, rows, pc, 0.1, True)
        (loss * len(rows) / len(mb)).backward()
    params = [*naive.policy.parameters(), *naive.critic_parameters()]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in naive.policy.parameters()]))
    naive_grads = [p.grad * min(1.0, 1.0 / (norm.item() + 1e-6)) for p in params[: len(list(naive.policy.parameters()))]]
    assert max_diff(grads[: len(naive_grads)], naive_grads) > 100 * TOL


# token_mean is test_ppo_micro_batches_give_the_minibatch_update's; bnpo and dapo are its function
# under TRL's names (test_loss_types_change_the_update)
@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dr_grpo", "token"), ("grpo", "sequence"),
                                              ("token_mean", "sequence_token"), ("cispo", "token"),
                                              ("sapo", "token")])
def test_every_loss_type_micro_batches_give_the_minibatch_update(loss_type, level, monkeypatch):
    """ppo.loss_type / importance_sampling_level: micro-batches of 3 rows (3, 3, 3, 1 of rows of
    different lengths) give the whole minibatch's gradients and stats; each aggregation weighs a
    micro-batch by its own unit, and for the per-row ones (grpo, dr_grpo) weighing by tokens, the
    token mean's unit, is caught."""
    ac = _actor_critic("shared")
    exp = _experience(ac)
    ppo = {"loss_type": loss_type, "importance_sampling_level": level, "max_new_tokens": 8}
    whole, split = copy.deepcopy(ac), copy.deepcopy(ac)
    grads, stats = _ppo_update(whole, exp, micro=0, **ppo)
    micro_grads, micro_stats = _ppo_update(split, exp, micro=3, **ppo)
    assert_same_grads(grads, micro_grads)
    for k in stats:
        torch.testing.assert_close(torch.as_tensor(stats[k]).double(), torch.as_tensor(micro_stats[k]).double(),
                                   atol=TOL, rtol=TOL, msg=k)
    if AGGREGATIONS[loss_type].unit == "rows":
        monkeypatch.setattr(rl, "aggregation_count", lambda mask, kind: mask.sum())
        token_grads, _ = _ppo_update(copy.deepcopy(ac), exp, micro=3, **ppo)
        assert max_diff(grads, token_grads) > 100 * TOL


def test_loss_types_change_the_update():
    """The loss types are not one loss under seven names where they should differ: grpo and dr_grpo
    give other gradients than the token mean on rows of different lengths; bnpo and dapo the same;
    off-policy (old log-probs 0.3 away) cispo's capped weight and sapo's gate give other gradients
    than the clipped loss under their own aggregations (token mean, per-sequence mean)."""
    ac = _actor_critic("shared")
    exp = _experience(ac)
    grads = {k: _ppo_update(copy.deepcopy(ac), exp, micro=0, loss_type=k, max_new_tokens=8)[0] for k in AGGREGATIONS}
    for k in ("bnpo", "dapo"):
        assert AGGREGATIONS[k] == AGGREGATIONS["token_mean"]
        assert max_diff(grads[k], grads["token_mean"]) == 0.0
    for k in ("grpo", "dr_grpo"):
        assert max_diff(grads[k], grads["token_mean"]) > 100 * TOL
    assert max_diff(grads["cispo"], grads["token_mean"]) > 100 * TOL
    assert max_diff(grads["sapo"], grads["grpo"]) > 100 * TOL


# --------------------------------------------------------------------------- SFT, DPO, reward model: the trainers


def _run(monkeypatch, train, cfg):
    """One step of ``train(cfg)`` with RecordingSGD as its optimizer: (grads, metrics rows, saved weights)."""
    made: list[RecordingSGD] = []

    def optimizer(params, lr=1.0, **kw):
        made.append(RecordingSGD(params, lr=lr))
        return made[-1]

    monkeypatch.setattr(torch.optim, "AdamW", optimizer)
    result = train(cfg)
    weights = load_file(f"{result['path']}/model.safetensors")
    return made[0].grads, read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl"), weights


def _compare_runs(monkeypatch, train, make_cfg):
    grads, rows, weights = _run(monkeypatch, train, make_cfg("whole", 0))
    micro_grads, micro_rows, micro_weights = _run(monkeypatch, train, make_cfg("micro", 3))
    assert_same_grads(grads, micro_grads)
    assert weights.keys() == micro_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], micro_weights[k], atol=TOL, rtol=TOL, msg=k)
    assert len(rows) == len(micro_rows) >= 1
    for a, b in zip(rows, micro_rows):
        keys = [k for k in a if not k.startswith(("time/", "throughput/")) and k != "step"]
        assert keys == [k for k in b if not k.startswith(("time/", "throughput/")) and k != "step"]
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=TOL, rel=TOL), k
    return grads, rows


def test_sft_micro_batches_give_the_batch_update(tiny_models, tiny_config, tmp_path, monkeypatch):
    from rlhfkit.trainers.sft import train_sft

    data = tmp_path / "sft.jsonl"  # completions of 2 to 6 digits: the rows hold different token counts
    data.write_text("".join(f'{{"prompt": "数字:{n}x2=", "completion": "{2 * n}"}}\n'
                            for n in (3, 12, 345, 4321, 12345, 7, 88, 4444, 23456, 9, 610)), encoding="utf-8")

    def cfg(name, micro):
        return tiny_config(tmp_path / name, model={"name": tiny_models.policy}, data={"path": str(data)},
                           sft={"steps": 1, "batch_size": 8, "lr": 1.0, "micro_batch_size": micro})

    from rlhfkit.trainers import sft

    grads, rows = _compare_runs(monkeypatch, train_sft, cfg)
    assert rows[0]["sft/grad_norm"] > 0

    # weighting the micro-batches by rows instead of tokens would be caught
    calls = []
    original = sft.micro_batch_loss

    def by_rows(model, batch, weight, rows):
        loss, stats = original(model, batch, weight, rows)
        targets = batch["loss_mask"][:, 1:] != 0
        n = batch["input_ids"].shape[0]
        calls.append(rows)
        return loss / (targets[rows].sum() / targets.sum()) * (len(range(n)[rows]) / n), stats

    monkeypatch.setattr(sft, "micro_batch_loss", by_rows)
    naive_grads, _, _ = _run(monkeypatch, train_sft, cfg("naive", 3))
    assert len(calls) == 3 and max_diff(grads, naive_grads) > 100 * TOL


def test_dpo_micro_batches_give_the_batch_update(tiny_models, tiny_config, tmp_path, monkeypatch):
    from rlhfkit.trainers.dpo import train_dpo

    def cfg(name, micro):  # the NLL term (a token mean) is on: dpo.nll_coef defaults to 1
        return tiny_config(tmp_path / name, model={"name": tiny_models.policy},
                           dpo={"steps": 1, "batch_size": 8, "lr": 1.0, "micro_batch_size": micro})

    _, rows = _compare_runs(monkeypatch, train_dpo, cfg)
    assert rows[0]["dpo/chosen_nll"] > 0 and rows[0]["rewards/accuracies"] == rows[0]["dpo/accuracy"]


@pytest.mark.parametrize("kind", ["pairwise", "classifier"])
def test_reward_model_micro_batches_give_the_batch_update(kind, tiny_models, tiny_config, tmp_path, monkeypatch):
    from rlhfkit.trainers.reward import train_reward_model

    def cfg(name, micro):
        return tiny_config(tmp_path / name, model={"name": tiny_models.policy},
                           reward={"kind": kind, "steps": 1, "batch_size": 8, "lr": 1.0, "micro_batch_size": micro})

    _, rows = _compare_runs(monkeypatch, train_reward_model, cfg)
    assert "rm/accuracy" in rows[0]


@pytest.mark.parametrize("draw", ["epoch", "rollout"])
def test_minibatch_draw_per_epoch_or_per_rollout(draw, monkeypatch):
    """``ppo.minibatch_draw``: every epoch deals each row to exactly one minibatch; 'epoch' deals
    anew each epoch, 'rollout' keeps the first epoch's minibatches, in order (TRL's
    num_iterations)."""
    ac = _actor_critic("shared")
    exp = _experience(ac)
    seen, original = [], rl.micro_batch_loss

    def recording(model, exp, mb, *a, **kw):
        seen.append(mb.tolist())
        return original(model, exp, mb, *a, **kw)

    monkeypatch.setattr(rl, "micro_batch_loss", recording)
    pc = dataclasses.replace(Config().ppo, minibatch_size=5, ppo_epochs=3, micro_batch_size=0, minibatch_draw=draw)
    opt = RecordingSGD([{"params": ac.policy.parameters()}, {"params": ac.critic_parameters()}], lr=1e-3)
    ppo_update(ac, opt, exp, pc, kl_coef=0.1, generator=torch.Generator().manual_seed(1))
    epochs = [seen[i:i + 2] for i in range(0, 6, 2)]  # 10 rows: two minibatches of 5 per epoch
    assert len(seen) == 6
    for mbs in epochs:
        assert sorted(r for mb in mbs for r in mb) == list(range(len(LENGTHS)))
    if draw == "rollout":
        assert epochs[0] == epochs[1] == epochs[2]
    else:
        assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
