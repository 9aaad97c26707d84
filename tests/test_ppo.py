"""Rollout and PPO invariants on tiny random-init models (fast, no training needed).

* generation-time log-probs equal the training forward's recomputation (no silent off-policy);
* greedy decoding equals Hugging Face ``generate`` (an independent implementation);
* the response mask covers tokens up to and including the first EOS, nothing after;
* before the first update of a step the PPO ratio is 1: approx-KL 0, clip fraction 0;
* with actor == reference the KL is 0 and the shaped reward is the score on the last token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from rlhfkit.config import ALGO_DEFAULTS, Config
from rlhfkit.core import entropy_from_logits, logprobs_from_logits, masked_mean
from rlhfkit.models.forward import (
    build_tiny_policy,
    build_tiny_scalar_model,
    disable_dropout,
    freeze,
    policy_forward,
)
from rlhfkit.rollout.experience import (
    ActorCritic,
    RunningMoments,
    experience_forwards,
    make_experience,
    reuse_rollout,
)
from rlhfkit.rollout.generate import generate
from rlhfkit.rollout.rewards import reward_model_scorer
from rlhfkit.tasks import doubling
from rlhfkit.trainers.rl import ppo_update

TOK = doubling.make_tokenizer()
ARCH = {"n_layer": 2, "n_head": 2, "n_embd": 32}


def prompts(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    # mix prefixed and ragged prompts so left padding really happens
    data = doubling.DoublingData(seed)
    texts = [p.text for p in data.prompts(n)]
    texts[0] = "数字:12x2="  # shorter -> padded
    texts[1] = "__:7x2="
    enc = TOK(texts, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any(), "test needs left padding"
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def policy():
    return disable_dropout(build_tiny_policy(TOK, seed=3, **ARCH)).eval()


@pytest.mark.accel_twice
def test_generation_logprobs_match_training_forward(policy):
    ids, mask = prompts(12)
    torch.manual_seed(0)
    roll = generate(policy, ids, mask, max_new_tokens=8, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    logits, _ = policy_forward(policy, roll.input_ids, roll.attention_mask, ids.shape[1])
    recomputed = logprobs_from_logits(logits, roll.response_ids)
    valid = roll.response_mask.bool()
    gap = (recomputed - roll.logprobs).abs()[valid].max().item()
    assert gap < 1e-5, f"generation and training forward disagree by {gap}"


def test_response_mask_stops_after_first_eos(policy):
    ids, mask = prompts(16, seed=1)
    torch.manual_seed(1)
    roll = generate(policy, ids, mask, max_new_tokens=10, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
    for row_ids, row_mask, done in zip(roll.response_ids.tolist(), roll.response_mask.tolist(), roll.finished.tolist()):
        n = sum(row_mask)
        assert row_mask == [1] * n + [0] * (len(row_mask) - n)  # a prefix of ones
        assert all(t == TOK.pad_token_id for t in row_ids[n:])  # padding after the response
        eos_at = [i for i, t in enumerate(row_ids[:n]) if t == TOK.eos_token_id]
        if done:
            assert eos_at == [n - 1]  # exactly one EOS, the last valid token
        else:
            assert eos_at == [] and n == roll.response_ids.shape[1]


def test_greedy_matches_hf_generate(policy):
    ids, mask = prompts(8, seed=2)
    ours = generate(policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, greedy=True)
    theirs = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)[:, ids.shape[1]:]
    R = ours.response_ids.shape[1]
    # HF pads finished rows with pad and may run longer when a row never stops; compare our span
    assert torch.equal(ours.response_ids, theirs[:, :R])


def _setup(value_model: str):
    torch.manual_seed(0)
    policy = disable_dropout(build_tiny_policy(TOK, seed=3, **ARCH)).train()
    ref = freeze(build_tiny_policy(TOK, seed=3, **ARCH))  # same seed: identical to the actor
    rm = freeze(build_tiny_scalar_model(TOK, seed=5, **ARCH))
    with torch.no_grad():  # GPT-2's 0.02-std init scores every text almost alike; spread the scores
        for p in rm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    if value_model == "shared":
        from rlhfkit.models.forward import ValueHead

        ac = ActorCritic(policy, value_head=ValueHead(ARCH["n_embd"]))
    else:
        ac = ActorCritic(policy, critic=disable_dropout(build_tiny_scalar_model(TOK, seed=7, **ARCH)).train())
    return ac, ref, rm


@pytest.mark.parametrize("accel", ["reference", "accelerated"])
@pytest.mark.parametrize("reuse", [False, True], ids=["recomputed", "reused"])
@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_first_minibatch_has_ratio_one_and_kl_zero(value_model, reuse, accel, request):
    # every accelerated operation that runs here (accel.enabled=on), or none, whatever --accel chose
    request.getfixturevalue("accel_on" if accel == "accelerated" else "accel_off")
    ac, ref, rm = _setup(value_model)
    pc = Config().ppo
    ids, mask = prompts(pc.batch_size // 2, seed=3)
    torch.manual_seed(3)
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, value_head=ac.value_head)
    # the sampler's log-probs are reused where they came from the accelerated forward's arithmetic
    reuse = reuse and accel == "accelerated"
    assert reuse_rollout(roll, ac, allowed=reuse) == reuse
    exp, stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef, reuse_logprobs=reuse)
    # actor == reference: every per-token KL is 0, so the reward is only the score, on the last token;
    # exactly when the experience pass runs the policy's forward again, up to rounding when it
    # takes the sampler's (KV-cached) log-probs
    tol = 1e-5 if reuse else 0.0  # a low-probability token's log-prob rounds to ~1e-6 .. 1e-5
    assert abs(stats["objective/kl"]) <= tol
    last = exp.response_mask.sum(-1) - 1
    expected = torch.zeros_like(exp.rewards)
    expected[torch.arange(len(last)), last] = exp.score.clamp(-pc.score_clip, pc.score_clip)
    torch.testing.assert_close(exp.rewards, expected, atol=tol or None, rtol=tol or None)

    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-2},
                             {"params": ac.critic_parameters(), "lr": 1e-2}])
    mb_stats = ppo_update(ac, opt, exp, pc, pc.kl_coef, logprob_gap=reuse)
    first = mb_stats[0]
    assert abs(first["policy/ratio_mean"].item() - 1.0) < 1e-6
    if reuse:  # measured on the first minibatch, before the optimizer moved anything
        assert 0.0 <= first["policy/logprob_gap"].item() < 1e-4
        assert all("policy/logprob_gap" not in s for s in mb_stats[1:])
    assert first["policy/approx_kl"].item() < 1e-10
    assert first["policy/clipfrac"].item() == 0.0
    # and the update did move the policy: later minibatches see ratios != 1
    assert max(s["policy/approx_kl"].item() for s in mb_stats[1:]) > 1e-6
    # the spent gradients are freed before the next rollout (memory of the trained weights' size)
    assert all(p.grad is None for p in [*ac.policy.parameters(), *ac.critic_parameters()])


def test_one_update_a_rollout_takes_the_old_logprobs_from_a_policy_forward(accel_off):
    """With one optimizer step a rollout (one epoch of one minibatch, no critic, the KL in the loss)
    and the sampler's log-probs not reusable, the experience pass runs the policy as always: the old
    log-probs and entropies are its forward's, and the statistics that read them come with the pass."""
    full, ref, rm = _setup("separate")
    ac = ActorCritic(full.policy)  # no critic
    pc = Config().replace(ppo={**ALGO_DEFAULTS["grpo"], "batch_size": 8, "minibatch_size": 8, "ppo_epochs": 1}).ppo
    ids, mask = (t.repeat_interleave(pc.group_size, 0) for t in prompts(2, seed=5))
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, generator=torch.Generator().manual_seed(1))
    exp, stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    with torch.no_grad():
        logp, ent, _ = ac(roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1], pc.temperature,
                          response_ids=roll.response_ids, entropy=True)
    valid = roll.response_mask.bool()
    torch.testing.assert_close(exp.old_logprobs[valid], logp[valid])
    assert stats["objective/entropy"] == pytest.approx(masked_mean(ent, roll.response_mask).item(), rel=1e-5)
    assert 0.0 <= stats["policy/logprob_gap"] < 1e-4  # the sampler's against the forward's
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_reused_rollout_experience_matches_recomputation(value_model, accel_on):
    """With accel.reuse_rollout_logprobs the experience pass takes the old log-probs, entropies
    and (shared head) values from the sampler: the same numbers as running the policy again,
    to rounding, so every advantage and return is too."""
    ac, ref, rm = _setup(value_model)
    with torch.no_grad():  # a value head that is not zero, so the values are compared for real
        for p in ac.critic_parameters():
            p.normal_(0.0, 0.5)
    pc = Config().ppo
    ids, mask = prompts(24, seed=8)
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id, temperature=0.8,
                    generator=torch.Generator().manual_seed(2), value_head=ac.value_head)
    pc = dataclasses.replace(pc, temperature=0.8)
    assert reuse_rollout(roll, ac)
    reused, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    recomputed, stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef,
                                        reuse_logprobs=False)
    valid = roll.response_mask.bool()
    assert stats["policy/logprob_gap"] < 1e-4
    for name in ("old_logprobs", "old_values", "advantages", "returns", "rewards"):
        a, b = getattr(reused, name), getattr(recomputed, name)
        torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=1e-5, msg=name)
    entropy = entropy_from_logits(ac(roll.input_ids, roll.attention_mask, roll.prompt_ids.shape[1], 0.8)[0])
    torch.testing.assert_close(roll.entropy[valid], entropy[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_critic_warmup_leaves_policy_untouched(value_model):
    ac, ref, rm = _setup(value_model)
    pc = Config().ppo
    ids, mask = prompts(16, seed=4)
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id)
    exp, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    before = [p.detach().clone() for p in ac.policy.parameters()]
    critic_before = [p.detach().clone() for p in ac.critic_parameters()]
    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-2},
                             {"params": ac.critic_parameters(), "lr": 1e-2}])
    ppo_update(ac, opt, exp, pc, pc.kl_coef, update_policy=False)
    assert all(torch.equal(a, b) for a, b in zip(before, ac.policy.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, ac.critic_parameters()))


