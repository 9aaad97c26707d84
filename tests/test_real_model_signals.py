"""What a real model shows that the toy tasks hid: groups whose completions all score alike
(frac_reward_zero_std, its warning, ppo.filter_zero_std_groups), completions cut at
max_new_tokens (response/truncated_rate, its warning, ppo.mask_truncated_completions), and
eval/accuracy only from rewards declared 0/1. Hand-built batches, numbers worked out by hand."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import Config, ConfigError
from rlhfkit.core import kl_estimate, masked_mean
from rlhfkit.data.prompts import file_records
from rlhfkit.models.forward import build_tiny_policy, disable_dropout, freeze, load_policy
from rlhfkit.rollout.evaluate import evaluate_rewards
from rlhfkit.rollout.experience import ActorCritic, make_experience
from rlhfkit.rollout.generate import Rollout
from rlhfkit.rollout.rewards import Reward, RewardError, build_reward, function_scorer
from rlhfkit.run.watch import SignalWatch
from rlhfkit.tasks import cities, doubling
from rlhfkit.trainers.rl import ppo_update, train_rl
from rlhfkit.trainers.rl_setup import refuse_untested_engines
from rlhfkit.utils import read_jsonl
from test_user_data import doubling_file

TOK = doubling.make_tokenizer()
ARCH = {"n_layer": 1, "n_head": 2, "n_embd": 16}

# --------------------------------------------------------------------------- a hand-built batch
# 4 completions of 2 prompts (grpo groups of 2), at most 3 tokens each:
#   row 0: 2 tokens, ends with EOS, score 1  } group 0: scores 1, 0 -> advantages +0.5, -0.5
#   row 1: 3 tokens, cut (no EOS),  score 0  }   (scale_rewards=none: A = s - group mean)
#   row 2: 1 token (EOS),           score 1  } group 1: scores 1, 1 -> zero std, advantages 0
#   row 3: 2 tokens, ends with EOS, score 1  }
LENGTHS, FINISHED, SCORES = [2, 3, 1, 2], [True, False, True, True], [1.0, 0.0, 1.0, 1.0]


def fixed_scores(prompts, completions, **columns):
    return SCORES[: len(completions)]


def hand_rollout() -> Rollout:
    prompt = TOK(["数字:12x2="] * 4, return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    body = torch.randint(4, 14, (4, 3), generator=gen)  # characters, never EOS or pad
    mask = torch.zeros(4, 3, dtype=torch.long)
    ids = torch.full((4, 3), TOK.pad_token_id)
    for i, (n, done) in enumerate(zip(LENGTHS, FINISHED)):
        mask[i, :n] = 1
        ids[i, :n] = body[i, :n]
        if done:
            ids[i, n - 1] = TOK.eos_token_id
    assert TOK.eos_token_id not in body.tolist()[1]  # the cut row holds no EOS
    return Rollout(prompt_ids=prompt["input_ids"], prompt_mask=prompt["attention_mask"], response_ids=ids,
                   response_mask=mask, logprobs=torch.zeros(4, 3), finished=torch.tensor(FINISHED))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    policy = disable_dropout(build_tiny_policy(TOK, seed=1, **ARCH)).train()
    ref = freeze(build_tiny_policy(TOK, seed=1, **ARCH))
    return ActorCritic(policy), ref


def grpo_config(**ppo) -> object:
    return dataclasses.replace(Config().ppo, algo="grpo", group_size=2, batch_size=4, minibatch_size=4, ppo_epochs=1,
                               scale_rewards="none", kl_in_loss=True, kl_estimator="k3", kl_coef=0.3, **ppo)


def experience(models, **ppo):
    ac, ref = models
    pc = grpo_config(**ppo)
    exp, stats = make_experience(ac, ref, function_scorer(fixed_scores, TOK), hand_rollout(), pc, pc.kl_coef)
    return exp, stats, pc


def test_group_and_truncation_statistics_of_a_hand_built_batch(models):
    exp, stats, _ = experience(models)
    assert stats["frac_reward_zero_std"] == 0.5  # group 1 of 2
    assert stats["response/truncated_rate"] == 0.25 and stats["response/eos_rate"] == 0.75  # row 1
    assert exp.loss_rows is None and "policy/trained_frac" not in stats  # no option on: every row trains
    # the advantages of a group are s - mean: row 1, cut, still counts in its group's baseline
    want = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(exp.advantages, want)


def test_groups_of_one_have_no_zero_std_share(models):
    ac, ref = models
    pc = dataclasses.replace(Config().ppo, algo="reinforce", batch_size=4, kl_in_loss=True, kl_estimator="k3")
    _, stats = make_experience(ac, ref, function_scorer(fixed_scores, TOK), hand_rollout(), pc, pc.kl_coef)
    assert "frac_reward_zero_std" not in stats and stats["response/truncated_rate"] == 0.25
    _, stats = make_experience(ac, ref, function_scorer(fixed_scores, TOK), hand_rollout(),
                               dataclasses.replace(pc, samples_per_prompt=2), pc.kl_coef)
    assert stats["frac_reward_zero_std"] == 0.5  # reinforce with 2 samples per prompt: its groups


@pytest.mark.parametrize(("options", "rows"), [
    ({"filter_zero_std_groups": True}, [True, True, False, False]),
    ({"mask_truncated_completions": True}, [True, False, True, True]),
    ({"filter_zero_std_groups": True, "mask_truncated_completions": True}, [True, False, False, False]),
])
def test_the_rows_each_option_leaves_out(models, options, rows):
    exp, stats, _ = experience(models, **options)
    assert exp.loss_rows.tolist() == rows
    assert stats["policy/trained_frac"] == sum(rows) / 4
    # leaving rows out changes no advantage: the baselines saw every completion
    assert torch.equal(exp.advantages, experience(models)[0].advantages)


def policy_loss_of(models, exp, pc) -> dict:
    """The update's own stats for one minibatch of every row of ``exp``, before any step (ratio 1)."""
    ac, _ = models
    opt = torch.optim.SGD(ac.policy.parameters(), lr=0.0)
    (stats,) = ppo_update(ac, opt, exp, pc, pc.kl_coef)
    return stats


