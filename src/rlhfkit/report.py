"""``rlhfkit report RUN_DIR``: one self-contained HTML page per run.

The page (``RUN_DIR/report.html``) needs no network: CSS and JavaScript are inline, curves are
inline SVG drawn here, the data of the trajectory view is an inline JSON block. It shows

* the run's summary (``summary.json``, when the demo wrote one) and resolved ``config.yaml``;
* curves of every metric in ``metrics.jsonl`` -- the RL ones first, in a fixed order (score,
  RLHF reward, KL, entropy, approx-KL, clip fractions, losses, explained variance, response
  length, EOS rate, evaluation, throughput), then whatever else the run logged;
* sample generations over the steps with their scores (``samples.jsonl``);
* the trajectory view (``trajectories.jsonl``, see :mod:`rlhfkit.trajectories`): for the
  saved rows of a step, tokens as columns and one row per quantity, cells coloured by sign
  and size; a menu picks the step (``report.html#step=N`` opens at step N, and
  ``#only=trajectories`` hides the other sections);
* the curves of sub-runs in the directory (the demo's ``pretrain/``, ``reward/`` ...).

A run without trajectories (or without samples) gets the sections it has data for. DOM
hooks for tests and scripts: ``figure.curve[data-metrics]``, ``table.trajectory`` with
``tr[data-row=NAME]`` and ``td[data-value][data-segment]``, ``table.samples``.
"""

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

from .trajectories import ROWS
from .utils import read_jsonl
from .watch import KEYS as HACKING_KEYS

# (id, title, metric keys) in display order; keys a run lacks are skipped, and every other
# numeric key gets a panel of its own after these
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
MAX_POINTS = 400
MAX_SAMPLE_STEPS = 16


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    a = abs(v)
    if a >= 1000 or a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _slug(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key).strip("-")


