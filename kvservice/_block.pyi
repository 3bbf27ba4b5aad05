"""Types of ``kvservice._block`` (kvservice/_block.c): the leased Block a zero-copy get makes, in C
(kvservice.pool.ReferenceBlock is the reference; kvservice.pool.Block derives from this one)."""
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, final

from typing_extensions import Buffer, Self, disjoint_base

from cxlrpc._flush import Lines

class _Owner(Protocol):
    """What ends a lease: ``_release(lease_id, collected)``."""

    def _release(self, lease_id: int, collected: bool, /) -> object: ...

class _Pool(Protocol):
    """What tells whether a block still holds its value: ``holds(entry, version)``."""

    def holds(self, entry: int, version: int, /) -> bool: ...

@disjoint_base
class Block:
    """A leased value read in place; ``with`` ends the lease."""

    @property
    def size(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def __new__(cls, view: memoryview, version: int = 0, owner: _Owner | None = None, lease_id: int = 0,
                pool: _Pool | None = None, entry: int = 0) -> Self: ...
    def check(self) -> None:
        """Raise LeaseExpired if the block no longer holds this value."""
    def view(self) -> memoryview: ...
    def _tracked_view(self) -> memoryview: ...
    def _copy_into_lines(self, out: Buffer, /) -> int:
        """Flush mode's copy_into: each chunk invalidated right before it is copied, checked after."""
    def _tobytes_lines(self) -> bytes:
        """Flush mode's tobytes: each chunk invalidated right before it is copied, checked after."""
    def release(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def __len__(self) -> int: ...

_B = TypeVar("_B", bound=Block)
_O = TypeVar("_O", bound=_Owner)

@final
class Leaser(Generic[_B, _O]):
    """The pool's ``leased()`` in C (flush mode given ``lines``); ``reference`` takes what it refuses."""

    def __new__(cls, block_type: type[_B], readable: memoryview, pool: _Pool,
                reference: Callable[[int, int, int, _O, int], _B], capacity: int, alignment: int, table: int,
                data: int, lines: Lines | None = None, /) -> Leaser[_B, _O]: ...
    def lease(self, offset: int, size: int, version: int, owner: _O, lease_id: int, /) -> _B:
        """The Block a lease names."""
    def write(self, offset: int, data: Buffer, /) -> None:
        """Flush mode: stream data into the pool at offset, then a store fence."""
    def written(self, offset: int, size: int, /) -> None:
        """Flush mode: write the block back before its commit (store fence)."""
    def given_back(self, offset: int, size: int, /) -> None:
        """Flush mode: write the block back before it is freed unpublished (store fence)."""
