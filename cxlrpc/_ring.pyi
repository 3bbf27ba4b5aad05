"""Types of ``cxlrpc._ring`` (cxlrpc/_ring.c): a ring's counters and its hot path (over coherent
memory, and an SPSC ring's over memory without coherence, through the region's ``Lines``), the
base of cxlrpc.ring.base.RingBase (whose ``_py`` methods are the reference).

Calls the native code cannot vouch for (keywords, odd arguments, an MPSC ring without coherence,
memory that flushes without ``Lines``) go to the subclass's reference methods (``_poll_py``,
``_poll_within_py``, ``_readable_py``, ``_try_push_parts_py``).
"""
from collections.abc import Callable, Sequence

from typing_extensions import CapsuleType, disjoint_base

from ._atomic import AtomicU64
from ._flush import Lines

@disjoint_base
class RingCore:
    #: the consumer's own copy of its counter
    _head_local: int
    #: an SPSC producer's own copy of its counter
    _tail_local: int
    #: the producer's last valid view of the head
    _head_cache: int
    #: the tail from which the producer next looks for an early wrap
    _wrap_from: int
    #: corrupt records or counters the consumer discarded
    dropped: int
    def __init__(self, buf: memoryview, offset: int, capacity: int, multi_producer: bool,
                 lines: Lines | None = None, flushing: bool = False) -> None: ...
    def readable(self) -> bool: ...
    def poll(self, handler: Callable[[memoryview], object], limit: int = ...) -> int: ...
    def poll_within(self, handler: Callable[[memoryview], object], limit: int, seconds: float) -> int: ...
    def _push_spsc(self, parts: Sequence[bytes | bytearray | memoryview]) -> bool: ...
    def _push_mpsc(self, parts: Sequence[bytes | bytearray | memoryview], producer: int = 0, tag: int = 0,
                   claim: AtomicU64 | None = None, revoked: Callable[[], bool] | None = None) -> bool: ...

#: the rings' C API for cxlrpc._dispatch (cxlrpc/_ring_api.h)
_C_API: CapsuleType
