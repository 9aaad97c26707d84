"""``rlhfkit report RUN_DIR``: one self-contained HTML page per run (``RUN_DIR/report.html``), CSS,
JavaScript, SVG curves and data inline; each section there when the run has its data."""

from __future__ import annotations

import html
import json
import math
import os
import shutil
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path

import yaml

from ..run.trajectories import ROWS
from ..run.watch import KEYS as HACKING_KEYS
from ..utils import read_jsonl

ASSETS = Path(__file__).parent  # report.css, report.js

# (id, title, metric keys) in display order; every other numeric key gets a panel after these
PANELS = [
    ("score", "reward-model score", ["objective/score"]),
    ("rlhf_reward", "RLHF reward (score - beta * KL)", ["objective/rlhf_reward"]),
    ("kl", "KL(actor || reference) per sequence", ["objective/kl"]),
    ("kl_coef", "KL coefficient beta", ["objective/kl_coef"]),
    ("entropy", "entropy per token", ["objective/entropy"]),
    ("approx_kl", "approx-KL between old and new policy", ["policy/approx_kl"]),
    ("clipfrac", "clip fractions", ["policy/clipfrac", "value/clipfrac"]),
    ("policy_loss", "policy loss", ["policy/loss"]),
    ("value_loss", "value loss", ["value/loss"]),
    ("explained_var", "explained variance of the critic", ["value/explained_var"]),
    ("length", "response length (tokens)", ["response/length"]),
    ("eos_rate", "EOS rate", ["response/eos_rate"]),
    ("eval", "held-out evaluation (greedy)", ["eval/*"]),
    ("baseline", "held-out evaluation before the first update", ["baseline/*"]),
    ("guard", "reward-hacking signs and skipped updates", ["guard/*"]),
    ("throughput", "throughput (tokens / s)", ["throughput/tokens_per_s"]),
    ("step_time", "seconds per step", ["time/rollout_s", "time/experience_s", "time/update_s"]),
]
SKIP = {"step", "time/elapsed_s", "time/train_s"}
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b"]
MAX_POINTS, MAX_SAMPLE_STEPS = 400, 16  # per curve; sample steps shown


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float) -> str:
    a = abs(v)
    if float(v).is_integer() and a < 1e6:
        return str(int(v))
    return f"{v:.2e}" if a >= 1000 or a < 1e-3 else f"{v:.4g}"


def _slug(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key).strip("-")


def _thin(items: list, most: int) -> list:
    """At most ``most`` of ``items``, evenly spaced, the first and last kept."""
    if len(items) <= most:
        return items
    return [items[i] for i in sorted({round(i * (len(items) - 1) / (most - 1)) for i in range(most)})]


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    return _thin([(r["step"], r[key]) for r in rows
                  if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])], MAX_POINTS)


def _panels(rows: list[dict], greedy: bool = True) -> list[tuple[str, str, list[str]]]:
    """``(id, title, keys)`` of each panel: ``PANELS`` first, then one per other numeric key."""
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if k not in SKIP and (v is None or isinstance(v, (int, float)))))
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    used, out = set(), []
    for pid, title, wanted in PANELS:
        found = list(dict.fromkeys(k for w in wanted for k in keys
                                   if (k.startswith(w[:-1]) if w.endswith("*") else k == w)))
        if found:
            title = score_title(keys) if pid == "score" else eval_title(found, greedy) if pid == "eval" else title
            out.append((pid, title, found))
            used.update(found)
    return out + [(_slug(k), k, [k]) for k in keys if k not in used]


def score_title(keys: list[str]) -> str:
    """What ``objective/score`` is in this run: the sources logged as ``reward/<name>``."""
    sources = [k.removeprefix("reward/") for k in keys if k.startswith("reward/")]
    if sources == ["reward_model"]:
        return "reward-model score"
    if len(sources) == 1:
        return f"score ({sources[0]})"
    return f"score (weighted sum: {' + '.join(sources)})" if sources else "score"


