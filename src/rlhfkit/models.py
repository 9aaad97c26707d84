"""Models: the forwards RL reads from Hugging Face models, response-aligned.

* policy / reference: any ``AutoModelForCausalLM``; :func:`policy_forward` and
  :func:`token_logprobs` score the response tokens (the LM head over the response columns only,
  in chunks of ``UPDATE_LOGITS`` for a big vocabulary).
* reward and (separate) value model: ``AutoModelForSequenceClassification`` with
  ``num_labels=1``. The reward reads the head at the last *attended* token (from the attention
  mask, not from ``pad_token_id``: many tokenizers use EOS as pad, and the EOS is exactly the
  token a reward must read); the value model applies the same head at every position.
* shared value head: a :class:`ValueHead` on the policy's last hidden state.

Every forward is the model's own ``transformers`` forward, unless an accelerated one is
registered (:func:`rlhfkit.ops.hidden_states`). Loading, LoRA and saving: :mod:`rlhfkit.loading`
(re-exported here).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .core import entropy_from_logits, logprobs_from_logits, position_ids_from_mask
from .distributed import is_sharded
from .loading import (  # noqa: F401  re-exported: rlhfkit.models is where callers find them
    ARCHS,
    DROPOUT_MODULES,
    DROPOUT_NAMES,
    DTYPES,
    LORA_LAYERS,
    SCALAR_HEADS,
    SCRATCH_MARK,
    AdapterDisabled,
    ModelLoadError,
    PreTrainedModel,
    add_lora,
    backbone,
    build_tiny,
    build_tiny_policy,
    build_tiny_scalar_model,
    check_lora_targets,
    context_window,
    disable_dropout,
    enable_gradient_checkpointing,
    eval_mode,
    freeze,
    from_scratch,
    is_lora,
    load_policy,
    load_scalar_model,
    load_tokenizer,
    local_path_reason,
    lora_delta,
    lora_targets,
    merge_lora,
    merged_lora_state_dict,
    pin_base_path,
    policy_dir,
    policy_with_reference,
    quiet_load_report,
    resolve_dtype,
    same_tokenizer,
    save_policy,
    scalar_head,
    tiny_config,
    tiny_gpt2_config,
    unwrap,
)
from .logprobs import chunked_token_logprobs, chunked_token_loss


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


def _hidden(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """Last hidden states ``[B, T, H]``: the model's own forward, or an accelerated one
    (:func:`rlhfkit.ops.hidden_states`)."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    hidden = ops.hidden_states(model, input_ids, attention_mask, position_ids)
    if hidden is None:
        out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        hidden = out.last_hidden_state
    return hidden  # [B, T, H]


def response_hidden(model: PreTrainedModel, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """Hidden states at the columns that predict the response tokens, ``[B, R, H]``.

    The last column is not run: its state predicts no token and, the attention being causal, no
    other column reads it. An accelerated forward may run each prompt repeated across rows (GRPO /
    RLOO groups) once (:func:`rlhfkit.ops.response_hidden_states`).
    """
    positions = position_ids_from_mask(attention_mask)
    hidden = ops.response_hidden_states(model, input_ids, attention_mask, positions, prompt_len)
    if hidden is not None:
        return hidden
    T_in = input_ids.shape[1] - 1  # >= prompt_len: at least one response column
    return _hidden(model, input_ids[:, :T_in], attention_mask[:, :T_in], positions[:, :T_in])[:, prompt_len - 1 :]


def token_values(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """The scalar head at every position: ``[B, T]`` (a value model)."""
    hidden = _hidden(model, input_ids, attention_mask, position_ids)
    return scalar_head(model)(hidden).squeeze(-1).float()  # [B, T]


def sequence_logits(model: PreTrainedModel, input_ids, attention_mask, position_ids=None,
                    prompt_len: int | None = None) -> torch.Tensor:
    """The classification head at the last attended token of each row: ``[B, num_labels]``.

    Works for left and right padding: the last attended column is found from the mask.
    ``prompt_len``: the rows are ``[prompt (P) | response]`` with left-padded prompts (a
    rollout), whose repeated prompts an accelerated forward may run once, as in the policy's
    forwards (:func:`rlhfkit.ops.response_hidden_states`; equal up to rounding).
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (cols * attention_mask.long()).argmax(-1)  # [B]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    hidden = None
    if prompt_len is not None and 0 < prompt_len < input_ids.shape[1] and bool((last >= prompt_len - 1).all()):
        hidden = ops.response_hidden_states(model, input_ids, attention_mask, position_ids, prompt_len,
                                            through_last=True)  # [B, T - P + 1, H]: columns P-1 .. T-1
    if hidden is not None:
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
    :func:`~rlhfkit.logprobs.chunked_token_logprobs` computes them ``UPDATE_LOGITS // V`` rows at a
    time, in the forward and again in the backward, so the update's peak memory stops growing
    with the vocabulary. Otherwise (a small vocabulary, an adapter on the head) the full logits
    are computed as before.

    ``token_loss(logp, ent, s, e)``, a loss that is a sum over tokens (its part from the
    flattened ``[B * R]`` positions ``s .. e-1``, reading no other): on the chunked path it is
    computed by :func:`~rlhfkit.logprobs.chunked_token_loss`, which builds each chunk's logits once
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
