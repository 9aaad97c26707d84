"""``rlhfkit export-task``: a built-in task's data as files the commands read back, equal to what
the built-in route generates from the same seed."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.cli.main import main
from rlhfkit.config import Config
from rlhfkit.data import encode_preferences, encode_triples, load_preferences, load_prompts, load_sft
from rlhfkit.data.prompts import prompt_data
from rlhfkit.tasks import cities, doubling, get_task
from rlhfkit.trainers.sft import encode_demonstrations, load_demonstrations
from rlhfkit.utils import read_jsonl

SEED = 3
SIZES = {"pretrain.steps": 2, "pretrain.batch_size": 8, "dpo.num_pairs": 64, "reward.eval_pairs": 16}
FILES = {"sft.jsonl": {"prompt", "completion"}, "prefs.jsonl": {"prompt", "chosen", "rejected"},
         "prefs_eval.jsonl": {"prompt", "chosen", "rejected"}, "pretrain.jsonl": {"text"}}
COLUMNS = {"doubling": {"number", "charset"}, "cities": {"city", "country"}}


@pytest.fixture(scope="module", params=["doubling", "cities"])
def exported(request, tmp_path_factory):
    task = request.param
    out = tmp_path_factory.mktemp(f"export_{task}")
    argv = ["export-task", task, str(out), f"run.seed={SEED}", *(f"{k}={v}" for k, v in SIZES.items())]
    assert main(argv) == 0
    cfg = Config().replace(**getattr(get_task(task), "CONFIG_DEFAULTS", {})).replace(
        run={"task": task, "seed": SEED}, pretrain={"steps": 2, "batch_size": 8}, dpo={"num_pairs": 64},
        reward={"eval_pairs": 16})
    return task, get_task(task), out, cfg


def test_the_files_have_their_fields(exported):
    name, task, out, _ = exported
    info = json.loads((out / "info.json").read_text(encoding="utf-8"))
    assert info["reward_function"] == f"rlhfkit.tasks.{name}:exact_reward"
    assert info["max_new_tokens"] == task.MAX_NEW_TOKENS and info["seed"] == SEED
    want = {"sft.jsonl": 2048, "prefs.jsonl": 64, "prefs_eval.jsonl": 16, "prompts.jsonl": 2048,
            "eval_prompts.jsonl": len(task.eval_prompts()), "pretrain.jsonl": 16}
    assert info["files"] == want
    for file, n in want.items():
        rows = read_jsonl(out / file)
        assert len(rows) == n, file
        fields = FILES.get(file, {"prompt"} | COLUMNS[name])
        assert all(set(r) == fields for r in rows), file


def test_the_loaders_read_them_back(exported):
    name, task, out, _ = exported
    tok = task.make_tokenizer()
    assert len(load_sft(out / "sft.jsonl", tok)) == 2048
    assert len(load_sft(out / "pretrain.jsonl", tok)) == 16  # {"text"}: the SFT loader's plain-text format
    assert len(load_preferences(out / "prefs.jsonl", tok)) == 64
    assert len(load_preferences(out / "prefs_eval.jsonl", tok)) == 16
    held = load_prompts(out / "eval_prompts.jsonl", tok)
    assert [(ex.prompt, ex.meta) for ex in held] == [(p.text, task.columns(p)) for p in task.eval_prompts()]
    assert len(load_prompts(out / "prompts.jsonl", tok)) == 2048


def _hand_made(name: str, prompt) -> list[tuple[str, bool]]:
    """(completion without EOS, finished) triples: right and ended, right but cut, wrong and ended."""
    if name == "doubling":
        right = doubling.render(2 * prompt.number, prompt.charset)
        other = next(s for s in doubling.SET_NAMES if s != prompt.charset)
        wrong = doubling.render(2 * prompt.number, other)
    else:
        right = cities.answer_text(prompt.city)[:-1]
        wrong = f"{prompt.country}."
    return [(right, True), (right, False), (wrong, True), (right + right[-1], True)]


def test_the_columns_make_exact_reward_agree_with_verify(exported):
    name, task, out, _ = exported
    objects = {"eval_prompts.jsonl": task.eval_prompts()[:5], "prompts.jsonl": task.TaskData(SEED + 2).prompts(5)}
    for file, prompts in objects.items():
        rows = read_jsonl(out / file)[:5]
        for row, p in zip(rows, prompts):
            cases = _hand_made(name, p)
            columns = {k: [row[k]] * len(cases) for k in COLUMNS[name]}
            got = task.exact_reward(prompts=[row["prompt"]] * len(cases), completions=[c for c, _ in cases],
                                    finished=[f for _, f in cases], **columns)
            want = [float(task.verify(p, c + task.EOS if f else c)["exact"]) for c, f in cases]
            assert got == want == [1.0, 0.0, 0.0, 0.0], (file, row)


def test_the_files_hold_what_the_built_in_route_generates(exported):
    name, task, out, cfg = exported
    tok = task.make_tokenizer()
    # RL prompts: the built-in route's prompt source, batch after batch
    source = prompt_data(cfg, tok, task).train
    rows = read_jsonl(out / "prompts.jsonl")
    got = [r for _ in range(4) for r in source.batch(16)]
    assert [r["prompt"] for r in rows[:64]] == [rec.text for rec in got]
    assert [{k: r[k] for k in COLUMNS[name]} for r in rows[:64]] == [rec.columns for rec in got]
    assert [r["prompt"] for r in rows[:8]] == [p.text for p in task.TaskData(SEED + 2).prompts(8)]
    # SFT: the same encoded demonstrations with and without data.path
    built_in = encode_demonstrations(cfg, tok, load_demonstrations(cfg, tok, None)[0], packing=False)
    from_file = encode_demonstrations(cfg, tok, load_demonstrations(cfg, tok, str(out / "sft.jsonl"))[0], packing=False)
    assert all(torch.equal(built_in[k], from_file[k]) for k in built_in)
    # DPO's fixed pair set, encoded as each route encodes it
    pairs = task.TaskData(SEED + 3).preference_pairs(64, cfg.reward.hard_negatives)
    a, b = encode_triples(tok, pairs), encode_preferences(load_preferences(out / "prefs.jsonl", tok), tok, 64, "error")
    assert all(torch.equal(a[k], b[k]) for k in a)
    held = [(r["prompt"], r["chosen"], r["rejected"]) for r in read_jsonl(out / "prefs_eval.jsonl")]
    assert held == task.held_out_pairs(16, SEED)
    # the pretraining stream, drawn batch by batch as the pretrain loop draws it
    data = task.TaskData(SEED)
    assert [r["text"] for r in read_jsonl(out / "pretrain.jsonl")] == data.pretrain_texts(8) + data.pretrain_texts(8)


def test_an_unknown_task_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export-task", "chess", str(tmp_path / "x")])
    assert info.value.code == 2
    assert "invalid choice: 'chess'" in capsys.readouterr().err
