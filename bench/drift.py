"""``python -m bench.drift [seconds]``: how fast this machine moves data between cores, over time.

One process pair lives for the whole run; every ~0.5 s it prints the p50 of a local 1 MiB copy,
of a 64 B ping-pong between the two processes, and of a 1 MiB followed copy from one to the
other (cxlrpc's publish_copy / follow_copy), with the CPU each process was on. On a VM whose
host moves the vCPUs, the cross-process figures change level for seconds at a time while the
local copy does not: why the echo section's transports take turns in short blocks.
"""
from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np

from cxlrpc.memory import ACQUIRE, RELEASE, AtomicMemory, follow_copy, publish_copy

MIB = 1 << 20
CMD, ACK, PROGRESS, BODY = 0, 8, 64, 4096  # the shared page's words, then the 1 MiB body
STOP = 1 << 62


def _peer(mem: AtomicMemory, buf: memoryview) -> None:
    """Answer each command: odd, a ping (ack at once); even, follow a 1 MiB copy, then ack."""
    last = 0
    while True:
        cmd = mem.load(CMD, ACQUIRE)
        if cmd == last:
            continue
        last = cmd
        if cmd == STOP:
            return
        if not cmd & 1:
            follow_copy(mem, buf, PROGRESS, BODY, MIB, 5.0, 10.0)
        mem.store(ACK, cmd, RELEASE)


def _cpu(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[36]  # field 39: the CPU it last ran on


def main(seconds: float) -> None:
    shared = mmap.mmap(-1, BODY + MIB)
    buf = memoryview(shared)
    mem = AtomicMemory(shared)
    pid = os.fork()
    if pid == 0:
        try:
            _peer(mem, buf)
        finally:
            os._exit(0)
    seq, src, dst = 0, np.random.default_rng(0).bytes(MIB), memoryview(bytearray(MIB))
    clock = time.perf_counter_ns

    def timed(n: int, step) -> float:
        xs = []
        for _ in range(n):
            t0 = clock()
            step()
            xs.append(clock() - t0)
        return float(np.median(xs)) / 1e3

    def roundtrip(follow: bool) -> None:
        nonlocal seq
        seq += 1 if (seq + 1) % 2 == (0 if follow else 1) else 2
        if follow:
            mem.store(PROGRESS, 0, RELEASE)
        mem.store(CMD, seq, RELEASE)
        if follow:
            publish_copy(mem, buf, PROGRESS, BODY, src)
        while mem.load(ACK, ACQUIRE) != seq:
            pass

    print("     s  local copy 1 MiB µs  ping 64 B µs  followed 1 MiB µs  CPUs (peer, this)")
    start = time.monotonic()
    try:
        while (now := time.monotonic() - start) < seconds:
            local = timed(30, lambda: dst.__setitem__(slice(None), src))
            ping = timed(2000, lambda: roundtrip(False))
            followed = timed(30, lambda: roundtrip(True))
            print(f"{now:6.1f}  {local:19.1f}  {ping:12.2f}  {followed:17.1f}  {_cpu(pid)}, {_cpu(os.getpid())}",
                  flush=True)
            time.sleep(0.4)
    finally:
        mem.store(CMD, STOP, RELEASE)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
