"""A child process for tests/test_use_after_close.py: one use of a closed object, which must
raise rather than crash (on main some died of SIGSEGV). Prints, as JSON, what each step
raised (its type's name and message) or "ok".

    python tests/closed_probe.py SCENARIO URL
"""
from __future__ import annotations

import json
import sys
from typing import Callable

UNIT = 4096


def attempt(fn: Callable[[], object]) -> str:
    """``fn()``'s outcome: "ok", or "TypeName: message"."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def block(url: str) -> dict[str, str]:
    """A leased Block whose view the user released, then its pool closed: check(), view(),
    array(), tobytes() (kvservice._block, or the reference with CXLRPC_NO_NATIVE=1)."""
    import kvservice.pool as kvpool

    pool = kvpool.Pool.create(url, 16 * UNIT, UNIT)
    pool.publish(0, 5)
    lease = pool.leased(0, 2 * UNIT, 5, None, 1)
    before = attempt(lease.check)
    lease.view().release()  # what view() handed out: the Block's own view
    still = attempt(lease.check)  # the pool is open: the check still answers
    pool.retire()
    pool.close()
    native = any(cls.__module__ == "kvservice._block" for cls in type(lease).__mro__)  # (flush mode: FlushBlock)
    return {"native": native, "before": before,
            "released_view": still, "check": attempt(lease.check), "view": attempt(lease.view),
            "array": attempt(lease.array), "tobytes": attempt(lease.tobytes)}


def flush(url: str) -> dict[str, str]:
    """A flush-mode region's write-back, invalidate and zero after Region.close()."""
    from cxlrpc.region import Region

    region = Region.create(url, 1 << 20, 1, coherence="flush")
    region.publish()
    mem = region.mem
    region.close()
    region.unlink()
    return {"writeback": attempt(lambda: mem.writeback(0, 1 << 20)),
            "invalidate": attempt(lambda: mem.invalidate(0, 1 << 20)),
            "zero": attempt(lambda: mem.zero(0, 1 << 20))}


if __name__ == "__main__":
    scenario, where = sys.argv[1], sys.argv[2]
    print(json.dumps({"block": block, "flush": flush}[scenario](where)))
