"""Models: Hugging Face causal LMs for the policy, scalar-head models for reward and value.

* policy / reference: any ``AutoModelForCausalLM``.
* reward and (separate) value model: ``AutoModelForSequenceClassification`` with
  ``num_labels=1``. The reward reads the head at the last *attended* token (from the
  attention mask, not from ``pad_token_id``: many tokenizers use EOS as pad, and the EOS is
  exactly the token a reward must read); the value model applies the same head at every
  position. Using one class for both is what lets a critic start from the reward model.
* shared value head: a ``ValueHead`` on the policy's last hidden state (as in the doubling tutorial), so one
  forward gives logits and values.
* LoRA (peft): the adapter is injected into the policy's own modules; the reference is the
  same model with the adapter switched off (:class:`AdapterDisabled`), so the base weights
  are held once. :func:`save_policy` writes a merged plain ``transformers`` checkpoint.

Every model is loaded through ``from_pretrained`` with a local path or a hub id alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedModel,
)
from transformers.pytorch_utils import Conv1D

from . import lean
from .core import entropy_from_logits, logprobs_from_logits, position_ids_from_mask
from .distributed import is_sharded
from .logprobs import chunked_token_logprobs, chunked_token_loss
from .precision import keep_master_weights

# The mark a config carries (and config.json after save_pretrained) when rlhfkit built the model
# from random weights: model.regime=auto then picks the learning rates for training from scratch
# (config.REGIME_DEFAULTS); copies fine-tuned from such a model keep it.
SCRATCH_MARK = "rlhfkit_from_scratch"


def from_scratch(model) -> bool:
    """Whether ``model`` (or the model under a peft wrapper) carries :data:`SCRATCH_MARK`."""
    return bool(getattr(getattr(unwrap(model), "config", None), SCRATCH_MARK, False))


def tiny_gpt2_config(tokenizer, n_layer: int = 4, n_head: int = 4, n_embd: int = 64, n_positions: int = 32) -> GPT2Config:
    """A GPT-2 config sized for the toy tasks, dropout off (RL needs deterministic forwards).

    Input and output embeddings are untied: with tying, every token that never appears as
    a target in pretraining (the task's prefix characters) receives the same "push this
    logit down" gradient and their embeddings collapse onto one another, so RL would first
    have to pull them apart before the policy can tell the prefixes apart.
    """
    return GPT2Config(
        tie_word_embeddings=False,
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{SCRATCH_MARK: True},
    )


def build_tiny_policy(tokenizer, seed: int, **arch) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(tokenizer, **arch))


def build_tiny_scalar_model(tokenizer, seed: int, **arch) -> GPT2ForSequenceClassification:
    torch.manual_seed(seed)
    cfg = tiny_gpt2_config(tokenizer, **arch)
    cfg.num_labels = 1
    return GPT2ForSequenceClassification(cfg)


DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None):
    """``model.dtype`` -> what ``from_pretrained(dtype=...)`` takes (``'auto'`` keeps the checkpoint's)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


ARCHS = ("gpt2", "llama", "qwen2", "qwen3")


def tiny_config(arch: str, tokenizer, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                max_positions: int = 128, num_labels: int = 1):
    """A small random-init config of a real architecture (``ARCHS``) for tests and smoke runs:
    the same classes a hub checkpoint of that family loads into, dropout off, embeddings untied."""
    from transformers import AutoConfig

    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, num_labels=num_labels,
                  **{SCRATCH_MARK: True})
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    extra = {"head_dim": hidden // heads} if arch == "qwen3" else {}
    return AutoConfig.for_model(arch, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                max_position_embeddings=max_positions, attention_dropout=0.0, **extra, **common)


def build_tiny(arch: str, tokenizer, seed: int = 0, scalar: bool = False, **sizes) -> PreTrainedModel:
    """A random-init causal LM (or, ``scalar=True``, a one-label sequence classifier) of
    architecture ``arch`` built through the Auto classes from :func:`tiny_config`."""
    torch.manual_seed(seed)
    config = tiny_config(arch, tokenizer, **sizes)
    auto = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    return auto.from_config(config)


def context_window(*models) -> int | None:
    """The longest sequence, in tokens, that every one of ``models`` reads: the smallest
    ``max_position_embeddings`` of their configs (GPT-2's ``n_positions``; a multimodal
    model's ``text_config``). Positions past it index outside GPT-2's position table (an
    IndexError mid-run) and are untrained for rotary models. None when no model declares a
    limit; ``None`` entries (no critic ...) and the LoRA reference are skipped."""
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
    """Why ``path`` is a filesystem path and not a hub id (``'name'`` or ``'org/name'``), or None
    when it may be a hub id. A path: absolute, or starting with ``.`` or ``~``, or ending with a
    separator, or with two separators or more, or (``org/name`` in form) whose first component
    is an existing local directory -- ``runs/nope`` when ``./runs`` exists is a run directory
    that is missing, not a hub repository, so it fails at once instead of after the hub's retries."""
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
    """``loader.from_pretrained(path, **kwargs)`` with a one-paragraph error instead of a traceback.

    Weights are read from safetensors only (``use_safetensors=True`` for models): a pickle-based
    ``pytorch_model.bin`` can execute code when loaded, so it is refused, not loaded."""
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
        hint = ""
        if kwargs.get("use_safetensors") and os.path.isdir(path) and any(
            f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path)
        ):
            hint = (" It holds pickle-based weights (.bin/.pt), which rlhfkit does not load because unpickling can "
                    "run arbitrary code; convert them once in a trusted session (load, then save_pretrained, "
                    "which writes model.safetensors).")
        raise ModelLoadError(f"cannot load the {what} from {path!r}: {reason}.{hint} Give a directory written by "
                             "save_pretrained (config.json + model.safetensors) or a hub id.") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, need_pad: bool = True):
    """``AutoTokenizer`` at ``path``; with ``need_pad``, one without a pad token is an error (batches
    are padded: rollouts on the left, pairs on the right) that says how to add one."""
    tok = _from_pretrained(AutoTokenizer, path, "tokenizer", trust_remote_code=trust_remote_code)
    if need_pad and tok.pad_token_id is None:
        raise ModelLoadError(
            f"the tokenizer at {path} has no pad token, and batches need one: set it and save the tokenizer, "
            "e.g. tok.pad_token = tok.eos_token; tok.save_pretrained(path) (the attention mask, not the pad "
            "id, marks padding here, so pad = EOS is safe)"
        )
    return tok


