"""Guest-side driver for tests/test_guests_rpc.py: one role per command, results as JSON in $OUT.

Run inside a guest (see tests/guest_vm.py) as ``python guest_peer.py ROLE``:

``server``   KVServer on ``file://$CXL_DEV0`` (pool on ``file://$CXL_DEV1``) plus test methods
             (echo, sleep, fail, whoami) on its embedded cxlrpc server; writes ``ready`` when
             serving and ``disconnects.json`` on every client departure; serves until killed.
``kvpeer``   (server's guest) waits for the host's ``kv-request.json``, reads that key zero-copy
             and checks it, puts a value of its own, writes ``kv-a.json``.
``client``   phases a-d (RPC contract, 10,000 verified echoes, calls after idle, kvservice both
             ways; the host relays ``kv-from-a.json``) into ``phases.json``, then writes
             ``looping`` and calls echo until the guest is killed.
``client2``  checks the server still serves, writes ``looping``, calls until the server guest is
             killed and writes ``result.json`` with how long Unavailable took.

Every file the host reads is written to a temporary name and renamed into place. A phase that
overruns its budget dumps every thread's stack to ``stack-<phase>.txt`` (faulthandler).
"""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import json
import mmap
import os
import random
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cxlrpc
from cxlrpc.identity import host_identity
from kvservice.client import KVClient
from kvservice.server import KVServer

OUT = Path(os.environ.get("OUT", "/run/out"))
RPC_URL = "file://" + os.environ.get("CXL_DEV0", "/nonexistent")
POOL_URL = "file://" + os.environ.get("CXL_DEV1", "/nonexistent")
POOL_SIZE = 32 << 20  # + the 4 KiB header fits the 64 MiB device
CLIENT_TIMEOUT = 1.0
#: The server's idle poll step (cxlrpc's default is 1 ms); the host may override it for a run
#: with CXLRPC_GUEST_POLL_INTERVAL to see what an after-idle call costs at other settings.
POLL_INTERVAL = float(os.environ.get("CXLRPC_GUEST_POLL_INTERVAL", "1e-3"))
COHERENCE = os.environ.get("CXLRPC_GUEST_COHERENCE", "hardware")  # the server's; clients read it
KV_VALUE_SIZE = 1 << 20
N_SEQUENTIAL = 5000
N_CONCURRENT = 5000
GATHER = 8
IDLE_PERIODS = (0.5, 1.0, 3.0, 0.5, 1.0, 3.0)
now = time.perf_counter


def write_json(name: str, data: Any) -> None:
    """Write $OUT/<name> atomically (temporary name, then rename)."""
    tmp = OUT / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, OUT / name)


def wait_json(name: str, timeout: float) -> Any:
    """Poll for $OUT/<name> (the host renames it into place) until ``timeout``."""
    path = OUT / name
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
    return json.loads(path.read_text())


@contextlib.contextmanager
def watchdog(phase: str, budget: float):
    """Dump all stacks to $OUT/stack-<phase>.txt if the phase runs longer than ``budget``."""
    f = open(OUT / f"stack-{phase}.txt", "w")
    faulthandler.dump_traceback_later(budget, repeat=False, file=f)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        empty = f.tell() == 0
        f.close()
        if empty:
            (OUT / f"stack-{phase}.txt").unlink(missing_ok=True)


def me() -> dict[str, Any]:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"host": socket.gethostname(), "boot_id": boot, "pid": os.getpid(),
            "identity": host_identity()}


def calibrate() -> float:
    """Seconds a fixed pure-Python loop takes here (the host runs it too: the TCG slowdown)."""
    t = now()
    sum(i * i for i in range(300_000))
    return now() - t


