"""The package's source says what the code does and why; measurement evidence lives in benchmarks/.

Commit hashes, CPU model lines and pointers to the hand-typed measurement files go stale with
every change, so none of them belongs in a docstring or comment under src/rlhfkit (their record
is benchmarks/archive/code-evidence.md).
"""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "rlhfkit"

# Being moved into the accel package, whose source is out of this check.
SKIPPED = {"accel", "csrc", "kernels.py", "gemm.py", "malloc.py", "triton_decode.py"}

COMMIT = re.compile(r"\bcommit\s+[0-9a-f]{7,40}\b", re.IGNORECASE)
HEX_TOKEN = re.compile(r"(?<![0-9A-Za-z_.])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
CPU_MODEL = re.compile(r"family 6|model 207|\bZen ?[345]\b|\bEPYC\b|\bXeon\b", re.IGNORECASE)
ARCHIVED = re.compile(r"RESULTS\.md|FINDINGS\.md|README-0\.1\.0-measurements\.md")


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
