"""``python -m bench.flush``: flush mode beside hardware mode, every reply verified, against the
targets of issue 42 (flush / hardware p50 per row).

Rows: echo of 64 B, 4 KiB, 64 KiB and 1 MiB (server and client in processes of their own on a
``shm://`` region, the server's ``async def`` handler, an asyncio client: the echo section's
``cxl-aio`` and ``cxl-aio-flush`` transports), then kvservice's zero-copy get (lease, read one
byte, release) and get_into (a copy into a preallocated buffer) of 4 KiB, 64 KiB and 1 MiB
(the kv section's ``kv-shm`` and ``kv-shm-flush`` backends). The table shows, per row and mode,
the median across rounds of each round's p50 and p99, the ratio of the two p50 medians (and
the range of the per-round ratios), the target and PASS/FAIL.

How the modes alternate (``bench.turns``): per round, fresh server and client processes for
both modes, each row timed in 16 blocks that alternate between the modes (order rotated each
turn). Blocks, not one mode per round: this VM's cross-core transfers change level for seconds
at a time (``python -m bench.drift``), so a mode measured for a whole round can see another
machine than the other mode did. Fresh processes per round: each round draws new CPUs and
memory placement, so no one placement decides the median. Between its turns a mode's
processes are SIGSTOPped: an idle flush-mode server polls its request rings (no doorbell can
wake it across hosts; ~6% of a core here), which would load the other mode's turns and flatter
the ratio. A pause lasts one block of the other mode (~0.1 s; past its 1 s client_timeout a
server would reap its client: that round would fail, not mislead).

Every reply is compared whole with what it must be (echo: the bytes sent; kv: the bytes put
under that key), outside the timed window; each row cycles through 4 distinct values, so a
stale reply or one meant for another call fails. A mismatch ends that mode's round with an
error (and the row FAILs); the table counts the replies each row verified. This checks replies,
not coherence (values never change during the run): the flush and mutation tests do that.
What a check costs the timings: at 1 MiB, reading the value between calls (as any whole check
must) cools the client's caches for the next call, which slows hardware mode's zero-copy get
(~5 us) far more than flush mode's (~105 us): that row's ratio comes out narrower than in a hot
loop (``python -m bench``'s table, one byte read, is that loop). Up to 64 KiB it moves < 1 us.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Awaitable, Callable, Hashable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench/__main__.py says why

import numpy as np

from . import report
from .echo import start_server
from .grpc_echo import run_loop
from .kv import start_server as start_kv_server
from .kv_backends import BY_KEY as KV_BY_KEY
from .kv_backends import KV_FLUSH, KV_SHM, AsyncKV
from .procs import Worker, WorkerError, cleanup, stop_on_signals, wait_readable
from .stats import median_of, pooled, summarize
from .transports import BY_KEY as ECHO_BY_KEY
from .transports import Transport, resolve
from .turns import BLOCKS, QUICK_BLOCKS, SETTLE_NS, Pair, run_rounds

KIB, MIB = 1024, 1024 * 1024
#: Timed calls per row, round and mode (a hundredth with --quick): echo by payload, kv by value size.
ECHO_CALLS = {64: 6000, 4 * KIB: 6000, 64 * KIB: 3000, MIB: 1000}
KV_CALLS = {4 * KIB: 3000, 64 * KIB: 2000, MIB: 1000}
KV_SIZES = tuple(KV_CALLS)
KV_OPS = ("get", "get_into")
#: The rows' hardware and flush twins (keys of bench.transports / bench.kv_backends).
ECHO_MODES = ("cxl-aio", "cxl-aio-flush")
KV_MODES = (KV_SHM.key, KV_FLUSH.key)
#: Issue 42's acceptance: flush / hardware p50 at most this, per (operation, size).
TARGETS: dict[tuple[str, int], float] = {
    ("echo", 64): 3.0, ("echo", 4 * KIB): 3.0, ("echo", 64 * KIB): 2.0, ("echo", MIB): 2.5,
    **{(op, size): 2.0 for size in KV_SIZES for op in KV_OPS}}
#: Distinct values per row, cycled call by call.
VALUES = 4
RESULTS = Path(__file__).resolve().parent / "results"

Unit = tuple[str, int]  # (operation, size): one row
Step = Callable[[], Awaitable[int]]  # one call: its reply verified, returns the timed ns


def row_name(unit: Unit) -> str:
    op, size = unit
    return f"echo {report.size_label(size)}" if op == "echo" else f"kv {op} {report.size_label(size)}"


def plans(quick: bool) -> dict[str, list[tuple[Unit, int, int]]]:
    """(row, timed calls, warm-up calls) per section, per round and mode."""
    scale = 100 if quick else 1

    def plan(counts: dict[int, int], ops: tuple[str, ...]) -> list[tuple[Unit, int, int]]:
        return [((op, s), n // scale, max(3, n // scale // 10)) for s, n in counts.items() for op in ops]

    return {"echo": plan(ECHO_CALLS, ("echo",)), "kv": plan(KV_CALLS, KV_OPS)}


# ---- client side (in the client workers) -----------------------------------------------------

def value(size: int, j: int) -> bytes:
    """The ``j``-th value of ``size`` bytes (seeded: every process makes the same)."""
    return np.random.default_rng([size, j]).bytes(size)


def verify(got: Any, want: bytes, what: str) -> None:
    """Raise AssertionError unless ``got`` (bytes or any buffer) holds exactly ``want``.

    A buffer is compared in place, 8 bytes at a time into a scratch array kept per size, not
    copied first: what a check touches between calls is taken from the next timed call's caches
    (hardware mode's 1 MiB zero-copy get, p50 here: ~5 us with nothing between calls, ~14
    reading the value, ~30 comparing it in place, ~38 copying it first)."""
    if isinstance(got, bytes):
        same = got == want
    else:
        mine, theirs = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
        same = mine.size == theirs.size
        if same and mine.size % 8 == 0:
            mine, theirs = mine.view(np.uint64), theirs.view(np.uint64)
        if same:
            scratch = _SCRATCH.get(mine.size)
            if scratch is None:
                scratch = _SCRATCH.setdefault(mine.size, np.empty(mine.size, bool))
            same = bool(np.equal(mine, theirs, out=scratch).all())
    if not same:
        raise AssertionError(f"{what}: the reply ({memoryview(got).nbytes} bytes) is not the "
                             f"{len(want)} bytes expected")


_SCRATCH: dict[int, np.ndarray] = {}  # verify's, by element count


def echo_step(call: Callable[[bytes], Awaitable[Any]], size: int) -> Step:
    """An echo of ``size`` bytes (the values in turn), the reply checked against what was sent."""
    values, turn, clock = [value(size, j) for j in range(VALUES)], itertools.count(), time.perf_counter_ns

    async def step() -> int:
        want = values[next(turn) % VALUES]
        t0 = clock()
        got = await call(want)
        elapsed = clock() - t0
        verify(got, want, f"echo of {size} bytes")
        return elapsed

    return step


def kv_key(size: int, j: int) -> str:
    return f"flush-{size}-{j}"


def kv_step(kv: Any, op: str, size: int) -> Step:
    """A zero-copy get (lease, read one byte, release: what the kv section times) or a get_into,
    of the keys of ``size`` in turn; the bytes read checked against what was put."""
    keys, turn, clock = [kv_key(size, j) for j in range(VALUES)], itertools.count(), time.perf_counter_ns
    values = [value(size, j) for j in range(VALUES)]

    async def get() -> int:
        j = next(turn) % VALUES
        t0 = clock()
        block = await kv.get(keys[j])
        view = block.view()
        view[0]  # the zero-copy read
        t1 = clock()
        verify(view, values[j], f"get {keys[j]}")  # within the lease, untimed
        t2 = clock()
        block.release()
        return t1 - t0 + clock() - t2

    out = np.empty(size, np.uint8)

    async def get_into() -> int:
        j = next(turn) % VALUES
        t0 = clock()
        n = await kv.get_into(keys[j], out)
        elapsed = clock() - t0
        verify(out[:n], values[j], f"get_into {keys[j]}")
        return elapsed

    return {"get": get, "get_into": get_into}[op]


async def serve_blocks(conn: Connection, step_for: Callable[[Unit], Step],
                       settle: Callable[[], Awaitable[Any]]) -> None:
    """Answer the parent (a ``bench.turns.Pair``) until it says stop: ``("block", row, calls,
    warm-up)`` with ``("block", (samples_ns, timed_ns))``, ``("tally",)`` with the replies
    verified per row. ``settle``: a small call (checked too), made for ``SETTLE_NS`` before
    a block's warm-up."""
    steps: dict[Hashable, Step] = {}
    verified: dict[Hashable, int] = {}
    clock = time.perf_counter_ns
    conn.send(("ready", None))
    while True:
        await wait_readable(conn)  # the loop runs while idle: heartbeats beat, leases end
        msg = conn.recv()
        if msg[0] == "tally":
            conn.send(("tally", verified))
            continue
        if msg[0] != "block":
            return
        _, unit, n, warm = msg
        step = steps.get(unit) or steps.setdefault(unit, step_for(unit))
        settled = clock() + SETTLE_NS
        while clock() < settled:
            await settle()
        for _ in range(warm):
            await step()
        samples = np.empty(n, dtype=np.int64)
        for i in range(n):
            samples[i] = await step()
        verified[unit] = verified.get(unit, 0) + warm + n
        # checks take time between calls: calls/s from the timed windows alone
        conn.send(("block", (samples, int(samples.sum()))))


