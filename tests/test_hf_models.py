"""Real Hugging Face architectures (GPT-2, Llama, Qwen2, Qwen3), built tiny and saved locally, loaded
through the path a hub id takes; dtype, gradient checkpointing, reward models with their own
tokenizer, and LoRA (reference = adapter off, one copy of the base, merged export)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings

import pytest
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_helpers import bpe_tokenizer, chat_tokenizer, save_tiny
from rlhfkit.accel import forward as lean
from rlhfkit.cli.main import main
from rlhfkit.config import Config
from rlhfkit.core import logprobs_from_logits
from rlhfkit.models.forward import (
    ARCHS,
    AdapterDisabled,
    add_lora,
    enable_gradient_checkpointing,
    eval_mode,
    load_policy,
    load_scalar_model,
    load_tokenizer,
    policy_forward,
    same_tokenizer,
    save_policy,
    sequence_scores,
)
from rlhfkit.rollout.generate import Rollout, generate
from rlhfkit.rollout.rewards import other_tokenizer, reward_model_scorer
from rlhfkit.trainers.common import warn_lossy_updates
from rlhfkit.trainers.reward import train_reward_model
from rlhfkit.trainers.rl import train_rl
from rlhfkit.trainers.rl_setup import build_models
from rlhfkit.utils import read_jsonl

PROMPTS = ["数字:1234x2=", "Where is Pune?", "大写:77x2="]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Directories standing in for hub checkpoints: one policy per architecture (a character-level
    chat tokenizer; for Qwen2, which transformers always reads as a byte-level BPE, a BPE one
    with the same chat markup), a Qwen3 reward model sharing the character tokenizer, and a
    Llama reward model with a plain BPE tokenizer."""
    root = tmp_path_factory.mktemp("hub")
    tok, bpe = chat_tokenizer(), bpe_tokenizer()
    paths = {arch: save_tiny(root / arch, arch, bpe_tokenizer(chat=True) if arch == "qwen2" else tok, seed=i)
             for i, arch in enumerate(ARCHS)}
    paths["rm"] = save_tiny(root / "rm", "qwen3", tok, seed=10, scalar=True)
    paths["bpe_rm"] = save_tiny(root / "bpe_rm", "llama", bpe, seed=11, scalar=True)
    return paths


