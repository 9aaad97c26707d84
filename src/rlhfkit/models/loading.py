"""Hugging Face models in and out: tiny configs, loading (safetensors only, one-line errors),
LoRA (the reference is the adapter switched off), dropout off, saving as plain ``transformers``."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.pytorch_utils import Conv1D

from .. import ops
from .precision import keep_master_weights

# Marks a config (and its saved config.json) built from random weights by rlhfkit: model.regime=auto
# then picks the from-scratch learning rates (config.REGIME_DEFAULTS).
SCRATCH_MARK = "rlhfkit_from_scratch"


def from_scratch(model) -> bool:
    """Whether ``model`` (or the model under a peft wrapper) carries :data:`SCRATCH_MARK`."""
    return bool(getattr(getattr(unwrap(model), "config", None), SCRATCH_MARK, False))


def build_tiny_policy(tokenizer, seed: int, scalar: bool = False, n_layer: int = 4, n_head: int = 4,
                      n_embd: int = 64, n_positions: int = 32) -> PreTrainedModel:
    """A GPT-2 :func:`build_tiny` sized for the toy tasks (``scalar``: a reward model), untied: tied, the
    prefix tokens never seen as targets get the same gradient and their embeddings collapse together."""
    return build_tiny("gpt2", tokenizer, seed, scalar, hidden=n_embd, layers=n_layer, heads=n_head,
                      max_positions=n_positions, num_labels=1 if scalar else 2)


def build_tiny_scalar_model(tokenizer, seed: int, **arch) -> PreTrainedModel:
    return build_tiny_policy(tokenizer, seed, scalar=True, **arch)


DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None):
    """``model.dtype`` -> what ``from_pretrained(dtype=...)`` takes (``'auto'`` keeps the checkpoint's)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


ARCHS = ("gpt2", "llama", "qwen2", "qwen3", "mistral")


def tiny_config(arch: str, tokenizer, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                max_positions: int = 128, num_labels: int = 1):
    """A small random-init config of a real architecture (``ARCHS``) for tests and smoke runs:
    the classes a hub checkpoint of that family loads into, dropout off, embeddings untied."""
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, num_labels=num_labels,
                  **{SCRATCH_MARK: True})
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    extra = {"head_dim": hidden // heads} if arch == "qwen3" else {"sliding_window": None} if arch == "mistral" else {}
    return AutoConfig.for_model(arch, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                max_position_embeddings=max_positions, attention_dropout=0.0, **extra, **common)


def build_tiny(arch: str, tokenizer, seed: int = 0, scalar: bool = False, **sizes) -> PreTrainedModel:
    """A random-init causal LM (``scalar``: a one-label sequence classifier) of :func:`tiny_config`."""
    torch.manual_seed(seed)
    config = tiny_config(arch, tokenizer, **sizes)
    auto = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    return auto.from_config(config)


def context_window(*models) -> int | None:
    """The longest sequence every one of ``models`` reads (the smallest ``max_position_embeddings``
    or ``n_positions``), None when none declares one; None entries and the LoRA reference skipped."""
    limits = []
    for model in models:
        if model is None or isinstance(model, AdapterDisabled):
            continue
        cfg = getattr(unwrap(model), "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if isinstance(n, int) and n > 0:
            limits.append(n)
    return min(limits) if limits else None


class ModelLoadError(ValueError):
    """A model or tokenizer cannot be loaded from a path; the message names the path and the fix."""


def local_path_reason(path: str) -> str | None:
    """Why ``path`` must be a filesystem path, not a hub id (``'name'`` or ``'org/name'``), or None
    when it may be one (``runs/nope`` with ``./runs`` there fails at once, not after hub retries)."""
    norm = path.replace(os.sep, "/")
    if os.path.isabs(path) or path.startswith((".", "~")):
        return "an absolute or relative path"
    if norm.endswith("/") or norm.count("/") >= 2:
        return "a path (a hub id is 'name' or 'org/name')"
    first, slash, _ = norm.partition("/")
    if slash and os.path.isdir(first):
        return f"a path, since {first}{os.sep} is a local directory"
    return None


def _from_pretrained(loader, path: str, what: str, **kwargs):
    """``loader.from_pretrained(path, **kwargs)`` with a one-paragraph error instead of a traceback."""
    path = os.fspath(path)
    if not path:
        raise ModelLoadError(f"no {what} path given")
    why = None if os.path.exists(path) else local_path_reason(path)
    if why:
        raise ModelLoadError(f"{path!r} does not exist (looked for the {what} there; read as {why}): point "
                             "model.name / reward.name at a directory written by save_pretrained (config.json, "
                             "model.safetensors, tokenizer files) or at a hub id")
    if os.path.isdir(path):  # a local directory: say which file is missing before HF guesses
        need = ("tokenizer_config.json", "tokenizer.json") if loader is AutoTokenizer else ("config.json",)
        if not any(os.path.isfile(os.path.join(path, f)) for f in need):
            raise ModelLoadError(f"{what} {path!r} is a directory without {' or '.join(need)}: give a directory "
                                 "written by save_pretrained (model and tokenizer), e.g. <run>/policy")
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # HF: OSError for missing files, bad ids, no network; ValueError others
        reason = " ".join(str(e).split())[:300].rstrip(".")
        pickled = os.path.isdir(path) and any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path))
        hint = (" It holds pickle-based weights (.bin/.pt), which rlhfkit does not load because unpickling can "
                "run arbitrary code; convert them once in a trusted session (load, then save_pretrained, "
                "which writes model.safetensors).") if pickled and kwargs.get("use_safetensors") else ""
        raise ModelLoadError(f"cannot load the {what} from {path!r}: {reason}.{hint} Give a directory written by "
                             "save_pretrained (config.json + model.safetensors) or a hub id.") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, need_pad: bool = True):
    """``AutoTokenizer`` at ``path``; with ``need_pad`` (batches are padded), a missing pad token is an error."""
    tok = _from_pretrained(AutoTokenizer, path, "tokenizer", trust_remote_code=trust_remote_code)
    if need_pad and tok.pad_token_id is None:
        raise ModelLoadError(f"the tokenizer at {path} has no pad token, and batches need one: set it and save the "
                             "tokenizer, e.g. tok.pad_token = tok.eos_token; tok.save_pretrained(path) (the "
                             "attention mask, not the pad id, marks padding here, so pad = EOS is safe)")
    return tok


