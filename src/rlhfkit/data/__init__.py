"""Training data in the formats users already have (TRL's dataset conventions; docs/data.md):
read (:mod:`.records`), checked into examples (:mod:`.examples`), tokenized into rows
(:mod:`.encode`). Imports no torch at import time, so a bad record is answered before it loads.
"""

from .encode import (
    Limit,
    context_limit,
    describe_characters,
    encode_preferences,
    encode_prompts,
    encode_sft,
    encode_triples,
    hold_out,
    pack_sft,
    stack_pairs,
    unencodable_characters,
)
from .examples import (
    ROLES,
    PreferenceExample,
    PromptExample,
    SFTExample,
    load_preferences,
    load_prompts,
    load_sft,
    precheck,
)
from .records import DataError, load_records, write_jsonl

__all__ = [
    "ROLES", "DataError", "PreferenceExample", "SFTExample", "PromptExample", "load_records", "load_preferences",
    "load_sft", "load_prompts", "precheck", "write_jsonl", "encode_prompts", "encode_sft", "encode_preferences",
    "encode_triples", "Limit", "context_limit", "hold_out", "stack_pairs", "pack_sft", "unencodable_characters",
    "describe_characters",
]
