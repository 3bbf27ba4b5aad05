"""Client processes the kvservice tests start (spawn): a lease holder to kill, and churn workers."""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time

DIGEST = 16


def make_value(key: bytes, writer: int, seq: int, size: int) -> bytes:
    """8-byte seq (writer in the top byte) + payload (writer, key, filler) + blake2b of both."""
    head = (writer << 56 | seq).to_bytes(8, "little")
    payload = bytes([writer]) + key + os.urandom(max(0, size - 9 - len(key) - DIGEST))
    return head + payload + hashlib.blake2b(head + payload, digest_size=DIGEST).digest()


def check_value(key: bytes, data) -> tuple[int, int]:
    """(writer, seq) of a value read back; AssertionError if it is torn or not ``key``'s."""
    data = memoryview(data)
    body, digest = data[:-DIGEST], data[-DIGEST:]
    assert hashlib.blake2b(body, digest_size=DIGEST).digest() == digest, "torn value: bad digest"
    assert bytes(data[9:9 + len(key)]) == key, "value of another key"
    word = int.from_bytes(data[:8], "little")
    assert data[8] == word >> 56, "writer byte disagrees with the seq"
    return word >> 56, word & ((1 << 56) - 1)


def hold_lease_main(url: str, key: bytes, ready) -> None:
    """Connect, lease ``key``, say so, then wait to be killed."""
    import cxlrpc
    from kvservice import KVClient

    async def main() -> None:
        kv = await KVClient.connect(url)
        block = await kv.get(key)
        assert block.size > 0
        ready.set()
        await asyncio.sleep(3600)

    cxlrpc.run(main())


def churn_main(url: str, writer: int, seconds: float, shared: int, results) -> None:
    """Random puts/gets/removes on shared keys, plus read-your-writes on private keys."""
    import cxlrpc
    from kvservice import KVClient

    rng = random.Random(writer)
    sizes = (64, 3000, 40_000, 70_000, 300_000)
    shared_keys = [f"shared-{i}".encode() for i in range(shared)]
    own_keys = [f"own-{writer}-{i}".encode() for i in range(4)]
    seen: dict[tuple[bytes, int], int] = {}
    counts = dict.fromkeys(("puts", "reads", "misses", "removes", "batch"), 0)

    def verify(key: bytes, data) -> int:
        w, seq = check_value(key, data)
        assert seen.get((key, w), -1) <= seq, f"stale read of {key!r}: writer {w} seq {seq}"
        seen[key, w] = seq
        counts["reads"] += 1
        return seq

    async def main() -> None:
        seq = 0
        async with KVClient.connect(url) as kv:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                seq += 1
                op = rng.random()
                key = rng.choice(shared_keys)
                if op < 0.3:
                    await kv.put(key, make_value(key, writer, seq, rng.choice(sizes)))
                    counts["puts"] += 1
                elif op < 0.6:
                    try:
                        with await kv.get(key) as block:
                            verify(key, block.view())  # read in place, under the lease
                    except KeyError:
                        counts["misses"] += 1
                elif op < 0.7:
                    try:
                        verify(key, await kv.get_bytes(key))
                    except KeyError:
                        counts["misses"] += 1
                elif op < 0.8:
                    counts["removes"] += await kv.remove(key)
                elif op < 0.9:
                    own = rng.choice(own_keys)
                    await kv.put(own, make_value(own, writer, seq, rng.choice(sizes)))
                    with await kv.get(own) as block:
                        assert verify(own, block.view()) == seq, "read-your-write failed"
                else:
                    keys = rng.sample(shared_keys, 3)
                    for k, block in zip(keys, await kv.batch_get(keys)):
                        if block is not None:
                            with block:
                                verify(k, block.array())
                    counts["batch"] += 1

    try:
        cxlrpc.run(main())
    except BaseException as exc:
        results.put((writer, f"{type(exc).__name__}: {exc}"))
        raise
    results.put((writer, counts))


def _await(go) -> None:
    """Poll an Event (not wait(): its set() would block on a waiter the test froze)."""
    while not go.is_set():
        time.sleep(0.005)


def late_put_main(url: str, key: bytes, size: int, begun, go, outcome) -> None:
    """Begin a put of ``size`` bytes and say so; once ``go`` is set (the test freezes this
    process first), fill the whole block with 0xEE and commit: put 'committed' or the error's
    name on ``outcome``; then wait to be killed (while it lives, its old connection is unfenced)."""
    from kvservice import SyncKVClient

    kv = SyncKVClient.connect(url)
    pending = kv.begin_put(key, size)
    begun.put(pending.size)
    _await(go)
    pending.view()[:] = b"\xee" * size  # the late write: the block may be another key's by now
    try:
        pending.commit()
        outcome.put("committed")
    except Exception as exc:
        outcome.put(type(exc).__name__)
    time.sleep(3600)


def late_get_main(url: str, key: bytes, leased, go, outcome) -> None:
    """Lease ``key`` and say so; once ``go`` is set (the test freezes this process first),
    copy the value out (tobytes: checked after the copy): put ('bytes', its blake2b) or
    ('expired', '') on ``outcome``; then wait to be killed."""
    from kvservice import LeaseExpired, SyncKVClient

    kv = SyncKVClient.connect(url)
    block = kv.get(key)
    leased.put(block.size)
    _await(go)
    try:
        outcome.put(("bytes", hashlib.blake2b(block.tobytes()).hexdigest()))
    except LeaseExpired:
        outcome.put(("expired", ""))
    time.sleep(3600)
