"""Safe loading: no pickle anywhere a file is read, safetensors for every saved weight.

Unpickling a file runs whatever code it names (the doubling tutorial reloads whole models with
``torch.load(weights_only=False)``, the thing never to do). Three guards:

* a static scan (AST) of the package and the benchmarks fails on any pickle-based load: a
  ``torch.load`` without ``weights_only=True``, ``pickle``/``dill``/``joblib``/... imports,
  ``torch.jit.load``, ``np.load(allow_pickle=True)``, ``trust_remote_code=True`` written into
  the code, or safetensors switched off (``use_safetensors=False``, ``safe_serialization=False``);
* every trainer, run for a few steps, writes weights as ``*.safetensors`` and no ``.bin``/``.pt``;
* the loaders refuse a checkpoint that has only pickle-based weights, with a message saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.models.forward import ModelLoadError, load_policy, load_scalar_model

ROOT = Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "src" / "rlhfkit", ROOT / "benchmarks"]
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLE_CALLS = {"torch.jit.load", "jit.load", "read_pickle", "torch.serialization.load"}
pytestmark = pytest.mark.usefixtures("no_plots")

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"}


def _dotted(node: ast.AST) -> str:
    """``torch.load`` for the call target ``torch.load`` (attribute chains of names), else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_loads(source: str, name: str = "<string>") -> list[str]:
    """Every pickle-based load (or switch that enables one) in Python ``source``, as 'name:line: why'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in PICKLE_MODULES:
                found.append(f"{where}: imports from {module}")
            if module.split(".")[0] == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where}: 'from {module} import load' hides torch.load from this check")
        elif isinstance(node, ast.Call):
            fn = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if fn in ("torch.load", "th.load") and not _const(kw.get("weights_only"), True):
                found.append(f"{where}: {fn} without weights_only=True")
            if fn in PICKLE_CALLS or fn.split(".")[-1] == "read_pickle":
                found.append(f"{where}: {fn} unpickles")
            if fn.split(".")[-1] == "load" and fn.split(".")[0] in ("np", "numpy") and _const(kw.get("allow_pickle"), True):
                found.append(f"{where}: {fn}(allow_pickle=True)")
            if _const(kw.get("trust_remote_code"), True):
                found.append(f"{where}: trust_remote_code=True hard-coded (only the user may set it)")
            for key in ("use_safetensors", "safe_serialization"):
                if _const(kw.get(key), False):
                    found.append(f"{where}: {key}=False")
    return found


def test_no_pickle_based_load_in_the_code():
    files = [p for d in SCANNED for p in sorted(d.rglob("*.py"))]
    assert len(files) > 10  # the scan really reads the package
    problems = [msg for p in files for msg in unsafe_loads(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert problems == []


@pytest.mark.parametrize("snippet", [
    "import torch\nsd = torch.load('x.pt')",
    "import torch\nsd = torch.load('x.pt', weights_only=False)",
    "import torch\nsd = torch.load(path, map_location='cpu')",
    "import pickle\nobj = pickle.load(open('x', 'rb'))",
    "from pickle import loads",
    "import dill",
    "import joblib\nm = joblib.load('m.joblib')",
    "from torch import load\nsd = load('x.pt')",
    "import torch\nm = torch.jit.load('m.pt')",
    "import numpy as np\na = np.load('a.npy', allow_pickle=True)",
    "import pandas as pd\ndf = pd.read_pickle('df.pkl')",
    "m = AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True)",
    "m = AutoModelForCausalLM.from_pretrained(p, use_safetensors=False)",
    "model.save_pretrained(d, safe_serialization=False)",
])
def test_the_scan_catches_each_unsafe_pattern(snippet):
    assert len(unsafe_loads(snippet)) == 1, unsafe_loads(snippet)


def test_the_scan_allows_the_safe_forms():
    ok = ("import torch\nsd = torch.load(p, weights_only=True, map_location='cpu')\n"
          "m = AutoModelForCausalLM.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code)\n"
          "import numpy as np\na = np.load('a.npy')\nmodel.save_pretrained(d)\n")
    assert unsafe_loads(ok) == []


def _weights(root: Path) -> tuple[list[Path], list[Path]]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return [p for p in files if p.suffix == ".safetensors"], [p for p in files if p.suffix in PICKLE_SUFFIXES]


def test_every_trainer_saves_safetensors_only(tiny_models, tiny_config, tmp_path):
    from rlhfkit.trainers.dpo import train_dpo
    from rlhfkit.trainers.pretrain import pretrain
    from rlhfkit.trainers.reward import train_reward_model
    from rlhfkit.trainers.rl import train_rl
    from rlhfkit.trainers.sft import train_sft

    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text('{"prompt": "数字:12x2=", "completion": "24"}\n{"prompt": "__:3x2=", "completion": "6"}\n',
                        encoding="utf-8")
    pretrain(tiny_config(tmp_path / "pretrain"))
    train_reward_model(tiny_config(tmp_path / "rm", model={"name": tiny_models.policy}))
    train_rl(tiny_config(tmp_path / "ppo", model={"name": tiny_models.policy}, reward={"name": tiny_models.reward},
                         ppo={"value_model": "separate"}))
    train_rl(tiny_config(tmp_path / "ppo_shared", model={"name": tiny_models.policy},
                         reward={"name": tiny_models.reward}))  # the default critic: a value head on the policy
    train_sft(tiny_config(tmp_path / "sft", model={"name": tiny_models.policy}, data={"path": str(sft_data)}))
    train_dpo(tiny_config(tmp_path / "dpo", model={"name": tiny_models.policy}))
    safe, unsafe = _weights(tmp_path)
    assert unsafe == []
    expected = ["pretrain/policy/model.safetensors", "rm/reward_model/model.safetensors",
                "ppo/policy/model.safetensors", "ppo/value_model/model.safetensors",
                "ppo_shared/policy/model.safetensors", "ppo_shared/value_head.safetensors",
                "sft/policy/model.safetensors", "dpo/policy/model.safetensors"]
    assert sorted(str(p.relative_to(tmp_path)) for p in safe) == sorted(expected)
    # and they load back through the safetensors-only loaders
    assert load_policy(str(tmp_path / "ppo" / "policy")) is not None
    assert load_scalar_model(str(tmp_path / "ppo" / "value_model")) is not None


def test_pickle_only_checkpoint_is_refused(tiny_models, tmp_path):
    # a directory as an older tool writes it: config.json + pytorch_model.bin, no safetensors
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    src = Path(tiny_models.policy)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (legacy / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(src / "model.safetensors")), legacy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle-based weights") as err:
        load_policy(str(legacy))
    assert str(legacy) in str(err.value) and "save_pretrained" in str(err.value)
    with pytest.raises(ModelLoadError, match="pickle-based weights"):
        load_scalar_model(str(legacy))
