"""The bad-input suite: every kind of bad input a user can hand rlhfkit, through its public
entry points, ends in a clear error or a documented policy -- never a bare traceback and
never a silent NaN.

Each entry of ``BAD_INPUTS`` is one bad input. A CLI case runs ``rlhfkit.cli.main.main([...])``
and expects exit code 2 and a one-line ``rlhfkit CMD: error: ...`` on stderr that names the
input (key, file:line, field, path, function) and says what to do; a Python-API case expects
a specific exception type with such a message; a policy case checks what the documented
policy does (truncate, pad with EOS, penalise and count missing EOS, ...). The count is
``len(BAD_INPUTS)``; the terminal summary prints how many were tried and how many handled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.cli.main import main
from rlhfkit.data import DataError, encode_sft, load_prompts, load_sft
from rlhfkit.models.forward import build_tiny_policy, build_tiny_scalar_model
from rlhfkit.tasks import doubling
from rlhfkit.utils import read_jsonl

BAD_INPUTS: dict[str, Callable] = {}


def case(name: str):
    def register(fn):
        assert name not in BAD_INPUTS, name
        BAD_INPUTS[name] = fn
        return fn

    return register


@pytest.fixture
def env(tmp_path, tiny_models, capsys, monkeypatch, no_plots):
    return SimpleNamespace(tmp=tmp_path, models=tiny_models, capsys=capsys, monkeypatch=monkeypatch)


# --------------------------------------------------------------------------- helpers


def cli_error(env, argv: list[str], *needles: str, code: int = 2) -> str:
    """Run the CLI; expect ``code`` and a one-line error on stderr containing every needle."""
    argv = [*argv, "run.progress=false"] if not any(a.startswith("run.progress") for a in argv) else argv
    if not any(a.startswith("run.out_dir") for a in argv) and argv[0] != "eval":
        argv.append(f"run.out_dir={env.tmp / 'out'}")
    got = main(argv)
    err = env.capsys.readouterr().err
    assert got == code, f"exit {got}, stderr: {err}"
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"rlhfkit {argv[0]}: error: "), err
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def api_error(exc_type, fn, *needles: str) -> str:
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def write(path: Path, lines: list) -> str:
    """JSONL: dicts are dumped, str lines written as they are, bytes appended raw."""
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else ((line if isinstance(line, str) else
                                                           json.dumps(line, ensure_ascii=False)) + "\n").encode())
    return str(path)


SFT_OK = {"prompt": "数字:12x2=", "completion": "24"}
PAIR_OK = {"prompt": "数字:12x2=", "chosen": "24", "rejected": "二四"}


def sft_cli(env, lines, *needles, extra=()):
    data = write(env.tmp / "bad.jsonl", lines)
    return cli_error(env, ["sft", f"model.name={env.models.policy}", f"data.path={data}", *extra], *needles)


def rm_cli(env, lines, *needles, extra=()):
    data = write(env.tmp / "bad.jsonl", lines)
    return cli_error(env, ["rm", f"model.name={env.models.policy}", f"data.path={data}", *extra], *needles)


def tiny_run(env, command: str, *overrides: str) -> int:
    argv = [command, f"run.out_dir={env.tmp / command}", "run.progress=false", "model.n_layer=1", "model.n_head=2",
            "model.n_embd=16", "ppo.steps=1", "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4",
            "ppo.eval_every=0", "ppo.critic_warmup_steps=0", "ppo.stop_at=0", "ppo.group_size=4",
            "sft.steps=2", "sft.batch_size=4", "eval.max_new_tokens=4", *overrides]
    return main(argv)


# --------------------------------------------------------------------------- data files


@case("jsonl_invalid_json")
def _(env):
    sft_cli(env, [SFT_OK, '{"prompt": "x", "completion": '], "bad.jsonl:2", "not valid JSON", "one JSON object")


@case("json_array_invalid_names_the_line_and_column_python_finds")
def _(env):
    text = '[{"prompt": "数字:12x2=", "completion": "24"},\n {"prompt": "数字:1x2=", "completion": "2", "x": [1,]}]\n'
    (env.tmp / "bad.json").write_text(text, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as py:  # the reference: Python's own parser
        json.loads(text)
    assert (py.value.lineno, py.value.colno) == (2, 51)
    cli_error(env, ["sft", f"model.name={env.models.policy}", f"data.path={env.tmp / 'bad.json'}"],
              "bad.json:2: not valid JSON (Expecting value, column 51)", "JSON array")


@case("jsonl_line_not_an_object")
def _(env):
    sft_cli(env, [SFT_OK, "[1, 2, 3]"], "bad.jsonl:2", "expected a JSON object")


@case("jsonl_empty_file")
def _(env):
    sft_cli(env, ["", "   "], "bad.jsonl", "no records")


@case("jsonl_not_utf8")
def _(env):
    sft_cli(env, [SFT_OK, b'{"prompt": "\xff\xfe", "completion": "1"}\n'], "bad.jsonl:2", "not UTF-8",
            "re-encode")


@case("data_path_missing")
def _(env):
    cli_error(env, ["sft", f"model.name={env.models.policy}", f"data.path={env.tmp / 'nope.jsonl'}"],
              "nope.jsonl", "cannot read", "data.path")


@case("data_path_is_a_directory")
def _(env):
    cli_error(env, ["sft", f"model.name={env.models.policy}", f"data.path={env.tmp}"], "cannot read", "data.path")


@case("sft_missing_field")
def _(env):
    sft_cli(env, [SFT_OK, {"prompt": "数字:1x2="}], "bad.jsonl:2", "field 'completion': missing")


@case("sft_mistyped_field")
def _(env):
    sft_cli(env, [SFT_OK, {"prompt": "数字:1x2=", "completion": 2}], "bad.jsonl:2", "field 'completion'",
            "got int 2")


@case("sft_no_known_fields")
def _(env):
    sft_cli(env, [{"question": "a", "answer": "b"}], "bad.jsonl:1", "'prompt' + 'completion'",
            "['answer', 'question']")


@case("sft_empty_prompt")
def _(env):
    sft_cli(env, [SFT_OK, {"prompt": "  ", "completion": "2"}], "bad.jsonl:2", "field 'prompt'", "non-empty")


@case("sft_empty_completion")
def _(env):
    sft_cli(env, [{"prompt": "数字:1x2=", "completion": ""}], "bad.jsonl:1", "field 'completion'", "non-empty")


@case("sft_null_field")
def _(env):
    sft_cli(env, [{"prompt": None, "completion": "2"}], "bad.jsonl:1", "field 'prompt': missing")


@case("pairs_missing_rejected")
def _(env):
    rm_cli(env, [PAIR_OK, {"prompt": "p", "chosen": "a"}], "bad.jsonl:2", "field 'rejected': missing")


@case("pairs_mistyped_chosen")
def _(env):
    rm_cli(env, [PAIR_OK, {**PAIR_OK, "chosen": ["24"]}], "bad.jsonl:2", "field 'chosen'", "expected a string")


@case("pairs_empty_rejected")
def _(env):
    rm_cli(env, [PAIR_OK, {**PAIR_OK, "rejected": " "}], "bad.jsonl:2", "field 'rejected'", "non-empty")


@case("pairs_chosen_equals_rejected")
def _(env):
    rm_cli(env, [PAIR_OK, {**PAIR_OK, "rejected": "24"}], "bad.jsonl:2", "identical to 'chosen'")


@case("pairs_margin_not_a_number")
def _(env):
    rm_cli(env, [{**PAIR_OK, "margin": "big"}, PAIR_OK], "bad.jsonl:1", "field 'margin'", "finite number")


@case("pairs_margin_on_some_records")
def _(env):
    rm_cli(env, [{**PAIR_OK, "margin": 1.0}, PAIR_OK], "bad.jsonl:2", "field 'margin'", "every record or on none")


@case("pairs_too_few")
def _(env):
    rm_cli(env, [PAIR_OK], "bad.jsonl", "1 preference pair", "need at least 2")


@case("chat_record_without_chat_template")
def _(env):
    rm_cli(env, [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
                  "rejected": [{"role": "assistant", "content": "b"}]}], "bad.jsonl:1", "no chat_template",
           "plain-string fields")


@case("chat_message_unknown_role")
def _(env):
    sft_cli(env, [{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "a"}]}],
            "bad.jsonl:1", "unknown role 'human'", "expected one of")


@case("chat_message_missing_content")
def _(env):
    sft_cli(env, [{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}], "bad.jsonl:1",
            "message 0", "missing 'content'")


@case("prompt_longer_than_limit_with_truncation_error")
def _(env):
    sft_cli(env, [SFT_OK, {"prompt": "数字:" + "1" * 40 + "x2=", "completion": "2"}], "bad.jsonl:2",
            "truncation='error'", "max_length=16", "'left' would drop",
            extra=["data.max_length=16", "data.truncation=error"])


@case("prompt_longer_than_limit_is_truncated_from_the_left")  # policy: data.truncation=left (default)
def _(env):
    tok = doubling.make_tokenizer()
    long_prompt = "数字:" + "1" * 40 + "x2="
    rows = encode_sft(load_sft([{"prompt": long_prompt, "completion": "22"}]), tok, max_length=16, truncation="left")
    ids = rows["input_ids"][0][rows["attention_mask"][0].bool()].tolist()
    assert len(ids) == 16 and ids[0] == tok.bos_token_id  # BOS kept, prompt start dropped
    assert tok.decode(ids[-3:]) == "22" + tok.eos_token  # completion and EOS intact
    data = write(env.tmp / "long.jsonl", [{"prompt": long_prompt, "completion": "22"}, SFT_OK])
    assert tiny_run(env, "sft", f"model.name={env.models.policy}", f"data.path={data}", "data.max_length=16") == 0


# a record longer than the model's context (the tiny models: n_positions=32), whatever data.max_*_length says;
# it used to crash after training started (IndexError in the position embedding), even with truncation=error
LONG_PROMPT = "数字:" + "1" * 40 + "x2="  # 46 tokens, 47 with BOS
RL_ARGS = ["reward.function=rlhfkit.tasks.doubling:exact_reward", "ppo.max_new_tokens=8"]


def assert_nothing_trained(env):
    assert not list(env.tmp.glob("**/metrics.jsonl")), "the error came after training started"


@case("rl_prompt_longer_than_the_model_context_with_truncation_error")
def _(env):
    data = write(env.tmp / "p.jsonl", [{"prompt": "数字:12x2="}, {"prompt": LONG_PROMPT}])
    cli_error(env, ["grpo", f"model.name={env.models.policy}", f"data.path={data}", "data.truncation=error", *RL_ARGS],
              "p.jsonl:2: field 'prompt': 47 tokens exceeds the 24 tokens that the model's context of 32 leaves "
              "after ppo.max_new_tokens=8", "data.truncation=left")
    assert_nothing_trained(env)


@case("rl_prompt_longer_than_the_model_context_is_cut_from_the_left")  # policy: data.truncation=left (default)
def _(env):
    data = write(env.tmp / "p.jsonl", [{"prompt": "数字:12x2="}, {"prompt": LONG_PROMPT}])
    for command in ("grpo", "ppo"):
        assert tiny_run(env, command, f"model.name={env.models.policy}", f"data.path={data}", "ppo.value_init=policy",
                        "ppo.steps=2", *RL_ARGS) == 0
        assert len(read_jsonl(env.tmp / command / "metrics.jsonl")) == 2
    assert "are longer than the 24 tokens that the model's context of 32 leaves" in env.capsys.readouterr().err


@case("rl_max_new_tokens_beyond_the_model_context")
def _(env):
    data = write(env.tmp / "p.jsonl", [{"prompt": "数字:12x2="}])
    cli_error(env, ["grpo", f"model.name={env.models.policy}", f"data.path={data}", RL_ARGS[0], "ppo.max_new_tokens=40"],
              "ppo.max_new_tokens=40 leaves no room for a prompt", "context of 32 tokens", "below 32")
    cli_error(env, ["grpo", f"model.name={env.models.policy}", RL_ARGS[0], "ppo.max_new_tokens=25"],  # the task's
              "ppo.max_new_tokens=25 plus the task's longest prompt", "context of 32", "21 or less")
    assert_nothing_trained(env)


LONG_PAIR = {"prompt": LONG_PROMPT, "chosen": "2", "rejected": "3"}


@case("pair_longer_than_the_model_context_with_truncation_error")
def _(env):
    for command in ("dpo", "rm"):
        data = write(env.tmp / "pairs.jsonl", [PAIR_OK, LONG_PAIR, PAIR_OK])
        cli_error(env, [command, f"model.name={env.models.policy}", f"data.path={data}", "data.truncation=error",
                        "data.eval_path=" + write(env.tmp / "held.jsonl", [PAIR_OK])],
                  "pairs.jsonl:2: field 'prompt'", "= 49 tokens exceeds the model's context of 32 tokens",
                  "below data.max_length=512", "'left' would drop the first 17 prompt tokens")
    assert_nothing_trained(env)


@case("pair_longer_than_the_model_context_is_cut_from_the_left")  # policy: data.truncation=left (default)
def _(env):
    data = write(env.tmp / "pairs.jsonl", [PAIR_OK, LONG_PAIR, PAIR_OK, PAIR_OK])
    assert tiny_run(env, "dpo", f"model.name={env.models.policy}", f"data.path={data}", "dpo.steps=2",
                    "dpo.batch_size=2", "dpo.eval_every=0") == 0
    assert tiny_run(env, "rm", f"model.name={env.models.policy}", f"data.path={data}", "reward.steps=2",
                    "reward.batch_size=2") == 0
    assert all(len(read_jsonl(env.tmp / c / "metrics.jsonl")) >= 1 for c in ("dpo", "rm"))


@case("sft_example_longer_than_the_model_context")
def _(env):
    sft_cli(env, [SFT_OK, {"prompt": LONG_PROMPT, "completion": "2"}], "bad.jsonl:2", "exceeds the model's context "
            "of 32 tokens (below data.max_length=512)", extra=["data.truncation=error"])
    assert_nothing_trained(env)
    data = write(env.tmp / "long.jsonl", [SFT_OK, {"prompt": LONG_PROMPT, "completion": "2"}])
    assert tiny_run(env, "sft", f"model.name={env.models.policy}", f"data.path={data}", "data.packing=true") == 0


@case("response_longer_than_limit")
def _(env):
    sft_cli(env, [{"prompt": "数字:1x2=", "completion": "2" * 30}], "bad.jsonl:1", "field 'completion'",
            "never truncated", "raise max_length", extra=["data.max_length=16"])


@case("rl_prompt_empty")
def _(env):
    api_error(DataError, lambda: load_prompts([{"prompt": "ok"}, {"prompt": ""}]), "list[1]", "field 'prompt'",
              "non-empty")


@case("dataset_dict_instead_of_a_split")
def _(env):
    from datasets import Dataset, DatasetDict

    dd = DatasetDict({"train": Dataset.from_list([SFT_OK])})
    api_error(DataError, lambda: load_sft(dd), "DatasetDict", "source['train']")


@case("data_source_of_the_wrong_type")
def _(env):
    api_error(TypeError, lambda: load_sft(42), "JSONL path, a list of dicts or a datasets.Dataset", "int")


# --------------------------------------------------------------------------- configuration


@case("config_unknown_key")
def _(env):
    cli_error(env, ["ppo", "ppo.kl_cof=0.1"], "ppo.kl_cof", "Did you mean 'ppo.kl_coef'")


@case("config_unknown_section")
def _(env):
    cli_error(env, ["ppo", "pppo.steps=3"], "pppo", "Did you mean 'ppo.steps'")


@case("config_ill_typed_int")
def _(env):
    cli_error(env, ["ppo", "ppo.steps=many"], "ppo.steps", "expects int", "'many'")


@case("config_ill_typed_bool")
def _(env):
    cli_error(env, ["ppo", "run.progress=maybe"], "run.progress", "expects bool")


@case("config_float_given_for_int")
def _(env):
    cli_error(env, ["ppo", "ppo.batch_size=8.5"], "ppo.batch_size", "expects int")


@case("config_choice_not_allowed")
def _(env):
    cli_error(env, ["ppo", "ppo.kl_estimator=k4"], "ppo.kl_estimator", "must be one of", "'k3'")


@case("config_override_without_equals")
def _(env):
    cli_error(env, ["ppo", "ppo.steps"], "'ppo.steps'", "section.key=value")


@case("config_zero_batch")
def _(env):
    cli_error(env, ["ppo", "ppo.batch_size=0"], "ppo.batch_size", "must be >= 1, got 0")


@case("config_negative_learning_rate")
def _(env):
    cli_error(env, ["sft", "sft.lr=-1e-3"], "sft.lr", "must be > 0")


@case("config_nan_value")
def _(env):
    cli_error(env, ["ppo", "ppo.kl_coef=.nan"], "ppo.kl_coef", "finite number")


@case("config_master_weights_without_bfloat16")
def _(env):
    cli_error(env, ["grpo", "model.master_weights=true"], "model.master_weights", "model.dtype=bfloat16")


@case("config_master_weights_with_lora")
def _(env):
    cli_error(env, ["grpo", "model.master_weights=true", "model.dtype=bfloat16", "model.lora_r=8"],
              "model.master_weights", "LoRA", "float32 already")


@case("master_weights_in_the_reward_model_command")
def _(env):
    cli_error(env, ["rm", f"model.name={env.models.policy}", "model.master_weights=true", "model.dtype=bfloat16"],
              "model.master_weights is supported by ppo, grpo, rloo, reinforce, sft and dpo")


@case("config_probability_out_of_range")
def _(env):
    cli_error(env, ["ppo", "ppo.gamma=1.5"], "ppo.gamma", "between 0 and 1")


@case("config_inconsistent_model_shape")
def _(env):
    cli_error(env, ["pretrain", "model.n_embd=30", "model.n_head=4"], "model.n_embd", "multiple of model.n_head")


@case("config_group_size_does_not_divide_batch")
def _(env):
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=rlhfkit.tasks.doubling:exact_reward",
                    "ppo.batch_size=6", "ppo.group_size=4"], "ppo.batch_size (6)", "multiple of ppo.group_size (4)")


@case("config_file_missing")
def _(env):
    cli_error(env, ["ppo", "--config", str(env.tmp / "nope.yaml")], "nope.yaml", "does not exist")


@case("config_file_invalid_yaml")
def _(env):
    (env.tmp / "bad.yaml").write_text("ppo: {steps: [1, 2\n")
    cli_error(env, ["ppo", "--config", str(env.tmp / "bad.yaml")], "bad.yaml", "not valid YAML")


@case("config_file_not_a_mapping")
def _(env):
    (env.tmp / "list.yaml").write_text("- ppo\n- steps\n")
    cli_error(env, ["ppo", "--config", str(env.tmp / "list.yaml")], "list.yaml", "mapping of sections")


@case("config_file_unknown_key")
def _(env):
    (env.tmp / "typo.yaml").write_text("ppo:\n  minibach_size: 8\n")
    cli_error(env, ["ppo", "--config", str(env.tmp / "typo.yaml")], "ppo.minibach_size",
              "Did you mean 'ppo.minibatch_size'")


@case("config_cuda_without_a_gpu")
def _(env):
    env.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cli_error(env, ["pretrain", "run.device=cuda"], "run.device=cuda", "run.device=cpu")


@case("config_value_init_reward_without_reward_model")
def _(env):
    # policy: with reward functions alone, value_init=reward (the default) starts the critic from the policy
    out = env.tmp / "out"
    assert main(["ppo", f"model.name={env.models.policy}", "reward.function=rlhfkit.tasks.doubling:exact_reward",
                 "ppo.value_init=reward", "ppo.steps=1", "ppo.batch_size=8", "ppo.minibatch_size=4",
                 "ppo.max_new_tokens=3", "ppo.eval_every=0", "ppo.critic_warmup_steps=0", "run.progress=false",
                 f"run.out_dir={out}"]) == 0
    assert (out / "value_model" / "config.json").exists()


# --------------------------------------------------------------------------- models and tokenizers


@case("model_path_missing")
def _(env):
    cli_error(env, ["ppo", f"model.name={env.tmp / 'no' / 'policy'}", f"reward.name={env.models.reward}"],
              "no/policy", "does not exist", "model.name", "save_pretrained")


@case("relative_model_path_missing_fails_at_once")
def _(env):
    # 'runs/nope' has a hub id's form, but runs/ is a local directory: a missing run, not a hub repository
    import time

    env.monkeypatch.chdir(env.tmp)
    (env.tmp / "runs").mkdir()
    t0 = time.perf_counter()
    cli_error(env, ["grpo", "model.name=runs/nope", "reward.function=rlhfkit.tasks.doubling:exact_reward",
                    "run.out_dir=out"], "'runs/nope' does not exist", f"runs{os.sep} is a local directory")
    assert time.perf_counter() - t0 < 2.0  # the hub's retries took 51 s
    cli_error(env, ["eval", "runs/nope"], "no model found at runs/nope")
    from rlhfkit.models.forward import local_path_reason

    assert local_path_reason("org/name") is None and local_path_reason("gpt2") is None  # hub ids stay hub ids
    assert all(local_path_reason(p) for p in ("./m", "../m", "~/m", "/abs/m", "a/b/c", "m/"))


@case("lora_target_module_the_model_does_not_have")
def _(env):
    # peft wraps the names it finds and silently drops the others: every command that builds an
    # adapter (policy, reward model, critic) stops instead, listing the names the model has
    bad = ["model.lora_r=2", "model.lora_target_modules=c_attn,c_atn"]
    reward = "reward.function=rlhfkit.tasks.doubling:exact_reward"
    needles = ("model.lora_target_modules names c_atn", "which this model does not have",
               "name some of c_attn, c_fc, c_proj, ", "wpe, wte, or use 'all-linear'")  # lm_head but in rm
    for argv in (["sft"], ["rm"], ["dpo"], ["grpo", reward], ["ppo", reward, "value.lora=true"]):
        cli_error(env, [argv[0], f"model.name={env.models.policy}", *bad, *argv[1:]], *needles)
    # a LoRA critic (value.lora) goes through the same check; its scalar head is never a target
    from rlhfkit.models.forward import add_lora

    critic = build_tiny_scalar_model(doubling.make_tokenizer(), 1, n_layer=1, n_head=2, n_embd=16)
    api_error(ValueError, lambda: add_lora(critic, 2, 4.0, target_modules="c_attn,c_atn", trainable_head=True),
              "names c_atn", "name some of c_attn, c_fc, c_proj, wpe, wte, or use")


@case("reward_model_path_missing")
def _(env):
    cli_error(env, ["ppo", f"model.name={env.models.policy}", f"reward.name={env.tmp / 'no_rm'}"], "no_rm",
              "does not exist")


@case("model_path_is_an_empty_directory")
def _(env):
    (env.tmp / "empty").mkdir()
    cli_error(env, ["dpo", f"model.name={env.tmp / 'empty'}"], "empty", "without tokenizer_config.json",
              "save_pretrained")


@case("model_directory_without_weights")
def _(env):
    import shutil

    shutil.copytree(env.models.policy, env.tmp / "noweights")
    (env.tmp / "noweights" / "model.safetensors").unlink()
    cli_error(env, ["sft", f"model.name={env.tmp / 'noweights'}", f"data.path={write(env.tmp / 'd.jsonl', [SFT_OK])}"],
              "cannot load the policy model", "noweights", "model.safetensors")


@case("model_with_pickle_weights_only")
def _(env):
    import shutil

    from safetensors.torch import load_file

    legacy = env.tmp / "legacy"
    shutil.copytree(env.models.policy, legacy)
    torch.save(load_file(str(legacy / "model.safetensors")), legacy / "pytorch_model.bin")
    (legacy / "model.safetensors").unlink()
    cli_error(env, ["eval", str(legacy), f"run.out_dir={env.tmp / 'ev'}"], "legacy", "pickle-based weights",
              "save_pretrained")


@case("eval_path_missing")
def _(env):
    cli_error(env, ["eval", str(env.tmp / "nothing")], "nothing", "config.json")


@case("sft_model_missing")
def _(env):
    cli_error(env, ["sft", f"model.name={env.tmp / 'gone'}", f"data.path={write(env.tmp / 'd.jsonl', [SFT_OK])}"],
              "gone", "does not exist")


@case("rm_model_missing")
def _(env):
    cli_error(env, ["rm", f"model.name={env.tmp / 'gone'}"], "gone", "does not exist")


@case("no_model_given")
def _(env):
    cli_error(env, ["ppo"], "model.name=PATH", "reward.name=PATH")


@case("sft_without_model")
def _(env):
    # without data.path SFT uses the task's demonstrations; without a model it cannot start
    cli_error(env, ["sft", "data.path=x.jsonl"], "model.name=PATH")


@case("rm_from_policy_without_a_policy")
def _(env):
    cli_error(env, ["rm"], "model.name=PATH", "reward.init_from=scratch")


@case("classifier_reward_from_scratch")
def _(env):
    cli_error(env, ["rm", "reward.kind=classifier", "reward.init_from=scratch"], "reward.kind=classifier",
              "reward.init_from=policy")


def _no_pad_copy(env) -> str:
    import shutil

    path = env.tmp / "nopad"
    shutil.copytree(env.models.policy, path)
    tok = doubling.make_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(path)
    return str(path)


@case("tokenizer_without_pad_token_rl")
def _(env):
    cli_error(env, ["ppo", f"model.name={_no_pad_copy(env)}", f"reward.name={env.models.reward}"], "nopad",
              "no pad token", "tok.pad_token = tok.eos_token")


@case("tokenizer_without_pad_token_dpo")
def _(env):
    cli_error(env, ["dpo", f"model.name={_no_pad_copy(env)}"], "no pad token", "tok.save_pretrained")


@case("tokenizer_without_pad_token_sft_pads_with_eos")  # policy: SFT rows are padded with EOS, masked out
def _(env):
    data = write(env.tmp / "d.jsonl", [SFT_OK, {"prompt": "__:7x2=", "completion": "14"}])
    assert tiny_run(env, "sft", f"model.name={_no_pad_copy(env)}", f"data.path={data}") == 0
    assert read_jsonl(env.tmp / "sft" / "metrics.jsonl")[-1]["sft/loss"] is not None  # finite (null if NaN)


# --------------------------------------------------------------------------- reward functions and scores

N_CALLS: list[int] = []


def short_reward(prompts, completions, **meta):
    return [1.0] * (len(completions) - 1)


def nan_reward(prompts, completions, **meta):
    return [float("nan") if i == 2 else 0.0 for i in range(len(completions))]


def inf_reward(prompts, completions, **meta):
    return [float("-inf")] + [0.0] * (len(completions) - 1)


def text_reward(prompts, completions, **meta):
    return ["good" for _ in completions]


def scalar_reward(prompts, completions, **meta):
    return 1.0


def nested_reward(prompts, completions, **meta):
    return [[1.0, 0.0] for _ in completions]


def constant_reward(prompts, completions, **meta):
    return [0.5] * len(completions)


def reward_cli(env, fn: str, *needles):
    return cli_error(env, ["grpo", f"model.name={env.models.policy}", f"reward.function=test_bad_inputs:{fn}",
                           "ppo.batch_size=8", "ppo.group_size=4", "ppo.max_new_tokens=3"],
                     "reward function test_bad_inputs:" + fn, *needles)


def no_extra_arguments(prompts, completions):
    return [0.0] * len(completions)


def needs_solution(completions, solution, **columns):
    return [0.0] * len(completions)


@case("reward_function_that_cannot_take_its_arguments")
def _(env):
    # checked before any model loads: the missing model directory is never reached
    data = write(env.tmp / "p.jsonl", [{"prompt": "数字:12x2=", "answer": "24"}])
    for fn, needle in (("no_extra_arguments", "got an unexpected keyword argument 'completion_ids'"),
                       ("needs_solution", "missing a required argument: 'solution'")):
        cli_error(env, ["grpo", f"model.name={env.tmp / 'no_model'}", f"reward.function=test_bad_inputs:{fn}",
                        f"data.path={data}", "ppo.max_new_tokens=4"],
                  f"reward function test_bad_inputs:{fn} cannot take the arguments",
                  "the data's columns (answer)", needle, "take **kwargs")
    # the built-in task's columns: number and charset
    cli_error(env, ["grpo", f"model.name={env.tmp / 'no_model'}", "reward.function=test_bad_inputs:needs_solution"],
              "the data's columns (number, charset)", "missing a required argument: 'solution'")
    # from Python too, before the models load
    import rlhfkit
    from rlhfkit.config import Config
    from rlhfkit.rollout.rewards import RewardError

    cfg = Config().replace(model={"name": str(env.tmp / "no_model")}, reward={"function": no_extra_arguments},
                           run={"out_dir": str(env.tmp / "api")})
    api_error(RewardError, lambda: rlhfkit.grpo(cfg), "test_bad_inputs:no_extra_arguments cannot take the arguments")


@case("reward_function_wrong_length")
def _(env):
    reward_cli(env, "short_reward", "returned 7 scores", "for 8 completions", "one per completion")


@case("reward_function_returns_nan")
def _(env):
    reward_cli(env, "nan_reward", "1 non-finite score(s)", "nan for", "finite score")


@case("reward_function_returns_inf")
def _(env):
    reward_cli(env, "inf_reward", "non-finite", "-inf for")


@case("reward_function_returns_strings")
def _(env):
    reward_cli(env, "text_reward", "not numbers", "list of 8 floats")


@case("reward_function_returns_a_scalar")
def _(env):
    reward_cli(env, "scalar_reward", "returned float", "not numbers")


@case("reward_function_returns_nested_lists")
def _(env):
    reward_cli(env, "nested_reward", "16 scores (shape (8, 2))", "for 8 completions")


@case("reward_function_spec_without_colon")
def _(env):
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=rlhfkit.tasks.doubling.exact_reward"],
              "reward.function=", "'package.module:function'")


@case("reward_function_module_missing")
def _(env):
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=no_such_module:score"],
              "no_such_module:score", "cannot be loaded")


@case("run_dir_holding_an_earlier_run")
def _(env):
    out = env.tmp / "earlier"
    out.mkdir()
    files = {"config.yaml": "run: {}\n", "metrics.jsonl": '{"step": 0}\n', "samples.jsonl": '{"step": 0}\n'}
    for name, text in files.items():
        (out / name).write_text(text)
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=rlhfkit.tasks.doubling:exact_reward",
                    f"run.out_dir={out}"], "holds an earlier run", "--resume", "run.overwrite=true")
    assert {p.name: p.read_text() for p in out.iterdir()} == files  # untouched


@case("stop_metric_the_run_does_not_log")
def _(env):
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=rlhfkit.tasks.doubling:exact_reward",
                    "ppo.stop_metric=eval/acuracy", "eval.max_new_tokens=2"],
              "ppo.stop_metric='eval/acuracy' is not logged", "eval/exact_acc")
    assert not (env.tmp / "out").exists()


@case("reward_function_not_callable")
def _(env):
    cli_error(env, ["grpo", f"model.name={env.models.policy}", "reward.function=math:pi"], "math:pi",
              "not callable")


@case("reward_model_outputs_nan")
def _(env):
    tok = doubling.make_tokenizer()
    rm = build_tiny_scalar_model(tok, 1, n_layer=1, n_head=2, n_embd=16)
    with torch.no_grad():
        rm.score.weight[0, 0] = float("nan")
    rm.save_pretrained(env.tmp / "nan_rm")
    tok.save_pretrained(env.tmp / "nan_rm")
    cli_error(env, ["ppo", f"model.name={env.models.policy}", f"reward.name={env.tmp / 'nan_rm'}",
                    "ppo.batch_size=8", "ppo.max_new_tokens=3", "ppo.value_init=policy"],
              "non-finite scores to 8 of 8 responses", "reward.name")


# --------------------------------------------------------------------------- batches and responses


@case("all_masked_batch_in_a_reduction")
def _(env):
    from rlhfkit.core import masked_mean, masked_whiten, policy_loss

    x, empty = torch.randn(3, 4), torch.zeros(3, 4)
    api_error(ValueError, lambda: masked_mean(x, empty), "empty mask", "response_mask")
    api_error(ValueError, lambda: masked_whiten(x, empty), "empty mask")
    api_error(ValueError, lambda: policy_loss(x, x, x, empty), "empty mask")


@case("response_row_without_valid_token")
def _(env):
    from rlhfkit.core import shaped_rewards

    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    api_error(ValueError, lambda: shaped_rewards(torch.ones(2), torch.zeros(2, 3), mask, 0.1),
              "a response has no valid token")


@case("sft_batch_without_target_tokens")
def _(env):
    from rlhfkit.models.forward import masked_lm_loss

    tok = doubling.make_tokenizer()
    model = build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16)
    ids = torch.tensor([[tok.bos_token_id, 5, 6, tok.eos_token_id]])
    api_error(ValueError, lambda: masked_lm_loss(model, ids, torch.ones_like(ids), torch.zeros_like(ids)),
              "no target token", "data.completion_only")


@case("single_valid_token_gives_zero_not_nan")  # policy: variance 0, whitened 0
def _(env):
    from rlhfkit.core import masked_var, masked_whiten

    x, one = torch.tensor([[3.0, float("nan")]]), torch.tensor([[1, 0]])
    assert masked_var(x, one).item() == 0.0
    assert torch.equal(masked_whiten(x, one), torch.zeros(1, 2))


@case("responses_that_never_emit_eos")  # policy: scored at the last token, penalised, counted in eos_rate
def _(env):
    # a policy that cannot emit EOS: every hidden state is the same vector h, and the EOS row of the
    # LM head is -100 h, so EOS has probability ~e^-100 at every step
    tok = doubling.make_tokenizer()
    policy = build_tiny_policy(tok, 0, n_layer=1, n_head=2, n_embd=16)
    with torch.no_grad():
        policy.transformer.ln_f.weight.zero_()
        policy.transformer.ln_f.bias.copy_(torch.linspace(-1, 1, 16))
        policy.lm_head.weight[tok.eos_token_id] = -100 * policy.transformer.ln_f.bias
    policy.save_pretrained(env.tmp / "no_eos")
    tok.save_pretrained(env.tmp / "no_eos")
    assert tiny_run(env, "ppo", f"model.name={env.tmp / 'no_eos'}", "reward.function=test_bad_inputs:constant_reward",
                    "ppo.value_init=policy", "ppo.missing_eos_penalty=1.5", "ppo.normalize_reward=false",
                    "ppo.steps=2") == 0
    rows = read_jsonl(env.tmp / "ppo" / "metrics.jsonl")
    assert all(r["response/eos_rate"] == 0.0 and r["response/length"] == 4.0 for r in rows)
    assert all(r["objective/score"] == 0.5 for r in rows)  # the raw score is logged as given
    samples = read_jsonl(env.tmp / "ppo" / "samples.jsonl")
    assert samples and all(s["score"] == 0.5 - 1.5 for s in samples)  # the penalty is applied to every one
    assert all(v is not None for r in rows for k, v in r.items() if k.startswith(("policy/", "value/")))


# --------------------------------------------------------------------------- the suite


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input(name, env):
    BAD_INPUTS[name](env)


def test_the_suite_is_big_enough():
    assert len(BAD_INPUTS) >= 50, len(BAD_INPUTS)


def test_every_range_names_a_config_key_and_the_defaults_pass():
    from rlhfkit.config import POSITIVE, RANGES, Config, ConfigError, from_dict

    cfg = Config()
    for key in [*RANGES, *POSITIVE]:
        sec, name = key.split(".")
        assert hasattr(getattr(cfg, sec), name), f"RANGES names {key}, which Config does not have"
    assert set(POSITIVE) <= set(RANGES)
    assert from_dict(cfg.to_dict()) == cfg  # every default is inside its range
    with pytest.raises(ConfigError, match="must be >= 1, got -3"):
        cfg.replace(ppo={"steps": -3})  # replace() validates too, not just the CLI
