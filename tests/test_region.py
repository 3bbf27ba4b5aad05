"""Regions: header validation, URL parsing, permissions, and what opening garbage does."""
from __future__ import annotations

import os
import shutil
import subprocess

import posix_ipc
import pytest

import cxlrpc
from cxlrpc.memory import RELEASE
from cxlrpc.region import HEADER_SIZE, Region, RegionError, UninitializedRegion, parse_url, unlink_shm


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
