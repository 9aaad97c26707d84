"""The grid-world cat as a text environment: a language model from scratch against tabular REINFORCE.

Both learners face the same world (rlhfkit.tasks.gridworld's default layout, no drunk moves,
20 moves per episode) and stop once the greedy policy reaches the meat on the best path
(return 99: five moves, one broom). Counted: episodes sampled until then.

* the language model (rlhfkit.tasks.gridcat): a random-init GPT-2 of one layer (width 32) over a
  23-token character vocabulary. It reads the cat's cell as a letter and answers with a move
  arrow and EOS. First a format pretraining (``--pretrain-steps`` of next-token cross-entropy on
  uniformly random walks: it then plays at random, knowing nothing of the meat), then
  ``rlhfkit ppo`` with ``env.class=rlhfkit.tasks.gridcat:GridCat``: 32 episodes per step, every
  turn one generate call over the whole episode so far, per-turn rewards, a value head on the
  actor, gamma 0.95, no KL (there is no reference worth staying near); the greedy episode is
  checked every ``--eval-every`` steps.
* tabular REINFORCE: ``rlhfkit gridworld`` (a one-hot MLP policy, returns-to-go, batch-mean
  baseline), 32 episodes per iteration; its greedy return is computed exactly every iteration.

    python benchmarks/gridcat_env.py                  # seeds 0 1 2, one thread
    python benchmarks/gridcat_env.py --seeds 0 --steps 100
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhfkit.config import Config
from rlhfkit.envs.environment import render_prompt
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.tasks.gridcat import MOVES, GridCat, make_tokenizer
from rlhfkit.tasks.gridworld import train_gridworld
from rlhfkit.trainers.rl import train_rl

OPTIMUM = 99.0


def random_walks(tok, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` transcripts of uniformly random moves, right-padded ``[n, T]``, and the mask of the
    tokens to learn (each move and its EOS)."""
    rows, masks = [], []
    for _ in range(n):
        env = GridCat()
        ids = render_prompt(tok, env.reset(None))
        learn = [0] * len(ids)
        for _ in range(env.max_turns):
            move = MOVES[int(torch.randint(4, (1,), generator=gen))]
            ids += tok(move, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            learn += [1, 1]
            obs, _, done = env.step(move)
            if done:
                break
            ids += tok(obs["content"], add_special_tokens=False)["input_ids"]
            learn += [0]
        rows.append(ids)
        masks.append(learn)
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])  # [n, T]
    return ids, torch.tensor([m + [0] * (T - len(m)) for m in masks])  # [n, T]


def format_pretraining(model, tok, seed: int, steps: int) -> None:
    """Teach the random-init model the game's format -- a move arrow and EOS after each cell
    letter -- by next-token cross-entropy on random walks: it then plays uniformly at random,
    as the tabular learner starts. Nothing here knows where the meat is."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids, learn = random_walks(tok, 32, gen)
        logits = model(input_ids=ids).logits[:, :-1]  # [n, T-1, V]: each predicts the next token
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [n, T-1]
        loss = (loss * learn[:, 1:]).sum() / learn[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def language_model(seed: int, steps: int, eval_every: int, out: Path, pretrain_steps: int) -> dict:
    tok = make_tokenizer()
    base = out / "base"
    model = build_tiny_policy(tok, seed, n_layer=1, n_head=2, n_embd=32, n_positions=64)
    t0 = time.perf_counter()
    format_pretraining(model, tok, seed, pretrain_steps)
    pretrain_s = time.perf_counter() - t0
    model.save_pretrained(base)
    tok.save_pretrained(base)
    prompts = out / "prompts.jsonl"  # the environment ignores the prompt: one start cell
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n")
    cfg = Config().replace(
        run={"out_dir": str(out / "rl"), "seed": seed, "progress": False, "checkpoint_every": 0,
             "tensorboard": False},
        accel={"threads": 1},
        model={"name": str(base)},
        data={"path": str(prompts), "eval_path": str(prompts)},
        env={"cls": "rlhfkit.tasks.gridcat:GridCat"},
        # ppo: per-turn rewards on each move, GAE with gamma < 1 (as the tabular learner's returns), so
        # a detour that bumps into walls for free is worth less than the short way. GRPO (the episode
        # return, undiscounted) reached 99 in its samples but kept a greedy policy bumping a wall
        ppo={"algo": "ppo", "value_model": "shared", "steps": steps, "batch_size": 32, "minibatch_size": 32,
             "ppo_epochs": 1, "lr": 3e-3, "kl_coef": 0.0, "gamma": 0.95, "lam": 0.95, "max_new_tokens": 2,
             "eval_every": eval_every, "stop_metric": "eval/reward", "stop_at": OPTIMUM, "trajectories_every": 0,
             "score_clip": 200.0},  # the default 5 would flatten returns of -20 .. 99
        eval={"max_new_tokens": 2},
    )
    t0 = time.perf_counter()
    res = train_rl(cfg)
    seconds = time.perf_counter() - t0
    reached = res["reached"]
    first = json.loads((out / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    return {"episodes": reached["steps"] * 32 if reached else None, "seconds": seconds, "pretrain_s": pretrain_s,
            "base": first["baseline/eval/reward"], "final": res["final"].get("eval/reward")}


def tabular(seed: int, out: Path) -> dict:
    cfg = Config().replace(run={"out_dir": str(out / "tabular"), "seed": seed, "progress": False}, accel={"threads": 1},
                           gridworld={"algo": "reinforce", "iterations": 200, "episodes_per_iter": 32})
    t0 = time.perf_counter()
    train_gridworld(cfg)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "tabular" / "metrics.jsonl").read_text().splitlines()]
    first = next((i for i, r in enumerate(rows) if r["return/greedy"] >= OPTIMUM - 1e-6), None)
    return {"episodes": None if first is None else (first + 1) * 32, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--pretrain-steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| seed | LM: greedy return after format pretraining | LM (ppo): episodes to the optimum | LM seconds: "
          "format pretraining + RL | tabular REINFORCE: episodes | tabular seconds |")
    print("|---|---|---|---|---|---|")
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            lm = language_model(seed, args.steps, args.eval_every, Path(tmp), args.pretrain_steps)
            tab = tabular(seed, Path(tmp))
        print(f"| {seed} | {lm['base']:g} | {lm['episodes'] or 'not in ' + str(args.steps * 32)} | "
              f"{lm['pretrain_s']:.0f} + {lm['seconds']:.0f} | "
              f"{tab['episodes'] or 'not in 6400'} | {tab['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