# --------------------------------------------------------------------------- curves


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    pts = [(r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if len(pts) > MAX_POINTS:  # keep the first and last point, thin the rest evenly
        idx = sorted({round(i * (len(pts) - 1) / (MAX_POINTS - 1)) for i in range(MAX_POINTS)})
        pts = [pts[i] for i in idx]
    return pts


def _panels(rows: list[dict], greedy: bool = True) -> list[tuple[str, str, list[str]]]:
    keys = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and k not in SKIP and (v is None or isinstance(v, (int, float))):
                keys.append(k)
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    used, out = set(), []
    for pid, title, wanted in PANELS:
        found = []
        for w in wanted:
            found += [k for k in keys if (k.startswith(w[:-1]) if w.endswith("*") else k == w) and k not in found]
        if found:
            title = score_title(keys) if pid == "score" else eval_title(found, greedy) if pid == "eval" else title
            out.append((pid, title, found))
            used.update(found)
    out += [(_slug(k), k, [k]) for k in keys if k not in used]
    return out


def score_title(keys: list[str]) -> str:
    """What ``objective/score`` is in this run: the sources logged as ``reward/<name>``."""
    sources = [k.removeprefix("reward/") for k in keys if k.startswith("reward/")]
    if sources == ["reward_model"]:
        return "reward-model score"
    if len(sources) == 1:
        return f"score ({sources[0]})"
    return f"score (weighted sum: {' + '.join(sources)})" if sources else "score"


def eval_title(keys: list[str], greedy: bool = True) -> str:
    """What the held-out ``eval/*`` metrics of this run measure: completions of held-out prompts
    (decoded greedily or sampled), or, without decoding, held-out pairs (DPO, reward model) or
    demonstrations (SFT)."""
    if all(k == "eval/loss" or k.startswith(("eval/rewards/", "eval/rm/")) for k in keys):
        pairs = any(k.startswith(("eval/rewards/", "eval/rm/")) for k in keys)
        return "held-out pairs (no sampling)" if pairs else "held-out loss"
    return f"held-out evaluation ({'greedy' if greedy else 'sampled'})"


def svg_curve(series: dict[str, list[tuple[float, float]]], width: int = 360, height: int = 190,
              marks: list[float] = ()) -> str:
    """Line plot of one or more ``key -> [(step, value)]`` series as an inline SVG string;
    ``marks``: steps drawn as thin red vertical lines (reward-hacking signs)."""
    left, right, top, bottom = 56, 10, 8, 24
    pts = [p for s in series.values() for p in s]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return top + (y1 - y) / (y1 - y0) * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plotbg"/>']
    for frac in (0.0, 0.5, 1.0):  # y grid and labels
        yv = y0 + pad + frac * (y1 - y0 - 2 * pad)
        y = sy(yv)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" class="ylab">{_esc(_fmt(yv))}</text>')
    if y0 < 0 < y1:
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" class="zero"/>')
    for xv in marks:
        if x0 <= xv <= x1:
            parts.append(f'<line x1="{sx(xv):.1f}" x2="{sx(xv):.1f}" y1="{top}" y2="{top + ph}" class="hack">'
                         f'<title>step {_esc(_fmt(xv))}: reward-hacking sign (guard/*)</title></line>')
    for xv in sorted({min(xs), max(xs)}):
        parts.append(f'<text x="{sx(xv):.1f}" y="{height - 6}" class="xlab">{_esc(_fmt(xv))}</text>')
    for i, (key, s) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        if len(s) > 1:
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.6" '
                         f'data-key="{_esc(key)}"/>')
        if len(s) <= 40:
            for x, y in s:
                parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.4" fill="{colour}">'
                             f'<title>{_esc(key)} step {_esc(_fmt(x))}: {_esc(_fmt(y))}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def hacking_steps(rows: list[dict]) -> list[float]:
    """Steps where a reward-hacking sign (a ``guard/*`` flag of :mod:`rlhfkit.watch`) showed."""
    return [r["step"] for r in rows if any(r.get(k) for k in HACKING_KEYS)]


def curves_html(rows: list[dict], prefix: str = "curve", greedy: bool = True) -> str:
    """The metric panels of a run's rows; ``greedy``: its held-out completions were decoded greedily."""
    marks = hacking_steps(rows)
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
    note = ""
    if marks:
        shown = ", ".join(_fmt(m) for m in marks[:20]) + (" ..." if len(marks) > 20 else "")
        note = (f'<p class="hacknote" id="{prefix}-hacking">Signs of reward hacking (red lines; '
                f'<code>guard/*</code> metrics) at steps {_esc(shown)}.</p>')
    return f'{note}<div class="curves">{"".join(figs)}</div>'


# --------------------------------------------------------------------------- other sections


def _summary_html(summary: dict) -> str:
    parts = []
    base, algos = summary.get("base", {}), summary.get("algos", {})
    metrics = list(base)
    if metrics:
        head = "".join(f"<th>{_esc(m)}</th>" for m in metrics)
        def cells(ev: dict) -> str:
            return "".join(f"<td>{_fmt(ev[m]) if m in ev else ''}</td>" for m in metrics)

        body = f"<tr><td>base</td>{cells(base)}</tr>"
        for a, ev in algos.items():
            body += f"<tr><td>after {_esc(a)}</td>{cells(ev)}</tr>"
        parts.append(f'<table class="summary"><tr><th></th>{head}</tr>{body}</table>')
    if summary.get("seconds"):
        parts.append("<p>seconds: " + ", ".join(f"{_esc(k)} {v}" for k, v in summary["seconds"].items()) + "</p>")
    examples = summary.get("examples") or []
    if examples and algos:
        a = next(iter(algos))
        rows = "".join(f"<tr><td>{_esc(e['prompt'])}</td><td>{_esc(e['base'])}</td><td>{_esc(e.get(a, ''))}</td>"
                       f"<td>{'ok' if e.get(a + '_exact') else 'wrong'}</td></tr>" for e in examples)
        parts.append(f'<table class="examples"><tr><th>held-out prompt</th><th>base</th><th>after {_esc(a)}</th>'
                     f'<th></th></tr>{rows}</table>')
    return "".join(parts)


def _samples_html(samples: list[dict]) -> str:
    steps = sorted({s["step"] for s in samples})
    if len(steps) > MAX_SAMPLE_STEPS:
        steps = sorted({steps[round(i * (len(steps) - 1) / (MAX_SAMPLE_STEPS - 1))] for i in range(MAX_SAMPLE_STEPS)})
    keep = set(steps)
    rows = []
    for s in samples:
        if s["step"] not in keep:
            continue
        score = s.get("score")
        cls = "" if score is None else ("pos" if score > 0 else "neg" if score < 0 else "")
        rows.append(f'<tr data-step="{s["step"]}"><td>{s["step"]}</td><td class="txt">{_esc(s.get("prompt", ""))}</td>'
                    f'<td class="txt">{_esc(s.get("response", ""))}</td>'
                    f'<td class="num {cls}">{_esc("" if score is None else _fmt(score))}</td></tr>')
    note = f"<p>{len(steps)} of the run's steps, evenly spaced.</p>" if len(keep) < len({s['step'] for s in samples}) else ""
    return (f'{note}<table class="samples"><thead><tr><th>step</th><th>prompt</th><th>response</th><th>score</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>')


def _trajectory_html(records: list[dict]) -> str:
    data = {"rows": [[k, v] for k, v in ROWS.items()], "records": records}
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    legend = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in ROWS.items())
    return (
        '<div class="controls"><label>step <select id="traj-step"></select></label> '
        '<span class="seglegend"><span class="seg-prompt">prompt</span><span class="seg-response">response</span>'
        '<span class="seg-observation">observation</span><span class="seg-padding">padding</span></span> '
        '<span class="hint">cells: blue &gt; 0, red &lt; 0, darker = larger |value| within the row; '
        '&middot; = not defined for this token</span></div>'
        '<div id="traj-tables"></div>'
        '<noscript><p>The trajectory view needs JavaScript (it is inline: no network).</p></noscript>'
        f'<details><summary>what each row shows</summary><dl class="rowlegend">{legend}</dl></details>'
        f'<script type="application/json" id="traj-data">{blob}</script>'
    )


CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#243b55;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.85}nav{padding:6px 24px;background:#e8edf3;position:sticky;top:0;z-index:2}
nav a{margin-right:16px;color:#243b55;text-decoration:none;font-weight:600}
section{padding:8px 24px 16px}h2{font-size:17px;border-bottom:1px solid #ccd;padding-bottom:4px}
.curves{display:grid;grid-template-columns:repeat(auto-fill,minmax(372px,1fr));gap:10px}
figure.curve{margin:0;background:#fff;border:1px solid #dde;border-radius:4px;padding:6px}
figcaption{font-weight:600;font-size:13px;margin-bottom:2px}
.hack{stroke:#d62728;stroke-width:1;stroke-dasharray:2 2}.hacknote{color:#b00}
.plotbg{fill:#fcfcfe;stroke:#ccd}.grid{stroke:#e4e4ec}.zero{stroke:#888;stroke-dasharray:3 3}
.ylab{font-size:10px;text-anchor:end;fill:#555}.xlab{font-size:10px;text-anchor:middle;fill:#555}
.legend{font-size:11px}.legend .key{margin-right:10px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #dde;padding:2px 6px}
table.samples td.txt{font-family:ui-monospace,monospace;white-space:pre-wrap}
td.num{text-align:right}td.pos{color:#1d4f91}td.neg{color:#a4161a}
.trajwrap{overflow-x:auto;margin:10px 0 18px;background:#fff;border:1px solid #dde;padding:6px}
.trajwrap h3{font-size:14px;margin:2px 0 6px;font-weight:600}
.trajwrap h3 code{background:#f0f0f4;padding:0 4px}
table.trajectory{font:11px ui-monospace,monospace}
table.trajectory th.rowname{text-align:left;white-space:nowrap;background:#f4f5f8;position:sticky;left:0}
table.trajectory thead th{min-width:38px;font-size:13px;white-space:pre}
table.trajectory td{text-align:right;min-width:38px;white-space:nowrap}
table.trajectory td.na{color:#bbb;text-align:center}
.seg-prompt,th.seg-prompt{background:#fff4cc}.seg-response,th.seg-response{background:#d9f2d9}
.seg-padding,th.seg-padding{background:#e6e6e6;color:#777}.seg-observation,th.seg-observation{background:#dde6f7}
.seglegend span{padding:1px 6px;margin-left:4px;border:1px solid #ccc}
.controls{margin:6px 0}.hint{color:#666;font-size:12px;margin-left:10px}
pre{background:#fff;border:1px solid #dde;padding:8px;overflow-x:auto;font-size:12px}
#config-yaml{column-width:300px;column-rule:1px solid #eee}
dl.rowlegend dt{font-weight:600;font-family:ui-monospace,monospace}dl.rowlegend dd{margin:0 0 4px 16px}
.empty{color:#777}
"""

JS = r"""
(function () {
  var el = document.getElementById('traj-data');
  if (!el) return;
  var data = JSON.parse(el.textContent), recs = data.records, rows = data.rows;
  var steps = [];
  recs.forEach(function (r) { if (steps.indexOf(r.step) < 0) steps.push(r.step); });
  var select = document.getElementById('traj-step'), box = document.getElementById('traj-tables');
  steps.forEach(function (s) {
    var o = document.createElement('option'); o.value = s; o.textContent = s; select.appendChild(o);
  });
  function fmt(v) {
    var a = Math.abs(v);
    if (v === 0) return '0';
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a < 0.005) return v.toExponential(0);
    return v.toFixed(2);
  }
  function show(tok) {
    return tok.replace(/ /g, '\u2423').replace(/\n/g, '\u23ce').replace(/\t/g, '\u21e5');
  }
  function cell(tr, v, seg, scale, isMask) {
    var td = document.createElement('td');
    td.setAttribute('data-segment', seg);
    if (v === null || v === undefined) {
      td.className = 'na'; td.textContent = '\u00b7'; td.setAttribute('data-value', ''); tr.appendChild(td); return;
    }
    td.setAttribute('data-value', String(v));
    td.title = String(v);
    td.textContent = isMask ? String(v) : fmt(v);
    var a = scale > 0 ? Math.min(1, Math.abs(v) / scale) : 0;
    if (isMask) td.style.background = v ? 'rgba(44,160,44,0.45)' : 'rgba(150,150,150,0.25)';
    else if (v > 0) td.style.background = 'rgba(33,102,172,' + (0.06 + 0.7 * a).toFixed(3) + ')';
    else if (v < 0) td.style.background = 'rgba(178,24,43,' + (0.06 + 0.7 * a).toFixed(3) + ')';
    if (a > 0.6 && !isMask) td.style.color = '#fff';
    tr.appendChild(td);
  }
  function table(r) {
    var wrap = document.createElement('div'); wrap.className = 'trajwrap';
    var h = document.createElement('h3');
    var kl = r.kl_in_loss ? 'KL is a loss term (reward = score only)'
                          : 'reward = score on the last token - ' + r.kl_coef + ' * KL';
    h.innerHTML = 'step ' + r.step + ', batch row ' + r.index + ', score <b>' + fmt(r.score) + '</b> &middot; KL estimator '
      + r.kl_estimator + ' &middot; ' + kl + '<br>';
    var p = document.createElement('code'); p.textContent = r.prompt; h.appendChild(p);
    h.appendChild(document.createTextNode(' \u2192 '));
    var c = document.createElement('code'); c.textContent = r.response; h.appendChild(c);
    wrap.appendChild(h);
    var t = document.createElement('table'); t.className = 'trajectory';
    t.setAttribute('data-step', r.step); t.setAttribute('data-index', r.index);
    var head = document.createElement('thead'), hr = document.createElement('tr');
    hr.setAttribute('data-row', 'token');
    var th0 = document.createElement('th'); th0.className = 'rowname'; th0.textContent = 'token'; hr.appendChild(th0);
    r.tokens.forEach(function (tok, i) {
      var th = document.createElement('th'); th.className = 'seg-' + r.segment[i];
      th.setAttribute('data-segment', r.segment[i]); th.textContent = show(tok); th.title = r.segment[i] + ' #' + i;
      hr.appendChild(th);
    });
    head.appendChild(hr); t.appendChild(head);
    var body = document.createElement('tbody');
    rows.forEach(function (pair) {
      var name = pair[0], vals = r.rows[name];
      if (!vals) return;
      var tr = document.createElement('tr'); tr.setAttribute('data-row', name);
      var th = document.createElement('th'); th.className = 'rowname'; th.textContent = name; th.title = pair[1];
      tr.appendChild(th);
      var scale = 0;
      vals.forEach(function (v) { if (v !== null && Math.abs(v) > scale) scale = Math.abs(v); });
      vals.forEach(function (v, i) { cell(tr, v, r.segment[i], scale, name === 'mask'); });
      body.appendChild(tr);
    });
    t.appendChild(body); wrap.appendChild(t);
    return wrap;
  }
  function render(step) {
    box.innerHTML = '';
    recs.filter(function (r) { return r.step === step; }).forEach(function (r) { box.appendChild(table(r)); });
  }
  if (/only=trajectories/.test(location.hash)) {  // the view alone, e.g. for a screenshot
    document.querySelectorAll('section, nav').forEach(function (s) {
      if (s.id !== 'trajectories') s.style.display = 'none';
    });
  }
  var initial = steps[steps.length - 1], m = /step=(\d+)/.exec(location.hash);
  if (m && steps.indexOf(+m[1]) >= 0) initial = +m[1];
  select.value = String(initial);
  select.onchange = function () { render(+select.value); };
  render(initial);
})();
"""


# --------------------------------------------------------------------------- page


def _read(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def latest_run(rows: list[dict]) -> list[dict]:
    """The rows of the latest run in an appended ``metrics.jsonl``: a run started again in the
    same directory appends from step 0, so keep what follows the last drop in ``step``."""
    start = 0
    for i in range(1, len(rows)):
        if rows[i].get("step", 0) < rows[i - 1].get("step", 0):
            start = i
    return rows[start:]


def _greedy(run: Path) -> bool:
    """``eval.greedy`` of the run's config.yaml (True, the default, when there is none)."""
    try:
        return bool(((yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}).get("eval") or {})
                    .get("greedy", True))
    except (OSError, yaml.YAMLError, AttributeError):  # no config, or not YAML: the default
        return True


def build_report(run_dir: str | os.PathLike) -> str:
    """The report page of ``run_dir`` as an HTML string."""
    run = Path(run_dir)
    metrics = latest_run(_read(run / "metrics.jsonl"))
    samples = _read(run / "samples.jsonl")
    trajectories = _read(run / "trajectories.jsonl")
    config_text = (run / "config.yaml").read_text(encoding="utf-8") if (run / "config.yaml").exists() else ""
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8")) if (run / "summary.json").exists() else {}
    subruns = sorted(p.parent for p in run.glob("*/metrics.jsonl"))
    if not (metrics or config_text or summary or subruns):
        raise FileNotFoundError(f"{run} is not a run directory: no metrics.jsonl, config.yaml or summary.json "
                                "in it or in its sub-directories")

    sections, nav = [], []

    def add(sid: str, title: str, body: str) -> None:
        nav.append(f'<a href="#{sid}">{_esc(title)}</a>')
        sections.append(f'<section id="{sid}"><h2>{_esc(title)}</h2>{body}</section>')

    if summary:
        add("summary", "summary", _summary_html(summary))
    if metrics:
        add("curves", "curves", curves_html(metrics, greedy=_greedy(run)))
    if trajectories:
        add("trajectories", "trajectory view", _trajectory_html(trajectories))
    if samples:
        add("samples", "sample generations", _samples_html(samples))
    if subruns:
        body = ""
        for sub in subruns:
            rows = latest_run(_read(sub / "metrics.jsonl"))
            extra = (f' (full report: <code>rlhfkit report {_esc(sub)}</code>)'
                     if (sub / "trajectories.jsonl").exists() or (sub / "samples.jsonl").exists() else "")
            body += f'<h3 id="stage-{_slug(sub.name)}">{_esc(sub.name)}/{extra}</h3>' + curves_html(rows, f"curve-{_slug(sub.name)}",
                                                                                             _greedy(sub))
        add("stages", "other stages", body)
    if config_text:
        add("config", "resolved config", f'<pre id="config-yaml">{_esc(config_text)}</pre>')

    last = metrics[-1] if metrics else {}
    algo = ""
    for line in config_text.splitlines():
        if line.strip().startswith("algo:") and not algo:
            algo = line.split(":", 1)[1].strip()
    facts = [f"{len(metrics)} logged steps" if metrics else "",
             *(f"{k} {_fmt(v)}" for k, v in last.items() if k.startswith("eval/") and v is not None),
             f"generated {datetime.now().strftime('%Y-%m-%d %H:%M')}"]
    title = f"rlhfkit report: {run.resolve().name}"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
        f'<header><h1>{_esc(title)}</h1><p>{_esc(run)}{" &middot; " + _esc(algo) if algo and trajectories else ""}'
        f' &middot; {" &middot; ".join(_esc(f) for f in facts if f)}</p></header>'
        f'<nav>{"".join(nav)}</nav>{"".join(sections)}{f"<script>{JS}</script>" if trajectories else ""}</body></html>'
    )


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write ``report.html`` (default: inside ``run_dir``); returns its path."""
    path = Path(out) if out else Path(run_dir) / "report.html"
    path.write_text(build_report(run_dir), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- headless browser


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


def chromium(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run headless Chromium on ``url`` with no network side-traffic, a throw-away profile
    and the given extra flags (``--dump-dom``, ``--screenshot=PATH`` ...)."""
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
    """Render ``html_path`` headless and save a PNG of the top ``width x height`` pixels
    (``anchor``: a URL fragment such as ``only=trajectories&step=0``)."""
    url = Path(html_path).resolve().as_uri() + (f"#{anchor}" if anchor else "")
    chromium(url, f"--screenshot={Path(png_path).resolve()}", f"--window-size={width},{height}")
    return Path(png_path)
