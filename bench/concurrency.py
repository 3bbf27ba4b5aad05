"""Concurrency: calls/s and p99 with 1, 8, 64 calls in flight from one client, and from 4 clients."""
from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from .echo import aclose, start_server
from .grpc_echo import run_loop
from .procs import Worker, WorkerError, wait_readable
from .stats import median_of, pooled, summarize
from .transports import BY_KEY, resolve

TRANSPORTS = ("cxl-aio", "grpc-aio-tcp")
INFLIGHT = (1, 8, 64)
PROCS, PROC_INFLIGHT = 4, 8
PAYLOAD = 64


async def _burst(call: Callable, payload: bytes, inflight: int, duration: float) -> tuple[np.ndarray, int]:
    """``inflight`` closed-loop callers for ``duration`` seconds; returns (latencies ns, wall ns)."""
    clock = time.perf_counter_ns
    samples: list[int] = []
    add = samples.append
    end = clock() + int(duration * 1e9)

    async def caller() -> None:
        while True:
            t0 = clock()
            if t0 >= end:
                return
            await call(payload)
            add(clock() - t0)

    start = clock()
    await asyncio.gather(*(caller() for _ in range(inflight)))
    return np.array(samples, dtype=np.int64), clock() - start


async def _client(conn: Connection, transport: str, address: str) -> None:
    t = BY_KEY[transport]
    client = await resolve(t.opener)(address, max_payload=1 << 20, **t.client_opts)
    try:
        payload = b"x" * PAYLOAD
        conn.send(("ready", None))
        while True:
            await wait_readable(conn)
            msg = conn.recv()
            if msg[0] != "run":
                return
            _, inflight, duration, warm = msg
            await _burst(client.call, payload, inflight, warm)
            conn.send(("result", await _burst(client.call, payload, inflight, duration)))
    finally:
        await aclose(client)


def conc_client(conn: Connection, transport: str, address: str, loop: str = "uvloop") -> None:
    """Client worker: on each ("run", inflight, seconds, warm-up seconds) send back (samples, wall)."""
    run_loop(_client(conn, transport, address), loop)


def _gather(workers: list[Worker], inflight: int, duration: float, warm: float) -> dict[str, float]:
    for w in workers:
        w.send("run", inflight, duration, warm)
    res = [w.expect("result", 60 + 4 * (duration + warm)) for w in workers]
    s = summarize(pooled(a for a, _ in res))
    s["calls_per_s"] = sum(a.size / (wall / 1e9) for a, wall in res)
    return s


def _clients(stack: ExitStack, key: str, addr: str, loop: str, n: int, first: int = 0) -> list[Worker]:
    """Start ``n`` client workers in parallel (ended by ``stack``) and wait until all are ready."""
    ws = [stack.enter_context(Worker("bench.concurrency:conc_client", f"{key}-conc{first + i}",
                                     transport=key, address=addr, loop=loop)) for i in range(n)]
    for w in ws:
        w.launch()
    for w in ws:
        w.wait_ready(60)
    return ws


def run_concurrency(cfg: dict, progress: Any, log: Callable[[str], None]) -> dict:
    """The concurrency section: for each transport and round, fresh processes, every setting."""
    duration, warm = (0.8, 0.2) if cfg["quick"] else (2.5, 0.5)
    settings = [f"1x{k}" for k in INFLIGHT] + [f"{PROCS}x{PROC_INFLIGHT}"]
    transports = [BY_KEY[k] for k in TRANSPORTS if BY_KEY[k].skip_reason() is None]
    rounds = cfg["rounds"]
    task = progress.add_task("concurrency", total=rounds * len(transports) * len(settings))
    raw: dict[str, dict[str, list]] = {t.key: {s: [] for s in settings} for t in transports}
    errors: dict[str, list[str]] = {}
    for r in range(rounds):
        order = transports if r % 2 == 0 else transports[::-1]
        for t in order:
            progress.update(task, description=f"concurrency r{r + 1}/{rounds} {t.key}")
            done = 0
            try:
                with ExitStack() as stack:
                    srv = stack.enter_context(start_server(t, 1 << 20, cfg["loop"]))
                    addr = srv.info["address"]
                    clients = _clients(stack, t.key, addr, cfg["loop"], 1)
                    for k in INFLIGHT:
                        raw[t.key][f"1x{k}"].append(_gather(clients[:1], k, duration, warm))
                        done += 1
                        progress.advance(task)
                    clients += _clients(stack, t.key, addr, cfg["loop"], PROCS - 1, first=1)
                    raw[t.key][settings[-1]].append(_gather(clients, PROC_INFLIGHT, duration, warm))
                    done += 1
                    progress.advance(task)
            except WorkerError as exc:
                errors.setdefault(t.key, []).append(str(exc))
                log(f"[red]concurrency {t.key} round {r + 1} failed: {str(exc).splitlines()[0]}")
                progress.advance(task, len(settings) - done)
    out: dict[str, Any] = {"payload": PAYLOAD, "settings": settings, "duration_s": duration, "errors": errors,
                           "transports": {}}
    for t in transports:
        out["transports"][t.key] = {"label": t.label, "family": t.family, "settings": {
            s: {"rounds": v, "median": median_of(v)} for s, v in raw[t.key].items() if v}}
    return out
