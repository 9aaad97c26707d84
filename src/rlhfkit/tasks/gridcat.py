"""The grid-world cat of the RL course notes as a text game for a language model.

The world is :mod:`rlhfkit.tasks.gridworld`'s (the cat, the meat +100 that ends the episode, the
bathtub -10 that ends it, the brooms -1), played through :class:`~rlhfkit.envs.Environment`:
each observation is one letter naming the cat's cell (``a`` .. ``p`` on the 4 x 4 layout, row
by row), the model answers with a move arrow (``↑`` ``↓`` ``←`` ``→``) and its EOS. Only the
turn's first character is read; a turn that does not start with an arrow costs -1 (as a
broom) and leaves the cat where it is -- a model trained from scratch first has to learn to
speak in moves. An episode ends on meat or bathtub, or after ``max_turns`` = 20 moves, the
tabular learner's ``gridworld.max_steps``.

The vocabulary (:func:`make_tokenizer`) holds only these characters, BOS, EOS and padding; the
tokenizer has no chat template, so observations are appended as plain text tokens.
"""

from __future__ import annotations

import torch

from ..envs import Environment
from . import char_tokenizer
from .gridworld import ARROWS, DEFAULT_LAYOUT, GridWorld

CELLS = "abcdefghijklmnop"  # cell s = row * cols + col of the default 4 x 4 layout
MOVES = ARROWS  # "↑↓←→": gridworld.ACTIONS' up, down, left, right
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
