"""The calculator task on a real chat model: multi-digit arithmetic the model cannot do alone,
with a calculator tool offered through :class:`rlhfkit.envs.tools.ToolEnvironment`.

``calculator`` is the tool: it parses two numbers and one operator (``+ - * /``) with a regular
expression and computes the result in Python; nothing the model writes is evaluated as code.
``CalculatorEnv`` poses a record's question (its ``answer`` column holds the result) and scores
the final turn: 1 when it is the number alone, else 0. ``shaping`` adds 0.2 for a tool turn whose
call ran (a parseable call of ``calculator`` that returned a number): the base model rarely calls
a tool in the expected format, so the exact answer alone would leave most groups without signal.
"""

from __future__ import annotations

import re

from rlhfkit.envs.tools import ToolCall, ToolEnvironment, parse_tool_call

NUMBER = r"-?\d+(?:\.\d+)?"
EXPRESSION = re.compile(rf"^\s*({NUMBER})\s*([-+*/x×÷])\s*({NUMBER})\s*=?\s*$")


def _number(s: str) -> int | float:
    return float(s) if "." in s else int(s)


def calculator(expression: str) -> str:
    """Compute a single arithmetic operation on two numbers.

    Args:
        expression: two numbers and one operator (+, -, *, /), e.g. "347 * 29"
    """
    m = EXPRESSION.match(expression.replace(",", ""))
    if m is None:
        raise ValueError(f"cannot read {expression!r}: write two numbers and one operator, e.g. 347 * 29")
    a, op, b = _number(m.group(1)), m.group(2), _number(m.group(3))
    if op in "/÷":
        if b == 0:
            raise ZeroDivisionError("division by zero")
        result = a / b
    else:
        result = a + b if op == "+" else a - b if op == "-" else a * b
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def answer_of(text: str) -> str:
    """The final turn read as a number: the text less spaces, a trailing period and commas."""
    return text.strip().rstrip(".").replace(",", "").strip()


class CalculatorEnv(ToolEnvironment):
    tools, tool_timeout, max_turns = (calculator,), 5.0, 3
    shaping = 0.2  # reward of a tool turn whose call ran

    def reset(self, record):
        self.want = str(record.columns["answer"])
        return super().reset(record)

    def reward(self, text: str) -> float:
        return float(answer_of(text) == self.want)

    def step(self, text: str):
        obs, reward, done = super().step(text)
        if not done and isinstance(parse_tool_call(text), ToolCall) and re.fullmatch(NUMBER, obs["content"]):
            reward = self.shaping
        return obs, reward, done


class CalculatorEnvNoShaping(CalculatorEnv):
    shaping = 0.0
