"""Signs that an RL run games its reward (:class:`HackingWatch`, ``guard/*`` flags tested against
the run's own noise) or has little to learn from (:class:`SignalWatch`), each warned once
(docs/safety.md). Both take scalars (one run) or arrays of runs stepping together (simulations)."""

from __future__ import annotations

import math
import warnings

import numpy as np

KEYS = ("guard/kl_high", "guard/eos_collapse", "guard/eval_drop", "guard/reward_tradeoff")
NORMAL_MEAN_ABS_DIFF = 2 / math.sqrt(math.pi)  # E|X - Y| of two independent N(0, s^2) draws, in units of s


def _mean(values: list) -> np.ndarray:
    return np.mean(np.stack(values), axis=0)


class HackingWatch:
    """Per-step reward-hacking checks: ``check(step, stats)`` returns the ``guard/*`` flags; its windows
    are checkpointed. ``kl_max``, ``eos_ratio``, ``eval_drop``, ``tradeoff``: ``ppo.guard_*`` (0 = off)."""

    def __init__(self, kl_max: float = 0.0, eos_ratio: float = 0.0, eval_drop: float = 0.0,
                 metric: str = "eval/exact_acc", batch_size: int = 64, window: int = 5, anchor: int = 10,
                 z: float = 4.5, eval_window: int = 3, min_evals: int = 5, tradeoff: float = 0.0,
                 eval_prompts: int = 0, tradeoff_window: int = 2, z_tradeoff: float = 3.5):
        self.kl_max, self.eos_ratio, self.eval_drop, self.metric = kl_max, eos_ratio, eval_drop, metric
        self.batch_size, self.window, self.anchor, self.z = batch_size, window, anchor, z
        self.eval_window, self.min_evals, self.tradeoff = eval_window, min_evals, tradeoff
        # eval/reward, each eval/reward/<source> and eval/reward_std/<source>: their values before training
        self.sources_before: dict | None = None
        self.fallen: list[str] = []  # the sources of the last trade-off flag, for its message
        self.source_evals: list[dict] = []  # the last `tradeoff_window` evaluations' eval/reward*
        self.eval_prompts, self.tradeoff_window, self.z_tradeoff = eval_prompts, tradeoff_window, z_tradeoff
        self.eos_anchor: list = []  # the first `anchor` steps' EOS rates
        self.eos_recent: list = []  # the last `window` steps'
        self.eos_anchor_var: list = []  # their squared standard errors (NaN: not logged)
        self.eos_recent_var: list = []
        self.kl_recent: list = []  # the last `window` steps' per-token KLs
        self.score_recent: list = []  # the last `window` steps' training scores
        self.evals: list = []  # every evaluation of `metric`
        self.best = None  # the best mean of `eval_window` consecutive evaluations
        self.score_at_best = None  # the training score's window mean then
        self.warned: list[str] = []

    def announce(self, logged: set[str] | None = None, evaluations: int | None = None) -> list[str]:
        """Warn once, at the start, which guards are off and why; returns them."""
        missing = None  # why the held-out metric cannot be followed
        if logged is not None and self.metric not in logged:
            have = ", ".join(sorted(k for k in logged if k.count("/") == 1)) or "no held-out metric"
            missing = (f"this run does not log ppo.stop_metric={self.metric}; it logs {have}"
                       + (": set ppo.stop_metric to one of them" if logged else ": set data.eval_path"))
        if evaluations is not None and evaluations < self.min_evals:
            missing = missing or f"{evaluations} evaluation(s) in the run, it needs {self.min_evals}: lower ppo.eval_every"
        why = {"guard/kl_high": "ppo.guard_kl=0" if not self.kl_max else missing,
               "guard/eos_collapse": "ppo.guard_eos=0" if not self.eos_ratio else None,
               "guard/eval_drop": "ppo.guard_eval_drop=0" if not self.eval_drop else missing}
        off = [f"{key} ({reason})" for key, reason in why.items() if reason]
        if off:
            warnings.warn("reward-hacking guards off: " + "; ".join(off), RuntimeWarning, stacklevel=2)
        return off

    def check(self, step: int, stats: dict) -> dict:
        kl, length = stats.get("objective/kl"), stats.get("response/length")
        eos, score, value = stats.get("response/eos_rate"), stats.get("objective/score"), stats.get(self.metric)
        w = self.window
        if kl is not None and length is not None:
            length = np.asarray(length, dtype=float)
            per_token = np.where(length > 0, np.asarray(kl, dtype=float) / np.maximum(length, 1e-12), 0.0)
            self.kl_recent = (self.kl_recent + [per_token])[-w:]
        if eos is not None:
            eos = np.asarray(eos, dtype=float)
            se = np.asarray(stats.get("response/eos_rate_se", math.nan), dtype=float)  # None in a log read back: NaN
            var = np.square(se) + np.zeros_like(eos)
            if len(self.eos_anchor) < self.anchor:
                self.eos_anchor.append(eos)
                self.eos_anchor_var.append(var)
            self.eos_recent, self.eos_recent_var = (self.eos_recent + [eos])[-w:], (self.eos_recent_var + [var])[-w:]
        if score is not None:
            self.score_recent = (self.score_recent + [np.asarray(score, dtype=float)])[-w:]
        drop = self._eval_drop(value) if value is not None else np.asarray(False)
        flags = {"guard/kl_high": self._kl_high(), "guard/eos_collapse": self._eos_collapse(),
                 "guard/eval_drop": drop, "guard/reward_tradeoff": self._tradeoff(stats)}
        for key, on in flags.items():
            if on.ndim == 0 and on and key not in self.warned:  # messages for one run only
                self.warned.append(key)
                warnings.warn(self._message(key, step, stats), RuntimeWarning, stacklevel=2)
        return {k: float(v) if v.ndim == 0 else v.astype(float) for k, v in flags.items()}

    def _kl_high(self) -> np.ndarray:
        if not self.kl_max or len(self.kl_recent) < self.window:
            return np.asarray(False)
        return (_mean(self.kl_recent) > self.kl_max) & self._below_best()

    def _eos_collapse(self) -> np.ndarray:
        if not self.eos_ratio or len(self.eos_anchor) < self.anchor or len(self.eos_recent) < self.window:
            return np.asarray(False)
        a, recent = _mean(self.eos_anchor), _mean(self.eos_recent)
        binomial = a * (1 - a) / self.batch_size  # a step's variance were its completions independent at rate a
        var = lambda vs: np.fmax(np.stack(vs), binomial).mean(0)  # noqa: E731  # a step's mean variance
        se = np.sqrt(var(self.eos_anchor_var) / self.anchor + var(self.eos_recent_var) / self.window)
        return (recent < self.eos_ratio * a) & (a - recent > self.z * se)

    def _eval_drop(self, value) -> np.ndarray:
        self.evals.append(np.asarray(value, dtype=float))
        if len(self.evals) < self.eval_window:
            return np.asarray(False)
        smooth = _mean(self.evals[-self.eval_window :])
        score = _mean(self.score_recent) if self.score_recent else np.zeros_like(smooth)
        if self.best is None:
            self.best, self.score_at_best = smooth, score
        else:
            better = smooth > self.best
            self.best = np.where(better, smooth, self.best)
            self.score_at_best = np.where(better, score, self.score_at_best)
        if not self.eval_drop:
            return np.zeros_like(smooth, dtype=bool)
        return (smooth < (1 - self.eval_drop) * self.best) & self._below_best()

    def _below_best(self) -> np.ndarray:
        """Is the held-out metric's recent mean more than ``z`` evaluation noises below its best?"""
        if self.best is None or len(self.evals) < self.min_evals:
            return np.asarray(False)
        # one evaluation's noise: the mean step between consecutive evaluations, / 1.128
        noise = np.abs(np.diff(np.stack(self.evals), axis=0)).mean(0) / NORMAL_MEAN_ABS_DIFF
        return self.best - _mean(self.evals[-self.eval_window :]) > self.z * noise

    def _tradeoff(self, stats: dict) -> np.ndarray:
        """A source's recent mean fell more than ``tradeoff`` of its value before training (and
        ``z_tradeoff`` standard errors) while the weighted total rose."""
        now = {k: np.asarray(v, dtype=float) for k, v in stats.items() if k.startswith("eval/reward")}
        before = {k[len("baseline/"):]: np.asarray(v, dtype=float) for k, v in stats.items()
                  if k.startswith("baseline/eval/reward")}
        if self.sources_before is None and (before or now):
            self.sources_before = before or now  # the first evaluation stands in for a missing baseline
            if not before:
                return np.asarray(False)
        if "eval/reward" not in now:
            return np.asarray(False)
        self.source_evals = (self.source_evals + [now])[-self.tradeoff_window :]
        b = self.sources_before or {}
        sources = [k for k in now if k.startswith("eval/reward/") and k in b]
        if (not self.tradeoff or len(sources) < 2 or "eval/reward" not in b
                or len(self.source_evals) < self.tradeoff_window):
            return np.asarray(False)
        mean = {k: _mean([e[k] for e in self.source_evals]) for k in [*sources, "eval/reward"]}
        falls = {}
        for k in sources:
            sd_key = "eval/reward_std/" + k.removeprefix("eval/reward/")
            if not self.eval_prompts or any(sd_key not in e for e in self.source_evals):
                continue  # no noise model: not watched
            var = _mean([np.square(e[sd_key]) for e in self.source_evals])  # the window's mean variance
            se = np.sqrt((np.square(b[sd_key]) if sd_key in b else var) + var) / math.sqrt(self.eval_prompts)
            falls[k] = (b[k] > 0) & (mean[k] < (1 - self.tradeoff) * b[k]) & (b[k] - mean[k] > self.z_tradeoff * se)
        self.fallen = [k for k, f in falls.items() if np.ndim(f) == 0 and f]
        if not falls:
            return np.asarray(False)
        return np.logical_or.reduce(list(falls.values())) & (mean["eval/reward"] > b["eval/reward"])

    def _message(self, key: str, step: int, stats: dict) -> str:
        head = f"step {step}: the policy may be gaming its reward: "
        if key == "guard/reward_tradeoff":
            b = self.sources_before or {}
            now = {k: float(_mean([e[k] for e in self.source_evals])) for k in [*self.fallen, "eval/reward"]}
            fell = ", ".join(f"{k.removeprefix('eval/reward/')} {float(b[k]):.2f} -> {now[k]:.2f}" for k in self.fallen)
            return (head + f"held-out reward source(s) fell by more than ppo.guard_tradeoff={self.tradeoff:g} of their "
                    f"value before training ({fell}, means of the last {self.tradeoff_window} evaluations) while the "
                    f"weighted total rose ({float(b['eval/reward']):.2f} -> {now['eval/reward']:.2f}): one term is bought with another. Raise the fallen "
                    "source's weight (reward.weights), make the rising one ask for it too, or raise ppo.kl_coef")
        if key == "guard/kl_high":
            smooth = float(_mean(self.evals[-self.eval_window :]))
            return (head + f"the KL to the reference averaged {float(_mean(self.kl_recent)):.2f} nats per token over "
                    f"the last {self.window} steps (> ppo.guard_kl={self.kl_max:g}) while {self.metric} fell to "
                    f"{smooth:.3f} (mean of the last {self.eval_window} evaluations) from its best {float(self.best):.3f}, "
                    "beyond the evaluations' noise; raise ppo.kl_coef or lower ppo.lr")
        if key == "guard/eos_collapse":
            return (head + f"only {float(_mean(self.eos_recent)):.2f} of responses ended with EOS over the last "
                    f"{self.window} steps (first {self.anchor} steps: {float(_mean(self.eos_anchor)):.2f}); set "
                    "ppo.missing_eos_penalty or raise ppo.kl_coef")
        smooth, best = float(_mean(self.evals[-self.eval_window :])), float(self.best)
        score, then = (float(_mean(self.score_recent)) if self.score_recent else math.nan), float(self.score_at_best)
        trend = (f"while the training score rose ({then:.3f} -> {score:.3f}): the reward is being over-optimised"
                 if score > then else f"and the training score did not rise ({then:.3f} -> {score:.3f})")
        return (head + f"{self.metric} fell to {smooth:.3f} (mean of the last {self.eval_window} evaluations) from its best "
                f"{best:.3f}, more than ppo.guard_eval_drop={self.eval_drop:g} of it, {trend}; stop earlier "
                "(ppo.stop_at) or raise ppo.kl_coef")

    WINDOWS = ("eos_anchor", "eos_recent", "eos_anchor_var", "eos_recent_var", "kl_recent", "score_recent", "evals")

    def state_dict(self) -> dict:
        plain = lambda v: None if v is None else np.asarray(v).tolist()  # noqa: E731
        return {**{k: [plain(v) for v in getattr(self, k)] for k in self.WINDOWS},
                "best": plain(self.best), "score_at_best": plain(self.score_at_best),
                "source_evals": [{k: plain(v) for k, v in e.items()} for e in self.source_evals],
                "sources_before": None if self.sources_before is None else
                {k: plain(v) for k, v in self.sources_before.items()},
                "warned": list(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        array = lambda v: None if v is None else np.asarray(v, dtype=float)  # noqa: E731
        self.warned = list(state["warned"])
        before = state.get("sources_before")
        self.sources_before = None if before is None else {k: array(v) for k, v in before.items()}
        self.source_evals = [{k: array(v) for k, v in e.items()} for e in state.get("source_evals", [])]
        if "eos_anchor" not in state:  # a checkpoint of the single-batch guards: their windows start fresh
            return
        for k in self.WINDOWS:  # the EOS variances, absent before their standard error was logged: NaN
            rates = state[k.removesuffix("_var")]
            setattr(self, k, [array(v) for v in state.get(k, [np.full_like(array(r), math.nan) for r in rates])])
        self.best, self.score_at_best = array(state["best"]), array(state["score_at_best"])


class SignalWatch:
    """Warns once each when, over the last ``window`` steps, more than ``share`` of the prompt groups
    carry no reward variance, of the completions are cut, or of the probability is cut by top-k/p."""

    KEYS = ("frac_reward_zero_std", "response/truncated_rate", "rollout/kept_mass")
    # the share of the batch without the signal: of the kept mass its complement, the others as logged
    WITHOUT = {"rollout/kept_mass": lambda v: 1.0 - v}

    def __init__(self, group_key: str = "ppo.group_size", window: int = 5, share: float = 0.5):
        self.group_key, self.window, self.share = group_key, window, share
        self.recent: dict[str, list[float]] = {key: [] for key in self.KEYS}
        self.warned: list[str] = []

    def check(self, step: int, stats: dict[str, float], max_new_tokens: int | None = None) -> None:
        for key in self.KEYS:
            value = stats.get(key)
            if value is None:
                continue
            value = self.WITHOUT.get(key, float)(float(value))
            recent = self.recent[key] = (self.recent[key] + [value])[-self.window :]
            mean = sum(recent) / len(recent)
            if len(recent) == self.window and mean > self.share and key not in self.warned:
                self.warned.append(key)
                warnings.warn(self._message(key, step, mean, max_new_tokens), RuntimeWarning, stacklevel=2)

    def _message(self, key: str, step: int, mean: float, max_new_tokens: int | None) -> str:
        head = f"step {step}: over the last {self.window} steps "
        if key == "frac_reward_zero_std":
            return (head + f"{mean:.0%} of prompt groups scored all their completions alike (frac_reward_zero_std): "
                    "they carry no learning signal. Give partial credit with a shaped reward (several weighted "
                    f"reward.function entries, reward.weights), sample more completions per prompt ({self.group_key}), "
                    "or start from an SFT warm-up (rlhfkit sft) that sometimes earns the reward")
        if key == "rollout/kept_mass":
            return (head + f"top-k / top-p dropped {mean:.0%} of the probability (rollout/kept_mass {1 - mean:.2f}): "
                    "the samples are far off-policy and every estimate over them (the policy gradient, "
                    "objective/kl) is biased. Raise ppo.top_p / ppo.top_k, or reweigh the loss "
                    "(ppo.sampling_correction=token_truncate)")
        limit = f"ppo.max_new_tokens={max_new_tokens}" if max_new_tokens else "ppo.max_new_tokens"
        return (head + f"{mean:.0%} of completions were cut at {limit} without EOS (response/truncated_rate): "
                "their rewards judge unfinished answers. Raise ppo.max_new_tokens, penalise them "
                "(ppo.missing_eos_penalty) or leave them out of the loss (ppo.mask_truncated_completions=true)")

    def state_dict(self) -> dict:
        return {"recent": {k: list(v) for k, v in self.recent.items()}, "warned": list(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.recent = {key: list(state["recent"].get(key, [])) for key in self.KEYS}
        self.warned = list(state["warned"])
