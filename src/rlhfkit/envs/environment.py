"""Multi-turn environments: the model acts, the environment answers, RL learns from the episode.
:func:`play` keeps the sampled tokens as they are, each observation appended as the chat
template's delta, in one :class:`~rlhfkit.rollout.generate.Rollout` (docs/environments.md: writing one,
token in / token out, limits, tools)."""

from __future__ import annotations

import json
import math
import numbers
import warnings
from collections.abc import Callable, Sequence

import torch
from transformers.utils import get_json_schema

from ..callables import EnvError, env_name, environment_factory
from ..data.prompts import left_pad
from ..rollout.generate import Rollout


class Environment:
    """Base class of multi-turn environments: override :meth:`reset` and :meth:`step`.
    ``max_turns`` / ``max_tokens``: most model turns / tokens (prompt and observations included)
    per episode; ``env.max_turns`` / ``env.max_tokens`` override them."""

    max_turns: int = 4
    max_tokens: int | None = None  # None: the model's context

    def reset(self, record) -> list[dict]:
        """The first messages of ``record``'s episode; by default its prompt as given."""
        prompt = record.original
        return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def step(self, text: str) -> tuple[dict | str | None, float | None, bool]:
        """The model's turn (special tokens removed) -> ``(observation, reward, done)``: the next
        message (a dict, or a string: a user message; None only when done), the turn's reward
        (None: 0) and whether the episode is over."""
        raise NotImplementedError


def limits(env: Environment, max_turns: int, max_tokens: int, context: int | None) -> tuple[int, int]:
    """``(max_turns, max_tokens)``: the config's when set, else the environment's (else the
    model's ``context``); EnvError when not positive or over the context."""
    turns = max_turns or getattr(env, "max_turns", 0)
    tokens = max_tokens or getattr(env, "max_tokens", None) or context
    for name, v in (("max_turns", turns), ("max_tokens", tokens)):
        if not isinstance(v, int) or v < 1:
            raise EnvError(f"environment {env_name(env)}: {name}={v!r} must be an int >= 1")
    if context is not None and tokens > context:
        raise EnvError(f"environment {env_name(env)}: max_tokens={tokens} overflows the model's context of {context} "
                       f"tokens: set env.max_tokens={context} or less")
    return turns, tokens


class EpisodeMaker:
    """``maker(record, tok) -> Episode``: a fresh environment per episode; the ``env`` section's
    limits are checked against the model's ``context`` once, before any work."""

    def __init__(self, ec, context: int | None):
        self.factory, self.ec, self.context = environment_factory(ec.cls), ec, context
        self.name = env_name(self.factory if isinstance(self.factory, type) else ec.cls)  # ec.cls: an instance
        limits(self.new(), ec.max_turns, ec.max_tokens, context)

    def new(self) -> Environment:
        try:
            return self.factory()
        except Exception as e:  # the user's constructor: one line that names it
            raise EnvError(f"environment {self.name} could not be made: {type(e).__name__}: {e}") from e

    def __call__(self, record, tok) -> Episode:
        env = self.new()
        return Episode(env, record, tok, *limits(env, self.ec.max_turns, self.ec.max_tokens, self.context))


# --------------------------------------------------------------------------- rendering


def _templated(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def _message(value, where: str) -> dict:
    if isinstance(value, str):
        return {"role": "user", "content": value}
    if isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str):
        return value
    raise EnvError(f"{where} returned {type(value).__name__} {str(value)[:60]!r} as a message: give a dict "
                   "with string 'role' and 'content' (or a string, a user message)")


