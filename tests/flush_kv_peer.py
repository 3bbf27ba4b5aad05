"""A kvservice client process for tests/test_flush_native_kv.py (spawn): runs the commands it is
sent on a blocking client and sends back what each returned, so a writer and a reader each work
in a process (a cache, over sim://) of their own. Imports nothing of the project at module level:
the parent picks the reference or the native paths through the environment it starts it with."""
from __future__ import annotations

import hashlib
import random
from typing import Any

BIG = 8 << 20  # the largest value a command reads into a buffer


def value(seed: int, size: int) -> bytes:
    """The bytes a command writes for ``seed`` (the same in every process)."""
    return random.Random(seed).randbytes(size)


def digest(data: Any) -> str:
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()


def _read(kv: Any, key: str, how: str) -> str:
    """Read ``key`` one way: a view (checked after reading), a copy as bytes, a copy into a
    buffer, a numpy array (checked after reading)."""
    if how == "bytes":
        return digest(kv.get_bytes(key))
    if how == "into":
        out = bytearray(BIG)
        return digest(memoryview(out)[:kv.get_into(key, out)])
    with kv.get(key) as block:
        data = digest(block.view() if how == "view" else block.array().tobytes())
        block.check()
        return data


def _read_held(block: Any, how: str) -> str:
    """Read a block leased earlier (its lease may have lapsed meanwhile), then release it."""
    with block:
        if how == "bytes":
            return digest(block.tobytes())
        if how == "into":
            out = bytearray(block.size)
            block.copy_into(out)
            return digest(out)
        data = digest(block.view())
        block.check()
        return data


def peer_main(url: str, eviction: float | None, skip: str | None, commands: Any, results: Any) -> None:
    """Connect, set the simulator's eviction rate and the flush site to skip (a mutation), say
    which Block kind reads, then run commands until ("stop",)."""
    import cxlrpc.simulator

    if eviction is not None:
        cxlrpc.simulator.EVICTION_RATE = eviction
    from cxlrpc import _flush
    from kvservice import KeyNotFound, LeaseExpired, SyncKVClient

    kv = SyncKVClient.connect(url)
    held: dict[str, Any] = {}
    try:
        lines = kv.pool.region.mem.lines
        if skip is not None:
            lines.skip = [site for site, _ in _flush.sites()].index(skip)
        results.put(kv.pool.leased == kv.pool._leased)  # True: the reference's leased
        while True:
            cmd, *args = commands.get()
            if cmd == "stop":
                break
            try:
                if cmd == "put":
                    key, seed, size = args
                    out: Any = kv.put(key, value(seed, size))
                elif cmd in ("fill", "abort"):
                    key, seed, size = args
                    pending = kv.begin_put(key, size)
                    pending.view()[:] = value(seed, size)
                    out = pending.commit() if cmd == "fill" else pending.abort()
                    out = "ok"
                elif cmd == "remove":
                    out = kv.remove(args[0])
                elif cmd == "read":
                    out = _read(kv, *args)
                elif cmd == "hold":
                    key, lease_s = args
                    held[key] = kv.get(key, lease_s=lease_s)
                    out = "ok"
                elif cmd == "read_held":
                    key, how = args
                    out = _read_held(held.pop(key), how)
                else:
                    raise ValueError(f"unknown command {cmd}")
            except (LeaseExpired, KeyNotFound) as exc:
                out = type(exc).__name__
            except Exception as exc:  # noqa: BLE001 - a mutation's symptom, reported as such
                out = f"error: {exc!r}"
            results.put(out)
    finally:
        for block in held.values():
            block.release()
        kv.close()