def policy_dir(path: str) -> str:
    """A model directory (``config.json``, or a LoRA ``adapter_config.json``), the ``policy/`` of a
    run directory, or, when no such directory exists, the string itself as a hub id."""
    p = Path(path)
    for cand in (p, p / "policy", p / "ppo" / "policy"):
        if (cand / "config.json").exists() or (cand / "adapter_config.json").exists():
            return str(cand)
    if not p.exists() and local_path_reason(path) is None:
        return path  # "org/name": a hub id, resolved by from_pretrained
    raise FileNotFoundError(f"no model found at {path}: expected a directory with config.json (or policy/config.json)")


def load_policy(path: str, dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
                base: str = "") -> PreTrainedModel:
    """A causal LM from a local directory or a hub id (``AutoModelForCausalLM``, safetensors only).

    A directory holding only a LoRA adapter (``adapter_config.json``, as ``policy_adapter/``
    of a LoRA run) is loaded onto its base model and merged: ``base`` when given, else the one
    its ``adapter_config.json`` names."""
    dtype = resolve_dtype(dtype) or torch.float32
    p = Path(path)
    if (p / "adapter_config.json").exists() and not (p / "config.json").exists():
        return _load_adapter(p, dtype, trust_remote_code, base)
    return _from_pretrained(AutoModelForCausalLM, path, "policy model", dtype=dtype,
                            trust_remote_code=trust_remote_code, use_safetensors=True)


def _load_adapter(path: Path, dtype: torch.dtype, trust_remote_code: bool, base: str = "") -> PreTrainedModel:
    """The LoRA adapter directory ``path`` on its base model (``base``, else ``base_model_name_or_path``
    of its ``adapter_config.json``), merged; a base that is not there is a one-line error."""
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
    model = _from_pretrained(AutoModelForCausalLM, base, "base model of the LoRA adapter", dtype=dtype,
                             trust_remote_code=trust_remote_code, use_safetensors=True)
    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(model, str(path))
    return model.merge_and_unload()


