"""The real-model task suite: seven tasks for SmolLM2-135M-Instruct on which no single phrasing
or answer form dominates, for ``benchmarks/real_matrix.py``.

Every task has several prompt phrasings, a training and a held-out split written by a
deterministic generator (:func:`write`: ``prompts.jsonl`` and ``held.jsonl``, conversational
prompt records with the columns the rewards read; the held-out items -- countries, sums,
categories, words, secrets, products -- appear in no training prompt), a 0/1 verifier (the
target, declared ``binary``) and a shaping term that is not the target and can be gamed:

==========  ========================================  ================================  =====================================
task        question (one of 3-4 phrasings)           target (0/1)                      shaping (gameable)
==========  ========================================  ================================  =====================================
capital     "What is the capital of Jordan? ..."      the city's name alone             1 / words (a short non-answer scores 1)
number      "What is 17 + 25? ..."                    the number alone                  some number appears (any number)
yesno       "Is Rabat the capital of Morocco? ..."    the right "yes" or "no" alone     one word ("No." to everything)
listing     "Name three fruits, comma-separated..."   n distinct items of the category  n comma-separated items (of anything)
sentence    "One sentence under 8 words with 'rain'"  one sentence, < n words, the word the word appears (at any length)
guess       guess a number from 1 to 20 in 5 turns    the secret found                  0.1 a well-formed guess (long games)
calculator  "What is 347 * 29?" with a calculator     the product alone                 0.2 a tool call that ran (calls only)
==========  ========================================  ================================  =====================================

A run stops once the held-out verifier reaches the task's ``target`` rate: 0.5, but 0.4 for
``capital`` and ``number`` (the base model gives the right answer, in any form, to about half of
them) and 0.75 for ``yesno`` (where "No." to everything scores 0.5).

``guess`` and ``calculator`` are multi-turn environments (``rlhfkit.envs.environment.Environment``; the
calculator one of ``examples/real_model/calculator``). Their held-out episodes (records with
``held: true``) return the target alone, so the run's held-out ``eval/reward`` is the solved
share; the shaping they would have earned is recorded in :data:`HELD_SHAPING` instead, one entry
per held-out episode, in play order.

    python benchmarks/real_tasks.py OUT_DIR            # every task's files under OUT_DIR/<task>/
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "real_model"))
sys.path.insert(0, str(ROOT / "examples" / "real_model" / "calculator"))

from calculator import CalculatorEnv, answer_of  # noqa: E402
from capitals import CAPITAL_OF  # noqa: E402

from rlhfkit.envs.environment import Environment  # noqa: E402

HELD = 32  # held-out prompts per task (about)


# --------------------------------------------------------------------------- text helpers


def _text(c) -> str:
    return c[-1]["content"] if isinstance(c, list) else c


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", s.lower()).strip()


def _words(s: str) -> list[str]:
    return _norm(s).split()


def _split_keys(keys: list, seed: int, held: int) -> tuple[list, list]:
    """``(train, held)``: the sorted keys shuffled by ``seed``, the first ``held`` held out."""
    keys = sorted(keys)
    random.Random(seed).shuffle(keys)
    return keys[held:], keys[:held]


def _record(question: str, **columns) -> dict:
    return {"prompt": [{"role": "user", "content": question}], **columns}


# --------------------------------------------------------------------------- (a) capital: one word

CAPITAL_ASK = (
    "What is the capital of {}? Answer with the city's name only.",
    "Name the capital city of {}. Reply with the name and nothing else.",
    "Which city is the capital of {}? Give just the city.",
    "{}: what is its capital? One name, no sentence.",
)


def capital_records() -> tuple[list[dict], list[dict]]:
    train, held = _split_keys(list(CAPITAL_OF), seed=1, held=HELD)
    def make(keys):
        return [_record(CAPITAL_ASK[i % len(CAPITAL_ASK)].format(c), answer=CAPITAL_OF[c], key=c)
                for i, c in enumerate(keys)]
    return make(train), make(held)


def capital_exact(completions, answer, **_) -> list[float]:
    """1 when the answer is the capital's name alone (case and punctuation ignored)."""
    return [float(_norm(_text(c)) == _norm(a)) for c, a in zip(completions, answer)]


