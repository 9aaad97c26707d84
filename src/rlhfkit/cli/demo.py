"""The built-in demo (docs/getting-started.md): pretrain -> reward model -> PPO (and any of GRPO,
RLOO, REINFORCE, DPO) from the same base -> evaluation, on ``run.task``. PPO writes the top of
``run.out_dir``, each other stage a folder of its own (``STAGES``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from ..config import ALGO_DEFAULTS, Config
from ..models.forward import load_policy
from ..rollout.evaluate import ACCURACIES, evaluate_task
from ..tasks import get_task
from ..trainers.dpo import train_dpo
from ..trainers.pretrain import pretrain
from ..trainers.reward import train_reward_model
from ..trainers.rl import train_rl
from ..trainers.rl_setup import check_critic_warmup
from ..utils import check_out_dir, clear_run_files, lock_run_dir, resolve_device
from .report import write_report

STAGES = ("pretrain", "reward", "grpo", "rloo", "reinforce", "dpo")  # the stages' folders (PPO: the top)


def _stage(cfg: Config, sub: str) -> Config:
    return cfg.replace(run={"out_dir": str(Path(cfg.run.out_dir) / sub)})


def start_demo_dir(cfg: Config) -> None:
    """Make ``run.out_dir`` ready for a fresh demo: an earlier demo (or any run under
    ``run.overwrite``) is replaced, another command's run refused."""
    out = Path(cfg.run.out_dir)
    replace = cfg.run.overwrite or (out / "pretrain" / "config.yaml").exists()
    if not replace:
        check_out_dir(cfg, resumable=False)
    lock_run_dir(out)  # refused while a live run holds it; taken before an earlier demo is cleared
    if replace:
        clear_run_files(out, extra=STAGES)


def parse_algos(spec: str) -> list[str]:
    algos = [a.strip() for a in spec.split(",") if a.strip()]
    known = [*ALGO_DEFAULTS, "dpo"]
    bad = [a for a in algos if a not in known]
    if not algos or bad:
        raise ValueError(f"demo.algos={spec!r}: choose a comma-separated list of {', '.join(known)}")
    return algos


def _table(rows: list[tuple[str, dict]]) -> str:
    return "\n".join([f"{'':<20}" + "".join(f"{m:>12}" for m in ACCURACIES),
                      *(f"{name:<20}" + "".join(f"{ev[m]:>12.4f}" for m in ACCURACIES) for name, ev in rows)])


def run_demo(cfg: Config) -> dict:
    """Run every stage; returns (and writes) ``summary.json``."""
    t_start = time.perf_counter()
    algos = parse_algos(cfg.demo.algos)
    if "ppo" in algos:  # before the pretraining, not after it
        check_critic_warmup(cfg.replace(ppo={"algo": "ppo"}).ppo)
    task = get_task(cfg.run.task)
    out = Path(cfg.run.out_dir)
    start_demo_dir(cfg)
    cfg = cfg.replace(run={"overwrite": False})  # each stage starts in a clean folder
    device = resolve_device(cfg.run.device)
    n_stages = 2 + len(algos)
    print(f"[rlhfkit demo] task {cfg.run.task}: pretrain -> reward model -> {', '.join(algos)}; writing to {out}/ "
          f"on {device}")

    pre = pretrain(_stage(cfg, "pretrain"))
    print(f"[1/{n_stages}] pretrained base in {pre['seconds']:.1f}s: format_acc={pre['format_acc']:.3f} "
          f"exact_acc={pre['exact_acc']:.3f} (right answer in any form: {pre['answer_acc']:.3f})")

    rm = train_reward_model(_stage(cfg, "reward"), policy_path=pre["path"])
    print(f"[2/{n_stages}] reward model in {rm['seconds']:.1f}s: held-out accuracy={rm['accuracy']:.3f} "
          f"delta={rm['delta']:.2f}")

    results, seconds = {}, {"pretrain": round(pre["seconds"], 2), "reward": round(rm["seconds"], 2)}
    for i, algo in enumerate(algos):
        stage = cfg if algo == "ppo" else _stage(cfg, algo)
        if algo == "dpo":
            res = train_dpo(stage, policy_path=pre["path"])
        else:
            rl = stage if stage.ppo.algo == algo else stage.replace(ppo={"algo": algo})
            res = train_rl(rl, policy_path=pre["path"], reward_path=rm["path"])
        print(f"[{3 + i}/{n_stages}] {algo}: {res['steps']} steps in {res['seconds']:.1f}s")
        results[algo], seconds[algo] = res, round(res["seconds"], 2)

    tok = AutoTokenizer.from_pretrained(pre["path"])
    prompts = task.eval_prompts()
    evals = {name: evaluate_task(task, load_policy(path).to(device), tok, device, cfg.eval.batch_size,
                                 cfg.eval.max_new_tokens, prompts, cfg.ppo.stop)
             for name, path in [("base", pre["path"]), *((a, r["path"]) for a, r in results.items())]}
    seconds["total"] = round(time.perf_counter() - t_start, 2)
    first = algos[0]
    summary = {
        "task": cfg.run.task,
        "base": {m: evals["base"][m] for m in ACCURACIES},
        "final": {m: evals[first][m] for m in ACCURACIES},  # the first algorithm (PPO by default)
        "algos": {a: {**{m: evals[a][m] for m in ACCURACIES}, "steps": r["steps"], "reached_target": r["reached"],
                      "saved_step": r.get("saved_step")}
                  for a, r in results.items()},
        "reward_model": {"accuracy": rm["accuracy"], "delta": rm["delta"]},
        "seconds": seconds,
        # the same held-out prompts answered by the base and by each tuned policy
        "examples": [{"prompt": p, "base": c, **{a: evals[a]["examples"][j][1] for a in results},
                      **{f"{a}_exact": evals[a]["examples"][j][3] for a in results}}
                     for j, (p, c, _f, _e) in enumerate(evals["base"]["examples"][:8])],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    print()
    print(_table([("base (pretrained)", evals["base"]), *((f"after {a}", evals[a]) for a in results)]))
    print(f"\nheld-out: {len(prompts)} prompts, greedy decoding; base -> {first}")
    for ex in summary["examples"][:4]:
        print(f"  {ex['prompt']!r}: {ex['base']!r} -> {ex[first]!r}  {'ok' if ex[first + '_exact'] else 'WRONG'}")
    report = write_report(out)
    print(f"\nsummary: {out / 'summary.json'}   plots: {out / 'plots.png' if 'ppo' in results else out}")
    print(f"report:  {report} (curves, samples, per-token trajectories; open it in a browser)")
    return summary
