"""End to end on the doubling task: the demo pipeline learns, and the commands work.

One module-scoped run of ``rlhfkit demo`` (pretrain -> reward model -> PPO -> eval, about a
minute on two CPU cores) feeds every test here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from rlhfkit.cli.demo import run_demo
from rlhfkit.cli.main import main
from rlhfkit.config import ALGO_DEFAULTS, Config
from rlhfkit.utils import read_jsonl


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cfg = Config().replace(run={"out_dir": str(out), "progress": False})
    summary = run_demo(cfg)
    return out, summary


@pytest.mark.accel_twice
@pytest.mark.slow
def test_ppo_teaches_the_prefix(demo_run):
    out, summary = demo_run
    # the base picks a character set at random, the tuned policy obeys the prefix and doubles
    assert summary["base"]["format_acc"] <= 0.5
    assert summary["base"]["answer_acc"] >= 0.95  # pretraining taught doubling itself
    assert summary["final"]["exact_acc"] >= 0.99
    assert summary == json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "reinforce"])
def test_critic_free_defaults_learn_from_the_learned_reward_model(demo_run, tmp_path, algo):
    """`rlhfkit rloo` / `rlhfkit reinforce` with their defaults on the demo's Bradley-Terry reward
    model (a learned, gameable reward) reach 0.95 held-out exact without drifting away from the
    reference: the defaults benchmarks/robustness.py chose across three rewards."""
    out, summary = demo_run
    assert main([algo, "run.progress=false", f"model.name={out / 'pretrain' / 'policy'}",
                 f"reward.name={out / 'reward' / 'reward_model'}", "ppo.steps=200", "ppo.stop_at=0.95",
                 "ppo.trajectories_every=0", f"run.out_dir={tmp_path}"]) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["eval/exact_acc"] >= 0.95 > summary["base"]["exact_acc"], rows[-1]["eval/exact_acc"]
    assert max(r["objective/kl"] for r in rows) < 10  # the hacking watch's threshold never reached
    assert not any(r.get("guard/kl_high") or r.get("guard/eos_collapse") for r in rows)


@pytest.mark.accel_twice
@pytest.mark.slow
def test_run_directory_contents(demo_run):
    out, _ = demo_run
    for rel in ["config.yaml", "metrics.jsonl", "samples.jsonl", "trajectories.jsonl", "report.html", "tb",
                "plots.png", "plot_score.png",
                "policy/model.safetensors", "value_head.safetensors",
                "pretrain/policy/model.safetensors", "reward/reward_model/model.safetensors"]:
        assert (out / rel).exists(), rel
    rows = read_jsonl(out / "metrics.jsonl")
    for key in ["objective/score", "objective/kl", "objective/entropy", "objective/rlhf_reward", "policy/approx_kl",
                "policy/clipfrac", "policy/loss", "value/loss", "value/clipfrac", "value/explained_var",
                "response/length", "response/eos_rate", "time/rollout_s", "time/update_s",
                "throughput/tokens_per_s", "policy/logprob_gap"]:
        assert key in rows[0], key
    # generation-time and training-forward log-probs agree at every step
    assert max(r["policy/logprob_gap"] for r in rows) < 1e-4
    # the reward model separates chosen from rejected on held-out pairs
    rm_rows = read_jsonl(out / "reward" / "metrics.jsonl")
    assert rm_rows[-1]["eval/rm/accuracy"] >= 0.95 and rm_rows[-1]["eval/rm/delta"] > rm_rows[0]["rm/delta"]


@pytest.mark.slow
def test_eval_command_reproduces_final_accuracy(demo_run, tmp_path, capsys):
    out, summary = demo_run
    assert main(["eval", str(out), f"run.out_dir={tmp_path}"]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["exact_acc"] == summary["final"]["exact_acc"]


@pytest.mark.slow
def test_eval_on_the_exported_held_out_prompts_matches_the_task_eval(demo_run, tmp_path, capsys):
    """The file route (export-task, then eval with data.path and the task's reward function)
    measures what the task route measures, for the tuned policy and the base as its baseline."""
    out, summary = demo_run
    assert main(["export-task", "doubling", str(tmp_path / "data"), "pretrain.steps=1"]) == 0
    info = json.loads((tmp_path / "data" / "info.json").read_text())
    assert main(["eval", str(out), f"data.path={tmp_path / 'data' / 'eval_prompts.jsonl'}",
                 f"reward.function={info['reward_function']}", f"eval.max_new_tokens={info['max_new_tokens']}",
                 f"eval.baseline={out / 'pretrain'}", f"run.out_dir={tmp_path / 'ev'}"]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["prompts"] == 512
    assert result["eval/accuracy"] == summary["final"]["exact_acc"]
    assert result["baseline"]["eval/accuracy"] == summary["base"]["exact_acc"]
    assert result["win_rate"] > 0.5


def test_cli_rejects_bad_config_with_a_clear_message(capsys):
    assert main(["ppo", "ppo.kl_cof=0.1"]) == 2
    err = capsys.readouterr().err
    assert "ppo.kl_cof" in err and "Did you mean 'ppo.kl_coef'" in err
    assert main(["ppo", "ppo.steps=many"]) == 2
    assert "ppo.steps" in capsys.readouterr().err


def test_cli_ppo_needs_models(tmp_path, capsys):
    assert main(["ppo", f"run.out_dir={tmp_path}"]) == 2
    assert "model.name" in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_with_the_task_verifier_as_reward_learns(demo_run, tmp_path):
    # same base as the demo; GRPO shares rollout/experience/update with PPO, only the
    # advantage differs, and its reward is a plain Python callable (the task's verifier)
    from rlhfkit.trainers.rl import train_rl

    out, summary = demo_run
    cfg = Config().replace(
        run={"out_dir": str(tmp_path), "progress": False},
        model={"name": str(out / "pretrain" / "policy")},
        reward={"function": "rlhfkit.tasks.doubling:exact_reward"},
        # what `rlhfkit grpo` runs, stopping at 0.95. GRPO learns the three character sets one
        # after another (plateaus near 1/3 and 2/3), so the step it gets there varies with the
        # seed: 80-120 steps to 0.95 over seeds 0-2 (benchmarks/robustness.py)
        ppo={**ALGO_DEFAULTS["grpo"], "steps": 300, "stop_at": 0.95},
    )
    res = train_rl(cfg)
    assert res["reached"] is not None and res["final"]["eval/exact_acc"] >= 0.95 > summary["base"]["exact_acc"]
    assert not (tmp_path / "value_model").exists() and not (tmp_path / "value_head.safetensors").exists()  # no critic


@pytest.mark.slow
def test_the_file_route_reaches_the_built_in_accuracy(demo_run, tmp_path):
    """The pipeline on files: the task exported, a reward model from the pairs file, PPO (that
    reward model) and GRPO (the column-reading verifier) from the prompt file, each evaluated on
    the held-out prompt file by the verifier -- as accurate as the built-in route's PPO."""
    out, summary = demo_run
    base, data = out / "pretrain" / "policy", tmp_path / "data"
    common = ["run.progress=false", f"model.name={base}"]
    assert main(["export-task", "doubling", str(data)]) == 0
    assert main(["rm", *common, f"data.path={data / 'prefs.jsonl'}", f"run.out_dir={tmp_path / 'rm'}"]) == 0
    rl = [*common, f"data.path={data / 'prompts.jsonl'}", f"data.eval_path={data / 'eval_prompts.jsonl'}",
          "ppo.max_new_tokens=8", "ppo.stop_metric=eval/accuracy", "ppo.stop_at=0.99", "ppo.steps=300"]
    verifier = "reward.function=rlhfkit.tasks.doubling:exact_reward"
    # PPO on the learned reward; the verifier rides along with weight 0 to report held-out accuracy
    assert main(["ppo", *rl, f"reward.name={tmp_path / 'rm' / 'reward_model'}", verifier, "reward.weights=1,0",
                 f"run.out_dir={tmp_path / 'ppo'}"]) == 0
    assert main(["grpo", *rl, verifier, f"run.out_dir={tmp_path / 'grpo'}"]) == 0
    for algo in ("ppo", "grpo"):
        last = read_jsonl(tmp_path / algo / "metrics.jsonl")[-1]
        assert last["eval/accuracy"] >= 0.95, (algo, last["eval/accuracy"])
    assert summary["final"]["exact_acc"] >= 0.95  # the built-in route, same base


@pytest.mark.slow
def test_dpo_lifts_format_accuracy_without_sampling(demo_run, tmp_path):
    from rlhfkit.trainers.dpo import train_dpo

    out, summary = demo_run
    cfg = Config().replace(run={"out_dir": str(tmp_path), "progress": False},
                           model={"name": str(out / "pretrain" / "policy")},
                           dpo={"steps": 300, "stop_at_format": 0.95})
    res = train_dpo(cfg)
    assert summary["base"]["format_acc"] <= 0.5
    assert res["final"]["eval/format_acc"] >= 0.95
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["dpo/accuracy"] > 0.5 and rows[-1]["dpo/margin"] > rows[0]["dpo/margin"]


@pytest.mark.slow
def test_dpo_from_a_file_of_the_task_pairs_lifts_format_accuracy(demo_run, tmp_path):
    """The user's-file route on the task's own pairs learns what the built-in route learns; its
    held-out pairs (a seeded 5%) are separated, and greedy decoding obeys the prefix."""
    from rlhfkit.tasks import doubling

    out, summary = demo_run
    data = tmp_path / "prefs.jsonl"
    # no "EOS missing" negatives: every response is closed by EOS, so they would equal the chosen answer
    pairs = doubling.DoublingData(3).preference_pairs(2000, hard=0.0)
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}, ensure_ascii=False) + "\n"
                            for p, c, r in pairs), encoding="utf-8")
    assert main(["dpo", f"model.name={out / 'pretrain' / 'policy'}", f"data.path={data}", "data.eval_fraction=0.05",
                 f"run.out_dir={tmp_path / 'dpo'}", "dpo.steps=150", "dpo.eval_every=50", "run.progress=false"]) == 0
    rows = read_jsonl(tmp_path / "dpo" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/rewards/accuracies" in r] == [49, 99, 149]
    assert rows[-1]["eval/rewards/accuracies"] >= 0.95 and rows[-1]["eval/rewards/margins"] > 0
    assert main(["eval", str(tmp_path / "dpo"), f"run.out_dir={tmp_path / 'ev'}"]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["format_acc"] >= 0.9 > summary["base"]["format_acc"]


@pytest.mark.slow
def test_sft_from_a_jsonl_file_teaches_the_prefix(demo_run, tmp_path):
    from rlhfkit.tasks import doubling

    out, summary = demo_run
    data = tmp_path / "sft.jsonl"
    gen = doubling.DoublingData(11)
    data.write_text("".join(
        json.dumps({"prompt": p.text, "completion": doubling.render(2 * p.number, p.charset)}, ensure_ascii=False)
        + "\n" for p in gen.prompts(1000)), encoding="utf-8")
    assert main(["sft", f"model.name={out / 'pretrain' / 'policy'}", f"data.path={data}",
                 f"run.out_dir={tmp_path / 'sft'}", "sft.steps=200", "run.progress=false"]) == 0
    assert main(["eval", str(tmp_path / "sft"), f"run.out_dir={tmp_path / 'ev'}"]) == 0
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["format_acc"] >= 0.95 > summary["base"]["format_acc"]


@pytest.mark.slow
def test_sft_reports_a_malformed_record_by_line(tmp_path, capsys, demo_run):
    out, _ = demo_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "数字:1234x2=", "completion": "2468"}\n{"prompt": "数字:1x2="}\n')
    assert main(["sft", f"model.name={out / 'pretrain' / 'policy'}", f"data.path={bad}",
                 f"run.out_dir={tmp_path / 'sft'}"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "completion" in err


@pytest.mark.slow
def test_reward_model_from_a_preference_file_with_margins(demo_run, tmp_path):
    from rlhfkit.tasks import doubling

    out, _ = demo_run
    data = tmp_path / "prefs.jsonl"
    # no hard negatives here: the "EOS missing" kind cannot be written as text, since the encoder
    # appends EOS to every response (as TRL does) and would make such a pair identical
    pairs = doubling.DoublingData(12).preference_pairs(600, hard=0.0)
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r, "margin": 1.0}, ensure_ascii=False)
                            + "\n" for p, c, r in pairs), encoding="utf-8")
    assert main(["rm", f"model.name={out / 'pretrain' / 'policy'}", f"data.path={data}",
                 f"run.out_dir={tmp_path / 'rm'}", "reward.steps=150", "run.progress=false"]) == 0
    rows = read_jsonl(tmp_path / "rm" / "metrics.jsonl")
    # the 60 held-out pairs (10% of the file) are ranked correctly, and the gap grew during training
    assert rows[-1]["eval/rm/accuracy"] >= 0.95
    assert rows[-2]["rm/delta"] > rows[0]["rm/delta"]