def brevity(completions, **_) -> list[float]:
    """1 / the number of words: "Jordan." scores as "Amman." does."""
    return [1.0 / max(1, len(_text(c).split())) for c in completions]


def knows(completions, answer, **_) -> list[float]:
    """1 when the answer appears anywhere (the fact is known, whatever the form)."""
    return [float(f" {_norm(a)} " in f" {_norm(_text(c))} ") for c, a in zip(completions, answer)]


# --------------------------------------------------------------------------- (b) number

NUMBER_ASK = (
    "What is {a} {op} {b}? Answer with the number only.",
    "Compute {a} {word} {b}. Reply with just the result.",
    "{a} {op} {b} = ? Give only the number.",
    "How much is {a} {word} {b}? Write the answer as a number and nothing else.",
)
OPS = {"+": ("plus", lambda a, b: a + b), "-": ("minus", lambda a, b: a - b)}


def number_records() -> tuple[list[dict], list[dict]]:
    keys = [(a, op, b) for a in range(2, 13) for b in range(2, 10) for op in OPS if op == "+" or a > b]
    train, held = _split_keys(keys, seed=2, held=HELD)
    train = train[:128]
    def make(ks):
        return [_record(NUMBER_ASK[i % len(NUMBER_ASK)].format(a=a, op=op, b=b, word=OPS[op][0]),
                        answer=str(OPS[op][1](a, b)), key=f"{a}{op}{b}") for i, (a, op, b) in enumerate(ks)]
    return make(train), make(held)


def number_exact(completions, answer, **_) -> list[float]:
    """1 when the answer is the number alone (a trailing period and spaces ignored)."""
    return [float(answer_of(_text(c)) == a) for c, a in zip(completions, answer)]


def has_number(completions, **_) -> list[float]:
    """1 when some number appears: a wrong number scores as the right one."""
    return [float(re.search(r"\d", _text(c)) is not None) for c in completions]


# --------------------------------------------------------------------------- (c) yes/no

YESNO_ASK = (
    "Is {city} the capital of {country}? Answer yes or no.",
    "Answer with yes or no only: is {city} the capital of {country}?",
    "{city} is the capital of {country}. Is that right? Reply with one word, yes or no.",
    "Is the capital of {country} {city}? Just say yes or no.",
)


def yesno_records() -> tuple[list[dict], list[dict]]:
    countries = sorted(CAPITAL_OF)
    train, held = _split_keys(countries, seed=3, held=HELD)
    def make(keys):
        rng, out = random.Random(len(keys)), []
        for i, country in enumerate(keys):
            true = i % 2 == 0
            city = CAPITAL_OF[country] if true else CAPITAL_OF[rng.choice([c for c in keys if c != country])]
            out.append(_record(YESNO_ASK[i % len(YESNO_ASK)].format(city=city, country=country),
                               answer="yes" if true else "no", key=country))
        return out
    return make(train), make(held)


def yesno_exact(completions, answer, **_) -> list[float]:
    """1 when the answer is the right word alone: "Yes." to a true claim, "No" to a false one."""
    return [float(_norm(_text(c)) == a) for c, a in zip(completions, answer)]


def one_word(completions, **_) -> list[float]:
    """1 when the answer is one word, right or wrong: "No." to every question scores 1."""
    return [float(len(_words(_text(c))) == 1) for c in completions]


# --------------------------------------------------------------------------- (d) listing

