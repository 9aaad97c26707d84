"""Generation settings of the RL sampler: top-k, top-p (nucleus), min-p, the repetition penalty
and stop strings.

* top-k = 1 is greedy decoding; top-k draws only among the k most likely tokens of an
  independent forward; top-p only from the smallest nucleus (against a plain-Python nucleus);
* the distribution drawn from with a repetition penalty and min-p is the one transformers' own
  logits processors give, and a rollout records log pi - log q of each drawn token against them;
* the log-probs and entropies reported stay those of the full tempered distribution, so the
  training forward recomputes them (gap <= 1e-5) and the first PPO ratio is 1;
* a stop string ends a row at the token that completes it, the rest masked, the row finished;
* with top-k / top-p / min-p / a repetition penalty the compiled CPU sampler steps aside; a row samples the same tokens
  whichever processes share the batch; the RL loop and its evaluation get the settings.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
import torch

from hf_helpers import bpe_tokenizer
from rlhfkit.accel import kernels
from rlhfkit.config import Config
from rlhfkit.core import entropy_from_logits, logprobs_from_logits
from rlhfkit.models.forward import (
    ValueHead,
    build_tiny,
    build_tiny_policy,
    build_tiny_scalar_model,
    disable_dropout,
    freeze,
    policy_forward,
)
from rlhfkit.rollout.experience import ActorCritic, make_experience
from rlhfkit.rollout.generate import (
    decode_responses,
    generate,
    sampler_logprobs,
    seen_tokens,
    truncate_logprobs,
)
from rlhfkit.rollout.rewards import reward_model_scorer
from rlhfkit.run.distributed import Shard, rollout_uniforms
from rlhfkit.tasks.doubling import make_tokenizer
from rlhfkit.trainers.rl import ppo_update
from test_sampling import FixedLogits

TOK = make_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


def peaked(model, scale: float = 0.5):
    """``model`` with its weights shaken: a random-init GPT-2 predicts almost uniformly, which would
    make every truncation keep nearly the whole vocabulary (entropy ~1.9 nats instead of ~3.7)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def tiny_policy():
    return peaked(disable_dropout(build_tiny_policy(TOK, seed=0, n_layer=1, n_head=2, n_embd=16)))


POLICY = tiny_policy().eval()


def prompts(n: int, tok=TOK) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [f"{('数字', '小写', '大写', '__')[i % 4]}:{1000 + 37 * i}x2=" for i in range(n)]
    texts[0] = "数字:7x2="  # shorter: left padding
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def uniforms(B: int, R: int, seed: int = 0) -> torch.Tensor:
    return torch.rand((B, R), generator=torch.Generator().manual_seed(seed))


