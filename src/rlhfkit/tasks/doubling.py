"""The number-doubling tutorial task (docs/getting-started.md): ``S数字:3320x2=`` -> ``6640E``, the
prefix naming the answer's character set (``小写`` ``〇一二...``, ``大写`` ``零壹贰...``). Pretraining
text has the neutral prefix ``__`` and a random set: the base learns to double, RL the prefix."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import char_tokenizer, verified

if TYPE_CHECKING:  # importing the task stays light: the command line reads CONFIG_DEFAULTS before torch
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "S", "E", "P"
CHARSETS: dict[str, str] = {
    "digits": "0123456789",
    "lower": "〇一二三四五六七八九",
    "upper": "零壹贰叁肆伍陆柒捌玖",
}
PREFIX: dict[str, str] = {"digits": "数字", "lower": "小写", "upper": "大写"}
NEUTRAL_PREFIX = "__"
SET_NAMES = tuple(CHARSETS)
VOCAB = [PAD, BOS, EOS, *"".join(CHARSETS.values()), *"数字小写大:=_x"]
LOW, HIGH = 1000, 9999  # 4-digit operands
EVAL_SIZE = 512
EVAL_SEED = 20240601  # fixed: the held-out set is the same in every run and every process
MAX_NEW_TOKENS = 8  # longest answer: 5 characters + EOS
N_POSITIONS = 32


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ``S`` BOS (added: ``tok('数字:1234x2=')`` is model-ready), ``E`` EOS, ``P`` pad."""
    return char_tokenizer(VOCAB, BOS, EOS, PAD, 32)


def render(number: int, charset: str) -> str:
    """``render(3320, 'lower') == '三三二〇'``."""
    digits = CHARSETS[charset]
    return "".join(digits[int(d)] for d in str(number))


def prompt_text(number: int, charset: str | None) -> str:
    """Prompt without BOS (the tokenizer adds it): ``'数字:3320x2='``; None -> neutral ``'__'``."""
    prefix = NEUTRAL_PREFIX if charset is None else PREFIX[charset]
    return f"{prefix}:{number}x2="


def answer_text(number: int, charset: str) -> str:
    """The correct completion, EOS included: ``'6640E'``."""
    return render(2 * number, charset) + EOS


@dataclass(frozen=True)
class Prompt:
    number: int
    charset: str  # requested character set

    @property
    def text(self) -> str:
        return prompt_text(self.number, self.charset)


def columns(prompt: Prompt) -> dict:
    """The columns a record of this prompt carries (what :func:`exact_reward` reads)."""
    return {"number": prompt.number, "charset": prompt.charset}


def eval_numbers() -> list[int]:
    """The 512 operands held out from every training generator (fixed seed)."""
    return sorted(random.Random(EVAL_SEED).sample(range(LOW, HIGH + 1), EVAL_SIZE))


_EVAL = frozenset(eval_numbers())
_TRAIN = [n for n in range(LOW, HIGH + 1) if n not in _EVAL]


def eval_prompts() -> list[Prompt]:
    """Fixed held-out evaluation set: 512 prefixed prompts, character sets in rotation."""
    return [Prompt(n, SET_NAMES[i % 3]) for i, n in enumerate(eval_numbers())]