def scramble(model, seed: int = 0, scale: float = 0.3):
    """Large random weights: the 0.02-std init makes outputs near-constant, hiding position bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)
    return model.eval()


def left_padded(tok, texts):
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def tiny_rl_config(tmp_path, **sections) -> Config:
    base = {"run": {"out_dir": str(tmp_path), "progress": False, "seed": 0}, "accel": {"threads": 1},
            "ppo": {"steps": 2, "batch_size": 8, "minibatch_size": 4, "group_size": 4, "critic_warmup_steps": 0,
                    "max_new_tokens": 6, "eval_every": 0, "stop_at": 0.0}}
    for sec, vals in sections.items():
        base.setdefault(sec, {}).update(vals)
    return Config().replace(**base)


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_loads_and_reads_responses_like_its_own_forward(hub, arch):
    tok = load_tokenizer(hub[arch])
    model = scramble(load_policy(hub[arch]), seed=1)
    assert model.config.model_type == arch
    assert type(model) is AutoModelForCausalLM._model_mapping[type(model.config)]  # what a hub id of it loads
    ids, mask = left_padded(tok, [p + "6420" for p in PROMPTS])
    P = ids.shape[1] - 4
    with torch.no_grad():
        ours, _ = policy_forward(model, ids, mask, P)  # [B, 4, V] through the backbone
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        theirs = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        # left padding changes nothing: each row alone gives the same response log-probs
        lp = logprobs_from_logits(ours, ids[:, P:])
        for i, text in enumerate(PROMPTS):
            one = tok(text + "6420", return_tensors="pt")["input_ids"]
            alone, _ = policy_forward(model, one, torch.ones_like(one), one.shape[1] - 4)
            torch.testing.assert_close(lp[i], logprobs_from_logits(alone, one[:, -4:])[0], atol=1e-5, rtol=1e-5)


def test_dtype_selection(hub, tmp_path):
    assert all(p.dtype == torch.bfloat16 for p in load_policy(hub["qwen3"], "bfloat16").parameters())
    assert all(p.dtype == torch.float32 for p in load_policy(hub["qwen3"], "auto").parameters())
    load_policy(hub["qwen3"], "bfloat16").save_pretrained(tmp_path / "bf16")
    assert all(p.dtype == torch.bfloat16 for p in load_policy(str(tmp_path / "bf16"), "auto").parameters())
    rm = load_scalar_model(hub["rm"], "float16")
    assert all(p.dtype == torch.float16 for p in rm.parameters())
    with pytest.raises(Exception, match="model.dtype"):
        Config().replace(model={"dtype": "float8"})


def test_gradient_checkpointing_gives_the_same_gradients_and_rollouts(hub):
    tok = load_tokenizer(hub["qwen3"])
    plain = scramble(load_policy(hub["qwen3"]), seed=2).train()
    ckpt = enable_gradient_checkpointing(scramble(load_policy(hub["qwen3"]), seed=2)).train()
    ids, mask = left_padded(tok, [p + "12" for p in PROMPTS])
    grads = []
    for model in (plain, ckpt):
        logits, _ = policy_forward(model, ids, mask, ids.shape[1] - 2)
        logprobs_from_logits(logits, ids[:, -2:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    pids, pmask = left_padded(tok, PROMPTS)
    with eval_mode(ckpt):  # the way train_rl samples: checkpointed layers keep their KV cache
        a = generate(ckpt, pids, pmask, 6, tok.eos_token_id, tok.pad_token_id, greedy=True)
    b = generate(plain.eval(), pids, pmask, 6, tok.eos_token_id, tok.pad_token_id, greedy=True)
    assert ckpt.training and torch.equal(a.response_ids, b.response_ids)


@pytest.mark.parametrize("arch,algo", [("gpt2", "ppo"), ("llama", "grpo"), ("qwen2", "ppo"), ("qwen3", "grpo")])
def test_rl_steps_on_real_architectures(hub, tmp_path, arch, algo):
    # the Qwen2 policy's tokenizer differs from the reward model's: it is scored on re-tokenised text
    # and its separate critic starts from the policy (a critic reads the policy's tokens); GPT-2's
    # PPO runs the defaults, a value head on the policy
    ppo = {"algo": algo, **({"value_init": "policy"} if arch == "qwen2" else {})}
    cfg = tiny_rl_config(tmp_path, model={"name": hub[arch]}, reward={"name": hub["rm"]}, ppo=ppo)
    result = train_rl(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert result["steps"] == 2 and len(rows) == 2
    for row in rows:
        assert row["policy/logprob_gap"] < 1e-4  # sampling and training forwards agree
        assert all(v is not None and math.isfinite(v) for v in row.values())
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert saved.config.model_type == arch


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_forward_uses_no_deprecated_library_api(hub, tmp_path, arch):
    """A rollout and an update on the models' own forward (accel.enabled=off, as the suite runs)
    of every tiny architecture: no DeprecationWarning or FutureWarning from transformers, peft or
    accelerate, nor from rlhfkit's own calls into them (a warning raised for its caller)."""
    cfg = tiny_rl_config(tmp_path, model={"name": hub[arch]}, reward={"name": hub["rm"]},
                         ppo={"algo": "grpo", "steps": 1}, accel={"enabled": "off"})
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            # torch's module call: where transformers' decorator attributes a deprecated argument of a forward
            warnings.filterwarnings("error", category=category,
                                    module=r"(transformers|peft|accelerate|rlhfkit|torch\.nn\.modules\.module)\b")
        assert train_rl(cfg)["steps"] == 1


def test_tokenizers_compare_by_vocabulary_and_specials(hub):
    tok = load_tokenizer(hub["qwen3"])
    assert same_tokenizer(tok, chat_tokenizer()) and not same_tokenizer(tok, bpe_tokenizer())
    assert same_tokenizer(tok, load_tokenizer(hub["llama"]))
    assert other_tokenizer(hub["rm"], tok) is None  # same vocabulary: ids are read as they are
    assert other_tokenizer(hub["bpe_rm"], tok) is not None
    assert other_tokenizer(hub["qwen2"], tok) is not None
    # the same vocabulary with another pre-tokeniser is another tokenizer
    regrouped = chat_tokenizer()
    regrouped.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert regrouped.get_vocab() == tok.get_vocab() and not same_tokenizer(tok, regrouped)