def test_a_critic_warm_up_as_long_as_the_run_is_refused_and_a_long_one_trains_its_last_steps(tiny_models, tmp_path,
                                                                                             capsys, no_plots):
    """ppo.critic_warmup_steps (3 by default) >= ppo.steps would save the starting policy: the command
    stops before loading anything; 3 of 4 steps warns and the policy does change."""
    from safetensors.torch import load_file

    from rlhfkit.cli.main import main

    args = ["ppo", f"model.name={tiny_models.policy}", "reward.function=rlhfkit.tasks.doubling:format_reward",
            "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0", "ppo.stop_at=0",
            "run.progress=false"]
    assert main([*args, "ppo.steps=2", f"run.out_dir={tmp_path / 'all'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlhfkit ppo: error: ppo.critic_warmup_steps=3 covers every one of ppo.steps=2: the policy would "
                   "never be updated; set ppo.critic_warmup_steps below 2 (0: no warm-up) or raise ppo.steps"]
    assert not (tmp_path / "all").exists()
    assert main(["grpo", *args[1:], "ppo.steps=2", "ppo.group_size=4", f"run.out_dir={tmp_path / 'grpo'}"]) == 0
    with pytest.warns(UserWarning, match=r"ppo.critic_warmup_steps=3 of ppo.steps=4: the policy is updated on the "
                                         r"last 1 step\(s\) only"):
        assert main([*args, "ppo.steps=4", f"run.out_dir={tmp_path / 'most'}"]) == 0
    start = load_file(f"{tiny_models.policy}/model.safetensors")
    trained = load_file(tmp_path / "most" / "policy" / "model.safetensors")
    assert max(float((trained[k] - start[k]).abs().max()) for k in start) > 0


def _one_step(overrides: dict, value_model: str = "separate"):
    ac, ref, rm = _setup(value_model)
    pc = Config().replace(ppo=overrides).ppo
    ids, mask = prompts(48, seed=5)
    torch.manual_seed(5)
    # short: most rows lack EOS, and (with these seeds) two emit it
    roll = generate(ac.policy, ids, mask, 4, TOK.eos_token_id, TOK.pad_token_id)
    moments = RunningMoments() if pc.normalize_reward else None
    exp, stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef, reward_stats=moments)
    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-3},
                             {"params": ac.critic_parameters(), "lr": 1e-3}])
    mb = ppo_update(ac, opt, exp, pc, pc.kl_coef)
    return roll, exp, stats, mb


