"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PPO_PANELS = [  # (keys, title, file name of the panel alone)
    (("objective/score",), "reward-model score", "plot_score.png"),
    (("objective/kl",), "KL(actor || ref) per sequence", "plot_kl.png"),
    (("objective/entropy",), "entropy per token", "plot_entropy.png"),
    (("eval/format_acc", "eval/exact_acc"), "held-out accuracy (greedy)", "plot_accuracy.png"),
]


def _draw(ax, history: list[dict], keys: tuple[str, ...], title: str = "") -> None:
    for key in keys:
        pts = [(r["step"], r[key]) for r in history if r.get(key) is not None]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="." if title and len(xs) < 30 else None, label=key)
    ax.set_title(title)
    ax.set_xlabel("PPO step")
    ax.grid(alpha=0.3)
    if len(keys) > 1 or not title:
        ax.legend()


def _save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_ppo(history: list[dict], out_dir: str | Path) -> list[Path]:
    """``plots.png`` with the four panels of ``PPO_PANELS``, then one PNG per panel."""
    out_dir = Path(out_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (keys, title, _) in zip(axes.flat, PPO_PANELS):
        _draw(ax, history, keys, title)
    paths = [_save(fig, out_dir / "plots.png", 90)]
    for keys, _, name in PPO_PANELS:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        _draw(ax, history, keys)
        paths.append(_save(fig, out_dir / name, 80))
    return paths


def plot_returns(curve: list[float], greedy: list[float], best: float, path: Path, title: str) -> Path:
    """The grid world's mean sampled and greedy return per iteration against the optimum."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(curve)), curve, label="mean sampled return")
    ax.plot(range(len(greedy)), greedy, label="greedy return", alpha=0.8)
    ax.axhline(best, color="k", ls="--", lw=1, label=f"optimum {best:g}")
    ax.set(xlabel="iteration", ylabel="episode return", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path, 90)
