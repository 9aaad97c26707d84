"""rlhfkit's GRPO update is TRL's, number for number, on the same batch.

``benchmarks/time_to_accuracy.py`` compares rlhfkit GRPO with TRL 1.16's GRPOTrainer on rlhfkit's
schedule and reads any difference in rollouts to the target as coming from the samples, not the
update. This checks that reading: one rollout's batch (GRPO groups, completions of different
lengths, a reference that differs from the policy so the KL term acts) goes through two epochs of
one minibatch in both libraries -- rlhfkit's ``ppo_update`` with ``rlhfkit grpo``'s defaults, and
TRL's own ``compute_loss`` under the GRPOConfig the benchmark builds (its ``trl_grpo_config`` with
``trl_on_rlhfkit_schedule``'s keys: ``loss_type='bnpo'``, ``scale_rewards='batch'``, k3 without the
importance ratio, beta and clip range as rlhfkit's, float32), the accelerator's backward and
gradient clip and TRL's fused AdamW. The advantages, the gradients of
both optimizer steps (the second one at a ratio away from 1, with clipped tokens) and the weights
after them must agree to rounding.

With left-padded prompts a model with absolute positions (GPT-2) is scored differently by the two:
TRL's training forward passes no position ids, so a padded row's positions start at the padding,
where its sampler (``generate``) and rlhfkit count them from the first real token. The GPT-2 case
therefore uses prompts of one length (as the doubling task's are, checked here), the Llama case
left padding (rotary positions are relative, so both agree there).

TRL is an optional benchmark dependency: the test is marked ``bench`` (``make bench`` and ``make
bench-real`` run it; ``make test`` leaves it out).
"""

from __future__ import annotations

import copy
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from hf_helpers import chat_tokenizer, import_example
from rlhfkit.config import PPOConfig
from rlhfkit.models.forward import build_tiny, token_logprobs
from rlhfkit.rollout.experience import ActorCritic, Experience, sequence_advantages
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import ppo_update
from rlhfkit.trainers.rl_setup import make_optimizer