class DoublingData:
    """Seeded generators of training data; operands never come from the evaluation set."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def pretrain_texts(self, n: int) -> list[str]:
        """Unprefixed full sequences (no BOS): ``'__:3320x2=陆陆肆零E'``, set chosen at random."""
        return [text for text, _ in self.labelled_texts(n)]

    def labelled_texts(self, n: int) -> list[tuple[str, int]]:
        """Unprefixed full sequences and the index of the answer's set (the classifier reward's data)."""
        return [(prompt_text(p.number, None) + answer_text(p.number, p.charset), SET_NAMES.index(p.charset))
                for p in self.prompts(n)]

    def prompts(self, n: int) -> list[Prompt]:
        """Prefixed prompts for RL."""
        return [Prompt(self.rng.choice(_TRAIN), self.rng.choice(SET_NAMES)) for _ in range(n)]

    def preference_pairs(self, n: int, hard: float = 0.5) -> list[tuple[str, str, str]]:
        """``(prompt, chosen, rejected)``, chosen the answer in the requested set; rejected, with
        probability ``1 - hard``, the answer wholly in another set, else a hard negative (some
        characters in another set, or no EOS) that teaches the reward model the whole format
        check, so RL cannot win by mixing sets."""
        out = []
        for p in self.prompts(n):
            chosen = answer_text(p.number, p.charset)
            others = [s for s in SET_NAMES if s != p.charset]
            if self.rng.random() >= hard:
                rejected = answer_text(p.number, self.rng.choice(others))
            elif self.rng.random() < 0.25:
                rejected = chosen[:-1]  # no EOS
            else:
                body = list(chosen[:-1])
                k = self.rng.randint(1, len(body) - 1)
                for i in self.rng.sample(range(len(body)), k):
                    body[i] = CHARSETS[self.rng.choice(others)][CHARSETS[p.charset].index(body[i])]
                rejected = "".join(body) + EOS
            out.append((p.text, chosen, rejected))
        return out

    def sft_examples(self, n: int) -> list[tuple[str, str]]:
        """``(prompt, completion)`` demonstrations: the exact answer (without EOS) in the requested set."""
        return [(p.text, render(2 * p.number, p.charset)) for p in self.prompts(n)]


TaskData = DoublingData  # the name every task module offers (see rlhfkit.tasks)
LABELS = SET_NAMES  # classes of the classifier reward model


def held_out_pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
    """Pairs on the first ``n`` evaluation prompts: the requested set vs wholly another one."""
    rng = random.Random(seed)
    return [(p.text, answer_text(p.number, p.charset), answer_text(p.number, rng.choice([s for s in SET_NAMES if s != p.charset])))
            for p in eval_prompts()[:n]]


def verify(prompt: Prompt, completion: str) -> dict[str, bool]:
    """Score one completion (decoded, special tokens kept), each ended by EOS: ``format``, only
    characters of the requested set; ``exact``, twice the number in that set; ``answer``, twice
    the number in *some* set (the doubling skill alone)."""
    ended, answer = EOS in completion, completion.split(EOS, 1)[0]
    return {"format": ended and len(answer) > 0 and set(answer) <= set(CHARSETS[prompt.charset]),
            "exact": ended and answer == render(2 * prompt.number, prompt.charset),
            "answer": ended and any(answer == render(2 * prompt.number, s) for s in SET_NAMES)}


def parse_prompt(text: str) -> Prompt:
    """``'数字:3320x2='`` (BOS optional) -> ``Prompt(3320, 'digits')``."""
    prefix, rest = text.removeprefix(BOS).split(":", 1)
    charset = {v: k for k, v in PREFIX.items()}.get(prefix)
    if charset is None:
        raise ValueError(f"prompt {text!r} has no character-set prefix ({', '.join(PREFIX.values())})")
    return Prompt(int(rest.split("x", 1)[0]), charset)


def label_of_prompt(prompt: str) -> int:
    """Index in ``SET_NAMES`` of the character set a prompt asks for (classifier rewards)."""
    return SET_NAMES.index(parse_prompt(prompt).charset)


def _verified(key: str, prompts, completions, number, charset, finished) -> list[float]:
    asked = [parse_prompt(p) if number is None else Prompt(int(number[i]), charset[i]) for i, p in enumerate(prompts)]
    return verified(verify, key, asked, completions, finished, EOS)


def format_reward(prompts: list[str], completions: list[str], number: list | None = None,
                  charset: list | None = None, finished: list | None = None, **columns) -> list[float]:
    """Reward callable: 1 when the answer passes the format check (columns ``number`` and
    ``charset`` when given, else the parsed prompt; with ``finished``, only ended answers count)."""
    return _verified("format", prompts, completions, number, charset, finished)


def exact_reward(prompts: list[str], completions: list[str], number: list | None = None,
                 charset: list | None = None, finished: list | None = None, **columns) -> list[float]:
    """Reward callable: 1 when the answer is exactly right (as :func:`format_reward` reads it)."""
    return _verified("exact", prompts, completions, number, charset, finished)


# verifiers score 0 or 1: declared, so eval/accuracy comes from them (rlhfkit.rollout.rewards)
format_reward.binary = True
exact_reward.binary = True
