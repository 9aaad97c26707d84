"""Log-probs and entropies of the chosen tokens computed chunk by chunk from the LM head
(``logprobs.chunked_token_logprobs``), as the update does for big vocabularies.

* in float64 the values and the gradients wrt the hidden states, the head's weight and bias equal
  those of ``logprobs_from_logits`` / ``entropy_from_logits`` on the full logits, for chunks of one
  row, of an odd number of rows, of all rows and of more, with a temperature;
* half-precision inputs give float32 log-probs and gradients in the inputs' dtypes; a bfloat16
  head read as bfloat16 by the compiled kernels gives PyTorch's float32 route's numbers;
* a PPO update whose log-probs go through chunks of a few rows (a small ``logits_budget``) gives the losses, statistics and gradients of the full-logits update, tied embeddings
  included, and its first minibatch still has ratio 1;
* the experience pass's policy and reference forwards (a LoRA reference too) take the same
  chunked path and give the full logits' numbers;
* a head with an adapter on it is not taken apart: the full logits are used.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import rlhfkit.models.forward as models
from rlhfkit import ops
from rlhfkit.accel import kernels
from rlhfkit.config import Config, PPOConfig
from rlhfkit.core import entropy_from_logits, logprobs_from_logits
from rlhfkit.models.forward import (
    ValueHead,
    add_lora,
    build_tiny_policy,
    build_tiny_scalar_model,
    disable_dropout,
    freeze,
    load_policy,
    plain_lm_head,
    token_logprobs,
)
from rlhfkit.models.logprobs import chunked_token_logprobs
from rlhfkit.rollout.experience import ActorCritic, Experience, make_experience
from rlhfkit.rollout.generate import generate
from rlhfkit.rollout.rewards import reward_model_scorer
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import minibatch_loss, ppo_update

TOK = doubling.make_tokenizer()
N, H, V = 9, 6, 13


def _inputs(bias: bool, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(V, (N,), generator=gen)
    return hidden, weight, b, targets


def _full(hidden, weight, bias, targets, temperature):
    logits = F.linear(hidden, weight, bias)[None] / temperature  # [1, N, V]
    return logprobs_from_logits(logits, targets[None])[0], entropy_from_logits(logits)[0]


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, N, 50])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("terms", ["both", "logprobs", "entropy"])
def test_chunks_equal_the_full_logits(chunk_rows, bias, terms):
    hidden, weight, b, targets = _inputs(bias)
    params = [p for p in (hidden, weight, b) if p is not None]
    gen = torch.Generator().manual_seed(1)
    a, c = torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(N, generator=gen, dtype=torch.float64)
    use_lp, use_ent = terms in ("both", "logprobs"), terms in ("both", "entropy")

    def objective(lp, ent):  # a weighted sum of whichever outputs are in use
        return (lp * a).sum() * use_lp + ((ent * c).sum() if use_ent else 0.0)

    lp, ent = chunked_token_logprobs(hidden, weight, b, targets, 0.7, chunk_rows, with_entropy=use_ent)
    assert lp.dtype == torch.float64 and (ent is None) != use_ent
    full_lp, full_ent = _full(hidden, weight, b, targets, 0.7)
    torch.testing.assert_close(lp, full_lp, atol=1e-12, rtol=1e-12)
    if use_ent:
        torch.testing.assert_close(ent, full_ent, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(objective(lp, ent), params)
    full_grads = torch.autograd.grad(objective(full_lp, full_ent), params)
    for name, g, fg in zip(("hidden", "weight", "bias"), grads, full_grads):
        torch.testing.assert_close(g, fg, atol=1e-12, rtol=1e-12, msg=name)


def test_gradcheck_with_temperature():
    hidden, weight, b, targets = _inputs(bias=True)
    small = (hidden[:4].detach().requires_grad_(), weight, b)
    assert torch.autograd.gradcheck(lambda h, w, bb: chunked_token_logprobs(h, w, bb, targets[:4], 1.3, 3, True), small)


def test_frozen_head_gets_no_gradient():
    """A LoRA policy's head is frozen: only the hidden states get a gradient, the same one."""
    hidden, weight, _, targets = _inputs(bias=False)
    weight = weight.detach()
    lp, _ = chunked_token_logprobs(hidden, weight, None, targets, 1.0, 2)
    (g,) = torch.autograd.grad(lp.sum(), hidden)
    (fg,) = torch.autograd.grad(_full(hidden, weight, None, targets, 1.0)[0].sum(), hidden)
    torch.testing.assert_close(g, fg, atol=1e-12, rtol=1e-12)


