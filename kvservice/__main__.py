"""``python -m kvservice serve --name kv --pool-size 8GiB [--quota NS=SIZE ...]`` runs a server;
``stats --name kv`` prints its stats."""
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


def parse_quota(text: str) -> tuple[str, int]:
    """``NS=SIZE`` (``llama=2GiB``; ``=1GiB`` for the default namespace) -> (ns, bytes)."""
    ns, sep, size = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"bad quota {text!r}: use NAMESPACE=SIZE, e.g. llama=2GiB")
    return ns, parse_size(size)


def _url(args: argparse.Namespace) -> str:
    return args.url or f"shm://{args.name}"


async def _serve(args: argparse.Namespace) -> None:
    server = KVServer(_url(args), args.pool_size, pool_url=args.pool_url, slots=args.slots,
                      alignment=args.alignment, default_lease_s=args.lease,
                      max_lease_s=args.max_lease, coherence=args.coherence,
                      client_timeout=args.client_timeout, fence_timeout=args.fence_timeout)
    for ns, quota in args.quota:
        server.set_quota(ns, quota)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    async with server:
        print(f"kvservice: serving {_url(args)}, pool {server.pool_url} of {server.pool_size} bytes"
              + "".join(f", quota {ns or '(default)'}={q}" for ns, q in args.quota)
              + f", client timeout {server.rpc.client_timeout} s, fence timeout "
                f"{args.fence_timeout} s", flush=True)
        await server.serve_forever()


async def _stats(args: argparse.Namespace) -> None:
    async with KVClient.connect(_url(args)) as kv:
        print(json.dumps(await kv.stats(args.namespace), indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvservice", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a KV server until SIGINT/SIGTERM")
    stats = sub.add_parser("stats", help="print a running server's stats as JSON")
    sub.add_parser("mooncake-shim-path",
                   help="print the directory to put on PYTHONPATH for `from mooncake.store import ...`")
    for cmd in (serve, stats):
        where = cmd.add_mutually_exclusive_group(required=True)
        where.add_argument("--name", help="service region name (shm://NAME)")
        where.add_argument("--url", help="service region URL (shm://NAME, file:///PATH or sim://NAME)")
    serve.add_argument("--pool-size", type=parse_size, default=parse_size("1GiB"))
    serve.add_argument("--pool-url", default=None,
                       help="pool region URL (default: the service URL + '.pool'; a device needs its own)")
    serve.add_argument("--quota", type=parse_quota, action="append", default=[], metavar="NS=SIZE",
                       help="guaranteed share and ceiling of a namespace (repeatable)")
    serve.add_argument("--slots", type=int, default=64, help="client slots (default 64)")
    serve.add_argument("--alignment", type=parse_size, default=4096,
                       help="block unit in bytes (default 4096; lower it for small values)")
    serve.add_argument("--coherence", choices=("hardware", "flush"), default="hardware",
                       help="'flush' for memory hosts share without cache coherence (default "
                            "'hardware': one host, or coherent CXL)")
    serve.add_argument("--lease", type=float, default=10.0, help="default lease seconds (10)")
    serve.add_argument("--max-lease", type=float, default=60.0, help="longest lease a client may ask (60)")
    serve.add_argument("--client-timeout", type=float, default=1.0,
                       help="seconds without a heartbeat before a client is judged gone (1)")
    serve.add_argument("--fence-timeout", type=float, default=10.0,
                       help="seconds after that before the pending puts of a client on another "
                            "host are freed (10; on this host: when its process exits)")
    stats.add_argument("--namespace", default=None, help="only this namespace's usage")
    args = p.parse_args(argv)
    if args.command == "mooncake-shim-path":
        from kvservice.compat import mooncake_shim_path
        print(mooncake_shim_path())
        return
    cxlrpc.run(_serve(args) if args.command == "serve" else _stats(args))


if __name__ == "__main__":
    main()
