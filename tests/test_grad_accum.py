"""Gradient accumulation (``ppo.micro_batch_size``): an update whose minibatch goes through the
forward and backward passes in micro-batches is the update of the whole minibatch.

One update runs twice, whole (``micro_batch_size=0``) and in micro-batches of 3 rows of a
minibatch of 10, on tiny float32 models. The optimizer is replaced by plain SGD that records the
gradients it steps on, so the gradients themselves are compared (Adam's first step is about
``lr * sign(g)`` and would hide a wrongly weighted one), then the weights after the step (lr 1: a
gradient error shows in full), then every statistic. The rows' responses have different lengths,
and the test checks that weighting micro-batches by rows instead of tokens would fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlhfkit.config import Config
from rlhfkit.core import logprobs_from_logits
from rlhfkit.experience import ActorCritic, Experience
from rlhfkit.models import ValueHead, build_tiny_policy, build_tiny_scalar_model, disable_dropout
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import minibatch_loss, ppo_update

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


def _ppo_update(ac: ActorCritic, exp: Experience, micro: int):
    pc = dataclasses.replace(Config().ppo, minibatch_size=len(LENGTHS), ppo_epochs=1, micro_batch_size=micro,
                             kl_in_loss=True, entropy_coef=0.05, value_clip_range=0.2)
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
    pc = dataclasses.replace(Config().ppo, kl_in_loss=True, entropy_coef=0.05, value_clip_range=0.2)
    mb = torch.arange(len(LENGTHS))
    for rows in mb.split(3):
        loss, _, _ = minibatch_loss(naive, exp, rows, pc, 0.1, True)
        (loss * len(rows) / len(mb)).backward()
    params = [*naive.policy.parameters(), *naive.critic_parameters()]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in naive.policy.parameters()]))
    naive_grads = [p.grad * min(1.0, 1.0 / (norm.item() + 1e-6)) for p in params[: len(list(naive.policy.parameters()))]]
    assert max_diff(grads[: len(naive_grads)], naive_grads) > 100 * TOL
