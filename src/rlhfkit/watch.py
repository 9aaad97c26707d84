"""Signs that an RL run is gaming its reward rather than learning the task.

A learned reward is exploitable: a policy can raise its score by drifting far from the
reference into text the reward model never saw, by dropping the EOS (a truncated answer the
reward still likes), or by trading held-out quality for training score. :class:`HackingWatch`
checks each step's logged statistics for the three signs and returns them as ``guard/*``
metrics (1 on the steps where the sign shows, 0 otherwise); the first time each shows it also
warns once, naming the step and the setting that bounds it. ``rlhfkit report`` marks the
steps on every curve.

* ``guard/kl_high``: the per-sequence KL to the reference (``objective/kl``, nats) is above
  ``ppo.guard_kl``;
* ``guard/eos_collapse``: the share of responses that end with EOS fell below
  ``ppo.guard_eos`` times its value at the first step;
* ``guard/eval_drop``: the held-out metric (``ppo.stop_metric``) fell more than
  ``ppo.guard_eval_drop`` below its best while the training score (``objective/score``)
  is above its value at that best.

:class:`SignalWatch` warns, once each, when most prompt groups carry no reward variance or most
completions are cut at ``max_new_tokens``: not gaming, but a run with little to learn from.
"""

from __future__ import annotations

import warnings

KEYS = ("guard/kl_high", "guard/eos_collapse", "guard/eval_drop")


class HackingWatch:
    """Per-step reward-hacking checks; ``check(step, stats)`` returns the ``guard/*`` flags.
    Its counters are part of a checkpoint (:meth:`state_dict`), so a resumed run flags and warns
    exactly as an unbroken one."""

    def __init__(self, kl_max: float = 0.0, eos_ratio: float = 0.0, eval_drop: float = 0.0,
                 metric: str = "eval/exact_acc"):
        self.kl_max, self.eos_ratio, self.eval_drop, self.metric = kl_max, eos_ratio, eval_drop, metric
        self.first_eos: float | None = None
        self.best: float | None = None
        self.score_at_best = 0.0
        self.warned: list[str] = []

    def check(self, step: int, stats: dict[str, float]) -> dict[str, float]:
        kl, eos, score = stats.get("objective/kl", 0.0), stats.get("response/eos_rate"), stats.get("objective/score")
        if self.first_eos is None and eos is not None:
            self.first_eos = eos
        flags = {
            "guard/kl_high": bool(self.kl_max and kl > self.kl_max),
            "guard/eos_collapse": bool(self.eos_ratio and eos is not None and self.first_eos
                                       and eos < self.eos_ratio * self.first_eos),
            "guard/eval_drop": False,
        }
        value = stats.get(self.metric)
        if value is not None and score is not None:
            if self.best is None or value > self.best:
                self.best, self.score_at_best = value, score
            flags["guard/eval_drop"] = bool(self.eval_drop and value < self.best - self.eval_drop
                                            and score > self.score_at_best)
        for key, on in flags.items():
            if on and key not in self.warned:
                self.warned.append(key)
                warnings.warn(self._message(key, step, stats), RuntimeWarning, stacklevel=2)
        return {k: float(v) for k, v in flags.items()}

    def _message(self, key: str, step: int, stats: dict) -> str:
        head = f"step {step}: the policy may be gaming its reward: "
        if key == "guard/kl_high":
            return (head + f"per-sequence KL to the reference is {stats['objective/kl']:.1f} nats (> ppo.guard_kl="
                    f"{self.kl_max:g}); raise ppo.kl_coef or lower ppo.lr")
        if key == "guard/eos_collapse":
            return (head + f"only {stats['response/eos_rate']:.2f} of responses end with EOS (first step: "
                    f"{self.first_eos:.2f}); set ppo.missing_eos_penalty or raise ppo.kl_coef")
        return (head + f"{self.metric} fell to {stats[self.metric]:.3f} from its best {self.best:.3f} while the "
                f"training score rose; the reward is being over-optimised: stop earlier (ppo.stop_at) or raise "
                "ppo.kl_coef")

    def state_dict(self) -> dict:
        return {"first_eos": self.first_eos, "best": self.best, "score_at_best": self.score_at_best,
                "warned": list(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.first_eos, self.best = state["first_eos"], state["best"]
        self.score_at_best, self.warned = state["score_at_best"], list(state["warned"])


class SignalWatch:
    """Warns once per run, each, when the batches carry little learning signal:

    * most prompt groups have no reward variance (``frac_reward_zero_std``): every completion of
      a prompt scored alike, so group-relative advantages are 0 and those prompts teach nothing
      (a 0/1 reward the model never, or always, earns);
    * most completions are cut at ``max_new_tokens`` (``response/truncated_rate``): their scores
      judge unfinished answers.

    The rule is the share over the last ``window`` steps (equal batches: the mean of the step
    shares), above ``share``, so one unlucky batch does not warn and a run that starts without
    signal warns at step ``window - 1``. The counters are part of a checkpoint.
    """

    KEYS = ("frac_reward_zero_std", "response/truncated_rate")

    def __init__(self, group_key: str = "ppo.group_size", window: int = 5, share: float = 0.5):
        self.group_key, self.window, self.share = group_key, window, share
        self.recent: dict[str, list[float]] = {key: [] for key in self.KEYS}
        self.warned: list[str] = []

    def check(self, step: int, stats: dict[str, float], max_new_tokens: int | None = None) -> None:
        for key in self.KEYS:
            value = stats.get(key)
            if value is None:
                continue
            recent = self.recent[key] = (self.recent[key] + [float(value)])[-self.window :]
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
        limit = f"ppo.max_new_tokens={max_new_tokens}" if max_new_tokens else "ppo.max_new_tokens"
        return (head + f"{mean:.0%} of completions were cut at {limit} without EOS (response/truncated_rate): "
                "their rewards judge unfinished answers. Raise ppo.max_new_tokens, penalise them "
                "(ppo.missing_eos_penalty) or leave them out of the loss (ppo.mask_truncated_completions=true)")

    def state_dict(self) -> dict:
        return {"recent": {k: list(v) for k, v in self.recent.items()}, "warned": list(self.warned)}

    def load_state_dict(self, state: dict) -> None:
        self.recent = {key: list(state["recent"].get(key, [])) for key in self.KEYS}
        self.warned = list(state["warned"])
