"""The two peers of tests/test_noncoherent.py: SpscRings over a region (a ``sim://`` one, or a
flush-mode ``shm://`` one), optionally with one flush or invalidate call of the ring code
removed (a mutation), to show the simulator catches it.

``python nc_ring_peer.py send|echo URL CAPACITY COUNT EVICTION GATE [FILE:LINE]``: ring A (at the
region's first data page) carries records from ``send`` to ``echo``, ring B (after it) carries
each one back. ``send`` waits for every echo before its next push, so every single push and
every batch must be published on its own. Both check sequence numbers and checksums; ``send``
prints ``ok N``, ``bad ...`` or ``timeout ...``. With GATE=1 the readers ask ``readable()``
before each ``pop_batch()``, with 0 they poll directly (each path must stand on its own).
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import sys
import time
import types
from pathlib import Path

RING = Path(__file__).resolve().parents[1] / "cxlrpc" / "ring"
DEADLINE_S = 4.0  # a transfer takes ~0.2 s; a mutation that stalls it waits this long for progress


def guarded_sites() -> list[tuple[str, int]]:
    """The ring code's flush and invalidate calls that sit under ``if self._flushing:``."""
    sites = []
    for name in ("base.py", "spsc.py"):
        lines = (RING / name).read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.strip() == "if self._flushing:" and re.search(r"\.(writeback|invalidate)\b", lines[i + 1]):
                sites.append((name, i + 2))
    return sites


def ring_class(mutation: str | None) -> type:
    """SpscRing, with the call at ``FILE:LINE`` replaced by ``pass`` when a mutation is given."""
    import cxlrpc.ring  # the package first, unmutated: only the ring modules are swapped below
    if mutation is None:
        return cxlrpc.ring.SpscRing
    target, lineno = mutation.split(":")
    for name in ("base.py", "spsc.py"):  # base first: spsc's RingBase must be the mutated one
        lines = (RING / name).read_text().splitlines()
        if name == target:
            code = lines[int(lineno) - 1]
            lines[int(lineno) - 1] = code[:len(code) - len(code.lstrip())] + "pass"
        module = types.ModuleType(f"cxlrpc.ring.{name[:-3]}")
        module.__package__ = "cxlrpc.ring"
        module.__file__ = str(RING / name)
        sys.modules[module.__name__] = module
        exec(compile("\n".join(lines), str(RING / name), "exec"), module.__dict__)
    return sys.modules["cxlrpc.ring.spsc"].SpscRing


def record(i: int, rng: random.Random) -> bytes:
    body = rng.randbytes(rng.randrange(0, 300))
    head = i.to_bytes(8, "little") + hashlib.blake2b(body, digest_size=8).digest()
    return head + body


def intact(view: bytes, seq: int) -> bool:
    return (int.from_bytes(view[:8], "little") == seq
            and hashlib.blake2b(view[16:], digest_size=8).digest() == view[8:16])


def ring_offsets(capacity: int) -> tuple[int, int]:
    from cxlrpc.region import HEADER_SIZE
    from cxlrpc.ring import ring_size

    return HEADER_SIZE, HEADER_SIZE + ring_size(capacity)


def main(argv: list[str]) -> int:
    role, url, capacity, count, eviction, gate = argv[:6]
    mutation = argv[6] if len(argv) > 6 else None
    gate = gate == "1"
    capacity, count = int(capacity), int(count)
    import cxlrpc.simulator

    cxlrpc.simulator.EVICTION_RATE = float(eviction)
    cls = ring_class(mutation)
    from cxlrpc.region import Region

    region = Region.open(url)
    off_a, off_b = ring_offsets(capacity)
    a = cls(region.buf, region.mem, off_a, capacity)
    b = cls(region.buf, region.mem, off_b, capacity)
    out, back = (a, b) if role == "send" else (b, a)
    deadline = time.monotonic() + DEADLINE_S
    rng = random.Random(count)
    try:
        done = 0
        while done < count:
            if role == "send":
                n = min(3, count - done) if done % 4 == 3 else 1  # single pushes and batches
                batch = [record(done + k, rng) for k in range(n)]
                pushed = out.try_push_batch(batch) if n > 1 else int(out.try_push_parts((batch[0][:16], batch[0][16:])))
                if pushed != n:
                    print(f"bad push at {done}: ring full with nothing in flight", flush=True)
                    return 0
                want = done + n
            else:
                want = done + 1
            while done < want:
                if time.monotonic() > deadline:
                    print(f"timeout after {done} records", flush=True)
                    return 1
                if gate and not back.readable():
                    os.sched_yield()  # on a busy machine, hand the core to the peer
                    continue
                views = back.pop_batch()
                if not views:
                    os.sched_yield()
                for view in views:
                    if not intact(view, done):
                        print(f"bad record at {done}", flush=True)
                        return 0
                    if role == "echo" and not out.try_push(view):
                        print(f"bad echo at {done}: ring full", flush=True)
                        return 0
                    done += 1
                    deadline = time.monotonic() + DEADLINE_S  # progress: the clock starts over
        print(f"ok {done}", flush=True)
        return 0
    finally:
        del a, b, out, back
        region.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
