"""Types of ``cxlrpc._flush`` (cxlrpc/_flush.c): cache-line write-back/invalidate and the copies
that publish or follow a body (see cxlrpc.memory, the reference)."""
from typing import Callable, Literal, final

from typing_extensions import Buffer

def writeback(address: int, length: int, /) -> None: ...
def invalidate(address: int, length: int, /) -> None: ...
def stream_copy(dst: Buffer, src: Buffer, /) -> None: ...
def stream_bytes(src: Buffer, /) -> bytes: ...
def copy(dst: Buffer, src: Buffer, /) -> None: ...
def copied(src: Buffer, /) -> bytes: ...
def publish_copy(dst: Buffer, src: Buffer, progress: Buffer, chunk: int, seal: Buffer = ..., expected: int = ...,
                 /) -> bool:
    """False: the seal changed, and the copy stopped there."""

def follow_copy(src: Buffer, progress: Buffer, stall: float, limit: float, seal: Buffer = ..., expected: int = ...,
                /) -> bytes | Literal[False] | None:
    """None: the writer stalled or ran out of time; False: the seal changed."""

BODY_CHUNK: int
"""Lines.read_body invalidates and copies a body this many bytes at a time."""

def publish_flushed(lines: Lines, at: int, src: Buffer, progress_at: int, chunk: int, seal_at: int = ...,
                    expected: int = ..., /) -> bool:
    """publish_copy without coherence (offsets in the mapping; seal_at -1: none). False: the seal changed."""

def follow_flushed(lines: Lines, at: int, length: int, progress_at: int, stall: float, limit: float,
                   seal_at: int = ..., expected: int = ..., /) -> bytes | Literal[False] | None:
    """follow_copy without coherence. None: the writer stalled or ran out of time; False: the seal changed."""

def features() -> str: ...
def sites() -> tuple[tuple[str, str], ...]:
    """The flush sites, by number (0: none): (name, what it protects)."""

@final
class Lines:
    """Write-back and invalidation over one mapping (the CPU's instructions, or a simulator's
    hooks), counted; the native paths call it through cxlrpc/_flush_api.h."""

    def __init__(self, address: int, size: int, writeback: Callable[[int, int], object] | None = None,
                 invalidate: Callable[[int, int], object] | None = None) -> None: ...
    def writeback(self, offset: int, length: int, /) -> None: ...
    def invalidate(self, offset: int, length: int, /) -> None: ...
    def write_body(self, offset: int, src: Buffer, /) -> None:
        """Copy ``src`` to ``offset`` with streaming stores (one write-back and fence counted)."""

    def read_body(self, offset: int, length: int, /) -> bytes:
        """A copy of the range, each chunk invalidated right before it is copied (counted)."""

    def close(self) -> None: ...
    def counts(self) -> dict[str, int]: ...
    def reset(self) -> None: ...
    def site_counts(self) -> dict[str, tuple[int, int]]:
        """Per site called since the last reset (by name): (calls, fences)."""
    skip: int
    @property
    def simulated(self) -> bool: ...

@final
class Follower:
    """A followed body taken a step at a time (with ``copy``, into bytes only take() hands out)."""

    def __init__(self, length: int, copy: bool) -> None: ...
    def step(self, src: Buffer, progress: Buffer, spin: float, budget: float, /) -> int: ...
    def step_flushed(self, lines: Lines, at: int, progress_at: int, spin: float, budget: float, /) -> int:
        """step without coherence, through ``lines`` (offsets in its mapping)."""

    def take(self) -> bytes | None: ...
    @property
    def done(self) -> int: ...
