"""Idle: server and client CPU use while no calls run, the latency of the first call after
idling, and the tail of the 4 KiB calls that follow it (a burst after idle: what walks pages
the machine let go cold)."""
from __future__ import annotations

import asyncio
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from .echo import aclose, start_server
from .grpc_echo import run_loop
from .procs import CLK_TCK, Worker, WorkerError, cpu_ticks
from .transports import BY_KEY, resolve

TRANSPORTS = ("cxl-aio", "grpc-aio-tcp")
PAYLOAD = 64
#: The burst after each idle period: this many calls of BURST_PAYLOAD bytes.
BURST, BURST_PAYLOAD = 625, 4096


async def _client(conn: Connection, transport: str, address: str, server_pid: int, reps: int,
                  idle_s: float, cpu_window: float) -> None:
    t = BY_KEY[transport]
    client = await resolve(t.opener)(address, max_payload=1 << 20, **t.client_opts)
    try:
        call, clock, payload, me = client.call, time.perf_counter_ns, b"x" * PAYLOAD, os.getpid()
        big = os.urandom(BURST_PAYLOAD)
        conn.send(("ready", None))
        conn.recv()  # go
        out: dict[str, list[float]] = {"server_cpu_pct": [], "client_cpu_pct": [], "first_call_us": [],
                                       "busy_p50_us": [], "burst_p99_us": []}
        for _ in range(reps):
            busy = np.empty(300, dtype=np.int64)
            for i in range(busy.size):
                t0 = clock()
                await call(payload)
                busy[i] = clock() - t0
            s0, c0, w0 = cpu_ticks(server_pid), cpu_ticks(me), time.monotonic()
            await asyncio.sleep(cpu_window)
            s1, c1, w1 = cpu_ticks(server_pid), cpu_ticks(me), time.monotonic()
            await asyncio.sleep(max(0.0, idle_s - (time.monotonic() - w0)))
            t0 = clock()
            await call(payload)
            first = clock() - t0
            burst = np.empty(BURST, dtype=np.int64)
            for i in range(BURST):
                t0 = clock()
                await call(big)
                burst[i] = clock() - t0
            span = (w1 - w0) * CLK_TCK
            out["server_cpu_pct"].append(100.0 * (s1 - s0) / span)
            out["client_cpu_pct"].append(100.0 * (c1 - c0) / span)
            out["first_call_us"].append(first / 1e3)
            out["busy_p50_us"].append(float(np.median(busy)) / 1e3)
            out["burst_p99_us"].append(float(np.percentile(burst, 99)) / 1e3)
            conn.send(("progress", 1))
        conn.send(("result", out))
    finally:
        await aclose(client)


def idle_client(conn: Connection, transport: str, address: str, server_pid: int, reps: int, idle_s: float,
                cpu_window: float, loop: str = "uvloop") -> None:
    """Client worker: per rep, 300 calls, CPU of both processes over ``cpu_window`` s, first
    call after ``idle_s`` s, then BURST calls of BURST_PAYLOAD bytes."""
    run_loop(_client(conn, transport, address, server_pid, reps, idle_s, cpu_window), loop)


def run_idle(cfg: dict, progress: Any, log: Callable[[str], None]) -> dict:
    """The idle section: per round, each transport's fresh processes run ``reps`` idle periods."""
    idle_s, cpu_window = 3.0, 1.0
    reps = 1 if cfg["quick"] else 3
    rounds = 1 if cfg["quick"] else cfg["rounds"]
    transports = [BY_KEY[k] for k in TRANSPORTS if BY_KEY[k].skip_reason() is None]
    task = progress.add_task("idle", total=rounds * len(transports) * reps)
    raw: dict[str, dict[str, list[float]]] = {t.key: {} for t in transports}
    errors: dict[str, list[str]] = {}
    for r in range(rounds):
        order = transports if r % 2 == 0 else transports[::-1]
        for t in order:
            progress.update(task, description=f"idle r{r + 1}/{rounds} {t.key}")
            done = []
            try:
                with start_server(t, 1 << 20, cfg["loop"]) as srv:
                    with Worker("bench.idle:idle_client", f"{t.key}-idle", transport=t.key,
                                address=srv.info["address"], server_pid=srv.info["pid"], reps=reps,
                                idle_s=idle_s, cpu_window=cpu_window, loop=cfg["loop"]) as cli:
                        cli.start(60)
                        cli.send("go")
                        res = cli.expect("result", 60 + reps * (idle_s + 5),
                                         lambda x: (done.append(x), progress.advance(task)))
                for k, v in res.items():
                    raw[t.key].setdefault(k, []).extend(v)
            except WorkerError as exc:
                errors.setdefault(t.key, []).append(str(exc))
                log(f"[red]idle {t.key} round {r + 1} failed: {str(exc).splitlines()[0]}")
                progress.advance(task, reps - len(done))
    out: dict[str, Any] = {"idle_s": idle_s, "cpu_window_s": cpu_window, "burst": BURST, "reps_per_round": reps,
                           "rounds": rounds, "clk_tck": CLK_TCK, "errors": errors, "transports": {}}
    for t in transports:
        if raw[t.key]:
            out["transports"][t.key] = {"label": t.label, "family": t.family, "samples": raw[t.key],
                                        "median": {k: statistics.median(v) for k, v in raw[t.key].items()}}
    return out
