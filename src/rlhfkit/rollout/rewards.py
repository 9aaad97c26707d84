"""Reward sources: what turns a rollout into one score per response. A :class:`Reward` is a
weighted sum of named sources, each a rollout -> ``[B]`` scores: a reward model, a label
classifier or a Python function called as TRL's GRPOTrainer calls one (docs/data.md);
:func:`build_reward` assembles them from the ``reward`` section."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..callables import (
    RewardError,
    function_name,
    load_reward_function,
    named_weights,
    source_name,
    split_specs,
)
from ..config import Config
from ..data.prompts import PromptRecord
from ..models.forward import (
    disable_dropout,
    freeze,
    load_scalar_model,
    load_tokenizer,
    same_tokenizer,
    sequence_logits,
    sequence_scores,
)
from ..tasks import get_task
from .generate import Rollout, response_rows

Source = Callable[[Rollout, Sequence[PromptRecord] | None], torch.Tensor]


@dataclass
class Reward:
    """A weighted sum of named reward sources: ``score(roll, records) -> (total [B], {name: [B]})``.
    Calling it returns the total alone."""

    sources: list[tuple[str, float, Source]]
    models: list = field(default_factory=list)
    """The reward models the sources call (FSDP shards them)."""
    accuracy: tuple[str, ...] = ()
    """The sources ``eval.accuracy_reward`` names for ``eval/accuracy``; empty: those declared 0/1."""

    def score(self, roll: Rollout, records: Sequence[PromptRecord] | None = None):
        """``(total [B], {name: [B]})``. A function's None (NaN in its part) leaves that part out
        of the total, as in TRL; where no part scores, the total is NaN (one warning says so).
        Any other non-finite score stops the run with the source's name."""
        if not self.sources:  # an environment's rewards alone
            return torch.zeros(roll.response_ids.shape[0], device=roll.response_ids.device), {}
        parts = {name: fn(roll, records).float() for name, _, fn in self.sources}  # [B] each
        for name, _, fn in self.sources:
            if not getattr(fn, "skips", False):
                check_finite(name, parts[name])
        for name in self.declared_binary():
            check_binary(name, parts[name], name in self.accuracy)
        total = sum(w * parts[name].nan_to_num(0.0) for name, w, _ in self.sources)  # [B]: a None adds 0 (nansum)
        unscored = torch.stack([p.isnan() for p in parts.values()]).all(0)  # [B]: no source scored it
        if bool(unscored.any()):
            warnings.warn(UNSCORED_WARNING, RuntimeWarning, stacklevel=2)
            total = torch.where(unscored, torch.nan, total)
        return total, parts

    def declared_binary(self) -> list[str]:
        """Sources whose scores must be 0 or 1: named by ``eval.accuracy_reward`` or ``binary = True``."""
        return [name for name, _, fn in self.sources if name in self.accuracy or getattr(fn, "binary", False)]

    def accuracy_sources(self) -> list[str]:
        """The sources whose all scoring 1 makes a completion correct (``eval/accuracy``)."""
        return list(self.accuracy) or [name for name, _, fn in self.sources if getattr(fn, "binary", False)]

    def __call__(self, roll: Rollout, records: Sequence[PromptRecord] | None = None) -> torch.Tensor:
        return self.score(roll, records)[0]

    @property
    def weights(self) -> dict[str, float]:
        return {name: w for name, w, _ in self.sources}


Scorer = Reward  # the name the experience pass uses


UNSCORED_WARNING = ("every reward function returned None for some completions: they have no score, so they are left "
                    "out of the group and batch baselines and of the logged reward means, and their advantage is 0 "
                    "(TRL's rule); give them a score in one function if they should count")


