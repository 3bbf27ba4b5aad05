"""Processes the tests start: servers and clients in their own interpreters (spawn)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

CTX = mp.get_context("spawn")


async def run_python(args: list[str] | tuple[str, ...], timeout: float,
                     env: dict[str, str] | None = None, cwd: str | None = None
                     ) -> tuple[int, str, str]:
    """Run ``python ARGS`` to its end without blocking the loop (killed after ``timeout``):
    (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, env=env, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()


async def run_json(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``python ARGS`` to its end (killed after ``timeout``): its last line of output, as
    JSON; an AssertionError with the tail of its stderr if it failed."""
    status, out, err = await run_python(args, timeout, env)
    assert status == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


async def _serve_until_sigterm(server, ready) -> None:
    """Add ``pid``, serve, signal ``ready``; SIGTERM closes the server cleanly (unlinking its region)."""
    server.add_method("pid", os.getpid)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(server.close()))
    async with server:
        ready.set()
        await server.serve_forever()


def _echo_server_main(url: str, opts: dict, ready) -> None:
    import cxlrpc

    async def main() -> None:
        server = cxlrpc.Server(url, **opts)

        @server.method("echo")
        def echo(payload):
            return payload

        @server.method("sleep")
        async def sleep(seconds: float) -> float:
            await asyncio.sleep(seconds)
            return seconds

        await _serve_until_sigterm(server, ready)

    asyncio.run(main())


def made(size: int, seed: int) -> bytes:
    """``size`` bytes that differ with ``seed`` (what followed_server's ``make`` answers)."""
    return (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]


def _followed_server_main(url: str, ready) -> None:
    import cxlrpc
    from cxlrpc import memory
    from cxlrpc.heap import SEAL_AT, HeapAccess, seal_word

    real = HeapAccess.publish

    def half(self, offset, body):  # the server freezes half way (and never writes the rest)
        at = self.start + offset
        memory.publish_copy(self.mem, self.buf, at, at + 64, memoryview(body)[:len(body) // 2])

    def garbage(self, offset, body):  # a progress word past the length
        self.mem.store(self.start + offset, len(body) + 1, memory.RELEASE)

    def reseal(self, offset, body):  # half written, the extent sealed for another, the rest
        at, view, n = self.start + offset, memoryview(body), len(body)
        memory.publish_copy(self.mem, self.buf, at, at + 64, view[:n // 2])
        self.mem.store(at + SEAL_AT, seal_word(1000, 1), memory.RELEASE)  # (as a new owner's)
        self.buf[at + 64 + n // 2:at + 64 + n] = view[n // 2:]
        self.mem.store(at, n, memory.RELEASE)

    async def main() -> None:
        server = cxlrpc.Server(url)

        @server.method("echo")
        async def echo(payload: bytes) -> bytes:
            return payload

        @server.method("make")
        def make(spec: list) -> bytes:
            return made(*spec)

        @server.method("heap_used")
        def heap_used() -> int:  # beyond the spares its clients keep
            heap = server._bodies.heap
            return heap.used - sum(heap._alloc.rounded(n) for n in heap._kept.values())

        @server.method("publish")
        def publish(how: str) -> None:  # how the server writes followed bodies from now on
            HeapAccess.publish = {"whole": real, "half": half, "garbage": garbage, "reseal": reseal}[how]
            if server._calls._fast is not None:  # (the native dispatcher follows replies itself)
                server._calls._fast.enabled = int(how == "whole")

        await _serve_until_sigterm(server, ready)

    asyncio.run(main())


@contextmanager
def _child_server(main, args: tuple, what: str) -> Iterator[mp.Process]:
    """Run ``main(*args, ready)`` in a child process until it sets ``ready``; SIGTERM (clean
    close) and join on exit."""
    ready = CTX.Event()
    proc = CTX.Process(target=main, args=(*args, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(20):
            raise TimeoutError(f"{what} did not start")
        yield proc
    finally:
        stop(proc)


def followed_server(url: str) -> AbstractContextManager[mp.Process]:
    """A server in a child process whose replies are followed: ``echo``, ``make`` ([size,
    seed] -> made(size, seed)), ``heap_used`` (bytes beyond the spares clients keep), and
    ``publish`` ("whole", "half": it stops half way, "garbage": a progress word past the
    length, "reseal": the extent's seal rewritten as for another owner half way)."""
    return _child_server(_followed_server_main, (url,), "followed server")


def echo_server(url: str, **opts) -> AbstractContextManager[mp.Process]:
    """Run an echo server in a child process; SIGTERM (clean close) and join on exit."""
    return _child_server(_echo_server_main, (url, opts), "echo server")


def stop(proc: mp.Process, timeout: float = 10.0) -> None:
    """End a child: SIGTERM, then SIGKILL after ``timeout``; always reaped."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)


def wait_for(cond, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``cond()`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


def _client_hold_main(url: str, ready, call_slow: bool) -> None:
    import cxlrpc

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    ready.set()
    if call_slow:
        client.call("sleep", 60.0, timeout=120)
    while True:
        time.sleep(1)


def client_holding_slot(url: str, call_slow: bool = False) -> mp.Process:
    """A child that attaches a blocking client (optionally sits in a slow call) and waits to be killed."""
    ready = CTX.Event()
    proc = CTX.Process(target=_client_hold_main, args=(url, ready, call_slow), daemon=True)
    proc.start()
    if not ready.wait(20):
        stop(proc)
        raise TimeoutError("client child did not attach")
    return proc


def _ran_s(schedstat: str) -> float:
    """Seconds one thread ran, from its /proc schedstat file (ns resolution)."""
    with open(schedstat) as f:
        return int(f.read().split()[0]) / 1e9


def cpu_seconds(pid: int) -> float:
    """CPU time all threads of a process ran, in ns-resolution (/proc schedstat; the stat
    file's clock ticks are 10 ms, too coarse for an idle budget of milliseconds)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += _ran_s(f"/proc/{pid}/task/{tid}/schedstat")
        except FileNotFoundError:
            pass  # the thread ended meanwhile
    return total


def timer_cpu_share(rate_hz: float, seconds: float = 1.0) -> float:
    """CPU share of a bare asyncio loop in this thread that only wakes ``rate_hz`` times a
    second: this machine's price of wake-ups, which idle budgets are scaled by. On one 2-core
    VM it moved within an hour from ~0.3 to ~1.4 ms per wake-up (20 a second: 3.0% of a
    core; 1,000 a second: 7.7%). Runs its own loop: call it where none is running."""
    async def wake() -> float:
        cpu0, t0 = _ran_s("/proc/thread-self/schedstat"), time.monotonic()
        for _ in range(int(rate_hz * seconds)):
            await asyncio.sleep(1 / rate_hz)
        return (_ran_s("/proc/thread-self/schedstat") - cpu0) / (time.monotonic() - t0)

    return asyncio.run(wake())


def wakeups(pid: int) -> int:
    """Voluntary context switches of all threads of a process: how often it slept and woke."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith("voluntary_ctxt_switches"))
        except FileNotFoundError:
            pass
    return total


# ----------------------------------------------------------------------------- fault-suite helpers
def _fault_server_main(url: str, ready, opts: dict) -> None:
    import cxlrpc

    async def main() -> None:
        server = cxlrpc.Server(url, **opts)
        active = {"n": 0}

        @server.method("echo")
        def echo(payload):
            return payload

        @server.method("sleep")
        async def sleep(seconds: float) -> float:
            active["n"] += 1
            try:
                await asyncio.sleep(seconds)
            finally:
                active["n"] -= 1
            return seconds

        @server.method("active")
        def active_sleeps() -> int:
            return active["n"]

        @server.method("slow_echo")
        def slow_echo(arg):  # blocks the reader on purpose: requests pile up in the ring
            delay, payload = arg
            time.sleep(delay)
            return payload

        await _serve_until_sigterm(server, ready)

    asyncio.run(main())


def start_fault_server(url: str, **opts) -> mp.Process:
    """Start a server with echo/sleep/active/slow_echo/pid in a child; the caller must ``stop`` it."""
    ready = CTX.Event()
    proc = CTX.Process(target=_fault_server_main, args=(url, ready, opts), daemon=True)
    proc.start()
    if not ready.wait(20):
        stop(proc)
        raise TimeoutError("fault server did not start")
    return proc


@contextmanager
def fault_server(url: str, **opts) -> Iterator[mp.Process]:
    """Run :func:`start_fault_server`'s server for a ``with`` block; SIGTERM and join on exit."""
    proc = start_fault_server(url, **opts)
    try:
        yield proc
    finally:
        stop(proc)


def _make_counting_client():
    import cxlrpc
    from cxlrpc import frame as fr

    class CountingClient(cxlrpc.Client):
        """An asyncio client that counts every reply frame it reads, by call id, before the
        normal dispatch (which silently ignores duplicates): duplicates and replies meant
        for another slot/generation become visible to the test."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.replies: dict[int, int] = {}
            self.foreign = 0
            self.undecodable = 0

            dispatch = self._replies.on_reply

            def on_reply(view: memoryview) -> None:
                self._count(view)
                dispatch(view)

            self._replies.on_reply = self._on_reply = on_reply  # the reader's and the native caller's

        def _count(self, view: memoryview) -> None:
            if len(view) >= fr.HEADER_SIZE:
                _, _, _, slot, gen, call_id, _, _ = fr.HEADER.unpack_from(view)
                if slot == self._conn.chan.slot and gen == self._conn.chan.gen:
                    self.replies[call_id] = self.replies.get(call_id, 0) + 1
                else:
                    self.foreign += 1
            else:
                self.undecodable += 1

        def _install(self, link) -> None:
            super()._install(link)
            if self._conn.caller is not None:  # replies the native caller takes in place count too
                self._conn.caller = _CountingCaller(self._conn.caller, self)

        def duplicates(self) -> int:
            return sum(n - 1 for n in self.replies.values() if n > 1)

    class _CountingCaller:
        """Stands in for a connection's native caller: counts the replies it returns."""

        def __init__(self, real, client) -> None:
            self.real, self.client = real, client

        def call(self, *args):
            got = self.real.call(*args)
            if type(got) is fr.Frame or type(got) is bytes:  # a reply, or a raw reply's body
                call_id = got.call_id if type(got) is fr.Frame else args[3]
                replies = self.client.replies
                replies[call_id] = replies.get(call_id, 0) + 1
            return got

    return CountingClient


_counting_client_cls = None


def counting_client(url: str, **kwargs):
    """A not-yet-opened CountingClient: ``client = counting_client(url); await client.open()``."""
    global _counting_client_cls
    if _counting_client_cls is None:
        _counting_client_cls = _make_counting_client()
    return _counting_client_cls(url, **kwargs)


def _claim_and_die_main(url: str, write_header: bool, claimed) -> None:
    import cxlrpc
    from cxlrpc.memory import ACQ_REL, ACQUIRE, RELEASE
    from cxlrpc.ring.record import KIND_DATA, KIND_PADDING, make_header

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    chan = client._conn.chan
    ring = chan.requests
    length = 64
    size = 8 + length
    while True:  # claim exactly as MpscRing.try_push does (claim word, CAS on the tail)...
        tail = ring._tail.load(ACQUIRE)
        idx = tail & ring.mask
        to_end = ring.capacity - idx
        need = size if size <= to_end else to_end + size
        chan.claim.store(tail, RELEASE)
        if ring._tail.cas(tail, tail + need, ACQ_REL) == tail:
            break
    claimed.value = tail  # shared memory: visible at once, unlike a queue's feeder thread
    if write_header:  # ...write the uncommitted header (and half the payload)...
        header = make_header(length, KIND_DATA, chan.slot, False, chan.tag)
        if need != size:
            ring.mem.store(ring.data, header, RELEASE)
            ring.mem.store(ring.data + idx, make_header(to_end - 8, KIND_PADDING, chan.slot, True), RELEASE)
            idx = 0
        else:
            ring.mem.store(ring.data + idx, header, RELEASE)
        ring.buf[ring.data + idx + 8:ring.data + idx + 8 + length // 2] = b"\xab" * (length // 2)
    os.kill(os.getpid(), signal.SIGKILL)  # ...and die before the commit


def claim_and_die(url: str, write_header: bool = True) -> int:
    """A child attaches a blocking client, claims request-ring space (optionally writes the
    uncommitted header) and SIGKILLs itself before committing. Returns, once it is reaped,
    the request-ring position it claimed."""
    claimed = CTX.Value("q", -1, lock=False)
    proc = CTX.Process(target=_claim_and_die_main, args=(url, write_header, claimed), daemon=True)
    proc.start()
    try:
        proc.join(30)
        if proc.exitcode != -signal.SIGKILL or claimed.value < 0:
            raise RuntimeError(f"claim-and-die child ended with {proc.exitcode}, not SIGKILL after a claim")
        return claimed.value
    finally:
        stop(proc)


def _load_client_main(url: str, idx: int, seconds: float, inflight: int, max_len: int,
                      call_timeout: float, progress, results) -> None:
    import random
    import struct

    import cxlrpc

    async def main() -> dict:
        client = counting_client(url)
        await client.open()
        rng = random.Random(idx)
        stats = {"idx": idx, "sent": 0, "ok": 0, "mismatched": 0, "errors": {}, "late": 0,
                 "max_latency": 0.0}
        deadline = time.monotonic() + seconds
        pending_progress = [0]

        async def worker(w: int) -> None:
            seq = 0
            while time.monotonic() < deadline:
                payload = struct.pack("<IIQ", idx, w, seq) + rng.randbytes(rng.randrange(0, max_len))
                seq += 1
                stats["sent"] += 1
                t0 = time.monotonic()
                try:
                    reply = await client.call("echo", payload, timeout=call_timeout)
                except cxlrpc.RpcError as exc:
                    name = type(exc).__name__
                    stats["errors"][name] = stats["errors"].get(name, 0) + 1
                else:
                    if reply == payload:
                        stats["ok"] += 1
                    else:
                        stats["mismatched"] += 1
                lat = time.monotonic() - t0
                stats["max_latency"] = max(stats["max_latency"], lat)
                if lat > call_timeout + 2.0:
                    stats["late"] += 1
                pending_progress[0] += 1
                if pending_progress[0] >= 64:
                    with progress.get_lock():
                        progress.value += pending_progress[0]
                    pending_progress[0] = 0

        try:
            await asyncio.gather(*(worker(w) for w in range(inflight)))
            await asyncio.sleep(0.05)  # let any late duplicate reply arrive before counting
            stats["replies"] = len(client.replies)
            stats["duplicates"] = client.duplicates()
            stats["foreign"] = client.foreign
        finally:
            await client.close()
        return stats

    try:
        results.put(cxlrpc.run(main()))
    except BaseException as exc:  # report, so the test shows why instead of a timeout
        results.put({"idx": idx, "crash": repr(exc)})


def start_load_clients(url: str, n: int, seconds: float, inflight: int = 32, max_len: int = 512,
                       call_timeout: float = 10.0):
    """Start ``n`` client processes each keeping ``inflight`` unique echo calls in flight for
    ``seconds``; returns (procs, progress counter, results queue). Each puts one stats dict."""
    progress = CTX.Value("q", 0)
    results = CTX.Queue()
    procs = [CTX.Process(target=_load_client_main,
                         args=(url, i, seconds, inflight, max_len, call_timeout, progress, results),
                         daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    return procs, progress, results


def _flooding_client_main(url: str, seconds: float, sent) -> None:
    import cxlrpc

    async def main() -> None:
        async with cxlrpc.connect(url) as client:
            end = time.monotonic() + seconds
            n = 0
            while time.monotonic() < end:
                for _ in range(100):
                    try:
                        client.send_nowait("echo", b"x" * 64)
                        n += 1
                    except cxlrpc.ResourceExhausted:
                        pass  # the ring is full: the server is behind, as wanted
                sent.value = n

    cxlrpc.run(main())


def flooding_client(url: str, seconds: float):
    """A client process keeping the server's request ring full of one-way ``echo`` calls for
    ``seconds``; returns (the process, a counter of the calls it queued so far)."""
    sent = CTX.Value("q", 0, lock=False)
    proc = CTX.Process(target=_flooding_client_main, args=(url, seconds, sent), daemon=True)
    proc.start()
    return proc, sent


def _paced_client_main(url: str, calls: int, pause_s: float, span) -> None:
    import cxlrpc

    async def main() -> None:
        async with cxlrpc.connect(url) as client:
            await client.call("echo", b"warm-up")
            span[0] = time.monotonic()
            for _ in range(calls):
                end = time.perf_counter() + pause_s  # computing between calls, not awaiting
                while time.perf_counter() < end:
                    pass
                await client.call("echo", b"x" * 64, timeout=10)
            span[1] = time.monotonic()

    cxlrpc.run(main())


def paced_client(url: str, calls: int, pause_s: float):
    """A client process making ``calls`` echo calls, each after ``pause_s`` of busy work;
    returns (the process, [monotonic time of the first pause, of the last reply] once done)."""
    span = CTX.Array("d", 2, lock=False)
    proc = CTX.Process(target=_paced_client_main, args=(url, calls, pause_s, span), daemon=True)
    proc.start()
    return proc, span


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/PID/status (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for {pid}")


# ----------------------------------------------------------------------------- fault-suite: in-test helpers
def sized_for(url: str, opts: dict) -> dict:
    """Server options for ``url``: on the simulator (it copies whole regions) small rings and
    a 1 MiB message limit, unless ``opts`` says otherwise."""
    if url.startswith("sim://"):
        opts.setdefault("request_capacity", 256 << 10)
        opts.setdefault("response_capacity", 256 << 10)
        opts.setdefault("max_message_size", 1 << 20)
    return opts


async def until(cond, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``cond()`` (sync, or returning an awaitable) until true or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


class Pump:
    """Keeps ``inflight`` unique echo calls in flight on one client and checks every reply."""

    def __init__(self, client, tag: str, inflight: int = 4, timeout: float = 10.0) -> None:
        self.client, self.tag, self.inflight, self.timeout = client, tag, inflight, timeout
        self.sent = self.ok = self.mismatched = 0
        self.errors: list[str] = []
        self.done: list[float] = []  # completion times
        self._stopping = False
        self._task: asyncio.Future | None = None

    async def _worker(self, w: int) -> None:
        from cxlrpc import RpcError

        seq = 0
        while not self._stopping:
            payload = f"{self.tag}:{w}:{seq}:".encode() + os.urandom(24)
            seq += 1
            self.sent += 1
            try:
                reply = await self.client.call("echo", payload, timeout=self.timeout)
            except RpcError as exc:
                self.errors.append(repr(exc))
                await asyncio.sleep(0.001)  # an error may come back at once: never starve the loop
            else:
                if reply == payload:
                    self.ok += 1
                else:
                    self.mismatched += 1
            self.done.append(time.monotonic())

    def start(self) -> "Pump":
        self._task = asyncio.gather(*(self._worker(w) for w in range(self.inflight)))
        return self

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.wait_for(self._task, 30)

    def max_gap(self, start: float, end: float) -> float:
        """Longest stretch in [start, end] without a completed call."""
        times = [start] + [t for t in self.done if start < t < end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))

    def check(self) -> None:
        assert self.mismatched == 0, f"{self.tag}: {self.mismatched} replies did not match their request"
        assert not self.errors, f"{self.tag}: calls failed: {self.errors[:5]}"
        assert self.ok == self.sent, f"{self.tag}: sent {self.sent}, answered {self.ok}"
        assert self.client.duplicates() == 0, f"{self.tag}: duplicated replies"
        assert self.client.foreign == 0, f"{self.tag}: replies meant for another slot/generation"
        assert self.client.undecodable == 0


async def open_counting(url: str, **kwargs):
    client = counting_client(url, **kwargs)
    await client.open()
    return client


async def connect_within(url: str, timeout: float):
    """Connect a counting client, retrying while every slot is taken; None if still full."""
    from cxlrpc import ResourceExhausted

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await open_counting(url)
        except ResourceExhausted:
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.01)


def report(label: str, **figures) -> None:
    print(f"\n[fault figures] {label}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
