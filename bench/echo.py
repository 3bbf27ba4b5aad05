"""Echo round trip: a server process and a client process per transport and round, each payload
timed in blocks that take turns with the other transports' (bench.turns)."""
from __future__ import annotations

import inspect
import itertools
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from .grpc_echo import run_loop
from .procs import Worker, WorkerError
from .stats import cdf_points, change, median_of, pooled, summarize
from .transports import ECHO, Transport, resolve
from .turns import BLOCKS, QUICK_BLOCKS, SETTLE_NS, Pair, run_rounds

KIB, MIB = 1024, 1024 * 1024
SIZES = (64, 4 * KIB, 64 * KIB, MIB)
HUGE = 16 * MIB
_counter = itertools.count()


def plan_for(sizes: tuple[int, ...], quick: bool) -> list[tuple[int, int, int]]:
    """(payload, timed calls, warm-up calls) per size: fewer calls for bigger payloads."""
    base = 1500 if quick else 10000
    out = []
    for s in sizes:
        n = base if s <= 4 * KIB else base // 3 if s <= 64 * KIB else base // 20 if s <= MIB else 12 if quick else 30
        out.append((s, n, max(5, n // 10)))
    return out


def next_id() -> int:
    """A run-unique instance number (for shm names and socket paths)."""
    return next(_counter)


async def aclose(client: Any) -> None:
    res = client.close()
    if inspect.isawaitable(res):
        await res


def _check(reply: bytes, payload: bytes) -> None:
    if len(reply) != len(payload) or reply[:64] != payload[:64] or reply[-64:] != payload[-64:]:
        raise AssertionError(f"echo mismatch: sent {len(payload)} bytes, got {len(reply)}")


def _payload(cache: dict[int, bytes], size: int) -> bytes:
    """The (seeded) payload of ``size`` bytes, made once per client."""
    if size not in cache:
        cache[size] = np.random.default_rng(size).bytes(size)
    return cache[size]


async def _async_client(conn: Connection, t: Transport, address: str, max_payload: int) -> None:
    client = await resolve(t.opener)(address, max_payload=max_payload, **t.client_opts)
    try:
        conn.send(("ready", None))
        call, clock, payloads = client.call, time.perf_counter_ns, {}
        while (msg := conn.recv())[0] == "block":
            _, size, n, warm = msg
            new, payload = size not in payloads, _payload(payloads, size)
            if new:
                _check(await call(payload), payload)
            small, settled = _payload(payloads, 64), clock() + SETTLE_NS
            while clock() < settled:
                await call(small)
            for _ in range(warm):
                await call(payload)
            samples = np.empty(n, dtype=np.int64)
            start = clock()
            for i in range(n):
                t0 = clock()
                await call(payload)
                samples[i] = clock() - t0
            conn.send(("block", (samples, clock() - start)))
    finally:
        await aclose(client)


def _sync_client(conn: Connection, t: Transport, address: str, max_payload: int) -> None:
    client = resolve(t.opener)(address, max_payload=max_payload, **t.client_opts)
    try:
        conn.send(("ready", None))
        call, clock, payloads = client.call, time.perf_counter_ns, {}
        while (msg := conn.recv())[0] == "block":
            _, size, n, warm = msg
            new, payload = size not in payloads, _payload(payloads, size)
            if new:
                _check(call(payload), payload)
            small, settled = _payload(payloads, 64), clock() + SETTLE_NS
            while clock() < settled:
                call(small)
            for _ in range(warm):
                call(payload)
            samples = np.empty(n, dtype=np.int64)
            start = clock()
            for i in range(n):
                t0 = clock()
                call(payload)
                samples[i] = clock() - t0
            conn.send(("block", (samples, clock() - start)))
    finally:
        client.close()


def echo_client(conn: Connection, transport: str, address: str, max_payload: int,
                loop: str = "uvloop") -> None:
    """Client worker: open, report ready, then time each ``("block", size, calls, warm-up)``
    asked for and send its samples back, until told to stop."""
    from .transports import BY_KEY

    t = BY_KEY[transport]
    if t.is_async:
        run_loop(_async_client(conn, t, address, max_payload), loop)
    else:
        _sync_client(conn, t, address, max_payload)


def start_server(t: Transport, max_payload: int, loop: str, **extra: Any) -> Worker:
    """Start ``t``'s server process (caller stops it); its ready info holds the address."""
    w = Worker(t.server, f"{t.key}-server", address=t.address(next_id()), max_payload=max_payload,
               loop=loop, **{**t.server_opts, **extra})
    try:
        w.start(timeout=60)
    except BaseException:
        w.stop()
        raise
    return w


def _pair(t: Transport, max_payload: int, loop: str) -> Pair:
    """``t``'s server and client processes, started, for a round of turns."""
    server = start_server(t, max_payload, loop)
    client = Worker("bench.echo:echo_client", f"{t.key}-client", transport=t.key,
                    address=server.info["address"], max_payload=max_payload, loop=loop)
    return Pair.started(t.key, t.idle, server, client, 60)


def run_echo(cfg: dict, progress: Any, log: Callable[[str], None]) -> dict:
    """The echo section: per round, fresh processes for every transport, each payload timed in
    blocks that take turns with the other transports' (bench.turns)."""
    sizes = tuple(SIZES) + ((HUGE,) if cfg["huge"] else ())
    plan = plan_for(sizes, cfg["quick"])
    max_payload = max(sizes)
    transports, skipped = [], {}
    for t in ECHO:
        if cfg["transports"] and t.key not in cfg["transports"]:
            continue
        reason = t.skip_reason()
        if reason:
            skipped[t.key] = reason
            log(f"[yellow]skip {t.label}: {reason}")
        else:
            transports.append(t)
    errors: dict[str, list[str]] = {}

    def failed(key: str, r: int, exc: WorkerError) -> None:
        errors.setdefault(key, []).append(str(exc))
        log(f"[red]echo {key} round {r + 1} failed: {str(exc).splitlines()[0]}")

    raw = run_rounds(transports, lambda t: _pair(t, max_payload, cfg["loop"]), plan, cfg["rounds"],
                     QUICK_BLOCKS if cfg["quick"] else BLOCKS, progress, "echo", failed)
    return summarize_echo(transports, raw, sizes, plan, skipped, errors)


def summarize_echo(transports: list[Transport], raw: dict, sizes: tuple[int, ...], plan: list,
                   skipped: dict, errors: dict) -> dict:
    """Per-round summaries, their medians, pooled percentiles, the gRPC baselines, flush rows'
    changes vs their hardware twin and 64 B CDFs."""
    out: dict[str, Any] = {"sizes": list(sizes), "plan": [list(p) for p in plan], "transports": {},
                           "skipped": skipped, "errors": errors, "baseline": {}, "cdf_64": {}}
    for t in transports:
        per = {}
        for s in sizes:
            rounds = [summarize(a, w) for a, w in raw[t.key][s]]
            if not rounds:
                continue
            per[str(s)] = {"rounds": rounds, "median": median_of(rounds),
                           "pooled": summarize(pooled(a for a, _ in raw[t.key][s]))}
        out["transports"][t.key] = {"label": t.label, "family": t.family, "hardware": t.hardware, "sizes": per}
        if raw[t.key].get(64):
            xs, ys = cdf_points(pooled(a for a, _ in raw[t.key][64]))
            out["cdf_64"][t.key] = {"us": xs, "frac": ys}
    for s in sizes:
        base = {}
        for metric in ("p50", "p99", "p99.9"):
            cands = [(v["sizes"][str(s)]["median"][metric], k) for k, v in out["transports"].items()
                     if v["family"] == "grpc" and str(s) in v["sizes"]]
            if cands:
                val, key = min(cands)
                base[metric] = {"transport": key, "us": val}
        cands = [(v["sizes"][str(s)]["median"]["calls_per_s"], k) for k, v in out["transports"].items()
                 if v["family"] == "grpc" and str(s) in v["sizes"]]
        if cands:
            val, key = max(cands)
            base["calls_per_s"] = {"transport": key, "value": val}
        out["baseline"][str(s)] = base
        for v in out["transports"].values():
            m = v["sizes"].get(str(s), {}).get("median")
            if m and base:
                v["sizes"][str(s)]["reduction"] = {
                    metric: 1.0 - m[metric] / base[metric]["us"] for metric in ("p50", "p99", "p99.9") if metric in base}
    for v in out["transports"].values():
        twin = out["transports"].get(v["hardware"], {}).get("sizes", {})
        for size, row in v["sizes"].items():
            hw = twin.get(size, {}).get("median")
            if hw:
                row["vs_hardware"] = {m: change(row["median"][m], hw[m]) for m in ("p50", "p99", "p99.9")}
    return out
