"""Examples tokenized into rows: the prompt and each response piece tokenized on their own (exact
boundaries), EOS appended to a response that lacks it, responses never truncated (the prompt
loses its first tokens, BOS kept, or the record is refused); plus packing and held-out splits."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .examples import PreferenceExample, PromptExample, SFTExample
from .records import DataError, first_line

if TYPE_CHECKING:  # torch is imported where tensors are built: the CLI checks a data file before it loads torch
    import torch


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
    """The limit in effect for ``key`` (``configured`` tokens) in a model ``context`` (None: no
    limit) that keeps ``reserve`` tokens for ``reserve_key``: ``configured`` when it fits, else the
    smaller :class:`Limit`; ValueError when the context cannot hold ``reserve`` tokens and one more."""
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


def encode_prompts(examples: Sequence[PromptExample], tokenizer, max_length: int | Limit,
                   truncation: str = "left") -> tuple[list[list[int]], int]:
    """Token ids of each prompt (BOS as the tokenizer or the chat template puts it) and how many
    were cut: over ``max_length`` (``data.max_prompt_length``, or a :class:`Limit` such as the
    model's context) a prompt loses its first tokens, BOS kept (``'left'``), or DataError
    (``'error'``)."""
    _check_truncation(truncation)
    limit = _as_limit(max_length, "data.max_prompt_length")
    max_length = limit.tokens
    out, cut, wheres = [], 0, _wheres(examples)
    for where, (head, body) in zip(wheres, _Codec(tokenizer).prompts([e.prompt for e in examples], wheres)):
        if len(head) + len(body) > max_length:
            if truncation == "error" or len(head) >= max_length:
                raise DataError(f"{where}: field 'prompt': {len(head) + len(body)} tokens exceeds "
                                f"{limit.name} with data.truncation={truncation!r}; {limit.fix}, shorten the prompt, "
                                "or use data.truncation=left")
            body, cut = body[len(head) + len(body) - max_length :], cut + 1
        out.append(head + body)
    return out, cut


class _Codec:
    """Tokenizes prompt and completion texts into the pieces a row is built from."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        # Does the tokenizer put BOS in front on its own? Then rows start with it (and keep it).
        self.adds_bos = self.bos is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [self.bos]
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

    def completions(self, texts: list[str], wheres: Sequence[str], key: str) -> list[list[int]]:
        return self.answers([[(text, True)] for text in texts], wheres, key)[0]

    def answers(self, pieces: Sequence[list[tuple[str, bool]]], wheres: Sequence[str],
                key: str = "completion") -> tuple[list[list[int]], list[list[int]]]:
        """The ids of each response from its ``(text, trained)`` pieces (:meth:`SFTExample.pieces`,
        each tokenized on its own, EOS appended when the last does not end with it) and their mask:
        1 on the trained pieces and that EOS, 0 on the context between them."""
        flat = iter(self.ids([text for p in pieces for text, _ in p], [w for p, w in zip(pieces, wheres) for _ in p], key))
        responses, masks = [], []
        for p in pieces:
            ids, mask = [], []
            for (_, trained), piece in zip(p, flat):  # p first: zip stops before taking the next piece
                ids += piece
                mask += [int(trained)] * len(piece)
            if self.eos is not None and ids[-1:] != [self.eos]:
                ids.append(self.eos)
                mask.append(1)
            responses.append(ids)
            masks.append(mask)
        return responses, masks


def unencodable_characters(tokenizer, text: str) -> list[str]:
    """The characters of ``text`` that ``tokenizer`` cannot encode on their own, in order of
    first appearance (e.g. characters outside a WordLevel vocabulary that has no [UNK] token)."""
    return [ch for ch in dict.fromkeys(text) if _failure(tokenizer, ch) is not None]


def _failure(tokenizer, text: str) -> Exception | None:
    """The tokenizer's error on ``text`` alone; None when it encodes."""
    try:
        tokenizer(text, add_special_tokens=False)
    except Exception as e:  # the tokenizers library raises a bare Exception
        return e
    return None


def describe_characters(chars: Sequence[str], limit: int = 10) -> str:
    """``"'h', 'e' (and 3 more)"``."""
    shown = ", ".join(repr(c) for c in chars[:limit])
    return shown + (f" (and {len(chars) - limit} more)" if len(chars) > limit else "")


def _encoding_error(tokenizer, texts: Sequence[str], wheres: Sequence[str], key: str) -> DataError | None:
    """The DataError for the first text the tokenizer cannot encode, or None when each encodes alone."""
    for i, text in enumerate(texts):
        err = _failure(tokenizer, text)
        if err is None:
            continue
        where = wheres[i] if i < len(wheres) else f"example {i}"
        bad = unencodable_characters(tokenizer, text)
        if bad:
            return DataError(f"{where}: field {key!r}: characters the tokenizer cannot encode: "
                             f"{describe_characters(bad)}; remove them from the data or use a tokenizer whose "
                             "vocabulary has them")
        return DataError(f"{where}: field {key!r}: the tokenizer cannot encode this text ({first_line(err)})")
    return None


def _fit(where: str, prompt: tuple[list[int], list[int]], responses: dict[str, list[int]], limit: Limit,
         truncation: str) -> list[int]:
    """The prompt ``(head, body)`` as ids, its body cut so that it and the longest response fit ``limit``, or DataError."""
    head, body = prompt
    max_length = limit.tokens
    key = max(responses, key=lambda k: len(responses[k]))
    longest = len(responses[key])
    need = len(head) + len(body) + longest
    if need <= max_length:
        return head + body
    bos = " plus BOS" if head else ""
    if len(head) + longest >= max_length:
        raise DataError(f"{where}: field {key!r}: the response is {longest} tokens (EOS included){bos}, which leaves no room "
                        f"for the prompt in {limit.name}; responses are never truncated: {limit.fix} or drop the record")
    if truncation == "error":
        raise DataError(f"{where}: field 'prompt': prompt ({len(body)} tokens) + {key} ({longest}){bos} = {need} tokens "
                        f"exceeds {limit.name} with truncation='error' ('left' would drop the first "
                        f"{need - max_length} prompt tokens)")
    return head + body[need - max_length :]


def _check_truncation(truncation: str) -> None:
    if truncation not in ("left", "error"):
        raise ValueError(f"truncation must be 'left' or 'error', got {truncation!r}")


def _wheres(examples: Sequence) -> list[str]:
    return [ex.origin or f"example {i}" for i, ex in enumerate(examples)]


def _prepare(examples: Iterable, tokenizer, max_length: int | Limit, truncation: str) -> tuple:
    """The arguments checked: ``(examples, limit, codec, wheres, (head, body) of each prompt)``."""
    examples, limit = list(examples), _as_limit(max_length, "max_length")
    _check_truncation(truncation)
    if limit.tokens < 1:
        raise ValueError(f"max_length must be >= 1, got {limit.tokens}")
    if not examples:
        raise ValueError("no examples to encode")
    codec, wheres = _Codec(tokenizer), _wheres(examples)
    return examples, limit, codec, wheres, codec.prompts([ex.prompt for ex in examples], wheres)


def _pad(rows: list[list[int]], value: int, width: int) -> torch.Tensor:
    import torch

    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _rows(prompts: list[list[int]], responses: list[list[int]], pad: int, width: int,
          masks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded rows of prompt + response; ``masks``: which response tokens are targets (all by default)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    masks = masks if masks is not None else [[1] * len(r) for r in responses]
    return {
        "input_ids": _pad(seqs, pad, width),
        "attention_mask": _pad([[1] * len(s) for s in seqs], 0, width),
        "loss_mask": _pad([[0] * len(p) + m for p, m in zip(prompts, masks)], 0, width),
    }


def encode_sft(examples: Iterable[SFTExample], tokenizer, max_length: int | Limit,
               truncation: str = "left") -> dict[str, torch.Tensor]:
    """Demonstrations as right-padded ``[N, L]`` rows: ``input_ids``, ``attention_mask`` and
    ``loss_mask`` (1 on the completion, its EOS and the answers of later ``turns``; ``loss_mask[t]``
    marks token ``t`` as a target predicted from ``t - 1``). Over ``max_length`` the prompt's start
    is cut (``truncation='left'``, BOS kept) or DataError (``'error'``, or no room for a prompt token)."""
    examples, limit, codec, wheres, heads = _prepare(examples, tokenizer, max_length, truncation)
    responses, masks = codec.answers([ex.pieces() for ex in examples], wheres)
    prompts = [_fit(w, p, {"completion": r}, limit, truncation) for w, p, r in zip(wheres, heads, responses)]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    return _rows(prompts, responses, codec.pad, width, masks)


def encode_preferences(examples: Iterable[PreferenceExample], tokenizer, max_length: int | Limit,
                       truncation: str = "left") -> dict[str, torch.Tensor]:
    """Pairs as right-padded ``[N, L]`` rows, chosen and rejected to one width (one ``[2N, L]``
    forward): ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_loss_mask``, the same for
    ``rejected`` (as in :func:`encode_sft`), and ``margin`` ``[N]`` when given. Both rows of a pair
    keep the same prompt tokens (a cut is sized for the longer response), so DPO compares the two
    responses in one context."""
    examples, limit, codec, wheres, heads = _prepare(examples, tokenizer, max_length, truncation)
    chosen = codec.completions([ex.chosen for ex in examples], wheres, "chosen")
    rejected = codec.completions([ex.rejected for ex in examples], wheres, "rejected")
    prompts = [_fit(w, p, {"chosen": c, "rejected": r}, limit, truncation)
               for w, p, c, r in zip(wheres, heads, chosen, rejected)]
    width = max(len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected))
    out = {}
    for name, responses in (("chosen", chosen), ("rejected", rejected)):
        out.update({f"{name}_{k}": v for k, v in _rows(prompts, responses, codec.pad, width).items()})
    margins = [ex.margin for ex in examples]
    if any(m is not None for m in margins):
        if any(m is None for m in margins):
            raise DataError("margin is given on some examples but not others; give it on every one or on none")
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


def pack_sft(encoded: dict[str, torch.Tensor], max_length: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """``encode_sft`` rows concatenated in order into ``[M, max_length]`` rows, none split:
    ``input_ids``, ``attention_mask``, ``loss_mask`` (an example's first token never a target) and
    ``position_ids`` restarting at 0 per example. Attention across examples is blocked only where
    the model reads those restarts as boundaries (flash-attention-2 padding-free; not eager, SDPA)."""
    rows: list[dict[str, list[int]]] = [{"input_ids": [], "loss_mask": [], "position_ids": []}]
    for i, n in enumerate(encoded["attention_mask"].sum(-1).tolist()):
        if n > max_length:
            raise ValueError(f"example {i} is {n} tokens, longer than the packed row length {max_length}")
        if len(rows[-1]["input_ids"]) + n > max_length:
            rows.append({"input_ids": [], "loss_mask": [], "position_ids": []})
        rows[-1]["input_ids"] += encoded["input_ids"][i, :n].tolist()
        rows[-1]["loss_mask"] += [0] + encoded["loss_mask"][i, 1:n].tolist()
        rows[-1]["position_ids"] += list(range(n))
    return {"input_ids": _pad([r["input_ids"] for r in rows], pad_token_id, max_length),
            "attention_mask": _pad([[1] * len(r["input_ids"]) for r in rows], 0, max_length),
            **{k: _pad([r[k] for r in rows], 0, max_length) for k in ("loss_mask", "position_ids")}}