def policy_dir(path: str) -> str:
    """A model directory (``config.json`` or ``adapter_config.json``), a run directory's ``policy/``,
    or else the string itself as a hub id."""
    p = Path(path)
    for cand in (p, p / "policy", p / "ppo" / "policy"):
        if (cand / "config.json").exists() or (cand / "adapter_config.json").exists():
            return str(cand)
    if not p.exists() and local_path_reason(path) is None:
        return path  # "org/name": a hub id, resolved by from_pretrained
    raise FileNotFoundError(f"no model found at {path}: expected a directory with config.json (or policy/config.json)")


def load_policy(path: str, dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
                base: str = "") -> PreTrainedModel:
    """A causal LM from a directory or a hub id (safetensors only); a LoRA adapter directory alone is
    merged onto ``base``, else onto the base its ``adapter_config.json`` names."""
    p = Path(path)
    if (p / "adapter_config.json").exists() and not (p / "config.json").exists():
        return _load_adapter(p, dtype, trust_remote_code, base)
    return _load_model(AutoModelForCausalLM, path, "policy model", dtype, trust_remote_code)


def _load_model(auto, path: str, what: str, dtype, trust_remote_code: bool, **kwargs) -> PreTrainedModel:
    """Weights from safetensors only: unpickling a ``.bin`` can run code."""
    return _from_pretrained(auto, path, what, dtype=resolve_dtype(dtype) or torch.float32,
                            trust_remote_code=trust_remote_code, use_safetensors=True, **kwargs)