def eval_title(keys: list[str], greedy: bool = True) -> str:
    """What the ``eval/*`` metrics measure: held-out completions, pairs (DPO, reward model) or loss (SFT)."""
    if all(k == "eval/loss" or k.startswith(("eval/rewards/", "eval/rm/")) for k in keys):
        pairs = any(k.startswith(("eval/rewards/", "eval/rm/")) for k in keys)
        return "held-out pairs (no sampling)" if pairs else "held-out loss"
    return f"held-out evaluation ({'greedy' if greedy else 'sampled'})"


def svg_curve(series: dict[str, list[tuple[float, float]]], width: int = 360, height: int = 190,
              marks: list[float] = ()) -> str:
    """Inline SVG lines of ``key -> [(step, value)]``; ``marks``: steps of reward-hacking signs."""
    left, right, top, bottom = 56, 10, 8, 24
    xs, ys = [x for s in series.values() for x, _ in s], [y for s in series.values() for _, y in s]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1.0), y1 + (abs(y0) * 0.1 or 1.0)
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return top + (y1 - y) / (y1 - y0) * ph

    def hline(y, cls):
        return f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="{cls}"/>'

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plotbg"/>']
    for frac in (0.0, 0.5, 1.0):  # y grid and labels
        yv = y0 + pad + frac * (y1 - y0 - 2 * pad)
        parts += [hline(sy(yv), "grid"), f'<text x="{left - 4}" y="{sy(yv) + 4:.1f}" class="ylab">{_esc(_fmt(yv))}</text>']
    if y0 < 0 < y1:
        parts.append(hline(sy(0), "zero"))
    parts += [f'<line x1="{sx(xv):.1f}" x2="{sx(xv):.1f}" y1="{top}" y2="{top + ph}" class="hack">'
              f'<title>step {_esc(_fmt(xv))}: reward-hacking sign (guard/*)</title></line>'
              for xv in marks if x0 <= xv <= x1]
    parts += [f'<text x="{sx(xv):.1f}" y="{height - 6}" class="xlab">{_esc(_fmt(xv))}</text>'
              for xv in sorted({min(xs), max(xs)})]
    for i, (key, s) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        if len(s) > 1:
            coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.6" '
                         f'data-key="{_esc(key)}"/>')
        if len(s) <= 40:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.4" fill="{colour}">'
                      f'<title>{_esc(key)} step {_esc(_fmt(x))}: {_esc(_fmt(y))}</title></circle>' for x, y in s]
    return "".join(parts) + "</svg>"


def curves_html(rows: list[dict], prefix: str = "curve", greedy: bool = True) -> str:
    """The metric panels of a run's rows, steps with a reward-hacking sign (``guard/*``) marked."""
    marks = [r["step"] for r in rows if any(r.get(k) for k in HACKING_KEYS)]
    figs = []
    for pid, title, keys in _panels(rows, greedy):
        series = {k: s for k in keys if (s := _series(rows, k))}
        if not series:
            continue
        legend = "".join(
            f'<span class="key"><i style="background:{COLOURS[i % len(COLOURS)]}"></i>{_esc(k)} '
            f'<b>{_esc(_fmt(s[-1][1]))}</b></span>' for i, (k, s) in enumerate(series.items()))
        figs.append(f'<figure class="curve" id="{prefix}-{pid}" data-metrics="{_esc(" ".join(series))}">'
                    f'<figcaption>{_esc(title)}</figcaption>{svg_curve(series, marks=marks)}'
                    f'<div class="legend">{legend}</div></figure>')
    if not figs:
        return '<p class="empty">no metrics logged</p>'
    shown = ", ".join(_fmt(m) for m in marks[:20]) + (" ..." if len(marks) > 20 else "")
    note = (f'<p class="hacknote" id="{prefix}-hacking">Signs of reward hacking (red lines; '
            f'<code>guard/*</code> metrics) at steps {_esc(shown)}.</p>') if marks else ""
    return f'{note}<div class="curves">{"".join(figs)}</div>'