def load_scalar_model(path: str, dtype: str | torch.dtype | None = None, trust_remote_code: bool = False,
                      num_labels: int | None = 1, **kwargs) -> PreTrainedModel:
    """A sequence-classification model; ``num_labels=None`` keeps the checkpoint's own count.
    ``kwargs`` go to ``from_pretrained`` (e.g. ``ignore_mismatched_sizes``)."""
    extra = dict(kwargs) if num_labels is None else {"num_labels": num_labels, **kwargs}
    model = _from_pretrained(AutoModelForSequenceClassification, path, "scalar (reward/value) model",
                             dtype=resolve_dtype(dtype) or torch.float32, trust_remote_code=trust_remote_code,
                             use_safetensors=True, **extra)
    scalar_head(model)  # fail now, with a clear message, if there is no head we can read
    return model


@contextlib.contextmanager
def quiet_load_report():
    """Silence transformers' load report while a causal-LM checkpoint is read into a
    sequence classifier (an unused LM head and a fresh scalar head are expected there)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def unwrap(model: nn.Module) -> nn.Module:
    """The ``transformers`` model under a peft wrapper (its modules carry the injected LoRA
    layers, so calling it still applies the adapter); any other model unchanged."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def backbone(model: nn.Module) -> nn.Module:
    """The transformer body without its head (``GPT2Model``, ``Qwen3Model`` ...), through peft."""
    if isinstance(model, AdapterDisabled):
        raise TypeError("call the reference through policy_forward / its __call__, which switch the adapter off")
    return unwrap(model).base_model


def enable_gradient_checkpointing(model: PreTrainedModel) -> PreTrainedModel:
    """Activation checkpointing in the non-reentrant form (works with frozen embeddings and LoRA).

    Layers drop their KV cache while checkpointing in train mode, so sampling must run in
    :func:`eval_mode` (rollouts do). Models on rlhfkit's lean forward (GPT-2, Llama, Qwen2) read
    the same switch and checkpoint each of their layers there (:func:`rlhfkit.lean.hidden_states`,
    shared prompts included)."""
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
    """``model.train(mode)``. transformers' ``train`` also moves the model's hub kernels
    (``use_kernels``, on by default where the ``kernels`` package is installed) between their
    inference and training modes, registering the kernel mapping and kernelizing the model again at
    each switch, a cost beside a small model's sampling (benchmarks/archive/code-evidence.md). A
    model on the lean path never runs its layers' own forward, so there only the flags change."""
    if lean.supported(model):
        for m in model.modules():
            m.training = mode
    else:
        model.train(mode)


def lora_targets(spec: str) -> str | list[str]:
    """``'all-linear'`` or ``'q_proj, v_proj'`` -> what ``peft.LoraConfig(target_modules=...)`` takes."""
    spec = spec.strip()
    return spec if spec == "all-linear" else [m.strip() for m in spec.split(",") if m.strip()]


# the layer types a LoRA adapter can wrap (peft's own list is longer; these are the ones a causal LM has)
LORA_LAYERS = (nn.Linear, nn.Embedding, Conv1D)
SCALAR_HEADS = ("score", "classifier")  # a scalar head is trained in full, never through an adapter