def _load_adapter(path: Path, dtype, trust_remote_code: bool, base: str = "") -> PreTrainedModel:
    from peft import PeftModel

    named = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    base = base or named or ""
    where = f"base_model_name_or_path in {path / 'adapter_config.json'}"
    fix = ("give the base with model.name=PATH_OR_HUB_ID, or put it back at that path (the merged model, a run's "
           "policy/ beside its policy_adapter/, loads without a base)")
    if not base:
        raise ModelLoadError(f"the LoRA adapter {path} names no base model ({where} is empty): {fix}")
    if not os.path.exists(base) and local_path_reason(base):
        raise ModelLoadError(f"the base model of the LoRA adapter {path} is not at {base!r} ({where}"
                             f"{'' if os.path.isabs(base) else ', relative to ' + os.getcwd()}): {fix}")
    model = _load_model(AutoModelForCausalLM, base, "base model of the LoRA adapter", dtype, trust_remote_code)
    with _quiet_peft():
        model = PeftModel.from_pretrained(model, str(path))
    return model.merge_and_unload()


@contextlib.contextmanager
def _quiet_peft():
    """Silence peft's warnings that say nothing to a user (a deprecated transformers call, its own
    ``fan_in_fan_out`` fix-up)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)
        yield


def load_scalar_model(path: str, dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
                      num_labels: int | None = 1, **kwargs) -> PreTrainedModel:
    """A sequence-classification model; ``num_labels=None`` keeps the checkpoint's own count."""
    extra = dict(kwargs) if num_labels is None else {"num_labels": num_labels, **kwargs}
    model = _load_model(AutoModelForSequenceClassification, path, "scalar (reward/value) model", dtype,
                        trust_remote_code, **extra)
    scalar_head(model)  # fail now, with a clear message, if there is no head we can read
    return model


@contextlib.contextmanager
def quiet_load_report():
    """Silence transformers' load report (a causal LM read into a sequence classifier)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def unwrap(model: nn.Module) -> nn.Module:
    """The ``transformers`` model under a peft wrapper (its layers still apply the adapter)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def backbone(model: nn.Module) -> nn.Module:
    """The transformer body without its head (``GPT2Model``, ``Qwen3Model`` ...), through peft."""
    if isinstance(model, AdapterDisabled):
        raise TypeError("call the reference through policy_forward / its __call__, which switch the adapter off")
    return unwrap(model).base_model


