"""Tools in multi-turn episodes (rlhfkit.envs.tools): calls parsed from the model's turn, run with a
time limit and no network, results returned as tool messages through the chat template."""

from __future__ import annotations

import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhfkit.data.prompts import PromptRecord
from rlhfkit.envs.environment import Episode, play
from rlhfkit.envs.tools import ToolCall, ToolEnvironment, call_tool, parse_tool_call
from rlhfkit.rollout.generate import Rollout

# a ChatML template that renders `tools` (as Qwen's and Hermes' do) and one that ignores them (SmolLM2's)
WITH_TOOLS = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
              "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WITHOUT_TOOLS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) that encodes any text, with ChatML's
    special tokens; built in memory."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    return fast


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def fetch(url: str) -> str:
    """Open a connection.

    Args:
        url: where
    """
    import urllib.request

    return urllib.request.urlopen(url, timeout=1).read().decode()


class Calculator(ToolEnvironment):
    tools = (multiply,)
    tool_timeout = 2.0
    max_turns, max_tokens = 3, 4096

    def reset(self, record):
        self.want = record.columns["product"]
        return [{"role": "user", "content": record.text}]

    def reward(self, text):
        return 1.0 if text.strip() == str(self.want) else 0.0


def test_a_tool_call_is_parsed_from_the_turn():
    assert parse_tool_call('ok <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>') == \
        ToolCall("multiply", {"a": 3, "b": 4})
    assert parse_tool_call("12") is None
    assert parse_tool_call("<tool_call>{name: 1}</tool_call>").startswith("error: the tool call is not valid JSON")
    assert parse_tool_call('<tool_call>["multiply"]</tool_call>').startswith("error: a tool call is")


def test_a_tool_runs_with_a_time_limit_and_no_network():
    assert call_tool([multiply], ToolCall("multiply", {"a": 123, "b": 456}), 5) == "56088"
    assert call_tool([multiply], ToolCall("multiply", {"a": 1}), 5) == \
        "TypeError: multiply() missing 1 required positional argument: 'b'"
    assert call_tool([multiply], ToolCall("divide", {}), 5) == "error: no tool named 'divide'; the tools are multiply"
    t0 = time.perf_counter()
    assert call_tool([slow], ToolCall("slow", {"seconds": 30}), 0.3) == "TimeoutError: slow ran over 0.3 s"
    assert time.perf_counter() - t0 < 5
    out = call_tool([fetch], ToolCall("fetch", {"url": "http://127.0.0.1:9/"}), 5)
    assert "tools run without network access" in out


def scripted(tok, turns: list[list[str]]):
    """A sampler that answers turn t of row i with ``turns[i][t]`` and EOS (log-probs 0)."""

    def sample(turn, ids, mask, rows, n):
        resp = [tok(turns[i][turn], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for i in rows]
        R = max(len(r) for r in resp)
        ids = torch.tensor([r + [tok.pad_token_id] * (R - len(r)) for r in resp])
        m = torch.tensor([[1] * len(r) + [0] * (R - len(r)) for r in resp])
        return Rollout(prompt_ids=ids, prompt_mask=m, response_ids=ids, response_mask=m,
                       logprobs=torch.zeros(ids.shape), finished=torch.ones(len(rows), dtype=torch.bool),
                       entropy=torch.zeros(ids.shape))

    return sample


def test_a_tool_episode_is_the_template_rendering_of_the_conversation_token_for_token():
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}</tool_call>'
    for template in (WITH_TOOLS, WITHOUT_TOOLS):
        tok = byte_tokenizer(template)
        record = PromptRecord("What is 123 * 456?", {"product": 56088})
        ep = Episode(Calculator(), record, tok, 3, 4096)
        roll = play([ep], scripted(tok, [[call, "56088"]]), tok, 100, torch.device("cpu"))
        tool_msg = {"role": "tool", "name": "multiply", "content": "56088"}
        assert ep.messages[-3:] == [{"role": "assistant", "content": call}, tool_msg,
                                    {"role": "assistant", "content": "56088"}]
        assert ep.turns == 2 and ep.env_done and roll.turn_rewards.sum() == 1.0
        # the sequence is what the template renders for the whole conversation (this one is
        # append-only), the tools offered in its own way, up to the last EOS
        rendered = tok.apply_chat_template(ep.messages, tools=ep.tools, tokenize=False)
        assert tok.decode(ep.ids) + "\n" == rendered
        assert ('"name": "multiply"' in rendered) and ("Tools:" in rendered) == (template == WITH_TOOLS)
        # the model's two turns are the mask's, the tool message (and the template's headers) are not
        model = tok.decode([t for t, m in zip(roll.response_ids[0].tolist(), roll.response_mask[0].tolist()) if m])
        assert model == call + "<|im_end|>56088<|im_end|>"
