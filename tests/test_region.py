"""Regions: header validation, URL parsing, permissions, and what opening garbage does."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import posix_ipc
import pytest

import cxlrpc
from cxlrpc.memory import RELEASE
from cxlrpc import region as region_mod
from cxlrpc.region import (HEADER_SIZE, PidWatch, Region, RegionError, UninitializedRegion, parse_url,
                           unlink_shm)


def test_create_open_round_trip_and_owner_only(url, name):
    region = Region.create(url, 1 << 16, kind=7)
    try:
        region.publish()
        assert os.stat(f"/dev/shm/cxlrpc.{name}").st_mode & 0o777 == 0o600
        other = Region.open(url, kind=7)
        assert (other.epoch, other.size, other.kind) == (region.epoch, region.size, 7)
        assert other.info().owner_pid == os.getpid()
        other.close()
        with pytest.raises(RegionError, match="different kind"):
            Region.open(url, kind=8)
        with pytest.raises(FileExistsError):
            Region.create(url, 1 << 16, kind=7)
    finally:
        region.unlink()
        region.close()


def test_unpublished_region_is_refused(url):
    region = Region.create(url, 1 << 16, kind=1)
    try:
        with pytest.raises(UninitializedRegion, match="bad magic"):
            Region.open(url)
    finally:
        region.unlink()
        region.close()


def test_other_layout_version_is_refused(url):
    region = Region.create(url, 1 << 16, kind=1)
    try:
        region.mem.store(8, 99, RELEASE)  # layout version field
        region.publish()
        with pytest.raises(RegionError, match="layout version 99"):
            Region.open(url)
        with pytest.raises(cxlrpc.Unavailable, match="layout version"):
            cxlrpc.connect_sync(url)
    finally:
        region.unlink()
        region.close()


def test_size_mismatch_and_too_small_are_refused(url, name, tmp_path):
    region = Region.create(url, 1 << 16, kind=1)
    try:
        region.mem.store(16, 1 << 40, RELEASE)  # header claims a terabyte
        region.publish()
        with pytest.raises(RegionError, match="header says"):
            Region.open(url)
    finally:
        region.unlink()
        region.close()
    small = tmp_path / "small"
    small.write_bytes(b"\0" * 100)
    with pytest.raises(RegionError, match="smaller than a header"):
        Region.open(f"file://{small}")
    shm = posix_ipc.SharedMemory(f"/cxlrpc.{name}", posix_ipc.O_CREX, mode=0o600, size=100)
    shm.close_fd()
    try:
        with pytest.raises(RegionError, match="smaller than a header"):
            Region.open(url)
    finally:
        unlink_shm(f"/cxlrpc.{name}")


def test_missing_regions(url, tmp_path):
    with pytest.raises(FileNotFoundError):
        Region.open(url)
    with pytest.raises(FileNotFoundError):
        Region.open(f"file://{tmp_path}/none")


@pytest.mark.parametrize("bad", ["shm://", "shm://a/b", "shm://" + "x" * 300, "tcp://h:1", "file://rel/path", "/dev/shm/x"])
def test_bad_urls(bad):
    with pytest.raises(RegionError):
        parse_url(bad)


def test_garbage_geometry_is_a_clear_error(url):
    """A region whose control block is garbage is refused by clients, not mapped blindly."""
    region = Region.create(url, 1 << 20, kind=1)
    try:
        region.buf[HEADER_SIZE:HEADER_SIZE + 64] = os.urandom(64)
        region.publish()
        with pytest.raises(cxlrpc.Unavailable, match="geometry|not running"):
            cxlrpc.connect_sync(url)
    finally:
        region.unlink()
        region.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("python3") is None, reason="needs root to run a child as nobody")
def test_another_user_cannot_open_a_region(url, name):
    region = Region.create(url, 1 << 16, kind=1)
    try:
        region.publish()
        probe = f"import os\ntry:\n os.open('/dev/shm/cxlrpc.{name}', os.O_RDWR)\n print('opened')\nexcept PermissionError:\n print('denied')"
        out = subprocess.run(["/usr/bin/python3", "-c", probe], user="nobody", capture_output=True,
                             text=True, timeout=30, cwd="/")
        assert out.stdout.strip() == "denied", out
    finally:
        region.unlink()
        region.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("budget", [region_mod.PIDFD_BUDGET, 0], ids=["pidfd", "proc-fallback"])
def test_pid_watch_sees_a_child_live_then_dead(monkeypatch, budget):
    """A live child reads alive; killed (a zombie, not yet reaped) it reads dead, and stays dead
    once reaped, with a pidfd and with the /proc fallback; close() gives the descriptor back."""
    monkeypatch.setattr(region_mod, "PIDFD_BUDGET", budget)
    fds = _open_fds()
    child = subprocess.Popen(["sleep", "30"])
    watch = PidWatch()
    try:
        assert watch.alive(child.pid) and not watch.dead(child.pid)
        assert _open_fds() == fds + (1 if budget else 0)  # the pipe-less child holds none
        child.kill()
        deadline = time.monotonic() + 5
        while watch.alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.005)  # exit is asynchronous to kill(): poll the condition
        assert watch.dead(child.pid), "a killed, unreaped child (a zombie) still reads alive"
        child.wait(5)
        assert watch.dead(child.pid)
    finally:
        child.kill()
        child.wait(5)
        watch.close()
    assert _open_fds() == fds


def test_pid_watch_follows_a_new_pid_and_ignores_garbage_hints():
    """Another PID replaces the watched one (its pidfd closed); 0 (not written) and values no
    pid_t can hold are no proof of death; a PID that never existed reads dead."""
    a = subprocess.Popen(["sleep", "30"])
    b = subprocess.Popen(["sleep", "30"])
    watch = PidWatch()
    fds = _open_fds()
    try:
        assert watch.alive(a.pid)
        a.kill()
        a.wait(5)
        assert watch.alive(b.pid) and _open_fds() == fds + 1
        for hint in (0, -5, 1 << 31, 1 << 40):
            assert not watch.dead(hint) and not watch.alive(hint)
        pid_max = int(open("/proc/sys/kernel/pid_max").read())
        assert watch.dead(pid_max)  # above every PID the kernel hands out
    finally:
        for p in (a, b):
            p.kill()
            p.wait(5)
        watch.close()


def test_pidfd_budget_is_shared_and_returned(monkeypatch):
    """Past PIDFD_BUDGET watches fall back to /proc (still correct) instead of taking more
    descriptors; closing a watch returns its share of the budget."""
    monkeypatch.setattr(region_mod, "PIDFD_BUDGET", region_mod._pidfds_open + 1)
    first, second = PidWatch(), PidWatch()
    fds = _open_fds()
    try:
        assert first.alive(os.getpid()) and second.alive(os.getppid())
        assert _open_fds() == fds + 1  # only the first got a pidfd
        first.close()
        second.close()
        assert second.alive(os.getppid()) and _open_fds() == fds + 1  # the budget came back
    finally:
        first.close()
        second.close()
    assert _open_fds() == fds