def test_missing_eos_penalty_lowers_only_unfinished_scores():
    roll, plain, _, _ = _one_step({"normalize_reward": False})  # the raw scores (ppo normalises by default)
    _, penalised, _, _ = _one_step({"missing_eos_penalty": 2.0, "normalize_reward": False})
    assert (~roll.finished).any() and roll.finished.any()
    diff = plain.score - penalised.score  # same seeds -> same rollout
    torch.testing.assert_close(diff, 2.0 * (~roll.finished).float())


def test_reward_normalisation_gives_unit_scale_scores():
    _, exp, _, _ = _one_step({"normalize_reward": True})
    assert abs(exp.score.mean().item()) < 1e-5 and abs(exp.score.std().item() - 1) < 1e-4


@pytest.mark.parametrize("overrides", [{"kl_in_loss": True, "kl_estimator": "k3"}, {"kl_estimator": "k2"},
                                       {"entropy_coef": 0.01}, {"value_clip_range": 0.2}, {"whiten_advantages": False}])
def test_options_run_and_stay_finite(overrides):
    _, exp, stats, mb = _one_step(overrides)
    assert all(torch.isfinite(v).all() for s in mb for v in s.values())
    if overrides.get("kl_in_loss"):
        # the KL moved out of the reward: with actor == ref the reward is just the score
        assert "policy/kl_loss" in mb[0] and mb[0]["policy/kl_loss"].item() < 1e-10


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_experience_in_row_chunks_equals_the_whole_batch(value_model):
    """Big vocabularies run the experience forward in row chunks (``chunk_logits``): same numbers."""
    ac, ref, rm = _setup(value_model)
    pc = Config().ppo
    ids, mask = prompts(12, seed=5)
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id)
    whole, whole_stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    R, V = roll.response_ids.shape[1], ac.policy.get_output_embeddings().out_features
    chunked, chunked_stats = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef,
                                             chunk_logits=5 * R * V)  # chunks of 5 rows: 5 + 5 + 2
    for name in ("old_logprobs", "ref_logprobs", "old_values", "rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), atol=1e-6, rtol=1e-6)
    assert chunked_stats.keys() == whole_stats.keys()
    for k in whole_stats:
        assert chunked_stats[k] == pytest.approx(whole_stats[k], abs=1e-6), k


def test_row_chunks_end_between_groups():
    """Hand-computed chunks: whole groups while they fit, a group longer than a chunk cut alone,
    plain chunks without groups, and a padding difference starts a new group."""
    from rlhfkit.rollout.experience import row_chunks

    grouped = torch.tensor([[1, 2]] * 3 + [[3, 4]] * 3 + [[5, 6]] * 3)  # 3 groups of 3
    ones = torch.ones_like(grouped)
    spans = lambda ids, mask, size: [c.tolist() for c in row_chunks(ids, mask, size)]  # noqa: E731
    assert spans(grouped, ones, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert spans(grouped, ones, 7) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert spans(grouped, ones, 2) == [[0, 1], [2], [3, 4], [5], [6, 7], [8]]
    assert spans(grouped, ones, 9) == [list(range(9))]
    assert spans(torch.arange(10).view(5, 2), torch.ones(5, 2), 2) == [[0, 1], [2, 3], [4]]
    padded = ones.clone()
    padded[1, 0] = 0  # row 1's prompt is padded differently: groups [0], [1], [2], [3-5], [6-8]
    assert spans(grouped, padded, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert spans(grouped, padded, 2) == [[0, 1], [2], [3, 4], [5], [6, 7], [8]]
    assert spans(grouped, padded, 5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_experience_row_chunks_run_each_group_prompt_once(monkeypatch, accel_on):
    """Chunked experience on GRPO groups: each chunk holds whole groups, so the reference forward
    runs as many prompt passes as with the whole batch (chunks of 5 rows over groups of 4 would
    run 5 instead of 3), and gives the whole batch's numbers."""
    from rlhfkit.accel import forward as lean

    ac, ref, rm = _setup("separate")
    pc = Config().ppo
    ids, mask = prompts(3, seed=5)
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # 3 groups of 4
    roll = generate(ac.policy, ids, mask, 8, TOK.eos_token_id, TOK.pad_token_id)
    passes, real = [], lean.response_hidden_states
    monkeypatch.setattr(lean, "response_hidden_states", lambda *a, **k: passes.append(a[5].numel()) or real(*a, **k))
    whole = experience_forwards(ac, ref, roll, pc, reuse=True)
    whole_passes, passes[:] = sum(passes), []
    R, V = roll.response_ids.shape[1], ac.policy.get_output_embeddings().out_features
    chunked = experience_forwards(ac, ref, roll, pc, reuse=True, chunk_logits=5 * R * V)  # at most 5 rows a chunk
    assert whole_passes >= 3 and sum(passes) == whole_passes, (whole_passes, passes)
    for name in ("old_logprobs", "ref_logprobs", "entropy"):
        torch.testing.assert_close(chunked[name], whole[name], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_lr_schedule_sets_both_groups_from_the_step(schedule):
    from rlhfkit.trainers.rl_setup import set_lr

    pc = dataclasses.replace(Config().ppo, steps=8, lr=4e-4, value_lr=2e-3, lr_schedule=schedule)
    w, v = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [w], "lr": 1.0}, {"params": [v], "lr": 1.0}])
    for step, scale in [(0, 1.0), (2, 0.75), (6, 0.25), (7, 0.125)]:
        scale = 1.0 if schedule == "constant" else scale  # linear: 1 - step / steps
        assert set_lr(opt, pc, step) == pytest.approx(4e-4 * scale)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([4e-4 * scale, 2e-3 * scale])


@pytest.mark.parametrize("keep_best", [True, False])
def test_keep_best_saves_the_best_evaluated_policy(keep_best, tiny_models, tiny_config, tmp_path, monkeypatch,
                                                   no_plots):
    """The held-out values are forced (the first call is the evaluation before step 0): the best
    is after step 1, and that step's weights are the ones saved -- the last step's without keep_best."""
    from safetensors.torch import load_file

    import rlhfkit.trainers.rl as rl

    values, seen = [0.95, 0.2, 0.9, 0.5, 0.1], []  # baseline, then after steps 0..3

    def scripted(run, ac, *args):
        seen.append({k: v.detach().clone() for k, v in ac.policy.state_dict().items()})
        return {"eval/exact_acc": values[len(seen) - 1]}

    monkeypatch.setattr(rl, "evaluate", scripted)
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "steps": 4, "eval_every": 1, "keep_best": keep_best, "lr": 1e-2})
    res = rl.train_rl(cfg)
    want = 2 if keep_best else 4  # snapshot after step 1 (the baseline is not a candidate), or after step 3
    assert res["saved_step"] == (1 if keep_best else 3)
    saved = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    assert any(not torch.equal(seen[2][k], seen[4][k]) for k in saved)  # the steps did move the weights
    for k, v in saved.items():
        torch.testing.assert_close(v, seen[want][k], rtol=0, atol=0)


