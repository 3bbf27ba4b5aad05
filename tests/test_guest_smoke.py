"""QEMU guests share memory with the host and with each other through ivshmem-plain devices."""
from __future__ import annotations

import itertools
import mmap
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from cxlrpc._atomic import AtomicView
from guest_vm import PROJECT, Guest, GuestImage

pytestmark = [pytest.mark.guests, pytest.mark.timeout(300)]

SHM_SIZE = 64 << 20
BOOT_TIMEOUT = 120.0
_names = itertools.count()


@pytest.fixture
def shm_file() -> Iterator[Callable[[], Path]]:
    """Make zero-filled SHM_SIZE backing files in /dev/shm; all are removed afterwards."""
    made: list[Path] = []

    def make() -> Path:
        path = Path(f"/dev/shm/cxlrpc-guest-test-{os.getpid()}-{next(_names)}")
        with open(path, "xb") as f:
            f.truncate(SHM_SIZE)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def _map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


GUEST_PATTERN = f"""
import mmap, os
fd = os.open(os.environ["CXL_DEV0"], os.O_RDWR)
size = os.fstat(fd).st_size
assert size == {SHM_SIZE}, size
m = mmap.mmap(fd, size)
print(m[4096:4112].hex())
m[1 << 20:(1 << 20) + 16] = bytes(range(0xA0, 0xB0))
"""


def test_guest_and_host_see_each_others_bytes(image: GuestImage, shm_file: Callable[[], Path]) -> None:
    shm = shm_file()
    host = _map(shm)
    try:
        host[4096:4112] = bytes(range(0x10, 0x20))
        with Guest(image, "smoke", [shm]) as guest:
            (guest.out / "check.py").write_text(GUEST_PATTERN)
            guest.start('python "$OUT/check.py"')
            rc, out, err = guest.wait(BOOT_TIMEOUT)
            assert (rc, err) == (0, ""), out
            assert out.strip() == bytes(range(0x10, 0x20)).hex()
        assert host[1 << 20 : (1 << 20) + 16] == bytes(range(0xA0, 0xB0))
    finally:
        host.close()


# Shared cells: the counter, the host's "go" flag, guests finished, guests ready.
COUNTER, GO, DONE, READY = 0, 8, 16, 24
N_ADDS = 100_000
GUEST_ADDS = f"""
import mmap, os, time
from cxlrpc._atomic import AtomicView
fd = os.open(os.environ["CXL_DEV0"], os.O_RDWR)
with AtomicView(mmap.mmap(fd, os.fstat(fd).st_size)) as v:
    v.fetch_add_u64({READY}, 1)
    while v.load_u64({GO}) == 0:
        time.sleep(0.001)
    for _ in range({N_ADDS}):
        v.fetch_add_u64({COUNTER}, 1)
    v.fetch_add_u64({DONE}, 1)
"""


def _until(
    view: AtomicView, offset: int, value: int, guests: list[Guest], adding: bool
) -> int:
    """Wait for the cell at ``offset`` to reach ``value``, meanwhile fetch_adding the counter
    (``adding``) or polling every 10 ms; return the adds done. Fails if a guest fails."""
    deadline = time.monotonic() + BOOT_TIMEOUT
    adds = 0
    while view.load_u64(offset) < value:
        if adding:
            view.fetch_add_u64(COUNTER, 1)
            adds += 1
            if adds % 4096:
                continue
        else:
            time.sleep(0.01)
        for g in guests:
            if g.proc is not None and g.proc.poll() is not None:
                rc, _, err = g.wait(0)  # a guest may finish early, but not fail
                assert rc == 0, err
        assert time.monotonic() < deadline, f"cell {offset} stuck at {view.load_u64(offset)}"
    return adds


def test_fetch_add_is_atomic_across_two_guests_and_host(
    image: GuestImage, shm_file: Callable[[], Path]
) -> None:
    """Two guests and the host all fetch_add one 8-byte cell at once; no add is lost."""
    shm = shm_file()
    host = _map(shm)
    try:
        with AtomicView(host) as view, Guest(image, "adder0", [shm]) as g0, Guest(
            image, "adder1", [shm]
        ) as g1:
            guests = [g0, g1]
            for g in guests:
                (g.out / "adds.py").write_text(GUEST_ADDS)
                g.start('python "$OUT/adds.py"', {"PYTHONPATH": str(PROJECT)})  # this checkout's
            _until(view, READY, 2, guests, adding=False)
            view.store_u64(GO, 1)
            host_adds = _until(view, DONE, 2, guests, adding=True)
            for g in guests:
                assert g.wait(BOOT_TIMEOUT) == (0, "", "")
            assert view.load_u64(COUNTER) == 2 * N_ADDS + host_adds
    finally:
        host.close()