def _summary_html(summary: dict) -> str:
    parts = []
    base, algos = summary.get("base", {}), summary.get("algos", {})
    if base:
        def cells(ev: dict) -> str:
            return "".join(f"<td>{_fmt(ev[m]) if m in ev else ''}</td>" for m in base)

        body = f"<tr><td>base</td>{cells(base)}</tr>" + "".join(
            f"<tr><td>after {_esc(a)}</td>{cells(ev)}</tr>" for a, ev in algos.items())
        head = "".join(f"<th>{_esc(m)}</th>" for m in base)
        parts.append(f'<table class="summary"><tr><th></th>{head}</tr>{body}</table>')
    if summary.get("seconds"):
        parts.append("<p>seconds: " + ", ".join(f"{_esc(k)} {v}" for k, v in summary["seconds"].items()) + "</p>")
    if summary.get("examples") and algos:
        a = next(iter(algos))
        rows = "".join(f"<tr><td>{_esc(e['prompt'])}</td><td>{_esc(e['base'])}</td><td>{_esc(e.get(a, ''))}</td>"
                       f"<td>{'ok' if e.get(a + '_exact') else 'wrong'}</td></tr>" for e in summary["examples"])
        parts.append(f'<table class="examples"><tr><th>held-out prompt</th><th>base</th><th>after {_esc(a)}</th>'
                     f'<th></th></tr>{rows}</table>')
    return "".join(parts)


def _samples_html(samples: list[dict]) -> str:
    every = sorted({s["step"] for s in samples})
    keep = set(_thin(every, MAX_SAMPLE_STEPS))
    rows = []
    for s in (s for s in samples if s["step"] in keep):
        score = s.get("score")
        cls = "pos" if score is not None and score > 0 else "neg" if score is not None and score < 0 else ""
        rows.append(f'<tr data-step="{s["step"]}"><td>{s["step"]}</td><td class="txt">{_esc(s.get("prompt", ""))}</td>'
                    f'<td class="txt">{_esc(s.get("response", ""))}</td>'
                    f'<td class="num {cls}">{_esc("" if score is None else _fmt(score))}</td></tr>')
    note = f"<p>{len(keep)} of the run's steps, evenly spaced.</p>" if len(keep) < len(every) else ""
    return (f'{note}<table class="samples"><thead><tr><th>step</th><th>prompt</th><th>response</th><th>score</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>')


def _trajectory_html(records: list[dict]) -> str:
    """The view's controls and data; ``report.js`` builds a table per saved row of the chosen step."""
    data = {"rows": [[k, v] for k, v in ROWS.items()], "records": records}
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    legend = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in ROWS.items())
    segments = "".join(f'<span class="seg-{s}">{s}</span>' for s in ("prompt", "response", "observation", "padding"))
    return (f'<div class="controls"><label>step <select id="traj-step"></select></label> '
            f'<span class="seglegend">{segments}</span> '
            '<span class="hint">cells: blue &gt; 0, red &lt; 0, darker = larger |value| within the row; '
            '&middot; = not defined for this token</span></div>'
            '<div id="traj-tables"></div>'
            '<noscript><p>The trajectory view needs JavaScript (it is inline: no network).</p></noscript>'
            f'<details><summary>what each row shows</summary><dl class="rowlegend">{legend}</dl></details>'
            f'<script type="application/json" id="traj-data">{blob}</script>')


