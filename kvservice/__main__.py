"""``python -m kvservice serve --name kv --pool-size 8GiB`` runs a server; ``stats --name kv`` prints its stats."""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal

import cxlrpc
from kvservice.client import KVClient
from kvservice.server import KVServer

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8GiB``, ``512M``, ``4096`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 8GiB, 512MiB, 4096")
    return int(m.group(1)) * _UNITS[m.group(2)]


async def _serve(args: argparse.Namespace) -> None:
    server = KVServer(f"shm://{args.name}", args.pool_size)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    async with server:
        print(f"kvservice: serving shm://{args.name}, pool {server.pool_url} of {server.pool_size} bytes",
              flush=True)
        await server.serve_forever()


async def _stats(args: argparse.Namespace) -> None:
    async with KVClient.connect(f"shm://{args.name}") as kv:
        print(json.dumps(await kv.stats(), indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvservice", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a KV server until SIGINT/SIGTERM")
    serve.add_argument("--name", required=True, help="service region name (shm://NAME)")
    serve.add_argument("--pool-size", type=parse_size, default=parse_size("1GiB"))
    stats = sub.add_parser("stats", help="print a running server's stats as JSON")
    stats.add_argument("--name", required=True)
    args = p.parse_args(argv)
    cxlrpc.run(_serve(args) if args.command == "serve" else _stats(args))


if __name__ == "__main__":
    main()