def test_keep_best_holds_only_the_lora_adapter_and_puts_it_back():
    from rlhfkit.models.forward import add_lora
    from rlhfkit.trainers.rl_setup import BestWeights

    policy = add_lora(build_tiny_policy(TOK, 0, n_layer=1, n_head=2, n_embd=16), 4, 8.0)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    best = BestWeights(policy)
    best.offer(0, 0.5)
    assert set(best.weights) == trained and all("lora_" in n for n in trained)  # the frozen base is not copied
    kept = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(1.0)
    best.offer(1, 0.4)  # worse: nothing kept
    best.restore()
    assert best.step == 0 and all(torch.equal(p, kept[n]) for n, p in policy.named_parameters())


def test_grpo_runs_with_dr_grpo_and_sequence_ratios_on_the_tasks_token_limit(tiny_models, tiny_config, tmp_path,
                                                                              monkeypatch):
    """loss_type=dr_grpo divides by the longest completion allowed: with ppo.max_new_tokens unset
    the run passes the task's limit down to the loss (else dr_grpo has no length to divide by) and
    to the over-long penalty."""
    import rlhfkit.trainers.rl as rl
    from rlhfkit.utils import read_jsonl

    seen = []
    original = rl.aggregate

    def spy(per_token, mask, kind="token_mean", max_len=0):
        seen.append((kind, max_len))
        return original(per_token, mask, kind, max_len)

    monkeypatch.setattr(rl, "aggregate", spy)
    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "max_new_tokens": None, "loss_type": "dr_grpo",
                           "importance_sampling_level": "sequence", "overlong_buffer": 2})
    rl.train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["policy/loss"])) for r in rows)
    # the over-long penalty ramps up to the same limit: logged, in [-1, 0]
    assert all(-1.0 <= r["objective/overlong_penalty"] <= 0.0 for r in rows)
    assert seen and set(seen) == {("dr_grpo", doubling.MAX_NEW_TOKENS)}  # the KL term's aggregation