def test_reward_model_with_its_own_tokenizer_scores_the_decoded_text(hub):
    tok = load_tokenizer(hub["qwen3"])
    rm_tok = other_tokenizer(hub["bpe_rm"], tok)
    rm = scramble(load_scalar_model(hub["bpe_rm"]), seed=3)
    responses, finished = ["2468", " Pune is in India.", "壹伍肆"], [True, False, True]
    # a rollout in the policy's vocabulary: left-padded prompts, responses + EOS where finished, pad after
    pids, pmask = left_padded(tok, PROMPTS)
    rows = [tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if f else [])
            for r, f in zip(responses, finished)]
    R = max(map(len, rows))
    rids = torch.tensor([r + [tok.pad_token_id] * (R - len(r)) for r in rows])
    rmask = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in rows])
    roll = Rollout(pids, pmask, rids, rmask, torch.zeros(rids.shape), torch.tensor(finished))
    with torch.no_grad():
        got = reward_model_scorer(rm, tok, rm_tok)(roll)
        for i, (p, r, f) in enumerate(zip(PROMPTS, responses, finished)):  # each text alone, RM's own vocabulary
            ids = rm_tok(p + r + ("</s>" if f else ""), return_tensors="pt")["input_ids"]
            assert ids[0, 0] == rm_tok.bos_token_id and (ids[0, -1] == rm_tok.eos_token_id) == f
            want = sequence_scores(rm, ids, torch.ones_like(ids))[0]
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_ppo_with_a_reward_model_of_another_tokenizer(hub, tmp_path):
    cfg = tiny_rl_config(tmp_path, model={"name": hub["qwen2"]}, reward={"name": hub["bpe_rm"]},
                         ppo={"value_init": "policy", "steps": 1})
    train_rl(cfg)
    assert math.isfinite(read_jsonl(tmp_path / "metrics.jsonl")[0]["objective/score"])
    # the critic reads the policy's tokens: starting it from that reward model is refused
    with pytest.raises(ValueError, match="different tokenizer"):
        build_models(cfg.replace(ppo={"value_init": "reward"}), hub["qwen2"], torch.device("cpu"))


def test_value_name_chooses_the_critic_checkpoint(hub, tmp_path):
    # the reward model has another tokenizer; value.name starts the critic from a checkpoint that
    # shares the policy's, whatever ppo.value_init says
    cfg = tiny_rl_config(tmp_path, model={"name": hub["qwen3"]}, reward={"name": hub["bpe_rm"]},
                         value={"name": hub["rm"]})
    ac, _, _, _ = build_models(cfg, hub["qwen3"], torch.device("cpu"))
    want = load_scalar_model(hub["rm"]).state_dict()
    got = ac.critic.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _bytes(params) -> int:
    """Bytes of parameter storage, each storage counted once however many modules share it."""
    seen = {}
    for p in params:
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def test_lora_reference_is_the_base_with_the_adapter_off_held_once(hub, tmp_path):
    cfg = tiny_rl_config(tmp_path, model={"name": hub["qwen3"], "lora_r": 4, "lora_target_modules": "q_proj,v_proj"},
                         reward={"function": "rlhfkit.tasks.doubling:format_reward"},
                         ppo={"algo": "grpo"})
    cpu = torch.device("cpu")
    ac, ref, _, _ = build_models(cfg, hub["qwen3"], cpu)
    full_ac, full_ref, _, _ = build_models(cfg.replace(model={"lora_r": 0}), hub["qwen3"], cpu)
    base = _bytes(load_policy(hub["qwen3"]).parameters())
    trainable = [p for p in ac.policy.parameters() if p.requires_grad]
    # q_proj and v_proj in 2 layers, r = 4: A [4, 32] + B [out, 4] with out 32 (q) and 16 (v, 2 kv heads x 8)
    assert sum(p.numel() for p in trainable) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert isinstance(ref, AdapterDisabled)
    lora_total = _bytes(list(ac.policy.parameters()) + list(ref.parameters()))
    full_total = _bytes(list(full_ac.policy.parameters()) + list(full_ref.parameters()))
    assert lora_total == base + _bytes(trainable)  # the reference adds nothing
    assert full_total == 2 * base
    print(f"\nLoRA policy + reference: {lora_total} B (base {base} B + adapter {_bytes(trainable)} B); "
          f"full fine-tuning policy + reference: {full_total} B")
    # with a non-zero adapter the policy moves, and the reference is exactly the base model
    with torch.no_grad():
        for p in trainable:
            p.normal_(0, 0.5)
    tok = load_tokenizer(hub["qwen3"])
    ids, mask = left_padded(tok, [p + "88" for p in PROMPTS])
    P = ids.shape[1] - 2
    with torch.no_grad():
        ref_logits, _ = policy_forward(ref, ids, mask, P)
        base_logits, _ = policy_forward(load_policy(hub["qwen3"]), ids, mask, P)
        pol_logits, _ = policy_forward(ac.policy, ids, mask, P)
    torch.testing.assert_close(ref_logits, base_logits, atol=1e-6, rtol=0)
    assert (pol_logits - base_logits).abs().max() > 1e-3
    assert ac.policy.training  # the reference forward left the policy in train mode


