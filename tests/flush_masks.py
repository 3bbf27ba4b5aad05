"""One write-back or invalidate call of the Python reference removed, as a mutation test removes
it: ``remove(monkeypatch, where)`` makes ``AtomicMemory.writeback``/``invalidate`` do nothing
when called from that file and line, in every mapping of this process (the site is gone, not
one call of it). Sites are named by function, so they survive edits around them."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import cxlrpc
from cxlrpc.memory import AtomicMemory

PACKAGES = Path(cxlrpc.__file__).resolve().parents[1]  # the tree the tests import


def site(relpath: str, function: str, nth: int = 0) -> tuple[str, int]:
    """(file, line) of the ``nth`` write-back or invalidate call, in source order, of
    ``function`` ("Class.method", or a module-level function) in ``relpath``."""
    path = PACKAGES / relpath
    tree = ast.parse(path.read_text())
    owner, _, name = function.rpartition(".")
    scope = tree.body
    if owner:
        scope = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    calls = sorted(c.lineno for c in ast.walk(fn) if isinstance(c, ast.Call)
                   and isinstance(c.func, ast.Attribute) and c.func.attr in ("writeback", "invalidate"))
    return str(path), calls[nth]


def remove(monkeypatch: pytest.MonkeyPatch, where: tuple[str, int]) -> None:
    """Make the call at ``where`` (from ``site``) do nothing until the test ends."""
    for name in ("writeback", "invalidate"):
        original = getattr(AtomicMemory, name)

        def skipping(self: AtomicMemory, offset: int, length: int, _original=original) -> None:
            caller = sys._getframe(1)
            if (caller.f_code.co_filename, caller.f_lineno) != where:
                _original(self, offset, length)

        monkeypatch.setattr(AtomicMemory, name, skipping)