def pattern(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def percentiles(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    ms = lambda x: round(x * 1e3, 4)  # noqa: E731
    return {"n": len(s), "p10_ms": ms(pick(0.10)), "p50_ms": ms(pick(0.50)),
            "p90_ms": ms(pick(0.90)), "p99_ms": ms(pick(0.99)),
            "max_ms": ms(s[-1]), "mean_ms": ms(sum(s) / len(s))}


# ---------------------------------------------------------------------------------- server
async def serve() -> None:
    # 16 slots x 1 MiB reply rings (the test echoes 256 KiB) + a 4 MiB request ring + a 16 MiB
    # heap: ~37 MiB, inside the 64 MiB device (flush mode: + 16 x 1 MiB request rings, one per
    # client: ~53 MiB)
    kv = KVServer(RPC_URL, pool_size=POOL_SIZE, pool_url=POOL_URL, client_timeout=CLIENT_TIMEOUT,
                  slots=16, response_capacity=1 << 20, poll_interval=POLL_INTERVAL,
                  coherence=COHERENCE, max_message_size=16 << 20)
    rpc = kv.rpc

    def echo(payload: bytes) -> bytes:
        return payload

    async def sleep(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    def fail(kind: str) -> None:
        if kind == "invalid":
            raise cxlrpc.InvalidArgument("bad argument, says guest A")
        raise RuntimeError("boom in guest A")

    def whoami() -> dict[str, Any]:
        return me()

    async def timer_probe(n: int) -> dict[str, float]:
        """How long this loop's 1 ms sleeps really take (the idle server's poll step)."""
        lat = []
        for _ in range(n):
            t = now()
            await asyncio.sleep(1e-3)
            lat.append(now() - t)
        return percentiles(lat)

    for name, fn in (("echo", echo), ("sleep", sleep), ("fail", fail), ("whoami", whoami),
                     ("timer_probe", timer_probe)):
        rpc.add_method(name, fn)
    departed: list[dict[str, Any]] = []

    def on_disconnect(peer: cxlrpc.Peer) -> None:
        departed.append({"slot": peer.slot, "gen": peer.gen, "t_mono": time.monotonic()})
        write_json("disconnects.json", departed)

    rpc.on_disconnect(on_disconnect)
    t0 = now()
    await kv.start()
    write_json("ready", {"start_s": now() - t0, "poll_interval": POLL_INTERVAL, "rpc_size": rpc._region.size, **me()})
    await kv.serve_forever()


# ---------------------------------------------------------------------------------- kv peer
async def kvpeer() -> None:
    req = wait_json("kv-request.json", 900)
    res: dict[str, Any] = {"me": me()}
    with watchdog("kvpeer", 60):
        async with KVClient.connect(RPC_URL) as kv:
            t = now()
            block = await kv.get(req["key"])
            res["get_ms"] = round((now() - t) * 1e3, 3)
            with block:
                view = block.view()
                res["read"] = {
                    "size": len(view),
                    "sha256": hashlib.sha256(view).hexdigest(),
                    "zero_copy": isinstance(view.obj, mmap.mmap),  # a view into the pool map
                    "readonly": view.readonly,
                }
            del view
            res["read"]["ok"] = (res["read"]["sha256"] == req["sha256"]
                                 and res["read"]["size"] == req["size"])
            res["exists_b"] = await kv.exists(req["key"])
            value = pattern("from-guest-A", KV_VALUE_SIZE)
            t = now()
            await kv.put("from-A", value)
            res["put_ms"] = round((now() - t) * 1e3, 3)
            res["put"] = {"key": "from-A", "size": len(value),
                          "sha256": hashlib.sha256(value).hexdigest()}
    write_json("kv-a.json", res)


# ---------------------------------------------------------------------------------- client
def check(results: dict[str, Any], name: str, ok: bool, **detail: Any) -> None:
    results[name] = {"ok": bool(ok), **detail}


async def expect_error(coro: Any, exc_type: type[BaseException]) -> tuple[bool, str, float]:
    t = now()
    try:
        got = await coro
    except exc_type as exc:
        return True, f"{type(exc).__name__}: {exc}", now() - t
    except BaseException as exc:  # noqa: BLE001 - report whatever it was
        return False, f"{type(exc).__name__}: {exc}", now() - t
    return False, f"no error, returned {got!r:.80}", now() - t


async def phase_contract(client: cxlrpc.Client, who_me: dict[str, Any]) -> dict[str, Any]:
    r: dict[str, Any] = {}
    server = await client.call("whoami", timeout=5)
    check(r, "remote_peer", server["boot_id"] != who_me["boot_id"]
          and server["identity"] != who_me["identity"] and not client._conn.chan.server_local,
          server=server, client=who_me)
    msg = b"hello from guest B \x00\xff"
    got = await client.call("echo", msg, timeout=5)
    check(r, "echo_bytes", got == msg and type(got) is bytes, got=repr(got))
    big = [pattern(f"big-{i}", 256 << 10) for i in range(4)]
    bad = sum([await client.call("echo", big[i % 4], timeout=10) != big[i % 4] for i in range(40)])
    check(r, "echo_256k_x40_ring_wraps", bad == 0, wrong=bad)
    ok, text, _ = await expect_error(client.call("no_such_method", b"x", timeout=5), cxlrpc.Unimplemented)
    check(r, "unknown_method_unimplemented", ok, error=text)
    ok, text, took = await expect_error(client.call("sleep", 3.0, timeout=0.3),
                                        cxlrpc.DeadlineExceeded)
    check(r, "timeout_deadline_exceeded", ok and took < 1.5, error=text, took_s=round(took, 4))
    got = await client.call("echo", b"after-timeout", timeout=5)
    check(r, "echo_after_timeout", got == b"after-timeout", got=repr(got))
    ok, text, _ = await expect_error(client.call("fail", "invalid", timeout=5),
                                     cxlrpc.InvalidArgument)
    check(r, "handler_status_invalid_argument", ok and "bad argument, says guest A" in text,
          error=text)
    ok, text, _ = await expect_error(client.call("fail", "boom", timeout=5), cxlrpc.Internal)
    check(r, "handler_exception_internal", ok and "boom in guest A" in text, error=text)
    got = await client.call("sleep", 0.05, timeout=5)
    check(r, "async_handler_result", got == 0.05, got=got)
    return r


def payload(i: int) -> bytes:
    return struct.pack("<Q", i) * 8  # 64 B, every word the call's number


async def phase_echo(client: cxlrpc.Client) -> dict[str, Any]:
    seen: set[int] = set()
    wrong = lost = duplicated = 0
    errors: list[str] = []

    def verify(i: int, reply: Any) -> None:
        nonlocal wrong, duplicated
        if not isinstance(reply, bytes) or len(reply) != 64:
            wrong += 1
            return
        words = set(struct.unpack("<8Q", reply))
        n = words.pop() if len(words) == 1 else -1
        if n in seen:
            duplicated += 1
        else:
            seen.add(n)
        if reply != payload(i):
            wrong += 1

    async def one(i: int) -> None:
        nonlocal lost
        try:
            verify(i, await client.call("echo", payload(i), timeout=10))
        except cxlrpc.RpcError as exc:
            lost += 1
            if len(errors) < 5:
                errors.append(f"call {i}: {type(exc).__name__}: {exc}")

    for i in range(200):  # warm-up (not counted)
        await client.call("echo", payload(1 << 40 | i), timeout=10)
    lat = []
    for i in range(N_SEQUENTIAL):
        t = now()
        await one(i)
        lat.append(now() - t)
    t0 = now()
    for base in range(N_SEQUENTIAL, N_SEQUENTIAL + N_CONCURRENT, GATHER):
        await asyncio.gather(*(one(i) for i in range(base, base + GATHER)))
    concurrent_s = now() - t0
    total = N_SEQUENTIAL + N_CONCURRENT
    # the same sequential calls from a client that busy-spins for its replies: what is left
    # is TCG's cost of the round trip itself, not the client's doorbell
    spin_lat = []
    async with cxlrpc.connect(RPC_URL, doorbell="busy-spin") as spinner:
        for i in range(1000):
            p = payload(1 << 44 | i)
            t = now()
            got = await spinner.call("echo", p, timeout=10)
            spin_lat.append(now() - t)
            if got != p:
                wrong += 1
    missing = total - len(seen & set(range(total)))
    return {"calls": total, "wrong": wrong, "lost": lost, "duplicated": duplicated,
            "missing": missing, "errors": errors, "sequential_64B": percentiles(lat),
            "sequential_calls_per_s": round(N_SEQUENTIAL / sum(lat), 1),
            "sequential_64B_busy_spin_client": percentiles(spin_lat),
            "gather8_calls_per_s": round(N_CONCURRENT / concurrent_s, 1)}


async def phase_idle(client: cxlrpc.Client) -> dict[str, Any]:
    rows = []
    for idle in IDLE_PERIODS:
        for i in range(20):  # busy again before each idle period
            await client.call("echo", payload(1 << 41 | i), timeout=10)
        await asyncio.sleep(idle)  # the idle period under test (no condition to wait for)
        t = now()
        try:
            got = await client.call("echo", b"after idle", timeout=10)
            rows.append({"idle_s": idle, "latency_ms": round((now() - t) * 1e3, 4),
                         "ok": got == b"after idle"})
        except cxlrpc.RpcError as exc:
            rows.append({"idle_s": idle, "latency_ms": round((now() - t) * 1e3, 4), "ok": False,
                         "error": f"{type(exc).__name__}: {exc}"})
    # many short idle periods: the distribution of the after-idle cost (the server polls an
    # idle ring every poll_interval = 1 ms once its previous wait timed out, after ~0.1 s)
    lat = []
    for i in range(30):
        await client.call("echo", payload(1 << 45 | i), timeout=10)
        await asyncio.sleep(0.3)
        t = now()
        await client.call("echo", b"after idle", timeout=10)
        lat.append(now() - t)
    probe = await client.call("timer_probe", 200, timeout=30)
    return {"calls": rows, "after_0.3s_idle_x30": percentiles(lat), "server_1ms_sleep": probe}


async def phase_kv(results: dict[str, Any]) -> None:
    r: dict[str, Any] = {}
    results["d_kv"] = r
    async with KVClient.connect(RPC_URL) as kv:
        value = pattern("from-guest-B", KV_VALUE_SIZE)
        sha = hashlib.sha256(value).hexdigest()
        t = now()
        await kv.put("from-B", value)
        r["put_ms"] = round((now() - t) * 1e3, 3)
        r["own_read_ok"] = hashlib.sha256(await kv.get_bytes("from-B")).hexdigest() == sha
        r["put"] = {"key": "from-B", "size": len(value), "sha256": sha}
        write_json("phases.json", results)
        write_json("kv-put.json", r["put"])
        from_a = await asyncio.to_thread(wait_json, "kv-from-a.json", 300)
        r["from_a"] = from_a
        t = now()
        block = await kv.get(from_a["key"])
        r["get_ms"] = round((now() - t) * 1e3, 3)
        with block:
            view = block.view()
            r["read"] = {"size": len(view), "sha256": hashlib.sha256(view).hexdigest(),
                         "zero_copy": isinstance(view.obj, mmap.mmap)}
            del view
        r["read"]["ok"] = r["read"]["sha256"] == from_a["sha256"] and r["read"]["size"] == from_a["size"]
        r["missing_key_raises"] = (await expect_error(kv.get("no-such-key"), KeyError))[0]


async def client_main() -> None:
    results: dict[str, Any] = {"me": me(), "calibrate_s": calibrate()}
    t = now()
    with watchdog("connect", 30):
        client = await cxlrpc.connect(RPC_URL)
    results["connect_ms"] = round((now() - t) * 1e3, 3)
    for phase, budget, fn in (("a_contract", 120, lambda: phase_contract(client, results["me"])),
                              ("b_echo", 400, lambda: phase_echo(client)),
                              ("c_idle", 120, lambda: phase_idle(client))):
        try:
            with watchdog(phase, budget):
                results[phase] = await fn()
        except Exception:  # noqa: BLE001 - recorded for the host to assert on
            results[phase] = {"error": traceback.format_exc()}
        write_json("phases.json", results)
    try:
        with watchdog("d_kv", 400):
            await phase_kv(results)
    except Exception:  # noqa: BLE001
        results.setdefault("d_kv", {})["error"] = traceback.format_exc()
        write_json("kv-put.json", {"error": results["d_kv"]["error"]})
    write_json("phases.json", results)
    # (e): call in a loop until the host kills this guest
    write_json("looping", {"calls_so_far": 0})
    i = 0
    while True:
        i += 1
        try:
            got = await client.call("echo", payload(1 << 42 | i), timeout=10)
            if got != payload(1 << 42 | i):
                raise AssertionError(f"wrong reply {got!r:.80} to loop call {i}")
        except Exception:  # noqa: BLE001 - should never happen before the kill
            write_json("loop-error.json", {"call": i, "error": traceback.format_exc()})
            raise


async def client2_main() -> None:
    res: dict[str, Any] = {"me": me()}
    t = now()
    client = await cxlrpc.connect(RPC_URL)
    res["connect_ms"] = round((now() - t) * 1e3, 3)
    bad = 0
    for i in range(1000):
        bad += await client.call("echo", payload(1 << 43 | i), timeout=10) != payload(1 << 43 | i)
    res["echo_1000_wrong"] = bad
    write_json("looping", res)
    last_ok = now()
    start = last_ok
    calls = 0
    while True:
        try:
            await client.call("echo", payload(calls), timeout=10)
            last_ok = now()
            calls += 1
        except cxlrpc.Unavailable as exc:
            res["outcome"] = "Unavailable"
            res["error"] = str(exc)
            break
        except Exception as exc:  # noqa: BLE001 - DeadlineExceeded here would mean a hang
            res["outcome"] = type(exc).__name__
            res["error"] = f"{type(exc).__name__}: {exc}"
            break
        if now() - start > 120:
            res["outcome"] = "no error within 120 s"
            break
    res["detect_s"] = round(now() - last_ok, 4)  # upper bound on the time since the kill
    res["loop_calls"] = calls
    t = now()
    try:
        await client.call("echo", b"after", timeout=5)
        res["next_call"] = "succeeded?!"
    except Exception as exc:  # noqa: BLE001
        res["next_call"] = f"{type(exc).__name__} after {(now() - t) * 1e3:.2f} ms"
    write_json("result.json", res)
    with contextlib.suppress(Exception):
        await client.close()


def main() -> int:
    role = sys.argv[1]
    roles = {"server": serve, "kvpeer": kvpeer, "client": client_main, "client2": client2_main}
    try:
        cxlrpc.run(roles[role]())
    except Exception:
        write_json(f"error-{role}.json", {"error": traceback.format_exc()})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