def test_leaving_rows_out_changes_the_token_mean_normaliser(models):
    """At ratio 1 the policy loss is -sum(A * mask) / sum(mask) over the minibatch's tokens.
    All 8 tokens (2 + 3 + 1 + 2): -(0.5 * 2 - 0.5 * 3) / 8 = 0.0625. Zero-std group 1 filtered,
    5 tokens left: -(0.5 * 2 - 0.5 * 3) / 5 = 0.1 -- its advantages were 0, only the divisor
    moved (8 -> 5), so every kept token's gradient grows by 8/5. Truncated row 1 masked, the
    tokens of rows 0, 2, 3 (5): -(0.5 * 2 + 0 + 0) / 5 = -0.2. The KL term averages over the same
    tokens."""
    full, _, pc = experience(models)
    assert policy_loss_of(models, full, pc)["policy/loss"] == pytest.approx(0.0625, abs=1e-6)
    for options, want, kept in (({"filter_zero_std_groups": True}, 0.1, [0, 1]),
                                ({"mask_truncated_completions": True}, -0.2, [0, 2, 3])):
        exp, _, pc = experience(models, **options)
        stats = policy_loss_of(models, exp.select(exp.loss_rows), pc)
        assert stats["policy/loss"] == pytest.approx(want, abs=1e-6), options
        kl = masked_mean(kl_estimate(exp.old_logprobs[kept], exp.ref_logprobs[kept], "k3"), exp.response_mask[kept])
        assert stats["policy/kl_loss"] == pytest.approx(float(kl), abs=1e-6)


def test_filtering_needs_group_baselines_and_one_process():
    with pytest.raises(ConfigError, match="filter_zero_std_groups needs grpo or rloo"):
        dataclasses.replace(Config().ppo, algo="reinforce", filter_zero_std_groups=True)
    cfg = Config().replace(ppo={"algo": "grpo", "mask_truncated_completions": True})
    two = SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2)
    with pytest.raises(ValueError, match="mask_truncated_completions runs on one process only"):
        refuse_untested_engines(two, cfg)
    refuse_untested_engines(SimpleNamespace(distributed_type="NO", num_processes=1), cfg)


# --------------------------------------------------------------------------- the warnings


