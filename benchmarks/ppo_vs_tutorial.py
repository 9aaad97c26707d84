"""rlhfkit PPO vs the number-doubling tutorial's PPO design, side by side, on one CPU core.

Both start from the same pretrained doubling base and the same reward model and stop when
greedy exact accuracy on the 512 held-out prefixed prompts reaches the target (0.99). Time
counts training only (rollout + experience + update); evaluation every few steps is not
counted for either contender.

The baseline re-implements the number-doubling tutorial's *design* with this package's core
math: ``model.generate`` rollouts, a value head with dropout sharing the actor's backbone,
KL coefficient 0.2 in the reward, gamma 0.95, lambda 1, whitened advantages, and -- the
part that makes it slow -- four epochs of **one sample per optimizer step** (Adam, lr 1e-5),
i.e. 256 updates per batch of 64 prompts.

    python benchmarks/ppo_vs_tutorial.py                 # full run (baseline may take ~10+ min)
    python benchmarks/ppo_vs_tutorial.py --baseline-budget 300   # cap the baseline's training time

If the baseline does not reach the target within its budget, the ratio printed is a lower
bound (budget / rlhfkit time).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import add_record_args, code_version, peak_rss_mib, pin_to_core, prepare, record  # noqa: E402


def run_rlhfkit(base: str, rm: str, out: Path, seed: int, target: float, max_steps: int) -> dict:
    from rlhfkit.config import Config
    from rlhfkit.trainers.rl import train_rl

    cfg = Config().replace(run={"out_dir": str(out / "rlhfkit_ppo"), "seed": seed, "progress": False,
                                "overwrite": True},
                           ppo={"stop_at": target, "steps": max_steps})
    res = train_rl(cfg, base, rm)
    reached = res["reached"]
    return {"name": f"rlhfkit PPO (minibatches of {cfg.ppo.minibatch_size})", "steps": res["steps"], "train_s": res["seconds"],
            "reached": reached is not None, "s_per_step": res["seconds"] / res["steps"],
            "final_exact": res["final"].get("eval/exact_acc")}


class TutorialActorCritic(torch.nn.Module):
    """The tutorial's model: the LM plus a dropout + linear value head on its last hidden state."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.value_head = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(policy.config.n_embd, 1))

    def forward(self, ids, mask, P):
        from rlhfkit.models.forward import position_ids_from_mask

        hidden = self.policy.base_model(input_ids=ids, attention_mask=mask,
                                        position_ids=position_ids_from_mask(mask)).last_hidden_state
        hidden = hidden[:, P - 1 : -1]  # [B, R, H]
        return self.policy.get_output_embeddings()(hidden), self.value_head(hidden).squeeze(-1)


