"""Records checked and turned into examples by TRL's dataset conventions (docs/data.md):
preference pairs, demonstrations and RL prompts, conversational fields rendered with the
tokenizer's chat template. A field set to ``null`` counts as missing."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .records import DataError, _kind, _records

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


# the "tokenizer" of precheck: conversational records rendered as plain ``role: content`` lines, so
# every record's fields and messages are checked; the chat template's own rendering is left to the load
UNRENDERED = object()


@dataclass(frozen=True)
class PreferenceExample:
    """One comparison, as text ready to tokenize (chat template already applied)."""

    prompt: str  # the context both responses continue
    chosen: str  # the preferred response
    rejected: str  # the dispreferred response
    margin: float | None = None  # how much better chosen is, when the data says so
    origin: str = field(default="", compare=False)  # "path:LINE" / "dataset[i]", for errors


@dataclass(frozen=True)
class SFTExample:
    """One demonstration; the loss covers ``completion`` only (all of it when prompt is ""),
    and the answers of ``turns``."""

    prompt: str  # context, not trained on ("" for the ``text`` format)
    completion: str  # what the model learns to produce
    origin: str = field(default="", compare=False)  # "path:LINE" / "dataset[i]", for errors
    # the later assistant turns of a conversation, after ``completion``: (context, answer) texts,
    # the context (the user's turn, the template's text around it) not trained, the answer trained
    turns: tuple[tuple[str, str], ...] = ()

    def pieces(self) -> list[tuple[str, bool]]:
        """What follows the prompt, in order, as ``(text, trained)``."""
        out = [(self.completion, True)]
        for context, answer in self.turns:
            out += [(context, False), (answer, True)]
        return out


@dataclass(frozen=True)
class PromptExample:
    """One prompt for RL generation."""

    prompt: str  # the text to generate from (chat template applied, generation prompt added)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # the record's other fields
    origin: str = field(default="", compare=False)  # "path:LINE" / "dataset[i]", for errors
    raw: Any = field(default=None, compare=False)  # the prompt as given: a string or messages


def _get(rec: dict, key: str, where: str, expected: str):
    value = rec.get(key)
    if value is None:
        raise DataError(f"{where}: field {key!r}: missing; expected {expected}")
    return value


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r}: expected a string or a list of messages, got {_kind(value)}")
    if not value.strip():
        raise DataError(f"{where}: field {key!r}: expected a non-empty string, got {value!r}")
    return value


def _is_chat(value) -> bool:
    return isinstance(value, list)


def _messages(value, where: str, key: str) -> list[dict]:
    """Checked copy of a message list, ``None``-valued keys dropped (arrow fills them in)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {key!r}: expected a non-empty list of messages, got {_kind(value)}")
    out = []
    for j, msg in enumerate(value):
        at = f"{where}: field {key!r}, message {j}"
        if not isinstance(msg, dict):
            raise DataError(f"{at}: expected a dict with 'role' and 'content', got {_kind(msg)}")
        msg = {k: v for k, v in msg.items() if v is not None}
        for part in ("role", "content"):
            if part not in msg:
                raise DataError(f"{at}: missing {part!r}; a message is {{'role': ..., 'content': ...}}")
        if msg["role"] not in ROLES:
            raise DataError(f"{at}: unknown role {msg['role']!r}; expected one of {sorted(ROLES)}")
        if not isinstance(msg["content"], str) or not msg["content"].strip():
            raise DataError(f"{at}: 'content' must be a non-empty string, got {_kind(msg['content'])}")
        out.append(msg)
    return out


def _answer(value, where: str, key: str) -> list[dict]:
    """Messages that form a response: assistant turns only."""
    msgs = _messages(value, where, key)
    for j, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            raise DataError(f"{where}: field {key!r}, message {j}: a response holds assistant turns only, got role {msg['role']!r}")
    return msgs