def nucleus(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """The kept tokens, computed apart from the library: sort, cut to k, renormalise, add tokens
    (most likely first) until their probability reaches top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        order = order[:top_k]
    z = [math.exp(logits[i] - logits[order[0]]) for i in order]
    kept, mass = set(), 0.0
    for i, w in zip(order, z):
        kept.add(i)
        mass += w / sum(z)
        if mass >= top_p:
            break
    return kept


# --------------------------------------------------------------------------- top-k and top-p


def test_top_k_1_is_greedy():
    ids, mask = prompts(16)
    sampled = generate(POLICY, ids, mask, 8, EOS, PAD, temperature=0.7, top_k=1, uniforms=uniforms(16, 8))
    greedy = generate(POLICY, ids, mask, 8, EOS, PAD, temperature=0.7, greedy=True)
    assert torch.equal(sampled.response_ids, greedy.response_ids)
    assert torch.equal(sampled.response_mask, greedy.response_mask)
    assert torch.equal(sampled.finished, greedy.finished)
    torch.testing.assert_close(sampled.logprobs, greedy.logprobs, atol=1e-6, rtol=1e-6)


def test_top_k_draws_only_among_the_k_most_likely():
    B, R, k = 64, 8, 3
    ids, mask = prompts(B)
    u = uniforms(B, R, seed=1)

    def ranks(roll):  # how many tokens an independent forward finds clearly more likely than the drawn one
        logits, _ = policy_forward(POLICY, roll.input_ids, roll.attention_mask, ids.shape[1])  # [B, R, V]
        drawn = logits.gather(-1, roll.response_ids[..., None])  # [B, R, 1]
        return (logits > drawn + 1e-4).sum(-1)[roll.response_mask.bool()]  # [n valid]

    with torch.no_grad():
        truncated = ranks(generate(POLICY, ids, mask, R, EOS, PAD, temperature=0.8, top_k=k, uniforms=u))
        full = ranks(generate(POLICY, ids, mask, R, EOS, PAD, temperature=0.8, uniforms=u))
    assert truncated.max() < k
    assert (truncated > 0).any()  # not greedy: the second and third are drawn too
    assert (full >= k).any()  # and without top-k the same draws do leave the top k


def test_truncation_keeps_the_top_k_and_the_smallest_nucleus():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((300, 10), generator=gen) * 2.0
    logp = torch.log_softmax(logits, -1)
    for top_k, top_p in [(0, 0.3), (0, 0.5), (0, 0.9), (0, 0.99), (4, 1.0), (4, 0.5), (1, 0.9), (12, 0.8)]:
        out = truncate_logprobs(logp, top_k, top_p)
        kept = out > float("-inf")  # [300, 10]
        for row, keep in zip(logits.double().tolist(), kept.tolist()):
            assert {i for i, b in enumerate(keep) if b} == nucleus(row, top_k, top_p), (top_k, top_p, row)
        assert torch.equal(out[kept], logp[kept])  # the kept tokens' log-probs untouched


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (3, 0.9), (0, 0.55)])
def test_top_p_draws_from_the_renormalised_nucleus(top_k, top_p):
    logits = torch.tensor([3.0, 2.5, -1e9, 2.0, 0.5, 0.0, -1.0, 1.2])
    keep = nucleus(logits.double().tolist(), top_k, top_p)
    z = {i: math.exp(logits[i].item()) for i in keep}
    want = torch.tensor([z.get(i, 0.0) / sum(z.values()) for i in range(len(logits))])
    n = 20000  # an even grid of uniforms: each token's share is its probability to within 1/n
    u = ((torch.arange(n) + 0.5) / n)[:, None]
    ids = torch.zeros((n, 1), dtype=torch.long)
    out = generate(FixedLogits(logits), ids, torch.ones_like(ids), 1, eos_token_id=99, pad_token_id=0, uniforms=u,
                   top_k=top_k, top_p=top_p)
    freq = torch.bincount(out.response_ids[:, 0], minlength=len(logits)).double() / n
    assert set(out.response_ids[:, 0].tolist()) == keep
    torch.testing.assert_close(freq, want.double(), atol=2.0 / n, rtol=0)
    # the reported log-prob is the full distribution's, not the renormalised nucleus's
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1)[out.response_ids[:, 0]])


# --------------------------------------------------------------------------- which log-probs


def _actor_critic():
    policy = tiny_policy().train()
    ref = freeze(copy.deepcopy(policy))
    rm = freeze(peaked(build_tiny_scalar_model(TOK, seed=5, n_layer=1, n_head=2, n_embd=16)))
    return ActorCritic(policy, value_head=ValueHead(16)), ref, rm


@pytest.mark.parametrize("reuse", [False, True], ids=["recomputed", "reused"])
def test_logprobs_are_the_full_tempered_distributions_and_the_first_ratio_is_one(reuse):
    ac, ref, rm = _actor_critic()
    pc = dataclasses.replace(Config().ppo, temperature=0.8, top_k=5, top_p=0.8, batch_size=32, minibatch_size=8)
    ids, mask = prompts(pc.batch_size)
    roll = generate(ac.policy, ids, mask, 8, EOS, PAD, pc.temperature, uniforms=uniforms(32, 8, seed=2),
                    value_head=ac.value_head, top_k=pc.top_k, top_p=pc.top_p)
    with torch.no_grad():
        logits, _ = policy_forward(ac.policy, roll.input_ids, roll.attention_mask, ids.shape[1])
        logits = logits / pc.temperature  # [B, R, V], the training forward's tempered logits
    valid = roll.response_mask.bool()
    recomputed = logprobs_from_logits(logits, roll.response_ids)
    assert (recomputed - roll.logprobs)[valid].abs().max() <= 1e-5
    torch.testing.assert_close(roll.entropy[valid], entropy_from_logits(logits)[valid], atol=1e-5, rtol=1e-5)
    # the truncated distribution's own log-probs would be off by log(kept mass): the choice is visible
    cut = truncate_logprobs(torch.log_softmax(logits, -1).flatten(0, 1), pc.top_k, pc.top_p).view_as(logits)
    renormalised = torch.log_softmax(cut, -1).gather(-1, roll.response_ids[..., None]).squeeze(-1)
    assert (renormalised - roll.logprobs)[valid].abs().max() > 1e-2

    exp, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=pc.kl_coef, reuse_logprobs=reuse)
    opt = torch.optim.AdamW([{"params": ac.policy.parameters(), "lr": 1e-2},
                             {"params": ac.critic_parameters(), "lr": 1e-2}])
    first, *rest = ppo_update(ac, opt, exp, pc, pc.kl_coef, logprob_gap=reuse)
    assert abs(first["policy/ratio_mean"].item() - 1.0) < 1e-6
    # reused: the decode steps' log-probs, equal to the training forward's to float32 rounding
    # (PyTorch's attention over a growing cache against over the whole sequence)
    assert first["policy/approx_kl"].item() < (1e-8 if reuse else 1e-10)
    assert first["policy/clipfrac"].item() == 0.0
    if reuse:
        assert first["policy/logprob_gap"].item() <= 1e-5
    assert max(s["policy/approx_kl"].item() for s in rest) > 1e-6  # the update did move the policy


# --------------------------------------------------------------------------- stop strings


def pick_stops(texts: list[str], n: int, length: int, avoid: str) -> list[str]:
    """``n`` substrings of the texts (from different rows, past their first two characters) that
    hold none of ``avoid``: strings the sampler does produce."""
    rng, stops = random.Random(0), []
    for text in texts:
        starts = [i for i in range(2, len(text) - length) if not set(text[i : i + length]) & set(avoid)]
        if starts:
            start = rng.choice(starts)
            stops.append(text[start : start + length])
        if len(stops) == n:
            return stops
    raise AssertionError(f"no {n} stop strings of {length} characters in {texts}")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-sampler", "pytorch-sampler"])
def test_stop_strings_end_a_row_at_the_token_that_completes_them(compiled, request):
    if compiled and not kernels.available():
        pytest.skip("no C compiler for the compiled sampler")
    request.getfixturevalue("accel_on" if compiled else "accel_off")
    B, R = 32, 12
    ids, mask = prompts(B)
    u = uniforms(B, R, seed=3)
    plain = generate(POLICY, ids, mask, R, EOS, PAD, uniforms=u)
    texts = decode_responses(TOK, plain.response_ids, plain.response_mask)  # one character per token
    stops = pick_stops(texts, 2, 2, avoid="E") + pick_stops(texts[5:], 1, 1, avoid="E")
    roll = generate(POLICY, ids, mask, R, EOS, PAD, uniforms=u, stop=stops, tokenizer=TOK)

    hits, lengths = 0, []
    for i, text in enumerate(texts):
        ends = [text.find(s) + len(s) for s in stops if s in text]
        n = min(ends) if ends else len(text)  # the first place any stop string is complete
        hits += bool(ends)
        lengths.append(n)
        assert roll.response_mask[i].tolist() == [1] * n + [0] * (roll.response_mask.shape[1] - n)
        assert torch.equal(roll.response_ids[i, :n], plain.response_ids[i, :n])
        assert (roll.response_ids[i, n:] == PAD).all() and (roll.logprobs[i, n:] == 0).all()
        torch.testing.assert_close(roll.logprobs[i, :n], plain.logprobs[i, :n], atol=1e-6, rtol=1e-6)
        assert roll.finished[i] == (bool(ends) or bool(plain.finished[i]))
    assert 0 < hits < B  # some rows stopped, some did not
    assert roll.response_ids.shape[1] == max(lengths)  # the loop ended once every row had


def test_stop_strings_across_byte_level_tokens():
    """With a byte-level BPE (tokens of several characters, characters of several tokens) and stop
    strings across tokens, the check on each row's last tokens agrees with decoding the whole
    response."""
    tok = bpe_tokenizer()
    model = peaked(build_tiny("gpt2", tok, seed=0, hidden=16, layers=1, heads=2)).eval()
    B, R = 32, 12
    ids, mask = prompts(B, tok)
    u = uniforms(B, R, seed=4)
    plain = generate(model, ids, mask, R, tok.eos_token_id, tok.pad_token_id, uniforms=u)
    stops = []  # the last character of a token and the first of the next: a stop string across tokens
    for row, n in zip(plain.response_ids.tolist(), plain.response_mask.sum(-1).tolist()):
        pieces = [tok.decode(t) for t in row[2:n]]
        pairs = [a[-1] + b[0] for a, b in zip(pieces, pieces[1:])
                 if a and b and not set(a[-1] + b[0]) & set("\ufffd<>/ ")]
        if pairs and pairs[0] not in stops:
            stops.append(pairs[0])
        if len(stops) == 3:
            break
    roll = generate(model, ids, mask, R, tok.eos_token_id, tok.pad_token_id, uniforms=u, stop=stops, tokenizer=tok)
    stopped = 0
    for row, n, finished in zip(roll.response_ids.tolist(), roll.response_mask.sum(-1).tolist(), roll.finished):
        text, before = (tok.decode(row[:m], skip_special_tokens=False) for m in (n, n - 1))
        if finished and row[n - 1] != tok.eos_token_id:  # ended on a stop string: the last token completed it
            stopped += 1
            assert any(s in text for s in stops) and not any(s in before for s in stops), (stops, text)
        else:
            assert not any(s in text for s in stops), (stops, text)
    assert stopped > 0


def test_stop_strings_need_a_tokenizer_and_text():
    ids, mask = prompts(2)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(POLICY, ids, mask, 4, EOS, PAD, stop=["0"])
    with pytest.raises(ValueError, match="non-empty"):
        generate(POLICY, ids, mask, 4, EOS, PAD, stop=[""], tokenizer=TOK)
    with pytest.raises(ValueError, match="top_p"):
        generate(POLICY, ids, mask, 4, EOS, PAD, top_p=0.0)


# --------------------------------------------------------------------------- paths and processes


def test_top_k_and_top_p_step_the_compiled_sampler_aside(monkeypatch, accel_on):
    made = []

    def spy(*args):
        made.append(args)
        raise AssertionError("the compiled sampler cannot truncate")

    if accel_on.get("sampler") != "c-kernels":
        pytest.skip("no C compiler for the compiled sampler")
    monkeypatch.setattr(kernels, "Sampler", spy)
    ids, mask = prompts(4)
    for settings in ({"top_k": 3}, {"top_p": 0.9}, {"top_k": 3, "top_p": 0.9}, {"min_p": 0.1},
                     {"repetition_penalty": 1.2}):
        generate(POLICY, ids, mask, 4, EOS, PAD, **settings)
    assert made == []
    with pytest.raises(AssertionError, match="cannot truncate"):  # and without them it is what runs
        generate(POLICY, ids, mask, 4, EOS, PAD)
    assert len(made) == 1


def test_a_rows_tokens_do_not_depend_on_the_batch_split():
    B, R = 8, 10
    ids, mask = prompts(B)
    settings = {"temperature": 0.9, "top_k": 4, "top_p": 0.9}
    free = generate(POLICY, ids, mask, R, EOS, PAD, uniforms=rollout_uniforms(3, 7, B, R, slice(0, B)), **settings)
    stops = pick_stops(decode_responses(TOK, free.response_ids, free.response_mask), 2, 1, avoid="E")
    full = generate(POLICY, ids, mask, R, EOS, PAD, uniforms=rollout_uniforms(3, 7, B, R, slice(0, B)), stop=stops,
                    tokenizer=TOK, **settings)
    assert full.response_mask.sum() < free.response_mask.sum()  # the stop strings ended some rows early
    for rank in (0, 1):
        shard = Shard()
        shard.rank, shard.world = rank, 2  # the rows rank 0 / 1 of 2 processes take
        rows = shard.span(B)
        half = generate(POLICY, ids[rows], mask[rows], R, EOS, PAD, uniforms=rollout_uniforms(3, 7, B, R, rows),
                        stop=stops, tokenizer=TOK, **settings)
        width = half.response_ids.shape[1]
        assert torch.equal(half.response_ids, full.response_ids[rows, :width])
        assert torch.equal(half.finished, full.finished[rows])
        assert (full.response_mask[rows, width:] == 0).all()


def test_the_rl_loop_and_its_evaluation_use_the_settings(tiny_config, tiny_models, tmp_path, monkeypatch, no_plots):
    import rlhfkit.rollout.evaluate
    import rlhfkit.trainers.rl
    from rlhfkit.trainers.rl import train_rl

    calls = {"rollout": [], "eval": []}

    def spy(where, real):
        def run(*args, **kwargs):
            calls[where].append(kwargs)
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(rlhfkit.trainers.rl, "generate", spy("rollout", rlhfkit.trainers.rl.generate))
    monkeypatch.setattr(rlhfkit.rollout.evaluate, "generate", spy("eval", rlhfkit.rollout.evaluate.generate))
    cfg = tiny_config(tmp_path / "ppo", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                      ppo={"top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3, "stop": ["0", "〇"],
                           "max_new_tokens": 6})
    train_rl(cfg)
    assert calls["rollout"] and calls["eval"]
    for kw in calls["rollout"]:
        assert (kw["top_k"], kw["top_p"], kw["min_p"], kw["repetition_penalty"], kw["stop"],
                kw["tokenizer"] is not None) == (5, 0.9, 0.05, 1.3, ("0", "〇"), True)
    for kw in calls["eval"]:
        assert kw["greedy"] and kw["stop"] == ("0", "〇") and kw["tokenizer"] is not None


# --------------------------------------------------------------------------- min-p, repetition penalty


def transformers_draw(logits: torch.Tensor, context: torch.Tensor, temperature: float, penalty: float, top_k: int,
                      top_p: float, min_p: float) -> torch.Tensor:
    """The probabilities ``[B, V]`` transformers' ``generate(do_sample=True)`` draws from, after its
    logits processors in its own order: the repetition penalty over ``context [B, T]`` (the ids
    already in each row), then the temperature, top-k, top-p and min-p warpers."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)]
                                + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
                                + ([MinPLogitsWarper(min_p)] if min_p else []))
    return torch.softmax(chain(context, logits.clone()), -1)


