"""rlhfkit chat: prompts rendered by the tokenizer's chat template (or plain text without one),
history, the /commands and end of input; scripted, no terminal needed (the tmux-driven check on a
trained model is in test_e2e.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
from peft import AutoPeftModelForCausalLM

from hf_helpers import chat_tokenizer, save_tiny
from rlhfkit.cli.chat import ChatSession, run_chat
from rlhfkit.cli.main import main
from rlhfkit.config import Config
from rlhfkit.models.forward import build_tiny_policy, load_policy
from rlhfkit.rollout.generate import generate
from rlhfkit.tasks.doubling import make_tokenizer


def scripted(lines):
    """A ``read`` that returns the lines in turn, then raises EOFError like ``input`` at Ctrl-D."""
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_templated_chat_renders_the_conversation_and_answers_greedily(tmp_path):
    tok = chat_tokenizer()
    path = save_tiny(tmp_path / "qwen3", "qwen3", tok, seed=4)
    cfg = Config().replace(run={"device": "cpu"}, chat={"max_new_tokens": 5, "system": "Be brief."})
    session = ChatSession(path, cfg)
    assert session.templated
    first = session.reply("Where is Pune?")
    # the model saw exactly the template's rendering, and answered what greedy decoding gives
    want_text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhere is Pune?<|im_end|>\n"
                 "<|im_start|>assistant\n")
    ids = torch.tensor([tok(want_text)["input_ids"]])
    out = generate(session.model, ids, torch.ones_like(ids), 5, tok.eos_token_id, tok.pad_token_id, greedy=True)
    n = int(out.response_mask.sum())
    assert first == tok.decode(out.response_ids[0, :n].tolist(), skip_special_tokens=True)
    # the next turn carries the first exchange
    assert session.history == [{"role": "user", "content": "Where is Pune?"},
                               {"role": "assistant", "content": first}]
    rendered = tok.decode(session._prompt_ids("And Lyon?"))
    assert rendered == (want_text + first + "<|im_end|>\n<|im_start|>user\nAnd Lyon?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    session.reset()
    assert tok.decode(session._prompt_ids("And Lyon?")).count("<|im_start|>user") == 1


def test_loop_handles_reset_quit_and_end_of_input(tmp_path):
    path = save_tiny(tmp_path / "llama", "llama", chat_tokenizer(), seed=5)
    cfg = Config().replace(run={"device": "cpu"}, chat={"max_new_tokens": 3})
    written = []
    assert run_chat(path, cfg, scripted(["hi", "", "/reset", "again", "/quit", "never read"]), written.append) == 2
    assert written[0].startswith("chatting with") and "(conversation cleared)" in written
    assert run_chat(path, cfg, scripted(["hi"]), written.append) == 1  # EOF after one line ends the loop


def test_commands_are_never_sent_to_the_model(tmp_path):
    path = save_tiny(tmp_path / "llama", "llama", chat_tokenizer(), seed=5)
    cfg = Config().replace(run={"device": "cpu"}, chat={"max_new_tokens": 3})
    written = []
    lines = ["/help", "hi", "/CLEAR", "/frobnicate now", "//etc is a path", "/exit", "never read"]
    assert run_chat(path, cfg, scripted(lines), written.append) == 2  # 'hi' and '/etc is a path' answered
    listing = written[1]  # the commands, listed at start and by /help
    assert all(name in listing for name in ("/help", "/reset", "/clear", "/quit", "/exit")) and written[2] == listing
    assert written[4] == "(conversation cleared)"
    assert written[5].startswith("(unknown command /frobnicate, not sent to the model;") and listing in written[5]
    assert len(written) == 7  # the reply to '//etc ...', then /exit left without reading on
    session = ChatSession(path, cfg)  # what '//etc is a path' sent: the line less one slash
    assert session.reply("/etc is a path") == written[6]


def test_plain_prompt_without_a_template_and_sampling(tmp_path):
    tok = make_tokenizer()  # the doubling task's tokenizer: no chat template, BOS added
    policy = build_tiny_policy(tok, seed=0, n_layer=1, n_head=2, n_embd=16)
    policy.save_pretrained(tmp_path / "p")
    tok.save_pretrained(tmp_path / "p")
    greedy = ChatSession(str(tmp_path / "p"), Config().replace(run={"device": "cpu"}))
    assert not greedy.templated and greedy._prompt_ids("数字:1234x2=") == tok("数字:1234x2=")["input_ids"]
    # the reply never runs past the model's 32 positions, whatever chat.max_new_tokens says
    assert len(tok(greedy.reply("数字:1234x2="))["input_ids"]) <= 32
    sampled = [ChatSession(str(tmp_path / "p"), Config().replace(run={"device": "cpu", "seed": s},
                                                                 chat={"greedy": False, "temperature": 2.0}))
               for s in (0, 0, 1)]
    answers = [s.reply("数字:1234x2=") for s in sampled]
    assert answers[0] == answers[1] and answers[0] != answers[2]  # seeded sampling


def test_a_line_the_tokenizer_cannot_encode_is_named_and_the_chat_goes_on(tmp_path):
    tok = make_tokenizer()  # the doubling task's character vocabulary: no 'h', no unknown token
    build_tiny_policy(tok, seed=0, n_layer=1, n_head=2, n_embd=16).save_pretrained(tmp_path / "p")
    tok.save_pretrained(tmp_path / "p")
    written = []
    cfg = Config().replace(run={"device": "cpu"}, chat={"max_new_tokens": 3})
    assert run_chat(str(tmp_path / "p"), cfg, scripted(["hi 数字", "数字:1234x2="]), written.append) == 1
    assert written[2] == ("(cannot encode this input: characters the tokenizer cannot encode: 'h', 'i', ' '; "
                          "type another line)")
    assert len(written) == 5 and written[4] == ""  # then the reply to the next line, and the newline at EOF


def test_a_lora_adapter_trained_on_a_relative_base_loads_from_any_directory(tiny_models, tmp_path, monkeypatch,
                                                                              capsys):
    train, elsewhere = tmp_path / "train", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copytree(tiny_models.policy, train / "base")
    monkeypatch.chdir(train)
    assert main(["sft", "model.name=base", "model.lora_r=4", "run.out_dir=run", "run.progress=false",
                 "sft.steps=1", "sft.batch_size=2"]) == 0
    capsys.readouterr()  # the SFT run's own lines
    adapter = train / "run" / "policy_adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert saved == str((train / "base").resolve())  # the base as an absolute path, not 'base'
    monkeypatch.chdir(elsewhere)
    ids = torch.tensor([[1, 5, 6, 7]])
    merged = load_policy(str(train / "run" / "policy"))(ids).logits
    torch.testing.assert_close(load_policy(str(adapter))(ids).logits, merged)  # adapter + base = the merged policy
    torch.testing.assert_close(AutoPeftModelForCausalLM.from_pretrained(adapter)(ids).logits, merged)  # peft's own
    done = subprocess.run([sys.executable, "-m", "rlhfkit", "chat", str(adapter), "run.device=cpu",
                           "chat.max_new_tokens=3"], input="数字:1234x2=\n/quit\n", capture_output=True, text=True,
                          cwd=elsewhere, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0 and "chatting with" in done.stdout, done.stderr
    # the base moved away: one line naming where it was looked for and the fix, exit code 2
    (train / "base").rename(train / "moved")
    assert main(["chat", str(adapter), "run.device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rlhfkit chat: error: the base model of the LoRA adapter {adapter} is not at "
                   f"{saved!r} (base_model_name_or_path in {adapter / 'adapter_config.json'}): give "
                   "the base with model.name=PATH_OR_HUB_ID, or put it back at that path (the merged model, a run's "
                   "policy/ beside its policy_adapter/, loads without a base)")
    cfg = Config().replace(run={"device": "cpu"}, model={"name": str(train / "moved")})  # the fix it names
    torch.testing.assert_close(ChatSession(str(adapter), cfg).model(ids).logits, merged)
