"""Do the commands' defaults keep a pretrained chat model's general answers?

Two short fine-tunings of SmolLM2-135M-Instruct (``rlhfkit fetch-model smollm2-135m-instruct``),
each with the command's defaults but for its length and batch:

* ``sft``: 10 steps of 4 rows on 24 chat records whose answers are one word (a colour);
* ``dpo``: 10 steps of 8 pairs on 8 preference pairs that prefer a one-word colour to a sentence.

Before and after each, the model answers a few prompts unrelated to that data (the capital of
France, one sentence about the sea, 2+2, ...) by greedy decoding through its chat template
(``transformers``' own ``generate``, not rlhfkit's). A learning rate meant for a model trained
from scratch turns every answer into one word; one meant for fine-tuning a pretrained model
keeps the answers. Each prompt is one row of ``benchmarks/results/pretrained_defaults.jsonl``:
commit, date, CPU, scenario, command, the learning-rate line the command printed (if any), the
prompt and the answers before and after.

    taskset -c 1 env OMP_NUM_THREADS=1 python benchmarks/pretrained_defaults.py [--scenarios sft dpo]

``tests/test_real_learning.py`` (``make test-real``) runs the same two scenarios and checks the
answers stay sane.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import commit, cpu, pinned_cmd  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pretrained_defaults.jsonl"

# (question, one-word answer): the SFT demonstrations; the first 8 make the DPO pairs
COLOURS = [
    ("What colour is the sky on a clear day?", "Blue"), ("What colour is grass?", "Green"),
    ("What colour is a ripe banana?", "Yellow"), ("What colour is snow?", "White"),
    ("What colour is coal?", "Black"), ("What colour is a ripe tomato?", "Red"),
    ("What colour is an orange?", "Orange"), ("What colour are most violets?", "Purple"),
    ("What colour is milk?", "White"), ("What colour is a lemon?", "Yellow"),
    ("What colour is a fire engine?", "Red"), ("What colour is a crow?", "Black"),
    ("What colour is the sea on a sunny day?", "Blue"), ("What colour is a lime?", "Green"),
    ("What colour is chocolate?", "Brown"), ("What colour is a flamingo?", "Pink"),
    ("What colour is a pumpkin?", "Orange"), ("What colour is a polar bear?", "White"),
    ("What colour is a frog?", "Green"), ("What colour is a strawberry?", "Red"),
    ("What colour is wet sand?", "Brown"), ("What colour is a plum?", "Purple"),
    ("What colour is a blueberry?", "Blue"), ("What colour is gold?", "Yellow"),
]
# prompts unrelated to the training data: a kept model answers them as its base did
PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.", "What is 2+2?",
           "Name three animals that live in the ocean.")
SCENARIOS = {
    "sft": ["sft", "sft.steps=10", "sft.batch_size=4"],
    "dpo": ["dpo", "dpo.steps=10", "dpo.batch_size=8"],
}


def write_data(out: Path) -> dict[str, Path]:
    """The two scenarios' files in TRL's conversational formats: ``{'sft': sft.jsonl, 'dpo': prefs.jsonl}``."""
    out.mkdir(parents=True, exist_ok=True)

    def turn(role: str, text: str) -> list[dict]:
        return [{"role": role, "content": text}]

    sft = [{"messages": turn("user", q) + turn("assistant", a)} for q, a in COLOURS]
    prefs = [{"prompt": turn("user", q), "chosen": turn("assistant", a),
              "rejected": turn("assistant", f"The answer is {a.lower()}, which is a colour you see every day.")}
             for q, a in COLOURS[:8]]
    paths = {"sft": out / "sft.jsonl", "dpo": out / "prefs.jsonl"}
    for name, rows in (("sft", sft), ("dpo", prefs)):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def greedy_answers(model_dir: str | Path, prompts=PROMPTS, max_new_tokens: int = 48) -> list[str]:
    """Each prompt answered by the model at ``model_dir`` through its chat template, greedily,
    with ``transformers``' ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        answers.append(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return answers


def scenario_args(name: str, model_dir: str, data: dict[str, Path], out_dir: Path) -> list[str]:
    """The command line of scenario ``name``: the command's defaults but for length and batch."""
    return [*SCENARIOS[name], f"model.name={model_dir}", f"data.path={data[name]}", f"run.out_dir={out_dir}",
            "accel.threads=1", "run.progress=false", "run.overwrite=true"]


def run_scenario(name: str, model_dir: str, data: dict[str, Path], work: Path, core: int) -> dict:
    """Run the command; its policy directory, the learning-rate line it printed and its seconds."""
    args = scenario_args(name, model_dir, data, work / name)
    start = time.perf_counter()
    proc = subprocess.run(pinned_cmd(core, "-m", "rlhfkit", *args), capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"rlhfkit {name} failed:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("learning rates:")]
    return {"policy": str(work / name / "policy"), "command": "rlhfkit " + " ".join(SCENARIOS[name]),
            "learning_rates": lines[0] if lines else "", "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--core", type=int, default=1, help="the core the commands are pinned to")
    ap.add_argument("--out", default=str(RESULTS), help="JSONL file the rows are appended to")
    args = ap.parse_args()
    from rlhfkit.cli import fetch

    model_dir = fetch.fetch_model("smollm2-135m-instruct")["dir"]
    at, date = commit(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    before = greedy_answers(model_dir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp) / "data")
        for name in args.scenarios:
            ran = run_scenario(name, model_dir, data, Path(tmp), args.core)
            after = greedy_answers(ran["policy"])
            with open(args.out, "a", encoding="utf-8") as fh:
                for prompt, b, a in zip(PROMPTS, before, after):
                    row = {"commit": at, "date": date, "cpu": cpu(), "scenario": name, "command": ran["command"],
                           "learning_rates": ran["learning_rates"], "seconds": ran["seconds"], "prompt": prompt,
                           "before": b, "after": a}
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                    print(f"[{name}] {prompt!r}\n  before: {b!r}\n  after:  {a!r}", flush=True)


if __name__ == "__main__":
    main()