def check_lora_targets(model: nn.Module, targets: str | list[str]) -> None:
    """ValueError naming the names of ``targets`` (a list, as :func:`lora_targets` gives) that match
    no module of ``model`` -- peft wraps the ones it finds and silently drops the rest -- with the
    model's names an adapter can wrap. A name matches a module whose qualified name is it or
    ends with ``.`` + it, as peft matches."""
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
    """Wrap ``model`` with a fresh LoRA adapter (peft): base weights frozen, ``B = 0`` so the
    wrapped model starts equal to the base. ``trainable_head`` keeps a scalar head (value
    model) fully trainable. Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(target_modules)
    heads = list(SCALAR_HEADS)
    if isinstance(targets, list) and set(heads) & set(targets):
        raise ValueError("model.lora_target_modules must not name the scalar head (score / classifier)")
    check_lora_targets(model, targets)
    # GPT-2's Conv1D layers store their weight transposed (fan_in x fan_out): peft must be told (the
    # saved adapter_config.json then says so too), or it warns on every run and sets the flag itself,
    # layer by layer -- as it still does, silenced below, for a Linear layer targeted beside them
    conv1d = any(isinstance(m, Conv1D) for m in model.modules())
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        exclude_modules=heads if trainable_head else None, fan_in_fan_out=conv1d)
    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)
        peft_model = get_peft_model(model, config)
    if trainable_head:
        scalar_head(peft_model).requires_grad_(True)
    return peft_model


def is_lora(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and callable(getattr(model, "get_base_model", None))


class AdapterDisabled:
    """The reference of a LoRA policy: the very same modules with the adapter switched off.

    Holds no weights of its own. ``policy_forward(ref, ...)``, ``token_logprobs(ref, ...)`` and
    ``ref(input_ids=...)`` run inside ``peft_model.disable_adapter()``, which is the frozen base
    model exactly.
    """

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
    """Load the trained policy and its reference from ``path`` as ``model.*`` (``mc``) says.

    Full fine-tuning: the policy and a frozen second copy. LoRA (``mc.lora_r > 0``): a peft
    model and :class:`AdapterDisabled` over it, the base weights held once. The models' own
    dropout is off (:func:`disable_dropout`); a LoRA adapter's is ``mc.lora_dropout`` with
    ``adapter_dropout`` (SFT, DPO), else off too (RL). Returns ``(policy, reference)``
    (reference None with ``reference=False``). ``mc.master_weights``: the policy in float32,
    marked to run in ``mc.dtype`` under :func:`rlhfkit.precision.compute_weights` (the caller
    runs its forwards there), the reference in ``mc.dtype``.
    """
    lora = mc.lora_r > 0
    policy = disable_dropout(load_policy(path, "float32" if mc.master_weights else mc.dtype, mc.trust_remote_code))
    if mc.master_weights:
        keep_master_weights(policy, resolve_dtype(mc.dtype))
    if lora:
        policy = add_lora(policy, mc.lora_r, mc.lora_alpha, mc.lora_dropout if adapter_dropout else 0.0,
                          mc.lora_target_modules)
    if mc.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    policy = policy.to(device).train()
    if not reference:
        return policy, None
    if lora:
        return policy, AdapterDisabled(policy)
    return policy, freeze(disable_dropout(load_policy(path, mc.dtype, mc.trust_remote_code))).to(device)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain ``transformers`` model to save: LoRA merged into the base weights (in place:
    call it once, when training is over); any other model unchanged."""
    return model.merge_and_unload() if is_lora(model) else model


def merged_lora_state_dict(model: nn.Module, state_dict: dict) -> dict:
    """The plain model's weights from a LoRA model's full ``state_dict`` (peft's key names, e.g.
    gathered from FSDP shards): every adapted layer's ``W + scaling * B @ A`` (transposed for
    ``fan_in_fan_out`` layers such as GPT-2's Conv1D), as ``merge_and_unload`` computes it, under
    the base model's key names. The module itself is not touched."""
    from peft.tuners.lora import LoraLayer

    sd, prefix = dict(state_dict), "base_model.model."
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        weight = sd.pop(f"{name}.base_layer.weight")
        merged = weight.float()
        for adapter in mod.active_adapters:
            a, b = sd.pop(f"{name}.lora_A.{adapter}.weight"), sd.pop(f"{name}.lora_B.{adapter}.weight")
            merged = merged + lean.lora_delta(mod, adapter, a.float(), b.float())
        sd[f"{name}.weight"] = merged.to(weight.dtype)
        if f"{name}.base_layer.bias" in sd:
            sd[f"{name}.bias"] = sd.pop(f"{name}.base_layer.bias")
    left = [k for k in sd if "lora_" in k]
    if left:  # DoRA magnitudes, adapted embeddings, inactive adapters ...: not a plain LoRA merge
        raise NotImplementedError(f"cannot merge these adapter weights from a gathered state dict: {left[:3]}")
    return {k.removeprefix(prefix): v for k, v in sd.items()}


def pin_base_path(model: nn.Module) -> None:
    """Make a LoRA model's ``base_model_name_or_path`` (written to its adapter_config.json) absolute
    when it is a local directory, so the saved adapter loads from any working directory; a hub id
    stays as it is."""
    for pc in model.peft_config.values():
        base = pc.base_model_name_or_path
        if base and os.path.isdir(base):
            pc.base_model_name_or_path = str(Path(base).resolve())


