"""Tools: Python functions the model may call during an episode (:class:`ToolEnvironment`;
docs/environments.md). A turn holding ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
gets the result (or the error) as a ``tool`` message; each call runs in a forked child, killed
after ``tool_timeout`` seconds, with Python's sockets disabled."""

from __future__ import annotations

import json
import multiprocessing
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .environment import Environment

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The first tool call of a turn: a :class:`ToolCall`, the error as text when malformed (it
    goes back to the model), None without one."""
    m = TOOL_CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return f"error: the tool call is not valid JSON ({e.msg})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(call.get("arguments", {}), dict):
        return 'error: a tool call is {"name": NAME, "arguments": {...}}'
    return ToolCall(call["name"], call.get("arguments", {}))


def _no_network(*args, **kwargs):
    raise OSError("tools run without network access")


def _child(fn: Callable, arguments: dict, conn) -> None:
    socket.socket = socket.create_connection = socket.socketpair = _no_network  # type: ignore[misc, assignment]
    try:
        conn.send(str(fn(**arguments)))
    except BaseException as e:  # the model learns from the error text
        conn.send(f"{type(e).__name__}: {e}")
    conn.close()


def call_tool(tools: Sequence[Callable], call: ToolCall, timeout: float) -> str:
    """Run ``call`` among ``tools`` in a forked child killed after ``timeout`` s; the result or error as text."""
    fn = next((t for t in tools if t.__name__ == call.name), None)
    if fn is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(t.__name__ for t in tools)}"
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, call.arguments, child), daemon=True)
    proc.start()
    child.close()
    try:
        result = parent.recv() if parent.poll(timeout) else f"TimeoutError: {call.name} ran over {timeout:g} s"
    except EOFError:  # the child died without answering
        result = f"error: {call.name} crashed"
    proc.kill()
    proc.join()
    parent.close()
    return result


class ToolEnvironment(Environment):
    """An environment offering ``tools`` (functions with type hints and docstrings): a turn with a
    tool call gets its result (reward 0); a turn without one ends the episode with :meth:`reward`.
    Subclass it, set ``tools``, override :meth:`reward` (and :meth:`reset`)."""

    tools: Sequence[Callable] = ()
    tool_timeout: float = 5.0

    def reward(self, text: str) -> float | None:
        """The final answer's reward (None: 0, the reward functions score the episode)."""
        return None

    def step(self, text: str):
        call = parse_tool_call(text)
        if call is None:
            return None, self.reward(text), True
        if isinstance(call, str):  # a malformed call: the error goes back to the model
            return {"role": "tool", "name": "tool", "content": call}, 0.0, False
        return {"role": "tool", "name": call.name, "content": call_tool(self.tools, call, self.tool_timeout)}, 0.0, False
