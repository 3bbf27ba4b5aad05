"""Put and get latencies of two checkouts, in alternated rounds (what a pool change costs the
hot path): ``python bench/pool_ab.py --a /path/before --b /path/after --rounds 6``.

Each round runs, once per checkout (order alternating), a process that starts ``python -m
kvservice serve`` (1 GiB pool), connects a KVClient and times: a put of a new 1 MiB key
(``put_new``), zero-copy gets of 64 KiB and 1 MiB (``get``, reading one byte, as the kv section
of ``python -m bench`` does), and a first full read of 1 MiB blocks another client wrote
(``first_read``: a new KVClient, whose mapping never touched them; minor faults per read too).
The table shows, per checkout, the median across rounds of each round's p50 and p99, and B/A.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import time

import numpy as np

from ab import cli  # run as a script: bench/ is on sys.path
from pool_connect import serving

MiB = 1 << 20
OPS = ("put_new 1M", "get 64K", "get 1M", "first_read 1M")


async def _settled(kv) -> None:
    """Wait for the thread that populates a client's whole mapping at connect (the old design:
    ``pool._prefault``; the new one has none)."""
    thread = getattr(kv.pool, "_prefault", None)
    deadline = time.monotonic() + 60
    while thread is not None and thread.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError("prefault thread still running")
        await asyncio.sleep(0.005)


async def _measure(url: str, n: int) -> dict[str, list[int]]:
    from kvservice import KVClient

    out: dict[str, list[int]] = {op: [] for op in OPS}
    out["first_read faults"] = []
    clock = time.perf_counter_ns
    kv = await KVClient.connect(url)
    try:
        await _settled(kv)
        big, small = os.urandom(MiB), os.urandom(64 << 10)
        for i in range(8):
            await kv.put(f"get-1M-{i}", big)
            await kv.put(f"get-64K-{i}", small)
        for i in range(n + n // 10):  # the first tenth is warm-up
            t = clock()
            await kv.put(f"new-{i}", big)
            if i >= n // 10:
                out["put_new 1M"].append(clock() - t)
        for size in ("64K", "1M"):
            for i in range(4 * n + n // 2):
                t = clock()
                with await kv.get(f"get-{size}-{i % 8}") as block:
                    block.view()[0]
                if i >= n // 2:
                    out[f"get {size}"].append(clock() - t)
        reader = await KVClient.connect(url)  # a mapping that never touched those blocks
        try:
            await _settled(reader)
            for i in range(n // 10, n + n // 10):
                t, faults = clock(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                with await reader.get(f"new-{i}") as block:
                    if np.frombuffer(block.view(), np.uint64).sum() == 1:  # reads every byte
                        raise AssertionError("unlikely sum")
                out["first_read 1M"].append(clock() - t)
                out["first_read faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        finally:
            await reader.close()
    finally:
        await kv.close()
    return out


def _child(n: int) -> None:
    with serving("bench-ab", "1GiB") as url:
        print(json.dumps(asyncio.run(_measure(url, n))), flush=True)


def main() -> None:
    cli(__doc__, os.path.abspath(__file__), _child, (*OPS, "first_read faults"), 6, "timed puts per round (gets: 4x)")


if __name__ == "__main__":
    main()
