"""The run report: saved trajectories, report.html in headless Chromium, TensorBoard events, trackers.

One module-scoped real run feeds the tests: a tiny GPT-2 pretrained for 150 steps (it learns to
stop with an EOS, so responses end before the padding), a reward model trained for 30 steps and
4 PPO steps with trajectories saved at steps 0, 1 and 3 -- about 15 s on one core.

The browser test needs Debian's ``chromium`` (``make test`` installs it). Without it the test is
skipped with a message on a developer's machine and fails under CI (``CI`` set).
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.main import main
from rlhfkit.cli.report import build_report, chromium, find_chromium, latest_run, screenshot, write_report
from rlhfkit.config import Config
from rlhfkit.trainers.pretrain import pretrain
from rlhfkit.trainers.reward import train_reward_model
from rlhfkit.trainers.rl import train_rl
from rlhfkit.utils import MetricsLogger, read_jsonl

CURVES = ["objective/score", "objective/kl", "objective/rlhf_reward", "objective/entropy", "policy/approx_kl",
          "policy/clipfrac", "value/clipfrac", "value/loss", "value/explained_var", "response/length",
          "response/eos_rate", "eval/exact_acc", "throughput/tokens_per_s"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    cfg = Config().replace(run={"out_dir": str(root / "pre"), "progress": False},
                           model={"n_layer": 1, "n_head": 2, "n_embd": 32},
                           pretrain={"steps": 150, "batch_size": 64})
    pre = pretrain(cfg)
    rm = train_reward_model(cfg.replace(run={"out_dir": str(root / "rm")}, reward={"steps": 30, "eval_pairs": 64}),
                            policy_path=pre["path"])
    ppo_cfg = cfg.replace(run={"out_dir": str(root / "ppo")},
                          ppo={"steps": 4, "batch_size": 16, "minibatch_size": 8, "eval_every": 0, "stop_at": 0,
                               "critic_warmup_steps": 1, "trajectories_every": 2, "trajectories_per_step": 3})
    train_rl(ppo_cfg, policy_path=pre["path"], reward_path=rm["path"])
    return root / "ppo"


# --------------------------------------------------------------------------- trajectories.jsonl


@pytest.mark.slow
def test_trajectories_hold_the_per_token_quantities(ppo_run):
    recs = read_jsonl(ppo_run / "trajectories.jsonl")
    assert sorted({r["step"] for r in recs}) == [0, 1, 3]  # first, every 2nd, last
    assert all(sum(r["step"] == s for r in recs) == 3 for s in (0, 1, 3))
    for r in recs:
        seg, rows, T = r["segment"], r["rows"], len(r["tokens"])
        assert all(len(v) == T for v in rows.values()) and len(seg) == T
        resp = [t for t in range(T) if seg[t] == "response"]
        assert resp == list(range(resp[0], resp[-1] + 1)) and all(s == "prompt" for s in seg[:resp[0]])
        assert rows["mask"] == [int(s == "response") for s in seg]
        # the score sits on the last response token and nowhere else
        assert rows["score"][resp[-1]] == r["score"] != 0
        assert all(v == 0 for t, v in enumerate(rows["score"]) if t != resp[-1])
        for t in range(T):
            if t in resp:
                # shaped reward = score on the last token - beta * KL; KL = logprob - ref_logprob (k1)
                kl = rows["logprob"][t] - rows["ref_logprob"][t]
                assert rows["kl"][t] == pytest.approx(kl, abs=2e-5)
                assert rows["reward"][t] == pytest.approx(rows["score"][t] - r["kl_coef"] * kl, abs=1e-4)
                # GAE: return = raw advantage + value
                assert rows["return"][t] == pytest.approx(rows["advantage_raw"][t] + rows["value"][t], abs=2e-5)
            else:
                assert rows["reward"][t] == 0 and rows["logprob"][t] is None and rows["advantage"][t] is None
        # the decoded tokens rebuild the response (special tokens, EOS and a sampled BOS, are absent from the text)
        assert "".join(r["tokens"][t] for t in resp if r["tokens"][t] not in ("S", "E")) == r["response"]
        if r["step"] == 0:  # nothing was updated yet: actor == reference
            assert all(rows["kl"][t] == 0 for t in resp)
    # responses that stopped early leave padding after the EOS; the test of the mask needs some
    assert any("padding" in r["segment"] for r in recs)


def test_critic_free_trajectories_have_no_value_rows():
    from rlhfkit.models.forward import build_tiny_policy, build_tiny_scalar_model, disable_dropout, freeze
    from rlhfkit.rollout.experience import ActorCritic, make_experience
    from rlhfkit.rollout.generate import generate
    from rlhfkit.rollout.rewards import reward_model_scorer
    from rlhfkit.run.trajectories import trajectory_records
    from rlhfkit.tasks import doubling

    tok = doubling.make_tokenizer()
    arch = {"n_layer": 1, "n_head": 2, "n_embd": 32}
    torch.manual_seed(0)
    ac = ActorCritic(disable_dropout(build_tiny_policy(tok, seed=3, **arch)))
    ref = freeze(build_tiny_policy(tok, seed=3, **arch))
    rm = freeze(build_tiny_scalar_model(tok, seed=5, **arch))
    with torch.no_grad():
        for p in rm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pc = Config().replace(ppo={"algo": "grpo", "group_size": 4, "kl_in_loss": True, "kl_estimator": "k3"}).ppo
    texts = [p.text for p in doubling.DoublingData(0).prompts(2) for _ in range(4)]
    enc = tok(texts, padding=True, return_tensors="pt")
    roll = generate(ac.policy, enc["input_ids"], enc["attention_mask"], 6, tok.eos_token_id, tok.pad_token_id)
    exp, _ = make_experience(ac, ref, reward_model_scorer(rm), roll, pc, kl_coef=0.05)
    recs = trajectory_records(exp, tok, pc, 0.05, step=0, n=2)
    scores = exp.score.tolist()
    assert [r["score"] for r in recs] == pytest.approx([min(scores), max(scores)], abs=1e-5)  # extremes first
    for r in recs:
        assert set(r["rows"]) == {"mask", "logprob", "ref_logprob", "kl", "score", "reward", "advantage"}
        resp = [t for t, s in enumerate(r["segment"]) if s == "response"]
        adv = {r["rows"]["advantage"][t] for t in resp}
        assert len(adv) == 1  # one sequence-level advantage on every response token
        # the KL is a loss term here: the reward is the score alone
        assert r["rows"]["reward"] == r["rows"]["score"]


# --------------------------------------------------------------------------- report.html in Chromium


class _DomTables(HTMLParser):
    """Collects figure.curve[data-metrics] and every table.trajectory's rows of td cells."""

    def __init__(self):
        super().__init__()
        self.curves: list[str] = []
        self.tables: list[dict] = []
        self._row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "curve" in (a.get("class") or "").split():
            self.curves.append(a.get("data-metrics", ""))
        elif tag == "table" and "trajectory" in (a.get("class") or "").split():
            self.tables.append({"step": int(a["data-step"]), "index": int(a["data-index"]), "rows": {}})
        elif tag == "tr" and self.tables and "data-row" in a:
            self._row = self.tables[-1]["rows"].setdefault(a["data-row"], [])
        elif tag in ("td", "th") and self._row is not None and "data-segment" in a:
            self._row.append((a["data-segment"], a.get("data-value")))

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None