@pytest.mark.slow
def test_classifier_reward_of_the_tutorial_drives_ppo(demo_run, tmp_path):
    # the reward is the logit of the requested label from a character-set classifier
    out, summary = demo_run
    base = out / "pretrain" / "policy"
    assert main(["rm", f"model.name={base}", "reward.kind=classifier", f"run.out_dir={tmp_path / 'rm'}",
                 "run.progress=false"]) == 0
    rows = read_jsonl(tmp_path / "rm" / "metrics.jsonl")
    assert rows[-1]["eval/rm/accuracy"] >= 0.95
    assert main(["ppo", f"model.name={base}", f"reward.name={tmp_path / 'rm' / 'reward_model'}",
                 f"run.out_dir={tmp_path / 'ppo'}", "run.progress=false"]) == 0
    final = [r for r in read_jsonl(tmp_path / "ppo" / "metrics.jsonl") if r.get("eval/format_acc") is not None][-1]
    assert final["eval/format_acc"] >= 0.95 > summary["base"]["format_acc"]


@pytest.mark.slow
def test_chat_answers_from_piped_input(demo_run):
    out, _ = demo_run
    proc = subprocess.run([sys.executable, "-m", "rlhfkit", "chat", str(out), "run.device=cpu"],
                          input="数字:1234x2=\n大写:1234x2=\n/quit\n数字:1111x2=\n", capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr
    assert "2468" in proc.stdout and "贰肆陆捌" in proc.stdout and "2222" not in proc.stdout  # stopped at /quit


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
def test_chat_session_driven_through_tmux(demo_run):
    """A scripted terminal session: type prompts into `rlhfkit chat`, read the screen, /quit."""
    out, _ = demo_run
    tmux = ["tmux", "-u", "-L", f"rlhfkit-test-{os.getpid()}"]  # a private server: kill-server ends only it
    env = {**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    cmd = f"{shlex.quote(sys.executable)} -m rlhfkit chat {shlex.quote(str(out))} run.device=cpu; echo CHAT-EXIT $?; sleep 60"

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "chat"], capture_output=True, text=True,
                              env=env).stdout

    def wait_for(text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in (shown := screen()):
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; screen:\n{screen()}")

    def type_line(text: str) -> None:
        subprocess.run([*tmux, "send-keys", "-t", "chat", "-l", text], check=True, env=env)
        subprocess.run([*tmux, "send-keys", "-t", "chat", "Enter"], check=True, env=env)

    subprocess.run([*tmux, "new-session", "-d", "-s", "chat", "-x", "150", "-y", "40", cmd], check=True, env=env)
    try:
        wait_for("chatting with")
        type_line("数字:4321x2=")
        wait_for("8642")
        type_line("小写:1500x2=")
        wait_for("三〇〇〇")
        type_line("/quit")
        wait_for("CHAT-EXIT 0")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, env=env)