def check_finite(name: str, scores: torch.Tensor) -> None:
    """RewardError when a reward model gave non-finite ``scores [B]`` (it would reach every advantage)."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        raise RewardError(f"reward source {name} gave non-finite scores to {int(bad.sum())} of {scores.numel()} "
                          "responses: check the reward model's weights (reward.name)")


def check_binary(name: str, scores: torch.Tensor, by_config: bool = False) -> None:
    """RewardError when a source declared 0/1 gave ``scores [B]`` other than 0, 1 or NaN (not scored)."""
    bad = (scores != 0) & (scores != 1) & ~scores.isnan()
    if bool(bad.any()):
        how = "named by eval.accuracy_reward" if by_config else "declared binary (binary = True)"
        raise RewardError(f"reward source {name} is {how} but returned {scores[bad][0].item():g} for "
                          f"{int(bad.sum())} of {scores.numel()} completions: return only 0 or 1, or drop the "
                          "declaration (eval/accuracy then comes from the other declared sources, or is not logged)")


def retokenize(roll: Rollout, tokenizer, rm_tokenizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout in another model's vocabulary: ``(ids [B, T'], mask [B, T'])``: prompt and
    response as text, closed with ``rm_tokenizer``'s EOS where the response ended."""
    prompts = tokenizer.batch_decode(roll.prompt_ids.tolist(), skip_special_tokens=True)
    responses = tokenizer.batch_decode(response_rows(roll.response_ids, roll.response_attention),
                                       skip_special_tokens=True)
    eos = rm_tokenizer.eos_token or ""
    texts = [p + r + (eos if done else "") for p, r, done in zip(prompts, responses, roll.finished.tolist())]
    enc = rm_tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=True)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def _read(readout: Callable, model, roll: Rollout, tokenizer, rm_tokenizer) -> torch.Tensor:
    """``readout`` (:func:`sequence_scores`, :func:`sequence_logits`) of ``model`` on the rollout:
    its own ids (each group's prompt runs once), or re-tokenised with ``rm_tokenizer``."""
    if rm_tokenizer is None:
        return readout(model, roll.input_ids, roll.attention_mask, prompt_len=roll.prompt_ids.shape[1])
    return readout(model, *retokenize(roll, tokenizer, rm_tokenizer, roll.input_ids.device))


def reward_model_scorer(reward_model, tokenizer=None, rm_tokenizer=None, name: str = "reward_model") -> Reward:
    """Score = the reward model's scalar at the last attended token of prompt + response."""

    def score(roll: Rollout, records=None) -> torch.Tensor:
        return _read(sequence_scores, reward_model, roll, tokenizer, rm_tokenizer)

    return Reward([(name, 1.0, score)], [reward_model])


def classifier_scorer(classifier, tokenizer, label_fn: Callable[[str], int], rm_tokenizer=None,
                      name: str = "reward_model") -> Reward:
    """Score = the classifier's logit, at the last attended token, of the label the prompt asks
    for (the doubling task's reward: a classifier of the answer's character set)."""

    def score(roll: Rollout, records=None) -> torch.Tensor:
        logits = _read(sequence_logits, classifier, roll, tokenizer, rm_tokenizer)  # [B, L]
        prompts = tokenizer.batch_decode(roll.prompt_ids.tolist(), skip_special_tokens=True)
        labels = torch.tensor([label_fn(p) for p in prompts], device=logits.device)  # [B]
        return logits.gather(1, labels[:, None]).squeeze(1)  # [B]

    return Reward([(name, 1.0, score)], [classifier])