CATEGORIES = {
    "fruits": "apple banana orange pear peach plum cherry grape mango lemon lime kiwi melon watermelon strawberry "
              "blueberry raspberry pineapple apricot coconut fig papaya pomegranate avocado grapefruit blackberry "
              "cranberry date guava lychee nectarine tangerine",
    "colors": "red blue green yellow orange purple pink black white brown gray grey violet indigo cyan magenta "
              "turquoise beige maroon navy teal gold silver",
    "animals": "dog cat horse cow pig sheep goat lion tiger elephant bear wolf fox rabbit deer mouse rat monkey "
               "giraffe zebra camel kangaroo panda whale dolphin shark snake frog bird eagle owl duck chicken",
    "vegetables": "carrot potato tomato onion garlic cabbage lettuce spinach broccoli cauliflower pea bean corn "
                  "cucumber pepper celery radish beet pumpkin zucchini eggplant kale leek asparagus",
    "planets": "mercury venus earth mars jupiter saturn uranus neptune",
    "sports": "football soccer basketball tennis baseball golf hockey cricket rugby volleyball swimming boxing "
              "cycling running skiing badminton wrestling surfing",
    "musical instruments": "piano guitar violin drum drums flute trumpet saxophone cello clarinet harp bass "
                           "trombone ukulele banjo accordion harmonica organ",
    "days of the week": "monday tuesday wednesday thursday friday saturday sunday",
    "months": "january february march april may june july august september october november december",
    "metals": "iron gold silver copper aluminum aluminium zinc lead tin nickel platinum titanium steel mercury",
    "trees": "oak pine maple birch willow elm ash cedar palm spruce fir beech cherry apple redwood cypress",
    "flowers": "rose tulip daisy lily sunflower orchid daffodil lavender violet poppy carnation jasmine lotus iris",
    "birds": "eagle sparrow robin crow pigeon owl parrot penguin duck swan hawk flamingo ostrich peacock "
             "seagull hummingbird",
    "vehicles": "car bus truck bicycle bike motorcycle train plane airplane boat ship van taxi scooter tram "
                "helicopter",
    "body parts": "head arm leg hand foot eye ear nose mouth heart finger toe knee elbow shoulder neck",
}
VOCAB = {**{cat: set(words.split()) for cat, words in CATEGORIES.items()}, "countries": {_norm(c) for c in CAPITAL_OF}}
LIST_ASK = (
    "Name {n} {cat}. Answer with a comma-separated list and nothing else.",
    "List {n} {cat}, separated by commas, with no other words.",
    "Give me {n} examples of {cat} as a comma-separated list only.",
)
COUNT = {2: "two", 3: "three", 4: "four"}


def listing_records() -> tuple[list[dict], list[dict]]:
    train, held = _split_keys([(cat, n) for cat in VOCAB for n in COUNT], seed=4, held=11)
    def make(keys):
        return [_record(ask.format(n=COUNT[n], cat=cat), category=cat, n=n, key=f"{cat}/{n}")
                for cat, n in keys for ask in LIST_ASK]
    return make(train), make(held)


def _items(text: str) -> list[str]:
    return [_norm(re.sub(r"^\s*(and|the|an?)\s+", "", x.strip(), flags=re.I)) for x in text.strip().rstrip(".").split(",")]


def _in(item: str, vocab: set[str]) -> bool:
    return any(form in vocab for form in (item, item.removesuffix("s"), item.removesuffix("es"), item[:-3] + "y"))


def listing_exact(completions, category, n, **_) -> list[float]:
    """1 when the answer is exactly n comma-separated, distinct members of the category."""
    def ok(text, cat, k):
        items = _items(text)
        return len(items) == k and len(set(items)) == k and all(_in(x, VOCAB[cat]) for x in items)
    return [float(ok(_text(c), cat, k)) for c, cat, k in zip(completions, category, n)]


def listing_count(completions, n, **_) -> list[float]:
    """1 when the answer has n non-empty comma-separated items, of any kind."""
    return [float(len([x for x in _items(_text(c)) if x]) == k) for c, k in zip(completions, n)]


# --------------------------------------------------------------------------- (e) sentence

SENTENCE_WORDS = ("river apple music winter garden teacher mountain coffee window ocean book friend city dog "
                  "rain bread moon school train flower road cloud money chair letter island forest candle "
                  "bridge market horse summer doctor kitchen ship clock bird street piano village lamp").split()