def save_policy(model: nn.Module, tokenizer, path: str | Path, adapter_dir: str | Path | None = None,
                state_dict: dict | None = None) -> nn.Module:
    """Save a model as a plain Hugging Face checkpoint (safetensors + tokenizer).

    A LoRA model is first saved as an adapter (to ``adapter_dir`` when given; its base as an
    absolute path, :func:`pin_base_path`), then merged
    into its base weights (``merge_and_unload``, in place) so ``path`` loads with
    ``transformers`` alone. ``state_dict``: the weights to write instead of the module's own
    (FSDP: gathered by :func:`rlhfkit.distributed.full_state_dict`); a LoRA model's are merged
    from it (:func:`merged_lora_state_dict`), its sharded modules left as they are. Returns the
    saved model.
    """
    if is_lora(model) and adapter_dir is not None:
        pin_base_path(model)
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
    """What decides a tokenizer's ids beyond its vocabulary: the normaliser, pre-tokeniser, model
    and post-processor of a fast tokenizer (the class of a slow one)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return type(tok).__name__
    spec = json.loads(backend.to_str())
    return {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model", "post_processor")}


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map every text to the same ids: same vocabulary, same BOS / EOS /
    pad ids and the same pipeline (then token ids can pass between models as they are). The
    class alone is not compared: ``transformers`` picks it by model family, so one tokenizer
    saved with a Qwen2 and a Llama model loads as two classes."""
    if a is b:
        return True
    if len(a) != len(b) or a.get_vocab() != b.get_vocab():
        return False
    if any(getattr(a, s, None) != getattr(b, s, None) for s in ("bos_token_id", "eos_token_id", "pad_token_id")):
        return False
    return _pipeline(a) == _pipeline(b)


class ModuleForward(nn.Module):
    """``fn(model, *args)`` as a module's forward.

    Data-parallel engines (DDP, FSDP, DeepSpeed) synchronise gradients only for computations
    that go through the wrapped module's ``forward``; our scalar-head readouts call the
    backbone directly, so a trainer wraps them in this before ``accelerator.prepare``.
    """

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# attributes holding the probability of a train-mode-only random perturbation: config keys and the
# copies modules keep for functional dropout (Llama's attention_dropout, GPT-2's resid_pdrop,
# Falcon's hidden_dropout, OPT's layerdrop, Mixtral's router_jitter_noise, peft's lora_dropout)
DROPOUT_NAMES = ("dropout", "pdrop", "layerdrop", "jitter")


