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
