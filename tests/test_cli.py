"""The command line as a newcomer meets it: errors answered at once and in one line (the
traceback on request), help that lists every key, the resolved config printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from rlhfkit.cli.main import COMMAND_SECTIONS, DEFAULT_OUT, _defaults, first_sentence, main
from rlhfkit.config import ConfigError, key_docs, key_types
from rlhfkit.rollout.rewards import RewardError


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfkit", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_a_mistyped_key_is_answered_before_torch_is_imported():
    run_cli("ppo", "ppo.kl_cof=1")  # warm the file cache: the timing below is the command's own
    t0 = time.perf_counter()
    done = run_cli("ppo", "ppo.kl_cof=1")
    seconds = time.perf_counter() - t0
    assert done.returncode == 2 and "ppo.kl_cof" in done.stderr
    assert seconds < 2.0, f"a config error took {seconds:.2f} s"  # ~0.2 s; importing torch alone takes seconds
    code = ("import sys\nfrom rlhfkit.cli.main import main\n"
            "assert main(['ppo', 'ppo.kl_cof=1']) == 2\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules)\n"
            "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout


def multiline_boom(prompts, completions, **columns):
    raise ValueError("first line\nsecond line")


@pytest.fixture
def fast_rl(tiny_models, tmp_path, no_plots):
    """CLI arguments of a two-step GRPO run on the tiny models."""
    return ["grpo", f"model.name={tiny_models.policy}", f"run.out_dir={tmp_path / 'run'}", "run.progress=false",
            "ppo.steps=2", "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4", "ppo.eval_every=0",
            "ppo.stop_at=0"]


def test_an_anticipated_error_is_one_line_and_exit_code_2(fast_rl, capsys, monkeypatch):
    monkeypatch.delenv("RLHFKIT_DEBUG", raising=False)
    assert main([*fast_rl, "reward.function=test_cli:multiline_boom"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("rlhfkit grpo: error: reward function test_cli:multiline_boom raised ValueError: first line "
                       "second line")
    assert not any("Traceback" in line for line in err)
    assert main(["eval", "no/such/dir/policy"]) == 2  # FileNotFoundError
    assert capsys.readouterr().err.startswith("rlhfkit eval: error: no model found at no/such/dir/policy")


def test_debug_flag_or_environment_gives_the_full_traceback(fast_rl, capsys, monkeypatch):
    monkeypatch.delenv("RLHFKIT_DEBUG", raising=False)
    for argv in (["--debug", "ppo", "ppo.kl_cof=1"], ["ppo", "ppo.kl_cof=1", "--debug"]):
        with pytest.raises(ConfigError, match="ppo.kl_cof"):
            main(argv)
    with pytest.raises(RewardError, match="multiline_boom") as info:
        main(["--debug", *fast_rl, "reward.function=test_cli:multiline_boom"])
    assert isinstance(info.value.__cause__, ValueError)  # the user's own exception is chained
    with pytest.raises(FileNotFoundError):
        main(["eval", "no/such/dir/policy", "--debug"])
    monkeypatch.setenv("RLHFKIT_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["ppo", "ppo.kl_cof=1"])
    monkeypatch.setenv("RLHFKIT_DEBUG", "0")
    assert main(["ppo", "ppo.kl_cof=1"]) == 2
    done = run_cli("ppo", "ppo.kl_cof=1", env={**os.environ, "RLHFKIT_DEBUG": "1"})
    assert done.returncode != 0 and "Traceback (most recent call last)" in done.stderr
    assert "rlhfkit.config.ConfigError: unknown config key 'ppo.kl_cof'" in done.stderr


def test_sft_on_a_file_with_characters_outside_the_vocabulary(tiny_models, tmp_path, capsys):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "数字:1234x2=", "completion": "2468"}\n'
                    '{"prompt": "hello 数字:12x2=", "completion": "24"}\n', encoding="utf-8")
    assert main(["sft", f"model.name={tiny_models.policy}", f"data.path={path}", f"run.out_dir={tmp_path / 'run'}",
                 "run.progress=false", "sft.steps=1", "sft.batch_size=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlhfkit sft: error: {path}:2: field 'prompt': characters the tokenizer cannot encode: "
                          "'h', 'e', 'l', 'o', ' '")


@pytest.mark.parametrize("command", list(COMMAND_SECTIONS))
def test_help_lists_every_key_the_command_reads(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps: compare with whitespace collapsed
    assert f"Writes to {DEFAULT_OUT[command]}/" in out
    defaults, docs, types = _defaults(command).to_dict(), key_docs(), key_types()
    listed = set()
    for entry in COMMAND_SECTIONS[command]:
        sec, _, only = entry.partition(".")
        for key in [only] if only else docs[sec]:
            listed.add(f"{sec}.{key}")
            assert f"{sec}.{key}: {types[sec][key]} = {defaults[sec][key]!r} {first_sentence(docs[sec][key])}" in out
    others = {f"{sec}.{key}:" for sec in docs for key in docs[sec] if f"{sec}.{key}" not in listed}
    assert not [k for k in others if f" {k} " in out]  # nothing the command does not read


def test_help_shows_the_commands_own_defaults_and_types(capsys):
    with pytest.raises(SystemExit):
        main(["grpo", "-h"])
    out = capsys.readouterr().out
    assert "  ppo.kl_coef: float = 0.3\n      beta, the weight of the KL penalty (TRL's beta).\n" in out
    assert "  ppo.kl_estimator: 'k1' | 'k2' | 'k3' = 'k3'\n" in out  # grpo's ALGO_DEFAULTS, Literal choices
    assert "  run.out_dir: str = 'runs/grpo'\n" in out
    assert "  ppo.max_new_tokens: int | None = None\n" in out
    assert "  reward.function: str | callable | list of (str | callable) = ''\n" in out
    assert "sft.steps" not in out


def test_every_config_key_has_a_description():
    docs, types = key_docs(), key_types()
    assert set(docs) == set(types)
    for sec in types:
        missing = set(types[sec]) - set(docs[sec])
        assert not missing, f"keys without a docstring under them in rlhfkit.config: {sorted(missing)} ({sec})"


def test_first_sentence_keeps_abbreviations_and_brackets():
    assert first_sentence("Comma-separated names (e.g. 'q_proj,v_proj'), or 'all'. More.") == \
        "Comma-separated names (e.g. 'q_proj,v_proj'), or 'all'."
    assert first_sentence("A task ('a' or \"Where?\" -> \"x.\", seeds 0/3).\n  Second.") == \
        "A task ('a' or \"Where?\" -> \"x.\", seeds 0/3)."
    assert first_sentence("No period") == "No period"


def test_print_config_shows_the_resolved_config_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("ppo:\n  steps: 7\n  batch_size: 16\n")
    assert main(["grpo", "--print-config", "--config", "my.yaml", "run.task=cities", "ppo.steps=3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["ppo"]["algo"] == "grpo" and cfg["ppo"]["kl_coef"] == 0.3  # the command's ALGO_DEFAULTS
    assert cfg["ppo"]["lr"] == 1e-4 and cfg["model"]["n_layer"] == 3  # the cities task's CONFIG_DEFAULTS
    assert cfg["ppo"]["batch_size"] == 16 and cfg["ppo"]["steps"] == 3  # the file, then the override
    assert cfg["run"]["out_dir"] == "runs/grpo"
    assert list(tmp_path.iterdir()) == [tmp_path / "my.yaml"]  # nothing ran, nothing written
    assert main(["gridworld", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["gridworld"]["algo"] == "reinforce"


def test_an_unknown_key_suggests_the_full_dotted_key(capsys):
    assert main(["ppo", "ppo.step=3"]) == 2
    assert capsys.readouterr().err.strip() == "rlhfkit ppo: error: unknown config key 'ppo.step'. Did you mean 'ppo.steps'?"
    assert main(["sft", "steps=3"]) == 2  # no section: the keys of that name, the command's sections first
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhfkit sft: error: unknown config key 'steps': keys are written section.key. "
                          "Did you mean sft.steps, pretrain.steps, reward.steps, ppo.steps, dpo.steps")
    assert main(["ppo", "ppo.beta=0.1"]) == 2  # TRL's name, not dpo.beta: the ppo section's KL weight
    assert "unknown config key 'ppo.beta'. TRL's beta is ppo.kl_coef here: " in capsys.readouterr().err


def test_ppo_with_a_reward_function_alone_starts_the_critic_from_the_policy(tiny_models, tiny_config, tmp_path,
                                                                             capsys, no_plots):
    import torch

    from rlhfkit.trainers.rl_setup import build_models

    common = [f"model.name={tiny_models.policy}", "reward.function=rlhfkit.tasks.doubling:exact_reward",
              "run.progress=false", "ppo.steps=2", "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.max_new_tokens=4",
              "ppo.eval_every=0", "ppo.stop_at=0", "ppo.critic_warmup_steps=1"]
    # the defaults: a value head on the policy, saved beside it
    assert main(["ppo", *common, f"run.out_dir={tmp_path / 'head'}"]) == 0, capsys.readouterr().err
    assert (tmp_path / "head" / "value_head.safetensors").exists() and not (tmp_path / "head" / "value_model").exists()
    # a separate critic, with no reward model to start from: the policy's backbone
    out = tmp_path / "run"
    assert main(["ppo", *common, f"run.out_dir={out}", "ppo.value_model=separate"]) == 0, capsys.readouterr().err
    assert (out / "value_model" / "config.json").exists()
    cfg = tiny_config(tmp_path / "api", model={"name": tiny_models.policy},
                      reward={"function": "rlhfkit.tasks.doubling:exact_reward"}, ppo={"value_model": "separate"})
    assert cfg.ppo.value_init is None and not cfg.reward.name
    ac = build_models(cfg, tiny_models.policy, torch.device("cpu"))[0]
    critic, policy = ac.critic.state_dict(), ac.policy.state_dict()
    shared = [k for k in critic if k.startswith("transformer.")]
    assert shared and all(torch.equal(critic[k], policy[k]) for k in shared)  # the policy's backbone


def 奖励(prompts, completions, **columns):  # a reward function named as its author writes
    return [1.0] * len(completions)


def test_json_for_people_keeps_non_ascii_text_readable(tiny_models, fast_rl, tmp_path, capsys):
    assert main(["eval", tiny_models.policy, f"run.out_dir={tmp_path / 'eval'}", "eval.max_new_tokens=4"]) == 0
    printed = capsys.readouterr().out
    saved = (tmp_path / "eval" / "eval.json").read_text(encoding="utf-8")
    for text in (printed, saved):
        assert '"prompt": "数字:' in text or '"prompt": "小写:' in text or '"prompt": "大写:' in text
        assert "\\u" not in text  # no escapes
    assert json.loads(printed) == json.loads(saved)
    assert main([*fast_rl, "reward.function=test_cli:奖励"]) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8")
    assert '"reward/奖励": 1.0' in metrics


def test_a_warning_is_one_line_without_a_line_of_source():
    # warnings from rlhfkit's code (as the reward-hacking watch's, rl.py) and from another package
    code = ("import warnings\nimport rlhfkit.cli.main\nfrom rlhfkit.trainers import common\n"
            "def run(args, cfg):\n"
            "    warnings.warn_explicit('step 2: the policy may be gaming\\nits reward', RuntimeWarning, "
            "common.__file__, 1)\n"
            "    warnings.warn_explicit(\"some library's advice\", UserWarning, '/elsewhere/lib.py', 7)\n"
            "rlhfkit.cli.main._run = run\nassert rlhfkit.cli.main.main(['grpo']) == 0\n"
            "print(len(warnings.formatwarning('x', UserWarning, common.__file__, 1).splitlines()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["rlhfkit grpo: warning: step 2: the policy may be gaming its reward",
                                        "rlhfkit grpo: warning: some library's advice (UserWarning, lib.py:7)"]
    assert done.stdout.split() == ["2"]  # after the command, Python's own format again: the warning and its source line


def test_a_bad_record_is_answered_before_torch_is_imported(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": 2}\n')
    args = ["sft", f"model.name={tmp_path / 'model'}", f"data.path={data}"]
    run_cli(*args)  # warm the file cache: the timing below is the command's own
    t0 = time.perf_counter()
    done = run_cli(*args)
    seconds = time.perf_counter() - t0
    assert done.returncode == 2 and f"{data}:2: field 'completion'" in done.stderr, done.stderr
    assert seconds < 2.0, f"a data error took {seconds:.2f} s"  # ~5 s when torch came first
    code = ("import sys\nfrom rlhfkit.cli.main import main\n"
            f"assert main({args!r}) == 2\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules)\n"
            "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout


def test_bad_prompt_records_rewards_and_environments_are_answered_before_torch_is_imported(tmp_path):
    """Every record's messages (a conversational first record used to stop the check), the reward
    functions (they load, take the call's arguments, fit reward.weights and eval.accuracy_reward)
    and env.class, checked before torch and any model: the model directory does not even exist."""
    ok = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(ok) + "\n")
    bad.write_text(json.dumps(ok) + "\n" + json.dumps({"prompt": [{"content": "3+3?"}], "answer": "6"}) + "\n")
    fns = tmp_path / "fns.py"
    fns.write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n\n"
                   "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n")
    grpo = ["grpo", f"model.name={tmp_path / 'no_model'}", f"data.path={good}", "ppo.max_new_tokens=8"]
    cases = [
        ([*grpo[:2], f"data.path={bad}", f"reward.function={fns}:score"], "bad.jsonl:2: field 'prompt', message 0: "
                                                                          "missing 'role'"),
        ([*grpo, f"reward.function={fns}:two_args"], "got an unexpected keyword argument 'completion_ids'"),
        ([*grpo, f"reward.function={fns}:nope"], "has no attribute 'nope'"),
        ([*grpo, f"reward.function={fns}:score", "reward.weights=1,2"], "gives 2 weight(s) for 1 reward source"),
        ([*grpo, f"reward.function={fns}:score", "eval.accuracy_reward=exact"], "names no reward source (exact)"),
        ([*grpo, f"env.class={fns}:Game"], "env.class="),
        (["eval", str(tmp_path / "no_model"), f"data.path={good}", f"reward.function={fns}:two_args",
          "eval.max_new_tokens=8"], "got an unexpected keyword argument 'completion_ids'"),
    ]
    run_cli(*cases[1][0])  # warm the file cache: the timing below is the command's own
    t0 = time.perf_counter()
    done = run_cli(*cases[1][0])
    seconds = time.perf_counter() - t0
    assert done.returncode == 2 and cases[1][1] in done.stderr, done.stderr
    assert seconds < 2.0, f"a reward function's error took {seconds:.2f} s"  # ~8 s after torch and the model
    code = ("import sys\nfrom rlhfkit.cli.main import main\n"
            f"for argv, needle in {cases!r}:\n"
            "    assert main([*argv, 'run.out_dir=" + str(tmp_path / "out") + "']) == 2, argv\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules)\n"
            "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == len(cases)
    for line, (_, needle) in zip(errors, cases):
        assert needle in line, (needle, line)


@pytest.fixture
def preload_lib(tmp_path):
    """A shared library no Python process loads by itself, built with the C compiler the kernels use."""
    src, lib = tmp_path / "marker.c", tmp_path / "libmarker.so"
    src.write_text("int rlhfkit_preload_marker(void) { return 7; }\n")
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_run_malloc_restarts_the_command_line_once_with_the_library_preloaded(preload_lib):
    from rlhfkit.accel import malloc

    assert not malloc.loaded(preload_lib)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RLHFKIT_MALLOC_RESTARTED")}
    done = run_cli("grpo", f"accel.malloc={preload_lib}", "--print-config", env=env)
    assert done.returncode == 0, done.stderr
    # printed by the restarted process only once the library is in LD_PRELOAD and mapped
    assert done.stderr.count(f"rlhfkit grpo: malloc: {preload_lib} (accel.malloc={preload_lib})") == 1
    assert f"malloc: {preload_lib}" in done.stdout  # the resolved config, printed after the restart


def test_run_malloc_errors_name_the_fix(preload_lib, monkeypatch, capsys):
    from rlhfkit.accel import malloc

    done = run_cli("grpo", "accel.malloc=tcmallocc", "--print-config")
    assert done.returncode == 2
    assert "accel.malloc must be '', 'tcmalloc', 'jemalloc' or a path" in done.stderr
    monkeypatch.setattr(malloc.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ValueError, match="libjemalloc2"):
        malloc.resolve("jemalloc")
    # called as a function, the command cannot restart its caller: it says how to preload instead
    assert main(["grpo", f"accel.malloc={preload_lib}", "--print-config"]) == 2
    assert f"set LD_PRELOAD={preload_lib} before Python starts" in capsys.readouterr().err


def test_a_speed_key_under_its_old_name_is_one_line_naming_the_new_one(capsys):
    assert main(["grpo", "ppo.cuda_graph=true", "--print-config"]) == 2
    assert capsys.readouterr().err.strip() == ("rlhfkit grpo: error: config key 'ppo.cuda_graph' is now "
                                               "'accel.cuda_graph' (a speed setting, in the accel section): "
                                               "write accel.cuda_graph=... instead")
    assert main(["grpo", "accel.cuda_graph=true", "--print-config"]) == 0
    assert "cuda_graph: true" in capsys.readouterr().out


def test_help_lists_the_ppo_keys_under_their_concern(capsys):
    with pytest.raises(SystemExit):
        main(["grpo", "--help"])
    out = capsys.readouterr().out
    at = [out.index(f"  -- {h}\n") for h in ("Batches", "Sampling", "KL", "Loss", "Guards")]
    assert at == sorted(at)
    assert at[1] < out.index("  ppo.temperature:") < at[2] < out.index("  ppo.kl_coef:") < at[3]
