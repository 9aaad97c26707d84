"""The calculator task's prompts: products of a 3-digit and a 2-digit number, 128 for training
and 32 held out (disjoint pairs), as conversational prompt records with an ``answer`` column;
and ``sft.jsonl``, tool-use demonstrations on the first N training pairs (``--sft N``): for each,
the call (system message offering the tool + question -> ``<tool_call>...</tool_call>``) and the
answer (... + the call + the tool's result -> the number alone), two records trained on their
last assistant turn each (run.sh sets sft.assistant_turns=last, so the call is trained once per
question). Usage: python make_data.py OUT_DIR [--sft N]"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from calculator import CalculatorEnv, calculator  # noqa: E402

from rlhfkit.envs.environment import tool_schemas, tools_message  # noqa: E402

ASK = "What is {a} * {b}? Use the calculator tool, then answer with the number only."
ASK_NO_TOOL = "What is {a} * {b}? Answer with the number only."


def pairs(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out: set[tuple[int, int]] = set()
    while len(out) < n:
        out.add((rng.randint(100, 999), rng.randint(11, 99)))
    return sorted(out, key=lambda p: rng.random())


def record(a: int, b: int, ask: str) -> dict:
    return {"prompt": [{"role": "user", "content": ask.format(a=a, b=b)}], "answer": str(a * b)}


def demonstrations(a: int, b: int) -> list[dict]:
    """The call and the answer of one question, as the environment renders them."""
    system = tools_message(tool_schemas(CalculatorEnv.tools))
    user = {"role": "user", "content": ASK.format(a=a, b=b)}
    expression = f"{a} * {b}"
    call = {"role": "assistant", "content": "<tool_call>" + json.dumps(
        {"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"}
    result = {"role": "tool", "name": "calculator", "content": calculator(expression)}
    final = {"role": "assistant", "content": str(a * b)}
    return [{"messages": [system, user, call]}, {"messages": [system, user, call, result, final]}]


def main(out: Path, sft: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    all_pairs = pairs(160, seed=0)
    splits = {"prompts.jsonl": (all_pairs[:128], ASK), "held.jsonl": (all_pairs[128:], ASK),
              "held_no_tool.jsonl": (all_pairs[128:], ASK_NO_TOOL)}
    for name, (ps, ask) in splits.items():
        with open(out / name, "w") as f:
            f.writelines(json.dumps(record(a, b, ask)) + "\n" for a, b in ps)
    with open(out / "sft.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for a, b in all_pairs[:sft] for r in demonstrations(a, b))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--sft", type=int, default=8, help="training pairs with tool-use demonstrations")
    args = ap.parse_args()
    main(args.out, args.sft)