@pytest.mark.parametrize("temperature, penalty, top_k, top_p, min_p",
                         [(1.0, 1.3, 0, 1.0, 0.0), (0.7, 1.0, 0, 1.0, 0.1), (0.8, 1.5, 0, 1.0, 0.05),
                          (1.2, 0.8, 20, 0.9, 0.02), (1.0, 2.0, 0, 1.0, 1.0)])
def test_the_shaped_draw_is_transformers_logits_processors(temperature, penalty, top_k, top_p, min_p):
    """On the same logits and context, the distribution rlhfkit draws from equals the one
    transformers' RepetitionPenaltyLogitsProcessor and MinPLogitsWarper (with the temperature,
    top-k and top-p warpers) leave: the same kept tokens, the same probabilities."""
    gen = torch.Generator().manual_seed(0)
    B, V, T = 6, 50, 12
    logits = 3 * torch.randn(B, V, generator=gen)  # [B, V], positive and negative logits
    context = torch.randint(0, V, (B, T), generator=gen)  # [B, T], with repeats
    logp = torch.log_softmax(logits / temperature, -1)  # the policy's own tempered distribution
    ours = torch.softmax(sampler_logprobs(logits, logp, temperature, seen_tokens(context, torch.ones_like(context), V),
                                          penalty, top_k, top_p, min_p), -1)
    theirs = transformers_draw(logits, context, temperature, penalty, top_k, top_p, min_p)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert (theirs > 0).sum() < B * V or penalty != 1.0  # each case shapes the draw


