"""kvservice's leased Block, native (kvservice._block) and reference (Python), made by a pool's
``leased`` on coherent memory and on memory without coherence (sim://, the native one in its
flush mode): reads in place, lapsed leases, release, collection, hostile leases."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import kvservice.pool as kvpool
from cxlrpc.region import RegionError
from kvservice import LeaseExpired
from kvservice.pool import Pool

pytestmark = pytest.mark.timeout(60)
MEMORIES = ("shm", "sim")
UNIT = 4096
BLOCK = kvpool.Block  # what a pool's native leased makes (made with it, whatever the test runs)


class Owner:
    """Records each ``_release(lease_id, collected)`` a block makes."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.fail = fail

    def _release(self, lease_id: int, collected: bool = False) -> None:
        self.calls.append((lease_id, collected))
        if self.fail is not None:
            raise self.fail


@pytest.fixture(params=["native", "reference"])
def kind(request, monkeypatch) -> str:
    """Blocks of kvservice._block (skipped where it did not build) or of the Python reference."""
    if request.param == "native":
        if kvpool._native is None:
            pytest.skip("kvservice._block is not built")
    else:
        monkeypatch.setattr(kvpool, "Block", kvpool.ReferenceBlock)
    return request.param


@pytest.fixture
def pool(url: str, kind: str, monkeypatch):
    """A 16-unit pool whose first block (two units) holds version 5 of bytes 0..255 repeated."""
    with monkeypatch.context() as patch:
        patch.setattr(kvpool, "Block", BLOCK)
        pool = Pool.create(url + ".pool", 16 * UNIT, UNIT)
    if kind == "reference":
        pool.leased = pool._leased
    pool.data[:2 * UNIT] = bytes(range(256)) * (2 * UNIT // 256)
    pool.written(0, 2 * UNIT)
    pool.publish(0, 5)
    try:
        yield pool
    finally:
        pool.retire()
        pool.close()


def test_the_kind_under_test_is_the_one_leased_made(pool, kind, scheme):
    """Native blocks and the native leased on every memory (without coherence: its flush mode,
    whose blocks copy out in C)."""
    block = pool.leased(0, 2 * UNIT, 5, None, 1)
    assert isinstance(block, kvpool.Block) and isinstance(block, kvpool.ReferenceBlock) == (kind == "reference")
    assert (pool.leased == pool._leased) == (kind == "reference")
    assert isinstance(block, kvpool.FlushBlock) == (kind == "native" and scheme == "sim")
    block.release()


def test_a_block_reads_its_value_in_place_read_only(pool):
    owner = Owner()
    with pool.leased(0, 2 * UNIT, 5, owner, 11) as block:
        view = block.view()
        assert view.readonly and len(block) == block.size == 2 * UNIT and block.version == 5
        assert view[:4].tobytes() == b"\x00\x01\x02\x03"
        pool.data[7] = 99  # in place: a write to the pool shows through the view
        assert block.view()[7] == 99 and block.tobytes()[7] == 99
        assert block.array(np.uint16, (UNIT,))[0] == 0x0100
        out = bytearray(2 * UNIT + 1)
        assert block.copy_into(out) == 2 * UNIT and out[7] == 99
        with pytest.raises(ValueError, match="too small"):
            block.copy_into(bytearray(10))
        assert not block.released and owner.calls == []
    assert block.released and owner.calls == [(11, False)]
    with pytest.raises(ValueError):
        view[0]  # released with the block
    with pytest.raises(ValueError, match="already released"):
        block.view()


def test_a_lapsed_lease_raises_lease_expired_from_every_read(pool):
    """The server freed the block (zeroed its entry) and reused it (a new version): every read
    raises, and so does check() on a view already handed out."""
    block = pool.leased(0, 2 * UNIT, 5, None, 1)
    view = block.view()
    block.check()
    for version in (0, 6):
        if version:
            pool.publish(0, version)
        else:
            pool.clear(0)
        for read in (block.check, block.view, block.tobytes, block.array,
                     lambda: block.copy_into(bytearray(2 * UNIT))):
            with pytest.raises(LeaseExpired, match="version 5"):
                read()
    assert view[0] == 0  # the view handed out stays readable: check() is the reader's guard
    block.release()


@pytest.mark.parametrize("version", [-1, 1 << 64, "5"])
def test_a_version_no_entry_can_hold_never_matches(pool, version):
    block = pool.leased(0, UNIT, version, None, 1)
    with pytest.raises(LeaseExpired):
        block.view()
    block.release()


def test_release_is_idempotent_and_tolerates_a_live_array(pool):
    owner = Owner()
    block = pool.leased(0, UNIT, 5, owner, 3)
    arr = block.array()
    block.release()
    block.release()
    assert owner.calls == [(3, False)] and block.released
    assert arr[1] == 1  # the array still exports its view, which stays mapped


def test_a_block_collected_unreleased_ends_its_lease_as_collected(pool):
    owner, failing = Owner(), Owner(RuntimeError("client torn down"))
    block = pool.leased(0, UNIT, 5, owner, 21)
    other = pool.leased(UNIT * 2, UNIT, 5, failing, 22)
    del block, other  # the failing owner's error is swallowed, as at interpreter exit
    gc.collect()
    assert owner.calls == [(21, True)] and failing.calls == [(22, True)]
    released = pool.leased(0, UNIT, 5, owner, 23)
    released.release()
    del released
    gc.collect()
    assert owner.calls == [(21, True), (23, False)]


def test_a_release_error_from_the_owner_propagates(pool):
    block = pool.leased(0, UNIT, 5, Owner(OSError("ring gone")), 4)
    with pytest.raises(OSError, match="ring gone"):
        block.release()
    assert block.released


@pytest.mark.parametrize("offset, size", [(-UNIT, 8), (16 * UNIT, 1), (100, 8), (UNIT, 0),
                                          (15 * UNIT, UNIT + 1), (UNIT, 16 * UNIT),
                                          (1 << 70, 8), (0, 1 << 70), (0, -1)])
def test_a_lease_outside_the_pool_or_off_its_units_gives_no_block(pool, offset, size):
    """A lease is read from a reply (hostile ground): it is refused before any view is made."""
    with pytest.raises(RegionError):
        pool.leased(offset, size, 5, None, 1)


@pytest.mark.parametrize("args", [(0.0, UNIT, 5, None, 1), (0, "4096", 5, None, 1), (0, UNIT, 5, None)])
def test_a_lease_of_the_wrong_types_raises_type_error(pool, args):
    with pytest.raises(TypeError):
        pool.leased(*args)


def test_the_last_unit_whole_is_a_block(pool):
    block = pool.leased(15 * UNIT, UNIT, 0, None, 1)  # entry 0: an unpublished block holds 0
    assert block.size == UNIT and block.view().readonly
    block.release()


def test_a_block_without_a_pool_always_holds_and_is_read_only(kind):
    data = bytearray(b"abc")
    block = kvpool.Block(memoryview(data))
    assert block.view().readonly and block.tobytes() == b"abc" and len(block) == 3
    assert block.version == 0
    block.release()
    assert block.released