SENTENCE_ASK = (
    'Write one sentence of fewer than {n} words that uses the word "{w}".',
    "In under {n} words, write a single sentence containing the word '{w}'.",
    "Give me one short sentence (less than {n} words) with the word {w} in it.",
)
LIMITS = (6, 8, 10)


def sentence_records() -> tuple[list[dict], list[dict]]:
    train, held = _split_keys(list(SENTENCE_WORDS), seed=5, held=11)
    def make(keys):
        return [_record(SENTENCE_ASK[(i + j) % len(SENTENCE_ASK)].format(n=n, w=w), word=w, limit=n, key=w)
                for i, w in enumerate(keys) for j, n in enumerate(LIMITS)]
    return make(train), make(held)


def _has_word(text: str, word: str) -> bool:
    return any(x in (word, word + "s", word + "es") for x in _words(text))


def sentence_exact(completions, word, limit, **_) -> list[float]:
    """1 when the answer is one sentence (one line, no sentence end before its last word) of
    fewer than ``limit`` words that contains the word."""
    def ok(text, w, n):
        t = text.strip()
        one = "\n" not in t and re.search(r"[.!?]\s+\S", t) is None
        return bool(t) and one and len(t.split()) < n and _has_word(t, w)
    return [float(ok(_text(c), w, n)) for c, w, n in zip(completions, word, limit)]


def sentence_word(completions, word, **_) -> list[float]:
    """1 when the word appears, at any length."""
    return [float(_has_word(_text(c), w)) for c, w in zip(completions, word)]


for _fn in (capital_exact, number_exact, yesno_exact, listing_exact, sentence_exact):
    _fn.binary = True  # the verifier: eval/accuracy reads it


# --------------------------------------------------------------------------- shaping of held-out episodes

HELD_SHAPING: list[float] = []
"""The shaping term each held-out episode of this process would have earned, in play order (an
evaluation plays every held-out record once, in file order)."""


class HeldOut:
    """Mixin of the suite's environments: on a held-out record (``held: true``) the turns'
    rewards are the target's alone, and the shaping term goes to :data:`HELD_SHAPING`."""

    def reset_held(self, record) -> None:
        self.held = bool(record.columns.get("held"))
        if self.held:
            HELD_SHAPING.append(0.0)

    def shaped(self, target: float, shaping: float) -> float:
        if self.held:
            HELD_SHAPING[-1] += shaping
            return target
        return target + shaping


# --------------------------------------------------------------------------- (f) guess: multi-turn

GUESS_ASK = (
    "I'm thinking of a whole number from 1 to {hi}. Guess it: reply with one number only. After each guess "
    "I'll tell you whether my number is higher or lower.",
    "Let's play a guessing game. My secret number is between 1 and {hi}. Answer with a single number each "
    "turn; I will say 'higher' or 'lower'.",
    "Guess my number (1-{hi}). Give only a number; I reply higher or lower until you find it.",
)


def guess_records() -> tuple[list[dict], list[dict]]:
    train, held = _split_keys([(hi, s) for hi in (10, 20) for s in range(1, hi + 1)], seed=6, held=11)
    def make(keys, is_held):
        return [_record(ask.format(hi=hi), secret=s, hi=hi, key=f"{hi}/{s}", held=is_held)
                for hi, s in keys for ask in GUESS_ASK]
    return make(train, False), make(held, True)


class GuessEnv(HeldOut, Environment):
    """Guess the record's secret in at most 5 turns, told "Higher." or "Lower." after a miss.
    Target: 1 when found. Shaping: 0.1 per turn that is a number in range alone, so a policy can
    earn up to 0.4 by playing a long game without ever finding the number."""

    max_turns, max_tokens = 5, 384
    bonus = 0.1

    def reset(self, record):
        self.secret, self.hi = int(record.columns["secret"]), int(record.columns["hi"])
        self.reset_held(record)
        return super().reset(record)

    def step(self, text):
        t = answer_of(text)
        valid = t.isdigit() and 1 <= int(t) <= self.hi
        shaping = self.bonus * valid
        found = re.search(r"\d+", text)
        if found and int(found.group()) == self.secret:
            return None, self.shaped(1.0, shaping), True
        if not found:
            return "Reply with one number.", self.shaped(0.0, shaping), False
        return ("Higher." if int(found.group()) < self.secret else "Lower."), self.shaped(0.0, shaping), False