def test_left_padding_is_not_a_repeat():
    ids, mask = prompts(3)
    seen = seen_tokens(ids, mask, len(TOK))  # [B, V]
    for row in range(3):
        assert set(seen[row].nonzero().flatten().tolist()) == set(ids[row][mask[row].bool()].tolist())
    assert not seen[0, PAD]  # row 0 is left-padded, and its prompt holds no padding token


def test_a_rollout_draws_from_the_shaped_distribution_and_records_pi_over_q():
    """generate with a repetition penalty and min-p, checked token by token against an independent
    forward through transformers' processors (the context: the row's prompt and its response so
    far): every drawn token is in the processors' support, the log-probs are the policy's own
    tempered ones (pi, which the training forward recomputes) and kept_logmass is log pi - log q."""
    T, penalty, min_p = 0.8, 1.4, 0.05
    B, R = 16, 8
    ids, mask = prompts(B)
    roll = generate(POLICY, ids, mask, R, EOS, PAD, T, uniforms=uniforms(B, R, seed=5), repetition_penalty=penalty,
                    min_p=min_p)
    with torch.no_grad():
        logits, _ = policy_forward(POLICY, roll.input_ids, roll.attention_mask, ids.shape[1])  # [B, R, V]
    pi = torch.log_softmax(logits / T, -1).gather(-1, roll.response_ids[..., None]).squeeze(-1)  # [B, R]
    valid = roll.response_mask.bool()
    assert (pi - roll.logprobs)[valid].abs().max() <= 1e-5
    repeats = 0
    for i in range(B):
        prompt = ids[i][mask[i].bool()]
        for t in range(int(valid[i].sum())):
            context = torch.cat([prompt, roll.response_ids[i, :t]])[None]  # [1, P_i + t]
            q = transformers_draw(logits[i, t][None], context, T, penalty, 0, 1.0, min_p)[0]  # [V]
            tok = int(roll.response_ids[i, t])
            assert q[tok] > 0, (i, t)
            assert float(roll.kept_logmass[i, t]) == pytest.approx(float(pi[i, t] - q[tok].log()), abs=1e-4)
            repeats += tok in context
    assert repeats > 0  # the penalty was at work on some drawn tokens
    assert (roll.kept_logmass[valid] != 0).any()
