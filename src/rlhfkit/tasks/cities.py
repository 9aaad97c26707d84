"""The city-facts task (docs/getting-started.md): "Where is Pune? " -> "Pune is in India.$" for
130 cities. The base knows each city's country but mostly answers tersely; tuning must teach
the full sentence without losing the facts. Each city is evaluated in a question form that no
tuning prompt uses for it (held-out whole cities would test the entity, not the form)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import char_tokenizer, verified

if TYPE_CHECKING:  # importing the task stays light: the command line reads CONFIG_DEFAULTS before torch
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "^", "$", "~"
COUNTRIES: dict[str, tuple[str, ...]] = {country: tuple(cities.split()) for country, cities in {
    "India": "Pune Delhi Mumbai Chennai Kolkata Jaipur Lucknow Surat Indore Nagpur",
    "China": "Beijing Shanghai Wuhan Chengdu Xian Nanjing Tianjin Suzhou Harbin Kunming",
    "Japan": "Tokyo Osaka Kyoto Nagoya Sapporo Kobe Fukuoka Sendai Nara Yokohama",
    "France": "Paris Lyon Marseille Nice Lille Nantes Bordeaux Toulouse Rennes Dijon",
    "Germany": "Berlin Munich Hamburg Cologne Bonn Dresden Leipzig Stuttgart Bremen Hanover",
    "Italy": "Rome Milan Naples Turin Florence Venice Bologna Genoa Palermo Verona",
    "Spain": "Madrid Barcelona Seville Valencia Bilbao Malaga Granada Toledo Cordoba Zaragoza",
    "Brazil": "Recife Salvador Manaus Curitiba Fortaleza Belem Natal Brasilia Santos Goiania",
    "Mexico": "Puebla Oaxaca Cancun Tijuana Merida Leon Toluca Monterrey Guadalajara Acapulco",
    "Canada": "Toronto Montreal Vancouver Ottawa Calgary Edmonton Winnipeg Halifax Quebec Regina",
    "Egypt": "Cairo Giza Luxor Aswan Alexandria Suez Tanta Asyut Ismailia Faiyum",
    "Kenya": "Nairobi Mombasa Kisumu Nakuru Eldoret Malindi Thika Garissa Kitale Lamu",
    "Peru": "Lima Cusco Arequipa Trujillo Piura Iquitos Chiclayo Huancayo Tacna Puno",
}.items()}
COUNTRY_OF: dict[str, str] = {city: c for c, cities in COUNTRIES.items() for city in cities}
# the city always ends the question: the answer starts by copying it, which a tiny model learns
# reliably only when the copy source sits right before the answer
QUESTIONS = ("Where is {city}? ", "Where is the city of {city}? ", "In which country is {city}? ")
STATEMENTS = ("{city} is a city in {country}.", "The city of {city} lies in {country}.", "{city} ({country})",
              "{country} has a city called {city}.")
# answer styles in pretraining text and their shares: the terse one dominates, so the base
# model's greedy answer is ``India.``; the full sentence is the target
STYLES = (("terse", 0.4), ("sentence", 0.3), ("pronoun", 0.15), ("wrong", 0.15))
# held-out prompts: every city is asked in one question form that no tuning prompt (RM, RL, DPO,
# SFT) uses; tuning asks about it in the other two forms
HELD_OUT_FORM: dict[str, int] = {city: i % len(QUESTIONS) for i, city in enumerate(COUNTRY_OF)}
TUNING_PROMPTS: tuple[tuple[str, int], ...] = tuple(
    (city, t) for city in COUNTRY_OF for t in range(len(QUESTIONS)) if t != HELD_OUT_FORM[city])
MAX_NEW_TOKENS = 32  # longest answer: 'Guadalajara is in Mexico.$' is 26
N_POSITIONS = 96
# applied by the command line before the user's file and overrides (see rlhfkit.cli.main): a wider,
# deeper model than the doubling task's (it must store 130 facts and copy names), gentler RL
CONFIG_DEFAULTS = {
    "model": {"n_layer": 3, "n_embd": 96},
    "pretrain": {"steps": 600},
    "reward": {"steps": 300},
    # few steps: tuning over-optimises the imperfect reward model (and DPO its pairs) after them
    "ppo": {"lr": 1e-4, "steps": 20, "stop_at": 0.0, "eval_every": 10},
    "dpo": {"lr": 3e-4, "steps": 50, "eval_every": 25},
    "demo": {"algos": "ppo,grpo,dpo"},
}
VOCAB = [PAD, BOS, EOS, *sorted(set("".join(COUNTRY_OF) + "".join(COUNTRIES) + "".join(QUESTIONS + STATEMENTS)
                                    + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .?,()'")
                                - {"{", "}"})]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of the task's alphabet; ``^`` BOS (added), ``$`` EOS, ``~`` pad."""
    return char_tokenizer(VOCAB, BOS, EOS, PAD, N_POSITIONS)


