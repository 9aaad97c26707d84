"""Loading training data in the formats users already have (TRL's dataset conventions).

Sources: a JSONL file path (one JSON object a line, blank lines skipped), a list of dicts,
or a ``datasets.Dataset`` / ``IterableDataset`` (pick a split first). Errors locate a record
as ``path:LINE`` (1-based, like a compiler), ``list[i]`` or ``dataset[i]`` (0-based, the
index you would type to look at it).

Types: JSON values keep their JSON types (``"12"`` a string, ``12`` an int); a CSV cell is
always a string, whatever the column holds (CSV has no types, and guessing them from the
content would make ``answer`` an int in one file and a string in the next); Parquet and
``datasets`` columns keep their declared types.

Formats, by loader (other fields are ignored; a field set to ``null`` counts as missing,
because a ``datasets.Dataset`` fills absent columns with ``None``):

    load_preferences  ``prompt`` + ``chosen`` + ``rejected``, all strings; or ``prompt`` a
                      list of messages and ``chosen``/``rejected`` lists of assistant
                      messages; or no ``prompt`` and ``chosen``/``rejected`` two whole
                      conversations: the leading messages they share are the prompt
                      (implicit prompt). Optional ``margin`` (a number), on every record
                      or on none.
    load_sft          ``messages`` (a conversation ending with an assistant turn: every
                      assistant turn is trained, as TRL's ``assistant_only_loss``, or the
                      last alone with ``turns='last'``; everything else is context); or
                      ``prompt`` + ``completion`` (strings, or messages); or ``text`` (no
                      prompt: the loss covers the whole sequence). Checked in that order,
                      so a record with both ``messages`` and ``prompt`` (ultrachat's
                      layout) is read as ``messages``.
    load_prompts      ``prompt`` (a string or messages); the other fields are kept in
                      ``PromptExample.meta`` for reward functions (ground truth and such).

A message is ``{"role": ..., "content": <non-empty string>}`` with role one of ``ROLES``.
Conversational records are rendered to text with the tokenizer's chat template: the prompt
with ``add_generation_prompt=True``, the completion as the rendering of prompt + answer
minus the rendered prompt (which must be a prefix of it). An SFT answer ends with its
end-of-turn token (the tokenizer's EOS where the template writes it, e.g. ``<|im_end|>``):
what the template writes after it, a newline before the next turn, is context, not answer.
A conversation with several trained assistant turns is cut the same way at each of them,
which needs a template that renders each earlier turn unchanged as the conversation grows.
Plain strings are used as they are, with no template. Empty (or whitespace-only) prompts and
responses are errors.

A pair whose chosen and rejected texts are equal is an error, not a warning: the two
sequences get the same score, so the pair gives no gradient to a Bradley-Terry or DPO loss
yet counts in the batch mean and as a miss in the accuracy, and it is nearly always a data
bug (a column copied twice) that should be seen rather than trained on.

Tokenisation (``encode_sft``, ``encode_preferences``) tokenizes the prompt and the
completion separately and concatenates them, so the prompt/completion boundary is exact;
EOS is appended to each completion unless it already ends with it. Responses are never
truncated: when prompt + response exceeds ``max_length``, ``truncation='left'`` drops tokens
from the start of the prompt (BOS is kept), ``'error'`` raises; a response that leaves no
room for even one prompt token always raises. A text the tokenizer cannot encode (a character
outside a vocabulary that has no unknown token, as in the built-in tasks' character
tokenizers) raises ``DataError`` naming the record, the field and the characters.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are built, not here: the CLI reads and checks a data file before
# it imports torch (seconds), so a bad record is answered at once

__all__ = [
    "ROLES",
    "DataError",
    "PreferenceExample",
    "SFTExample",
    "PromptExample",
    "load_records",
    "load_preferences",
    "load_sft",
    "load_prompts",
    "encode_prompts",
    "encode_sft",
    "encode_preferences",
    "encode_triples",
    "Limit",
    "context_limit",
    "hold_out",
    "stack_pairs",
    "pack_sft",
    "unencodable_characters",
    "describe_characters",
]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class DataError(ValueError):
    """A malformed source or record; the message says where (``path:LINE``), which field,
    and what was expected."""


# the "tokenizer" of precheck: conversational records rendered as plain ``role: content`` lines, so
# every record's fields and messages are checked; the chat template's own rendering is left to the load
UNRENDERED = object()


class Limit(NamedTuple):
    """A length limit and how an error names it: ``tokens``; ``name`` as in "exceeds NAME"; ``fix``,
    what to change to allow more. An ``int`` limit is a config key's (:func:`_as_limit`)."""

    tokens: int
    name: str
    fix: str