def _need_chromium():
    if find_chromium() is None:
        msg = "chromium is not installed: apt-get install -y chromium (make test does this) -- browser test NOT run"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def _dom(url: str) -> _DomTables:
    parser = _DomTables()
    parser.feed(chromium(url, "--dump-dom").stdout)
    return parser


def _check_tables(tables: list[dict], recs: list[dict]) -> None:
    by_key = {(r["step"], r["index"]): r for r in recs}
    for t in tables:
        rec = by_key[(t["step"], t["index"])]
        segs = [s for s, _ in t["rows"]["token"]]
        assert segs == rec["segment"]
        score = [(s, float(v)) for s, v in t["rows"]["score"]]  # every cell has a number
        mask = [(s, float(v)) for s, v in t["rows"]["mask"]]
        last = max(i for i, s in enumerate(segs) if s == "response")
        assert score[last][1] == pytest.approx(rec["score"]) and score[last][1] != 0
        assert all(v == 0 for i, (_s, v) in enumerate(score) if i != last)
        assert all(v == (1 if s == "response" else 0) for s, v in mask)
        assert {"logprob", "ref_logprob", "kl", "reward", "value", "advantage_raw", "advantage", "return"} <= set(t["rows"])


@pytest.mark.slow
def test_report_renders_in_headless_chromium(ppo_run):
    _need_chromium()
    assert main(["report", str(ppo_run)]) == 0
    page = ppo_run / "report.html"
    text = page.read_text(encoding="utf-8")
    assert page.stat().st_size < 5_000_000
    # self-contained: nothing is fetched (the SVG namespace URI is an identifier, not a request)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?https?:|@import""", text, re.I)

    recs = read_jsonl(ppo_run / "trajectories.jsonl")
    dom = _dom(page.as_uri())
    metrics = " ".join(dom.curves).split()
    assert set(CURVES) <= set(metrics), set(CURVES) - set(metrics)
    # the view opens at the last saved step, one table per saved row, built by the page's script
    assert sorted((t["step"], t["index"]) for t in dom.tables) == sorted(
        (r["step"], r["index"]) for r in recs if r["step"] == 3)
    _check_tables(dom.tables, recs)
    first = _dom(page.as_uri() + "#step=0")  # the step menu, driven by the URL
    assert {t["step"] for t in first.tables} == {0} and len(first.tables) == 3
    _check_tables(first.tables, recs)
    shown = dom.tables + first.tables
    assert any(s == "padding" for t in shown for s, _ in t["rows"]["token"])

    png = screenshot(page, ppo_run / "report.png", width=1400, height=3000)
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1400, 3000)


