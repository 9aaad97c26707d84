"""The command line as a newcomer meets it: errors answered at once and in one line (the
traceback on request), help that lists every key, the resolved config printed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlhfkit.cli import main
from rlhfkit.config import ConfigError
from rlhfkit.rewards import RewardError


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
    code = ("import sys\nfrom rlhfkit.cli import main\n"
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