class _Renderer:
    """Applies a tokenizer's chat template and splits completions off rendered prompts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _apply(self, messages, generation: bool, where: str, key: str) -> str:
        tok = self.tokenizer
        if tok is UNRENDERED:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if tok is None:
            raise DataError(f"{where}: field {key!r} is conversational (a list of messages) but no tokenizer was given; "
                            "pass tokenizer=... (one with a chat template) to render it")
        if not getattr(tok, "chat_template", None):
            raise DataError(f"{where}: field {key!r} is conversational (a list of messages) but the tokenizer has no "
                            "chat_template; set one (tokenizer.chat_template = '<jinja template>'), use an instruct "
                            "model's tokenizer, or give plain-string fields")
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # template code is the user's: report it against the record
            raise DataError(f"{where}: field {key!r}: the chat template failed on these messages: {e}") from e

    def prompt(self, messages, where: str, key: str = "prompt") -> str:
        return self._apply(messages, True, where, key)

    def answer(self, prompt_msgs, prompt_text: str, answer_msgs, where: str, key: str) -> str:
        """:meth:`completion` through its end-of-turn token (the tokenizer's EOS as the template
        writes it, when it does): what the template writes after it is the next turn's context."""
        text = self.completion(prompt_msgs, prompt_text, answer_msgs, where, key)
        eos = getattr(self.tokenizer, "eos_token", None)
        return text[: text.rindex(eos) + len(eos)] if eos and eos in text else text

    def conversation(self, msgs: list[dict], answers: list[int], where: str,
                     key: str = "messages") -> tuple[str, str, tuple[tuple[str, str], ...]]:
        """``(prompt, completion, turns)`` of an :class:`SFTExample` training the assistant
        messages at indices ``answers`` of ``msgs``: each answer cut from the rendering of the
        conversation up to it, the text between two answers their context."""
        texts, done = [], ""
        for j in answers:
            prompt = self.prompt(msgs[:j], where, key)
            if not prompt.startswith(done):
                raise DataError(f"{where}: field {key!r}: the chat template renders the turns before message {j} differently "
                                "from how it rendered them before the previous assistant turn (it rewrites earlier turns), so "
                                "each assistant turn cannot be cut out of one sequence; train the last turn only with "
                                "sft.assistant_turns=last")
            answer = self.answer(msgs[:j], prompt, msgs[j : j + 1], where, key)
            texts += [prompt[len(done) :], answer]
            done = prompt + answer
        return texts[0], texts[1], tuple(zip(texts[2::2], texts[3::2]))

    def completion(self, prompt_msgs, prompt_text: str, answer_msgs, where: str, key: str) -> str:
        full = self._apply(prompt_msgs + answer_msgs, False, where, key)
        if not full.startswith(prompt_text):
            # Templates that rewrite earlier turns (strip reasoning, stamp a date) do this; the
            # completion cannot be cut off cleanly, and guessing would train on wrong tokens.
            raise DataError(f"{where}: field {key!r}: the chat template does not render the prompt (with generation "
                            "prompt) as a prefix of prompt + answer, so the completion cannot be split off; "
                            f"prompt ends {prompt_text[-30:]!r}, full text has {full[max(0, len(prompt_text) - 30) : len(prompt_text)]!r}")
        completion = full[len(prompt_text) :]
        if not completion.strip():
            raise DataError(f"{where}: field {key!r}: the response renders to an empty string")
        return completion


def _margin(rec: dict, where: str) -> float | None:
    value = rec.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError(f"{where}: field 'margin': expected a finite number, got {_kind(value)}")
    return float(value)


