"""``python -m cxlrpc ls`` lists the project's shared regions; ``clean`` removes dead owners' ones."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .channel import KIND_RPC, STATE_RUNNING, CONTROL, read_geometry
from .memory import ACQUIRE
from .region import SHM_PREFIX, Region, RegionError, UninitializedRegion, unlink_shm, untouched_for

_KINDS = {1: "rpc", 2: "kv-pool"}


def _segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []


def _describe(region: Region) -> dict:
    info = region.info()
    row = {"url": region.url, "kind": _KINDS.get(info.kind, str(info.kind)), "size": info.size,
           "owner": f"{info.owner_pid}@{info.owner_host}", "age_s": round(time.time() - info.created, 1),
           "epoch": f"{info.epoch:016x}"}
    if info.kind == KIND_RPC:
        try:
            geo = read_geometry(region)
            mem = region.mem
            row["clients"] = sum(mem.load(geo.slot(i), ACQUIRE) & 1 for i in range(geo.slots))
            tail = mem.load(geo.request_ring, ACQUIRE)
            head = mem.load(geo.request_ring + 128, ACQUIRE)
            row["request_fill"] = f"{min(max(tail - head, 0), geo.request_capacity) / geo.request_capacity:.0%}"
            row["running"] = mem.load(CONTROL, ACQUIRE) == STATE_RUNNING
        except RegionError as exc:
            row["error"] = str(exc)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cxlrpc", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list regions with owner, size, age, epoch, clients, ring fill")
    clean = sub.add_parser("clean", help="remove regions whose owner is dead")
    clean.add_argument("--stale", type=float, default=1.0,
                       help="seconds a remote owner's heartbeat must stay still (default 1.0)")
    clean.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    for seg in _segments():
        url = "shm://" + seg[len(SHM_PREFIX):]
        try:
            region = Region.open(url)
        except (RegionError, OSError) as exc:
            if args.cmd == "ls":
                print(f"{url}\tunreadable: {exc}")
            elif isinstance(exc, UninitializedRegion) and untouched_for(url, 10.0):
                if not args.dry_run:
                    unlink_shm("/" + seg)
                print(f"removed {url} (unreadable for over 10 s: {exc})")
            continue
        try:
            if args.cmd == "ls":
                alive = region.owner_alive(0.3)
                row = _describe(region)
                row["owner_alive"] = alive
                print("\t".join(f"{k}={v}" for k, v in row.items()))
            elif not region.owner_alive(args.stale):
                if not args.dry_run:
                    region.unlink()
                print(f"removed {url} (owner {region.info().owner_pid}@{region.info().owner_host} is dead)")
        finally:
            region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
