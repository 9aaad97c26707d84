"""The package's source says what the code does and why; measurement evidence lives in benchmarks/.

Commit hashes, CPU model lines and pointers to the hand-typed measurement files go stale with
every change, so none of them belongs in a docstring or comment under src/rlhfkit (their record
is benchmarks/archive/code-evidence.md).

No test reaches a code path by monkeypatching a module or class constant (an ALL_CAPS name): the
value is an argument of what reads it, or the path is reached through a real input size.
"""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "rlhfkit"
TESTS = Path(__file__).resolve().parent

# Being moved into the accel package, whose source is out of this check.
SKIPPED = {"accel", "csrc", "kernels.py", "gemm.py", "malloc.py", "triton_decode.py"}

COMMIT = re.compile(r"\bcommit\s+[0-9a-f]{7,40}\b", re.IGNORECASE)
HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z_.])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
CPU_MODEL = re.compile(r"family 6|model 207|\bZen ?[345]\b|\bEPYC\b|\bXeon\b", re.IGNORECASE)
ARCHIVED = re.compile(r"RESULTS\.md|FINDINGS\.md|README-0\.1\.0-measurements\.md")
# monkeypatch.setattr(x, "NAME", ...), (x.Y, "NAME", ...) or ("x.Y.NAME", ...)
PATCHED_CONSTANT = re.compile(r"monkeypatch\.setattr\(\s*(?:[\w.]+\s*,\s*[\"']|[\"'][\w.]*\.)([A-Z][A-Z0-9_]+)[\"']")


def checked_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py")
                  if not SKIPPED.intersection(p.relative_to(PKG).parts))


def is_hash(token: str) -> bool:
    """A bare hex token that is a hash, not a number or a word: it mixes digits and letters."""
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


def findings(text: str) -> list[str]:
    found = [m.group(0) for m in COMMIT.finditer(text)]
    found += [m.group(0) for m in HEX_TOKEN.finditer(text) if is_hash(m.group(0))]
    found += [m.group(0) for pattern in (CPU_MODEL, ARCHIVED) for m in pattern.finditer(text)]
    return found


def test_the_checks_catch_what_they_are_for():
    assert findings("at commit 3777dbe on a 2-core machine") == ["commit 3777dbe", "3777dbe"]
    assert findings("(c0d2ceb)") == ["c0d2ceb"]
    assert findings("Intel Xeon, family 6 model 207") == ["Xeon", "family 6", "model 207"]
    assert findings("an AMD EPYC (Zen 4)") == ["EPYC", "Zen 4"]
    assert findings("see benchmarks/RESULTS.md and FINDINGS.md") == ["RESULTS.md", "FINDINGS.md"]
    # numbers, words and hex literals are no hashes
    assert findings("seed 20240601, digits 0123456789, a defaced value, 0x7fffffff") == []


def test_no_measurement_evidence_in_the_package_source():
    offenders = {str(p.relative_to(PKG)): found for p in checked_files()
                 if (found := findings(p.read_text(encoding="utf-8")))}
    assert not offenders, ("measurement evidence in src/rlhfkit (move it to "
                           f"benchmarks/archive/code-evidence.md): {offenders}")


def patched_constants(text: str) -> list[str]:
    return PATCHED_CONSTANT.findall(text)


def test_the_patched_constant_check_catches_what_it_is_for():
    assert patched_constants('monkeypatch.setattr(models, "UPDATE_LOGITS", 1)') == ["UPDATE_LOGITS"]
    assert patched_constants("monkeypatch.setattr(\n    lean.FixedStep, 'BAND', 4)") == ["BAND"]
    assert patched_constants('env.monkeypatch.setattr("rlhfkit.models.forward.UPDATE_LOGITS", 1)') == ["UPDATE_LOGITS"]
    # functions, classes, dunders and mixed-case names are not constants
    assert patched_constants('monkeypatch.setattr(rl, "rollout", spy); monkeypatch.setattr(m, "Sampler", s)\n'
                             'monkeypatch.setattr(lean._StackedLoRAs, "__call__", f); monkeypatch.setattr('
                             '"sys.path", [])') == []


def test_no_test_monkeypatches_a_constant():
    offenders = {p.name: found for p in sorted(TESTS.rglob("*.py"))
                 if p != Path(__file__).resolve() and (found := patched_constants(p.read_text(encoding="utf-8")))}
    assert not offenders, ("tests monkeypatch module or class constants; pass the value as an argument of what "
                           f"reads it, or reach the path through a real input size: {offenders}")