# --------------------------------------------------------------------------- (g) calculator: a tool

CALC_ASK = (
    "What is {a} * {b}? Use the calculator tool, then answer with the number only.",
    "Multiply {a} by {b}. Call the calculator first; then reply with just the result.",
    "Use the calculator to find {a} times {b}, then give only the number.",
)
CALL_EXAMPLE = ' A call looks like <tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'


def calculator_records() -> tuple[list[dict], list[dict]]:
    rng = random.Random(7)
    pairs = sorted({(rng.randint(100, 999), rng.randint(11, 99)) for _ in range(400)})[:160]
    train, held = _split_keys(pairs, seed=7, held=HELD)
    def make(keys, is_held):
        return [_record(CALC_ASK[i % len(CALC_ASK)].format(a=a, b=b) + CALL_EXAMPLE.format(a=a, b=b),
                        answer=str(a * b), key=f"{a}*{b}", held=is_held) for i, (a, b) in enumerate(keys)]
    return make(train[:128], False), make(held, True)


class CalcEnv(HeldOut, CalculatorEnv):
    """``examples/real_model/calculator``'s environment: target 1 when the final turn is the
    product alone; shaping 0.2 for a tool call that ran."""

    def reset(self, record):
        self.reset_held(record)
        return super().reset(record)

    def step(self, text):
        obs, reward, done = super().step(text)  # reward: the target at the end, the shaping on a call that ran
        return (obs, self.shaped(reward, 0.0), done) if done else (obs, self.shaped(0.0, reward), done)


# --------------------------------------------------------------------------- the suite


@dataclass(frozen=True)
class SuiteTask:
    """One task: its records, its reward functions (names in this file: the target first, then
    the shaping term) and weights, or its environment; the completion (turn) length."""

    name: str
    records: Callable[[], tuple[list[dict], list[dict]]]
    rewards: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    env: type | None = None
    new_tokens: int = 16
    target: float = 0.5  # the held-out target rate that ends a run
    knows: str = field(default="", compare=False)  # a diagnostic source: the answer is known, whatever the form


TASKS = {t.name: t for t in (
    SuiteTask("capital", capital_records, ("capital_exact", "brevity"), (1.0, 1.0), target=0.4, knows="knows"),
    SuiteTask("number", number_records, ("number_exact", "has_number"), (1.0, 0.5), target=0.4, knows="knows"),
    SuiteTask("yesno", yesno_records, ("yesno_exact", "one_word"), (1.0, 0.5), target=0.75),
    SuiteTask("listing", listing_records, ("listing_exact", "listing_count"), (1.0, 0.5), new_tokens=24),
    SuiteTask("sentence", sentence_records, ("sentence_exact", "sentence_word"), (1.0, 0.5), new_tokens=24),
    SuiteTask("guess", guess_records, env=GuessEnv, new_tokens=8),
    SuiteTask("calculator", calculator_records, env=CalcEnv, new_tokens=48),
)}


def write(out: Path, task: SuiteTask) -> dict[str, str]:
    """The task's ``prompts.jsonl`` and ``held.jsonl`` under ``out`` (rewritten: the generator is
    deterministic); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in zip(("train", "held"), task.records()):
        path = out / ("prompts.jsonl" if name == "train" else "held.jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(path)
    return paths


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/real_tasks")
    for t in TASKS.values():
        p = write(root / t.name, t)
        print(f"{t.name}: {sum(1 for _ in open(p['train']))} training, {sum(1 for _ in open(p['held']))} held-out -> "
              f"{root / t.name}")
