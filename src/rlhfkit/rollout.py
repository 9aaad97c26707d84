"""Batched generation with a KV cache from left-padded prompts.

A lean decode loop instead of ``model.generate``: one prefill, then one cached forward per
token -- for GPT-2 and Llama/Qwen2 models through :mod:`rlhfkit.lean` (a pre-allocated KV
cache written in place, a functional forward with no per-step mask building), for any other
causal LM through its own forward with a ``DynamicCache``. Sampling happens on the device (on a
CPU, one compiled call per step: :class:`rlhfkit.kernels.Sampler`); rows that emitted EOS keep
being fed (a batch moves in lockstep) but their later tokens are padding and masked; the loop
ends as soon as every row has finished. It also returns the log-prob of every sampled token
under the sampling distribution, which PPO compares against its own recomputation
(``policy/logprob_gap``) -- or, when the sampler ran the training forward's own arithmetic
(``Rollout.forward_logprobs``), uses in place of a second forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from . import kernels
from . import lean as lean_lm
from .core import position_ids_from_mask


@dataclass
class Rollout:
    """One batch of generated responses, response-aligned.

    Fields:
        prompt_ids:      ``[B, P]`` left-padded prompts.
        prompt_mask:     ``[B, P]`` 1 on prompt tokens, 0 on left padding.
        response_ids:    ``[B, R]`` sampled tokens; ``pad`` after the first EOS.
        response_mask:   ``[B, R]`` 1 up to and including the first EOS, 0 after.
        logprobs:        ``[B, R]`` log pi(a_t|s_t) of each token at sampling time (0 where masked).
        finished:        ``[B]`` bool, True where an EOS was emitted.
        entropy:         ``[B, R]`` entropy of each sampling distribution (0 where masked).
        values:          ``[B, R]`` ``value_head`` of the state before each token, when asked for
                         and the lean path ran (else None).
        forward_logprobs: True when ``logprobs`` (and ``values``) came from the same arithmetic
                         as the training forward -- :mod:`rlhfkit.lean` in float32 -- so they
                         equal a recomputation up to rounding (~1e-6) and PPO may use them as
                         the old log-probs instead of running the policy again.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    forward_logprobs: bool = False

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)  # [B, T]

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], 1)  # [B, T]


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Decoded response text per row, special tokens kept (EOS matters), padding dropped."""
    lengths = response_mask.sum(-1).tolist()
    rows = [ids[:n] for ids, n in zip(response_ids.tolist(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


def tokenize_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding=True, return_tensors="pt", padding_side="left")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def sample_tokens(logp: torch.Tensor, generator: torch.Generator | None = None,
                  u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from ``logp [B, V]`` (log-probabilities) by inverting the CDF.

    ``u [B]`` are the row's uniform draws in [0, 1) (drawn from ``generator`` when not given).
    The token is the first index whose cumulative probability reaches ``(1 - u) * total``, a
    point in ``(0, total]``, so a zero-probability token is never drawn. One uniform per row
    and a binary search: on CPU 2-10x faster than ``torch.multinomial`` (which draws and sorts
    per row).
    """
    cdf = logp.exp().cumsum(-1)  # [B, V]
    if u is None:
        u = torch.rand((logp.shape[0],), generator=generator, device=logp.device)
    point = (1.0 - u.to(cdf)[:, None]) * cdf[:, -1:]  # [B, 1], scaled to the total (float error)
    return torch.searchsorted(cdf, point).squeeze(-1).clamp_(max=logp.shape[-1] - 1)  # [B]


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` over the last dim of log-probabilities; a token ruled out (log p = -inf)
    adds 0, not 0 * -inf."""
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)


class _Forward:
    """The model's next-token logits one step at a time: the lean path (:mod:`rlhfkit.lean`,
    pre-allocated cache, functional forward) or the model's own forward with a DynamicCache."""

    def __init__(self, model, prompt_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, lean: bool):
        self.model, self.mask, self.lean = model, mask, lean
        positions = position_ids_from_mask(mask)  # [B, P]
        self.next_pos = positions[:, -1] + 1  # [B]
        self.hidden = None
        if lean:
            head = model.get_output_embeddings()
            if type(head) is torch.nn.Linear:  # skip the module call's hooks machinery: it runs per token
                head = lambda h, w=head.weight, b=head.bias: F.linear(h, w, b)  # noqa: E731
            self.head = head
            self.hidden, self.cache = lean_lm.prefill(model, prompt_ids, mask, positions, max_new_tokens)
            self.logits = head(self.hidden)  # [B, V]
        else:
            self.cache = DynamicCache()
            out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                        use_cache=True)
            self.cache, self.logits = out.past_key_values, out.logits[:, -1]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Feed ``tok [B]``; the logits ``[B, V]`` of the next position."""
        if self.lean:
            self.hidden = lean_lm.decode_step(self.cache, tok, self.next_pos)
            logits = self.head(self.hidden)
        else:
            B = tok.shape[0]
            self.mask = torch.cat([self.mask, torch.ones((B, 1), dtype=self.mask.dtype, device=tok.device)], 1)
            out = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                             past_key_values=self.cache, use_cache=True)
            self.cache, logits = out.past_key_values, out.logits[:, -1]
        self.next_pos = self.next_pos + 1
        return logits


class _Draw:
    """Picks each step's tokens and keeps what the rollout returns: the tokens, which rows are
    still going, and the log-probs and entropies of the (tempered) distributions sampled from.

    On a CPU the sampling step is one compiled call (:class:`rlhfkit.kernels.Sampler`, same
    arithmetic). Otherwise per step only what sampling needs; masks, padding and trimming
    happen once at the end. While the per-step distributions are small (a small vocabulary)
    they are kept and reduced to log-probs and entropies in one go; with a large one each is
    reduced as it comes.
    """

    def __init__(self, B: int, V: int, max_new_tokens: int, temperature: float, greedy: bool, eos_token_id: int,
                 uniforms: torch.Tensor | None, device):
        self.temperature, self.greedy, self.eos = temperature, greedy, eos_token_id
        self.uniforms = uniforms
        self.sampler = (kernels.Sampler(B, max_new_tokens, V, temperature, eos_token_id)
                        if not greedy and device.type == "cpu" and kernels.sampler_usable(B, V) else None)
        if self.sampler is not None:
            self.uniforms = uniforms.float()
        # checking "all rows finished" reads a flag back from the device; on GPUs do it every few steps
        self.check_every = 1 if device.type == "cpu" else 8
        self.keep = B * V * max_new_tokens <= 2**24
        self.tokens, self.logps, self.entropies = [], [], []
        self.alive = torch.ones(B, dtype=torch.bool, device=device)

    def step(self, t: int, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Token ``t`` of every row from ``logits [B, V]`` (float32): ``(tokens [B], all rows ended)``."""
        if self.sampler is not None:
            done = self.sampler.step(t, logits, self.uniforms[:, t]) == 0  # every row has emitted EOS
            return self.sampler.tokens[:, t], done
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp_all = torch.log_softmax(logits, -1)  # [B, V]
        tok = logits.argmax(-1) if self.greedy else sample_tokens(logp_all, u=self.uniforms[:, t])  # [B]
        self.tokens.append(tok)
        if self.keep:
            self.logps.append(logp_all)
        else:
            self.logps.append(logp_all.gather(-1, tok[:, None]))
            self.entropies.append(_entropy(logp_all))
        self.alive = self.alive & (tok != self.eos)
        return tok, (t + 1) % self.check_every == 0 and not bool(self.alive.any())

    def result(self, steps: int) -> tuple[torch.Tensor, ...]:
        """``(raw tokens, after_eos, finished [B], logprobs, entropy)`` after ``steps`` steps; the
        ``[B, R]`` tensors end at the last column any row still needs."""
        if self.sampler is not None:
            raw, alive = self.sampler.tokens[:, :steps], self.sampler.alive  # [B, R]
        else:
            raw, alive = torch.stack(self.tokens, 1), self.alive  # [B, R]
        is_eos = (raw == self.eos).long()
        after_eos = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first EOS
        if self.check_every > 1:  # rows may have finished before the last check: trim the all-padding tail
            R = max(1, int((~after_eos).any(0).sum()))
            raw, after_eos = raw[:, :R], after_eos[:, :R]
        R = raw.shape[1]
        if self.sampler is not None:
            logprobs, entropy = self.sampler.logprobs[:, :R], self.sampler.entropy[:, :R]  # [B, R]
        elif self.keep:
            logp = torch.stack(self.logps[:R], 1)  # [B, R, V]
            logprobs, entropy = logp.gather(-1, raw[..., None]).squeeze(-1), _entropy(logp)
        else:
            logprobs, entropy = torch.cat(self.logps[:R], 1), torch.stack(self.entropies[:R], 1)
        return raw, after_eos, ~alive, logprobs, entropy


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    lean: bool = True,
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Rollout:
    """Sample (or greedily decode) up to ``max_new_tokens`` tokens for each prompt.

    Args:
        model: a causal LM returning ``.logits`` and accepting ``past_key_values``.
        prompt_ids, prompt_mask: ``[B, P]``, left-padded.
        temperature: logits are divided by it before sampling; the returned log-probs are
            those of the tempered distribution (the one actually sampled from).
        greedy: argmax decoding (log-probs still reported under the tempered softmax).
        generator: optional RNG for sampling, for reproducible rollouts.
        uniforms: optional ``[B, max_new_tokens]`` draws from U(0, 1); token ``t`` of row ``i`` is
            then the inverse CDF of its distribution at ``uniforms[i, t]`` (instead of a draw
            from ``generator``), so each row's sample depends on its own draws only and a
            batch split across processes samples exactly what one process would.
        lean: use :mod:`rlhfkit.lean` (pre-allocated KV cache, functional forward) when the
            architecture is supported; False always runs the model's own forward.
        value_head: optional ``[B, H] -> [B]`` map (a shared value head) applied to the last
            hidden state before each sampled token, giving ``Rollout.values`` on the lean path.
    """
    if prompt_ids.shape != prompt_mask.shape:
        raise ValueError("prompt_ids and prompt_mask must have the same shape")
    B, device = prompt_ids.shape[0], prompt_ids.device
    fwd = _Forward(model, prompt_ids, prompt_mask.long(), max_new_tokens, lean and lean_lm.supported(model))
    logits = fwd.logits  # [B, V]
    # the sampler's log-probs stand in for a training forward only when they are computed alike
    forward_logprobs = fwd.lean and logits.dtype == torch.float32
    if uniforms is None and not greedy:  # one draw per row and step, all at once
        uniforms = torch.rand((B, max_new_tokens), generator=generator, device=device)
    draw = _Draw(B, logits.shape[-1], max_new_tokens, temperature, greedy, eos_token_id, uniforms, device)
    values = [] if value_head is not None and fwd.lean else None
    for t in range(max_new_tokens):
        if values is not None:
            values.append(value_head(fwd.hidden))  # [B]: the state that samples token t
        tok, done = draw.step(t, logits.float())
        if t == max_new_tokens - 1 or done:
            break
        logits = fwd.step(tok)  # rows that already ended are fed their own samples: masked out later
    raw, after_eos, finished, logprobs, entropy = draw.result(t + 1)  # [B, R] but finished [B]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask.long(),
                   response_ids=raw.masked_fill(after_eos, pad_token_id), response_mask=(~after_eos).long(),
                   logprobs=logprobs.masked_fill(after_eos, 0.0), finished=finished,
                   entropy=entropy.masked_fill(after_eos, 0.0),
                   values=None if values is None else torch.stack(values[: raw.shape[1]], 1).float(),
                   forward_logprobs=forward_logprobs)
