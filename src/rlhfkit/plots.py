"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PPO_PANELS = [
    ("objective/score", "reward-model score"),
    ("objective/kl", "KL(actor || ref) per sequence"),
    ("objective/entropy", "entropy per token"),
    (("eval/format_acc", "eval/exact_acc"), "held-out accuracy (greedy)"),
]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in history if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_ppo(history: list[dict], out_dir: str | Path) -> list[Path]:
    """One PNG per panel (``plot_score.png`` ...) plus ``plots.png`` with all four."""
    out_dir = Path(out_dir)
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (keys, title) in zip(axes.flat, PPO_PANELS):
        keys = keys if isinstance(keys, tuple) else (keys,)
        for key in keys:
            xs, ys = _series(history, key)
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    fig.tight_layout()
    path = out_dir / "plots.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
    for keys, _title in PPO_PANELS:
        keys = keys if isinstance(keys, tuple) else (keys,)
        name = keys[0].split("/")[-1] if len(keys) == 1 else "accuracy"
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for key in keys:
            ax.plot(*_series(history, key), label=key)
        ax.set_xlabel("PPO step")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out_dir / f"plot_{name}.png"
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths.append(p)
    return paths
