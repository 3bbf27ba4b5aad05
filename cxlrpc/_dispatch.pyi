"""Types of ``cxlrpc._dispatch`` (cxlrpc/_dispatch.c): the server's request dispatch and the
client's call in C, for the common call shape (Server._dispatch and Client.call are the
reference). Both take their many arguments positionally, as the server and client bind them
once per connection; the objects the C code only calls back by name are typed ``object``."""
from collections.abc import Callable, Sized
from contextvars import ContextVar
from types import NotImplementedType
from typing import Any, final

from ._flush import Lines
from ._ring import RingCore
from .frame import Frame
from .ring import MpscRing, SpscRing

@final
class Dispatcher:
    """The request ring's handler (called with a record's view, as Server._on_request is)."""

    #: 0 sends every frame to the reference (draining, interceptors)
    enabled: int
    #: when the reader began its batch: deadlines count from it
    polled_at: float
    def __init__(self, server: object, buf: memoryview, slot_at: list[int], seen: list[int | None],
                 peers: dict[Any, Any], backlog: dict[Any, Any], methods: dict[Any, Any],
                 responses: list[SpscRing], chan: object, context_type: Callable[..., object],
                 no_metadata: object, current_call: ContextVar[Any], ring_client: Callable[..., object],
                 encode_body: Callable[..., object], loop: object, current_task: Callable[..., object],
                 enter_task: Callable[..., object], leave_task: Callable[..., object],
                 eager_type: Callable[..., object], cancelled: type[BaseException], reply_limit: int,
                 frame_type: Callable[..., object], current_tasks: object, parked_at: list[int], me: int,
                 heap: object, heap_waiting: list[Any], heap_start: int, heap_size: int, follow_min: int,
                 body_limit: int, follow_chunk: int, pack: Callable[..., object], gen_mask: int = ...,
                 /) -> None: ...
    @property
    def batch(self) -> int:
        """The records the next batch takes (sized to the last batch's pace)."""
    def __call__(self, view: memoryview, /) -> None: ...
    def poll(self, ring: RingCore | list[SpscRing], now: float, until: float, /) -> int: ...
    def serve(self, ring: RingCore | list[SpscRing], seconds: float, until: float, /) -> int: ...
    def dispatch_body(self, slot: int, gen: int, call_id: int, flags: int, timeout: float, method: bytes,
                      body: bytes, /) -> bool:
        """False: nothing was done for it (the reference takes it)."""

@final
class Caller:
    """A connection's calls of the common shape (called with a record's view, it is the reply
    ring's handler during the hot wait)."""

    def __init__(self, client: object, methods: dict[str, bytes], requests: MpscRing | SpscRing,
                 push_args: tuple[object, ...], ring_bell: Callable[[], object], ring: SpscRing,
                 encode_body: Callable[..., object], decode: Callable[..., object], slot: int, gen: int,
                 max_payload: int, buf: memoryview, bell_at: int, me: int, idle_when: tuple[Sized, ...],
                 turn_when: tuple[Sized, ...], in_place: set[bytes], heap_start: int, heap_size: int,
                 follow_chunk: int, follow_stall: float, follow_rate: float, pack: Callable[..., object],
                 grant_at: int = ..., grant: int = ..., lines: Lines | None = ..., /) -> None: ...
    def __call__(self, view: memoryview, /) -> None: ...
    def call(self, method: str, arg: object, timeout: float, call_id: int, hot: float,
             raw: bool | Callable[[bytes], object], spin: float = ..., turned: bool = ...,
             spare: tuple[int, int] | None = ..., /
             ) -> Frame | bytes | list[Any] | tuple[int, bytes | bytearray | memoryview] | NotImplementedType | None:
        """The reply Frame; with ``raw`` True a raw reply's body; with ``raw`` a decode function,
        ``[the value it decoded]``; None: the request is out, its reply not here yet;
        (flags, body): it did not go; NotImplemented: the reference must make this call."""