def test_lora_merged_export_loads_in_plain_transformers_with_identical_logits(hub, tmp_path):
    tok = load_tokenizer(hub["qwen3"])
    model = add_lora(load_policy(hub["qwen3"]), r=4, alpha=8)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    ids, mask = left_padded(tok, PROMPTS)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    save_policy(model, tok, tmp_path / "merged", tmp_path / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # transformers alone
    assert not any("lora" in n for n, _ in plain.named_parameters())
    from_adapter = load_policy(str(tmp_path / "adapter"))  # base + adapter, merged on load
    with torch.no_grad():
        got = plain(input_ids=ids, attention_mask=mask).logits
        got_adapter = from_adapter(input_ids=ids, attention_mask=mask).logits
    diff = (got - want).abs().max().item()
    print(f"\nmerged export vs LoRA model: max |logit diff| = {diff:.2e}")
    assert diff < 1e-5
    torch.testing.assert_close(got_adapter, got, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])  # nn.Linear, and Conv1D (fan_in_fan_out)
def test_lora_export_from_a_gathered_state_dict_equals_peft_merge(hub, tmp_path, arch):
    """What FSDP's save does: the adapter and the merged weights written from a full state dict
    (peft's key names) equal peft's own save and ``merge_and_unload``, and the model is left as it was."""
    import copy

    from safetensors.torch import load_file

    tok = load_tokenizer(hub[arch])
    model = add_lora(load_policy(hub[arch]), r=4, alpha=8)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_policy(copy.deepcopy(model), tok, tmp_path / "peft_merged", tmp_path / "peft_adapter")
    save_policy(model, tok, tmp_path / "merged", tmp_path / "adapter", state_dict=gathered)
    assert any("lora_A" in n for n, _ in model.named_parameters())  # not merged in place
    for ours, theirs in (("merged", "peft_merged"), ("adapter", "peft_adapter")):
        name = "model.safetensors" if ours == "merged" else "adapter_model.safetensors"
        got, want = load_file(tmp_path / ours / name), load_file(tmp_path / theirs / name)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6, msg=k)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in plain.named_parameters())


def test_lora_ppo_run_on_qwen3(hub, tmp_path):
    """LoRA on the policy and on a critic started from the reward model; a few PPO steps."""
    cfg = tiny_rl_config(tmp_path, model={"name": hub["qwen3"], "lora_r": 8, "lora_alpha": 16},
                         reward={"name": hub["rm"]}, value={"lora": True}, ppo={"steps": 3, "lr": 1e-2})
    train_rl(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3 and rows[0]["objective/kl"] == 0.0  # policy == adapter-off reference at the start
    # the adapter moved the policy away from the base (a k1 estimate over a batch may be of either sign)
    assert rows[-1]["objective/kl"] != 0.0
    assert all(math.isfinite(r["value/loss"]) for r in rows)
    for rel in ("policy/model.safetensors", "policy_adapter/adapter_model.safetensors", "value_model/config.json"):
        assert (tmp_path / rel).exists(), rel
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "value_model")  # merged, plain
    assert not any("lora" in n for n, _ in critic.named_parameters())
    # eval works on the run directory, the merged policy and the adapter directory alike
    results = []
    for target in (tmp_path, tmp_path / "policy_adapter"):
        out = tmp_path / f"eval_{len(results)}"
        assert main(["eval", str(target), f"run.out_dir={out}", "eval.max_new_tokens=4"]) == 0
        results.append(json.loads((out / "eval.json").read_text()))
    assert results[0]["examples"] == results[1]["examples"]