def echo_client(conn: Connection, transport: str, address: str, loop: str = "uvloop") -> None:
    """Client worker of an echo mode (``bench.transports`` key)."""
    t = ECHO_BY_KEY[transport]

    async def main() -> None:
        client = await resolve(t.opener)(address, **t.client_opts)
        try:
            await serve_blocks(conn, lambda unit: echo_step(client.call, unit[1]), echo_step(client.call, 64))
        finally:
            await client.close()

    run_loop(main(), loop)


def kv_client(conn: Connection, backend: str, address: str, sizes: list[int], loop: str = "uvloop") -> None:
    """Client worker of a kv mode (``bench.kv_backends`` key): puts every key, then serves blocks."""
    b = KV_BY_KEY[backend]

    async def main() -> None:
        kv = (await AsyncKV.open(b, address)).kv
        try:
            for size in sizes:
                for j in range(VALUES):
                    await kv.put(kv_key(size, j), value(size, j))
            probe = kv_key(sizes[0], 0)

            async def settle() -> None:
                if not await kv.exists(probe):
                    raise AssertionError(f"exists({probe!r}) is False after its put")

            await serve_blocks(conn, lambda unit: kv_step(kv, *unit), settle)
        finally:
            await kv.close()

    run_loop(main(), loop)


# ---- parent side ------------------------------------------------------------------------------

