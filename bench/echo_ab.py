"""Echo latencies of two checkouts, in alternated rounds (what a change costs the RPC hot path):
``python bench/echo_ab.py --a /path/before --b /path/after --rounds 6``.

Each round runs, once per checkout (order alternating), a process that starts an echo server
(a plain handler: the native dispatcher's shape) in a child process and times an asyncio
client's echo of 64 B, 1 MiB and 8 MiB bodies (the big ones followed through the heap both
ways). The table shows, per checkout, the median across rounds of each round's p50 and p99,
and B/A.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
SIZES = {"echo 64B": 64, "echo 1M": MiB, "echo 8M": 8 * MiB}
CALLS = {"echo 64B": 20, "echo 1M": 4, "echo 8M": 1}  # per unit of --n


def _pct(samples: list[int], q: float) -> float:
    return float(np.percentile(np.array(samples) / 1e3, q))


def _serve(url: str) -> None:
    import cxlrpc

    async def main() -> None:
        server = cxlrpc.Server(url, client_timeout=10.0)

        @server.method("echo")
        def echo(body: bytes) -> bytes:
            return body

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            print("ready", flush=True)
            await stop.wait()

    asyncio.run(main())


async def _measure(url: str, n: int) -> dict[str, list[int]]:
    import cxlrpc

    out: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    async with cxlrpc.connect(url, server_timeout=10.0) as client:  # (a loaded machine starves beats)
        for op, size in SIZES.items():
            body = os.urandom(size)
            calls = CALLS[op] * n
            samples = out[op] = []
            for i in range(calls + calls // 5):  # the first sixth is warm-up
                t = clock()
                got = await client.call("echo", body, timeout=30)
                if i >= calls // 5:
                    samples.append(clock() - t)
                if len(got) != size:
                    raise AssertionError(f"echo of {size} bytes came back with {len(got)}")
    return out


def _child(n: int) -> None:
    url = f"shm://echo-ab-{os.getpid()}"
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", url],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server did not start")
        print(json.dumps(asyncio.run(_measure(url, n))), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def _round(tree: str, n: int) -> dict[str, list[int]]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(n)], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"the round in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", help="checkout A (before)")
    parser.add_argument("--b", help="checkout B (after)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n", type=int, default=200, help="timed 8 MiB echoes per round (1 MiB: 4x, 64 B: 20x)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        _serve(args.serve)
        return
    if args.child is not None:
        _child(args.child)
        return
    trees = {"A": args.a, "B": args.b}
    per: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k in trees}
    for r in range(args.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            for op, samples in _round(trees[k], args.n).items():
                per[k].setdefault(op, []).append((_pct(samples, 50), _pct(samples, 99)))
            print(f"round {r + 1}/{args.rounds} {k} done", file=sys.stderr, flush=True)
    print(f"A = {trees['A']}\nB = {trees['B']}\n{args.rounds} rounds, medians of per-round figures (us)")
    print(f"{'op':<12} {'A p50':>9} {'B p50':>9} {'B/A':>6} | {'A p99':>9} {'B p99':>9} {'B/A':>6}")
    for op in SIZES:
        a50, a99 = (statistics.median(x) for x in zip(*per["A"][op]))
        b50, b99 = (statistics.median(x) for x in zip(*per["B"][op]))
        print(f"{op:<12} {a50:>9.1f} {b50:>9.1f} {b50 / a50:>6.2f} | {a99:>9.1f} {b99:>9.1f} {b99 / a99:>6.2f}")


if __name__ == "__main__":
    main()
