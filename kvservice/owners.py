"""The key index's owners (cxlrpc peers): what each holds, and the quarantine of a departed
writer's blocks until it is fenced (see "Fencing" in kvservice.index)."""
from __future__ import annotations

from collections.abc import Callable, Hashable

from kvservice.keymap import BlockRec, KeyMap
from kvservice.leases import Leases
from kvservice.puts import Puts


class Owners:
    """Owner -> ids of its leases and tickets (``records``, shared with the leases and puts
    that add and drop them), and the blocks quarantined from departed owners."""

    def __init__(self, records: dict[Hashable, set[int]], keys: KeyMap, leases: Leases,
                 puts: Puts, on_reclaim: Callable[[int, int], None] | None = None) -> None:
        #: an owner's entry lasts until release (a server's connections all end so): one set
        #: per get and release to make and drop was a tenth of a get's cost
        self.records = records
        self._keys = keys
        self._leases = leases
        self._puts = puts
        #: owner -> blocks its pending puts held when it departed: kept until fence
        self.quarantine: dict[Hashable, list[BlockRec]] = {}
        self.quarantined_bytes = 0
        #: (offset, nbytes) of each quarantined block as its owner is fenced, before it is freed
        self._on_reclaim = on_reclaim

    def release(self, owner: Hashable) -> int:
        """End ``owner``'s leases, quarantine its pending blocks; how many records it held."""
        ids = self.records.pop(owner, ())
        for record_id in ids:
            if self._leases.end_held(record_id):
                continue
            block = self._puts.take(record_id).block
            self.quarantine.setdefault(owner, []).append(block)
            self.quarantined_bytes += block.nbytes
        return len(ids)

    def fence(self, owner: Hashable) -> int:
        """Free the blocks quarantined from ``owner``; how many."""
        blocks = self.quarantine.pop(owner, ())
        for block in blocks:
            self.quarantined_bytes -= block.nbytes
            if self._on_reclaim is not None:
                self._on_reclaim(block.offset, block.nbytes)
            self._keys.free(block)
        return len(blocks)

    def quarantined_blocks(self) -> int:
        """How many blocks wait for their writer's fence."""
        return sum(map(len, self.quarantine.values()))
