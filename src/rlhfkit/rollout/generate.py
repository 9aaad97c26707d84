"""Batched generation with a KV cache from left-padded prompts: one prefill, then one cached
forward per token (the model's own, or :func:`rlhfkit.ops.decoder`'s), drawing on the device,
optionally from a distribution shaped as transformers' logits processors shape it. Finished rows
keep being fed (the batch moves in lockstep), their later tokens masked. Each token's log-prob
under the full tempered distribution comes back too (``policy/logprob_gap``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .. import ops
from ..core import position_ids_from_mask
from ..models.loading import unwrap


@dataclass
class Rollout:
    """One batch of generated responses; ``[B, R]`` tensors are response-aligned, 0 / pad where masked."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on prompt tokens
    response_ids: torch.Tensor  # [B, R] the sampled tokens
    response_mask: torch.Tensor  # [B, R] 1 up to and including the first EOS (or a stop string's last token)
    logprobs: torch.Tensor  # [B, R] log pi(a_t|s_t) under the full tempered distribution, shaped draw or not
    finished: torch.Tensor  # [B] bool, False where cut off at max_new_tokens
    entropy: torch.Tensor | None = None  # [B, R] of each full tempered distribution
    values: torch.Tensor | None = None  # [B, R] the shared value head's, where asked and accelerated
    forward_logprobs: bool = False  # logprobs (and values) computed as the training forward computes them
    kept_logmass: torch.Tensor | None = None  # [B, R] log pi - log q of a shaped draw's tokens; None: q = pi
    attend: torch.Tensor | None = None  # [B, R] every token the model reads (an episode's observations too)
    turn_rewards: torch.Tensor | None = None  # [B, R] an environment's per-turn rewards, on each turn's last token
    turn_lengths: torch.Tensor | None = None  # [B, R] long, each model turn's length on its last token

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)  # [B, T]

    @property
    def response_attention(self) -> torch.Tensor:
        """``[B, R]`` the response tokens the model reads (observations included)."""
        return self.response_mask if self.attend is None else self.attend

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_attention], 1)  # [B, T]


