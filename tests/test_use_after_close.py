"""Use after close raises, never crashes (issue 40, items 10 and 11): a leased Block whose
view its user released, read after its pool closed, and a flush-mode region's write-back,
invalidate and zero after Region.close(). Each runs in a child process (on main both died of
SIGSEGV), natively and, for the Block, with the Python reference."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from procs import run_python

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "closed_probe.py")
MEMORIES = ("shm", "sim")


async def probe(scenario: str, url: str, native: bool = True) -> dict:
    """tests/closed_probe.py's outcomes; it must exit by itself, not by a signal."""
    env = dict(os.environ)
    env.pop("CXLRPC_NO_NATIVE", None)
    if not native:
        env["CXLRPC_NO_NATIVE"] = "1"
    status, out, err = await run_python([PROBE, scenario, url], 60, env)
    assert status == 0, f"the probe ended with status {status} (a negative one: a signal)\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
async def test_a_block_outliving_its_pool_raises(url, native):
    """Block.view() hands out the view that kept the mapping; released by its user, then the
    pool closed: check(), view(), array() and tobytes() raise ValueError (the same in C and in
    the reference), while the pool was open the check still answered."""
    if native and importlib.util.find_spec("kvservice._block") is None:
        pytest.skip("kvservice._block is not built")
    got = await probe("block", url + ".pool", native)
    assert got["native"] is native
    assert got["before"] == got["released_view"] == "ok", got
    closed = f"ValueError: the pool {url}.pool was closed: its blocks can no longer be read"
    assert [got[k] for k in ("check", "view", "array", "tobytes")] == [closed] * 4, got


async def test_flushes_after_close_raise(url):
    """A flush-mode region's write-back and invalidate (their hooks hold its address) and
    zero raise ValueError after Region.close(), instead of touching unmapped memory."""
    got = await probe("flush", url)
    closed = "ValueError: operation on a closed AtomicMemory (its region was closed)"
    assert got == {"writeback": closed, "invalidate": closed, "zero": closed}
