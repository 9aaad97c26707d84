"""The built-in demo: pretrain -> reward model -> PPO -> evaluation on the doubling task.

Layout of ``run.out_dir`` (default ``runs/demo``)::

    config.yaml  metrics.jsonl  samples.jsonl  plots.png  plot_*.png   (PPO stage)
    policy/  value_model/ (or value_head.safetensors)                  (PPO models, HF format)
    pretrain/policy/   reward/reward_model/                             (earlier stages)
    summary.json                                                        (before/after + timings)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from .config import Config
from .evaluate import evaluate_doubling
from .models import load_policy
from .trainers.pretrain import pretrain
from .trainers.reward import train_reward_model
from .trainers.rl import train_rl
from .utils import resolve_device


def _stage(cfg: Config, sub: str) -> Config:
    return cfg.replace(run={"out_dir": str(Path(cfg.run.out_dir) / sub)})


def _table(base: dict, final: dict) -> str:
    rows = [("", "format_acc", "exact_acc"), ("base (pretrained)", base["format_acc"], base["exact_acc"]),
            ("after PPO", final["format_acc"], final["exact_acc"])]
    lines = []
    for name, a, b in rows:
        a = a if isinstance(a, str) else f"{a:.4f}"
        b = b if isinstance(b, str) else f"{b:.4f}"
        lines.append(f"{name:<20}{a:>12}{b:>12}")
    return "\n".join(lines)


def run_demo(cfg: Config) -> dict:
    """Run every stage; returns (and writes) ``summary.json``."""
    t_start = time.perf_counter()
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.run.device)
    print(f"[rlhfkit demo] writing to {out}/ on {device}")

    pre = pretrain(_stage(cfg, "pretrain"))
    print(f"[1/3] pretrained base in {pre['seconds']:.1f}s: format_acc={pre['format_acc']:.3f} "
          f"exact_acc={pre['exact_acc']:.3f} (doubles correctly in some set: {pre['answer_acc']:.3f})")

    rm = train_reward_model(_stage(cfg, "reward"), policy_path=pre["path"])
    print(f"[2/3] reward model in {rm['seconds']:.1f}s: held-out accuracy={rm['accuracy']:.3f} delta={rm['delta']:.2f}")

    ppo = train_rl(cfg, policy_path=pre["path"], reward_path=rm["path"])
    print(f"[3/3] PPO: {ppo['steps']} steps in {ppo['seconds']:.1f}s")

    tok = AutoTokenizer.from_pretrained(ppo["path"])
    final_policy = load_policy(ppo["path"]).to(device)
    final = evaluate_doubling(final_policy, tok, device, cfg.eval.batch_size, cfg.eval.max_new_tokens)
    summary = {
        "base": {"format_acc": pre["format_acc"], "exact_acc": pre["exact_acc"], "answer_acc": pre["answer_acc"]},
        "final": {"format_acc": final["format_acc"], "exact_acc": final["exact_acc"], "answer_acc": final["answer_acc"]},
        "reward_model": {"accuracy": rm["accuracy"], "delta": rm["delta"]},
        "ppo": {"steps": ppo["steps"], "reached_target": ppo["reached"]},
        "seconds": {"pretrain": round(pre["seconds"], 2), "reward": round(rm["seconds"], 2),
                    "ppo": round(ppo["seconds"], 2), "total": round(time.perf_counter() - t_start, 2)},
        "examples": [{"prompt": p, "completion": c, "exact": e} for p, c, _f, e in final["examples"][:6]],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    print()
    print(_table(summary["base"], summary["final"]))
    print(f"\nheld-out: {len(final['examples'])} prefixed prompts, greedy decoding")
    for ex in summary["examples"][:3]:
        print(f"  S{ex['prompt']} -> {ex['completion']}  {'ok' if ex['exact'] else 'WRONG'}")
    print(f"\nsummary: {out / 'summary.json'}   plots: {out / 'plots.png'}")
    return summary
