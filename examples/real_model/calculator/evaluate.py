"""Held-out accuracy of greedy episodes on the calculator task: the final turn is the product
alone. Usage: python evaluate.py MODEL_DIR HELD.jsonl [--no-tool] [--show N] [--limit N]

With the tool, the episode is played as ``rlhfkit grpo env.class=...`` plays it (the tool schemas
in a system message, SmolLM2's template ignoring ``tools``; at most ``max_turns`` turns);
``--no-tool`` offers no tool: one turn, scored the same way. Prints accuracy, the share of
episodes with a call that ran, the share whose last turn holds the product anywhere
(format aside), and the first N episodes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from calculator import CalculatorEnv  # noqa: E402

from rlhfkit.data.prompts import PromptRecord  # noqa: E402
from rlhfkit.envs.environment import tool_schemas, tools_message  # noqa: E402
from rlhfkit.envs.tools import ToolCall, parse_tool_call  # noqa: E402


@torch.no_grad()
def turn(model, tok, messages, max_new_tokens: int) -> str:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def episode(model, tok, row: dict, tool: bool, max_new_tokens: int) -> tuple[float, bool, list[dict]]:
    env = CalculatorEnv()
    messages = env.reset(PromptRecord(text="", columns={"answer": row["answer"]}, prompt=row["prompt"]))
    if tool:
        messages = [tools_message(tool_schemas(env.tools))] + messages
    called = False
    for _ in range(env.max_turns if tool else 1):
        text = turn(model, tok, messages, max_new_tokens)
        messages.append({"role": "assistant", "content": text})
        if not tool:
            return env.reward(text), False, messages
        obs, reward, done = env.step(text)
        called |= isinstance(parse_tool_call(text), ToolCall) and bool(reward)
        if done:
            return reward, called, messages
        messages.append(obs)
    return 0.0, called, messages  # out of turns without a final answer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("held")
    ap.add_argument("--no-tool", action="store_true")
    ap.add_argument("--show", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    rows = [json.loads(line) for line in open(args.held)][: args.limit]
    t0 = time.process_time()
    results = [episode(model, tok, r, not args.no_tool, args.max_new_tokens) for r in rows]
    for _, _, messages in results[: args.show]:
        print(json.dumps(messages[1 if not args.no_tool else 0:], ensure_ascii=False))
    acc = sum(r for r, _, _ in results) / len(rows)
    calls = sum(c for _, c, _ in results) / len(rows)
    # the product anywhere in the last turn, format aside: whether the number itself was right
    contains = sum(r["answer"] in m[-1]["content"].replace(",", "") for r, (_, _, m) in zip(rows, results)) / len(rows)
    print(json.dumps({"model": args.model, "tool": not args.no_tool, "n": len(rows), "accuracy": acc,
                      "contains": contains, "call_rate": calls, "cpu_s": round(time.process_time() - t0, 1)}))


if __name__ == "__main__":
    main()
