"""Numerical guards: a NaN/inf loss or gradient skips that optimizer update (warning, counter in
``guard/skipped_updates``) and ``run.max_bad_updates`` of them in a row stop the run with a
clear error -- in every training loop, so no NaN ever reaches the saved weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import Config
from rlhfkit.trainers.common import Engine
from rlhfkit.utils import TrainingError, UpdateGuard, read_jsonl

pytestmark = pytest.mark.usefixtures("no_plots")

# --------------------------------------------------------------------------- the helper


def test_guard_passes_finite_updates_and_counts_bad_ones():
    guard = UpdateGuard(max_bad=3, where="unit")
    assert guard.ok(torch.tensor(1.0), torch.tensor(0.5))
    with pytest.warns(RuntimeWarning, match=r"unit: non-finite.*skipped \(1 in a row, 1 in total\)"):
        assert not guard.ok(torch.tensor(math.nan), torch.tensor(0.5))
    with pytest.warns(RuntimeWarning, match=r"\(2 in a row, 2 in total\)"):
        assert not guard.ok(torch.tensor(1.0), torch.tensor(math.inf))  # a finite loss, an inf gradient
    assert guard.ok(torch.tensor(2.0), torch.tensor(0.1), 0.0)  # a good update resets the streak
    assert (guard.skipped, guard.in_a_row) == (2, 0)
    with pytest.warns(RuntimeWarning):
        guard.ok(torch.tensor(math.nan))
        guard.ok(torch.tensor(math.nan))
    with pytest.raises(TrainingError, match=r"unit: 3 optimizer updates in a row.*run\.max_bad_updates"):
        guard.ok(torch.tensor(-math.inf))
    assert guard.skipped == 5


def test_max_bad_updates_is_validated():
    from rlhfkit.config import ConfigError

    assert Config().run.max_bad_updates == 5
    with pytest.raises(ConfigError, match=r"run\.max_bad_updates' must be >= 1, got 0"):
        Config().replace(run={"max_bad_updates": 0})


# --------------------------------------------------------------------------- PPO minibatches


def _poison(fn, bad_calls, calls: list):
    """``fn`` whose loss comes out NaN (graph kept, so the gradients are NaN too) on the given calls."""

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        i = len(calls)
        calls.append(i)
        if bad_calls == "all" or i in bad_calls:
            return (out[0] * math.nan, out[1]) if isinstance(out, tuple) else out * math.nan
        return out

    return wrapped


def _ppo_setup():
    from test_ppo import update_inputs

    pc = Config().replace(ppo={"minibatch_size": 4}).ppo
    ac, exp, opt = update_inputs("separate", pc)
    return ac, exp, pc, opt


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
def test_ppo_update_skips_nan_minibatches_and_keeps_weights_finite(monkeypatch):
    import rlhfkit.trainers.rl as rl

    ac, exp, pc, opt = _ppo_setup()
    before = {k: v.clone() for k, v in ac.state_dict().items()}
    original, calls = rl.policy_loss, []
    monkeypatch.setattr(rl, "policy_loss", _poison(original, "all", calls))
    guard = UpdateGuard(max_bad=100)
    rl.ppo_update(ac, opt, exp, pc, pc.kl_coef, engine=Engine(guard=guard))
    assert len(calls) == guard.skipped == pc.ppo_epochs * 16 // 4 == 8
    # every update was skipped: weights and optimizer state exactly as before
    assert all(torch.equal(before[k], v) for k, v in ac.state_dict().items())
    assert all(not s for s in opt.state.values())

    # one poisoned minibatch among eight: seven updates land, all weights stay finite
    monkeypatch.setattr(rl, "policy_loss", _poison(original, {3}, []))
    guard = UpdateGuard(max_bad=100)
    rl.ppo_update(ac, opt, exp, pc, pc.kl_coef, engine=Engine(guard=guard))
    assert guard.skipped == 1 and guard.in_a_row == 0
    assert any(not torch.equal(before[k], v) for k, v in ac.state_dict().items())
    assert all(torch.isfinite(v).all() for v in ac.state_dict().values())


@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
def test_ppo_update_stops_after_max_bad_in_a_row(monkeypatch):
    import rlhfkit.trainers.rl as rl

    ac, exp, pc, opt = _ppo_setup()
    calls: list = []
    monkeypatch.setattr(rl, "policy_loss", _poison(rl.policy_loss, "all", calls))
    with pytest.raises(TrainingError, match="ppo: 3 optimizer updates in a row had a non-finite loss"):
        rl.ppo_update(ac, opt, exp, pc, pc.kl_coef, engine=Engine(guard=UpdateGuard(max_bad=3, where="ppo")))
    assert len(calls) == 3  # stopped at the third, not at the end of the epochs


# --------------------------------------------------------------------------- every trainer, end to end

# (trainer, module whose loss function is poisoned, name of that function, extra config)
TRAINERS = {
    "pretrain": ("pretrain", "rlhfkit.trainers.pretrain", "masked_lm_loss", {}),
    "sft": ("train_sft", "rlhfkit.trainers.sft", "masked_lm_loss", {}),
    "rm": ("train_reward_model", "rlhfkit.trainers.reward", "bradley_terry_loss", {}),
    "rm_classifier": ("train_reward_model", "rlhfkit.trainers.reward", "cross_entropy", {"reward": {"kind": "classifier"}}),
    "dpo": ("train_dpo", "rlhfkit.trainers.dpo", "dpo_loss", {}),
    "ppo": ("train_rl", "rlhfkit.trainers.rl", "policy_loss", {}),
    "grpo": ("train_rl", "rlhfkit.trainers.rl", "policy_loss", {"ppo": {"algo": "grpo", "kl_in_loss": True,
                                                                      "kl_estimator": "k3"}}),
}


def _run_trainer(case, tiny_models, tiny_config, out: Path, monkeypatch, bad_calls, **run):
    import importlib

    entry, module_name, loss_name, extra = TRAINERS[case]
    module = importlib.import_module(module_name)
    calls: list = []
    if loss_name == "cross_entropy":  # the classifier loop calls torch.nn.functional.cross_entropy
        monkeypatch.setattr(torch.nn.functional, "cross_entropy", _poison(torch.nn.functional.cross_entropy,
                                                                          bad_calls, calls))
    else:
        monkeypatch.setattr(module, loss_name, _poison(getattr(module, loss_name), bad_calls, calls))
    data = out.parent / f"{out.name}_sft.jsonl"
    data.write_text("".join(f'{{"prompt": "数字:{n}x2=", "completion": "{2 * n}"}}\n' for n in range(10, 30)),
                    encoding="utf-8")
    sections = {"model": {"name": tiny_models.policy}, "reward": {"name": tiny_models.reward},
                "data": {"path": str(data)} if case == "sft" else {}, "run": run}
    for sec, values in extra.items():
        sections[sec] = {**sections.get(sec, {}), **values}
    cfg = tiny_config(out, **sections)
    result = getattr(module, entry)(cfg)
    return result, calls


@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("case", TRAINERS)
def test_trainer_skips_a_nan_update_and_saves_finite_weights(case, tiny_models, tiny_config, tmp_path, monkeypatch):
    result, calls = _run_trainer(case, tiny_models, tiny_config, tmp_path / case, monkeypatch, {1})
    assert len(calls) >= 3  # the poisoned update was not the last one
    rows = [r for r in read_jsonl(tmp_path / case / "metrics.jsonl") if "guard/skipped_updates" in r]
    assert rows and rows[-1]["guard/skipped_updates"] == 1
    weights = sorted((tmp_path / case).rglob("*.safetensors"))
    assert weights
    for path in weights:
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values()), path


@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("case", TRAINERS)
def test_trainer_stops_after_max_bad_updates_in_a_row(case, tiny_models, tiny_config, tmp_path, monkeypatch):
    with pytest.raises(TrainingError, match=r"3 optimizer updates in a row.*run\.max_bad_updates"):
        _run_trainer(case, tiny_models, tiny_config, tmp_path / case, monkeypatch, "all", max_bad_updates=3)
    assert not list((tmp_path / case).rglob("*.safetensors"))  # nothing saved from a diverged run


def test_cli_reports_a_diverged_run_with_exit_code_1(tiny_models, tmp_path, monkeypatch, capsys):
    import rlhfkit.trainers.dpo as dpo
    from rlhfkit.cli.main import main

    monkeypatch.setattr(dpo, "dpo_loss", _poison(dpo.dpo_loss, "all", []))
    with pytest.warns(RuntimeWarning):
        code = main(["dpo", f"model.name={tiny_models.policy}", f"run.out_dir={tmp_path}", "run.progress=false",
                     "dpo.num_pairs=16", "dpo.batch_size=4", "run.max_bad_updates=2"])
    assert code == 1
    err = capsys.readouterr().err
    # after the line naming the learning rates, the error, on one line
    assert err.splitlines()[-1].startswith("rlhfkit dpo: error: dpo: 2 optimizer updates in a row")
    assert err.startswith("learning rates: ") and len(err.splitlines()) == 2 and "Traceback" not in err


def test_metrics_logger_reads_back_only_its_own_rows(tmp_path):
    # the RL loop keeps no per-step rows in memory and reads them back at the end; a run directory
    # reused by a second run must not mix the first run's rows into the second run's plots
    from rlhfkit.utils import MetricsLogger

    first = MetricsLogger(tmp_path / "metrics.jsonl")
    first.log(0, {"a": 1.0})
    first.close()
    second = MetricsLogger(tmp_path / "metrics.jsonl")
    second.log(0, {"a": 2.0, "b": math.nan})
    second.log(1, {"a": 3.0})
    assert [(r["step"], r["a"]) for r in second.rows()] == [(0, 2.0), (1, 3.0)]  # readable while open
    second.close()
    assert second.rows()[0]["b"] is None and len(read_jsonl(tmp_path / "metrics.jsonl")) == 3


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, float("nan")])
def test_clip_grad_norm_matches_torch(scale):
    """rlhfkit's single-process clipping is torch's: the same norm, the same clipped gradients, and a
    NaN gradient comes back as a NaN norm (for the guard) rather than an error."""
    from rlhfkit.run.distributed import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 4, 3), (1,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # skipped, as torch skips no-grad params
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=gen) * scale
        b.grad = a.grad.clone()
    norm = clip_grad_norm(None, [*ours, frozen], max_norm=1.0)
    ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    if math.isnan(scale):
        assert math.isnan(float(norm))
        return
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert (float(ref) > 1.0) == (scale > 1e-2)  # the cases clip and do not clip
