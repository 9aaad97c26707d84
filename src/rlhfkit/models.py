"""Models: Hugging Face causal LMs for the policy, scalar-head models for reward and value.

* policy / reference: any ``AutoModelForCausalLM``.
* reward and (separate) value model: ``AutoModelForSequenceClassification`` with
  ``num_labels=1``. The reward reads the head at the last *attended* token (from the
  attention mask, not from ``pad_token_id``: many tokenizers use EOS as pad, and the EOS is
  exactly the token a reward must read); the value model applies the same head at every
  position. Using one class for both is what lets a critic start from the reward model.
* shared value head: a ``ValueHead`` on the policy's last hidden state (seed 002), so one
  forward gives logits and values.
"""

from __future__ import annotations

import os

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

from . import lean


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens, so left padding shifts nothing: ``[B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
    )


def build_tiny_policy(tokenizer, seed: int, **arch) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(tokenizer, **arch))


def build_tiny_scalar_model(tokenizer, seed: int, **arch) -> GPT2ForSequenceClassification:
    torch.manual_seed(seed)
    cfg = tiny_gpt2_config(tokenizer, **arch)
    cfg.num_labels = 1
    return GPT2ForSequenceClassification(cfg)


class ModelLoadError(ValueError):
    """A model or tokenizer cannot be loaded from a path; the message names the path and the fix."""


def _looks_local(path: str) -> bool:
    """True for what can only be a filesystem path, never a hub id ('name' or 'org/name')."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") >= 2 or (os.sep != "/" and os.sep in path)


def _from_pretrained(loader, path: str, what: str, **kwargs):
    """``loader.from_pretrained(path, **kwargs)`` with a one-paragraph error instead of a traceback.

    Weights are read from safetensors only (``use_safetensors=True`` for models): a pickle-based
    ``pytorch_model.bin`` can execute code when loaded, so it is refused, not loaded."""
    path = os.fspath(path)
    if not path:
        raise ModelLoadError(f"no {what} path given")
    if not os.path.exists(path) and _looks_local(path):
        raise ModelLoadError(f"{path!r} does not exist (looked for the {what} there): point model.name / "
                             "reward.name at a directory written by save_pretrained (config.json, model.safetensors, "
                             "tokenizer files) or at a hub id")
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


def load_policy(path: str, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> PreTrainedModel:
    return _from_pretrained(AutoModelForCausalLM, path, "policy model", dtype=dtype,
                            trust_remote_code=trust_remote_code, use_safetensors=True)


def load_scalar_model(path: str, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                      num_labels: int | None = 1, **kwargs) -> PreTrainedModel:
    """A sequence-classification model; ``num_labels=None`` keeps the checkpoint's own count.
    ``kwargs`` go to ``from_pretrained`` (e.g. ``ignore_mismatched_sizes``)."""
    extra = dict(kwargs) if num_labels is None else {"num_labels": num_labels, **kwargs}
    model = _from_pretrained(AutoModelForSequenceClassification, path, "scalar (reward/value) model", dtype=dtype,
                             trust_remote_code=trust_remote_code, use_safetensors=True, **extra)
    scalar_head(model)  # fail now, with a clear message, if there is no head we can read
    return model


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0: PPO's ratio must be exactly 1 before the first update."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def freeze(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    return model.eval()


def scalar_head(model: PreTrainedModel) -> nn.Module:
    """The linear head of a sequence-classification model (``score`` or ``classifier``)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ValueError(
        f"{type(model).__name__} has no linear 'score'/'classifier' head to read a scalar from; "
        "use a decoder AutoModelForSequenceClassification (GPT-2, Llama, Qwen, ...) with num_labels=1"
    )


def _hidden(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    if lean.supported(model):  # GPT-2 / Llama / Qwen2: the same forward with less overhead
        return lean.hidden_states(model, input_ids, attention_mask, position_ids)
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.last_hidden_state  # [B, T, H]


def response_hidden(model: PreTrainedModel, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """Hidden states at the columns that predict the response tokens, ``[B, R, H]``.

    When prompts repeat across rows (GRPO / RLOO groups) and the model takes the lean path,
    each distinct prompt is computed once (:func:`rlhfkit.lean.response_hidden_states`).
    """
    positions = position_ids_from_mask(attention_mask)
    if lean.supported(model):
        shared = lean.shared_prompts(input_ids, attention_mask, prompt_len)
        if shared is not None:
            return lean.response_hidden_states(model, input_ids, attention_mask, positions, prompt_len, *shared)
    return _hidden(model, input_ids, attention_mask, positions)[:, prompt_len - 1 : -1]


def token_values(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """The scalar head at every position: ``[B, T]`` (a value model)."""
    hidden = _hidden(model, input_ids, attention_mask, position_ids)
    return scalar_head(model)(hidden).squeeze(-1).float()  # [B, T]


def sequence_logits(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """The classification head at the last attended token of each row: ``[B, num_labels]``.

    Works for left and right padding: the last attended column is found from the mask.
    """
    hidden = _hidden(model, input_ids, attention_mask, position_ids)  # [B, T, H]
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (cols * attention_mask.long()).argmax(-1)  # [B]
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
    return scalar_head(model)(pooled).float()  # [B, L]


def sequence_scores(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """The scalar head at the last attended token of each row: ``[B]`` (a reward model)."""
    return sequence_logits(model, input_ids, attention_mask, position_ids).squeeze(-1)  # [B]


class ValueHead(nn.Module):
    """A linear value head on the policy's last hidden state (shared-backbone critic)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)  # start at V = 0: no bogus advantages on step 1
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden).squeeze(-1).float()  # [B, T]


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
    hidden = response_hidden(policy, input_ids, attention_mask, prompt_len)  # [B, R, H]
    logits = policy.get_output_embeddings()(hidden)  # [B, R, V]
    values = None
    if value_head is not None:
        values = value_head(hidden.detach() if detach_value else hidden)  # [B, R]
    return logits, values


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
