"""Echo round trip: one server process and one client process per transport, per round."""
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


async def _async_client(conn: Connection, t: Transport, address: str, plan: list, max_payload: int) -> None:
    client = await resolve(t.opener)(address, max_payload=max_payload, **t.client_opts)
    try:
        conn.send(("ready", None))
        conn.recv()  # go
        call, clock, out = client.call, time.perf_counter_ns, {}
        for size, n, warm in plan:
            payload = np.random.default_rng(size).bytes(size)
            _check(await call(payload), payload)
            for _ in range(warm):
                await call(payload)
            samples = np.empty(n, dtype=np.int64)
            start = clock()
            for i in range(n):
                t0 = clock()
                await call(payload)
                samples[i] = clock() - t0
            out[size] = (samples, clock() - start)
            conn.send(("progress", size))
        conn.send(("result", out))
    finally:
        await aclose(client)


def _sync_client(conn: Connection, t: Transport, address: str, plan: list, max_payload: int) -> None:
    client = resolve(t.opener)(address, max_payload=max_payload, **t.client_opts)
    try:
        conn.send(("ready", None))
        conn.recv()  # go
        call, clock, out = client.call, time.perf_counter_ns, {}
        for size, n, warm in plan:
            payload = np.random.default_rng(size).bytes(size)
            _check(call(payload), payload)
            for _ in range(warm):
                call(payload)
            samples = np.empty(n, dtype=np.int64)
            start = clock()
            for i in range(n):
                t0 = clock()
                call(payload)
                samples[i] = clock() - t0
            out[size] = (samples, clock() - start)
            conn.send(("progress", size))
        conn.send(("result", out))
    finally:
        client.close()


def echo_client(conn: Connection, transport: str, address: str, plan: list, max_payload: int,
                loop: str = "uvloop") -> None:
    """Client worker: open, report ready, wait for go, time every planned payload, send samples."""
    from .transports import BY_KEY

    t = BY_KEY[transport]
    if t.is_async:
        run_loop(_async_client(conn, t, address, plan, max_payload), loop)
    else:
        _sync_client(conn, t, address, plan, max_payload)


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


def measure_once(t: Transport, plan: list, max_payload: int, loop: str,
                 on_progress: Callable[[Any], None]) -> dict[int, tuple[np.ndarray, int]]:
    """One round of one transport: fresh server and client processes, all payloads."""
    with start_server(t, max_payload, loop) as srv:
        with Worker("bench.echo:echo_client", f"{t.key}-client", transport=t.key,
                    address=srv.info["address"], plan=plan, max_payload=max_payload, loop=loop) as cli:
            cli.start(timeout=60)
            cli.send("go")
            budget = 120 + sum(n + w for _, n, w in plan) * 0.05
            return cli.expect("result", budget, on_progress)


def run_echo(cfg: dict, progress: Any, log: Callable[[str], None]) -> dict:
    """The echo section: every transport once per round (order rotated each round), all payloads."""
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
    rounds = cfg["rounds"]
    task = progress.add_task("echo", total=rounds * len(transports) * len(plan))
    raw: dict[str, dict[int, list]] = {t.key: {s: [] for s in sizes} for t in transports}
    errors: dict[str, list[str]] = {}
    for r in range(rounds):
        k = r % max(1, len(transports))
        order = transports[k:] + transports[:k]
        if r % 2:
            order.reverse()
        for t in order:
            progress.update(task, description=f"echo r{r + 1}/{rounds} {t.key}")
            done = []
            try:
                res = measure_once(t, plan, max_payload, cfg["loop"],
                                   lambda s: (done.append(s), progress.advance(task)))
            except WorkerError as exc:
                errors.setdefault(t.key, []).append(str(exc))
                log(f"[red]echo {t.key} round {r + 1} failed: {str(exc).splitlines()[0]}")
                progress.advance(task, len(plan) - len(done))
                continue
            for s, (samples, wall) in res.items():
                raw[t.key][s].append((samples, wall))
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