def _as_limit(limit: int | Limit, key: str) -> Limit:
    return limit if isinstance(limit, Limit) else Limit(limit, f"{key}={limit}", f"raise {key}")


def context_limit(key: str, configured: int, context: int | None, reserve: int = 0,
                  reserve_key: str = "") -> int | Limit:
    """The limit that ``key`` (``configured`` tokens) has in effect with a model that reads
    ``context`` tokens at most, ``reserve`` of them kept for ``reserve_key`` (the new tokens
    of RL rollouts): ``configured`` when it fits (or ``context`` is None: no limit), else the
    smaller :class:`Limit`, named for errors. Raises ValueError when the context cannot hold
    ``reserve`` tokens and one more."""
    if context is None:
        return configured
    room = context - reserve
    if room < 1:
        raise ValueError(f"{reserve_key}={reserve} leaves no room for a prompt in the model's context of {context} "
                         f"tokens (its config's max_position_embeddings / n_positions): lower {reserve_key} below "
                         f"{context}")
    if room >= configured:
        return configured
    if reserve:
        return Limit(room, f"the {room} tokens that the model's context of {context} leaves after "
                           f"{reserve_key}={reserve} (below {key}={configured})", f"lower {reserve_key}")
    return Limit(room, f"the model's context of {context} tokens (below {key}={configured})",
                 "use a model with a longer context")


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


# --------------------------------------------------------------------------- records


_DATASET_FILES = (".json", ".parquet", ".csv")


def _jsonl_records(path: str) -> list[tuple[str, Any]]:
    out = []
    try:
        f = open(path, "rb")  # bytes, decoded line by line, so a bad byte is reported at its line
    except OSError as e:
        raise DataError(f"{path}: cannot read this data file ({e.strerror or e}); check the path "
                        "(data.path) points to a JSONL file") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line); "
                                "re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                out.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                                "each line must be one JSON object") from None
    return out


def _json_records(path: str) -> list[tuple[str, Any]]:
    """A ``.json`` file: one JSON array of records, or JSON lines (as ``datasets`` reads both)."""
    try:
        text = open(path, encoding="utf-8-sig").read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read this JSON file ({e}); check the path and that it is UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if not text.lstrip().startswith("["):
            return _jsonl_records(path)  # JSON lines under a .json name
        # an array: the error is where Python's parser found it in the document, not at line 1
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); a .json file holds one "
                        "JSON array of records (or one JSON object a line)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records (or one JSON object a line), got "
                        f"{type(data).__name__}")
    return [(f"{path}[{i}]", rec) for i, rec in enumerate(data)]


def _csv_records(path: str) -> list[tuple[str, Any]]:
    """A ``.csv`` file with a header row: every cell is read as the string it is, never converted
    by its content (``007`` stays ``"007"``; a column of digits is not turned into int), so a
    reward function compares the same values whatever the other rows hold; an empty cell is a
    missing value (``None``), as ``datasets`` reads it. Records are located as ``path:LINE``."""
    import csv

    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise DataError(f"{path}: cannot read this CSV file ({e.strerror or e}); check the path (data.path)") from None
    out: list[tuple[str, Any]] = []
    with f:
        reader = csv.reader(f)
        try:
            header, start = None, 1
            for row in reader:
                where, start = f"{path}:{start}", reader.line_num + 1  # a quoted cell may span lines
                if not row:  # a blank line
                    continue
                if header is None:
                    header = row
                    dup = sorted({c for c in header if header.count(c) > 1})
                    if dup:
                        raise DataError(f"{where}: the header names column {dup[0]!r} twice; rename one")
                    continue
                if len(row) > len(header):
                    raise DataError(f"{where}: {len(row)} cells but the header (line 1) names {len(header)} "
                                    "columns; quote cells that contain commas")
                out.append((where, {c: (v if v != "" else None) for c, v in zip(header, row + [""] * len(header))}))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{reader.line_num + 1}: not UTF-8 text (byte {e.start + 1}); re-encode the file "
                            "as UTF-8") from None
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    return out


def _open_dataset(path: str, split: str | None):
    """A Parquet file, a ``Dataset.save_to_disk`` directory, or a hub dataset id
    (``datasets.load_dataset``) as a ``datasets.Dataset``; ``split`` picks one of several."""
    import datasets

    try:
        if os.path.isdir(path):
            if not any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
                raise DataError(f"{path}: cannot read this directory as data: it is not a directory written by "
                                "Dataset.save_to_disk; point data.path at a JSONL/JSON/Parquet/CSV file or such a "
                                "directory")
            ds = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            ds = datasets.load_dataset("parquet", data_files=path, split="train")
        elif os.path.sep in path and not path.count("/") == 1:
            raise DataError(f"{path}: no such file or directory; check the path (data.path)")
        else:  # a hub id such as 'trl-lib/tldr'
            ds = datasets.load_dataset(path, split=split or "train")
    except DataError:
        raise
    except Exception as e:  # datasets' own errors are many and long: one line that names the source
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: cannot load it as a dataset ({type(e).__name__}: {first}); data.path takes a "
                        "JSONL/JSON/Parquet/CSV file, a save_to_disk directory or a hub dataset id") from None
    if isinstance(ds, datasets.DatasetDict):
        want = split or ("train" if "train" in ds else None)
        if want not in ds:
            raise DataError(f"{path}: holds splits {sorted(ds)}; choose one with data.split")
        ds = ds[want]
    return ds