def test_lora_grpo_on_a_bfloat16_base(hub, tmp_path, accel_on):
    """``model.dtype=bfloat16`` with LoRA, the set-up the config recommends for large models: peft
    keeps the adapters in float32 beside the bfloat16 base, and so does the accelerated forward
    the rollout and the update run (folding an adapter into a bfloat16 weight would round its
    update away); the adapter trains in float32."""
    cfg = tiny_rl_config(tmp_path, model={"name": hub["llama"], "dtype": "bfloat16", "lora_r": 8, "lora_alpha": 16},
                         reward={"name": hub["rm"]}, ppo={"algo": "grpo", "steps": 3, "lr": 1e-2},
                         accel={"enabled": "on"})
    ac, _, _, _ = build_models(cfg, hub["llama"], torch.device("cpu"))
    dtypes = {n.split(".")[-2] if "lora_" in n else "base": p.dtype for n, p in ac.policy.named_parameters()}
    assert dtypes == {"base": torch.bfloat16, "default": torch.float32}
    assert lean.supported(ac.policy)  # the lean forward for the policy ...
    with ac.policy.disable_adapter():
        assert lean.supported(ac.policy)  # ... and for the reference, the base alone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_rl(cfg)
    assert not [w for w in caught if "rounds to nothing" in str(w.message)]  # the float32 adapter is what trains
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    # policy == reference at the start (B = 0: the adapters add exactly nothing, up to the bfloat16
    # rounding of the sum); then the float32 adapter moves the bfloat16 policy
    assert len(rows) == 3 and abs(rows[0]["objective/kl"]) < 1e-3
    assert rows[-1]["objective/kl"] > 1e-2
    for row in rows:
        assert all(v is not None and math.isfinite(v) for v in row.values())
        assert row["policy/logprob_gap"] < 0.5  # bfloat16 rounding between sampling and training forwards


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_in_the_optimizer_warn_and_the_bound_is_right(dtype):
    """Training half-precision weights in place warns, naming the magnitude above which a step of
    about ``lr`` rounds away; torch's own AdamW confirms the bound on both sides of it."""
    lr = 1e-5
    w = torch.nn.Parameter(torch.tensor([1e-4, 1e-3, 0.1, 1.0], dtype=dtype))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    with pytest.warns(RuntimeWarning, match="rounds to nothing") as record:
        warn_lossy_updates(opt)
    bound = float(str(record[0].message).split("above about ")[1].split(" ")[0])
    assert bound == pytest.approx(2 * lr / torch.finfo(dtype).eps, rel=0.05)
    before = w.detach().clone()
    w.grad = torch.ones_like(w)
    opt.step()  # AdamW's first step moves each weight by about lr
    moved = w.detach() != before
    assert moved[before.abs() < bound / 4].all() and not moved[before.abs() > 4 * bound].any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_lossy_updates(torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=lr))  # float32: silent