def run_tutorial_design(base: str, rm_path: str, seed: int, target: float, budget_s: float, eval_every: int) -> dict:
    from transformers import AutoTokenizer

    from rlhfkit.core import (
        gae,
        kl_estimate,
        logprobs_from_logits,
        masked_mean,
        masked_whiten,
        shaped_rewards,
    )
    from rlhfkit.models.forward import freeze, load_policy, load_scalar_model, sequence_scores
    from rlhfkit.rollout.evaluate import evaluate_task
    from rlhfkit.rollout.generate import tokenize_prompts
    from rlhfkit.tasks import doubling

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = TutorialActorCritic(load_policy(base)).train()
    ref = freeze(TutorialActorCritic(load_policy(base)))
    rm = freeze(load_scalar_model(rm_path))
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    data = doubling.DoublingData(seed + 2)
    train_s, step, reached, exact = 0.0, 0, False, None
    while train_s < budget_s:
        t0 = time.perf_counter()
        ids, mask = tokenize_prompts(tok, [p.text for p in data.prompts(64)], "cpu")
        P = ids.shape[1]
        with torch.no_grad():
            seq = model.policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                        max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            resp = seq[:, P:]
            is_eos = resp == tok.eos_token_id
            after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
            rmask = (~after_eos).long()
            full_mask = torch.cat([mask, rmask], 1)
            logits, values = model(seq, full_mask, P)
            old_lp = logprobs_from_logits(logits, resp)
            ref_logits, _ = ref(seq, full_mask, P)
            ref_lp = logprobs_from_logits(ref_logits, resp)
            score = sequence_scores(rm, seq, full_mask)
            rewards = shaped_rewards(score, kl_estimate(old_lp, ref_lp, "k1"), rmask, 0.2)
            adv, returns = gae(rewards, values, rmask, gamma=0.95, lam=1.0)
            adv = masked_whiten(adv, rmask)
        for _ in range(4):
            for i in range(64):  # one sample per optimizer step: the tutorial's loop
                sl = slice(i, i + 1)
                lg, v = model(seq[sl], full_mask[sl], P)
                ratio = torch.exp(logprobs_from_logits(lg, resp[sl]) - old_lp[sl])
                pg = masked_mean(torch.maximum(-adv[sl] * ratio, -adv[sl] * ratio.clamp(0.8, 1.2)), rmask[sl])
                v_clip = values[sl] + (v - values[sl]).clamp(-0.2, 0.2)
                vf = 0.5 * masked_mean(torch.maximum((v - returns[sl]) ** 2, (v_clip - returns[sl]) ** 2), rmask[sl])
                (pg + 0.1 * vf).backward()
                opt.step()
                opt.zero_grad()
        train_s += time.perf_counter() - t0
        step += 1
        if step % eval_every == 0:
            exact = evaluate_task(doubling, model.policy, tok, "cpu")["exact_acc"]
            print(f"  tutorial design: step {step}  train {train_s:6.1f}s  exact {exact:.3f}", flush=True)
            if exact >= target:
                reached = True
                break
    return {"name": "tutorial design (1 sample/update)", "steps": step, "train_s": train_s, "reached": reached,
            "s_per_step": train_s / max(step, 1), "final_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench_tutorial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--baseline-budget", type=float, default=900.0, help="max training seconds for the baseline")
    ap.add_argument("--eval-every", type=int, default=5)
    add_record_args(ap)
    args = ap.parse_args()
    pin_to_core(0)
    at = code_version()  # the code measured, whatever is checked out when the run ends
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(args.out)
    paths = prepare(out, args.seed)
    base, rm = paths["base"], paths["rm"]
    print("rlhfkit PPO ...", flush=True)
    ours = run_rlhfkit(base, rm, out, args.seed, args.target, max_steps=300)
    print(f"  reached={ours['reached']} in {ours['train_s']:.1f}s ({ours['steps']} steps)", flush=True)
    print("tutorial design ...", flush=True)
    theirs = run_tutorial_design(base, rm, args.seed, args.target, args.baseline_budget, args.eval_every)
    rows = [ours, theirs]
    for contender, r in (("rlhfkit_ppo", ours), ("tutorial_design", theirs)):
        record("ppo_vs_tutorial", {"contender": contender, "settings": {"target": args.target,
                                                                        "eval_every": args.eval_every,
                                                                        "baseline_budget_s": args.baseline_budget},
                                   "seeds": [args.seed], "times_s": [r["train_s"]], "rollouts": r["steps"],
                                   "reached": r["reached"], "final_exact": r["final_exact"],
                                   "peak_mib": peak_rss_mib(), "peak_of": "the process, both contenders"},
               args, at=at)
    cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"\nPPO time to exact_acc >= {args.target} (greedy, 512 held-out prompts); 1 core pinned "
          f"(nproc sees {cpu}), torch threads {torch.get_num_threads()}, seed {args.seed}")
    print(f"{'contender':<36}{'s/step':>8}{'steps':>7}{'train s':>10}{'reached':>9}{'final exact':>13}")
    for r in rows:
        fe = "-" if r["final_exact"] is None else f"{r['final_exact']:.3f}"
        print(f"{r['name']:<36}{r['s_per_step']:>8.3f}{r['steps']:>7}{r['train_s']:>10.1f}{str(r['reached']):>9}{fe:>13}")
    ratio = theirs["train_s"] / ours["train_s"]
    bound = "" if theirs["reached"] else " (lower bound: the baseline had not reached the target)"
    print(f"\nspeed-up of rlhfkit over the tutorial design: {ratio:.1f}x{bound}")
    print(f"per-step speed-up: {theirs['s_per_step'] / ours['s_per_step']:.1f}x")


if __name__ == "__main__":
    main()
