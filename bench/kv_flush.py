"""kvservice reads in flush mode beside hardware mode, in alternated rounds of one run:
``python bench/kv_flush.py --rounds 6 --n 300 [--json PATH]``.

Each round runs, once per mode (order alternating), a process that starts ``python -m kvservice
serve --coherence MODE`` (256 MiB pool) and times from a KVClient (asyncio), at 4 KiB, 64 KiB
and 1 MiB: a zero-copy get (``get``: lease, ``view()``, read one byte, release, as the kv
section of ``python -m bench`` does), the same reading the whole value (``get+read``: the
view compared with what was put), and a copy into a preallocated buffer (``get_into``), of 8
keys in turn; and ``get first`` / ``get_into first``, of a version just put (untimed), which
this mapping never read: in flush mode a read of a version already read skips the block's
invalidation (kvservice._block's memo), a first read pays it. Every
read is verified against the value put (8 keys per size, each its own bytes): in ``get`` and
``get_into`` after the clock stops (the lease still held), in ``get+read`` on the clock. An
untimed ``exists`` call precedes each timed one: a verification's gap (~100 us at 1 MiB) lets
an adaptive server park and a flush-mode one back its polling off, which the next call would
pay (a wake-up, not the read). The
``block`` rows time the client's block alone, no RPC: ``Pool.leased`` of a lease a get
returned, then ``view()`` and one byte read and release (``block view``), or a copy out
(``block copy``: ``copy_into``), verified the same way. The table: per mode, the median
across rounds of each round's p50 and p99, and flush / hardware.
On this machine's coherent memory flush mode's write-backs and invalidations are real
instructions: a lower bound of their cost on memory without coherence.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from ab import _pct  # run as a script: bench/ is on sys.path
from pool_connect import serving

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"4K": 4 * KiB, "64K": 64 * KiB, "1M": MiB}
KINDS = ("get", "get+read", "get_into", "get first", "get_into first", "block view", "block copy")
OPS = tuple(f"{kind} {size}" for size in SIZES for kind in KINDS)
MODES = ("hardware", "flush")


async def _measure(url: str, n: int) -> dict[str, list[int]]:
    from kvservice import KVClient

    out: dict[str, list[int]] = {op: [] for op in OPS}
    clock = time.perf_counter_ns
    kv = await KVClient.connect(url)
    leases: dict[int, tuple[int, int, int]] = {}  # per block size: (offset, size, version) of a get
    leased = kv.pool.leased

    def recorded(offset: int, size: int, version: int, owner: object, lease_id: int) -> object:
        leases[size] = (offset, size, version)
        return leased(offset, size, version, owner, lease_id)
    kv.pool.leased = recorded

    async def timed_view(key: str, want: bytes, what: str) -> float:
        """A zero-copy get of ``key`` and one byte of its view, timed (the check of its bytes
        against ``want`` off the clock)."""
        await kv.exists(key)  # each timed call finds the server awake (see the docstring)
        t0 = clock()
        block = await kv.get(key)
        view = block.view()
        view[0]
        t1 = clock()
        if view.tobytes() != want:
            raise AssertionError(f"{what}: wrong bytes")
        t2 = clock()
        block.release()
        return t1 - t0 + clock() - t2
    try:
        for label, size in SIZES.items():
            values = [os.urandom(size) for _ in range(8)]
            for i, data in enumerate(values):
                await kv.put(f"{label}-{i}", data)
            buf = bytearray(size)
            for i in range(n + n // 5):  # the first sixth is warm-up
                key, want = f"{label}-{i % 8}", values[i % 8]
                get = await timed_view(key, want, f"get {label}")
                await kv.exists(key)
                t0 = clock()
                with await kv.get(key) as block:
                    if block.view().tobytes() != want:
                        raise AssertionError(f"get+read {label}: wrong bytes")
                read = clock() - t0
                await kv.exists(key)
                t0 = clock()
                if await kv.get_into(key, buf) != size:
                    raise AssertionError(f"get_into {label}: wrong size")
                into = clock() - t0
                if buf != want:
                    raise AssertionError(f"get_into {label}: wrong bytes")
                await kv.put(key, want)  # a new version: one this mapping never read
                first = await timed_view(key, want, f"get first {label}")
                await kv.put(key, want)
                await kv.exists(key)
                t0 = clock()
                if await kv.get_into(key, buf) != size:
                    raise AssertionError(f"get_into first {label}: wrong size")
                into_first = clock() - t0
                if buf != want:
                    raise AssertionError(f"get_into first {label}: wrong bytes")
                with await kv.get(key) as held:  # the lease the block rows use is held meanwhile
                    t0 = clock()
                    block = leased(*leases[size], None, 0)
                    view = block.view()
                    view[0]
                    t1 = clock()
                    if view.tobytes() != want:
                        raise AssertionError(f"block view {label}: wrong bytes")
                    t2 = clock()
                    block.release()
                    alone = t1 - t0 + clock() - t2
                    t0 = clock()
                    with leased(*leases[size], None, 0) as block:
                        block.copy_into(buf)
                    copied = clock() - t0
                    if buf != want or held.size != size:
                        raise AssertionError(f"block copy {label}: wrong bytes")
                if i >= n // 5:
                    out[f"get {label}"].append(get)
                    out[f"get+read {label}"].append(read)
                    out[f"get_into {label}"].append(into)
                    out[f"get first {label}"].append(first)
                    out[f"get_into first {label}"].append(into_first)
                    out[f"block view {label}"].append(alone)
                    out[f"block copy {label}"].append(copied)
    finally:
        await kv.close()
    return out


def _child(n: int, mode: str) -> None:
    with serving(f"bench-kvf-{mode[0]}", "256MiB", coherence=mode) as url:
        print(json.dumps(asyncio.run(_measure(url, n))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n", type=int, default=300, help="timed reads per size and kind per round")
    parser.add_argument("--json", default=None, help="write every round's p50 and p99 (us) here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="hardware", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.mode)
        return
    per: dict[str, dict[str, list[tuple[float, float]]]] = {m: {} for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(args.n),
                                   "--mode", mode], check=True, capture_output=True, text=True, timeout=600)
            for op, samples in json.loads(done.stdout.strip().splitlines()[-1]).items():
                per[mode].setdefault(op, []).append((_pct(samples, 50), _pct(samples, 99)))
            print(f"round {r + 1}/{args.rounds} {mode} done", file=sys.stderr, flush=True)
    print(f"{args.rounds} rounds, medians of per-round figures (us), every read verified")
    print(f"{'op':<16} {'hw p50':>8} {'flush p50':>10} {'ratio':>6} | {'hw p99':>8} {'flush p99':>10} {'ratio':>6}")
    for op in OPS:
        h50, h99 = (statistics.median(x) for x in zip(*per["hardware"][op]))
        f50, f99 = (statistics.median(x) for x in zip(*per["flush"][op]))
        print(f"{op:<16} {h50:>8.1f} {f50:>10.1f} {f50 / h50:>6.2f} | {h99:>8.1f} {f99:>10.1f} {f99 / h99:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "n": args.n, "per_round_p50_p99_us": per}, f, indent=1)


if __name__ == "__main__":
    main()
