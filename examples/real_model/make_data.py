"""Writes a task's files for a real chat model: prompts in TRL's conversational prompt-only
format with the answer column, split into training and held-out records.

    python examples/real_model/make_data.py OUT_DIR [--task cities|capitals]

``cities`` (the default): "In which country is the city of Jaipur? Answer with the country's name
only." (98 training, 32 held-out cities of the city-facts task). A one-word answer there must
name a country, so a brevity reward is hard to game. ``capitals``: "What is the capital of
Algeria? Answer with the city's name only." (82 training, 32 held-out countries): a short answer
can repeat the country instead ("Algeria."), so brevity can be bought by dropping the fact.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capitals import CAPITAL_OF  # noqa: E402

from rlhfkit.tasks.cities import COUNTRY_OF  # noqa: E402

TASKS = {
    "cities": ("In which country is the city of {}? Answer with the country's name only.", COUNTRY_OF),
    "capitals": ("What is the capital of {}? Answer with the city's name only.", CAPITAL_OF),
}


def main(out: Path, task: str = "cities") -> None:
    question, answers = TASKS[task]
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted(answers)
    random.Random(0).shuffle(keys)
    held, train = keys[:32], keys[32:]
    for name, part in (("prompts.jsonl", train), ("held.jsonl", held)):
        with open(out / name, "w", encoding="utf-8") as f:
            for key in part:
                rec = {"prompt": [{"role": "user", "content": question.format(key)}], "answer": answers[key]}
                f.write(json.dumps(rec) + "\n")
    print(f"{task}: {len(train)} training and {len(held)} held-out prompts in {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="runs/real_model/data", type=Path)
    p.add_argument("--task", choices=sorted(TASKS), default="cities")
    a = p.parse_args()
    main(a.out, a.task)
