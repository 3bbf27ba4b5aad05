"""Types of ``kvservice._block`` (kvservice/_block.c): the leased Block a zero-copy get makes, in C
(kvservice.pool.ReferenceBlock is the reference; kvservice.pool.Block derives from this one)."""
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, final

from typing_extensions import Self, disjoint_base

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
    def release(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def __len__(self) -> int: ...

_B = TypeVar("_B", bound=Block)
_O = TypeVar("_O", bound=_Owner)

@final
class Leaser(Generic[_B, _O]):
    """A coherent pool's ``leased()`` in C; ``reference`` takes what it refuses."""

    def __new__(cls, block_type: type[_B], readable: memoryview, pool: _Pool,
                reference: Callable[[int, int, int, _O, int], _B], capacity: int, alignment: int, table: int,
                data: int, /) -> Leaser[_B, _O]: ...
    def lease(self, offset: int, size: int, version: int, owner: _O, lease_id: int, /) -> _B:
        """The Block a lease names."""