def test_report_of_a_run_without_trajectories(tmp_path):
    # e.g. the reward-model stage: curves only; a restarted run appended to metrics.jsonl
    rows = [{"step": s, "loss": 1.0} for s in range(3)] + [{"step": s, "loss": 1.0 / (s + 1), "rm/accuracy": 0.5 + s / 10}
                                                            for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("run:\n  seed: 0\n")
    assert latest_run(rows) == rows[3:]
    page = write_report(tmp_path)
    text = page.read_text(encoding="utf-8")
    assert 'data-metrics="loss"' in text and 'data-metrics="rm/accuracy"' in text
    assert 'id="traj-data"' not in text and 'id="trajectories"' not in text and 'class="samples"' not in text
    assert "<b>0.2</b>" in text  # the legend shows the last value of the latest run (1 / 5)
    assert main(["report", str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_report_lists_sub_runs(ppo_run):
    html = build_report(ppo_run.parent)  # the fixture's root: pre/, rm/, ppo/ are stages
    for sub in ("pre", "rm", "ppo"):
        assert f'id="stage-{sub}"' in html
    assert "rlhfkit report" in html  # points at the RL stage's own full report


# --------------------------------------------------------------------------- TensorBoard, trackers


def _tb_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos < len(data):  # TFRecord: length, crc, payload, crc
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v.simple_value
    return out


@pytest.mark.slow
def test_tensorboard_events_match_metrics(ppo_run):
    scalars = _tb_scalars(ppo_run / "tb")
    rows = read_jsonl(ppo_run / "metrics.jsonl")
    for key in ("objective/score", "objective/kl", "value/loss", "eval/exact_acc"):
        logged = {r["step"]: r[key] for r in rows if r.get(key) is not None}
        assert logged and scalars[key].keys() == logged.keys()
        for step, v in logged.items():
            assert scalars[key][step] == pytest.approx(v, rel=1e-6, abs=1e-6)
    assert _tb_scalars(ppo_run.parent / "pre" / "tb")  # every trainer writes them, not only RL


def test_trackers_only_when_asked(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw["project"])),
                                 log=lambda d, step: calls.append(("log", step, d["loss"])),
                                 finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path / "a" / "metrics.jsonl", Config().replace(run={"tensorboard": False}))
    log.log(0, {"loss": 1.0})
    log.close()
    assert calls == [] and not (tmp_path / "a" / "tb").exists()
    cfg = Config().replace(run={"tensorboard": False, "trackers": "wandb"})
    log = MetricsLogger(tmp_path / "b" / "metrics.jsonl", cfg)
    log.log(3, {"loss": 0.5})
    log.close()
    assert calls == [("init", "rlhfkit"), ("log", 3, 0.5), ("finish",)]
    monkeypatch.setitem(sys.modules, "trackio", None)  # import fails: not installed
    with pytest.raises(ValueError, match="pip install trackio"):
        MetricsLogger(tmp_path / "c" / "metrics.jsonl", cfg.replace(run={"trackers": "trackio"}))
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        MetricsLogger(tmp_path / "d" / "metrics.jsonl", cfg.replace(run={"trackers": "mlflow"}))


def _titles(run: Path) -> list[str]:
    return re.findall(r"<figcaption>(.*?)</figcaption>", build_report(run))


@pytest.mark.parametrize("row, config, score, held_out", [
    ({"objective/score": 1.0, "reward/reward_model": 1.0, "eval/exact_acc": 0.5}, "", "reward-model score",
     "held-out evaluation (greedy)"),
    ({"objective/score": 1.0, "reward/exact_reward": 1.0, "eval/reward": 1.0, "eval/accuracy": 1.0},
     "eval:\n  greedy: false\n", "score (exact_reward)", "held-out evaluation (sampled)"),
    ({"objective/score": 1.0, "reward/reward_model": 0.5, "reward/correct": 1.0}, "", "score (weighted sum: "
     "reward_model + correct)", None),
    ({"dpo/loss": 0.6, "eval/rewards/chosen": 0.1, "eval/rewards/margins": 0.2, "eval/loss": 0.5}, "", None,
     "held-out pairs (no sampling)"),
    ({"sft/loss": 1.0, "eval/loss": 0.9}, "", None, "held-out loss"),
])
def test_panel_titles_say_what_the_run_measured(row, config, score, held_out, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, **row}) + "\n")
    if config:
        (tmp_path / "config.yaml").write_text(config)
    titles = _titles(tmp_path)
    assert (score in titles) if score else not any("score" in t for t in titles)
    assert (held_out in titles) if held_out else not any("held-out" in t for t in titles)


def test_the_page_inlines_the_stylesheet_and_script_the_package_ships(tmp_path):
    import rlhfkit.cli.report as report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "objective/score": 1.0}) + "\n")
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(
        {"step": 0, "index": 0, "algo": "grpo", "tokens": ["a"], "segment": ["response"], "rows": {"mask": [1]}}) + "\n")
    page = build_report(tmp_path)
    css, js = (Path(report.__file__).with_name(name).read_text(encoding="utf-8") for name in ("report.css", "report.js"))
    assert f"<style>{css}</style>" in page and f"<script>{js}</script>" in page
    assert "&middot; grpo &middot;" in page  # the header names the algorithm of the saved trajectories
    (tmp_path / "trajectories.jsonl").unlink()
    assert "<script>" not in build_report(tmp_path)  # no trajectory view, no script
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^rlhfkit = \[.*"cli/report\.css", "cli/report\.js"\]', pyproject, re.M)  # shipped as package data
    assert len(Path(report.__file__).read_text().splitlines()) <= 350  # the readable-core budget of the module
