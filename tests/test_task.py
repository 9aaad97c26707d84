"""Tests for rlhfkit.tasks.doubling: tokenizer, data generators, held-out set, verifier."""

from __future__ import annotations

from collections import Counter

import pytest

from rlhfkit.tasks.doubling import (
    CHARSETS,
    EOS,
    PREFIX,
    SET_NAMES,
    VOCAB,
    DoublingData,
    Prompt,
    eval_prompts,
    make_tokenizer,
    render,
    verify,
)

PREFIX_TO_SET = {v: k for k, v in PREFIX.items()}
DRAWS = 3000


def charset_of(answer: str) -> set[str]:
    """The names of the character sets that the characters of ``answer`` come from."""
    return {s for ch in answer for s, chars in CHARSETS.items() if ch in chars}


def as_digits(answer: str) -> str:
    """Map every character back to its ASCII digit: '六六四〇' -> '6640'."""
    return "".join(str(chars.index(ch)) for ch in answer for chars in CHARSETS.values() if ch in chars)


def parse_prompt(text: str) -> Prompt:
    """Inverse of Prompt.text: '数字:3320x2=' -> Prompt(3320, 'digits')."""
    prefix, rest = text.split(":")
    assert rest.endswith("x2=")
    return Prompt(int(rest[: -len("x2=")]), PREFIX_TO_SET[prefix])


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_adds_bos():
    tok = make_tokenizer()
    text = "数字:1234x2="
    ids = tok(text)["input_ids"]
    # S + 10 characters, one id each; BOS comes from the tokenizer, not the text.
    assert len(ids) == 1 + len(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "S" + text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_special_token_ids():
    tok = make_tokenizer()
    # VOCAB = [P, S, E, ...]: pad 0, bos 1, eos 2.
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["P", "S", "E"]) == [0, 1, 2]
    assert len(tok) == len(VOCAB)


def test_one_token_per_character():
    tok = make_tokenizer()
    for i, ch in enumerate(VOCAB):
        assert tok(ch, add_special_tokens=False)["input_ids"] == [i], ch
    whole = "".join(VOCAB)
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    assert ids == list(range(len(VOCAB)))
    assert tok.decode(ids) == whole  # Fuse decoder: no spaces between characters


def test_left_padding_by_default_and_right_on_request():
    tok = make_tokenizer()
    long, short = "数字:1234x2=", "__:99x2="  # 1 + 10 and 1 + 8 tokens: short gets 2 pads
    assert tok.padding_side == "left"
    batch = tok([long, short], padding=True)
    assert batch["input_ids"][1] == [0, 0] + tok(short)["input_ids"]
    assert batch["attention_mask"][1] == [0, 0] + [1] * 9
    assert batch["attention_mask"][0] == [1] * 11
    right = tok([long, short], padding=True, padding_side="right")
    assert right["input_ids"][1] == tok(short)["input_ids"] + [0, 0]
    assert right["attention_mask"][1] == [1] * 9 + [0, 0]


# --------------------------------------------------------------------------- held-out set


def test_eval_prompts_fixed_and_balanced():
    a, b = eval_prompts(), eval_prompts()
    assert len(a) == 512
    assert a == b
    assert len({p.number for p in a}) == 512  # distinct operands
    counts = Counter(p.charset for p in a)
    # 512 = 3 * 170 + 2 -> 171, 171, 170
    assert set(counts) == set(SET_NAMES)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(1000 <= p.number <= 9999 for p in a)


@pytest.mark.parametrize("seed", [0, 1])
def test_eval_numbers_never_in_training_data(seed):
    held_out = {p.number for p in eval_prompts()}
    data = DoublingData(seed)
    pre = {int(t.split(":")[1].split("x")[0]) for t in data.pretrain_texts(DRAWS)}
    rl = {p.number for p in data.prompts(DRAWS)}
    pairs = {parse_prompt(p).number for p, _, _ in data.preference_pairs(DRAWS)}
    # ~3000 draws from 8488 training operands cover a good share of them, yet none is held out.
    assert len(pre) > 2000 and len(rl) > 2000
    assert not (pre | rl | pairs) & held_out


