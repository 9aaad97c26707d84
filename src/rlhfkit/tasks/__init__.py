"""Built-in tasks: ``get_task(cfg.run.task)`` is the task's module, whence every trainer takes its
tokenizer, data and evaluation (what a task module provides: docs/contributing.md)."""

from __future__ import annotations

import importlib
from types import ModuleType

TASKS = {"doubling": "rlhfkit.tasks.doubling", "cities": "rlhfkit.tasks.cities"}


def char_tokenizer(vocab: list[str], bos: str, eos: str, pad: str, max_length: int):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``vocab``: BOS prepended by the
    tokenizer itself, left padding (batched generation), decoding joins characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {ch: i for i, ch in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   padding_side="left")
    fast.model_max_length = max_length
    return fast


def verified(verify, key: str, prompts: list, completions: list[str], finished: list | None, eos: str) -> list[float]:
    """``verify(prompt, completion)[key]`` of each completion as 1.0 or 0.0, a ``finished`` one with
    its EOS back (reward texts have special tokens removed)."""
    return [float(verify(p, c + eos if finished is not None and finished[i] else c)[key])
            for i, (p, c) in enumerate(zip(prompts, completions))]


def get_task(name: str) -> ModuleType:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)} (run.task)")
    return importlib.import_module(TASKS[name])