def enable_gradient_checkpointing(model: PreTrainedModel) -> PreTrainedModel:
    """Non-reentrant activation checkpointing (frozen embeddings, LoRA); sampling runs in :func:`eval_mode`."""
    base = unwrap(model)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Eval mode for the duration (generation: gradient-checkpointed layers keep their cache)."""
    was_training = model.training
    _set_training(model, False)
    try:
        yield model
    finally:
        _set_training(model, was_training)


def _set_training(model: nn.Module, mode: bool) -> None:
    """``model.train(mode)``; only the flags for a model an accelerated forward computes (whose
    ``train`` would kernelize hub kernels again)."""
    if ops.runs_forward(model):
        for m in model.modules():
            m.training = mode
    else:
        model.train(mode)


# the layer types a LoRA adapter can wrap (peft's own list is longer; these are the ones a causal LM has)
LORA_LAYERS = (nn.Linear, nn.Embedding, Conv1D)
SCALAR_HEADS = ("score", "classifier")  # a scalar head is trained in full, never through an adapter


def check_lora_targets(model: nn.Module, targets: str | list[str]) -> None:
    """ValueError naming the ``targets`` that match no module of ``model`` (peft drops them silently)."""
    if isinstance(targets, str):  # 'all-linear': peft finds the layers itself
        return
    names = [name for name, _ in model.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, LORA_LAYERS)} - set(SCALAR_HEADS))
        raise ValueError(f"model.lora_target_modules names {', '.join(unknown)}, which this model does not have: "
                         f"name some of {', '.join(leaves)}, or use 'all-linear'")


def add_lora(model: PreTrainedModel, r: int, alpha: float, dropout: float = 0.0,
             target_modules: str = "all-linear", trainable_head: bool = False) -> nn.Module:
    """A fresh LoRA adapter (peft, ``B = 0``: equal to the base) over frozen ``model``;
    ``trainable_head`` trains a scalar head (value model) in full."""
    from peft import LoraConfig, get_peft_model

    spec = target_modules.strip()  # 'all-linear' or 'q_proj, v_proj'
    targets = spec if spec == "all-linear" else [m.strip() for m in spec.split(",") if m.strip()]
    heads = list(SCALAR_HEADS)
    if isinstance(targets, list) and set(heads) & set(targets):
        raise ValueError("model.lora_target_modules must not name the scalar head (score / classifier)")
    check_lora_targets(model, targets)
    # GPT-2's Conv1D layers store their weight transposed (fan_in x fan_out): peft must be told
    conv1d = any(isinstance(m, Conv1D) for m in model.modules())
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        exclude_modules=heads if trainable_head else None, fan_in_fan_out=conv1d)
    with _quiet_peft():
        peft_model = get_peft_model(model, config)
    if trainable_head:
        scalar_head(peft_model).requires_grad_(True)
    return peft_model


def is_lora(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and callable(getattr(model, "get_base_model", None))


class AdapterDisabled:
    """The reference of a LoRA policy: the same modules with the adapter off (no weights of its own)."""

    def __init__(self, peft_model: nn.Module):
        if not is_lora(peft_model):
            raise TypeError("AdapterDisabled needs a peft model (model.lora_r > 0)")
        self.peft_model = peft_model

    @contextlib.contextmanager
    def active(self):
        with self.peft_model.disable_adapter(), eval_mode(self.peft_model):
            yield unwrap(self.peft_model)

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        with self.active() as base:
            return base(*args, **kwargs)

    def parameters(self):
        return self.peft_model.parameters()


def policy_with_reference(path: str, mc, device, reference: bool = True, adapter_dropout: bool = True):
    """``(policy, reference)`` from ``path`` as ``model.*`` (``mc``) says: the reference a frozen copy,
    :class:`AdapterDisabled` under LoRA, or None. Dropout off except a LoRA adapter's with
    ``adapter_dropout``; ``mc.master_weights``: a float32 policy that runs in ``mc.dtype``."""
    policy = disable_dropout(load_policy(path, "float32" if mc.master_weights else mc.dtype, mc.trust_remote_code))
    if mc.master_weights:
        keep_master_weights(policy, resolve_dtype(mc.dtype))
    if mc.lora_r > 0:
        policy = add_lora(policy, mc.lora_r, mc.lora_alpha, mc.lora_dropout if adapter_dropout else 0.0,
                          mc.lora_target_modules)
    if mc.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    policy = policy.to(device).train()
    if not reference:
        return policy, None
    if mc.lora_r > 0:
        return policy, AdapterDisabled(policy)
    return policy, freeze(disable_dropout(load_policy(path, mc.dtype, mc.trust_remote_code))).to(device)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain ``transformers`` model to save: LoRA merged into the base weights, in place."""
    return model.merge_and_unload() if is_lora(model) else model