def test_full_fine_tuning_in_bfloat16_warns(hub, tmp_path):
    cfg = tiny_rl_config(tmp_path, model={"name": hub["llama"], "dtype": "bfloat16"}, reward={"name": hub["rm"]},
                         ppo={"algo": "grpo", "steps": 1})
    with pytest.warns(RuntimeWarning, match="trainable weights are bfloat16 .* rounds to nothing"):
        train_rl(cfg)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_master_weights_run_the_bfloat16_models_arithmetic_on_float32_weights(hub, arch):
    """``model.master_weights``: under :func:`~rlhfkit.models.precision.compute_weights` a float32
    model computes what the same model in bfloat16 computes, bit for bit -- the update's
    log-probs and entropies (the models' own forward) and
    every weight's gradient, which reaches the float32 weight unrounded (a bfloat16 value in
    float32) -- and its own float32 parameters are back after the block."""
    from rlhfkit.models.forward import token_logprobs
    from rlhfkit.models.precision import compute_weights, keep_master_weights

    tok = load_tokenizer(hub[arch])
    master = scramble(load_policy(hub[arch]), seed=2, scale=0.05).train()
    half = copy.deepcopy(master)
    for p in half.parameters():  # the weights alone, as from_pretrained(dtype=bfloat16) loads them (the
        p.data = p.data.to(torch.bfloat16)  # rotary tables stay float32 buffers there)
    keep_master_weights(master)
    before = dict(master.named_parameters())
    ids, mask = left_padded(tok, [p + "6420" for p in PROMPTS])
    P = ids.shape[1] - 4
    outs = []
    for model, ctx in ((half, contextlib.nullcontext()), (master, compute_weights(master))):
        with ctx:
            lp, ent, _ = token_logprobs(model, ids, mask, P, ids[:, P:], entropy=True)
        (lp.float().sum() + 0.1 * ent.float().sum()).backward()
        outs.append((lp, ent, {n: p.grad for n, p in model.named_parameters()}))
    (lp_h, ent_h, g_h), (lp_m, ent_m, g_m) = outs
    assert torch.equal(lp_m, lp_h) and torch.equal(ent_m, ent_h)
    assert g_m.keys() == g_h.keys() and all(g_m[n] is not None for n in g_m)
    for n, g in g_m.items():
        assert g.dtype == torch.float32 and torch.equal(g, g_h[n].float()), n
    after = dict(master.named_parameters())
    assert all(after[n] is before[n] and p.dtype == torch.float32 for n, p in after.items())


def test_master_weights_grpo_samples_as_bfloat16_and_keeps_the_small_steps(hub, tmp_path):
    """A GRPO run at ``model.dtype=bfloat16 model.master_weights=true`` against one at
    ``model.dtype=bfloat16``: before any update both sample the same completions with the same
    log-probs (the rollout, the reference and the update's forward all run the bfloat16
    copies); then at ``lr`` 1e-5 the float32 master weights keep nearly every step, where the
    bfloat16 weights round most of them away, and the saved policy is float32."""
    from safetensors.torch import load_file

    runs = {}
    for name, extra in (("half", {}), ("master", {"master_weights": True})):
        cfg = tiny_rl_config(tmp_path / name, model={"name": hub["llama"], "dtype": "bfloat16", **extra},
                             reward={"name": hub["rm"]}, ppo={"algo": "grpo", "steps": 2, "lr": 1e-5})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_rl(cfg)
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl"), [str(w.message) for w in caught]
    (half, half_warned), (master, master_warned) = runs["half"], runs["master"]
    assert any("rounds to nothing" in w for w in half_warned) and not any("rounds to nothing" in w
                                                                           for w in master_warned)
    for k in ("objective/score", "objective/kl", "objective/entropy", "response/length"):
        assert master[0][k] == half[0][k], k
    assert master[0]["objective/kl"] == 0.0  # the reference is the bfloat16 load: the copies at the start
    start = load_file(f"{hub['llama']}/model.safetensors")
    moved = {}
    for name, cast in (("half", torch.bfloat16), ("master", torch.float32)):
        end = load_file(tmp_path / name / "policy" / "model.safetensors")
        assert {t.dtype for t in end.values()} == {cast}
        mats = [k for k in start if start[k].ndim == 2]
        moved[name] = sum((end[k] != start[k].to(cast)).float().mean().item() for k in mats) / len(mats)
    assert moved["master"] > 0.9 and moved["half"] < 0.3, moved


