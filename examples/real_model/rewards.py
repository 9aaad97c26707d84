"""Reward functions for the city-country task on a real chat model (examples/real_model).

Each is ``fn(completions, answer, **columns) -> list[float]``: ``completions`` are the decoded
answers (special tokens removed; conversational prompts give ``[{"role": "assistant", "content":
...}]`` lists), ``answer`` the record's country. ``exact`` is the verifier (0/1); ``contains``
and ``brevity`` shape it: the base model answers in whole sentences, so ``exact`` alone is 0 for
almost every sample and a group of them carries no signal.
"""

from __future__ import annotations

import re


def _text(c) -> str:
    return c[-1]["content"] if isinstance(c, list) else c


def _norm(s: str) -> str:
    return re.sub(r"[^a-z ]", "", s.lower()).strip()


def exact(completions, answer, **_) -> list[float]:
    """1 when the answer is the country's name alone (case and punctuation ignored), else 0."""
    return [float(_norm(_text(c)) == _norm(a)) for c, a in zip(completions, answer)]


exact.binary = True  # a 0/1 verifier: eval/accuracy reads it


def contains(completions, answer, **_) -> list[float]:
    """1 when the country's name appears in the answer: the fact is kept."""
    return [float(_norm(a) in _norm(_text(c))) for c, a in zip(completions, answer)]


def brevity(completions, **_) -> list[float]:
    """1 / the number of words: shorter answers score higher (1 for one word)."""
    return [1.0 / max(1, len(_text(c).split())) for c in completions]