def test_grpo_runs_with_sapo_and_logs_its_gate(tiny_models, tiny_config, tmp_path):
    """loss_type=sapo end to end: the temperatures reach the loss, and the gate's mean (1 on-policy,
    below it once the ratio moves) is logged with the token means of the other policy stats."""
    import rlhfkit.trainers.rl as rl
    from rlhfkit.utils import read_jsonl

    cfg = tiny_config(tmp_path / "run", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"algo": "grpo", "loss_type": "sapo", "sapo_temperature_pos": 2.0, "ppo_epochs": 2})
    rl.train_rl(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    assert all(0.0 < r["policy/sapo_gate"] <= 1.0 for r in rows) and all(r["policy/clipfrac"] == 0.0 for r in rows)
    assert any(r["policy/sapo_gate"] < 1.0 for r in rows)  # the second epoch runs off-policy


def test_overlong_penalty_lands_in_the_scores_after_the_missing_eos_penalty():
    """ppo.overlong_buffer: DAPO's soft over-long penalty is added to each score (lengths 2, 4, 5
    of at most 5, buffer 2: 0, -0.5 * 1.5, -1 * 1.5), after the missing-EOS penalty; off by default."""
    from types import SimpleNamespace

    from rlhfkit.rollout.experience import final_scores
    from rlhfkit.run.distributed import Shard

    raw = torch.tensor([1.0, 2.0, 3.0])
    scorer = SimpleNamespace(score=lambda roll, records: (raw, {}))
    lengths = torch.tensor([2, 4, 5])
    roll = SimpleNamespace(response_mask=(torch.arange(5)[None, :] < lengths[:, None]).long(),
                           finished=torch.tensor([True, True, False]), turn_rewards=None, turn_lengths=None)
    pc = dataclasses.replace(Config().ppo, normalize_reward=False, max_new_tokens=5, missing_eos_penalty=0.25,
                             overlong_buffer=2, overlong_penalty=1.5)
    _, score, _ = final_scores(scorer, roll, pc, None, Shard())
    torch.testing.assert_close(score, torch.tensor([1.0, 2.0 - 0.75, 3.0 - 0.25 - 1.5]))
    _, plain, _ = final_scores(scorer, roll, dataclasses.replace(pc, overlong_buffer=0), None, Shard())
    torch.testing.assert_close(plain, torch.tensor([1.0, 2.0, 2.75]))


def update_inputs(value_model: str, pc):
    """The same rollout's experience every call, and a fresh AdamW: ``(ac, exp, optimizer)``
    for one ``ppo_update``."""
    ac, ref, rm = _setup(value_model)
    ids, mask = prompts(16, seed=6)
    torch.manual_seed(6)
    roll = generate(ac.policy, ids, mask, 6, TOK.eos_token_id, TOK.pad_token_id)
    exp, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef)
    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-2},
                             {"params": ac.critic_parameters(), "lr": 1e-2}])
    return ac, exp, opt


