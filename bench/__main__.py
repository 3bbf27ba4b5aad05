"""``python -m bench``: cxlrpc against gRPC, side by side, printed as tables and saved as JSON + PNG."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

# numpy (the bench's statistics) starts OpenBLAS threads that spin in every process that loads
# it, the measured servers and clients included (spawned children import this module): one
# thread, no spinning. Measured on 2 cores: ~6% of the samples of each echo process were theirs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from . import report
from .procs import clean_shm, cleanup, stop_on_signals

SECTIONS = ("echo", "concurrency", "idle", "kv")
#: The flush rows' table in this run: the acceptance measurement is ``python -m bench.flush``.
FLUSH_TITLE = ("Flush vs hardware mode, the rows above vs issue 42's targets (indicative: first replies "
               "verified; every one: python -m bench.flush)")
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer calls and rounds (under 2 minutes)")
    p.add_argument("--huge", action="store_true", help="add the 16 MiB payload to the echo section")
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds per section (default 3, quick 2)")
    p.add_argument("--only", default=None, help=f"comma-separated sections among {', '.join(SECTIONS)}")
    p.add_argument("--transports", default=None, help="comma-separated echo transport keys (default: all)")
    p.add_argument("--json", type=Path, default=RESULTS / "latest.json", help="raw results file")
    p.add_argument("--plot", type=Path, default=RESULTS / "latency.png", help="latency plot (PNG)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop of every process")
    a = p.parse_args(argv)
    a.sections = SECTIONS if not a.only else tuple(s.strip() for s in a.only.split(",") if s.strip())
    bad = set(a.sections) - set(SECTIONS)
    if bad:
        p.error(f"unknown section(s) {sorted(bad)}; choose from {SECTIONS}")
    if a.rounds is None:
        a.rounds = 2 if a.quick else 3
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=132)
    stop_on_signals()
    cfg = {"quick": args.quick, "huge": args.huge, "rounds": args.rounds, "loop": args.loop,
           "transports": args.transports.split(",") if args.transports else None}
    data: dict[str, Any] = {"env": report.environment(args.loop), "config": {**cfg, "sections": list(args.sections)}}
    from .concurrency import run_concurrency
    from .echo import run_echo
    from .flush import from_bench
    from .idle import run_idle
    from .kv import run_kv

    runners: dict[str, tuple[Callable, Callable]] = {
        "echo": (run_echo, report.echo_table),
        "concurrency": (run_concurrency, report.concurrency_table),
        "idle": (run_idle, report.idle_table),
        "kv": (run_kv, report.kv_tables),
    }
    started = time.monotonic()
    columns = (SpinnerColumn(), TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    status = 0
    try:
        with Progress(*columns, console=console) as progress:
            log = progress.console.print
            for name in args.sections:
                run, table = runners[name]
                t0 = time.monotonic()
                data[name] = run(cfg, progress, log)
                data[name]["seconds"] = time.monotonic() - t0
                progress.console.print(table(data[name]))
                report.save_json(args.json, data)
            if rows := from_bench(data):  # the echo and kv sections' flush rows vs issue 42's targets
                data["flush_targets"] = rows
                progress.console.print(report.flush_table(rows, FLUSH_TITLE))
                report.save_json(args.json, data)
    except KeyboardInterrupt:
        console.print("[red]interrupted: stopping workers")
        data["interrupted"] = True
        status = 130
    finally:
        cleanup(console.print)
    data["env"]["loadavg_end"] = os.getloadavg()
    data["seconds"] = time.monotonic() - started
    data["shm_leftovers"] = clean_shm()
    report.save_json(args.json, data)
    if "echo" in data and data["echo"]["transports"]:
        report.plot(args.plot, data["echo"])
        console.print(f"plot: {args.plot}")
    console.print(f"raw figures: {args.json}  ({data['seconds']:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
