"""Checking clients of the region fuzz (tests/test_fuzz_region.py), each in a child process.

Every call echoes a payload derived from (client, worker, call number), so a reply that is
another call's (swapped, stale, overwritten) or altered by one byte is seen: each reply is
compared byte for byte. A call may fail with an RpcError while garbage is about (that is the
contract); any other exception, a call that outlives its timeout, or a reply that differs is
recorded and fails the test.
"""
from __future__ import annotations

import asyncio
import random
import time

from procs import CTX

#: A call that takes this much longer than its timeout counts as hung.
HANG_SLACK = 2.0


def payload(key: str, size: int) -> bytes:
    """The bytes a call with this key sends: random-looking, different for every key (no
    8-byte word of it looks like a heap progress word, so the fuzz never mistakes one for it)."""
    return random.Random(key).randbytes(size)


def _diff(key: str, sent: bytes, got) -> dict:
    """What is wrong with a reply, briefly (for the report)."""
    got = bytes(got) if isinstance(got, (bytes, bytearray, memoryview)) else repr(got).encode()
    first = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
    return {"key": key, "sent": len(sent), "got": len(got), "first_diff": first,
            "got_bytes": got[first:first + 16].hex()}


class Tally:
    """What one checking client saw."""

    def __init__(self, idx: int, call_timeout: float) -> None:
        self.idx, self.call_timeout = idx, call_timeout
        self.stats = {"idx": idx, "ok": 0, "ok_bytes": 0, "errors": {}, "wrong": [],
                      "exceptions": [], "late": 0, "slowest": 0.0, "last_error_at": 0.0}

    def call_done(self, elapsed: float) -> None:
        s = self.stats
        s["slowest"] = max(s["slowest"], elapsed)
        if elapsed > self.call_timeout + HANG_SLACK:
            s["late"] += 1

    def outcome(self, key: str, sent: bytes, reply) -> None:
        if reply == sent:
            self.stats["ok"] += 1
            self.stats["ok_bytes"] += len(sent)
        elif len(self.stats["wrong"]) < 20:
            self.stats["wrong"].append(_diff(key, sent, reply))
        else:
            self.stats["wrong"].append({"key": key})

    def error(self, exc: BaseException) -> None:
        self.stats["last_error_at"] = time.monotonic()  # (one clock for all processes of the host)
        name = type(exc).__name__
        self.stats["errors"][name] = self.stats["errors"].get(name, 0) + 1


def _async_main(url: str, idx: int, bands: list[tuple[int, int]], call_timeout: float,
                progress, stop, results) -> None:
    """One asyncio client, one worker per size band, each keeping one call in flight."""
    import cxlrpc

    tally = Tally(idx, call_timeout)

    async def worker(client, w: int, lo: int, hi: int) -> None:
        rng = random.Random(f"{idx}:{w}")
        seq = 0
        while not stop.is_set():
            seq += 1
            key = f"{idx}:{w}:{seq}"
            sent = payload(key, rng.randint(lo, hi))
            t0 = time.monotonic()
            try:
                reply = await client.call("echo", sent, timeout=call_timeout)
            except cxlrpc.RpcError as exc:
                tally.error(exc)
                await asyncio.sleep(0.005)  # an error may come back at once: never starve the loop
            except Exception as exc:  # noqa: BLE001 - a call must fail with an RpcError only
                tally.stats["exceptions"].append(repr(exc)[:300])
                await asyncio.sleep(0.005)
            else:
                tally.outcome(key, sent, reply)
                progress[idx] += 1
            tally.call_done(time.monotonic() - t0)

    async def main() -> None:
        async with cxlrpc.connect(url, wait_for_ready=20) as client:
            await asyncio.gather(*(worker(client, w, lo, hi) for w, (lo, hi) in enumerate(bands)))

    try:
        cxlrpc.run(main())
    except BaseException as exc:  # noqa: BLE001 - reported: the test shows why, not a timeout
        tally.stats["exceptions"].append("client ended: " + repr(exc)[:300])
    results.put(tally.stats)


def _sync_main(url: str, idx: int, bands: list[tuple[int, int]], call_timeout: float,
               progress, stop, results) -> None:
    """One blocking client calling through the size bands in turn."""
    import cxlrpc

    tally = Tally(idx, call_timeout)
    rng = random.Random(f"{idx}:sync")
    try:
        with cxlrpc.connect_sync(url, wait_for_ready=20) as client:
            seq = 0
            while not stop.is_set():
                seq += 1
                lo, hi = bands[seq % len(bands)]
                key = f"{idx}:s:{seq}"
                sent = payload(key, rng.randint(lo, hi))
                t0 = time.monotonic()
                try:
                    reply = client.call("echo", sent, timeout=call_timeout)
                except cxlrpc.RpcError as exc:
                    tally.error(exc)
                    time.sleep(0.005)
                except Exception as exc:  # noqa: BLE001 - a call must fail with an RpcError only
                    tally.stats["exceptions"].append(repr(exc)[:300])
                    time.sleep(0.005)
                else:
                    tally.outcome(key, sent, reply)
                    progress[idx] += 1
                tally.call_done(time.monotonic() - t0)
    except BaseException as exc:  # noqa: BLE001
        tally.stats["exceptions"].append("client ended: " + repr(exc)[:300])
    results.put(tally.stats)


def _main(url: str, async_bands: list[tuple[int, int]], sync_bands: list[tuple[int, int]],
          call_timeout: float, progress, stop, results) -> None:
    """Both clients in one process (one interpreter less to start): the blocking one in a thread."""
    import threading

    blocking = threading.Thread(target=_sync_main,
                                args=(url, 1, sync_bands, call_timeout, progress, stop, results))
    blocking.start()
    try:
        _async_main(url, 0, async_bands, call_timeout, progress, stop, results)
    finally:
        stop.set()
        blocking.join()


class Checkers:
    """Start the checking clients (one asyncio, one blocking, in a child process) on ``url``;
    ``stop()`` them and collect what each saw."""

    def __init__(self, url: str, async_bands: list[tuple[int, int]],
                 sync_bands: list[tuple[int, int]], call_timeout: float) -> None:
        self.progress = CTX.Array("q", 2, lock=False)
        self.stop_event = CTX.Event()
        self.results = CTX.Queue()
        self.procs = [CTX.Process(target=_main, daemon=True,
                                  args=(url, async_bands, sync_bands, call_timeout, self.progress,
                                        self.stop_event, self.results))]
        self.procs[0].start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stop(self, timeout: float = 30.0) -> list[dict]:
        """Ask the clients to finish their calls, report and exit; a client that does not report
        in ``timeout`` seconds (it hung, or died) yields a stats dict saying so."""
        self.stop_event.set()
        stats, deadline = [], time.monotonic() + timeout
        for _ in range(2):
            try:
                stats.append(self.results.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - queue.Empty: the child never reported
                stats.append({"idx": -1, "exceptions": ["a checking client never reported"],
                              "exitcodes": [p.exitcode for p in self.procs]})
        for p in self.procs:  # gone, not only done: a holder the garbage took its slot from
            p.join(max(0.1, deadline - time.monotonic()))  # is fenced when its process exits
        return stats

    def close(self) -> None:
        from procs import stop

        self.stop_event.set()
        for p in self.procs:
            stop(p)
        self.results.close()
