"""A three-turn environment for the data-parallel runs (tests/dist/driver.py): a fixed observation
after each turn, a reward per turn that depends on the turn's text."""

from rlhfkit.envs.environment import Environment


class Echo(Environment):
    max_turns, max_tokens = 3, 32  # the tiny models' context

    def step(self, text):
        return {"role": "user", "content": "x2"}, float(len(text) % 3), False
