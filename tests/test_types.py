"""``mypy --strict`` over cxlrpc and kvservice, with the checkout's configuration
(``[tool.mypy]`` in pyproject.toml: which files, strictness, the untyped third-party packages).

mypy runs as a subprocess from the checkout, as a developer runs it (``python -m mypy``); its
incremental cache is the checkout's ``.mypy_cache`` (ignored by git), so a second run takes a
fraction of the first.
"""
from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A cold run takes a few seconds here; the bound leaves room for a loaded machine.
TIMEOUT_S = 300


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_mypy_strict_finds_no_errors() -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extras: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    out = done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    per_file = collections.Counter(line.split(":", 1)[0] for line in errors)
    summary = "\n".join(f"{count:5} {path}" for path, count in per_file.most_common())
    assert done.returncode == 0 and not errors, f"mypy found {len(errors)} errors:\n{summary}\n\n{out}"
    assert "Success: no issues found" in done.stdout, out
