"""A client process for tests/test_pool_faults.py: what connecting to a pool (once its head
start is mapped), a second connection, then putting and getting a few blocks, cost it in page
faults and mapped pool memory (printed as JSON).

    python tests/pool_probe.py URL
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

MiB = 1 << 20


def sample() -> dict[str, int]:
    """Minor faults so far, and the shared memory this process maps (RssShmem, bytes)."""
    with open("/proc/self/status") as f:
        shmem = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
    return {"minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt, "shmem": shmem << 10}


def mapped(kv: object) -> None:
    """Wait until the background thread mapped what the connection queued (its head start)."""
    deadline = time.monotonic() + 20
    while 1 in kv.pool._prefaulter._state:
        assert time.monotonic() < deadline, "the pool's prefault thread did not finish"
        time.sleep(0.005)


def main(url: str) -> None:
    from kvservice import SyncKVClient

    base = sample()
    kv = SyncKVClient.connect(url)
    try:
        mapped(kv)
        connected = sample()
        second = SyncKVClient.connect(url)  # a second mapping in the same process starts cold
        try:
            mapped(second)
            again = sample()
        finally:
            second.close()
        rng = np.random.default_rng(7)
        values = {f"k{i}": rng.integers(0, 256, MiB + 4096 * i, dtype=np.uint8).tobytes()
                  for i in range(3)}
        kv.put("k0", values["k0"])  # Pool.write
        pending = kv.begin_put("k1", len(values["k1"]))  # filled in place
        pending.array()[:] = np.frombuffer(values["k1"], dtype=np.uint8)
        pending.commit()
        kv.put("k2", values["k2"])
        same = {}
        for key, value in values.items():
            with kv.get(key) as block:
                same[key] = bytes(block.view()) == value
        used = sample()
    finally:
        kv.close()
    print(json.dumps({"connect": {k: connected[k] - base[k] for k in base},
                      "second_connect": {k: again[k] - connected[k] for k in base},
                      "after_puts": {k: used[k] - base[k] for k in base},
                      "written": sum(map(len, values.values())), "same": same,
                      "native": not os.environ.get("CXLRPC_NO_NATIVE")}))


if __name__ == "__main__":
    main(sys.argv[1])