def lora_delta(m: nn.Module, adapter: str, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """``scaling * B @ A`` of one adapter of a LoRA layer in its base weight's layout (``[in, out]``
    for ``fan_in_fan_out``); ``a``, ``b``: weights from elsewhere (a gathered state dict)."""
    a = m.lora_A[adapter].weight if a is None else a
    b = m.lora_B[adapter].weight if b is None else b
    delta = (b @ a) * m.scaling[adapter]  # [out, in]
    return delta.T if getattr(m, "fan_in_fan_out", False) else delta


def merged_lora_state_dict(model: nn.Module, state_dict: dict) -> dict:
    """The plain model's weights from a LoRA model's full ``state_dict`` (gathered from FSDP shards):
    each adapted layer's ``W + scaling * B @ A`` under the base model's keys, the module untouched."""
    from peft.tuners.lora import LoraLayer

    sd, prefix = dict(state_dict), "base_model.model."
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        weight = sd.pop(f"{name}.base_layer.weight")
        merged = weight.float()
        for adapter in mod.active_adapters:
            a, b = sd.pop(f"{name}.lora_A.{adapter}.weight"), sd.pop(f"{name}.lora_B.{adapter}.weight")
            merged = merged + lora_delta(mod, adapter, a.float(), b.float())
        sd[f"{name}.weight"] = merged.to(weight.dtype)
        if f"{name}.base_layer.bias" in sd:
            sd[f"{name}.bias"] = sd.pop(f"{name}.base_layer.bias")
    left = [k for k in sd if "lora_" in k]
    if left:  # DoRA magnitudes, adapted embeddings, inactive adapters ...: not a plain LoRA merge
        raise NotImplementedError(f"cannot merge these adapter weights from a gathered state dict: {left[:3]}")
    return {k.removeprefix(prefix): v for k, v in sd.items()}


def save_policy(model: nn.Module, tokenizer, path: str | Path, adapter_dir: str | Path | None = None,
                state_dict: dict | None = None) -> nn.Module:
    """Save a model as a plain Hugging Face checkpoint (safetensors + tokenizer); returns it. A LoRA
    model is saved as an adapter to ``adapter_dir`` first, then merged (in place). ``state_dict``:
    the weights to write instead of the module's own (FSDP, gathered)."""
    if is_lora(model) and adapter_dir is not None:
        for pc in model.peft_config.values():  # a local base made absolute: loads from any directory
            if pc.base_model_name_or_path and os.path.isdir(pc.base_model_name_or_path):
                pc.base_model_name_or_path = str(Path(pc.base_model_name_or_path).resolve())
        model.save_pretrained(adapter_dir, **({} if state_dict is None else {"state_dict": state_dict}))
        if tokenizer is not None:
            tokenizer.save_pretrained(adapter_dir)
    if state_dict is not None and is_lora(model):
        plain, state_dict = model.get_base_model(), merged_lora_state_dict(model, state_dict)
    else:
        plain = merge_lora(model)
    plain.save_pretrained(path, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return plain


def _pipeline(tok):
    """What decides a tokenizer's ids beyond its vocabulary (a slow one: its class)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return type(tok).__name__
    spec = json.loads(backend.to_str())
    return {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model", "post_processor")}


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map every text to the same ids (vocabulary, special ids, pipeline;
    not the class, which transformers picks by model family)."""
    if a is b:
        return True
    if len(a) != len(b) or a.get_vocab() != b.get_vocab():
        return False
    if any(getattr(a, s, None) != getattr(b, s, None) for s in ("bos_token_id", "eos_token_id", "pad_token_id")):
        return False
    return _pipeline(a) == _pipeline(b)


DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# names of the probabilities of train-mode-only noise in configs and modules (attention_dropout,
# resid_pdrop, hidden_dropout, layerdrop, router_jitter_noise, lora_dropout ...)
DROPOUT_NAMES = ("dropout", "pdrop", "layerdrop", "jitter")


def _zero_dropout_attributes(obj) -> None:
    for key, value in list(vars(obj).items()):
        if isinstance(value, float) and value > 0 and any(name in key for name in DROPOUT_NAMES):
            setattr(obj, key, 0.0)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Every dropout of ``model`` to 0 in place, modules and (nested, peft's) configs: any left
    makes RL's first ratio of a training to a sampling forward not 1."""
    configs = list(getattr(model, "peft_config", {}).values())
    for m in model.modules():
        if isinstance(m, DROPOUT_MODULES):
            m.p = 0.0
        _zero_dropout_attributes(m)
        configs.append(getattr(m, "config", None))
    seen = set()
    while configs:
        cfg = configs.pop()
        if id(cfg) in seen or not hasattr(cfg, "to_dict") or not hasattr(cfg, "__dict__"):
            continue
        seen.add(id(cfg))
        _zero_dropout_attributes(cfg)
        configs.extend(vars(cfg).values())  # sub-configs (a multimodal model's text_config ...)
    return model


def freeze(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    return model.eval()


def scalar_head(model: PreTrainedModel) -> nn.Module:
    """The linear head of a sequence-classification model (``score`` or ``classifier``)."""
    model = unwrap(model)
    for name in SCALAR_HEADS:
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ValueError(f"{type(model).__name__} has no linear 'score'/'classifier' head to read a scalar from; "
                     "use a decoder AutoModelForSequenceClassification (GPT-2, Llama, Qwen, ...) with num_labels=1")