def _zero_dropout_attributes(obj) -> None:
    """Set ``obj``'s float attributes named like a dropout probability (``DROPOUT_NAMES``) to 0."""
    for key, value in list(vars(obj).items()):
        if isinstance(value, float) and value > 0 and any(name in key for name in DROPOUT_NAMES):
            setattr(obj, key, 0.0)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn off every dropout of ``model``, in place: dropout modules get ``p = 0`` (a peft
    adapter's ``lora_dropout`` ones too); the probabilities that modules keep for functional
    dropout (``attention_dropout`` of Llama / Qwen attention) and their configs' keys
    (``attention_dropout``, ``hidden_dropout``, ``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``,
    ``dropout``, ``layerdrop`` ..., nested configs and peft's ``LoraConfig`` included) become 0.

    RL compares two forwards of one policy (the sampler's in eval mode, the update's in train
    mode, through Hugging Face's code with gradient checkpointing): with any dropout left the
    ratio is not 1 at the first minibatch, and it drifts even at lr = 0.
    """
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
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ValueError(
        f"{type(model).__name__} has no linear 'score'/'classifier' head to read a scalar from; "
        "use a decoder AutoModelForSequenceClassification (GPT-2, Llama, Qwen, ...) with num_labels=1"
    )


def _hidden(model: PreTrainedModel, input_ids, attention_mask, position_ids=None,
            use_lean: bool | None = None) -> torch.Tensor:
    """Last hidden states ``[B, T, H]``; ``use_lean``: the caller's :func:`lean.supported` answer, if it has one."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    if lean.supported(model) if use_lean is None else use_lean:  # GPT-2 / Llama / Qwen2: less overhead
        return lean.hidden_states(model, input_ids, attention_mask, position_ids)
    out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.last_hidden_state  # [B, T, H]


def response_hidden(model: PreTrainedModel, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """Hidden states at the columns that predict the response tokens, ``[B, R, H]``.

    When prompts repeat across rows (GRPO / RLOO groups) and the model takes the lean path,
    each distinct prompt is computed once (:func:`rlhfkit.lean.response_hidden_states`). The
    last column is not run: its state predicts no token and, the attention being causal, no
    other column reads it (one of the R response columns fewer to run).
    """
    positions = position_ids_from_mask(attention_mask)
    use_lean = lean.supported(model)
    if use_lean:
        shared = lean.shared_prompts(input_ids, attention_mask, prompt_len)
        if shared is not None:
            return lean.response_hidden_states(model, input_ids, attention_mask, positions, prompt_len, *shared)
    T_in = input_ids.shape[1] - 1  # >= prompt_len: at least one response column
    return _hidden(model, input_ids[:, :T_in], attention_mask[:, :T_in], positions[:, :T_in],
                   use_lean)[:, prompt_len - 1 :]


def token_values(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """The scalar head at every position: ``[B, T]`` (a value model)."""
    hidden = _hidden(model, input_ids, attention_mask, position_ids)
    return scalar_head(model)(hidden).squeeze(-1).float()  # [B, T]


def sequence_logits(model: PreTrainedModel, input_ids, attention_mask, position_ids=None,
                    prompt_len: int | None = None) -> torch.Tensor:
    """The classification head at the last attended token of each row: ``[B, num_labels]``.

    Works for left and right padding: the last attended column is found from the mask.
    ``prompt_len``: the rows are ``[prompt (P) | response]`` with left-padded prompts (a
    rollout); when prompts repeat across rows (GRPO / RLOO groups) and the model takes the lean
    path, each distinct prompt is then run once, as in the policy's forwards
    (:func:`rlhfkit.lean.response_hidden_states`; equal up to rounding).
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (cols * attention_mask.long()).argmax(-1)  # [B]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    shared = None
    if prompt_len is not None and 0 < prompt_len < input_ids.shape[1] and lean.supported(model):
        shared = lean.shared_prompts(input_ids, attention_mask, prompt_len)
    if shared is not None and bool((last >= prompt_len - 1).all()):
        hidden = lean.response_hidden_states(model, input_ids, attention_mask, position_ids, prompt_len, *shared,
                                             through_last=True)  # [B, T - P + 1, H]: columns P-1 .. T-1
        pooled = hidden[rows, last - (prompt_len - 1)]  # [B, H]
    else:
        pooled = _hidden(model, input_ids, attention_mask, position_ids)[rows, last]  # [B, H]
    return scalar_head(model)(pooled).float()  # [B, L]


def sequence_scores(model: PreTrainedModel, input_ids, attention_mask, position_ids=None,
                    prompt_len: int | None = None) -> torch.Tensor:
    """The scalar head at the last attended token of each row: ``[B]`` (a reward model);
    ``prompt_len`` as in :func:`sequence_logits`."""
    return sequence_logits(model, input_ids, attention_mask, position_ids, prompt_len).squeeze(-1)  # [B]


class ValueHead(nn.Module):
    """A linear value head on the policy's last hidden state (shared-backbone critic)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)  # start at V = 0: no bogus advantages on step 1
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1).float()  # [B, T]


def policy_forward(
    policy: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    value_head: ValueHead | None = None,
    detach_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits predicting each response token, and (with a shared head) values: response-aligned.

    The sequence is ``[prompt (P) | response (R)]``; the logits at column ``t`` predict token
    ``t + 1``, so response token ``j`` (column ``P + j``) is scored by column ``P + j - 1``.
    Only those ``R`` columns go through the LM head, which saves ``P/T`` of its cost.

    ``detach_value`` stops the value loss at the head (the shared backbone is not moved by
    it), which is what a critic warm-up needs.

    Returns:
        ``logits [B, R, V]`` and ``values [B, R]`` (None without a value head).
    """
    if isinstance(policy, AdapterDisabled):  # the LoRA reference: the base, adapter off
        with torch.no_grad(), policy.active() as base:
            return policy_forward(base, input_ids, attention_mask, prompt_len)
    hidden = response_hidden(policy, input_ids, attention_mask, prompt_len)  # [B, R, H]
    logits = unwrap(policy).get_output_embeddings()(hidden)  # [B, R, V]
    values = None
    if value_head is not None:
        values = value_head(hidden.detach() if detach_value else hidden)  # [B, R]
    return logits, values


UPDATE_LOGITS = 2**24  # logits per chunk of the update's log-prob / entropy pass: 64 MiB of float32


def plain_lm_head(policy) -> nn.Linear | None:
    """The policy's LM head when it is a plain ``nn.Linear`` whose weight (tied or not) can be
    used directly: no adapter or other wrapper, no hooks on its call, no sharded weight; else None."""
    head = unwrap(policy).get_output_embeddings()
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks or is_sharded(head.weight):
        return None
    return head


def token_logprobs(
    policy: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    response_ids: torch.Tensor,
    temperature: float = 1.0,
    value_head: ValueHead | None = None,
    detach_value: bool = False,
    entropy: bool = False,
    token_loss=None,
) -> tuple:
    """Log-probs of the response tokens under the (tempered) policy, their entropies and (with a
    shared head) values, response-aligned: the numbers of :func:`policy_forward`'s logits divided
    by ``temperature`` and read by :func:`~rlhfkit.core.logprobs_from_logits` /
    :func:`~rlhfkit.core.entropy_from_logits`, with gradients.

    When the ``[B, R, V]`` logits would exceed ``UPDATE_LOGITS`` elements and the LM head is a
    plain linear layer (:func:`plain_lm_head`), they are never built:
    :func:`~rlhfkit.core.chunked_token_logprobs` computes them ``UPDATE_LOGITS // V`` rows at a
    time, in the forward and again in the backward, so the update's peak memory stops growing
    with the vocabulary. Otherwise (a small vocabulary, an adapter on the head) the full logits
    are computed as before.

    ``token_loss(logp, ent, s, e)``, a loss that is a sum over tokens (its part from the
    flattened ``[B * R]`` positions ``s .. e-1``, reading no other): on the chunked path it is
    computed by :func:`~rlhfkit.core.chunked_token_loss`, which builds each chunk's logits once
    instead of again in the backward; the log-probs and entropies are then returned without a
    gradient, and the loss with one. Elsewhere the loss is None and the caller computes it from
    the log-probs as usual.

    Returns:
        ``(logprobs [B, R], entropy [B, R] or None, values [B, R] or None)``; entropies only
        with ``entropy=True``; given ``token_loss``, also that loss or None, as a fourth item.
    """
    out = _token_logprobs(policy, input_ids, attention_mask, prompt_len, response_ids, temperature, value_head,
                          detach_value, entropy, token_loss)
    return out if token_loss is not None else out[:3]


def _token_logprobs(policy, input_ids, attention_mask, prompt_len, response_ids, temperature, value_head,
                    detach_value, entropy, token_loss):
    if isinstance(policy, AdapterDisabled):  # the LoRA reference: the base, adapter off
        with torch.no_grad(), policy.active() as base:
            return (*token_logprobs(base, input_ids, attention_mask, prompt_len, response_ids, temperature,
                                    entropy=entropy), None)  # the reference: no loss
    hidden = response_hidden(policy, input_ids, attention_mask, prompt_len)  # [B, R, H]
    values = None
    if value_head is not None:
        values = value_head(hidden.detach() if detach_value else hidden)  # [B, R]
    head = plain_lm_head(policy)
    rows = max(1, UPDATE_LOGITS // head.out_features) if head is not None else 0
    if head is None or response_ids.numel() <= rows:
        logits = unwrap(policy).get_output_embeddings()(hidden) / temperature  # [B, R, V]
        return (logprobs_from_logits(logits, response_ids), entropy_from_logits(logits) if entropy else None,
                values, None)
    shape, loss = response_ids.shape, None
    if token_loss is not None and torch.is_grad_enabled():
        loss, logp, ent = chunked_token_loss(hidden.flatten(0, 1), head.weight, head.bias, response_ids.flatten(),
                                             token_loss, temperature, rows, entropy)  # [B * R]
    else:
        logp, ent = chunked_token_logprobs(hidden.flatten(0, 1), head.weight, head.bias, response_ids.flatten(),
                                           temperature, rows, entropy)  # [B * R]
    return logp.view(shape), None if ent is None else ent.view(shape), values, loss


def masked_lm_loss(model, ids, attention_mask, loss_mask, position_ids=None) -> torch.Tensor:
    """Mean cross-entropy over target tokens: ``loss_mask[:, t]`` marks token t as a target."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits  # [B, T, V]
    targets = ids[:, 1:].masked_fill(loss_mask[:, 1:] == 0, -100)  # [B, T-1]
    if bool((targets == -100).all()):
        raise ValueError("an SFT batch has no target token: check data.completion_only and the records")
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                             ignore_index=-100)