def test_the_signal_watch_warns_once_on_a_window_not_on_one_batch():
    w = SignalWatch("ppo.group_size", window=5, share=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning here fails
        for step, share in enumerate([1.0, 0.0, 0.25, 1.0, 0.0, 0.5, 0.75]):  # noisy, below half on average
            w.check(step, {"frac_reward_zero_std": share, "response/truncated_rate": 0.0})
    w = SignalWatch("ppo.group_size", window=5, share=0.5)
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(8):
            w.check(step, {"frac_reward_zero_std": 1.0, "response/truncated_rate": 0.8}, max_new_tokens=16)
    assert len(caught) == 2  # one per sign, at the step the window filled
    zero, cut = (str(c.message) for c in caught)
    assert zero.startswith("step 4:") and "100% of prompt groups" in zero
    for remedy in ("reward.function", "reward.weights", "ppo.group_size", "rlhfkit sft"):
        assert remedy in zero
    assert "80%" in cut and "ppo.max_new_tokens=16" in cut and "ppo.mask_truncated_completions" in cut
    again = SignalWatch()
    again.load_state_dict(w.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.check(8, {"frac_reward_zero_std": 1.0, "response/truncated_rate": 1.0})  # warned already


def constant_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_a_run_without_signal_warns_once_and_filtering_leaves_the_policy_as_it_was(tiny_models, tiny_config,
                                                                                    tmp_path, no_plots):
    """A 0/1 reward the policy never earns: every group zero-std. The run names the remedies once;
    with filter_zero_std_groups no row is trained on, so the saved policy is the starting one."""
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, data={"path": doubling_file(tmp_path)},
                      reward={"function": "test_real_model_signals:constant_reward"},
                      ppo={"algo": "grpo", "steps": 6, "batch_size": 8, "group_size": 4, "max_new_tokens": 1,
                           "filter_zero_std_groups": True})
    with pytest.warns(RuntimeWarning) as caught:
        train_rl(cfg)
    messages = [str(c.message) for c in caught]
    assert sum("carry no learning signal" in m for m in messages) == 1
    assert sum("were cut at ppo.max_new_tokens=1" in m for m in messages) == 1  # one token: nearly all cut
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["frac_reward_zero_std"] for r in rows] == [1.0] * 6
    assert all(r["policy/trained_frac"] == 0.0 and "policy/loss" not in r for r in rows)
    start = load_policy(tiny_models.policy).state_dict()
    saved = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    assert all(torch.equal(saved[k], start[k]) for k in saved if k in start)


# --------------------------------------------------------------------------- eval/accuracy


def graded(prompts, completions, **columns):
    """A 0/1/2 reward that happens to give every completion 1."""
    return [1.0] * len(completions)


def graded_declared(prompts, completions, **columns):
    return [2.0] * len(completions)


graded_declared.binary = True  # wrongly: it returns 2


def test_accuracy_comes_only_from_declared_0_1_rewards(tiny_models, tmp_path):
    policy = load_policy(tiny_models.policy)
    records = file_records(doubling_file(tmp_path, 6), TOK, Config())
    cpu = torch.device("cpu")
    ev = evaluate_rewards(policy, TOK, records, function_scorer(graded, TOK), cpu, max_new_tokens=4)
    assert ev["eval/reward/graded"] == 1.0 and "eval/accuracy" not in ev  # all 1s, never declared 0/1
    declared = Reward(function_scorer(graded, TOK).sources, accuracy=("graded",))  # eval.accuracy_reward=graded
    assert evaluate_rewards(policy, TOK, records, declared, cpu, max_new_tokens=4)["eval/accuracy"] == 1.0
    with pytest.raises(RewardError) as err:
        evaluate_rewards(policy, TOK, records, function_scorer(graded_declared, TOK), cpu, max_new_tokens=4)
    msg = str(err.value)
    assert "\n" not in msg and "graded_declared is declared binary" in msg and "returned 2 for 6 of 6" in msg


def test_eval_accuracy_reward_names_a_source_and_the_verifiers_are_declared():
    cfg = Config().replace(reward={"function": "rlhfkit.tasks.doubling:exact_reward,test_real_model_signals:graded"})
    assert build_reward(cfg, TOK, "cpu").accuracy_sources() == ["exact_reward"]  # the built-in verifier
    named = build_reward(cfg.replace(eval={"accuracy_reward": "graded"}), TOK, "cpu")
    assert named.accuracy_sources() == ["graded"] and named.declared_binary() == ["exact_reward", "graded"]
    with pytest.raises(ValueError, match="names no reward source .nope.; the sources are: exact_reward, graded"):
        build_reward(cfg.replace(eval={"accuracy_reward": "nope"}), TOK, "cpu")
    assert doubling.exact_reward.binary and doubling.format_reward.binary and cities.exact_reward.binary


def test_stopping_on_an_accuracy_no_reward_declares_is_refused(tiny_models, tiny_config, tmp_path):
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy},
                      data={"path": doubling_file(tmp_path), "eval_path": doubling_file(tmp_path, 4, "held.jsonl")},
                      reward={"function": "test_real_model_signals:graded"},
                      ppo={"algo": "grpo", "stop_metric": "eval/accuracy", "stop_at": 0.9})
    with pytest.raises(ValueError, match="no reward source is declared 0/1, so it is never logged"):
        train_rl(cfg)
    declared = cfg.replace(eval={"accuracy_reward": "graded"}, ppo={"steps": 1})
    assert train_rl(declared)["reached"]["steps"] == 1  # every completion scores 1: stops at the first evaluation
