"""``rlhfkit chat RUN_DIR``: talk to a trained policy (docs/real-models.md). A line is a user turn,
through the chat template when the tokenizer has one, else as it is; ``/...`` is a command."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..config import Config
from ..data import describe_characters, unencodable_characters
from ..models.forward import context_window, load_policy, load_tokenizer
from ..rollout.generate import eos_token_ids, generate
from ..utils import resolve_device, seed_everything

# the chat's commands and what they do; ALIASES name the same command another way
COMMANDS = {"/help": "list these commands", "/reset": "forget the conversation (also /clear)",
            "/quit": "leave (also /exit, or Ctrl-D)"}
ALIASES = {"/clear": "/reset", "/exit": "/quit"}
COMMANDS_HELP = ("commands: " + "; ".join(f"{name} {what}" for name, what in COMMANDS.items())
                 + "; start a line with // to send it beginning with /")


def command_of(line: str) -> str | None:
    """The command a typed line gives (aliases resolved), or None for a line to send (``//...`` too)."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    name = line.split()[0].lower()
    return ALIASES.get(name, name)


class UnencodableInput(ValueError):
    """The typed line holds characters the tokenizer cannot encode."""


class ChatSession:
    """A conversation with one model; :meth:`reply` takes a user line and returns the answer."""

    def __init__(self, path: str, cfg: Config):
        self.cfg, self.cc = cfg, cfg.chat
        self.device = resolve_device(cfg.run.device)
        self.tok = load_tokenizer(path, cfg.model.trust_remote_code, need_pad=False)  # one row: no padding
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.model = load_policy(path, cfg.model.dtype, cfg.model.trust_remote_code,
                                 cfg.model.name).to(self.device).eval()
        self.templated = bool(getattr(self.tok, "chat_template", None))
        self.history: list[dict[str, str]] = []
        self.gen = torch.Generator().manual_seed(cfg.run.seed)

    def _prompt_ids(self, text: str) -> list[int]:
        if not self.templated:
            return self._encode(text, text, add_special_tokens=True)
        system = [{"role": "system", "content": self.cc.system}] if self.cc.system else []
        messages = system + (self.history if self.cc.history else []) + [{"role": "user", "content": text}]
        rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._encode(rendered, text, add_special_tokens=False)  # the template holds any BOS

    def _encode(self, full: str, typed: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tok(full, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception:  # the tokenizers library raises a bare Exception (e.g. WordLevel without [UNK])
            bad = unencodable_characters(self.tok, typed)
            if not bad:
                raise
            raise UnencodableInput("cannot encode this input: characters the tokenizer cannot encode: "
                                   f"{describe_characters(bad)}") from None

    @torch.no_grad()
    def reply(self, text: str) -> str:
        ids = self._prompt_ids(text)
        limit = context_window(self.model)
        while limit and len(ids) >= limit and self.history:  # forget the oldest exchange first
            self.history = self.history[2:]
            ids = self._prompt_ids(text)
        if limit and len(ids) >= limit:
            ids = ids[-(limit - 1):]
        max_new = self.cc.max_new_tokens if not limit else max(1, min(self.cc.max_new_tokens, limit - len(ids)))
        prompt = torch.tensor([ids], device=self.device)  # [1, P]
        uniforms = None if self.cc.greedy else torch.rand((1, max_new), generator=self.gen).to(self.device)
        out = generate(self.model, prompt, torch.ones_like(prompt), max_new, eos_token_ids(self.model, self.tok),
                       self.pad_id, temperature=self.cc.temperature, greedy=self.cc.greedy, uniforms=uniforms)
        n = int(out.response_mask.sum())
        answer = self.tok.decode(out.response_ids[0, :n].tolist(), skip_special_tokens=True)  # EOS dropped
        if self.templated and self.cc.history:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer

    def reset(self) -> None:
        self.history = []


def run_command(command: str, session: ChatSession) -> str:
    """Carry out a command other than ``/quit``; the line to show."""
    if command == "/reset":
        session.reset()
        return "(conversation cleared)"
    if command == "/help":
        return COMMANDS_HELP
    return f"(unknown command {command}, not sent to the model; {COMMANDS_HELP})"


def run_chat(path: str, cfg: Config, read: Callable[[str], str] = input, write: Callable[[str], None] = print) -> int:
    """The interactive loop (``read`` / ``write``: the terminal by default); returns the replies given."""
    seed_everything(cfg.run.seed)
    session = ChatSession(path, cfg)
    mode = "greedy" if cfg.chat.greedy else f"sampled at temperature {cfg.chat.temperature:g}"
    template = "its chat template" if session.templated else "plain-text prompts (no chat template)"
    write(f"chatting with {path}: {template}, {mode}.")
    write(COMMANDS_HELP)
    n = 0
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("")
            break
        command = command_of(line)
        if command == "/quit":
            break
        if command is not None:
            write(run_command(command, session))
            continue
        line = line.removeprefix("/")  # '//text' sends '/text'
        if not line:
            continue
        try:
            answer = session.reply(line)
        except UnencodableInput as e:  # say so and wait for the next line
            write(f"({e}; type another line)")
            continue
        write(answer)
        n += 1
        sys.stdout.flush()
    return n
