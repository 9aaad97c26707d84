"""MkDocs hook: the config reference page (reference/config.md), rendered from rlhfkit/config/
at every build.

The page is never committed: each ``mkdocs build`` renders it from the same sources as
``rlhfkit CMD --help`` (``config.key_docs()``, ``config.key_types()``, ``config.RANGES``, the
defaults of ``Config()``), so a key added, renamed or re-documented in the config package is in the next
build of the site, and there is no second copy that could fall behind.
"""

from __future__ import annotations

import html

from rlhfkit import config as rc
from rlhfkit.cli.main import COMMAND_SECTIONS

PAGE = "reference/config.md"

INTRO = """\
# Config reference

Every key of every command, with its type, its default, the values it accepts and what it does.
This page is generated from `src/rlhfkit/config/` each time the site is built: it is the text
that `rlhfkit CMD --help` prints, so the two cannot disagree.

Set a key on the command line as `section.key=value` (`rlhfkit ppo ppo.kl_coef=0.1`) or in a YAML
file given with `--config` (a `section:` mapping of `key: value`); overrides apply after the file.
`rlhfkit CMD --print-config [overrides]` prints the resolved config without running. A mistyped
key, a wrong type or a value out of range stops the command before any work, naming the key.

The defaults below are those of `rlhfkit ppo` for the keys that depend on the algorithm; the
next table gives each RL command's own, and the built-in cities task (`run.task=cities`) brings
its own defaults for a few keys (`--print-config` shows them).
"""


def _cell(value: object) -> str:
    """One table cell: a single line, HTML-escaped, pipes escaped for the table."""
    text = " ".join(str(value).split())
    return html.escape(text, quote=False).replace("|", "\\|")


def value_range(key: str) -> str:
    """The values ``key`` accepts by RANGES and POSITIVE (what the config checks); empty without a range."""
    if key not in rc.RANGES:
        return ""
    lo, hi = rc.RANGES[key]
    low = "> 0" if key in rc.POSITIVE else f">= {lo}"
    return low if hi is None else f"{low}, <= {hi}"


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`".replace("|", "\\|")


def _algo_table() -> list[str]:
    keys = rc.ALGO_KEYS
    lines = ["## Defaults that depend on the RL command", "",
             "`rlhfkit ppo`, `grpo`, `rloo` and `reinforce` set `ppo.algo`, which brings these values "
             "for the keys you do not set yourself (`config.ALGO_DEFAULTS`). With a LoRA policy "
             "(`model.lora_r` > 0) the keys in `config.LORA_DEFAULTS` change again: "
             + "; ".join(f"`{algo}`: " + ", ".join(f"`ppo.{k}` = `{v!r}`" for k, v in vals.items())
                         for algo, vals in rc.LORA_DEFAULTS.items()) + ".", "",
             "Each column is a key of the `ppo` section:", "",
             "| command | " + " | ".join(f"`{k}`" for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for algo, values in rc.ALGO_DEFAULTS.items():
        lines.append(f"| `rlhfkit {algo}` | " + " | ".join(_default(values[k]) for k in keys) + " |")
    return lines


def _readers(section: str) -> str:
    """The commands that read ``section`` (or some of its keys), as ``rlhfkit CMD --help`` lists them."""
    names = [cmd for cmd, entries in COMMAND_SECTIONS.items()
             if any(e.partition(".")[0] == section for e in entries)]
    return ", ".join(f"`{n}`" for n in names) or "none"


def _display_key(section: str, key: str) -> str:
    """The key as a user writes it: ``env.cls`` is ``env.class`` on the command line and in files."""
    aliases = {v: k for k, v in rc.KEY_ALIASES.items()}
    dotted = f"{section}.{key}"
    return aliases.get(dotted, dotted)


def render_config_reference() -> str:
    """The whole page, Markdown: one table a section (the ``ppo`` section one a concern, under its
    heading), one row a key, in the config's order."""
    docs, types, defaults = rc.key_docs(), rc.key_types(), rc.Config().to_dict()
    lines = [INTRO, *_algo_table()]
    for section, groups in rc.key_groups().items():
        lines += ["", f"## {section}", "", f"Read by: {_readers(section)}."]
        for heading, about, keys in groups:
            lines += ["", f"### {heading}", "", about] if heading else []
            lines += ["", "| key | type | default | accepts | description |", "|---|---|---|---|---|"]
            for key in keys:
                lines.append(f"| `{_display_key(section, key)}` | {_cell(types[section][key])} | "
                             f"{_default(defaults[section][key])} | {_cell(value_range(f'{section}.{key}'))} | "
                             f"{_cell(docs[section].get(key, ''))} |")
    return "\n".join(lines) + "\n"


def on_files(files, config, **kwargs):
    """Add the rendered config reference to the site's files (MkDocs ``on_files`` event)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render_config_reference()))
    return files
