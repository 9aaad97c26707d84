"""Tiny stand-ins for hub checkpoints, built locally (no downloads): tokenizers with the shape of
real ones (special tokens, a chat template, byte-level BPE) and random-init models of real
architectures saved with ``save_pretrained``, so tests load them the way a hub id is loaded."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rlhfkit.models.forward import build_tiny
from rlhfkit.tasks import cities, doubling

# Qwen-style chat markup; no BOS, EOS = end of turn
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _task_texts() -> list[str]:
    return doubling.TaskData(0).pretrain_texts(300) + cities.TaskData(0).pretrain_texts(300)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (printable ASCII, newline, the doubling task's CJK characters; any
    other is ``<unk>``), ``<|im_end|>`` as EOS, ``<|endoftext|>`` as pad, no BOS and a chat template."""
    chars = sorted(set("".join(chr(c) for c in range(32, 127)) + "\n" + "".join(doubling.VOCAB)))
    vocab = {t: i for i, t in enumerate(CHAT_SPECIALS + ["<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"], padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def bpe_tokenizer(vocab_size: int = 300, chat: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the tasks' text; it splits text into other tokens than
    :func:`chat_tokenizer`. ``chat=False``: ``<s>`` BOS (prepended), ``</s>`` EOS, ``<pad>``.
    ``chat=True``: Qwen's special tokens and chat template, no BOS (what ``transformers`` loads a
    Qwen2 checkpoint's tokenizer as must be a byte-level BPE)."""
    specials = CHAT_SPECIALS if chat else ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_task_texts(), trainer)
    if chat:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       additional_special_tokens=["<|im_start|>"], padding_side="left")
        fast.chat_template = CHAT_TEMPLATE
        return fast
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left")


def save_tiny(path: Path, arch: str, tokenizer, seed: int = 0, scalar: bool = False, **sizes) -> str:
    """A random-init model of ``arch`` and its tokenizer saved to ``path``; returns the path."""
    model = build_tiny(arch, tokenizer, seed=seed, scalar=scalar, **sizes)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def import_example(directory: Path, name: str):
    """The module ``directory/name.py`` of an example, loaded from its file under a name of its
    own: two examples' ``make_data.py`` would otherwise share one ``sys.modules`` entry, and a test
    file would get the other's when both run on one pytest worker. The directory is importable
    while it loads (an example's own sibling imports)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"example_{directory.name}_{name}", directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(directory))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
    return module