def answer_text(city: str, country: str | None = None) -> str:
    """The target completion, EOS included: ``'Pune is in India.$'``."""
    return f"{city} is in {country or COUNTRY_OF[city]}.{EOS}"


@dataclass(frozen=True)
class Prompt:
    city: str
    template: int = 0  # index into QUESTIONS

    @property
    def text(self) -> str:
        return QUESTIONS[self.template].format(city=self.city)

    @property
    def country(self) -> str:
        return COUNTRY_OF[self.city]


def columns(prompt: Prompt) -> dict:
    """The columns a record of this prompt carries (what :func:`exact_reward` reads)."""
    return {"city": prompt.city, "country": prompt.country}


def eval_prompts() -> list[Prompt]:
    """Fixed evaluation set: every city in its held-out question form (130 prompts)."""
    return [Prompt(city, t) for city, t in HELD_OUT_FORM.items()]


class CitiesData:
    """Seeded generators of training data; tuning prompts never use a held-out question form."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def _answer(self, city: str, style: str) -> str:
        if style == "wrong":
            return answer_text(city, self.rng.choice([c for c in COUNTRIES if c != COUNTRY_OF[city]]))
        country = COUNTRY_OF[city]
        return {"terse": f"{country}.{EOS}", "sentence": answer_text(city), "pronoun": f"It is in {country}.{EOS}"}[style]

    def pretrain_texts(self, n: int) -> list[str]:
        """Statements (35%) and question-answer lines (65%) about all 130 cities, no BOS."""
        names, weights = zip(*STYLES)
        out = []
        for _ in range(n):
            city = self.rng.choice(list(COUNTRY_OF))
            if self.rng.random() < 0.35:
                out.append(self.rng.choice(STATEMENTS).format(city=city, country=COUNTRY_OF[city]) + EOS)
            else:
                style = self.rng.choices(names, weights)[0]
                out.append(self.rng.choice(QUESTIONS).format(city=city) + self._answer(city, style))
        return out

    def prompts(self, n: int) -> list[Prompt]:
        """Tuning questions (never a held-out city/form pair), for RL."""
        return [Prompt(*self.rng.choice(TUNING_PROMPTS)) for _ in range(n)]

    def _garble(self, text: str) -> str:
        """One to three characters of ``text`` replaced by other random letters."""
        chars = list(text)
        for i in self.rng.sample(range(len(chars)), self.rng.randint(1, min(3, len(chars)))):
            chars[i] = self.rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != chars[i]])
        return "".join(chars)

    def preference_pairs(self, n: int, hard: float = 0.5) -> list[tuple[str, str, str]]:
        """``(prompt, chosen, rejected)``, chosen the full sentence with the right country; rejected,
        with probability ``1 - hard``, the sentence with a wrong country (the facts matter), else a
        form negative: terse, pronoun, no EOS, another city, or garbled (without garbled negatives
        a reward model scores misspelt sentences well and PPO learns to write them)."""
        out = []
        for p in self.prompts(n):
            chosen = answer_text(p.city)
            if self.rng.random() >= hard:
                rejected = self._answer(p.city, "wrong")
            else:
                kind = self.rng.choice(("terse", "pronoun", "no_eos", "other_city", "garbled"))
                if kind == "no_eos":
                    rejected = chosen[:-1]
                elif kind == "other_city":
                    rejected = answer_text(self.rng.choice([c for c in COUNTRY_OF if c != p.city]))
                elif kind == "garbled":
                    rejected = self._garble(chosen[:-1]) + EOS
                else:
                    rejected = self._answer(p.city, kind)
            out.append((p.text, chosen, rejected))
        return out

    def sft_examples(self, n: int) -> list[tuple[str, str]]:
        """``(prompt, completion)`` demonstrations on tuning prompts (completion without EOS)."""
        return [(p.text, answer_text(p.city)[:-1]) for p in self.prompts(n)]


TaskData = CitiesData


def held_out_pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
    """Preference pairs on the evaluation prompts (question forms never tuned on): the right
    sentence vs a wrong country or a terse answer."""
    rng, prompts, out = random.Random(seed), eval_prompts(), []
    for i in range(n):
        p = prompts[i % len(prompts)]
        rejected = answer_text(p.city, rng.choice([c for c in COUNTRIES if c != p.country])) if rng.random() < 0.5 \
            else f"{p.country}.{EOS}"
        out.append((p.text, answer_text(p.city), rejected))
    return out


_SENTENCE = re.compile(r"(?P<city>[A-Z][a-z]+) is in (?P<country>[A-Z][a-z]+)\.")


def verify(prompt: Prompt, completion: str) -> dict[str, bool]:
    """Score one completion (decoded, special tokens kept): ``format``, exactly ``<the city> is in
    <a country>.`` then EOS; ``exact``, that with the right country; ``answer``, the right country
    named before EOS (the knowledge alone)."""
    return _verify(prompt.city, prompt.country, completion)


def _verify(city: str, country: str, completion: str) -> dict[str, bool]:
    ended = EOS in completion
    answer = completion.split(EOS, 1)[0]
    m = _SENTENCE.fullmatch(answer)
    fmt = ended and m is not None and m["city"] == city and m["country"] in COUNTRIES
    exact = fmt and m["country"] == country
    answer_ok = ended and re.search(rf"\b{country}\b", answer) is not None
    return {"format": fmt, "exact": exact, "answer": answer_ok}


def parse_prompt(text: str) -> Prompt:
    """``'Where is Pune? '`` (BOS optional) -> ``Prompt('Pune', 0)``."""
    body = text.removeprefix(BOS)
    for i, q in enumerate(QUESTIONS):
        head, tail = q.split("{city}")
        if body.startswith(head) and body.endswith(tail):
            city = body[len(head) : len(body) - len(tail)]
            if city in COUNTRY_OF:
                return Prompt(city, i)
    raise ValueError(f"prompt {text!r} is not a city question of this task (e.g. {QUESTIONS[0].format(city='Pune')!r})")


def exact_reward(prompts: list[str], completions: list[str], city: list | None = None, country: list | None = None,
                 finished: list | None = None, **columns) -> list[float]:
    """Reward callable: 1 for the full sentence with the right country (columns ``city`` and
    ``country`` when given, else the parsed prompt; with ``finished``, only ended answers count)."""
    asked = [(q.city, q.country) for q in map(parse_prompt, prompts)] if city is None else list(zip(city, country))
    return verified(lambda target, text: _verify(*target, text), "exact", asked, completions, finished, EOS)


# verifiers score 0 or 1: declared, so eval/accuracy comes from them (rlhfkit.rollout.rewards)
exact_reward.binary = True
