"""What each KL estimator optimises, by exact expected gradients (no sampling noise).

The vocabulary is small enough to enumerate every response, so the expectation over samples
``a ~ pi`` of a gradient is a sum weighted by ``pi(a)``, computed exactly in float64 through
rlhfkit's own ``logprobs_from_logits`` and ``kl_estimate``. The sampled responses are held
fixed (their weights ``pi(a)`` are detached), as in PPO, where the gradient runs through the
log-probs of tokens that were already drawn.

* as a loss term (``ppo.kl_in_loss=true``): ``E[grad k(a)]``;
* in the reward (the default): the estimate is a constant, and the policy gradient turns the
  penalty into ``E[sum_t (k_t + k_{t+1} + ...) grad log pi(a_t | s_t)]`` (reward to go).

Each is compared with the exact gradient of a divergence: the reverse KL(pi || ref) of whole
responses, the forward KL(ref || pi), and their per-token versions at the states the policy
visits (``sum_t E_{s_t ~ pi}[KL(pi(.|s_t) || ref(.|s_t))]`` with the states' probabilities held
fixed). PPOConfig.kl_estimator states the results; ``CLAIMS`` below is that statement.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhfkit.config import ALGO_DEFAULTS, Config, ConfigError, load_config
from rlhfkit.core import kl_estimate, logprobs_from_logits
from rlhfkit.models.forward import build_tiny_policy, policy_forward

TOL = 1e-10

# (placement, estimator) -> the divergence whose gradient it is in expectation, as a formula over
# the exact gradients below (PPOConfig.kl_estimator says the same in words); None: no KL's
CLAIMS = {
    ("reward", "k1"): lambda g: g["reverse"],
    ("reward", "k2"): None,
    ("reward", "k3"): lambda g: g["reverse"] - g["forward_per_token"],
    ("loss", "k1"): lambda g: torch.zeros_like(g["reverse"]),  # and refused by the config
    ("loss", "k2"): lambda g: g["reverse_per_token"],
    ("loss", "k3"): lambda g: g["forward_per_token"],
}


def flat_grad(value: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def estimator_gradients(logp: torch.Tensor, ref_logp: torch.Tensor, params) -> dict[tuple[str, str], torch.Tensor]:
    """Expected gradients of every (placement, estimator) over all ``N`` responses of ``R``
    tokens: ``logp``, ``ref_logp`` ``[N, R]`` (the policy's with gradient)."""
    weight = logp.sum(-1).exp().detach()[:, None]  # pi(response), the sample held fixed
    out = {}
    for kind in ("k1", "k2", "k3"):
        k = kl_estimate(logp, ref_logp, kind)  # [N, R]
        out["loss", kind] = flat_grad((weight * k).sum(), params)
        to_go = k.detach().flip(-1).cumsum(-1).flip(-1)  # the penalty still ahead of each token
        out["reward", kind] = flat_grad((weight * to_go * logp).sum(), params)
    return out


def divergence_gradients(logits, ref_logits, logp, ref_logp, params) -> dict[str, torch.Tensor]:
    """Exact gradients of the divergences, from the full distributions ``[N, R, V]``."""
    seq, ref_seq = logp.sum(-1), ref_logp.sum(-1)  # [N] log-probs of whole responses
    lp, rp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    visits = seq.exp().detach()[:, None]  # the probability of each state, held fixed
    return {
        "reverse": flat_grad((seq.exp() * (seq - ref_seq)).sum(), params),
        "forward": flat_grad((ref_seq.exp() * (ref_seq - seq)).sum(), params),
        "reverse_per_token": flat_grad((visits * (lp.exp() * (lp - rp)).sum(-1)).sum(), params),
        "forward_per_token": flat_grad((visits * (rp.exp() * (rp - lp)).sum(-1)).sum(), params),
    }


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def one_token_case():
    """Logits theta over V = 5 tokens at one position; every token is a response."""
    V = 5
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.randn(V, generator=gen, dtype=torch.float64)
    tokens = torch.arange(V)[:, None]  # [N=V, R=1]
    logits, ref_logits = theta.expand(V, 1, V), ref.expand(V, 1, V)
    logp, ref_logp = logprobs_from_logits(logits, tokens), logprobs_from_logits(ref_logits, tokens)
    return logits, ref_logits, logp, ref_logp, [theta]


class _Vocab:
    """What build_tiny_policy reads from a tokenizer."""

    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __len__(self):
        return 6


def two_token_case():
    """A tiny GPT-2 (vocabulary 6) and another as the reference, every 2-token response after a
    one-token prompt (36 responses), through the training forward ``policy_forward``."""
    def tiny(seed):
        model = build_tiny_policy(_Vocab(), seed=seed, n_layer=1, n_head=2, n_embd=8, n_positions=8).double()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # GPT-2's 0.02-std init is nearly uniform; spread the distributions
            for p in model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        return model.eval()

    policy, ref = tiny(1), tiny(2)
    V = len(_Vocab())
    responses = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [36, 2]
    ids = torch.cat([torch.zeros(len(responses), 1, dtype=torch.long), responses], 1)
    mask = torch.ones_like(ids)
    logits, _ = policy_forward(policy, ids, mask, prompt_len=1)  # [36, 2, V]
    with torch.no_grad():
        ref_logits, _ = policy_forward(ref, ids, mask, prompt_len=1)
    logp, ref_logp = logprobs_from_logits(logits, responses), logprobs_from_logits(ref_logits, responses)
    assert abs(logp.sum(-1).exp().sum().item() - 1.0) < 1e-12  # the enumeration is complete
    return logits, ref_logits, logp, ref_logp, list(policy.parameters())


@pytest.fixture(scope="module", params=["one_token", "two_tokens"])
def case(request):
    logits, ref_logits, logp, ref_logp, params = (one_token_case if request.param == "one_token" else two_token_case)()
    return request.param, estimator_gradients(logp, ref_logp, params), divergence_gradients(
        logits, ref_logits, logp, ref_logp, params)


@pytest.mark.parametrize("placement,kind", list(CLAIMS))
def test_expected_gradient_is_the_documented_divergence(case, placement, kind):
    name, est, div = case
    got, claim = est[placement, kind], CLAIMS[placement, kind]
    scale = div["reverse"].abs().max().item()
    assert scale > 0.1, "the policy must be far enough from the reference for the test to mean anything"
    if claim is None:  # k2 in the reward: a biased pull, neither KL's gradient
        for other in ("reverse", "forward", "reverse_per_token", "forward_per_token"):
            assert gap(got, div[other]) > 1e-2 * scale, other
        return
    assert gap(got, claim(div)) < (1e-12 if (placement, kind) == ("loss", "k1") else TOL), (name, placement, kind)


def test_k1_as_a_loss_is_noise_and_k2_k3_pull_on_different_kls(case):
    name, est, div = case
    assert est["loss", "k1"].abs().max().item() < 1e-12 < div["reverse"].abs().max().item()
    # k3 as a loss term does not pull on the reverse KL the objective names
    assert gap(est["loss", "k3"], div["reverse_per_token"]) > 1e-2
    assert gap(est["loss", "k2"], est["loss", "k3"]) > 1e-2
    if name == "one_token":  # one token: the per-token divergences are the divergences
        assert gap(div["reverse_per_token"], div["reverse"]) < TOL
        assert gap(div["forward_per_token"], div["forward"]) < TOL
    else:
        # over a response, a loss term leaves out how the policy moves the later states: only k1
        # in the reward has the whole response's reverse-KL gradient
        assert gap(est["loss", "k2"], div["reverse"]) > 1e-2
        assert gap(est["reward", "k1"], div["reverse"]) < TOL


def test_k3_in_the_reward_barely_pulls_near_the_reference():
    """Close to the reference, reverse and forward KL agree to second order, so k3 in the reward
    (their gradients' difference) pulls with the square of the distance where k1 pulls with it."""
    gen = torch.Generator().manual_seed(1)
    ref, direction = torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    tokens = torch.arange(5)[:, None]
    ratios = []
    for eps in (1e-1, 1e-2):
        theta = (ref + eps * direction).requires_grad_()
        est = estimator_gradients(logprobs_from_logits(theta.expand(5, 1, 5), tokens),
                                  logprobs_from_logits(ref.expand(5, 1, 5), tokens), [theta])
        ratios.append(est["reward", "k3"].norm().item() / est["reward", "k1"].norm().item())
    assert ratios[1] < 0.2 * ratios[0] and ratios[1] < 0.01


def test_k1_as_a_loss_term_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="kl_estimator=k2.*kl_in_loss=false"):
        load_config(overrides=["ppo.kl_in_loss=true"])  # k1, the default estimator
    with pytest.raises(ConfigError, match="zero expected gradient"):
        Config().replace(ppo={"kl_in_loss": True, "kl_estimator": "k1"})
    for kind in ("k2", "k3"):
        assert Config().replace(ppo={"kl_in_loss": True, "kl_estimator": kind}).ppo.kl_in_loss
    for kind in ("k1", "k2", "k3"):  # in the reward every estimator is allowed
        assert Config().replace(ppo={"kl_estimator": kind}).ppo.kl_estimator == kind
    for algo, defaults in ALGO_DEFAULTS.items():  # every command's defaults pass
        Config().replace(ppo=defaults)
        assert not (defaults.get("kl_in_loss") and defaults.get("kl_estimator", "k1") == "k1"), algo


def test_forward_kl_term_defaults():
    """PPO: k1 in the reward plus a k3 loss term of 0.1, 0 with LoRA; the critic-free commands
    (their KL a loss term already) 0; switching the algorithm moves the unset key along."""
    assert Config().ppo.forward_kl_coef == 0.1
    assert load_config(overrides=["model.lora_r=8"]).ppo.forward_kl_coef == 0.0
    for algo in ("grpo", "rloo", "reinforce"):
        assert load_config(overrides=[f"ppo.algo={algo}"]).ppo.forward_kl_coef == 0.0
    assert Config().replace(ppo={"algo": "grpo"}).replace(ppo={"algo": "ppo"}).ppo.forward_kl_coef == 0.1
    assert load_config(overrides=["ppo.forward_kl_coef=0", "model.lora_r=8"]).ppo.forward_kl_coef == 0.0
    assert load_config(overrides=["ppo.forward_kl_coef=0.3", "model.lora_r=8"]).ppo.forward_kl_coef == 0.3
    with pytest.raises(ConfigError, match="ppo.forward_kl_coef"):
        load_config(overrides=["ppo.forward_kl_coef=-0.1"])