def _located_records(source, split: str | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """``(source name, [(location, record), ...])``; records are not checked here."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".jsonl") or (os.path.isfile(path) and not path.endswith(_DATASET_FILES)):
            return path, _jsonl_records(path)
        if path.endswith(".json") and os.path.isfile(path):
            return path, _json_records(path)
        if path.endswith(".csv") and os.path.isfile(path):
            return path, _csv_records(path)
        return path, [(f"{path}[{i}]", rec) for i, rec in enumerate(_open_dataset(path, split))]
    ds = sys.modules.get("datasets")  # only a caller who imported datasets can hand us a Dataset
    if ds is not None and isinstance(source, ds.DatasetDict | ds.IterableDatasetDict):
        raise DataError(f"got a DatasetDict with splits {list(source)}: pass one split, e.g. source['train']")
    if ds is not None and isinstance(source, ds.Dataset | ds.IterableDataset):
        return "dataset", [(f"dataset[{i}]", rec) for i, rec in enumerate(source)]
    if isinstance(source, Sequence) and not isinstance(source, bytes):
        return "list", [(f"list[{i}]", rec) for i, rec in enumerate(source)]
    raise TypeError(
        f"source must be a JSONL path, a list of dicts or a datasets.Dataset, got {type(source).__name__}"
    )


def _records(source, allow_empty: bool = False, split: str | None = None) -> list[tuple[str, dict]]:
    name, located = _located_records(source, split)
    if not located and not allow_empty:  # an empty training set is a wrong path or a bad export
        raise DataError(f"{name}: no records (empty or blank); check the path or the export that wrote it")
    for where, rec in located:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object (a dict of fields), got {_kind(rec)}")
    return located


PRECHECK_BYTES = 64 * 2**20  # larger files are read once, by the trainer


def precheck(kind: str, source) -> list | None:
    """Read and check a local data file's records, or in-memory records (a list of dicts, a
    ``datasets.Dataset``), as ``kind`` (``'prompts'``, ``'pairs'`` or ``'sft'``) without a
    tokenizer, hence without torch: every record's fields and messages (roles, contents); what only
    the chat template can check (its rendering) and the token lengths are left to the full load.
    Returns the examples, their texts unrendered (None: the source is left to the full load:
    Parquet, directories, hub ids and files over ``PRECHECK_BYTES``)."""
    if isinstance(source, (str, os.PathLike)) and (not os.path.isfile(source) or os.fspath(source).endswith(
            ".parquet") or os.path.getsize(source) > PRECHECK_BYTES):
        return None
    loader = {"prompts": load_prompts, "pairs": load_preferences, "sft": load_sft}[kind]
    return loader(source, UNRENDERED)


def load_records(source) -> list[dict]:
    """The raw records of ``source`` (JSONL path, list of dicts, or ``datasets.Dataset``).

    Blank JSONL lines are skipped; a line that is not valid JSON, or not a JSON object,
    raises ``DataError`` naming the file and the line.
    """
    return [rec for _, rec in _records(source, allow_empty=True)]


def write_jsonl(source, path: str | os.PathLike) -> str:
    """Write ``source``'s records (a list of dicts or a ``datasets.Dataset``) to the JSONL file
    ``path``, so a run given in-memory data reads, and records, a file; returns the path."""
    lines = []
    for where, rec in _records(source):
        try:
            lines.append(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: cannot be written as JSON ({e}); give its fields as strings, numbers, "
                            "booleans, None, lists or dicts") from None
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # each process of a launch writes its own, then renames
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- field checks


def _kind(value) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _get(rec: dict, key: str, where: str, expected: str):
    value = rec.get(key)
    if value is None:
        raise DataError(f"{where}: field {key!r}: missing; expected {expected}")
    return value


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {key!r}: expected a string or a list of messages, got {_kind(value)}"
        )
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
            raise DataError(
                f"{where}: field {key!r}, message {j}: a response holds assistant turns only, got role {msg['role']!r}"
            )
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
            raise DataError(
                f"{where}: field {key!r} is conversational (a list of messages) but no tokenizer was given; "
                "pass tokenizer=... (one with a chat template) to render it"
            )
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{where}: field {key!r} is conversational (a list of messages) but the tokenizer has no "
                "chat_template; set one (tokenizer.chat_template = '<jinja template>'), use an instruct "
                "model's tokenizer, or give plain-string fields"
            )
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except Exception as e:  # template code is the user's: report it against the record
            raise DataError(f"{where}: field {key!r}: the chat template failed on these messages: {e}") from e
        return text

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
                raise DataError(
                    f"{where}: field {key!r}: the chat template renders the turns before message {j} differently "
                    "from how it rendered them before the previous assistant turn (it rewrites earlier turns), so "
                    "each assistant turn cannot be cut out of one sequence; train the last turn only with "
                    "sft.assistant_turns=last"
                )
            answer = self.answer(msgs[:j], prompt, msgs[j : j + 1], where, key)
            texts += [prompt[len(done) :], answer]
            done = prompt + answer
        return texts[0], texts[1], tuple(zip(texts[2::2], texts[3::2]))

    def completion(self, prompt_msgs, prompt_text: str, answer_msgs, where: str, key: str) -> str:
        full = self._apply(prompt_msgs + answer_msgs, False, where, key)
        if not full.startswith(prompt_text):
            # Templates that rewrite earlier turns (strip reasoning, stamp a date) do this; the
            # completion cannot be cut off cleanly, and guessing would train on wrong tokens.
            raise DataError(
                f"{where}: field {key!r}: the chat template does not render the prompt (with generation "
                "prompt) as a prefix of prompt + answer, so the completion cannot be split off; "
                f"prompt ends {prompt_text[-30:]!r}, full text has {full[max(0, len(prompt_text) - 30) : len(prompt_text)]!r}"
            )
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


# --------------------------------------------------------------------------- loaders


def load_preferences(source, tokenizer=None, split: str | None = None) -> list[PreferenceExample]:
    """Preference pairs from ``source``; see the module docstring for the accepted formats.

    ``tokenizer`` is needed only for conversational records (its chat template renders them).
    Raises ``DataError`` on the first malformed record, on a pair with chosen == rejected,
    and when ``margin`` is given on some records but not others.
    """
    render = _Renderer(tokenizer)
    out = []
    for where, rec in _records(source, split=split):
        chosen = _get(rec, "chosen", where, "a string or a list of messages")
        rejected = _get(rec, "rejected", where, "a string or a list of messages")
        prompt = rec.get("prompt")
        if prompt is None and _is_chat(chosen) and _is_chat(rejected):
            cm, rm = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
            k = 0
            while k < min(len(cm), len(rm)) and cm[k] == rm[k]:
                k += 1
            if k == 0:
                raise DataError(
                    f"{where}: field 'prompt': missing, and 'chosen'/'rejected' share no leading messages "
                    "to take as an implicit prompt; add a 'prompt' field"
                )
            prompt, chosen, rejected = cm[:k], cm[k:], rm[k:]
            for key, msgs in (("chosen", chosen), ("rejected", rejected)):
                if not msgs:
                    raise DataError(
                        f"{where}: field {key!r}: no messages after the prompt shared with the other response "
                        "(one conversation is a prefix of the other)"
                    )
        if prompt is None:
            raise DataError(f"{where}: field 'prompt': missing; expected a string or a list of messages")
        if _is_chat(prompt):
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                if not _is_chat(value):
                    raise DataError(
                        f"{where}: field {key!r}: 'prompt' is a list of messages, so expected a list of "
                        f"assistant messages, got {_kind(value)}"
                    )
            pm = _messages(prompt, where, "prompt")
            prompt_text = render.prompt(pm, where)
            chosen_text = render.completion(
                pm, prompt_text, _answer(chosen, where, "chosen"), where, "chosen"
            )
            rejected_text = render.completion(
                pm, prompt_text, _answer(rejected, where, "rejected"), where, "rejected"
            )
        else:
            prompt_text = _text(prompt, where, "prompt")
            for key, value in (("chosen", chosen), ("rejected", rejected)):
                if _is_chat(value):
                    raise DataError(
                        f"{where}: field {key!r}: 'prompt' is a string, so expected a string, got a list"
                    )
            chosen_text, rejected_text = _text(chosen, where, "chosen"), _text(rejected, where, "rejected")
        if chosen_text == rejected_text:
            raise DataError(
                f"{where}: field 'rejected': identical to 'chosen'; such a pair carries no preference signal "
                "(zero gradient) and is usually a data bug"
            )
        out.append(PreferenceExample(prompt_text, chosen_text, rejected_text, _margin(rec, where), where))
    with_margin = [ex.margin is not None for ex in out]
    if any(with_margin) and not all(with_margin):
        ex = out[with_margin.index(not with_margin[0])]
        raise DataError(
            f"{ex.origin}: field 'margin': given on some records but not this one; give it on every "
            "record or on none"
        )
    return out


def load_sft(source, tokenizer=None, split: str | None = None, turns: str = "all") -> list[SFTExample]:
    """Demonstrations from ``source`` (``messages``, ``prompt`` + ``completion``, or ``text``).

    ``tokenizer`` is needed only for conversational records. ``turns``: which assistant turns
    of a ``messages`` conversation are trained, ``'all'`` (every one but one that opens the
    conversation, which answers nothing) or ``'last'``. Raises ``DataError`` on the first
    malformed record.
    """
    if turns not in ("all", "last"):
        raise ValueError(f"turns must be 'all' or 'last', got {turns!r}")
    render = _Renderer(tokenizer)
    out = []
    for where, rec in _records(source, split=split):
        if rec.get("messages") is not None:
            msgs = _messages(rec["messages"], where, "messages")
            last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
            if last is None:
                raise DataError(f"{where}: field 'messages': no assistant turn to learn from")
            if last != len(msgs) - 1:
                raise DataError(
                    f"{where}: field 'messages': must end with an assistant turn (the completion), "
                    f"ends with role {msgs[-1]['role']!r}"
                )
            if last == 0:
                raise DataError(f"{where}: field 'messages': no prompt turn before the assistant turn")
            answers = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and j > 0] if turns == "all" \
                else [last]
            prompt_text, completion, later = render.conversation(msgs, answers, where)
            out.append(SFTExample(prompt_text, completion, where, later))
        elif rec.get("prompt") is not None or rec.get("completion") is not None:
            prompt = _get(rec, "prompt", where, "a string or a list of messages")
            completion = _get(rec, "completion", where, "a string or a list of messages")
            if _is_chat(prompt):
                if not _is_chat(completion):
                    raise DataError(
                        f"{where}: field 'completion': 'prompt' is a list of messages, so expected a list "
                        f"of assistant messages, got {_kind(completion)}"
                    )
                pm = _messages(prompt, where, "prompt")
                prompt_text = render.prompt(pm, where)
                completion_text = render.answer(
                    pm, prompt_text, _answer(completion, where, "completion"), where, "completion"
                )
                out.append(SFTExample(prompt_text, completion_text, where))
            else:
                out.append(
                    SFTExample(_text(prompt, where, "prompt"), _text(completion, where, "completion"), where)
                )
        elif rec.get("text") is not None:
            out.append(SFTExample("", _text(rec["text"], where, "text"), where))
        else:
            raise DataError(
                f"{where}: field 'messages': missing; expected 'messages', 'prompt' + 'completion', or 'text' "
                f"(record has {sorted(rec)})"
            )
    return out


def load_prompts(source, tokenizer=None, split: str | None = None) -> list[PromptExample]:
    """RL prompts from ``source``: records with ``prompt`` (a string or messages).

    The record's other fields go to ``PromptExample.meta``; reward functions receive each as a
    keyword argument (a list aligned with the completions). A field present in some records
    but missing (or null) in others is an error naming the first such record: a reward
    function would otherwise meet ``None`` mid-run.
    """
    render = _Renderer(tokenizer)
    out = []
    records = _records(source, split=split)
    columns = {k for _, rec in records for k, v in rec.items() if v is not None} - {"prompt"}
    for where, rec in records:
        prompt = _get(rec, "prompt", where, "a string or a list of messages")
        text = (
            render.prompt(_messages(prompt, where, "prompt"), where)
            if _is_chat(prompt)
            else _text(prompt, where, "prompt")
        )
        missing = sorted(k for k in columns if rec.get(k) is None)
        if missing:
            raise DataError(f"{where}: field {missing[0]!r}: missing here but present in other records; every "
                            "record needs the same fields (reward functions receive each field as a column)")
        out.append(PromptExample(text, {k: rec[k] for k in sorted(columns)}, where, prompt))
    return out


def encode_prompts(examples: Sequence[PromptExample], tokenizer, max_length: int | Limit,
                   truncation: str = "left") -> tuple[list[list[int]], int]:
    """Token ids of each prompt (BOS as the tokenizer adds it, or as the chat template wrote
    it) and how many were cut. A prompt longer than ``max_length`` tokens loses tokens from
    its start, BOS kept (``truncation='left'``), or raises ``DataError`` naming the record
    (``'error'``). ``max_length``: ``data.max_prompt_length``, or a :class:`Limit` that names
    another source (the model's context: :func:`context_limit`)."""
    if truncation not in ("left", "error"):
        raise ValueError(f"truncation must be 'left' or 'error', got {truncation!r}")
    limit = _as_limit(max_length, "data.max_prompt_length")
    max_length = limit.tokens
    out, cut = [], 0
    pieces = _Codec(tokenizer).prompts([e.prompt for e in examples], _wheres(examples))
    for i, (ex, (head, body)) in enumerate(zip(examples, pieces)):
        if len(head) + len(body) > max_length:
            if truncation == "error" or len(head) >= max_length:
                raise DataError(f"{_where(ex, i)}: field 'prompt': {len(head) + len(body)} tokens exceeds "
                                f"{limit.name} with data.truncation={truncation!r}; {limit.fix}, shorten the prompt, "
                                "or use data.truncation=left")
            body, cut = body[len(head) + len(body) - max_length :], cut + 1
        out.append(head + body)
    return out, cut


# --------------------------------------------------------------------------- tokenisation


class _Codec:
    """Tokenizes prompt and completion texts into the pieces a row is built from."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        # Does the tokenizer put BOS in front on its own? Then rows start with it (and keep it).
        self.adds_bos = self.bos is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [
            self.bos
        ]
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)

    def ids(self, texts: list[str], wheres: Sequence[str] = (), key: str = "text") -> list[list[int]]:
        """Token ids of each text; a text the tokenizer cannot encode raises DataError naming its
        record (``wheres[i]``), the field ``key`` and the characters."""
        try:
            encoded = self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]  # lengths: ours to check
        except Exception as e:  # e.g. a WordLevel vocabulary without [UNK]: find the record and the characters
            raise _encoding_error(self.tok, texts, wheres, key) or e from None
        return [list(x) for x in encoded]

    def prompts(self, texts: list[str], wheres: Sequence[str] = ()) -> list[tuple[list[int], list[int]]]:
        """``(head, body)`` per prompt: head is the BOS kept under truncation."""
        out = []
        for ids in self.ids(texts, wheres, "prompt"):
            if self.bos is not None and ids[:1] == [self.bos]:  # the chat template wrote BOS itself
                out.append(([self.bos], ids[1:]))
            else:
                out.append(([self.bos] if self.adds_bos else [], ids))
        return out

    def completions(self, texts: list[str], wheres: Sequence[str] = (), key: str = "completion") -> list[list[int]]:
        out = self.ids(texts, wheres, key)
        for ids in out:
            self._end(ids)
        return out

    def _end(self, ids: list[int]) -> bool:
        """Append EOS to a response that does not end with it; whether it did."""
        if self.eos is None or ids[-1:] == [self.eos]:
            return False
        ids.append(self.eos)
        return True

    def answers(self, examples: Sequence[SFTExample], wheres: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
        """The ids of what follows each example's prompt (:meth:`SFTExample.pieces`, each piece
        tokenized on its own, EOS appended to the last as in :meth:`completions`) and their mask:
        1 on the answers and that EOS, 0 on the context between them."""
        pieces = [ex.pieces() for ex in examples]
        flat = self.ids([text for p in pieces for text, _ in p], [w for p, w in zip(pieces, wheres) for _ in p],
                        "completion")
        responses, masks, at = [], [], 0
        for p in pieces:
            ids, mask = [], []
            for piece, (_, trained) in zip(flat[at : at + len(p)], p):
                ids += piece
                mask += [int(trained)] * len(piece)
            at += len(p)
            if self._end(ids):
                mask.append(1)
            responses.append(ids)
            masks.append(mask)
        return responses, masks


def unencodable_characters(tokenizer, text: str) -> list[str]:
    """The characters of ``text`` that ``tokenizer`` cannot encode on their own, in order of
    first appearance (e.g. characters outside a WordLevel vocabulary that has no [UNK] token)."""
    bad = []
    for ch in dict.fromkeys(text):
        try:
            tokenizer(ch, add_special_tokens=False)
        except Exception:  # the tokenizers library raises a bare Exception
            bad.append(ch)
    return bad


def describe_characters(chars: Sequence[str], limit: int = 10) -> str:
    """``"'h', 'e' (and 3 more)"``."""
    shown = ", ".join(repr(c) for c in chars[:limit])
    return shown + (f" (and {len(chars) - limit} more)" if len(chars) > limit else "")


def _encoding_error(tokenizer, texts: Sequence[str], wheres: Sequence[str], key: str) -> DataError | None:
    """The DataError for the first text the tokenizer cannot encode, or None when each encodes alone."""
    for i, text in enumerate(texts):
        try:
            tokenizer(text, add_special_tokens=False)
            continue
        except Exception as e:  # the tokenizers library raises a bare Exception
            err = e
        where = wheres[i] if i < len(wheres) else f"example {i}"
        bad = unencodable_characters(tokenizer, text)
        if bad:
            return DataError(f"{where}: field {key!r}: characters the tokenizer cannot encode: "
                             f"{describe_characters(bad)}; remove them from the data or use a tokenizer whose "
                             "vocabulary has them")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return DataError(f"{where}: field {key!r}: the tokenizer cannot encode this text ({first})")
    return None


def _fit(
    where: str,
    head: list[int],
    body: list[int],
    responses: dict[str, list[int]],
    limit: Limit,
    truncation: str,
) -> list[int]:
    """The prompt body cut so ``head + body + response`` fits ``limit``, or DataError."""
    max_length = limit.tokens
    key = max(responses, key=lambda k: len(responses[k]))
    longest = len(responses[key])
    need = len(head) + len(body) + longest
    if need <= max_length:
        return body
    bos = " plus BOS" if head else ""
    if len(head) + longest >= max_length:
        raise DataError(
            f"{where}: field {key!r}: the response is {longest} tokens (EOS included){bos}, which leaves no room "
            f"for the prompt in {limit.name}; responses are never truncated: {limit.fix} or drop the record"
        )
    if truncation == "error":
        raise DataError(
            f"{where}: field 'prompt': prompt ({len(body)} tokens) + {key} ({longest}){bos} = {need} tokens "
            f"exceeds {limit.name} with truncation='error' ('left' would drop the first "
            f"{need - max_length} prompt tokens)"
        )
    return body[need - max_length :]


def _where(example, i: int) -> str:
    return example.origin or f"example {i}"


def _wheres(examples: Sequence) -> list[str]:
    return [_where(ex, i) for i, ex in enumerate(examples)]


def _check_policy(examples, max_length: int | Limit, truncation: str) -> Limit:
    """The limit, after checking the arguments."""
    limit = _as_limit(max_length, "max_length")
    if truncation not in ("left", "error"):
        raise ValueError(f"truncation must be 'left' or 'error', got {truncation!r}")
    if limit.tokens < 1:
        raise ValueError(f"max_length must be >= 1, got {limit.tokens}")
    if not examples:
        raise ValueError("no examples to encode")
    return limit


def _pad(rows: list[list[int]], value: int, width: int) -> torch.Tensor:
    import torch

    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _rows(
    prompts: list[list[int]], responses: list[list[int]], pad: int, width: int,
    masks: list[list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded rows of prompt + response; ``masks``: which response tokens are targets (all by default)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    masks = masks if masks is not None else [[1] * len(r) for r in responses]
    return {
        "input_ids": _pad(seqs, pad, width),
        "attention_mask": _pad([[1] * len(s) for s in seqs], 0, width),
        "loss_mask": _pad([[0] * len(p) + m for p, m in zip(prompts, masks)], 0, width),
    }


def encode_sft(
    examples: Iterable[SFTExample], tokenizer, max_length: int | Limit, truncation: str = "left"
) -> dict[str, torch.Tensor]:
    """Tokenize demonstrations into right-padded rows, ``[N, L]`` with L the longest row.

    Returns ``input_ids``, ``attention_mask`` (1 on tokens, 0 on padding) and ``loss_mask``
    (1 on the completion tokens and the EOS and on the answers of later ``turns``, 0 on BOS,
    prompt, the turns' context and padding). Each piece of text is tokenized on its own, so
    the boundaries are exact. ``loss_mask[t]``
    marks token ``t`` as a target, predicted from position ``t - 1``: HF-style labels are
    ``input_ids.masked_fill(loss_mask == 0, -100)`` (the model shifts them itself).

    ``truncation``: what to do when prompt + completion exceeds ``max_length``: ``'left'``
    drops prompt tokens from the start (keeping BOS), ``'error'`` raises ``DataError``. A
    completion that leaves no room for a prompt token raises either way. ``max_length`` may be a
    :class:`Limit` that names where it comes from (the model's context: :func:`context_limit`).
    """
    examples = list(examples)
    limit = _check_policy(examples, max_length, truncation)
    codec = _Codec(tokenizer)
    wheres = _wheres(examples)
    heads = codec.prompts([ex.prompt for ex in examples], wheres)
    responses, masks = codec.answers(examples, wheres)
    prompts = [
        head + _fit(_where(ex, i), head, body, {"completion": resp}, limit, truncation)
        for i, (ex, (head, body), resp) in enumerate(zip(examples, heads, responses))
    ]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    return _rows(prompts, responses, codec.pad, width, masks)


def encode_preferences(
    examples: Iterable[PreferenceExample], tokenizer, max_length: int | Limit, truncation: str = "left"
) -> dict[str, torch.Tensor]:
    """Tokenize pairs into right-padded ``[N, L]`` rows, chosen and rejected to one width L.

    Returns ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_loss_mask`` and the
    same three for ``rejected`` (masks as in ``encode_sft``), plus ``margin`` ``[N]`` when
    the examples carry margins. One width lets a trainer ``torch.cat`` both halves into a
    single ``[2N, L]`` forward. Both rows of a pair keep the same prompt tokens: under
    ``truncation='left'`` the cut is sized for the longer response, so DPO compares the two
    responses in one context. ``max_length``: as in :func:`encode_sft`.
    """
    examples = list(examples)
    limit = _check_policy(examples, max_length, truncation)
    codec = _Codec(tokenizer)
    wheres = _wheres(examples)
    heads = codec.prompts([ex.prompt for ex in examples], wheres)
    chosen = codec.completions([ex.chosen for ex in examples], wheres, "chosen")
    rejected = codec.completions([ex.rejected for ex in examples], wheres, "rejected")
    prompts = [
        head + _fit(_where(ex, i), head, body, {"chosen": c, "rejected": r}, limit, truncation)
        for i, (ex, (head, body), c, r) in enumerate(zip(examples, heads, chosen, rejected))
    ]
    width = max(len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected))
    out = {}
    for name, responses in (("chosen", chosen), ("rejected", rejected)):
        out.update({f"{name}_{k}": v for k, v in _rows(prompts, responses, codec.pad, width).items()})
    margins = [ex.margin for ex in examples]
    if any(m is not None for m in margins):
        if any(m is None for m in margins):
            raise DataError(
                "margin is given on some examples but not others; give it on every one or on none"
            )
        import torch

        out["margin"] = torch.tensor(margins, dtype=torch.float32)
    return out


def encode_triples(tok, triples: list[tuple[str, str, str]], max_length: int = 64) -> dict:
    """``(prompt, chosen, rejected)`` text triples -> ``encode_preferences`` tensors."""
    return encode_preferences([PreferenceExample(p, c, r) for p, c, r in triples], tok, max_length, "error")


def hold_out(items: list, fraction: float, seed: int, what: str = "examples") -> tuple[list, list]:
    """``(train, held_out)``: a seeded ``fraction`` of ``items`` held out (at least one when
    ``fraction > 0``; none at 0), each part in its original order."""
    if not fraction:
        return list(items), []
    n = max(1, round(len(items) * fraction))
    if n >= len(items):
        raise DataError(f"data.eval_fraction={fraction} holds out all {len(items)} {what}; lower it")
    import torch

    held = set(torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()[:n])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def stack_pairs(enc: dict, idx: torch.Tensor, device, fields=("input_ids", "attention_mask")) -> tuple:
    """Rows ``idx`` of an ``encode_preferences`` result as one forward: for each field, the
    chosen rows then the rejected rows, ``[2B, T]``."""
    import torch

    return tuple(torch.cat([enc[f"chosen_{f}"][idx], enc[f"rejected_{f}"][idx]]).to(device) for f in fields)


def pack_sft(
    encoded: dict[str, torch.Tensor], max_length: int, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """Concatenate ``encode_sft`` rows into ``[M, max_length]`` rows, fewer padding tokens.

    Examples are taken in order and a row is closed when the next one does not fit (no
    reordering, no splitting an example across rows). Returns ``input_ids``,
    ``attention_mask`` (0 only on the padding at the end of a row), ``loss_mask`` and
    ``position_ids``, which restart at 0 for each example. The first token of every example
    is never a target, so no loss term predicts one example from the one before it (the
    same targets as unpacked rows, where the shift drops position 0).

    Attention across example boundaries is *not* blocked: tokens still see the previous
    examples of their row unless the model's attention honours the restarting
    ``position_ids`` as sequence boundaries (e.g. HF flash-attention-2 with padding-free
    inputs); with eager or SDPA attention the examples leak context into each other.
    """
    rows: list[dict[str, list[int]]] = []
    cur: dict[str, list[int]] = {"input_ids": [], "loss_mask": [], "position_ids": []}
    lengths = encoded["attention_mask"].sum(-1).tolist()
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"example {i} is {n} tokens, longer than the packed row length {max_length}")
        if len(cur["input_ids"]) + n > max_length:
            rows.append(cur)
            cur = {"input_ids": [], "loss_mask": [], "position_ids": []}
        cur["input_ids"] += encoded["input_ids"][i, :n].tolist()
        cur["loss_mask"] += [0] + encoded["loss_mask"][i, 1:n].tolist()
        cur["position_ids"] += list(range(n))
    if cur["input_ids"]:
        rows.append(cur)
    return {
        "input_ids": _pad([r["input_ids"] for r in rows], pad_token_id, max_length),
        "attention_mask": _pad([[1] * len(r["input_ids"]) for r in rows], 0, max_length),
        "loss_mask": _pad([r["loss_mask"] for r in rows], 0, max_length),
        "position_ids": _pad([r["position_ids"] for r in rows], 0, max_length),
    }