def render_prompt(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The first prompt's ids: the chat template's (with the tools' schemas), else the contents
    joined as plain text."""
    if _templated(tok):
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok("".join(m["content"] for m in messages))["input_ids"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


APPEND_ONLY_WARNING = ("the chat template is not append-only for the model's turns: re-rendering the conversation "
                       "does not reproduce the tokens sampled so far; observations are appended as the template's "
                       "delta after its own rendering, and the sampled tokens are kept as they are")


def observation_tokens(tok, conversation: list[dict], message: dict, ids: Sequence[int],
                       tools: list[dict] | None = None) -> list[int]:
    """The tokens of ``message`` after ``ids`` (the episode so far, ``conversation``): the
    template's rendering with the message and the generation prompt, less its longest common
    prefix with ``ids``. No template: the content's tokens."""
    if not _templated(tok):
        return tok(message["content"], add_special_tokens=False)["input_ids"]
    text = tok.apply_chat_template(conversation + [message], tools=tools, tokenize=False, add_generation_prompt=True)
    full = tok(text, add_special_tokens=False)["input_ids"]
    k = _common_prefix(full, ids)
    if k < len(ids):
        warnings.warn(APPEND_ONLY_WARNING, RuntimeWarning, stacklevel=2)
        before = tok(tok.apply_chat_template(conversation, tools=tools, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        k = _common_prefix(full, before)
    return full[k:]


def tool_schemas(tools: Sequence[Callable]) -> list[dict] | None:
    """The functions' JSON schemas (from type hints and Google-style docstrings) as chat
    templates take them; None without tools."""
    return [get_json_schema(fn) for fn in tools] or None


TOOL_CALL_FORMAT = '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>'


def tools_message(schemas: list[dict]) -> dict:
    """A system message offering the tools, for a template that does not render ``tools``."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return {"role": "system", "content": f"You may call these tools:\n{listed}\nTo call one, answer with "
                                         f"{TOOL_CALL_FORMAT} and nothing else; its result comes back as a "
                                         "message."}


# --------------------------------------------------------------------------- episodes


def _user_call(where: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the user's code: one line that names it
        raise EnvError(f"{where} raised {type(e).__name__}: {e}") from e


def checked_step(env: Environment, text: str) -> tuple[dict | None, float, bool]:
    """``env.step(text)``; EnvError naming the environment when it raises or returns anything
    but ``(message or None, finite number or None, bool)``."""
    where = f"environment {env_name(env)}.step"
    out = _user_call(where, env.step, text)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise EnvError(f"{where} returned {type(out).__name__} {str(out)[:60]!r}: return a tuple "
                       "(observation, reward, done)")
    obs, reward, done = out
    if not isinstance(done, bool):
        raise EnvError(f"{where} returned done={done!r} ({type(done).__name__}): give True or False")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        raise EnvError(f"{where} returned reward={reward!r}: give a finite number or None")
    if obs is None and not done:
        raise EnvError(f"{where} returned no observation with done=False: give the next message, or done=True")
    return (None if obs is None else _message(obs, where)), float(reward or 0.0), done


def checked_reset(env: Environment, record) -> list[dict]:
    where = f"environment {env_name(env)}.reset"
    messages = _user_call(where, env.reset, record)
    if isinstance(messages, (str, dict)):
        messages = [messages]
    if not isinstance(messages, list) or not messages:
        raise EnvError(f"{where} returned {type(messages).__name__} {str(messages)[:60]!r}: return a non-empty "
                       "list of messages")
    return [_message(m, where) for m in messages]


class Episode:
    """One episode's tokens as they grow: ``ids`` (prompt first), and per response token whether
    the model sampled it, its log-prob, entropy, value and kept mass."""

    def __init__(self, env: Environment, record, tok, max_turns: int, max_tokens: int):
        self.env, self.max_turns, self.max_tokens = env, max_turns, max_tokens
        self.messages = checked_reset(env, record)
        self.tools = tool_schemas(getattr(env, "tools", ()))
        if self.tools and "tools" not in (getattr(tok, "chat_template", None) or ""):
            # a template that ignores `tools` (or none): the schemas go in a system message of their own
            self.messages = [tools_message(self.tools)] + self.messages
            self.tools = None
        self.ids = render_prompt(tok, self.messages, self.tools)
        self.prompt_len = len(self.ids)
        if self.prompt_len >= max_tokens:
            raise EnvError(f"environment {env_name(env)}.reset: the first prompt is {self.prompt_len} tokens, "
                           f"max_tokens={max_tokens} leaves no room for a turn: shorten it or raise max_tokens")
        self.model, self.logprobs, self.entropy, self.values, self.kept = [], [], [], [], []
        self.rewards: dict[int, float] = {}  # response column -> reward of the turn ending there
        self.lengths: dict[int, int] = {}  # response column -> length of the model's turn ending there
        self.turns, self.done, self.finished = 0, False, False
        self.env_done = False  # the environment ended the episode (not a limit)

    @property
    def room(self) -> int:
        return self.max_tokens - len(self.ids)

    def add_turn(self, tokens: list[int], sampled: dict[str, list], finished: bool, tok) -> None:
        """Append the model's turn, step the environment on its text, append the observation."""
        self.ids += tokens
        self.model += [1] * len(tokens)
        for name, values in sampled.items():
            getattr(self, name).extend(values)
        self.turns += 1
        self.finished = finished
        text = tok.decode(tokens, skip_special_tokens=True)
        obs, reward, self.env_done = checked_step(self.env, text)
        self.rewards[len(self.model) - 1], self.lengths[len(self.model) - 1] = reward, len(tokens)
        self.messages.append({"role": "assistant", "content": text})
        if self.env_done or self.turns >= self.max_turns or self.room <= 0:
            self.done = True
            return
        delta = observation_tokens(tok, self.messages, obs, self.ids, self.tools)
        if len(delta) >= self.room:  # no room for the observation and a turn after it
            self.done = True
            return
        self.messages.append(obs)
        self.ids += delta
        self.model += [0] * len(delta)
        for name in ("logprobs", "entropy", "values", "kept"):
            getattr(self, name).extend([0.0] * len(delta))


def _right_pad(rows: list[list], fill, dtype, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=device)


Sample = Callable[[int, torch.Tensor, torch.Tensor, list[int], int], Rollout]


def play(episodes: list[Episode], sample: Sample, tok, max_new_tokens: int, device) -> Rollout:
    """Play ``episodes`` to their end in lockstep turns; one rollout of them all.

    ``sample(turn, ids [n, P], mask [n, P], rows, n_tokens)`` samples a turn for the episodes
    ``rows`` still going (left-padded: everything so far). A turn longer than an episode's room
    is cut to it (its first tokens' log-probs do not depend on the later ones).
    """
    pad, forward_logprobs = tok.pad_token_id, True
    given = set()  # the optional quantities (values, kept mass) some turn's sampler gave
    for turn in range(max(e.max_turns for e in episodes)):
        rows = [i for i, e in enumerate(episodes) if not e.done]
        if not rows:
            break
        ids, mask = left_pad([episodes[i].ids for i in rows], pad, device)
        n = min(max_new_tokens, max(episodes[i].room for i in rows))
        roll = sample(turn, ids, mask, rows, n)
        forward_logprobs &= roll.forward_logprobs
        fields = {name: t for name, t in (("logprobs", roll.logprobs), ("entropy", roll.entropy),
                                          ("values", roll.values), ("kept", roll.kept_logmass)) if t is not None}
        given |= fields.keys()
        for j, (i, length) in enumerate(zip(rows, roll.response_mask.sum(-1).tolist())):
            L = min(length, episodes[i].room)
            episodes[i].add_turn(roll.response_ids[j, :L].tolist(), {name: t[j, :L].tolist() for name, t in fields.items()},
                                 bool(roll.finished[j]) and L == length, tok)
    prompt_ids, prompt_mask = left_pad([e.ids[: e.prompt_len] for e in episodes], pad, device)
    response = [e.ids[e.prompt_len :] for e in episodes]
    attend = _right_pad([[1] * len(r) for r in response], 0, torch.long, device)  # [B, R]
    response_mask = _right_pad([e.model for e in episodes], 0, torch.long, device)  # [B, R]

    def at_turn_ends(name, dtype):  # [B, R]: each turn's value on its last token, 0 elsewhere
        rows = [[0] * len(r) for r in response]
        for row, e in zip(rows, episodes):
            for col, v in getattr(e, name).items():
                row[col] = v
        return _right_pad(rows, 0, dtype, device)

    def floats(name):
        return _right_pad([getattr(e, name) for e in episodes], 0.0, torch.float32, device)  # [B, R]

    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=_right_pad(response, pad, torch.long, device),
                   response_mask=response_mask, logprobs=floats("logprobs"),
                   finished=torch.tensor([e.finished for e in episodes], device=device), entropy=floats("entropy"),
                   values=floats("values") if "values" in given else None, forward_logprobs=forward_logprobs,
                   kept_logmass=floats("kept") if "kept" in given else None,
                   attend=None if torch.equal(attend, response_mask) else attend,
                   turn_rewards=at_turn_ends("rewards", torch.float32), turn_lengths=at_turn_ends("lengths", torch.long))


def episode_stats(episodes: list[Episode], roll: Rollout) -> dict[str, float]:
    """Means per episode of model turns, environment return and observation tokens, and the
    share of episodes a limit ended (``env/limit_rate``)."""
    obs = (roll.response_attention - roll.response_mask).sum(-1).float()  # [B]
    n = len(episodes)
    return {"env/turns": sum(e.turns for e in episodes) / n, "env/return": float(roll.turn_rewards.sum(-1).mean()),
            "env/obs_tokens": float(obs.mean()), "env/limit_rate": sum(not e.env_done for e in episodes) / n}
