"""The forwards RL reads from Hugging Face models, response-aligned: a causal LM's log-probs, a
sequence classifier's scalar at the last *attended* token (from the mask: pad is often EOS, the
token a reward must read) or at every position, a shared :class:`ValueHead`. Each is the model's
own forward unless an accelerated one is registered (:mod:`rlhfkit.ops`); loading is re-exported."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..core import entropy_from_logits, logprobs_from_logits, position_ids_from_mask
from ..run.distributed import is_sharded
from .loading import *  # noqa: F403  re-exported: rlhfkit.models is where callers find them
from .loading import AdapterDisabled, PreTrainedModel, backbone, scalar_head, unwrap
from .logprobs import chunked_token_logprobs


class ModuleForward(nn.Module):
    """``fn(model, *args)`` as a module's forward: DDP / FSDP synchronise gradients only through it."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def _hidden(model: PreTrainedModel, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    hidden = ops.hidden_states(model, input_ids, attention_mask, position_ids)
    if hidden is None:
        out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        hidden = out.last_hidden_state
    return hidden  # [B, T, H]


def response_hidden(model: PreTrainedModel, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """Hidden states ``[B, R, H]`` at the columns that predict the response tokens (the last column,
    which predicts none, is not run); an accelerated forward may run a repeated prompt once."""
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
    """The classification head at each row's last attended token: ``[B, num_labels]``.
    ``prompt_len``: rows are ``[prompt (P) | response]``, whose repeated prompts may run once."""
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
    """The scalar head at each row's last attended token: ``[B]`` (a reward model)."""
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


def policy_forward(policy: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                   value_head: ValueHead | None = None, detach_value: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned ``logits [B, R, V]`` (token ``P + j`` scored by column ``P + j - 1``) and,
    with a shared head, ``values [B, R]``; ``detach_value`` stops the value loss at the head."""
    if isinstance(policy, AdapterDisabled):  # the LoRA reference: the base, adapter off
        with torch.no_grad(), policy.active() as base:
            return policy_forward(base, input_ids, attention_mask, prompt_len)
    hidden = response_hidden(policy, input_ids, attention_mask, prompt_len)  # [B, R, H]
    logits = unwrap(policy).get_output_embeddings()(hidden)  # [B, R, V]
    return logits, None if value_head is None else value_head(hidden.detach() if detach_value else hidden)


UPDATE_LOGITS = 2**24  # logits per chunk of the update's log-prob / entropy pass: 64 MiB of float32


def plain_lm_head(policy) -> nn.Linear | None:
    """The policy's LM head when its weight can be used directly (a plain ``nn.Linear``: no
    wrapper, hooks or sharded weight), else None."""
    head = unwrap(policy).get_output_embeddings()
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks or is_sharded(head.weight):
        return None
    return head


def token_logprobs(policy: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                   response_ids: torch.Tensor, temperature: float = 1.0, value_head: ValueHead | None = None,
                   detach_value: bool = False, entropy: bool = False, logits_budget: int = UPDATE_LOGITS) -> tuple:
    """``(logprobs [B, R], entropy [B, R] | None, values [B, R] | None)`` of the response tokens
    under the policy's logits over ``temperature``. Past ``logits_budget`` logits with a
    :func:`plain_lm_head` they are computed in row chunks, never built."""
    if isinstance(policy, AdapterDisabled):  # the LoRA reference: the base, adapter off
        with torch.no_grad(), policy.active() as base:
            return token_logprobs(base, input_ids, attention_mask, prompt_len, response_ids, temperature,
                                  entropy=entropy, logits_budget=logits_budget)
    hidden = response_hidden(policy, input_ids, attention_mask, prompt_len)  # [B, R, H]
    values = None if value_head is None else value_head(hidden.detach() if detach_value else hidden)  # [B, R]
    head = plain_lm_head(policy)
    rows = max(1, logits_budget // head.out_features) if head is not None else 0
    if head is None or response_ids.numel() <= rows:
        logits = unwrap(policy).get_output_embeddings()(hidden) / temperature  # [B, R, V]
        return logprobs_from_logits(logits, response_ids), entropy_from_logits(logits) if entropy else None, values
    logp, ent = chunked_token_logprobs(hidden.flatten(0, 1), head.weight, head.bias, response_ids.flatten(),
                                       temperature, rows, entropy)  # [B * R]
    shape = response_ids.shape
    return logp.view(shape), None if ent is None else ent.view(shape), values


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