U, G, P, R = 4, 4, 6, 5  # prompts, completions per prompt, prompt and completion columns
B = U * G
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def batch(tok, vocab: int, left_padding: bool, seed: int = 0):
    """A GRPO rollout's tensors: grouped prompts (left-padded if asked), right-padded completions
    of 1..R tokens, scores."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(U, P, dtype=torch.long)
    if left_padding:
        prompt_mask[1, :2] = 0
        prompt_mask[3, :1] = 0
    prompts = torch.randint(10, vocab, (U, P), generator=g).masked_fill(prompt_mask == 0, tok.pad_token_id)
    prompt_ids, prompt_mask = prompts.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    completion_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    completions = torch.randint(10, vocab, (B, R), generator=g).masked_fill(completion_mask == 0, tok.pad_token_id)
    scores = 2 * torch.randn(B, generator=g)
    return prompt_ids, prompt_mask, completions, completion_mask, scores


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.bench
@pytest.mark.parametrize("arch,left_padding", [("gpt2", False), ("llama", True)])
def test_the_grpo_update_equals_trls_on_the_same_batch(tmp_path, arch, left_padding):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    tta = import_example(BENCHMARKS, "time_to_accuracy")

    tok = chat_tokenizer()
    base = build_tiny(arch, tok, seed=0)
    base.save_pretrained(tmp_path / "base")  # TRL builds its reference model from the model's path
    tok.save_pretrained(tmp_path / "base")
    prompt_ids, prompt_mask, completions, completion_mask, scores = batch(tok, base.config.vocab_size, left_padding)
    input_ids = torch.cat([prompt_ids, completions], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)

    # rlhfkit grpo's defaults, with a learning rate high enough that the second epoch clips tokens
    pc = PPOConfig(algo="grpo", batch_size=B, minibatch_size=B, group_size=G, ppo_epochs=2, lr=3e-3,
                   max_new_tokens=R)
    assert (pc.kl_in_loss, pc.kl_estimator, pc.loss_type, pc.scale_rewards) == (True, "k3", "token_mean", "batch")

    # TRL 1.16's advantages for scale_rewards='batch': (r - group mean) / (std(r) + 1e-4)
    theirs = (scores - scores.view(U, G).mean(1).repeat_interleave(G)) / (scores.std() + 1e-4)
    advantages = sequence_advantages(scores, pc)
    torch.testing.assert_close(advantages, theirs, rtol=0, atol=1e-6)

    with torch.no_grad():
        old, _, _ = token_logprobs(base, input_ids, attention_mask, P, completions)
    g = torch.Generator().manual_seed(1)
    old = old.masked_fill(completion_mask == 0, 0.0)
    ref = (old + 0.3 * torch.randn(old.shape, generator=g)).masked_fill(completion_mask == 0, 0.0)

    # rlhfkit: ppo_update over one minibatch, two epochs; the gradients as the optimizer steps on them
    ours = copy.deepcopy(base)
    ac = ActorCritic(ours)
    zeros = torch.zeros(B, R)
    exp = Experience(input_ids=input_ids, attention_mask=attention_mask, prompt_len=P, response_ids=completions,
                     response_mask=completion_mask.float(), old_logprobs=old, ref_logprobs=ref, old_values=zeros,
                     score=scores, rewards=zeros, advantages=advantages[:, None] * completion_mask, returns=zeros)
    optimizer = make_optimizer(ac, pc)
    our_grads, step = [], optimizer.step
    optimizer.step = lambda *a, **k: (our_grads.append(grads(ours)), step(*a, **k))[1]
    stats = ppo_update(ac, optimizer, exp, pc, pc.kl_coef, generator=torch.Generator().manual_seed(0))
    assert stats[0]["policy/clipfrac"] == 0 and stats[1]["policy/clipfrac"] > 0.1  # the second epoch clips

    # TRL: its loss on the same inputs, then what its Trainer does with it for one optimizer step
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    # the benchmark's GRPOConfig on rlhfkit's schedule (float32, no checkpointing; read for its rollout
    # of 64), with this test's learning rate and its batch as one minibatch
    keys = {**tta.trl_on_rlhfkit_schedule(Namespace(batch_size=64)), "per_device_train_batch_size": B,
            "steps_per_generation": 1, "learning_rate": pc.lr}
    assert keys["num_iterations"] == pc.ppo_epochs and keys["num_generations"] == G
    args = tta.trl_grpo_config(str(tmp_path / "trl"), seed=0, max_steps=1, batch_size=B, overrides=keys)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * B}), processing_class=tok)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completions,
              "completion_mask": completion_mask, "advantages": theirs, "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum()}
    their_grads = []
    for _ in range(pc.ppo_epochs):
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.accelerator.backward(trainer.compute_loss(model, inputs))
        trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        their_grads.append(grads(model))
        trainer.optimizer.step()

    # the first epoch's gradients come from the same weights (measured: 1e-6 of their size); the
    # second's from weights one Adam step apart by rounding, whose gap depends on the threads'
    # summation order (up to 1.2e-4 of the size on two threads, 1e-5 on one)
    assert len(our_grads) == len(their_grads) == 2
    for epoch, (a, b) in enumerate(zip(our_grads, their_grads)):
        assert a.keys() == b.keys()
        for name in b:
            scale = b[name].abs().max().item()
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=(1e-4, 1e-3)[epoch] * scale + 1e-9,
                                       msg=f"epoch {epoch}: {name}")
    # Adam's steps are about lr per weight whatever the gradient's size, so a weight whose gradient is
    # near 0 carries its rounding further: the weights agree to 5% of one step (measured: 0.5% on one
    # thread, 1.4% on two)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), base.parameters()))
    gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ours.parameters()))
    assert moved > pc.lr and gap < 0.05 * pc.lr


def test_the_doubling_prompts_need_no_padding():
    """The time-to-accuracy comparison's prompts (training and held-out) are all one length in the
    task's tokenizer, so no row is left-padded and TRL's training forward places GPT-2's positions
    as its sampler and rlhfkit do."""
    tok = doubling.make_tokenizer()
    prompts = doubling.DoublingData(0).prompts(3000) + doubling.eval_prompts()
    assert len({len(tok(p.text)["input_ids"]) for p in prompts}) == 1
