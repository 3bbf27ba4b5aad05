"""``mypy --strict`` over cxlrpc and kvservice, with the checkout's configuration
(``[tool.mypy]`` in pyproject.toml: which files, strictness, the untyped third-party packages),
and the native modules' stubs against the built modules (``mypy.stubtest``).

mypy runs as a subprocess from the checkout, as a developer runs it (``python -m mypy``); its
incremental cache is the checkout's ``.mypy_cache`` (ignored by git), so a second run takes a
fraction of the first.
"""
from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A cold run takes a few seconds here; the bound leaves room for a loaded machine.
TIMEOUT_S = 300
#: The native modules, each typed by the .pyi stub beside its C source.
NATIVE = ("cxlrpc._atomic", "cxlrpc._ring", "cxlrpc._flush", "cxlrpc._frame", "cxlrpc._dispatch",
          "kvservice._block")


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


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_native_stubs_match_the_built_modules() -> None:
    """Every name a stub declares exists in the built module and vice versa, with the same kind
    (class, function, property) and, where the module says it, the same parameters."""
    pytest.importorskip("mypy.stubtest")
    built = [name for name in NATIVE if importlib.util.find_spec(name) is not None]
    if not built:
        pytest.skip("no native module was built (no C compiler at install)")
    done = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", "pyproject.toml", *built],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