def response_rows(response_ids: torch.Tensor, attend: torch.Tensor) -> list[list[int]]:
    """Each row's response tokens where ``attend [B, R]`` is 1, padding dropped."""
    return [[t for t, a in zip(ids, m) if a] for ids, m in zip(response_ids.tolist(), attend.tolist())]


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Decoded response text per row, special tokens kept (EOS matters), padding dropped."""
    return tokenizer.batch_decode(response_rows(response_ids, response_mask), skip_special_tokens=False)


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a response: the model's ``generation_config.eos_token_id`` (a chat model
    may end a turn with ``<|im_end|>`` and a text with ``<|endoftext|>``), then the tokenizer's."""
    gen = getattr(getattr(unwrap(model), "generation_config", None), "eos_token_id", None)
    ids = [gen] if isinstance(gen, int) else list(gen or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    out = list(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise ValueError("neither the model's generation_config nor the tokenizer names an EOS token")
    return out


def sampling_settings(pc) -> dict:
    """How the ``ppo`` section shapes the sampler's distribution, as :func:`generate`'s keywords."""
    return {"top_k": pc.top_k, "top_p": pc.top_p, "min_p": pc.min_p, "repetition_penalty": pc.repetition_penalty}


UNSHAPED = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}  # the draw is pi itself


def tokenize_prompts(tokenizer, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(texts, padding=True, return_tensors="pt", padding_side="left")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def sample_tokens(logp: torch.Tensor, generator: torch.Generator | None = None,
                  u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from ``logp [B, V]``: the first whose cumulative probability reaches
    ``(1 - u) * total``, ``u [B]`` in [0, 1) (else drawn), so a zero-probability token is never drawn."""
    cdf = logp.exp().cumsum(-1)  # [B, V]
    if u is None:
        u = torch.rand((logp.shape[0],), generator=generator, device=logp.device)
    point = (1.0 - u.to(cdf)[:, None]) * cdf[:, -1:]  # [B, 1], scaled to the total (float error)
    return torch.searchsorted(cdf, point).squeeze(-1).clamp_(max=logp.shape[-1] - 1)  # [B]


def truncate_logprobs(logp: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """``logp [B, V]`` with every token outside the kept set at ``-inf`` (the rest unchanged), row
    by row: the ``top_k`` most likely, then the fewest most likely whose probability renormalised
    over those reaches ``top_p`` (ties with the last kept one kept too), then those at least
    ``min_p`` times the most likely (transformers' order)."""
    if top_k > 0 or top_p < 1.0:
        V = logp.shape[-1]
        top = logp.topk(top_k, -1).values if 0 < top_k < V else logp.sort(-1, descending=True).values  # [B, k]
        n = torch.full_like(top[:, :1], top.shape[-1], dtype=torch.long)  # [B, 1] tokens kept
        if top_p < 1.0:
            probs = torch.softmax(top, -1)
            mass_before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(-1)[:, :-1]], -1)  # non-decreasing
            n = (mass_before < top_p).sum(-1, keepdim=True)  # >= 1: the first token has 0 before it
        logp = logp.masked_fill(logp < top.gather(-1, n - 1), float("-inf"))  # below the least likely kept
    if min_p > 0.0:
        probs = logp.exp()  # [B, V]
        logp = logp.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logp


def seen_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, V: int) -> torch.Tensor:
    """``[B, V]`` bool: the tokens among each row's prompt tokens (padding left out)."""
    counts = torch.zeros((prompt_ids.shape[0], V), dtype=torch.int32, device=prompt_ids.device)
    return counts.scatter_add_(1, prompt_ids, prompt_mask.to(torch.int32)) > 0


def sampler_logprobs(logits: torch.Tensor, logp: torch.Tensor, temperature: float = 1.0, seen: torch.Tensor | None = None,
                     repetition_penalty: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> torch.Tensor:
    """Unnormalised log-probabilities ``[B, V]`` the sampler draws from, in transformers' order: the
    raw ``logits`` with the ``seen`` tokens penalised, tempered, truncated (:func:`truncate_logprobs`);
    ``logp``, the tempered log-softmax, as it is when nothing is penalised."""
    if repetition_penalty != 1.0:  # a seen token's logit divided by the penalty if positive, else multiplied
        penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logp = torch.log_softmax(torch.where(seen, penalised, logits) / temperature, -1)
    return truncate_logprobs(logp, top_k, top_p, min_p)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` over the last dim of log-probabilities; a ruled-out token adds 0, not 0 * -inf."""
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)


def _forward_takes(model, name: str) -> bool:
    """Whether the (unwrapped) model's forward takes the argument ``name``."""
    return name in inspect.signature(unwrap(model).forward).parameters


class _Forward:
    """Next-token logits one step at a time: the model's forward with a ``DynamicCache``, or the
    accelerated one (:func:`rlhfkit.ops.decoder`), which also gives the hidden states."""

    def __init__(self, model, prompt_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, fast: bool,
                 graph: bool = False):
        self.model, self.mask = model, mask
        positions = position_ids_from_mask(mask)  # [B, P]
        self.next_pos = positions[:, -1] + 1  # [B]
        self.fast = ops.decoder(model, prompt_ids, mask, positions, max_new_tokens, graph) if fast else None
        if self.fast is not None:
            self.logits = self.fast.logits  # [B, V]
            return
        # ``cache=`` where transformers names the argument so, the older ``past_key_values=`` elsewhere
        self.cached = {"cache" if _forward_takes(model, "cache") else "past_key_values": DynamicCache(),
                       "use_cache": True}
        # the prefill needs the last position's logits only: [B, P, V] of a big vocabulary is GiBs
        keep = {"logits_to_keep": 1} if _forward_takes(model, "logits_to_keep") else {}
        out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, **self.cached, **keep)
        self.logits = out.logits[:, -1]

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Feed ``tok [B]``; the logits ``[B, V]`` of the next position."""
        if self.fast is not None:
            logits = self.fast.step(tok, self.next_pos)
        else:
            B = tok.shape[0]
            self.mask = torch.cat([self.mask, torch.ones((B, 1), dtype=self.mask.dtype, device=tok.device)], 1)
            out = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
                             **self.cached)
            logits = out.logits[:, -1]
        self.next_pos = self.next_pos + 1
        return logits


class _StopStrings:
    """Ends rows whose text holds a stop string, decoding live rows' last ``window`` tokens: a
    string of ``b`` UTF-8 bytes the newest token completes lies within its last ``b`` tokens (plus
    one, away from a decoder's start-of-text rules). ``ended_at [B]``: the step that did (-1: none)."""

    def __init__(self, tokenizer, stop: Sequence[str], B: int):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.window = max(len(s.encode("utf-8")) for s in self.stop) + 1
        self.ended_at = torch.full((B,), -1, dtype=torch.long)

    def check(self, t: int, recent: torch.Tensor, alive: torch.Tensor) -> None:
        """Step ``t``: rows of ``alive [B]`` (changed in place) whose ``recent [B, w]`` tokens hold a stop string end."""
        rows = alive.nonzero().squeeze(1)  # [n]
        if rows.numel() == 0:
            return
        texts = self.tokenizer.batch_decode(recent[rows].tolist(), skip_special_tokens=False)
        hit = [i for i, text in enumerate(texts) if any(s in text for s in self.stop)]
        if hit:
            ended = rows[hit]
            alive[ended] = False
            self.ended_at[ended.cpu()] = t


class _Draw:
    """Picks each step's tokens and keeps the tokens, live rows, log-probs and entropies: one
    :func:`rlhfkit.ops.sampler` call a step unless the draw is shaped (:func:`sampler_logprobs`, whose
    q draws while pi's log-probs are kept, with log pi - log q). Small distributions are kept and
    reduced at the end, large ones as they come."""

    def __init__(self, B: int, V: int, max_new_tokens: int, temperature: float, greedy: bool,
                 eos_token_id: int | Sequence[int], uniforms: torch.Tensor | None, device, shaping: dict,
                 stop: _StopStrings | None = None, seen: torch.Tensor | None = None):
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.temperature, self.greedy = temperature, greedy
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)  # [E]: any of them ends a row
        # the compiled sampler ends rows at the first EOS id; the others are checked after its call
        self.more_eos = self.eos[1:] if len(eos) > 1 else None
        self.uniforms, self.stop = uniforms, stop
        self.shaping = shaping  # sampling_settings' keys
        # the compiled sampler draws from the full tempered distribution only
        self.shaped = not greedy and shaping != UNSHAPED
        self.seen = seen  # [B, V] the tokens in each row's context, for the repetition penalty (else None)
        self.sampler = (ops.sampler(B, max_new_tokens, V, temperature, eos[0])
                        if not greedy and not self.shaped and device.type == "cpu" else None)
        if self.sampler is not None:
            self.uniforms = uniforms.float()
        # checking "all rows finished" reads a flag back from the device; on GPUs do it every few steps
        self.check_every = 1 if device.type == "cpu" else 8
        self.keep = B * V * max_new_tokens <= 2**24
        self.tokens, self.logps, self.entropies, self.kept = [], [], [], []
        self.alive = torch.ones(B, dtype=torch.bool, device=device)

    def step(self, t: int, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Token ``t`` of every row from ``logits [B, V]`` (float32): ``(tokens [B], all rows ended)``."""
        if self.sampler is not None:
            done = self.sampler.step(t, logits, self.uniforms[:, t]) == 0  # every row has emitted EOS
            tok, alive = self.sampler.tokens[:, t], self.sampler.alive
            if self.more_eos is not None and not done:
                alive &= ~torch.isin(tok, self.more_eos)  # in place: the sampler's own flags
                done = not bool(alive.any())
        else:
            tok = self._pick(t, logits)
            self.alive = alive = self.alive & ~torch.isin(tok, self.eos)
            done = (t + 1) % self.check_every == 0 and not bool(alive.any())
        if self.stop is not None and not done:  # decoding reads the tokens back anyway: check every step
            first = max(0, t + 1 - self.stop.window)
            recent = (self.sampler.tokens[:, first : t + 1] if self.sampler is not None
                      else torch.stack(self.tokens[first:], 1))  # [B, w]
            self.stop.check(t, recent, alive)
            done = not bool(alive.any())
        return tok, done

    def _pick(self, t: int, logits: torch.Tensor) -> torch.Tensor:
        """The PyTorch path's tokens ``[B]`` of step ``t``."""
        raw = logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp_all = torch.log_softmax(logits, -1)  # [B, V]
        if self.greedy:
            tok = logits.argmax(-1)  # [B]
        elif not self.shaped:
            tok = sample_tokens(logp_all, u=self.uniforms[:, t])  # [B]
        else:
            logp_draw = sampler_logprobs(raw, logp_all, self.temperature, self.seen, **self.shaping)  # [B, V]
            tok = sample_tokens(logp_draw, u=self.uniforms[:, t])  # [B]
            # log pi - log q of the drawn token (q = exp(logp_draw) renormalised): with truncation
            # alone exactly log Z, the log of the probability kept
            drawn = tok[:, None]
            self.kept.append(logp_all.gather(-1, drawn).squeeze(-1) - logp_draw.gather(-1, drawn).squeeze(-1)
                             + torch.logsumexp(logp_draw, -1))  # [B]
            if self.seen is not None:
                self.seen.scatter_(1, drawn, True)  # a repeat from now on
        self.tokens.append(tok)
        if self.keep:
            self.logps.append(logp_all)
        else:
            self.logps.append(logp_all.gather(-1, tok[:, None]))
            self.entropies.append(_entropy(logp_all))
        return tok

    def result(self, steps: int) -> tuple[torch.Tensor, ...]:
        """``(raw tokens, ended, finished [B], logprobs, entropy, kept)`` after ``steps`` steps, ``ended``
        True strictly after a row's end, ``kept`` log pi - log q of a shaped draw's tokens (else None);
        ``[B, R]`` up to the last column a row still needs."""
        if self.sampler is not None:
            raw, alive = self.sampler.tokens[:, :steps], self.sampler.alive  # [B, R]
        else:
            raw, alive = torch.stack(self.tokens, 1), self.alive  # [B, R]
        is_eos = torch.isin(raw, self.eos).long()
        ended = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first EOS
        if self.stop is not None:
            stopped_at = self.stop.ended_at.to(raw.device)  # [B]
            cols = torch.arange(raw.shape[1], device=raw.device)
            ended = ended | ((stopped_at[:, None] >= 0) & (cols[None] > stopped_at[:, None]))
        if self.check_every > 1:  # rows may have finished before the last check: trim the all-padding tail
            R = max(1, int((~ended).any(0).sum()))
            raw, ended = raw[:, :R], ended[:, :R]
        R = raw.shape[1]
        if self.sampler is not None:
            logprobs, entropy = self.sampler.logprobs[:, :R], self.sampler.entropy[:, :R]  # [B, R]
        elif self.keep:
            logp = torch.stack(self.logps[:R], 1)  # [B, R, V]
            logprobs, entropy = logp.gather(-1, raw[..., None]).squeeze(-1), _entropy(logp)
        else:
            logprobs, entropy = torch.cat(self.logps[:R], 1), torch.stack(self.entropies[:R], 1)
        return raw, ended, ~alive, logprobs, entropy, torch.stack(self.kept[:R], 1) if self.kept else None


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
             eos_token_id: int | Sequence[int], pad_token_id: int, temperature: float = 1.0, greedy: bool = False,
             generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None, lean: bool = True,
             value_head: Callable[[torch.Tensor], torch.Tensor] | None = None, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, repetition_penalty: float = 1.0, stop: Sequence[str] = (), tokenizer=None,
             graph: bool = False) -> Rollout:
    """Sample (or greedily decode) up to ``max_new_tokens`` tokens for each left-padded prompt.

    ``uniforms``: ``[B, max_new_tokens]`` U(0, 1) draws (else from ``generator``), so a batch split
    across processes samples as one would; ``lean``: the accelerated forward where registered, whose
    hidden states ``value_head`` reads (``Rollout.values``); ``top_k`` .. ``repetition_penalty`` shape
    the draw (:func:`sampler_logprobs`); ``stop`` strings are read through ``tokenizer``; ``graph``:
    fixed-shape decoding (``accel.cuda_graph``)."""
    if prompt_ids.shape != prompt_mask.shape:
        raise ValueError("prompt_ids and prompt_mask must have the same shape")
    if top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or repetition_penalty <= 0:
        raise ValueError(f"top_k must be >= 0, top_p in (0, 1], min_p in [0, 1] and repetition_penalty > 0, got "
                         f"top_k={top_k}, top_p={top_p}, min_p={min_p}, repetition_penalty={repetition_penalty}")
    if any(not s for s in stop) or (stop and tokenizer is None):
        raise ValueError("stop strings must be non-empty and need the tokenizer to decode responses")
    B, device = prompt_ids.shape[0], prompt_ids.device
    fwd = _Forward(model, prompt_ids, prompt_mask.long(), max_new_tokens, lean, graph)
    logits = fwd.logits  # [B, V]
    # the sampler's log-probs stand in for a training forward only when they are computed alike
    forward_logprobs = fwd.fast is not None and logits.dtype == torch.float32
    if uniforms is None and not greedy:  # one draw per row and step, all at once
        uniforms = torch.rand((B, max_new_tokens), generator=generator, device=device)
    V = logits.shape[-1]
    seen = seen_tokens(prompt_ids, prompt_mask, V) if repetition_penalty != 1.0 and not greedy else None  # [B, V]
    shaping = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "repetition_penalty": repetition_penalty}
    draw = _Draw(B, V, max_new_tokens, temperature, greedy, eos_token_id, uniforms, device, shaping,
                 _StopStrings(tokenizer, stop, B) if stop else None, seen)
    values = [] if value_head is not None and fwd.fast is not None else None
    for t in range(max_new_tokens):
        if values is not None:
            values.append(value_head(fwd.fast.hidden))  # [B]: the state that samples token t (accelerated only)
        tok, done = draw.step(t, logits.float())
        if t == max_new_tokens - 1 or done:
            break
        logits = fwd.step(tok)  # rows that already ended are fed their own samples: masked out later
    raw, ended, finished, logprobs, entropy, kept = draw.result(t + 1)  # [B, R] but finished [B]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask.long(),
                   response_ids=raw.masked_fill(ended, pad_token_id), response_mask=(~ended).long(),
                   logprobs=logprobs.masked_fill(ended, 0.0), finished=finished,
                   entropy=entropy.masked_fill(ended, 0.0),
                   values=None if values is None else torch.stack(values[: raw.shape[1]], 1).float(),
                   forward_logprobs=forward_logprobs, kept_logmass=None if kept is None else kept.masked_fill(ended, 0.0))
