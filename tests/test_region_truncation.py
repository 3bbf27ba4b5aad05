"""A region's file truncated under its mappings (issue 40, item 12): the server notices it
(one fstat in its heartbeat thread and before its loop's housekeeping), grows the file back
and stops with a clear RegionError instead of dying of SIGBUS later; a client notices it in
its monitor thread and fails its calls with Unavailable instead of touching the memory.

Each process is a child (tests/cut_probe.py); the servers and clients are ended by the tests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cxlrpc.region import parse_url

pytestmark = pytest.mark.timeout(120)
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cut_probe.py")


def start(role: str, url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PROBE, role, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line(proc: subprocess.Popen) -> dict:
    """The next JSON line a probe prints (a dead probe: its stderr in the failure)."""
    out = proc.stdout.readline()
    assert out, f"the {proc.args[2]} probe printed nothing: status {proc.poll()}\n{proc.stderr.read()[-3000:]}"
    return json.loads(out)


def end(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """Wait up to ``timeout`` for the probe to exit by itself: (status, what it printed last);
    status None when it had to be killed."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        status = None
    return status, out.strip().splitlines()[-1] if out.strip() else ""


def shm_file(url: str) -> str:
    return "/dev/shm" + parse_url(url)[1]


def test_a_truncated_region_stops_the_server_cleanly_and_fails_calls(url):
    """The server frozen (SIGSTOP), the region's file cut to where its heap begins: the client
    is told (Unavailable, saying so) and its 1 MiB call, which would write the cut heap, fails
    instead of dying of SIGBUS; the server, resumed, grows the file back and stops with a
    RegionError saying the file was truncated (on main it served on, blind to it)."""
    server = start("server", url)
    client = None
    try:
        assert line(server) == {"ready": True}
        client = start("client", url)
        geometry = line(client)
        os.kill(server.pid, signal.SIGSTOP)
        os.truncate(shm_file(url), geometry["heap"])
        client.stdin.write("go\n")
        client.stdin.flush()
        status, last = end(client, 30)
        assert status == 0, (status, last, client.stderr.read()[-3000:])
        got = json.loads(last)
        assert "was truncated to" in got["gone"], got
        assert got["call"].startswith("Unavailable: ") and "was truncated to" in got["call"], got
        os.kill(server.pid, signal.SIGCONT)
        status, last = end(server, 30)
        assert status == 3, (status, last)  # exited by itself, with the error (not -SIGBUS)
        raised = json.loads(last)["raised"]
        assert raised.startswith(f"RegionError: region {url}'s file was truncated to "
                                 f"{geometry['heap']} bytes"), raised
        assert "its size was restored" in raised
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.communicate()
        for path in (shm_file(url),):
            if os.path.exists(path):
                os.unlink(path)


def test_a_truncated_pool_stops_the_kv_server_cleanly(url):
    """kvservice's pool file cut to nothing: the KV server (which watches its pool's file as its
    own) grows it back and stops with the RegionError, instead of serving a pool whose values
    are gone."""
    server = start("kv", url)
    try:
        ready = line(server)
        assert ready["ready"] is True
        os.truncate("/dev/shm" + ready["pool"], 0)
        status, last = end(server, 30)
        assert status == 3, (status, last)
        raised = json.loads(last)["raised"]
        assert raised.startswith(f"RegionError: region {url}.pool's file was truncated to 0 "
                                 f"bytes"), raised
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
        for path in (shm_file(url), shm_file(url + ".pool")):
            if os.path.exists(path):
                os.unlink(path)