# --------------------------------------------------------------------------- generators


def test_pretrain_texts_neutral_prefix_and_consistent_answer():
    texts = DoublingData(3).pretrain_texts(500)
    seen = Counter()
    for t in texts:
        # '__:3320x2=陆陆肆零E'
        assert t.startswith("__:") and t.endswith(EOS) and "x2=" in t
        number = int(t[3 : t.index("x")])
        answer = t[t.index("=") + 1 : -1]
        sets = charset_of(answer)
        assert len(sets) == 1, t  # one character set per answer
        (s,) = sets
        assert answer == render(2 * number, s)
        assert as_digits(answer) == str(2 * number)
        seen[s] += 1
    assert set(seen) == set(SET_NAMES)  # the set is random, not fixed


def test_preference_pairs_chosen_passes_rejected_fails():
    for hard in (0.0, 0.5, 1.0):
        for prompt_text, chosen, rejected in DoublingData(4).preference_pairs(300, hard=hard):
            p = parse_prompt(prompt_text)  # one prompt shared by chosen and rejected
            assert p.text == prompt_text
            assert verify(p, chosen) == {"format": True, "exact": True, "answer": True}
            assert not verify(p, rejected)["format"]
            assert rejected != chosen
            # the rejected answer is the same number, only the format is wrong
            assert as_digits(rejected.removesuffix(EOS)) == str(2 * p.number)
            if hard == 0.0:  # only whole other-set answers: right number, wrong set
                assert verify(p, rejected)["answer"]


def test_preference_pairs_seeded():
    assert DoublingData(5).preference_pairs(20) == DoublingData(5).preference_pairs(20)
    assert DoublingData(5).preference_pairs(20) != DoublingData(6).preference_pairs(20)


def test_seeded_draws_are_pinned():
    # the demo's numbers follow from these draws: a generator rewritten must draw the same sequence
    data = DoublingData(0)
    assert [p.text for p in data.prompts(3)] == ["小写:7697x2=", "小写:1690x2=", "小写:9884x2="]
    assert data.labelled_texts(2) == [("__:8040x2=一六〇八〇E", 1), ("__:9278x2=一八五五六E", 1)]
    assert data.preference_pairs(2) == [("大写:4772x2=", "玖伍肆肆E", "玖伍肆肆"), ("小写:3401x2=", "六八〇二E", "6802E")]
    assert data.sft_examples(2) == [("数字:6389x2=", "12778"), ("大写:2266x2=", "肆伍叁贰")]
    assert DoublingData(1).pretrain_texts(2) == ["__:3318x2=陆陆叁陆E", "__:2080x2=四一六〇E"]


# --------------------------------------------------------------------------- verifier


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        # 2 * 1234 = 2468
        (Prompt(1234, "digits"), "2468E", (True, True, True)),
        (Prompt(1234, "digits"), "二四六八E", (False, False, True)),  # right number, wrong set
        (Prompt(1234, "digits"), "24六八E", (False, False, False)),  # mixed sets
        (Prompt(1234, "digits"), "2468", (False, False, False)),  # no EOS
        (Prompt(1234, "digits"), "2469E", (True, False, False)),  # right set, wrong digit
        (Prompt(1234, "digits"), "E", (False, False, False)),  # empty answer
        (Prompt(1234, "digits"), "2468E数P", (True, True, True)),  # after EOS is ignored
        # 2 * 4999 = 9998; 2 * 5000 = 10000 (five characters)
        (Prompt(4999, "lower"), "九九九八E", (True, True, True)),
        (Prompt(5000, "upper"), "壹零零零零E", (True, True, True)),
        (Prompt(5000, "upper"), "一〇〇〇〇E", (False, False, True)),
    ],
)
def test_verify_hand_made(prompt, completion, expected):
    got = verify(prompt, completion)
    assert (got["format"], got["exact"], got["answer"]) == expected
