"""Run a coroutine on uvloop when it is installed, on plain asyncio otherwise."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Protocol, TypeVar

T = TypeVar("T")


class _Uvloop(Protocol):
    """The part of uvloop used here: a protocol, so ``uvloop`` may be None."""

    def run(self, main: Coroutine[Any, Any, T], /) -> T: ...


uvloop: _Uvloop | None
try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` with uvloop's event loop where available (what users run in production)."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)