def _chat_responses(render: _Renderer, cut, prompt, responses: dict, where: str) -> tuple[str, list[str]]:
    """A conversational ``prompt`` rendered, and each of ``responses`` (field -> assistant messages)
    cut from prompt + response by ``cut`` (:meth:`_Renderer.completion` or :meth:`_Renderer.answer`)."""
    for key, value in responses.items():
        if not _is_chat(value):
            raise DataError(f"{where}: field {key!r}: 'prompt' is a list of messages, so expected a list of "
                            f"assistant messages, got {_kind(value)}")
    pm = _messages(prompt, where, "prompt")
    text = render.prompt(pm, where)
    return text, [cut(pm, text, _answer(value, where, key), where, key) for key, value in responses.items()]


def _implicit_prompt(chosen, rejected, where: str) -> tuple[list, list, list]:
    """``(prompt, chosen, rejected)`` messages of two whole conversations: the prompt is the leading
    messages they share."""
    cm, rm = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    k = next((i for i, (a, b) in enumerate(zip(cm, rm)) if a != b), min(len(cm), len(rm)))
    if k == 0:
        raise DataError(f"{where}: field 'prompt': missing, and 'chosen'/'rejected' share no leading messages "
                        "to take as an implicit prompt; add a 'prompt' field")
    for key, msgs in (("chosen", cm[k:]), ("rejected", rm[k:])):
        if not msgs:
            raise DataError(f"{where}: field {key!r}: no messages after the prompt shared with the other response "
                            "(one conversation is a prefix of the other)")
    return cm[:k], cm[k:], rm[k:]


def _preference(rec: dict, where: str, render: _Renderer) -> PreferenceExample:
    chosen = _get(rec, "chosen", where, "a string or a list of messages")
    rejected = _get(rec, "rejected", where, "a string or a list of messages")
    prompt = rec.get("prompt")
    if prompt is None and _is_chat(chosen) and _is_chat(rejected):
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
    if prompt is None:
        raise DataError(f"{where}: field 'prompt': missing; expected a string or a list of messages")
    if _is_chat(prompt):
        prompt_text, (chosen_text, rejected_text) = _chat_responses(
            render, render.completion, prompt, {"chosen": chosen, "rejected": rejected}, where)
    else:
        prompt_text = _text(prompt, where, "prompt")
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if _is_chat(value):
                raise DataError(f"{where}: field {key!r}: 'prompt' is a string, so expected a string, got a list")
        chosen_text, rejected_text = _text(chosen, where, "chosen"), _text(rejected, where, "rejected")
    if chosen_text == rejected_text:  # no preference signal, no gradient: nearly always a column copied twice
        raise DataError(f"{where}: field 'rejected': identical to 'chosen'; such a pair carries no preference "
                        "signal (zero gradient) and is usually a data bug")
    return PreferenceExample(prompt_text, chosen_text, rejected_text, _margin(rec, where), where)


def load_preferences(source, tokenizer=None, split: str | None = None) -> list[PreferenceExample]:
    """Preference pairs: ``prompt`` + ``chosen`` + ``rejected`` strings; or a ``prompt`` of messages
    and lists of assistant messages; or two whole conversations whose shared leading messages are
    the prompt. Optional ``margin`` (a number) on every record or on none. ``tokenizer`` renders
    conversational records. DataError on the first bad record or a pair with chosen == rejected."""
    render = _Renderer(tokenizer)
    out = [_preference(rec, where, render) for where, rec in _records(source, split=split)]
    with_margin = [ex.margin is not None for ex in out]
    if any(with_margin) and not all(with_margin):
        ex = out[with_margin.index(not with_margin[0])]
        raise DataError(f"{ex.origin}: field 'margin': given on some records but not this one; give it on every "
                        "record or on none")
    return out


def _conversation(msgs: list[dict], where: str, render: _Renderer, turns: str) -> SFTExample:
    last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        raise DataError(f"{where}: field 'messages': no assistant turn to learn from")
    if last != len(msgs) - 1:
        raise DataError(f"{where}: field 'messages': must end with an assistant turn (the completion), "
                        f"ends with role {msgs[-1]['role']!r}")
    if last == 0:
        raise DataError(f"{where}: field 'messages': no prompt turn before the assistant turn")
    answers = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0] if turns == "all" else [last]
    prompt_text, completion, later = render.conversation(msgs, answers, where)
    return SFTExample(prompt_text, completion, where, later)


