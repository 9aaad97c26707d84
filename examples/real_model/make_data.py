"""Writes the city-country task's files for a real chat model: prompts (TRL's conversational
prompt-only format, with the answer column) split into training and held-out cities.

    python examples/real_model/make_data.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from rlhfkit.tasks.cities import COUNTRY_OF

QUESTION = "In which country is the city of {city}? Answer with the country's name only."


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cities = sorted(COUNTRY_OF)
    random.Random(0).shuffle(cities)
    held, train = cities[:32], cities[32:]
    for name, part in (("prompts.jsonl", train), ("held.jsonl", held)):
        with open(out / name, "w", encoding="utf-8") as f:
            for city in part:
                rec = {"prompt": [{"role": "user", "content": QUESTION.format(city=city)}], "answer": COUNTRY_OF[city]}
                f.write(json.dumps(rec) + "\n")
    print(f"{len(train)} training and {len(held)} held-out prompts in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/real_model/data"))