def _read(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


def latest_run(rows: list[dict]) -> list[dict]:
    """The rows after the last drop in ``step``: a run started again appends from step 0."""
    starts = [i for i in range(1, len(rows)) if rows[i].get("step", 0) < rows[i - 1].get("step", 0)]
    return rows[starts[-1] if starts else 0:]


def _greedy(run: Path) -> bool:
    """``eval.greedy`` of the run's config.yaml (True, the default, when there is none)."""
    try:
        return bool((yaml.safe_load(_text(run / "config.yaml")) or {}).get("eval", {}).get("greedy", True))
    except (yaml.YAMLError, AttributeError):  # not YAML, or not a mapping: the default
        return True


def _stages_html(subruns: list[Path]) -> str:
    body = ""
    for sub in subruns:
        full = (sub / "trajectories.jsonl").exists() or (sub / "samples.jsonl").exists()
        extra = f' (full report: <code>rlhfkit report {_esc(sub)}</code>)' if full else ""
        body += (f'<h3 id="stage-{_slug(sub.name)}">{_esc(sub.name)}/{extra}</h3>'
                 + curves_html(latest_run(_read(sub / "metrics.jsonl")), f"curve-{_slug(sub.name)}", _greedy(sub)))
    return body


def build_report(run_dir: str | os.PathLike) -> str:
    """The report page of ``run_dir`` as an HTML string."""
    run = Path(run_dir)
    metrics = latest_run(_read(run / "metrics.jsonl"))
    trajectories = _read(run / "trajectories.jsonl")
    samples = _read(run / "samples.jsonl")
    config_text = _text(run / "config.yaml")
    summary = json.loads(_text(run / "summary.json") or "{}")
    subruns = sorted(p.parent for p in run.glob("*/metrics.jsonl"))
    if not (metrics or config_text or summary or subruns):
        raise FileNotFoundError(f"{run} is not a run directory: no metrics.jsonl, config.yaml or summary.json "
                                "in it or in its sub-directories")
    sections = [  # (id, title, body), in page order, each when the run has its data
        ("summary", "summary", summary and _summary_html(summary)),
        ("curves", "curves", metrics and curves_html(metrics, greedy=_greedy(run))),
        ("trajectories", "trajectory view", trajectories and _trajectory_html(trajectories)),
        ("samples", "sample generations", samples and _samples_html(samples)),
        ("stages", "other stages", subruns and _stages_html(subruns)),
        ("config", "resolved config", config_text and f'<pre id="config-yaml">{_esc(config_text)}</pre>'),
    ]
    sections = [(sid, title, body) for sid, title, body in sections if body]
    nav = "".join(f'<a href="#{sid}">{_esc(title)}</a>' for sid, title, _ in sections)
    page = "".join(f'<section id="{sid}"><h2>{_esc(title)}</h2>{body}</section>' for sid, title, body in sections)
    facts = [f"{len(metrics)} logged steps" if metrics else "",
             *(f"{k} {_fmt(v)}" for k, v in (metrics or [{}])[-1].items() if k.startswith("eval/") and v is not None),
             f"generated {datetime.now().strftime('%Y-%m-%d %H:%M')}"]
    algo = trajectories[-1].get("algo", "") if trajectories else ""
    title = f"rlhfkit report: {run.resolve().name}"
    script = f"<script>{_text(ASSETS / 'report.js')}</script>" if trajectories else ""
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title><style>{_text(ASSETS / 'report.css')}</style></head><body>"
            f'<header><h1>{_esc(title)}</h1><p>{_esc(run)}{" &middot; " + _esc(algo) if algo else ""}'
            f' &middot; {" &middot; ".join(_esc(f) for f in facts if f)}</p></header>'
            f"<nav>{nav}</nav>{page}{script}</body></html>")


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write ``report.html`` (default: inside ``run_dir``); returns its path."""
    path = Path(out) if out else Path(run_dir) / "report.html"
    path.write_text(build_report(run_dir), encoding="utf-8")
    return path


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome",
                                                 "google-chrome-stable"))), None)


def chromium(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium on ``url`` (no side-traffic, a throw-away profile) with extra flags ``args``."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH: install it (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="rlhfkit-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-default-apps", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
               f"--user-data-dir={profile}", *args, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)


def screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike, width: int = 1400, height: int = 3000,
               anchor: str = "") -> Path:
    """A PNG of the top ``width x height`` pixels of ``html_path`` (``anchor``: a URL fragment)."""
    url = Path(html_path).resolve().as_uri() + (f"#{anchor}" if anchor else "")
    chromium(url, f"--screenshot={Path(png_path).resolve()}", f"--window-size={width},{height}")
    return Path(png_path)
