"""The package's imports go one way: down the layers of docs/design.md, never up, no cycle.

Every import in src/rlhfkit is read with ``ast`` -- those inside functions too: an import put
in a function to dodge a cycle is the cycle still there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "rlhfkit"

# Bottom to top. A module may import its own layer or a lower one; "trainers" are entry points
# that never import one another (what they share lives in trainers.common).
LAYERS = [
    # the registry class and the prompt-run finder that rlhfkit.ops and rlhfkit.accel share
    ("shared", {"registry"}),
    # the hardware-specific implementations rlhfkit.ops installs (rlhfkit.accel): of the rest, they import
    # only the registry module
    ("accel", {"accel", "accel.registry", "accel.forward", "accel.primitives", "accel.kernels", "accel.gemm",
               "accel.triton_decode", "accel.malloc", "accel.heap", "accel.offload"}),
    ("base", {"core", "core.stats", "core.rewards", "core.advantages", "core.losses", "core.preference", "ops",
              "config", "config.base", "config.ppo", "config.sections", "config.trl", "utils", "progress", "models.precision"}),
    ("infrastructure", {"run.distributed", "run.checkpoint", "data", "data.records", "data.examples", "data.encode",
                        "callables", "data.prompts", "tasks", "tasks.doubling", "tasks.cities", "tasks.export"}),
    ("models", {"models.loading", "models.logprobs", "models.forward"}),
    ("generation and scoring", {"rollout.generate", "rollout.evaluate", "rollout.rewards", "rollout.experience", "run.trajectories", "run.plots",
                                "run.watch", "envs.environment", "envs.tools"}),
    ("run scaffolding", {"trainers.common", "trainers.rl_setup"}),
    ("trainers", {"trainers.pretrain", "trainers.sft", "trainers.reward", "trainers.dpo", "trainers.rl",
                  "tasks.gridworld"}),
    # tasks.gridcat: the grid world (a trainers-layer module) as an environment
    ("front ends", {"cli.demo", "cli.chat", "cli.report", "cli.fetch", "cli.main", "api", "__main__", "tasks.gridcat"}),
]
NO_SIBLINGS = {"trainers"}
LAYER_OF = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
PACKAGES = dict.fromkeys(["", "trainers", "cli", "envs", "models", "rollout", "run"])  # __init__ files: namespaces, no code to layer (accel's is a layer's)


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports (relative or absolute), by dotted name in the package."""
    me = module_name(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("rlhfkit"):
                target = node.module.removeprefix("rlhfkit").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import lean` names a module; `from .core import f` does not
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in LAYER_OF else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlhfkit."):
                    found.add(alias.name.removeprefix("rlhfkit."))
    return {m for m in found if m and m not in PACKAGES} - {me}


GRAPH = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in GRAPH if m not in LAYER_OF and m not in PACKAGES)
    assert not unplaced, f"modules missing from LAYERS in tests/test_layers.py: {unplaced}"


def test_no_import_goes_up_a_layer():
    bad = []
    for mod, targets in GRAPH.items():
        if mod in PACKAGES:
            continue
        for t in targets:
            lo, hi = LAYER_OF[t], LAYER_OF[mod]
            if lo > hi or (lo == hi and LAYERS[hi][0] in NO_SIBLINGS):
                bad.append(f"{mod} ({LAYERS[hi][0]}) imports {t} ({LAYERS[lo][0]})")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> list[str] | None:
        state[mod] = 1
        for t in sorted(GRAPH.get(mod, ())):
            if state.get(t) == 1:
                return [*path[path.index(t):], t] if t in path else [*path, t]
            if t not in state and (cycle := visit(t, [*path, t])):
                return cycle
        state[mod] = 2
        return None

    for mod in sorted(GRAPH):
        if mod not in state and (cycle := visit(mod, [mod])):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_what_it_must():
    """The parser catches relative, nested and function-level imports (so the tests above can fail)."""
    assert "trainers.common" in GRAPH["trainers.rl"]
    assert "core" in GRAPH["trainers.rl"]  # `from ..core import (...)`
    assert "ops" in GRAPH["models.forward"]  # `from .. import ops`
    assert {"cli.demo", "trainers.rl", "cli.report"} <= GRAPH["cli.main"]  # imported inside main()