def _demonstration(rec: dict, where: str, render: _Renderer, turns: str) -> SFTExample:
    if rec.get("messages") is not None:  # first: ultrachat's records carry 'prompt' too
        return _conversation(_messages(rec["messages"], where, "messages"), where, render, turns)
    if rec.get("prompt") is not None or rec.get("completion") is not None:
        prompt = _get(rec, "prompt", where, "a string or a list of messages")
        completion = _get(rec, "completion", where, "a string or a list of messages")
        if _is_chat(prompt):
            prompt_text, (text,) = _chat_responses(render, render.answer, prompt, {"completion": completion}, where)
            return SFTExample(prompt_text, text, where)
        return SFTExample(_text(prompt, where, "prompt"), _text(completion, where, "completion"), where)
    if rec.get("text") is not None:
        return SFTExample("", _text(rec["text"], where, "text"), where)
    raise DataError(f"{where}: field 'messages': missing; expected 'messages', 'prompt' + 'completion', or 'text' "
                    f"(record has {sorted(rec)})")


def load_sft(source, tokenizer=None, split: str | None = None, turns: str = "all") -> list[SFTExample]:
    """Demonstrations: ``messages`` (a conversation ending with an assistant turn; ``turns='all'``
    trains every assistant turn but one that opens it, as TRL's ``assistant_only_loss``, ``'last'``
    the last), ``prompt`` + ``completion`` (strings or messages), or ``text`` (no prompt: all of it
    trained), checked in that order. DataError on the first bad record."""
    if turns not in ("all", "last"):
        raise ValueError(f"turns must be 'all' or 'last', got {turns!r}")
    render = _Renderer(tokenizer)
    return [_demonstration(rec, where, render, turns) for where, rec in _records(source, split=split)]


def load_prompts(source, tokenizer=None, split: str | None = None) -> list[PromptExample]:
    """RL prompts: records with ``prompt`` (a string or messages); the other fields go to
    ``PromptExample.meta``, each a keyword argument of the reward functions. A field missing (or
    null) in some records but not others is an error: a reward function would meet None mid-run."""
    render, out = _Renderer(tokenizer), []
    records = _records(source, split=split)
    columns = {k for _, rec in records for k, v in rec.items() if v is not None} - {"prompt"}
    for where, rec in records:
        prompt = _get(rec, "prompt", where, "a string or a list of messages")
        text = render.prompt(_messages(prompt, where, "prompt"), where) if _is_chat(prompt) \
            else _text(prompt, where, "prompt")
        missing = sorted(k for k in columns if rec.get(k) is None)
        if missing:
            raise DataError(f"{where}: field {missing[0]!r}: missing here but present in other records; every "
                            "record needs the same fields (reward functions receive each field as a column)")
        out.append(PromptExample(text, {k: rec[k] for k in sorted(columns)}, where, prompt))
    return out


PRECHECK_BYTES = 64 * 2**20  # larger files are read once, by the trainer


def precheck(kind: str, source) -> list | None:
    """A local file's or in-memory records checked as ``kind`` (``'prompts'``, ``'pairs'``, ``'sft'``)
    without a tokenizer, hence before torch loads: fields, roles, contents (the chat template and
    lengths wait for the full load). The examples, unrendered; None where the source is left to
    the full load (Parquet, directories, hub ids, files over ``PRECHECK_BYTES``)."""
    if isinstance(source, (str, os.PathLike)) and (not os.path.isfile(source) or os.fspath(source).endswith(
            ".parquet") or os.path.getsize(source) > PRECHECK_BYTES):
        return None
    loader = {"prompts": load_prompts, "pairs": load_preferences, "sft": load_sft}[kind]
    return loader(source, UNRENDERED)