@pytest.mark.parametrize(("epochs", "held_out"), [(1, True), (2, True), (1, False)])
def test_master_weights_copies_only_for_blocks_that_run_the_policy(hub, tmp_path, monkeypatch, epochs, held_out):
    """GRPO at ``model.master_weights=true`` makes the policy's bfloat16 copies once a block that
    runs it: each rollout, each experience pass (the sampler's bfloat16 log-probs are not the
    training forward's), each minibatch of the update and each evaluation (before the first step
    and after the last); a prompts file with nothing held out evaluates nothing and makes none there."""
    from rlhfkit.models import precision
    from rlhfkit.trainers import rl

    blocks, phase = [], {"now": "other"}
    marked = precision._marked

    def spy_marked(models):
        roots = marked(models)
        if roots:
            blocks.append(phase["now"])
        return roots

    def timed(fn, during, after):  # the phase while ``fn`` runs and once it has returned
        def wrapper(*args, **kwargs):
            phase["now"] = during
            try:
                return fn(*args, **kwargs)
            finally:
                phase["now"] = after
        return wrapper

    monkeypatch.setattr(precision, "_marked", spy_marked)
    monkeypatch.setattr(rl, "rollout", timed(rl.rollout, "rollout", "experience"))  # the pass right after it
    monkeypatch.setattr(rl, "ppo_update", timed(rl.ppo_update, "update", "other"))
    monkeypatch.setattr(rl, "evaluate", timed(rl.evaluate, "evaluate", "other"))
    data = {}
    if not held_out:  # the built-in task holds out prompts; a file with eval_fraction 0 does not
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2), encoding="utf-8")
        data = {"path": str(prompts), "eval_fraction": 0.0}
    cfg = tiny_rl_config(tmp_path, model={"name": hub["llama"], "dtype": "bfloat16", "master_weights": True},
                         reward={"name": hub["rm"]}, data=data,
                         ppo={"algo": "grpo", "steps": 2, "ppo_epochs": epochs, "minibatch_size": 8})
    train_rl(cfg)
    assert {p: blocks.count(p) for p in ("rollout", "experience", "update", "evaluate", "other")} == {
        "rollout": 2, "experience": 2, "update": 2 * epochs,
        "evaluate": 2 if held_out else 0, "other": 0}


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_master_weights_in_sft_and_dpo(hub, tmp_path, command):
    """SFT and DPO at ``model.master_weights=true``: the first step's loss (SFT) or policy
    log-probs (DPO, whose margin to the bfloat16 reference is then 0) are the bfloat16 run's,
    the same bfloat16 forward; and at ``lr`` 1e-5 the float32 weights keep the steps that
    bfloat16 weights round away; the saved policy is float32."""
    from safetensors.torch import load_file

    from rlhfkit.trainers.dpo import train_dpo
    from rlhfkit.trainers.sft import train_sft

    train = {"sft": train_sft, "dpo": train_dpo}[command]
    key = {"sft": "sft/loss", "dpo": "logps/chosen"}[command]
    start = load_file(f"{hub['llama']}/model.safetensors")
    mats = [k for k in start if start[k].ndim == 2]
    first, moved = {}, {}
    for name, extra, cast in (("half", {}, torch.bfloat16), ("master", {"master_weights": True}, torch.float32)):
        out = tmp_path / name
        cfg = Config().replace(run={"out_dir": str(out), "progress": False, "seed": 0}, accel={"threads": 1},
                               model={"name": hub["llama"], "dtype": "bfloat16", **extra},
                               sft={"steps": 2, "batch_size": 4, "lr": 1e-5, "warmup_steps": 0},
                               dpo={"steps": 2, "batch_size": 4, "num_pairs": 16, "lr": 1e-5, "eval_every": 0})
        train(cfg)
        row = read_jsonl(out / "metrics.jsonl")[0]
        first[name] = row[key]
        assert command == "sft" or row["dpo/margin"] == 0.0  # the policy's copies are the reference's weights
        end = load_file(out / "policy" / "model.safetensors")
        assert {t.dtype for t in end.values()} == {cast}
        moved[name] = sum((end[k] != start[k].to(cast)).float().mean().item() for k in mats) / len(mats)
    assert first["master"] == first["half"]
    assert moved["master"] > 0.9 and moved["half"] < 0.3, moved


def test_reward_model_with_lora_saves_a_plain_merged_classifier(hub, tmp_path):
    cfg = Config().replace(run={"out_dir": str(tmp_path), "progress": False}, accel={"threads": 1},
                           model={"name": hub["qwen3"], "lora_r": 4},
                           reward={"steps": 2, "batch_size": 8, "eval_pairs": 16, "lr": 1e-2})
    result = train_reward_model(cfg)
    rm = AutoModelForSequenceClassification.from_pretrained(result["path"])  # transformers alone
    assert rm.config.num_labels == 1 and not any("lora" in n for n, _ in rm.named_parameters())
    base = load_policy(hub["qwen3"]).state_dict()
    merged = rm.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])  # the trained adapter is in the merged weights
    for k in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):  # no adapter there
        assert torch.equal(merged[k], base[k])