def completion_texts(roll: Rollout, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Each row's response ids (EOS included when emitted) and text (special tokens removed)."""
    ids = response_rows(roll.response_ids, roll.response_attention)
    return ids, tokenizer.batch_decode(ids, skip_special_tokens=True)


def call_arguments(roll: Rollout, tokenizer, records: Sequence[PromptRecord] | None) -> dict:
    """The keyword arguments a reward function receives for a rollout (docs/data.md)."""
    ids, texts = completion_texts(roll, tokenizer)
    if records is None:  # no records: the prompts as the model read them
        prompts: list = tokenizer.batch_decode(roll.prompt_ids.tolist(), skip_special_tokens=True)
        columns: dict[str, list] = {}
    else:
        prompts = [r.original for r in records]
        columns = {k: [r.columns.get(k) for r in records] for k in (records[0].columns if records else {})}
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    return {"prompts": prompts, "completions": completions, "completion_ids": ids,
            "finished": roll.finished.tolist(), **columns}


def function_scorer(fn: Callable[..., list[float]], tokenizer, name: str | None = None) -> Reward:
    """Score = ``fn(prompts=, completions=, completion_ids=, finished=, **columns)``: one number
    per completion, or None for one it does not score (NaN in its ``[B]`` scores). A RewardError
    naming the function when it raises or returns anything else (a NaN returned is a bug more
    often than a choice)."""
    full = function_name(fn)

    def score(roll: Rollout, records=None) -> torch.Tensor:
        kwargs = call_arguments(roll, tokenizer, records)
        try:
            values = fn(**kwargs)
        except Exception as e:  # the user's code: one line that names it (RLHFKIT_DEBUG=1 for the traceback)
            raise RewardError(f"reward function {full} raised {type(e).__name__}: {e}") from e
        return _as_scores(values, len(kwargs["completions"]), full, kwargs["completions"]).to(roll.response_ids.device)

    score.binary = bool(getattr(fn, "binary", False))  # a 0/1 declaration travels with the source
    score.skips = True  # may return None for a completion: NaN in its scores, not an error
    return Reward([(name or source_name(fn), 1.0, score)])


def _as_scores(values, n: int, name: str, completions: list) -> torch.Tensor:
    """``[n]`` float32 scores from what a reward function returned; NaN where it gave None."""
    fix = f"return a list of {n} floats (or None for a completion it does not score), one per completion, in order"
    if values is None:
        raise RewardError(f"reward function {name} returned None: {fix}")
    try:
        items = values if isinstance(values, torch.Tensor) else list(values)
        skipped = [] if isinstance(items, torch.Tensor) else [i for i, v in enumerate(items) if v is None]
        out = torch.as_tensor([0.0 if v is None else v for v in items] if skipped else items, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise RewardError(f"reward function {name} returned {type(values).__name__} {str(values)[:60]!r}, "
                          f"not numbers: {fix}") from None
    if out.shape != (n,):
        raise RewardError(f"reward function {name} returned {out.numel()} scores (shape {tuple(out.shape)}) "
                          f"for {n} completions: {fix}")
    bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
    if bad:
        raise RewardError(f"reward function {name} returned {len(bad)} non-finite score(s) (NaN/inf) for {n} "
                          f"completions, e.g. {out[bad[0]].item()} for {completions[bad[0]]!r}: give every "
                          "completion a finite score, or None for one it does not score")
    out[skipped] = torch.nan
    return out


def other_tokenizer(path: str, tok, trust_remote_code: bool = False):
    """The tokenizer saved with the model at ``path`` when it differs from ``tok`` (the policy's),
    else None (a directory without tokenizer files shares the policy's). One without a pad token
    pads with its EOS: the readout comes from the attention mask."""
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f))
                                       for f in ("tokenizer_config.json", "tokenizer.json")):
        return None
    own = load_tokenizer(path, trust_remote_code=trust_remote_code, need_pad=False)
    if same_tokenizer(own, tok):
        return None
    if own.pad_token_id is None:
        own.pad_token = own.eos_token
    return own


def model_source(cfg: Config, tok, device) -> Reward:
    """The model at ``reward.name``: a scalar model, or a classifier read with
    ``reward.label_function`` or the task's ``label_of_prompt``."""
    rc, mc = cfg.reward, cfg.model
    if isinstance(rc.name, str):
        rm = load_scalar_model(rc.name, mc.dtype, mc.trust_remote_code, num_labels=None)
        rm_tok = other_tokenizer(rc.name, tok, mc.trust_remote_code)  # None: the policy's ids are read as they are
    else:  # a model object given from Python: it reads the policy's token ids
        rm, rm_tok = rc.name, None
    rm = freeze(disable_dropout(rm)).to(device)
    if rm.config.num_labels == 1:
        return reward_model_scorer(rm, tok, rm_tok)
    # a label classifier (the number-doubling tutorial task's reward), not a pairwise scalar
    if rc.label_function:
        return classifier_scorer(rm, tok, load_reward_function(rc.label_function), rm_tok)
    task = get_task(cfg.run.task)
    if not hasattr(task, "label_of_prompt"):
        raise ValueError(f"{rc.name} is a classifier with {rm.config.num_labels} labels but task "
                         f"{cfg.run.task!r} has no labels: set reward.label_function=module:name")
    return classifier_scorer(rm, tok, task.label_of_prompt, rm_tok)


def build_reward(cfg: Config, tok, device) -> Reward:
    """The model at ``reward.name`` and the functions of ``reward.function``, weighted by
    ``reward.weights`` (the model first; empty: all 1); each logged as ``reward/<name>``."""
    model = model_source(cfg, tok, device) if cfg.reward.name else Reward([])
    sources = model.sources + [function_scorer(load_reward_function(spec), tok).sources[0]
                               for spec in split_specs(cfg.reward.function)]
    names, weights, accuracy = named_weights([name for name, _, _ in sources], cfg)
    return Reward([(name, w, fn) for name, w, (_, _, fn) in zip(names, weights, sources)], model.models, accuracy)
