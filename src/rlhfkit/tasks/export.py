"""A built-in task written out as the data files ``data.path`` reads (docs/data.md), drawn from
the generators the built-in route seeds with ``run.seed`` (plus each command's offset below), so
a run on the files sees the built-in run's data. Answers keep the task's EOS where its pairs do."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import Config
from ..utils import write_jsonl
from . import get_task

SFT_EXAMPLES = 2048  # as many as the sft command generates without data.path
RL_PROMPTS = 2048


def export_task(cfg: Config, out_dir: str | Path) -> dict:
    """Write ``run.task``'s data files to ``out_dir``; returns info.json's content."""
    name, seed = cfg.run.task, cfg.run.seed
    task = get_task(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def prompt_rows(prompts) -> list[dict]:
        return [{"prompt": p.text, **task.columns(p)} for p in prompts]

    def pair_rows(pairs) -> list[dict]:
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs]

    hard = cfg.reward.hard_negatives
    files = {
        "sft.jsonl": [{"prompt": p, "completion": c} for p, c in task.TaskData(seed + 4).sft_examples(SFT_EXAMPLES)],
        "prefs.jsonl": pair_rows(task.TaskData(seed + 3).preference_pairs(cfg.dpo.num_pairs, hard)),
        "prefs_eval.jsonl": pair_rows(task.held_out_pairs(cfg.reward.eval_pairs, seed)),
        "prompts.jsonl": prompt_rows(task.TaskData(seed + 2).prompts(RL_PROMPTS)),
        "eval_prompts.jsonl": prompt_rows(task.eval_prompts()),
        "pretrain.jsonl": [{"text": t} for t in
                           task.TaskData(seed).pretrain_texts(cfg.pretrain.steps * cfg.pretrain.batch_size)],
    }
    info = {"task": name, "seed": seed, "reward_function": f"{task.__name__}:exact_reward",
            "max_new_tokens": task.MAX_NEW_TOKENS,
            "files": {file: write_jsonl(out / file, rows) for file, rows in files.items()}}
    (out / "info.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return info
