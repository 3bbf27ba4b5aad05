"""Peers that share only /dev/shm: server and client in different PID, network and UTS
namespaces (``unshare -pfnu --mount-proc``, as root), as containers of different pods or
hosts of one CXL pool see each other.  No PID, socket or host name is common to them."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cxlrpc
from cxlrpc.channel import read_geometry
from cxlrpc.memory import ACQUIRE
from cxlrpc.region import Region, parse_url, unlink_shm

from procs import cpu_seconds, report, timer_cpu_share, until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare(1) to make PID/network/UTS namespaces"),
]
PEER = str(Path(__file__).with_name("ns_peer.py"))


class Peer:
    """A ns_peer.py process (in fresh namespaces unless ``isolated=False``); JSON lines out."""

    def __init__(self, role: str, url: str, isolated: bool = True, hostname: str = "other-host") -> None:
        argv = [sys.executable, PEER, role, url]
        if isolated:
            argv = ["unshare", "-pfnu", "--mount-proc", "sh", "-c",
                    f'hostname {hostname} && exec "$0" "$@"', *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, phase: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"no {phase!r} from the peer in {timeout} s; "
                                     f"stderr: {self._stderr()}") from None
            if msg.get("phase") == phase:
                return msg

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()[-3000:]

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the whole namespace (unshare, its PID 1 and everything under it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def slot_claimed(url: str, slot: int) -> bool:
    with Region.open(url) as region:
        return bool(region.mem.load(read_geometry(region).slot(slot), ACQUIRE) & 1)


async def test_client_in_other_namespaces_is_served_fast_and_sees_server_death(url):
    """A client in other PID/net/UTS namespaces: not reaped, busy and after-idle round trips
    near the local ones (no 100 ms wake-up timeouts), a local client undisturbed meanwhile,
    idle CPU low on both sides, and a killed server seen as Unavailable within 2 s."""
    timers = await asyncio.to_thread(timer_cpu_share, 1000)  # a 1 kHz poll's price here
    deep_wake_s = await asyncio.to_thread(timer_cpu_share, 20) / 20  # one wake-up from idle
    server = Peer("server", url, isolated=False)
    remote = None
    try:
        ready = server.expect("ready", 30)
        remote = Peer("client", url)
        connected = remote.expect("connected", 30)
        assert connected["host"] == "other-host" and connected["pid"] != ready["pid"]
        local_lat: list[float] = []
        async with cxlrpc.connect(url) as local:
            async def local_calls() -> None:
                while True:
                    t = time.perf_counter()
                    assert await local.call("echo", b"local", timeout=5) == b"local"
                    local_lat.append(time.perf_counter() - t)
                    await asyncio.sleep(0.002)

            pump = asyncio.create_task(local_calls())
            try:
                assert await until(lambda: local_lat, 10), "the local client's calls did not start"
                remote.tell("busy")  # its busy phase runs while the local client calls
                busy = await asyncio.to_thread(remote.expect, "busy", 60)
            finally:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
        remote.tell("go")  # no local traffic now: nothing but polling wakes the server
        idle = await asyncio.to_thread(remote.expect, "after_idle", 60)
        after_idle_us = [us for _, us in idle["calls"]]
        cpu0 = cpu_seconds(server.proc.pid)
        t0 = time.monotonic()
        client_cpu = remote.expect("idle_cpu", 30)["share"]
        server_cpu = (cpu_seconds(server.proc.pid) - cpu0) / (time.monotonic() - t0)
        remote.expect("waiting_for_kill", 10)
        local_lat.sort()
        local_p50_ms = statistics.median(local_lat) * 1e3
        local_p90_ms = local_lat[int(len(local_lat) * 0.9)] * 1e3
        server.kill()
        remote.tell("killed")
        gone = remote.expect("server_gone", 10)
        report("client in other namespaces", busy_p50_us=round(busy["p50_us"], 1),
               busy_p99_us=round(busy["p99_us"], 1), after_idle_us=[round(x) for x in after_idle_us],
               local_client_p50_ms=round(local_p50_ms, 2), local_client_p90_ms=round(local_p90_ms, 2),
               idle_cpu_client=round(client_cpu, 4),
               idle_cpu_server=round(server_cpu, 4), server_death_detect_s=round(gone["detect_s"], 2),
               connect_s=round(connected["connect_s"], 3))
        # ~1 ms of polling at most after idle (the old wake-up path cost ~102 ms), with slack
        # for a noisy 2-core machine: 5 ms, plus four wake-ups from idle at this machine's
        # price (~0.25 ms each; ~1.4 ms in a bad hour, when calls after idle took 2-7 ms
        # with the code of the day before as well)
        assert statistics.median(after_idle_us) < busy["p50_us"] + 5_000 + 4e6 * deep_wake_s, (idle, deep_wake_s)
        assert max(after_idle_us) < 50_000, idle
        assert busy["p50_us"] < 2_000, busy
        # no wake-up timeouts (~100 ms each) for the local client: with the remote client and
        # the server both spinning on 2 cores, its p90 took 0.2-11 ms here (the same with the
        # code of the day before) and 21.6 ms on CI's slower machine: what the scheduler gives it
        assert local_p90_ms < 50, f"a local client suffered while a remote one was active: p90 {local_p90_ms:.1f} ms"
        # a 1 kHz timer alone costs ~1.9% of a core on this VM (each wake-up ~20 us of kernel
        # time), 7.7% in a bad hour; poll_interval= trades that against the after-idle
        # latency. The bounds, scaled by what a bare 1 kHz asyncio loop costs here, catch a
        # consumer that spins (tens of %), not the machine's speed.
        assert client_cpu < 0.02 + 2 * timers and server_cpu < 0.10 + 2 * timers, (client_cpu, server_cpu, timers)
        assert gone["detect_s"] <= 2.0, gone
        assert "UNAVAILABLE" in gone["error"]
    finally:
        for p in (remote, server):
            if p is not None:
                p.close()
        unlink_shm(parse_url(url)[1])  # the killed server could not


async def test_killed_client_in_other_namespaces_is_reclaimed_by_heartbeat(url):
    """The server cannot check a PID of another namespace: the slot comes back once the
    client's heartbeat stops (client_timeout 1 s), and not before the client dies."""
    server = Peer("server", url, isolated=False)
    remote = None
    try:
        server.expect("ready", 30)
        remote = Peer("client", url)
        remote.tell("busy")
        remote.expect("busy", 60)
        remote.tell("go")
        remote.expect("after_idle", 60)
        assert slot_claimed(url, 0)
        t_kill = time.monotonic()
        remote.kill()
        while slot_claimed(url, 0):
            assert time.monotonic() - t_kill < 5, "the dead client's slot was never reclaimed"
            await asyncio.sleep(0.01)
        reclaim = time.monotonic() - t_kill
        report("killed client in other namespaces", reclaim_s=round(reclaim, 2))
        assert 0.8 <= reclaim <= 2.5, reclaim
        async with cxlrpc.connect(url) as c:  # and the server is fine
            assert await c.call("echo", b"after", timeout=5) == b"after"
    finally:
        for p in (remote, server):
            if p is not None:
                p.close()


async def test_server_in_other_namespaces_owns_its_file_region(tmp_path):
    """A live server of another namespace keeps its file:// region (its PID means nothing
    here: the heartbeat decides); once it is killed a new server takes the region over."""
    url = f"file://{tmp_path}/region"
    server = Peer("server", url)
    try:
        server.expect("ready", 30)
        rival = cxlrpc.Server(url, client_timeout=1.0)
        with pytest.raises(FileExistsError, match="another host"):
            await rival.start()
        async with cxlrpc.connect(url) as c:
            assert await c.call("echo", b"owner lives", timeout=5) == b"owner lives"
        server.kill()
        t = time.monotonic()
        async with cxlrpc.Server(url, client_timeout=1.0) as successor:
            successor.add_method("echo", lambda p: p)
            took = time.monotonic() - t
            async with cxlrpc.connect(url) as c:
                assert await c.call("echo", b"successor", timeout=5) == b"successor"
        report("server in other namespaces", takeover_after_kill_s=round(took, 2))
        assert took < 5
    finally:
        server.close()
