"""What connecting to a kvservice pool costs a process, by pool size and number of clients.

    python -m bench.pool_connect                          # 256 MiB and 4 GiB pools, 1 and 4 clients
    python -m bench.pool_connect --pools 256MiB --clients 1,4,8 --tree /path/to/other/checkout

For each pool size one server (``python -m kvservice serve``) is started; for each client count a
fresh process imports kvservice, connects that many SyncKVClients, and reports its minor faults
(getrusage), VmRSS and RssShmem (/proc/self/status) and wall time: at connect, once the pool's
background population (if any) has ended, and after one 1 MiB put and get per client. ``--tree``
runs server and clients from another checkout (PYTHONPATH), to compare before and after.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

from kvservice.__main__ import parse_size

_DEADLINE_S = 120.0


def _status() -> dict[str, int]:
    """VmRSS and RssShmem of this process, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssShmem"):
                out[name] = int(value.split()[0])
    return out


def _sample(start_ns: int) -> dict[str, float]:
    status = _status()
    return {"minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "rss_mib": status["VmRSS"] / 1024, "shmem_mib": status["RssShmem"] / 1024,
            "ms": (time.perf_counter_ns() - start_ns) / 1e6}


def _populating(kv: object) -> bool:
    """True while ``kv``'s pool still has windows queued for its background thread (a tree
    before the windows: while its whole-pool populate thread runs)."""
    prefaulter = getattr(kv.pool, "_prefaulter", None)
    if prefaulter is not None:
        return 1 in prefaulter._state
    return any(t.name.startswith("kvservice-pool") for t in threading.enumerate())


def measure(url: str, clients: int) -> dict[str, dict[str, float]]:
    """In this process: connect ``clients`` clients to ``url``; costs at each stage, as deltas
    from before the first connect."""
    from kvservice import SyncKVClient

    base = _sample(time.perf_counter_ns())
    start = time.perf_counter_ns()
    kvs = [SyncKVClient.connect(url) for _ in range(clients)]
    try:
        stages = {"connect": _sample(start)}
        deadline = time.monotonic() + _DEADLINE_S
        while any(_populating(kv) for kv in kvs):
            if time.monotonic() > deadline:
                raise TimeoutError("the pool's background population did not end")
            time.sleep(0.005)
        stages["settled"] = _sample(start)
        value = os.urandom(1 << 20)
        keys = [f"k{i}-{uuid.uuid4().hex}" for i in range(clients)]
        for kv, key in zip(kvs, keys):
            kv.put(key, value)
        for kv, key in zip(kvs, keys):
            if kv.get_bytes(key) != value:
                raise RuntimeError(f"{key} read back wrong bytes")
        stages["put+get"] = _sample(start)
    finally:
        for kv in kvs:
            kv.close()
    return {stage: {k: v - base[k] if k != "ms" else v for k, v in s.items()}
            for stage, s in stages.items()}


def _child(url: str, clients: int) -> None:
    import kvservice

    print(json.dumps({"tree": os.path.dirname(os.path.dirname(kvservice.__file__)),
                      **measure(url, clients)}), flush=True)


def _env(tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    return env


def _wait_serving(server: subprocess.Popen, timeout: float = _DEADLINE_S) -> None:
    """Wait for ``kvservice serve``'s first line (it serves); RuntimeError after ``timeout``."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(server.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or "serving" not in lines[0]:
        raise RuntimeError(f"kvservice serve did not start (exit {server.poll()})")


@contextlib.contextmanager
def serving(prefix: str, pool_size: int | str, tree: str | None = None,
            coherence: str = "hardware") -> Iterator[str]:
    """A ``python -m kvservice serve`` process (from ``tree`` if given) with a pool of
    ``pool_size`` (``coherence``: its --coherence), serving while the block runs: its URL.
    Ended and its segments removed after."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    server = subprocess.Popen([sys.executable, "-m", "kvservice", "serve", "--name", name,
                               "--pool-size", str(pool_size), "--coherence", coherence], env=_env(tree),
                              cwd=tree, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_serving(server)
        yield f"shm://{name}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        for path in (f"/dev/shm/{name}", f"/dev/shm/{name}.pool"):
            if os.path.exists(path):
                os.unlink(path)


def run(pool_size: int, client_counts: list[int], tree: str | None) -> list[dict]:
    """Start a server with a pool of ``pool_size``; measure each client count in a new process."""
    rows = []
    with serving("bench-pool", pool_size, tree) as url:
        for clients in client_counts:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", url,
                                  "--clients", str(clients)], env=_env(tree), cwd=tree, check=True,
                                 capture_output=True, text=True, timeout=_DEADLINE_S)
            rows.append({"pool": pool_size, "clients": clients, **json.loads(out.stdout)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pools", default="256MiB,4GiB")
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--tree", default=None, help="checkout to run server and clients from")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the rows there too")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    if args.child:
        _child(args.child, counts[0])
        return
    rows = [row for pool in args.pools.split(",") for row in run(parse_size(pool), counts, args.tree)]
    print(f"tree: {rows[0]['tree']}")
    print(f"{'pool':>8} {'clients':>7} | {'stage':<8} | {'minflt':>9} {'VmRSS MiB':>10} "
          f"{'RssShmem MiB':>12} {'ms':>9}")
    for row in rows:
        for stage in ("connect", "settled", "put+get"):
            s = row[stage]
            print(f"{row['pool'] >> 20:>7}M {row['clients']:>7} | {stage:<8} | {s['minflt']:>9.0f} "
                  f"{s['rss_mib']:>10.1f} {s['shmem_mib']:>12.1f} {s['ms']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