class TalliedPair(Pair):
    """A mode's pair, paused between its turns from its first block on (not while the other
    mode's processes start: seconds, and a server resumed after more than its client_timeout
    reaps its client before that client beats again), whose client says, before it stops, how
    many replies it verified."""

    sink: Callable[[str, dict], None] | None = None
    timed = False  # no block yet: Pair.__init__ does not pause it

    def block(self, unit: Hashable, n: int, warm: int) -> tuple[np.ndarray, int]:
        self.timed = True
        return super().block(unit, n, warm)

    def _rest(self) -> None:
        if self.timed:
            super()._rest()

    def stop(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None and self.client.proc.is_alive():
            try:
                self.client.resume()
                self.client.send("tally")
                sink(self.key, self.client.expect("tally", 30))
            except WorkerError:
                pass  # the round already failed, or fails now: its error is what counts
        super().stop()


def _pair(server: Worker, client: Worker, key: str, sink: Callable[[str, dict], None]) -> Pair:
    pair = TalliedPair.started(key, "pause", server, client, 120)
    pair.sink = sink
    return pair


def _echo_pair(t: Transport, loop: str, sink: Callable[[str, dict], None]) -> Pair:
    server = start_server(t, MIB, loop)
    client = Worker("bench.flush:echo_client", f"{t.key}-client", transport=t.key,
                    address=server.info["address"], loop=loop)
    return _pair(server, client, t.key, sink)


def _kv_pair(key: str, loop: str, sink: Callable[[str, dict], None]) -> Pair:
    b = KV_BY_KEY[key]
    server = start_kv_server(b, loop, 64 * MIB, "")
    client = Worker("bench.flush:kv_client", f"{key}-client", backend=key, address=server.info["address"],
                    sizes=list(KV_SIZES), loop=loop)
    return _pair(server, client, key, sink)


def measure(cfg: dict, progress: Any, log: Callable[[str], None]) -> dict:
    """Both sections' rounds: raw samples, tallies and errors per mode (keys of both sections)."""
    blocks = QUICK_BLOCKS if cfg["quick"] else BLOCKS
    raw: dict[str, dict] = {}
    tallies: dict[str, list[dict]] = {}
    errors: dict[str, list[str]] = {}

    def sink(key: str, tally: dict) -> None:
        tallies.setdefault(key, []).append(tally)

    def failed(key: str, r: int, exc: WorkerError) -> None:
        errors.setdefault(key, []).append(str(exc))
        log(f"[red]{key} round {r + 1} failed: {str(exc).splitlines()[0]}")

    plan = plans(cfg["quick"])
    if "echo" in cfg["sections"]:
        rows = [ECHO_BY_KEY[k] for k in ECHO_MODES]
        raw.update(run_rounds(rows, lambda t: _echo_pair(t, cfg["loop"], sink), plan["echo"], cfg["rounds"],
                              blocks, progress, "flush echo", failed))
    if "kv" in cfg["sections"]:
        rows = [KV_BY_KEY[k] for k in KV_MODES]
        raw.update(run_rounds(rows, lambda b: _kv_pair(b.key, cfg["loop"], sink), plan["kv"], cfg["rounds"],
                              blocks, progress, "flush kv", failed))
    return {"raw": raw, "tallies": tallies, "errors": errors}


def _figures(rounds: list[tuple[np.ndarray, int]]) -> dict:
    per = [summarize(a, w) for a, w in rounds]
    return {"rounds": per, "median": median_of(per), "pooled": summarize(pooled(a for a, _ in rounds))}


def verdict(unit: Unit, hardware: dict, flush: dict, ok: bool) -> dict:
    """One row of the table from both modes' figures (``rounds``: each round's summary;
    ``median``: their medians): the ratio of the p50 medians, each round's own, target, pass."""
    hw50, fl50 = hardware["median"].get("p50"), flush["median"].get("p50")
    ratio = fl50 / hw50 if hw50 and fl50 else float("nan")
    paired = len(hardware["rounds"]) == len(flush["rounds"])  # (else a round failed: no pairs)
    target = TARGETS[unit]
    return {"row": row_name(unit), "op": unit[0], "size": unit[1], "target": target, "ratio_p50": ratio,
            "round_ratios": [f["p50"] / h["p50"] for h, f in zip(hardware["rounds"], flush["rounds"])] if paired
            else [],
            "hardware": {m: hardware["median"].get(m) for m in ("p50", "p99")},
            "flush": {m: flush["median"].get(m) for m in ("p50", "p99")},
            "pass": bool(ok and ratio <= target)}


def rows_of(measured: dict, cfg: dict) -> list[dict]:
    """The table's rows: per row, both modes' figures, the verdict, and the replies verified
    against the calls made. A row passes only if both modes ran every round and verified
    every reply."""
    raw, tallies, errors = measured["raw"], measured["tallies"], measured["errors"]
    plan = plans(cfg["quick"])
    out = []
    for section, modes in (("echo", ECHO_MODES), ("kv", KV_MODES)):
        if section not in cfg["sections"]:
            continue
        for unit, _, _ in plan[section]:
            figs = {mode: _figures(raw[mode][unit]) for mode in modes}
            calls = {mode: sum(a.size for a, _ in raw[mode][unit]) for mode in modes}
            verified = {mode: sum(t.get(unit, 0) for t in tallies.get(mode, ())) for mode in modes}
            ok = all(len(raw[m][unit]) == cfg["rounds"] and verified[m] >= calls[m] > 0 and not errors.get(m)
                     for m in modes)
            row = verdict(unit, figs[modes[0]], figs[modes[1]], ok)
            row.update({"modes": dict(zip(("hardware", "flush"), modes)), "timed_calls": calls,
                        "verified": verified, "figures": figs})
            out.append(row)
    return out


def from_bench(data: dict) -> list[dict]:
    """The same rows from a main bench run (``python -m bench``): its echo section's
    ``cxl-aio-flush`` vs ``cxl-aio`` and its kv section's ``kv-shm-flush`` vs ``kv-shm``,
    where both ran. Their replies are not all verified (the first of each unit is)."""
    out = []
    echo = data.get("echo", {}).get("transports", {})
    kv = data.get("kv", {}).get("ops", {}).get("backends", {})
    for unit in TARGETS:
        op, size = unit
        if op == "echo":
            hw, fl = (echo.get(k, {}).get("sizes", {}).get(str(size), {}) for k in ECHO_MODES)
        else:
            hw, fl = (kv.get(k, {}).get("items", {}).get(f"{op}:{size}", {}) for k in KV_MODES)
        if hw.get("median") and fl.get("median"):
            out.append({**verdict(unit, hw, fl, True), "verified": None})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.flush", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few dozen calls per row (tests)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 2)")
    p.add_argument("--only", default="echo,kv", help="comma-separated sections among echo, kv")
    p.add_argument("--json", type=Path, default=RESULTS / "flush.json", help="raw results file")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop of every process")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.only.split(",") if s.strip()]
    if not a.sections or set(a.sections) - {"echo", "kv"}:
        p.error("--only takes echo, kv or both")
    if a.rounds is None:
        a.rounds = 2 if a.quick else 5
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, save the raw figures; exit 1 if a round failed (a reply
    that did not verify, a worker that died), whatever the verdicts."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    stop_on_signals()
    cfg = {"quick": args.quick, "rounds": args.rounds, "loop": args.loop, "sections": args.sections}
    data: dict[str, Any] = {"env": report.environment(args.loop), "config": cfg, "targets":
                            [{"op": op, "size": s, "limit": v} for (op, s), v in TARGETS.items()]}
    started = time.monotonic()
    try:
        with Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            measured = measure(cfg, progress, progress.console.print)
    except KeyboardInterrupt:
        console.print("[red]interrupted: stopping workers")
        return 130
    finally:
        cleanup(console.print)
    data["rows"] = rows_of(measured, cfg)
    data["errors"] = measured["errors"]
    data["seconds"] = time.monotonic() - started
    data["env"]["loadavg_end"] = os.getloadavg()
    report.save_json(args.json, data)
    console.print(report.flush_table(data["rows"], f"Flush mode vs hardware mode, {args.rounds} rounds "
                                                   f"alternated block by block, every reply verified"))
    for key, errs in measured["errors"].items():
        console.print(f"[red]{key}: {len(errs)} failed round(s): {errs[0].splitlines()[0]}")
    env = data["env"]
    console.print(f"load average {env['loadavg_start'][0]:.1f} at the start, {env['loadavg_end'][0]:.1f} at the end, "
                  f"{env['affinity']} CPUs: anything else running makes the figures noise")
    console.print(f"raw figures: {args.json}  ({data['seconds']:.0f} s)")
    return 1 if measured["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
