"""The per-host janitor of a flush-mode server region (``python -m cxlrpc janitor URL``).

On memory without coherence a killed process's dirty lines stay in its host's caches and
reach memory whenever they are evicted: no timeout bounds when, and by then the server may have
given that memory to another client (its request ring when it reaped the slot, its heap extents
and kvservice blocks when it fenced it). The server writes back what a client dead on its own
host held (its write-back reaches that host's caches); for a client of another host, only a
process of that host can. The janitor is that process: it maps the region, watches the slot
holders of its host (their PIDs, through pidfds), and when one dies writes back every line it
could have written: its slot's ranges (``cxlrpc.channel.holder_ranges``), the whole heap (the
janitor does not know which extents it held) and the whole of every ``also`` region (a
kvservice pool). See docs/operations.md for the bounds it meets.
"""
from __future__ import annotations

from typing import Sequence

from .channel import KIND_RPC, holder_line, holder_ranges, read_geometry
from .identity import host_identity
from .memory import FLUSH
from .region import HEADER_SIZE, PidWatch, Region, RegionError

#: Seconds between two looks at the slot table (the bound it adds to a death's write-back).
INTERVAL = 0.1


class Janitor:
    """Watches one flush-mode server region's holders of this host; writes back a dead one's
    lines (``look``, once per ``interval``)."""

    def __init__(self, url: str, also: Sequence[str] = ()) -> None:
        self.identity = host_identity()
        #: (slot, generation) -> (PID, its pidfd watch): this host's holders, until they
        #: release their slot or die
        self._watched: dict[tuple[int, int], tuple[int, PidWatch]] = {}
        #: holders whose lines were written back (their process gone)
        self.written_back: list[tuple[int, int]] = []
        self.also: list[Region] = []
        self.region = Region.open(url, KIND_RPC)
        try:
            if self.region.coherence != FLUSH:
                raise RegionError(f"{url} is on coherent memory: a dead process's lines cannot "
                                  f"outlive it there, no janitor is needed")
            self.geo = read_geometry(self.region)
            for other in also:
                self.also.append(Region.open(other))
        except BaseException:
            self.close()
            raise

    def look(self) -> list[tuple[int, int]]:
        """One pass: note the holders of this host, forget those that released their slot,
        and write back the lines of those whose process is gone (a holder reaped while frozen
        too: it is watched until it exits); the (slot, generation) written back now."""
        lines = [holder_line(self.region, self.geo, slot) for slot in range(self.geo.slots)]
        for slot, line in enumerate(lines):
            if line.held and line.identity == self.identity and (slot, line.gen) not in self._watched:
                watch = PidWatch()
                watch.alive(line.pid)  # pins the PID with a pidfd now, while it is the holder's
                self._watched[(slot, line.gen)] = (line.pid, watch)
        done = []
        for (slot, gen), (pid, watch) in list(self._watched.items()):
            if watch.dead(pid):
                self._write_back(slot)
                done.append((slot, gen))
            elif lines[slot].released != gen:
                continue
            watch.close()  # dead and written back, or released cleanly (it wrote its lines back)
            del self._watched[(slot, gen)]
        self.written_back.extend(done)
        return done

    def _write_back(self, slot: int) -> None:
        """Every line the slot's holder could have left dirty in this host's caches."""
        geo, mem = self.geo, self.region.mem
        for offset, length in holder_ranges(geo, slot):
            mem.writeback(offset, length)
        if geo.heap_size:
            mem.writeback(geo.heap, geo.heap_size)
        for region in self.also:
            region.mem.writeback(HEADER_SIZE, region.size - HEADER_SIZE)

    def close(self) -> None:
        for _, watch in self._watched.values():
            watch.close()
        for region in (self.region, *self.also):
            region.close()
