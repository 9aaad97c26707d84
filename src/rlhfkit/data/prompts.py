"""RL prompts from the user's files (``data.path``) or a built-in task (``run.task``), as records whose
other columns travel with the rows (groups, shards, checkpoints) to the reward functions."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..run.checkpoint import data_state, load_data_state
from . import DataError, Limit, context_limit, encode_prompts, hold_out, load_prompts


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and the other columns of its row."""

    text: str  # the prompt as the model reads it (chat template applied)
    columns: dict[str, Any] = field(default_factory=dict)  # every other field of the record
    prompt: Any = None  # the prompt as the user gave it (a string or messages); None: ``text``
    ids: tuple[int, ...] | None = None  # token ids (BOS included), when tokenised at load time

    @property
    def original(self) -> Any:
        return self.text if self.prompt is None else self.prompt


class FilePrompts:
    """The user's records in seeded epochs, batches taken across their boundaries; :meth:`state_dict`
    is the exact position (for kill-and-resume)."""

    def __init__(self, records: list[PromptRecord], seed: int):
        if not records:
            raise DataError("no prompts to train on")
        self.records = records
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch, self.pos = 0, 0
        self.order = torch.randperm(len(records), generator=self.gen).tolist()

    def batch(self, n: int) -> list[PromptRecord]:
        out: list[PromptRecord] = []
        while len(out) < n:
            if self.pos == len(self.order):  # the pass is over: a fresh order for the next one
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = torch.randperm(len(self.records), generator=self.gen).tolist()
            take = self.order[self.pos : self.pos + n - len(out)]
            out += [self.records[i] for i in take]
            self.pos += len(take)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "order": self.order, "gen": self.gen.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.order = state["epoch"], state["pos"], list(state["order"])
        self.gen.set_state(torch.tensor(state["gen"], dtype=torch.uint8))


class TaskPrompts:
    """A built-in task's seeded prompt generator as records (it never repeats a pass: epoch 0)."""

    epoch = 0

    def __init__(self, task, seed: int):
        self.task, self.data = task, task.TaskData(seed)

    def batch(self, n: int) -> list[PromptRecord]:
        return task_records(self.task, self.data.prompts(n))

    def state_dict(self):
        return data_state(self.data)

    def load_state_dict(self, state) -> None:
        load_data_state(self.data, state)


def task_records(task, prompts) -> list[PromptRecord]:
    """A task's prompt objects (e.g. its held-out set) as records."""
    return [PromptRecord(p.text, task.columns(p)) for p in prompts]


def file_records(source, tok, cfg, what: str = "data.path", limit: int | Limit | None = None) -> list[PromptRecord]:
    """Records from a file, directory or hub dataset, tokenised once; prompts over ``limit`` (default
    ``data.max_prompt_length``) follow ``data.truncation``."""
    dc = cfg.data
    limit = dc.max_prompt_length if limit is None else limit
    examples = load_prompts(source, tok, split=dc.split or None)
    ids, cut = encode_prompts(examples, tok, limit, dc.truncation)
    if cut:
        name = limit.name if isinstance(limit, Limit) else f"data.max_prompt_length={limit} tokens"
        print(f"warning: {cut} of {len(examples)} prompts in {what}={source} are longer than {name}; their first "
              "tokens were dropped (data.truncation=left)", file=sys.stderr)
    return [PromptRecord(ex.prompt, ex.meta, ex.raw, tuple(row)) for ex, row in zip(examples, ids)]


def prompt_tensors(tok, records: list[PromptRecord], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids [B, P], attention_mask [B, P])`` of the records' prompts."""
    if any(r.ids is None for r in records):
        enc = tok([r.text for r in records], padding=True, return_tensors="pt", padding_side="left")
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return left_pad([list(r.ids) for r in records], pad, device)


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [n, W], mask [n, W])`` of token rows padded on the left to the longest, ``W``."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


@dataclass
class PromptData:
    """The RL loop's prompts: a training source, the held-out records and the built-in task."""

    train: FilePrompts | TaskPrompts
    eval_records: list[PromptRecord]
    task: Any = None


def new_tokens(cfg, task=None) -> tuple[int, str]:
    """The most tokens an RL run samples after a prompt (training or held-out) and the key that sets it."""
    default = task.MAX_NEW_TOKENS if task is not None and not cfg.data.path else 0
    train = cfg.ppo.max_new_tokens or default
    held = cfg.eval.max_new_tokens or default or train  # held-out prompts of a file: as in training
    return max((train, "ppo.max_new_tokens"), (held, "eval.max_new_tokens"))


def prompt_limit(cfg, context: int | None, new: int, new_key: str) -> int | Limit:
    """``data.max_prompt_length``, or less where ``context`` must also hold ``new`` sampled tokens."""
    return context_limit("data.max_prompt_length", cfg.data.max_prompt_length, context, new, new_key)


def check_task_fits(task, tok, context: int | None, new: int, new_key: str) -> None:
    """Refuse a built-in task whose prompts plus ``new`` tokens exceed the model's ``context``."""
    if context is None:
        return
    longest = max(len(ids) for ids in tok([p.text for p in task.eval_prompts()], verbose=False)["input_ids"])
    if longest + new > context:
        raise ValueError(f"{new_key}={new} plus the task's longest prompt ({longest} tokens) is {longest + new} "
                         f"tokens, more than the model's context of {context}: lower {new_key} to "
                         f"{max(0, context - longest)} or less")


def prompt_data(cfg, tok, task, context: int | None = None) -> PromptData:
    """``data.path`` (held out: ``data.eval_path`` or ``data.eval_fraction``), else the task's prompts and
    held-out set; prompts plus new tokens must fit ``context``."""
    dc = cfg.data
    new, new_key = new_tokens(cfg, task)
    if not dc.path:
        check_task_fits(task, tok, context, new, new_key)
        return PromptData(TaskPrompts(task, cfg.run.seed + 2), task_records(task, task.eval_prompts()), task)
    limit = prompt_limit(cfg, context, new, new_key)
    records = file_records(dc.path, tok, cfg, limit=limit)
    if dc.eval_path:
        held = file_records(dc.eval_path, tok, cfg, "data.eval_path", limit)
    else:
        records, held = hold_out(records, dc.eval_fraction, cfg.run.seed + 7, "prompts")
    return PromptData(FilePrompts(records, cfg.run.seed + 2), held)