def test_half_precision_computes_the_softmax_in_float32():
    hidden, weight, b, targets = _inputs(bias=True, dtype=torch.bfloat16)
    lp, ent = chunked_token_logprobs(hidden, weight, b, targets, 0.8, 4, with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    full_lp, full_ent = _full(hidden, weight, b, targets, 0.8)  # bf16 logits, float32 log-softmax
    torch.testing.assert_close(lp, full_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, full_ent, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight, b))
    full_grads = torch.autograd.grad(full_lp.sum() + full_ent.sum(), (hidden, weight, b))
    for g, fg, p in zip(grads, full_grads, (hidden, weight, b)):
        assert g.dtype == p.dtype
        torch.testing.assert_close(g.float(), fg.float(), atol=0.05, rtol=0.05)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: the bfloat16 head runs PyTorch's route")
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("V", [13, 1003])
def test_bfloat16_head_read_as_bfloat16_equals_the_float32_route(monkeypatch, accel_on, temperature, V):
    """A bfloat16 head's chunks go to the compiled kernels (no float32 copy of the logits), and
    give what PyTorch's route gives, which converts each chunk first: the log-probs to float32
    rounding, every gradient (its logits' gradient rounded to bfloat16 once on both
    routes) to within one bfloat16 rounding. Vocabularies with and without a partial last vector."""
    gen = torch.Generator().manual_seed(4)
    hidden = (2 * torch.randn(N, H, generator=gen)).bfloat16().requires_grad_()
    weight = torch.randn(V, H, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(V, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(V, (N,), generator=gen)
    a = torch.randn(N, generator=gen)
    calls = []
    real = kernels.head_usable
    monkeypatch.setattr(kernels, "head_usable", lambda z: calls.append(z.dtype) or real(z))

    def run():
        lp, _ = chunked_token_logprobs(hidden, weight, b, targets, temperature, 4)
        return lp, torch.autograd.grad((a * lp).sum(), (hidden, weight, b))

    ours = run()
    assert calls and all(d == torch.bfloat16 for d in calls)
    ops.configure("off")  # PyTorch's route (accel_on puts the suite's choice back)
    ref = run()
    assert ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
    for g, r in zip(ours[1], ref[1]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), atol=1e-3, rtol=2 ** -7)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler")
def test_bfloat16_head_kernels_on_infinite_and_exact_values():
    """Rows of -inf, a +inf logit and a finite row as ``torch.logsumexp`` treats them; the
    gradient against float64's, rounded to bfloat16 once (to the nearest, ties to even)."""
    z = torch.tensor([[0.5, -1.0, 2.0, 0.25, 3.0, -2.0, 1.5, 0.0, 4.0], [-float("inf")] * 9,
                      [1.0, float("inf"), 0.0] * 3]).bfloat16()
    t = torch.tensor([2, 0, 1])
    lse, picked = kernels.head_lse_bf16(z, t)
    torch.testing.assert_close(lse, torch.logsumexp(z.float(), -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(picked, z.float().gather(1, t[:, None])[:, 0], atol=0, rtol=0)
    c = torch.tensor([0.7])
    g = kernels.head_grad_bf16(z[:1], lse[:1], c, t[:1])
    exact = (c.double()[:, None] * (F.one_hot(t[:1], 9).double() - z[:1].double().softmax(-1))).bfloat16()
    assert (g.float() - exact.float()).abs().max() <= 2 ** -8 * exact.float().abs().max()


def test_no_rows_give_zero_gradients():
    """An empty batch of rows: empty log-probs, and a zero gradient of the head's shape."""
    hidden, weight, b, targets = _inputs(bias=True)
    empty = hidden[:0].detach().requires_grad_()
    lp, ent = chunked_token_logprobs(empty, weight, b, targets[:0], 0.9, 4, with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    gh, gw, gb = torch.autograd.grad(lp.sum() + ent.sum(), (empty, weight, b))
    assert gh.shape == (0, H) and gw.shape == weight.shape and gb.shape == b.shape
    assert not gw.any() and not gb.any()


def test_infinite_logits_as_torch_logsumexp():
    """The forward's logsumexp (computed in the logits' own memory) treats rows with an infinite
    maximum as ``torch.logsumexp`` does: -inf for a row of -inf, +inf where a logit is +inf."""
    from rlhfkit.models.logprobs import _logsumexp_

    z = torch.tensor([[0.5, -1.0, 2.0], [-float("inf")] * 3, [1.0, float("inf"), 0.0], [-float("inf"), 3.0, 1.0]])
    torch.testing.assert_close(_logsumexp_(z.clone()), torch.logsumexp(z, -1), atol=0, rtol=0)


def test_bad_shapes_are_refused():
    hidden, weight, b, targets = _inputs(bias=True)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(hidden, weight, b, targets[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_token_logprobs(hidden, weight, b, targets, chunk_rows=0)


# --------------------------------------------------------------------------- the update


def _experience(ac: ActorCritic, P: int = 3, R: int = 5, B: int = 6) -> Experience:
    """A hand-made batch: responses of different lengths, old log-probs near the policy's own
    (ratios near 1, some clipped), random advantages, returns and values."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 5, 2, 4, 3, 5])[:B]
    rmask = (torch.arange(R)[None, :] < lengths[:, None]).long()  # [B, R]
    prompt = torch.randint(4, len(TOK), (B, P), generator=gen)
    response = torch.where(rmask.bool(), torch.randint(4, len(TOK), (B, R), generator=gen), TOK.pad_token_id)
    ids, attn = torch.cat([prompt, response], 1), torch.cat([torch.ones(B, P, dtype=torch.long), rmask], 1)
    with torch.no_grad():
        logits, _ = ac(ids, attn, P, 0.7)
        logprobs = logprobs_from_logits(logits, response)
    noise = lambda scale: scale * torch.randn(B, R, generator=gen)  # noqa: E731
    return Experience(input_ids=ids, attention_mask=attn, prompt_len=P, response_ids=response, response_mask=rmask,
                      old_logprobs=logprobs + noise(0.3), ref_logprobs=logprobs + noise(0.2), old_values=noise(0.5),
                      score=torch.zeros(B), rewards=torch.zeros(B, R), advantages=noise(1.0), returns=noise(1.0))


def _actor_critic(path: str, value_model: str, tied: bool) -> ActorCritic:
    policy = disable_dropout(load_policy(path)).train()
    if tied:  # one Parameter for the input embedding and the head: both uses add to its gradient
        policy.lm_head.weight = policy.transformer.wte.weight
    if value_model == "none":  # GRPO: no critic
        return ActorCritic(policy)
    if value_model == "shared":
        head = ValueHead(policy.config.hidden_size)
        torch.nn.init.normal_(head.summary.weight, std=0.5)
        return ActorCritic(policy, value_head=head)
    hidden = policy.config.hidden_size
    critic = build_tiny_scalar_model(TOK, seed=7, n_layer=1, n_head=2, n_embd=hidden)
    return ActorCritic(policy, critic=disable_dropout(critic).train())


def _rows_a_chunk(ac: ActorCritic, rows: int) -> ActorCritic:
    """``ac``'s models whose log-prob passes run the LM head in chunks of ``rows`` rows."""
    budget = rows * ac.policy.get_output_embeddings().out_features
    return ActorCritic(ac.policy, value_head=ac.value_head, critic=ac.critic, logits_budget=budget)


def _loss_and_grads(ac: ActorCritic, exp: Experience, pc, update_policy: bool = True):
    ac.zero_grad(set_to_none=True)
    mb = torch.arange(exp.input_ids.shape[0])
    loss, logprobs, stats = minibatch_loss(ac, exp, mb, pc, kl_coef=0.1, update_policy=update_policy)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ac.named_parameters() if p.grad is not None}
    return loss.detach(), logprobs.detach(), stats, grads


@pytest.mark.parametrize("update_policy", [True, False], ids=["update", "critic_warmup"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_update_in_chunks_equals_full_logits(tiny_models, monkeypatch, value_model, tied, update_policy):
    """The update's loss from the chunked head's log-probs: the full logits' loss, stats and gradients."""
    ac = _actor_critic(tiny_models.policy, value_model, tied)
    exp = _experience(ac)
    pc = dataclasses.replace(Config().ppo, temperature=0.7, entropy_coef=0.05, kl_in_loss=True, kl_estimator="k2")
    full = _loss_and_grads(ac, exp, pc, update_policy)
    calls = []  # chunks of 4 of the 30 rows: the last one of 2
    real = models.chunked_token_logprobs
    monkeypatch.setattr(models, "chunked_token_logprobs", lambda *a: calls.append(a[5]) or real(*a))
    chunked = _loss_and_grads(_rows_a_chunk(ac, 4), exp, pc, update_policy)
    assert calls == [4], "the update did not take the chunked path"
    for got, want in zip(chunked[:2], full[:2]):  # the loss, the log-probs
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert chunked[2].keys() == full[2].keys()
    for k in full[2]:
        torch.testing.assert_close(chunked[2][k], full[2][k], atol=1e-6, rtol=1e-6, msg=k)
    assert chunked[3].keys() == full[3].keys() and len(full[3]) > 0
    for name in full[3]:
        torch.testing.assert_close(chunked[3][name], full[3][name], atol=1e-6, rtol=1e-6, msg=name)


class _Recorder:
    """An optimizer that records each step's gradients and moves nothing."""

    def __init__(self, params):
        self.params, self.steps = list(params), []
        self.param_groups = [{"params": self.params}]  # what ppo_update reads of an optimizer besides these calls

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.steps.append([None if p.grad is None else p.grad.clone() for p in self.params])


@pytest.mark.parametrize("algo, change", [
    ("grpo", {}), ("ppo", {}), ("grpo", {"loss_type": "grpo"}), ("grpo", {"loss_type": "dr_grpo", "max_new_tokens": 5}),
    ("grpo", {"loss_type": "cispo"}), ("grpo", {"loss_type": "sapo"}), ("grpo", {"importance_sampling_level": "sequence"}),
], ids=["grpo", "ppo", "seq_mean", "dr_grpo", "cispo", "sapo", "gspo"])
def test_chunked_update_any_micro_batch_split(tiny_models, monkeypatch, algo, change):
    """The commands' defaults (GRPO: k3 in the loss; PPO: a shared value head, k3 0.1 beside the
    reward's KL) and other aggregations and objectives, the log-probs from the chunked head,
    micro-batches of 2 or 4 of a minibatch's 6 rows: every optimizer step's gradients are those
    of the whole minibatch on the full logits."""
    ac = _actor_critic(tiny_models.policy, "shared" if algo == "ppo" else "none", tied=True)
    exp = _experience(ac)
    pc = dataclasses.replace(PPOConfig(algo=algo), batch_size=6, minibatch_size=6, micro_batch_size=0,
                             group_size=2, samples_per_prompt=2 if algo == "grpo" else 1, **change)
    assert (pc.kl_in_loss, pc.kl_estimator) == ((True, "k3") if algo == "grpo" else (False, "k1"))

    def steps(micro):
        opt = _Recorder(ac.parameters())
        ppo_update(ac, opt, exp, dataclasses.replace(pc, micro_batch_size=micro), pc.kl_coef,
                   generator=torch.Generator().manual_seed(0))
        return opt.steps

    want = steps(0)
    ac = _rows_a_chunk(ac, 4)
    calls, real = [], models.chunked_token_logprobs
    monkeypatch.setattr(models, "chunked_token_logprobs", lambda *a: calls.append(a[5]) or real(*a))
    for micro in (2, 4):
        got = steps(micro)
        assert len(got) == len(want) == pc.ppo_epochs * 1 and set(calls) == {4}
        for g_step, w_step in zip(got, want):
            for g, w in zip(g_step, w_step):
                assert (g is None) == (w is None)
                if w is not None:
                    torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_forward_kl_term_beside_the_reward_kl(tiny_models):
    """ppo.forward_kl_coef = c adds c * token-mean of k3 = exp(log ref - log pi) - 1 - (log ref - log pi)
    to PPO's loss while the KL stays in the reward: the loss grows by that hand-computed mean, and
    loss and gradients equal those of the k3 loss term GRPO uses (kl_in_loss=true) at beta c."""
    ac = _actor_critic(tiny_models.policy, "shared", tied=False)
    exp = _experience(ac)
    base = Config().ppo  # PPO's defaults: k1 in the reward and this term at 0.1
    assert not base.kl_in_loss and base.kl_estimator == "k1" and base.forward_kl_coef == 0.1
    plain = _loss_and_grads(ac, exp, dataclasses.replace(base, forward_kl_coef=0.0))
    beside = _loss_and_grads(ac, exp, dataclasses.replace(base, forward_kl_coef=0.25))
    log_r = exp.ref_logprobs - beside[1]
    k3 = (log_r.exp() - 1 - log_r)[exp.response_mask.bool()]
    torch.testing.assert_close(beside[0] - plain[0], 0.25 * k3.mean(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(beside[2]["policy/kl_loss"], k3.mean(), atol=1e-6, rtol=1e-5)
    ac.zero_grad(set_to_none=True)  # the same term as GRPO's k3 loss at beta 0.25
    pc_loss = dataclasses.replace(base, kl_in_loss=True, kl_estimator="k3")  # forward_kl_coef 0.1: not used
    loss, _, _ = minibatch_loss(ac, exp, torch.arange(len(exp.score)), pc_loss, kl_coef=0.25, update_policy=True)
    loss.backward()
    torch.testing.assert_close(loss.detach(), beside[0], atol=1e-6, rtol=1e-6)
    for name, p in ac.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, beside[3][name], atol=1e-6, rtol=1e-5, msg=name)
    assert any((beside[3][n] - plain[3][n]).abs().max() > 1e-4 for n in plain[3]), "the term moved no gradient"


@pytest.mark.accel_twice
def test_first_minibatch_ratio_is_one_in_chunks():
    """The experience pass takes the full logits, the update the chunked path: the first
    minibatch's ratio is still 1 (the two compute the same numbers)."""
    arch = {"n_layer": 2, "n_head": 2, "n_embd": 32}
    policy = disable_dropout(build_tiny_policy(TOK, seed=3, **arch)).train()
    ref = freeze(build_tiny_policy(TOK, seed=3, **arch))
    rm = freeze(build_tiny_scalar_model(TOK, seed=5, **arch))
    ac = ActorCritic(policy, value_head=ValueHead(arch["n_embd"]))
    pc = dataclasses.replace(Config().ppo, temperature=0.8, entropy_coef=0.01)
    texts = [p.text for p in doubling.DoublingData(3).prompts(pc.batch_size)]
    enc = TOK(texts, padding=True, return_tensors="pt")
    roll = generate(policy, enc["input_ids"], enc["attention_mask"], 6, TOK.eos_token_id, TOK.pad_token_id,
                    temperature=0.8, generator=torch.Generator().manual_seed(3))
    exp, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    ac = _rows_a_chunk(ac, 3)
    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-2},
                             {"params": ac.critic_parameters(), "lr": 1e-2}])
    first = ppo_update(ac, opt, exp, pc, pc.kl_coef)[0]
    assert abs(first["policy/ratio_mean"].item() - 1.0) < 1e-6
    assert first["policy/approx_kl"].item() < 1e-10 and first["policy/clipfrac"].item() == 0.0


@pytest.mark.parametrize("lora", [False, True], ids=["full_reference", "lora_reference"])
def test_experience_in_chunks_equals_full_logits(monkeypatch, lora):
    """The experience pass's policy and reference forwards (the LoRA reference: the base with the
    adapter off) take the chunked path too, and give the full logits' numbers."""
    from rlhfkit.models.forward import AdapterDisabled
    from rlhfkit.rollout.experience import experience_forwards

    arch = {"n_layer": 2, "n_head": 2, "n_embd": 32}
    policy = disable_dropout(build_tiny_policy(TOK, seed=3, **arch)).train()
    if lora:
        policy = add_lora(policy, 4, 8.0)
        torch.nn.init.normal_(policy.base_model.model.transformer.h[0].attn.c_attn.lora_B["default"].weight)
        ref = AdapterDisabled(policy)
    else:
        ref = freeze(build_tiny_policy(TOK, seed=4, **arch))
    ac = ActorCritic(policy)
    pc = dataclasses.replace(Config().ppo, temperature=0.8)
    enc = TOK([p.text for p in doubling.DoublingData(3).prompts(6)], padding=True, return_tensors="pt")
    roll = generate(policy, enc["input_ids"], enc["attention_mask"], 6, TOK.eos_token_id, TOK.pad_token_id,
                    temperature=0.8, generator=torch.Generator().manual_seed(3))
    full = experience_forwards(ac, ref, roll, pc, reuse=False)
    calls, real = [], models.chunked_token_logprobs
    monkeypatch.setattr(models, "chunked_token_logprobs", lambda *a: calls.append(a[5]) or real(*a))
    chunked = experience_forwards(_rows_a_chunk(ac, 5), ref, roll, pc, reuse=False)
    assert calls == [5, 5], "the policy and the reference forwards did not both take the chunked path"
    for key in ("old_logprobs", "ref_logprobs", "entropy"):
        torch.testing.assert_close(chunked[key], full[key], atol=1e-6, rtol=1e-6, msg=key)
    with torch.no_grad():  # and both equal the log-softmax of the models' own logits
        P = roll.prompt_ids.shape[1]
        ref_logits, _ = models.policy_forward(ref, roll.input_ids, roll.attention_mask, P)
        torch.testing.assert_close(full["ref_logprobs"], logprobs_from_logits(ref_logits / 0.8, roll.response_ids))
    assert (full["old_logprobs"] - full["ref_logprobs"]).abs().max() > 1e-3  # the two models differ


def test_a_head_with_an_adapter_keeps_the_full_logits(tiny_models):
    plain = load_policy(tiny_models.policy)
    assert plain_lm_head(plain) is plain.lm_head
    assert plain_lm_head(add_lora(copy.deepcopy(plain), 4, 8.0)) is not None  # all-linear leaves the head plain
    adapted = add_lora(copy.deepcopy(plain), 4, 8.0, target_modules="c_attn, lm_head")
    assert plain_lm_head(adapted) is None
    ids = torch.randint(4, len(TOK), (2, 6))
    # a budget of 1 logit would chunk by the row if it could
    lp, ent, _ = token_logprobs(adapted, ids, torch.ones_like(ids), 3, ids[:, 3:], 0.9, entropy=True, logits_budget=1)
    logits, _ = models.policy_forward(adapted, ids, torch.ones_like(ids), 3)
    torch.testing.assert_close(lp, logprobs_from_logits(logits / 0.9, ids[:, 3:]))
    torch.testing.assert_close(ent, entropy_from_logits(logits / 0.9))
