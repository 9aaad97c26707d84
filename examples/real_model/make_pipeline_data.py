"""Writes the files of the whole pipeline (SFT -> reward model -> PPO / GRPO / DPO) for the
city-country task on a real chat model, all in TRL's conversational formats:

    sft.jsonl          {"prompt": [user], "completion": [assistant]}: the country's name alone
    prefs.jsonl        {"prompt": [user], "chosen": [assistant], "rejected": [assistant]}
    prefs_eval.jsonl   the same on the held-out cities
    prompts.jsonl      {"prompt": [user], "answer": country}: the RL prompts
    held.jsonl         the same on the held-out cities (every evaluation reads these)

The held-out cities are those of ``make_data.py`` (the same 32); the demonstrations cover
``--sft`` of the 98 training cities. A preference pair prefers the country's name alone to the
answer the base model gives (a whole sentence naming the country) and to a wrong country (alone
or in a sentence), so a reward model learns both the format and, where it can, the fact.

    python examples/real_model/make_pipeline_data.py OUT_DIR [--sft N]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rlhfkit.tasks.cities import COUNTRIES, COUNTRY_OF

QUESTION = "In which country is the city of {city}? Answer with the country's name only."
SENTENCES = ("The city of {city} is located in {country}.", "{city} is a city in {country}.",
             "{city} is located in {country}.", "The city of {city} is in {country}.")


def user(city: str) -> list[dict]:
    return [{"role": "user", "content": QUESTION.format(city=city)}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def pairs(city: str, rng: random.Random) -> list[dict]:
    """Two pairs per city: the name alone over a sentence with the right country, and over a wrong
    country (alone or in a sentence, one of each at random)."""
    right = COUNTRY_OF[city]
    wrong = rng.choice(sorted(c for c in COUNTRIES if c != right))
    sentence = rng.choice(SENTENCES)
    wrong_answer = wrong if rng.random() < 0.5 else rng.choice(SENTENCES).format(city=city, country=wrong)
    return [{"prompt": user(city), "chosen": assistant(right), "rejected": assistant(r)}
            for r in (sentence.format(city=city, country=right), wrong_answer)]


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(out: Path, n_sft: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cities = sorted(COUNTRY_OF)
    random.Random(0).shuffle(cities)  # the split of make_data.py
    held, train = cities[:32], cities[32:]
    rng = random.Random(1)
    write(out / "sft.jsonl", [{"prompt": user(c), "completion": assistant(COUNTRY_OF[c])} for c in train[:n_sft]])
    write(out / "prefs.jsonl", [p for c in train for p in pairs(c, rng)])
    write(out / "prefs_eval.jsonl", [p for c in held for p in pairs(c, rng)])
    for name, part in (("prompts.jsonl", train), ("held.jsonl", held)):
        write(out / name, [{"prompt": user(c), "answer": COUNTRY_OF[c]} for c in part])
    print(f"{n_sft} demonstrations, {2 * len(train)} + {2 * len(held)} preference pairs, "
          f"{len(train)} training and {len(held)} held-out prompts in {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/real_pipeline/data")
    ap.add_argument("--sft", type=int, default=32, help="training cities with a demonstration")
    args = ap.parse_args()
    main(Path(args.out), args.sft)
