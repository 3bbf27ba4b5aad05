"""``python -m cxlrpc ls`` lists the project's shared regions; ``clean`` removes dead owners' ones;
``health URL`` and ``methods URL`` ask a server for its status and its methods; ``janitor URL``
writes back the lines of a flush-mode server's clients of this host that die."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

from .channel import CONTROL, KIND_RPC, SLOT_STRIDE, STATE_RUNNING, read_geometry
from .client import connect
from .errors import RpcError
from .janitor import INTERVAL, Janitor
from .memory import ACQUIRE
from .region import SHM_PREFIX, Region, RegionError, in_use, unlink_shm
from .simulator import is_side_file

_KINDS = {1: "rpc", 2: "kv-pool"}


def _segments() -> list[str]:
    """The project's segments (not a simulated region's side files: see _orphans)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX) and not is_side_file(n))
    except FileNotFoundError:
        return []


def _orphans() -> list[str]:
    """Side files of simulated regions (cxlrpc.simulator's LIMBO) whose region is gone."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(SHM_PREFIX) and is_side_file(n)
                  and n.split("~", 1)[0] not in names)


def _describe(region: Region) -> dict[str, object]:
    info = region.info()
    row: dict[str, object] = {
        "url": region.url, "kind": _KINDS.get(info.kind, str(info.kind)), "size": info.size,
        "owner": f"{info.owner_pid}@{info.owner_host}", "age_s": round(time.time() - info.created, 1),
        "epoch": f"{info.epoch:016x}", "identity": f"{info.owner_identity:016x}",
        "closed": info.closed, "coherence": info.coherence}
    if info.kind == KIND_RPC:
        try:
            geo = read_geometry(region)
            mem = region.mem
            row["clients"] = sum(mem.load(geo.slot(i), ACQUIRE) & 1 for i in range(geo.slots))
            rings = ([geo.client_request_ring(i) for i in range(geo.slots)]
                     if geo.per_client_requests else [geo.request_ring])
            mem.invalidate(geo.slot_table, geo.slots * SLOT_STRIDE)
            fill = 0
            for at in rings:
                mem.invalidate(at, 256)
                fill = max(fill, min(max(mem.load(at, ACQUIRE) - mem.load(at + 128, ACQUIRE), 0),
                                     geo.request_capacity))
            row["request_fill"] = f"{fill / geo.request_capacity:.0%}"  # the fullest ring's
            row["running"] = mem.load(CONTROL, ACQUIRE) == STATE_RUNNING
        except RegionError as exc:
            row["error"] = str(exc)
    return row


async def _ask(url: str, what: str, timeout: float) -> Any:
    """Connect to ``url`` and call the client helper ``what`` (health, methods), all within ``timeout`` s."""
    async def ask() -> Any:
        async with connect(url) as client:
            return await getattr(client, what)()
    return await asyncio.wait_for(ask(), timeout)


def _query(url: str, what: str, timeout: float) -> int:
    """Print the server's answer; the exit status is 0 only for an answer from a serving server."""
    try:
        answer = asyncio.run(_ask(url, what, timeout))
    except asyncio.TimeoutError:
        print(f"no answer from {url} within {timeout:g} s", file=sys.stderr)
        return 1
    except RpcError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    if what == "health":
        print(answer)
        return 0 if answer == "SERVING" else 1
    for name in answer:
        print(name)
    return 0


def _janitor(url: str, also: list[str], interval: float) -> int:
    """Run a Janitor until SIGTERM or SIGINT; print each holder it wrote back."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        jan = Janitor(url, also)
    except (RegionError, OSError) as exc:
        print(f"janitor: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"janitor: watching {url}'s clients of this host", flush=True)
        while True:
            for slot, gen in jan.look():
                print(f"wrote back slot {slot} (generation {gen}): its holder died", flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        jan.close()


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 seconds")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cxlrpc", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list regions with owner, size, age, epoch, clients, ring fill")
    clean = sub.add_parser("clean", help="remove regions whose owner is dead")
    clean.add_argument("--stale", type=float, default=1.0,
                       help="seconds a remote owner's (or an unfinished creator's) heartbeat "
                            "must stay still (default 1.0)")
    clean.add_argument("--dry-run", action="store_true")
    for cmd, text in (("health", "print a server's status (SERVING, NOT_SERVING while it shuts "
                                 "down); exit status 0 only when serving"),
                      ("methods", "print the names of a server's methods")):
        ask = sub.add_parser(cmd, help=text)
        ask.add_argument("url", help="the server's URL (shm://NAME, file:///PATH, sim://NAME)")
        ask.add_argument("--timeout", type=_positive, default=2.0,
                         help="seconds to wait for the answer, connecting included (default 2)")
    janitor = sub.add_parser("janitor", help="on a client host of a flush-mode server: write back "
                                             "the lines of this host's clients that die (run one per host)")
    janitor.add_argument("url", help="the server's URL")
    janitor.add_argument("--also", action="append", default=[], metavar="URL",
                         help="another region its clients write (a kvservice pool), written back whole")
    janitor.add_argument("--interval", type=_positive, default=INTERVAL,
                         help=f"seconds between looks at the slot table (default {INTERVAL})")
    args = parser.parse_args(argv)
    if args.cmd in ("health", "methods"):
        return _query(args.url, args.cmd, args.timeout)
    if args.cmd == "janitor":
        return _janitor(args.url, args.also, args.interval)

    if args.cmd == "clean":
        for orphan in _orphans():
            if not args.dry_run:
                unlink_shm("/" + orphan)
            print(f"removed /dev/shm/{orphan} (a simulated region's side file; the region is gone)")
    for seg in _segments():
        url = "shm://" + seg[len(SHM_PREFIX):]
        if args.cmd == "clean":
            try:
                reason = in_use(url, args.stale)
            except (RegionError, OSError) as exc:
                print(f"kept {url} ({exc})")
                continue
            if reason is None:
                if not args.dry_run:
                    unlink_shm("/" + seg)
                print(f"removed {url} (no live owner)")
            continue
        try:
            region = Region.open(url)
        except (RegionError, OSError) as exc:
            print(f"{url}\tunreadable: {exc}")
            continue
        try:
            row = _describe(region)
            row["owner_alive"] = region.owner_alive(0.3)
            print("\t".join(f"{k}={v}" for k, v in row.items()))
        finally:
            region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
