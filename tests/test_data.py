"""Tests for rlhfkit.data: every format from JSONL and from a datasets.Dataset, chat
templates, malformed records (with where/field in the message), truncation and packing."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hf_helpers import CHAT_TEMPLATE, chat_tokenizer
from rlhfkit.config import Config
from rlhfkit.data import (
    DataError,
    PreferenceExample,
    SFTExample,
    encode_preferences,
    encode_sft,
    load_preferences,
    load_prompts,
    load_records,
    load_sft,
    pack_sft,
)
from rlhfkit.trainers.sft import load_demonstrations

# Assistant turns end with EOS inside the template, user/system turns with a newline.
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tok(template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level, no merges: one token per byte of ASCII text, so lengths are countable.
    Adds BOS itself (like Llama); EOS is '</s>'."""
    vocab = {
        t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())])
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = template
    return fast


TOK = make_tok()
BOS, EOS, PAD = 1, 2, 0


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path, records: list) -> str:
    """Records as JSONL; a str record is written as the raw line (for bad JSON)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture(params=["jsonl", "dataset"])
def as_source(request, tmp_path):
    """Turns a list of records into the parametrized kind of source."""
    if request.param == "jsonl":
        return lambda records: write_jsonl(tmp_path / "data.jsonl", records)
    return Dataset.from_list


def decode(ids: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    keep = ids if mask is None else ids[mask.bool()]
    return TOK.decode(keep.tolist())


# --------------------------------------------------------------------------- formats


def test_load_records_skips_blank_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2}\n')
    assert load_records(path) == [{"a": 1}, {"a": 2}]
    assert load_records([{"a": 3}]) == [{"a": 3}]


def test_preferences_text(as_source):
    recs = [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 1.5, "id": 7}]
    assert load_preferences(as_source(recs)) == [PreferenceExample("2+2=", "4", "5", 1.5)]


def test_preferences_chat(as_source):
    recs = [{"prompt": [user("hi")], "chosen": [bot("hello")], "rejected": [bot("go away")]}]
    (ex,) = load_preferences(as_source(recs), TOK)
    assert (ex.prompt, ex.chosen, ex.rejected, ex.margin) == (
        "<|user|>hi\n<|assistant|>",
        "hello</s>",
        "go away</s>",
        None,
    )


def test_preferences_implicit_prompt(as_source):
    # Two turns shared (system, user, assistant, user), then the answers differ.
    shared = [{"role": "system", "content": "be brief"}, user("hi"), bot("hey"), user("2+2?")]
    recs = [{"chosen": [*shared, bot("4")], "rejected": [*shared, bot("5")]}]
    (ex,) = load_preferences(as_source(recs), TOK)
    assert ex.prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>hey</s><|user|>2+2?\n<|assistant|>"
    assert (ex.chosen, ex.rejected) == ("4</s>", "5</s>")


SFT_FORMATS = {
    "messages": ({"messages": [user("hi"), bot("yo"), user("bye"), bot("ciao")]},
                 SFTExample("<|user|>hi\n<|assistant|>", "yo</s>", turns=(("<|user|>bye\n<|assistant|>", "ciao</s>"),))),
    "prompt_completion_text": ({"prompt": "Q: 1+1\nA:", "completion": " 2"}, SFTExample("Q: 1+1\nA:", " 2")),
    "prompt_completion_chat": ({"prompt": [user("hi")], "completion": [bot("yo")]},
                               SFTExample("<|user|>hi\n<|assistant|>", "yo</s>")),
    "text": ({"text": "just text"}, SFTExample("", "just text")),
}  # fmt: skip


@pytest.mark.parametrize("fmt", SFT_FORMATS)
def test_sft_formats(as_source, fmt):
    rec, example = SFT_FORMATS[fmt]
    assert load_sft(as_source([rec]), TOK) == [example]
    if fmt == "messages":  # the last assistant turn alone, the earlier ones prompt
        want = SFTExample("<|user|>hi\n<|assistant|>yo</s><|user|>bye\n<|assistant|>", "ciao</s>")
        assert load_sft(as_source([rec]), TOK, turns="last") == [want]


def test_prompts(as_source):
    recs = [{"prompt": [user("double 12")], "answer": "24"}, {"prompt": [user("double 3")], "answer": "6"}]
    exs = load_prompts(as_source(recs), TOK)
    assert [e.prompt for e in exs] == ["<|user|>double 12\n<|assistant|>", "<|user|>double 3\n<|assistant|>"]
    assert [e.meta for e in exs] == [{"answer": "24"}, {"answer": "6"}]
    assert load_prompts([{"prompt": "plain"}])[0].prompt == "plain"  # strings: no template


def test_chat_needs_a_template():
    recs = [{"prompt": [user("hi")]}]
    with pytest.raises(
        DataError, match=r"list\[0\]: field 'prompt'.*no chat_template; set one \(tokenizer.chat_template"
    ):
        load_prompts(recs, make_tok(template=None))
    with pytest.raises(DataError, match="no tokenizer was given"):
        load_prompts(recs)


def test_template_that_rewrites_the_prompt_is_refused():
    # Renders the turn count first, so the prompt is not a prefix of prompt + answer.
    tok = make_tok("{{ messages | length }}" + TEMPLATE)
    with pytest.raises(DataError, match="field 'completion'.*not render the prompt"):
        load_sft([{"prompt": [user("hi")], "completion": [bot("yo")]}], tok)


# --------------------------------------------------------------------------- malformed records

GOOD = {"prompt": "p", "chosen": "a", "rejected": "b"}
SFT_GOOD = {"prompt": "p", "completion": "c"}


def pref(path):
    return load_preferences(path, TOK)


def sft(path, **kw):
    return encode_sft(load_sft(path, TOK), TOK, **kw)


# (loader, bad record on line 3 after a good line 1 and a blank line 2, substrings of the message)
MALFORMED = {
    "bad_json": (pref, '{"prompt": "p", "chosen": ', ["not valid JSON"]),
    "not_an_object": (pref, "[1, 2]", ["expected a JSON object"]),
    "missing_chosen": (pref, {"prompt": "p", "rejected": "b"}, ["field 'chosen'", "missing"]),
    "chosen_int": (pref, {**GOOD, "chosen": 5}, ["field 'chosen'", "got int 5"]),
    "empty_prompt": (pref, {**GOOD, "prompt": "  "}, ["field 'prompt'", "non-empty string"]),
    "message_no_role": (pref, {**GOOD, "prompt": [{"content": "hi"}], "chosen": [bot("a")], "rejected": [bot("b")]},
                        ["field 'prompt', message 0", "missing 'role'"]),
    "unknown_role": (pref, {**GOOD, "prompt": [{"role": "robot", "content": "hi"}], "chosen": [bot("a")],
                            "rejected": [bot("b")]}, ["field 'prompt'", "unknown role 'robot'"]),
    "chosen_equals_rejected": (pref, {**GOOD, "rejected": "a"}, ["field 'rejected'", "identical to 'chosen'"]),
    "margin_on_some": (pref, GOOD, ["field 'margin'", "some records"]),  # line 1 has one
    "no_assistant_turn": (sft, {"messages": [user("hi"), user("again")]}, ["field 'messages'", "no assistant turn"]),
    "prompt_too_long": (lambda p: sft(p, max_length=12, truncation="error"), {**SFT_GOOD, "prompt": "x" * 20},
                        ["field 'prompt'", "truncation='error'", "max_length=12"]),
    "response_too_long": (lambda p: sft(p, max_length=12), {**SFT_GOOD, "completion": "y" * 11},
                          ["field 'completion'", "12 tokens (EOS included) plus BOS", "never truncated"]),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_record_names_file_line_and_field(tmp_path, case):
    loader, bad, expected = MALFORMED[case]
    good = SFT_GOOD if loader is not pref else {**GOOD, "margin": 1.0} if case == "margin_on_some" else GOOD
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad])
    with pytest.raises(DataError) as err:
        loader(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:3: "), msg  # the blank line 2 still counts
    for part in expected:
        assert part in msg, msg


def test_dataset_null_is_missing():
    # from_list fills the absent 'rejected' of record 1 with None: reported as missing, 0-based.
    ds = Dataset.from_list([GOOD, {"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=r"^dataset\[1\]: field 'rejected': missing"):
        load_preferences(ds)
    # Same for a message key: arrow gives the role-less message role=None, still "missing".
    ds = Dataset.from_list([{"prompt": [user("hi")]}, {"prompt": [{"content": "hi"}]}])
    with pytest.raises(DataError, match=r"^dataset\[1\]: field 'prompt', message 0: missing 'role'"):
        load_prompts(ds, TOK)


# --------------------------------------------------------------------------- tokenisation


def test_encode_sft_loss_mask_is_exactly_the_completion():
    exs = [SFTExample("ab", "xyz"), SFTExample("", "text"), SFTExample("q", "r</s>")]
    enc = encode_sft(exs, TOK, max_length=16)
    ids, att, loss = enc["input_ids"], enc["attention_mask"], enc["loss_mask"]
    assert ids.shape == (3, 7)  # padded to the longest row, not to max_length
    assert ids[0].tolist() == [BOS, *TOK.convert_tokens_to_ids(list("abxyz")), EOS]
    assert loss[0].tolist() == [0, 0, 0, 1, 1, 1, 1]  # xyz + EOS
    assert decode(ids[1], loss[1]) == "text</s>" and loss[1, 0] == 0  # text: all but BOS
    # completion already ends with EOS (chat templates do that): not doubled
    assert ids[2].tolist() == [BOS, *TOK.convert_tokens_to_ids(["q", "r"]), EOS, PAD, PAD, PAD]
    assert att[2].tolist() == [1, 1, 1, 1, 0, 0, 0] and loss[2].tolist() == [0, 0, 1, 1, 0, 0, 0]


# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json has it: a default system
# turn, and a newline after each turn's <|im_end|>
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_every_assistant_turn_of_a_conversation_is_trained_through_its_end_of_turn(tmp_path):
    tok = chat_tokenizer()  # one token per character, <|im_start|> and <|im_end|> one token each; EOS <|im_end|>
    tok.chat_template = SMOLLM2_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, user("Hi"), bot("Yo!"), user("2+2?"), bot("4")]
    enc = encode_sft(load_sft([{"messages": msgs}], tok), tok, max_length=100)
    ids, loss = enc["input_ids"][0], enc["loss_mask"][0]
    # the template's own rendering, tokenized at once, is the row (less the newline after the last <|im_end|>)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert ids.tolist() == tok(full.removesuffix("\n"))["input_ids"] and enc["attention_mask"].all()
    # <|im_start|> system \n S <|im_end|> \n = 1+6+1+1+1+1 = 11; <|im_start|> user \n Hi <|im_end|> \n = 1+4+1+2+1+1 = 10;
    # <|im_start|> assistant \n = 1+9+1 = 11: 32 prompt tokens. Yo! <|im_end|> = 3+1 = 4 trained.
    # \n <|im_start|> user \n 2+2? <|im_end|> \n <|im_start|> assistant \n = 1+1+4+1+4+1+1+1+9+1 = 24 context;
    # 4 <|im_end|> = 2 trained: 62 tokens
    assert loss.tolist() == [0] * 32 + [1] * 4 + [0] * 24 + [1] * 2
    assert tok.decode(ids[32:36]) == "Yo!<|im_end|>" and tok.decode(ids[60:62]) == "4<|im_end|>"
    answers = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    assert tok.decode(ids[loss.bool()]) == "".join(answers)  # the assistant contents and nothing else
    last = encode_sft(load_sft([{"messages": msgs}], tok, turns="last"), tok, max_length=100)
    assert last["input_ids"][0].tolist() == ids.tolist() and last["loss_mask"][0].tolist() == [0] * 60 + [1] * 2
    for turns, later in (("all", 1), ("last", 0)):  # sft.assistant_turns reaches the trainer's loader
        cfg = Config().replace(sft={"assistant_turns": turns})
        (ex,), _ = load_demonstrations(cfg, tok, write_jsonl(tmp_path / "sft.jsonl", [{"messages": msgs}]))
        assert len(ex.turns) == later
    # a conversation opened by the assistant: that turn answers nothing and stays context
    opened = encode_sft(load_sft([{"messages": [bot("Hello"), *msgs[1:3]]}], tok), tok, max_length=100)
    assert tok.decode(opened["input_ids"][0][opened["loss_mask"][0].bool()]) == "Yo!<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_trains_the_last_turn_only():
    tok = chat_tokenizer()  # this template marks every assistant turn but the last as old
    tok.chat_template = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] }}"
                                              "{% if m['role'] == 'assistant' and not loop.last %} (old){% endif %}")
    rec = {"messages": [user("Hi"), bot("Yo"), user("Bye"), bot("Ciao")]}
    with pytest.raises(DataError, match=r"^list\[0\]: field 'messages': the chat template renders the turns before "
                                        r"message 3 differently .* sft.assistant_turns=last$"):
        load_sft([rec], tok)
    (ex,) = load_sft([rec], tok, turns="last")
    assert ex.completion == "Ciao<|im_end|>" and ex.prompt.endswith("Yo (old)<|im_end|>\n<|im_start|>user\nBye"
                                                                    "<|im_end|>\n<|im_start|>assistant\n")


def test_truncation_left_keeps_response_and_prompt_end():
    ex = SFTExample("0123456789", "abc")
    enc = encode_sft([ex], TOK, max_length=8)  # BOS + prompt 10 + response 4 = 15 -> 7 prompt tokens cut
    ids, loss = enc["input_ids"][0], enc["loss_mask"][0]
    assert ids[0] == BOS and decode(ids) == "<s>789abc</s>"
    assert decode(ids, loss) == "abc</s>"
    assert (
        decode(encode_sft([ex], TOK, max_length=15, truncation="error")["input_ids"][0])
        == "<s>0123456789abc</s>"
    )
    with pytest.raises(DataError, match="example 0: field 'prompt'"):  # no origin: the index
        encode_sft([ex], TOK, max_length=14, truncation="error")
    with pytest.raises(ValueError, match="truncation"):
        encode_sft([ex], TOK, max_length=8, truncation="right")


def test_encode_preferences_shares_the_prompt_cut():
    # chosen 'a'+EOS (2 tokens), rejected 'bbbb'+EOS (5): the cut is sized for the rejected one.
    ex = PreferenceExample("0123456789", "a", "bbbb", margin=0.5)
    enc = encode_preferences([ex, ex], TOK, max_length=9)
    assert decode(enc["rejected_input_ids"][0]) == "<s>789bbbb</s>"
    c_ids, c_att = enc["chosen_input_ids"][0], enc["chosen_attention_mask"][0]
    assert decode(c_ids, c_att) == "<s>789a</s>" and c_ids.shape == (9,)  # one width for both
    assert decode(c_ids, enc["chosen_loss_mask"][0]) == "a</s>"
    assert decode(enc["rejected_input_ids"][0], enc["rejected_loss_mask"][0]) == "bbbb</s>"
    assert enc["margin"].tolist() == [0.5, 0.5]
    assert "margin" not in encode_preferences([PreferenceExample("p", "a", "b")], TOK, max_length=9)


def test_pack_sft_restarts_positions_and_masks_boundaries():
    enc = encode_sft(
        [SFTExample("ab", "xyz"), SFTExample("c", "d"), SFTExample("efghij", "k")], TOK, max_length=16
    )
    packed = pack_sft(enc, max_length=12, pad_token_id=PAD)  # lengths 7, 4, 9: rows [7+4], [9]
    assert packed["input_ids"].shape == (2, 12)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0]
    assert packed["attention_mask"][0].tolist() == [1] * 11 + [0]
    assert decode(packed["input_ids"][0], packed["attention_mask"][0]) == "<s>abxyz</s><s>cd</s>"
    assert decode(packed["input_ids"][0], packed["loss_mask"][0]) == "xyz</s>d</s>"
    assert packed["loss_mask"].sum() == enc["loss_mask"].sum()
    # Without BOS the first token of an example is a target in its own row; packed, it is not.
    bare = {"input_ids": torch.tensor([[5, 6], [7, 8]]), "attention_mask": torch.ones(2, 2, dtype=torch.long)}
    bare["loss_mask"] = torch.ones(2, 2, dtype=torch.long)
    assert pack_sft(bare, max_length=4)["loss_mask"].tolist() == [[0, 1, 0, 1]]
    with pytest.raises(ValueError, match="longer than the packed row length"):
        pack_sft(enc, max_length=8)


def test_characters_the_tokenizer_cannot_encode_are_named_with_the_record():
    from rlhfkit.data import PromptExample, encode_prompts
    from rlhfkit.tasks import doubling

    tok = doubling.make_tokenizer()  # one token per character, no unknown token
    sft = [SFTExample("数字:1234x2=", "2468", "sft.jsonl:1"), SFTExample("hello 数字:12x2=", "24", "sft.jsonl:2")]
    with pytest.raises(DataError) as err:
        encode_sft(sft, tok, 32)
    assert str(err.value).startswith("sft.jsonl:2: field 'prompt': characters the tokenizer cannot encode: "
                                     "'h', 'e', 'l', 'o', ' '; ")
    pairs = [PreferenceExample("数字:12x2=", "24", "2四", origin="p.jsonl:1"),
             PreferenceExample("数字:12x2=", "24", "二four", origin="p.jsonl:2")]
    with pytest.raises(DataError, match=r"^p\.jsonl:2: field 'rejected': characters the tokenizer cannot encode: "
                                        r"'f', 'o', 'u', 'r';"):
        encode_preferences(pairs, tok, 32)
    many = [PromptExample("abcdefghijklmn")]  # no origin: its index; more than ten characters: a count
    with pytest.raises(DataError, match=r"^example 0: field 'prompt': .*'j' \(and 4 more\);"):
        encode_prompts(many, tok, 32)
