"""The grid-world cat of :mod:`rlhfkit.tasks.gridworld` as a text game (docs/environments.md): each
observation is the letter of the cat's cell (``a`` .. ``p``, row by row), the model answers with a
move arrow and its EOS. Only a turn's first character is read; one that is not an arrow costs -1
(a broom's) and leaves the cat in place. ``max_turns`` is the tabular learner's ``max_steps``.
The tokenizer has no chat template: observations are appended as plain text tokens.
"""

from __future__ import annotations

import torch

from ..envs.environment import Environment
from . import char_tokenizer
from .gridworld import ARROWS, DEFAULT_LAYOUT, GridWorld

CELLS = "abcdefghijklmnop"  # cell s = row * cols + col of the default 4 x 4 layout
MOVES = ARROWS  # "↑↓←→": up, down, left, right, as the grid world numbers its actions
BOS, EOS, PAD = "S", "E", "P"
NOT_A_MOVE = -1.0  # the cost of a turn that is not a move (a broom's)


def make_tokenizer(max_length: int = 64):
    """One token per character: the cell letters, the move arrows, BOS, EOS and padding."""
    return char_tokenizer([PAD, BOS, EOS, *CELLS, *MOVES], BOS, EOS, PAD, max_length)


class GridCat(Environment):
    """The cat on the default layout, one move per model turn (see the module docstring)."""

    max_turns = 20

    def __init__(self):
        self.world = GridWorld(DEFAULT_LAYOUT, drunk=0.0, max_steps=self.max_turns)
        self.cell = self.world.start

    def reset(self, record) -> list[dict]:
        self.cell = self.world.start
        return [{"role": "user", "content": CELLS[self.cell]}]

    def step(self, text: str):
        move = MOVES.find(text[:1]) if text else -1
        if move < 0:
            return {"role": "user", "content": CELLS[self.cell]}, NOT_A_MOVE, False
        nxt, reward, done = self.world.step(torch.tensor([self.cell]), torch.tensor([move]))
        self.cell = int(nxt)
        return {"role": "user", "content": CELLS[self.cell]}, float(reward), bool(done)