def _update_with_grad_storages(value_model: str, pc, off_heap: bool = False):
    """One ``ppo_update`` from the same rollout; the trained weights after it and, for each
    optimizer step, the set of storages its gradients live in."""
    ac, exp, opt = update_inputs(value_model, pc)
    storages, real_step = [], opt.step

    def step():
        storages.append({p.grad.untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]
                         if p.grad is not None})
        real_step()

    opt.step = step
    ppo_update(ac, opt, exp, pc, pc.kl_coef, generator=torch.Generator().manual_seed(0), off_heap=off_heap)
    return [p.detach().clone() for p in ac.parameters()], storages


@pytest.mark.parametrize("value_model", ["separate", "shared"])
def test_update_with_the_gradient_buffer_moves_the_weights_as_autograds_own_gradients_do(value_model, monkeypatch):
    """``ppo_update`` keeps the CPU gradients in one buffer (``accel.heap.gradient_buffer``); the trained
    weights after a whole update (2 epochs x 2 minibatches x 2 micro-batches) are bit for bit
    those of the same update with autograd's own gradients, and every gradient the optimizer
    steps with lives in that one buffer."""
    import rlhfkit.trainers.rl as rl
    from rlhfkit.accel import heap

    # this tiny model is under the size that takes the buffer: the update's call asks for no floor
    monkeypatch.setattr(rl, "gradient_buffer", functools.partial(heap.gradient_buffer, min_numbers=0))
    pc = Config().replace(ppo={"batch_size": 16, "minibatch_size": 8, "micro_batch_size": 4, "ppo_epochs": 2}).ppo
    weights, storages = _update_with_grad_storages(value_model, pc)
    monkeypatch.setattr(rl, "gradient_buffer", lambda params, enabled=True: contextlib.nullcontext())
    plain, plain_storages = _update_with_grad_storages(value_model, pc)
    assert len(storages) == 4 and all(len(s) == 1 for s in storages)
    assert all(len(s) > 1 for s in plain_storages)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain))


def test_update_off_heap_is_asked_for_and_moves_the_weights_as_the_default_update_does(monkeypatch):
    """``accel.update_off_heap`` turns :func:`rlhfkit.accel.heap.tensors_off_heap` on for the update (off
    by default); where the tensors live does not change the arithmetic: bit for bit the same weights."""
    import rlhfkit.trainers.rl as rl

    asked, real = [], rl.tensors_off_heap

    def recording(enabled=True):
        asked.append(enabled)
        return real(enabled=enabled)

    monkeypatch.setattr(rl, "tensors_off_heap", recording)
    pc = Config().replace(ppo={"batch_size": 16, "minibatch_size": 8, "micro_batch_size": 4, "ppo_epochs": 2}).ppo
    default, _ = _update_with_grad_storages("separate", pc)
    off_heap, _ = _update_with_grad_storages("separate", pc, off_heap=True)
    assert asked == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(default, off_heap))
