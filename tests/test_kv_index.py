"""KVIndex semantics: two-phase puts, leases, TTL, eviction, quotas and fairness, owners, stats.

Time is an injected fake clock; nothing sleeps.
"""
import pytest
from hypothesis import given, settings, strategies as st

from cxlrpc.allocator import PoolAllocator
from kvservice.index import KVIndex, Lease, PoolFull, PutTicket, QuotaExceeded

U = 4096  # one allocation unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(units: int = 16, **kw) -> tuple[KVIndex, Clock]:
    clock = Clock()
    kw.setdefault("high_watermark", 1.0)
    kw.setdefault("low_watermark", 1.0)
    return KVIndex(PoolAllocator(units * U), clock=clock, **kw), clock


def put(idx: KVIndex, ns: str, key, units: int = 1, **kw) -> int:
    return idx.commit_put(idx.begin_put(ns, key, units * U, **kw).ticket_id)


def keys(idx: KVIndex, ns: str, candidates) -> list:
    return [k for k in candidates if idx.exists(ns, k)]


# ---- two-phase put ------------------------------------------------------------------------

def test_value_is_invisible_until_commit():
    idx, _ = make()
    ticket = idx.begin_put("m", "k", 100)
    assert isinstance(ticket, PutTicket) and ticket.size == 100
    assert not idx.exists("m", "k") and idx.lookup_prefix("m", [b"k"]) == 0
    with pytest.raises(KeyError):
        idx.get("m", "k")
    version = idx.commit_put(ticket.ticket_id)
    lease = idx.get("m", "k")
    assert isinstance(lease, Lease)
    assert (lease.offset, lease.size, lease.version) == (ticket.offset, 100, version)
    assert idx.exists("m", b"k")  # str and bytes keys are the same key


def test_commit_twice_or_unknown_ticket_is_keyerror():
    idx, _ = make()
    ticket = idx.begin_put("m", "k", U)
    idx.commit_put(ticket.ticket_id)
    with pytest.raises(KeyError):
        idx.commit_put(ticket.ticket_id)
    with pytest.raises(KeyError):
        idx.commit_put(12345)


def test_abort_frees_and_is_idempotent():
    idx, _ = make()
    ticket = idx.begin_put("m", "k", 3 * U)
    assert idx.stats()["pool_used"] == 3 * U
    assert idx.abort_put(ticket.ticket_id) is True
    assert idx.abort_put(ticket.ticket_id) is False
    assert idx.stats()["pool_used"] == 0 and not idx.exists("m", "k")
    with pytest.raises(KeyError):
        idx.commit_put(ticket.ticket_id)


def test_uncommitted_put_expires_after_timeout():
    idx, clock = make(put_timeout_s=30)
    ticket = idx.begin_put("m", "k", U)
    clock.now += 29.9
    assert idx.expire() == 0 and idx.stats()["pool_used"] == U
    clock.now += 0.1
    assert idx.expire() == 1
    stats = idx.stats()
    assert stats["pool_used"] == 0 and stats["put_expirations"] == 1 and stats["pending_puts"] == 0
    with pytest.raises(KeyError):
        idx.commit_put(ticket.ticket_id)


def test_expiry_runs_at_the_start_of_operations():
    idx, clock = make(put_timeout_s=5)
    ticket = idx.begin_put("m", "k", U)
    clock.now += 5
    with pytest.raises(KeyError):
        idx.commit_put(ticket.ticket_id)  # no explicit expire() call needed
    assert idx.stats()["pool_used"] == 0


def test_last_commit_wins_between_concurrent_puts():
    idx, _ = make()
    t1 = idx.begin_put("m", "k", U)
    t2 = idx.begin_put("m", "k", U)
    v2 = idx.commit_put(t2.ticket_id)
    v1 = idx.commit_put(t1.ticket_id)
    assert v1 > v2
    lease = idx.get("m", "k")
    assert (lease.offset, lease.version) == (t1.offset, v1)
    assert idx.stats()["pool_used"] == U  # t2's block was replaced and freed


# ---- replacement, leases -------------------------------------------------------------------

def test_overwrite_keeps_leased_old_block_until_release():
    idx, _ = make()
    put(idx, "m", "k")
    old = idx.get("m", "k")
    ticket = idx.begin_put("m", "k", U)
    idx.commit_put(ticket.ticket_id)
    new = idx.get("m", "k")
    assert new.offset == ticket.offset != old.offset and new.version > old.version
    stats = idx.stats()
    assert stats["pool_used"] == 2 * U and stats["retired_blocks"] == 1 and stats["entries"] == 1
    assert idx.release(old.lease_id) is True
    assert idx.stats()["pool_used"] == U and idx.stats()["retired_blocks"] == 0
    assert idx.get("m", "k").offset == new.offset  # the new value is unaffected


def test_overwrite_without_lease_frees_old_block_at_commit():
    idx, _ = make()
    put(idx, "m", "k", 2)
    put(idx, "m", "k", 3)
    assert idx.stats()["pool_used"] == 3 * U and idx.get("m", "k").size == 3 * U


def test_old_block_freed_when_its_last_lease_expires():
    idx, clock = make(default_lease_s=10)
    put(idx, "m", "k")
    idx.get("m", "k")
    idx.get("m", "k", lease_s=20)
    put(idx, "m", "k")
    clock.now += 10
    idx.expire()
    assert idx.stats()["pool_used"] == 2 * U  # one lease still holds the old block
    clock.now += 10
    idx.expire()
    stats = idx.stats()
    assert stats["pool_used"] == U and stats["lease_expirations"] == 2 and stats["leases"] == 0


@pytest.mark.parametrize("how", ["renewed", "released with a hold"])
def test_lease_with_two_timer_entries_both_due_in_one_pass_ends_once(how):
    """A renewal (or a release with a hold) leaves the lease two timer entries; when no pass
    ran between their deadlines, one pass sees both: it ends the lease once, and goes on to
    what else is due (it raised KeyError half-way and left the rest unexpired)."""
    idx, clock = make(default_lease_s=10)
    put(idx, "m", "k")
    put(idx, "m", "old")
    if how == "renewed":
        lease = idx.get("m", "k", lease_s=1)
        clock.now += 0.5
        assert idx.renew(lease.lease_id, lease_s=1) == clock.now + 1
    else:
        (lease,) = idx.batch_get("m", ["k"], lease_s=1, hold_s=2)
        assert idx.release(lease.lease_id) is True  # held on until its hold ends
    other = idx.get("m", "old", lease_s=3)
    put(idx, "m", "old")  # the leased old block is retired, freed when its lease ends
    clock.now += 5  # past every deadline, with no pass since
    assert idx.expire() == 2
    stats = idx.stats()
    assert stats["lease_expirations"] == 2 and stats["leases"] == 0
    assert stats["pool_used"] == 2 * U  # the retired block was freed too
    assert idx.release(lease.lease_id) is False and idx.release(other.lease_id) is False


def test_lease_expiry_time_and_default():
    idx, clock = make(default_lease_s=10)
    put(idx, "m", "k")
    assert idx.get("m", "k").expires_at == clock.now + 10
    assert idx.get("m", "k", lease_s=2.5).expires_at == clock.now + 2.5
    with pytest.raises(ValueError):
        idx.get("m", "k", lease_s=0)


def test_release_unknown_or_twice_returns_false_and_counts():
    idx, clock = make(default_lease_s=1)
    put(idx, "m", "k")
    lease = idx.get("m", "k")
    assert idx.release(lease.lease_id) is True
    assert idx.release(lease.lease_id) is False
    assert idx.release(999) is False
    expired = idx.get("m", "k")
    clock.now += 1
    assert idx.release(expired.lease_id) is False
    assert idx.stats()["stale_releases"] == 3


def test_hits_misses_and_batch_get():
    idx, _ = make()
    put(idx, "m", "a")
    put(idx, "m", "b")
    with pytest.raises(KeyError):
        idx.get("m", "zzz")
    with pytest.raises(KeyError):
        idx.get("other", "a")
    got = idx.batch_get("m", ["a", "x", b"b"])
    assert [g is not None for g in got] == [True, False, True]
    assert len({g.lease_id for g in got if g}) == 2
    stats = idx.stats()
    assert (stats["hits"], stats["misses"], stats["leases"]) == (2, 3, 2)


def test_exists_and_lookup_prefix_take_no_lease_and_count_nothing():
    idx, _ = make()
    chain = [bytes([i]) * 16 for i in range(5)]
    for k in chain[:3]:
        put(idx, "m", k)
    put(idx, "m", chain[4])
    assert idx.lookup_prefix("m", chain) == 3
    assert idx.lookup_prefix("m", chain[:2]) == 2
    assert idx.lookup_prefix("m", []) == 0
    assert idx.lookup_prefix("nope", chain) == 0
    assert idx.exists("m", chain[4]) and not idx.exists("m", chain[3])
    stats = idx.stats()
    assert (stats["hits"], stats["misses"], stats["leases"]) == (0, 0, 0)


def test_remove_hides_at_once_and_frees_when_leases_end():
    idx, _ = make()
    put(idx, "m", "k")
    lease = idx.get("m", "k")
    assert idx.remove("m", "k") is True
    assert not idx.exists("m", "k") and idx.remove("m", "k") is False
    with pytest.raises(KeyError):
        idx.get("m", "k")
    assert idx.stats()["pool_used"] == U
    idx.release(lease.lease_id)
    assert idx.stats()["pool_used"] == 0
    assert idx.remove("m", "never") is False and idx.remove("nobody", "k") is False


# ---- TTL ------------------------------------------------------------------------------------

def test_ttl_expired_key_is_a_miss_and_freed():
    idx, clock = make()
    put(idx, "m", "k", ttl=5)
    put(idx, "m", "forever")
    clock.now += 4.9
    assert idx.exists("m", "k")
    clock.now += 0.1
    assert not idx.exists("m", "k")
    with pytest.raises(KeyError):
        idx.get("m", "k")
    stats = idx.stats()
    assert stats["expirations"] == 1 and stats["misses"] == 1 and stats["pool_used"] == U
    assert idx.exists("m", "forever")


def test_ttl_expiry_of_leased_block_waits_for_the_lease():
    idx, clock = make(default_lease_s=100)
    put(idx, "m", "k", ttl=5)
    lease = idx.get("m", "k")
    clock.now += 5
    assert not idx.exists("m", "k") and idx.stats()["pool_used"] == U
    idx.release(lease.lease_id)
    assert idx.stats()["pool_used"] == 0


def test_ttl_of_replaced_value_does_not_expire_the_new_one():
    idx, clock = make()
    put(idx, "m", "k", ttl=5)
    put(idx, "m", "k")
    clock.now += 10
    assert idx.exists("m", "k") and idx.stats()["expirations"] == 0


# ---- eviction -----------------------------------------------------------------------------

def test_watermarks_evict_lru_down_to_low():
    idx, _ = make(10, high_watermark=0.9, low_watermark=0.5)
    for i in range(9):
        put(idx, "m", i.to_bytes(2, "big"))
    idx.get("m", (0).to_bytes(2, "big"))  # bump the oldest
    put(idx, "m", b"new")  # 9 + 1 > 9 -> evict until 9 + 1 - 5 units are gone
    left = keys(idx, "m", [i.to_bytes(2, "big") for i in range(9)])
    assert left == [(i).to_bytes(2, "big") for i in (0, 6, 7, 8)]
    stats = idx.stats()
    assert stats["evictions"] == 5 and stats["pool_used"] == 5 * U


def test_exists_does_not_bump_lru_but_get_does():
    idx, _ = make(3)
    for k in ("a", "b", "c"):
        put(idx, "m", k)
    idx.exists("m", "a")
    idx.lookup_prefix("m", ["a"])
    put(idx, "m", "d")
    assert keys(idx, "m", "abcd") == ["b", "c", "d"]
    idx.release(idx.get("m", "b").lease_id)
    put(idx, "m", "e")
    assert keys(idx, "m", "bcde") == ["b", "d", "e"]


def test_eviction_skips_leased_blocks():
    idx, _ = make(3)
    for k in ("a", "b", "c"):
        put(idx, "m", k)
    idx.get("m", "a")
    put(idx, "m", "d")
    assert keys(idx, "m", "abcd") == ["a", "c", "d"]


def test_allocation_failure_from_fragmentation_evicts_more():
    idx, _ = make(4)
    for k in ("a", "b", "c", "d"):
        put(idx, "m", k)
    idx.remove("m", "b")
    idx.remove("m", "d")  # 2 units free, but not contiguous
    lease = idx.get("m", "c")
    put(idx, "m", "big", 2)  # must evict "a" (unleased) to join its unit with b's
    assert keys(idx, "m", ["a", "c", "big"]) == ["c", "big"]
    assert idx.get("m", "big").offset == 0 and lease.offset == 2 * U


def test_pool_full_when_everything_is_leased_or_pending():
    idx, _ = make(3)
    put(idx, "m", "a")
    idx.get("m", "a")
    idx.begin_put("m", "b", 2 * U)  # pending: never evicted
    with pytest.raises(PoolFull):
        idx.begin_put("m", "c", U)
    assert idx.exists("m", "a") and idx.stats()["evictions"] == 0


def test_pool_full_for_a_size_that_cannot_fit_even_after_evicting():
    idx, _ = make(4)
    put(idx, "m", "a", 2)
    idx.get("m", "a")
    with pytest.raises(PoolFull):
        idx.begin_put("m", "b", 3 * U)
    with pytest.raises(ValueError):
        idx.begin_put("m", "b", 4 * U + 1)


def test_sizes_are_accounted_after_rounding():
    idx, _ = make()
    put(idx, "m", "a")  # one unit exactly
    idx.commit_put(idx.begin_put("m", "b", 1).ticket_id)
    assert idx.stats()["namespaces"]["m"]["bytes"] == 2 * U
    assert idx.get("m", "b").size == 1


# ---- quotas and fairness --------------------------------------------------------------------

def test_put_over_quota_evicts_own_lru_only():
    idx, _ = make(16)
    idx.set_quota("a", 3 * U)
    put(idx, "b", "x")
    for k in ("1", "2", "3"):
        put(idx, "a", k)
    put(idx, "a", "4", 2)
    assert keys(idx, "a", "1234") == ["3", "4"] and idx.exists("b", "x")
    assert idx.stats()["namespaces"]["a"]["bytes"] == 3 * U


def test_quota_exceeded_when_own_blocks_cannot_make_room_and_nothing_is_evicted():
    idx, _ = make(16)
    idx.set_quota("a", 3 * U)
    put(idx, "a", "1")
    put(idx, "a", "2", 2)
    idx.get("a", "2")
    with pytest.raises(QuotaExceeded):
        idx.begin_put("a", "3", 2 * U)  # evicting "1" frees 1 unit, 2 are needed
    assert keys(idx, "a", "12") == ["1", "2"] and idx.stats()["evictions"] == 0
    with pytest.raises(QuotaExceeded):
        idx.begin_put("a", "big", 4 * U)
    assert issubclass(QuotaExceeded, PoolFull)


def test_namespace_within_quota_is_never_evicted_by_another():
    idx, _ = make(4)
    idx.set_quota("a", 2 * U)
    put(idx, "a", "1")
    put(idx, "a", "2")
    put(idx, "b", "1")
    put(idx, "b", "2")
    idx.get("b", "1")
    idx.get("b", "2")
    with pytest.raises(PoolFull):
        idx.begin_put("b", "3", U)
    assert keys(idx, "a", "12") == ["1", "2"]


def test_own_blocks_are_evicted_before_other_namespaces():
    idx, clock = make(4)
    put(idx, "other", "old")
    clock.now += 1
    put(idx, "me", "1")
    put(idx, "me", "2")
    put(idx, "other", "new")
    put(idx, "me", "3")
    assert keys(idx, "me", "123") == ["2", "3"]
    assert keys(idx, "other", ["old", "new"]) == ["old", "new"]


def test_other_namespaces_are_evicted_in_global_lru_order():
    idx, clock = make(4)
    for ns, k in (("x", "1"), ("y", "1"), ("x", "2"), ("y", "2")):
        clock.now += 1
        put(idx, ns, k)
    put(idx, "me", "a", 3)
    assert keys(idx, "x", "12") == [] and keys(idx, "y", "12") == ["2"]


def test_over_quota_namespace_is_evicted_by_others_only_down_to_its_quota():
    idx, _ = make(6)
    for k in "1234":
        put(idx, "hog", k)
    idx.set_quota("hog", 2 * U)  # takes effect lazily: hog is now 2 units over its quota
    put(idx, "me", "a", 2)
    assert keys(idx, "hog", "1234") == list("1234")  # it fits: nobody is evicted
    idx.get("me", "a")
    put(idx, "me", "b", 2)  # own "a" is leased, so hog pays, down to its quota
    assert keys(idx, "hog", "1234") == ["3", "4"]
    put(idx, "you", "c", 2)  # hog is within quota now; "me" has no quota, its "b" goes
    assert keys(idx, "hog", "1234") == ["3", "4"] and keys(idx, "me", "ab") == ["a"]
    idx.get("you", "c")
    with pytest.raises(PoolFull):
        idx.begin_put("them", "d", U)
    assert keys(idx, "hog", "1234") == ["3", "4"]


def test_namespaces_without_quota_are_evictable_by_anyone():
    idx, _ = make(2)
    put(idx, "a", "1", 2)
    put(idx, "b", "1", 2)
    assert not idx.exists("a", "1") and idx.exists("b", "1")


def test_set_quota_validation_and_removal():
    idx, _ = make()
    for bad in (-1, 1.5, "x", True):
        with pytest.raises(ValueError):
            idx.set_quota("a", bad)
    idx.set_quota("a", 0)
    with pytest.raises(QuotaExceeded):
        idx.begin_put("a", "k", 1)
    idx.set_quota("a", None)
    put(idx, "a", "k")
    assert idx.stats()["namespaces"]["a"]["quota"] is None


# ---- owners -------------------------------------------------------------------------------

def test_release_owner_drops_its_leases_and_tickets_only():
    idx, _ = make()
    put(idx, "m", "k")
    idx.get("m", "k", owner="dead")
    idx.get("m", "k", owner="alive")
    idx.begin_put("m", "p", 2 * U, owner="dead")
    kept = idx.begin_put("m", "q", U, owner="alive")
    put(idx, "m", "k")  # the old block is retired, held by both leases
    assert idx.stats()["pool_used"] == 5 * U
    assert idx.release_owner("dead") == 2
    stats = idx.stats()
    assert stats["leases"] == 1 and stats["pending_puts"] == 1 and stats["pool_used"] == 5 * U
    assert stats["quarantined_blocks"] == 1 and stats["quarantined_bytes"] == 2 * U
    assert idx.release_owner("dead") == 0
    assert idx.fence_owner("dead") == 1  # its writer can write no more: the block is freed
    assert idx.stats()["pool_used"] == 3 * U and idx.fence_owner("dead") == 0
    idx.commit_put(kept.ticket_id)
    assert idx.release_owner("alive") == 1
    assert idx.stats()["pool_used"] == 2 * U  # retired block freed with its last lease


def test_released_or_expired_records_leave_their_owner():
    idx, clock = make(default_lease_s=1)
    put(idx, "m", "k")
    lease = idx.get("m", "k", owner=7)
    idx.release(lease.lease_id)
    idx.get("m", "k", owner=7)
    clock.now += 1
    ticket = idx.begin_put("m", "x", U, owner=7)
    idx.commit_put(ticket.ticket_id)
    assert idx.release_owner(7) == 0


# ---- fencing: a departed writer's blocks wait for its fence ---------------------------------

def test_a_departed_writers_pending_blocks_are_not_reused_until_it_is_fenced():
    """A writer judged gone may be frozen, holding a writable view of its blocks: they are
    quarantined (counted, not free), its tickets are dead, and no other put gets their bytes
    until fence_owner; then they are freed and reused."""
    idx, clock = make(4, put_timeout_s=5)
    late = idx.begin_put("m", "late", U, owner="frozen")
    clock.now += 6  # late's ticket expires: its block stays the writer's (it may be writing)
    pending = idx.begin_put("m", "p", 2 * U, owner="frozen")
    assert idx.stats()["expired_puts_held"] == 1
    assert idx.release_owner("frozen") == 2
    stats = idx.stats()
    assert stats["pending_puts"] == stats["expired_puts_held"] == 0
    assert stats["quarantined_blocks"] == 2 and stats["quarantined_bytes"] == 3 * U
    assert stats["pool_used"] == 3 * U and stats["namespaces"]["m"]["bytes"] == 3 * U
    held = {pending.offset, pending.offset + U, late.offset}
    other = idx.begin_put("n", "o", U, owner="alive")  # the one unit left
    assert other.offset not in held
    with pytest.raises(PoolFull):  # nothing evictable: the quarantined units are not free
        idx.begin_put("n", "x", U, owner="alive")
    for tid in (pending.ticket_id, late.ticket_id):  # the resumed writer's commits fail
        with pytest.raises(KeyError):
            idx.commit_put(tid, "frozen")
        assert not idx.abort_put(tid, "frozen")
    assert idx.stats()["quarantined_blocks"] == 2  # and free nothing: it is not fenced yet
    assert idx.fence_owner("frozen") == 2
    stats = idx.stats()
    assert stats["quarantined_blocks"] == stats["quarantined_bytes"] == 0
    assert stats["pool_used"] == U and "m" not in stats["namespaces"]
    reused = {idx.begin_put("n", k, U, owner="alive").offset for k in "abc"}
    assert reused == held
    assert idx.fence_owner("frozen") == 0


def test_fence_without_a_disconnect_first_releases_the_owner():
    """fence_owner of an owner still holding records ends them as release_owner would, then
    frees its pending blocks at once."""
    idx, _ = make(4)
    put(idx, "m", "k")
    idx.get("m", "k", owner="w")
    idx.begin_put("m", "p", 2 * U, owner="w")
    assert idx.fence_owner("w") == 1
    stats = idx.stats()
    assert stats["leases"] == stats["pending_puts"] == stats["quarantined_blocks"] == 0
    assert stats["pool_used"] == U


def test_a_departed_readers_leases_end_at_once():
    """Leases are not quarantined: a late reader's copy fails its version check instead, so a
    frozen reader pins nothing (a hidden block it held is freed on release_owner)."""
    idx, _ = make(4)
    put(idx, "m", "k", 2)
    idx.get("m", "k", owner="reader")
    idx.remove("m", "k")
    assert idx.stats()["pool_used"] == 2 * U  # retired, held by the lease
    idx.release_owner("reader")
    stats = idx.stats()
    assert stats["pool_used"] == 0 and stats["quarantined_blocks"] == 0


# ---- stats, validation, bounded metadata --------------------------------------------------

def test_stats_shape_and_empty_namespaces_are_forgotten():
    idx, _ = make()
    put(idx, "a", "1", 2)
    put(idx, "b", "1")
    stats = idx.stats()
    assert stats["namespaces"] == {"a": {"bytes": 2 * U, "entries": 1, "quota": None},
                                   "b": {"bytes": U, "entries": 1, "quota": None}}
    assert (stats["entries"], stats["pool_used"], stats["pool_capacity"]) == (2, 3 * U, 16 * U)
    for key in ("hits", "misses", "evictions", "expirations", "leases", "pending_puts"):
        assert key in stats
    idx.remove("b", "1")
    assert list(idx.stats()["namespaces"]) == ["a"]


def test_argument_validation():
    idx, _ = make()
    with pytest.raises(ValueError):
        idx.begin_put("m", "k", 0)
    with pytest.raises(ValueError):
        idx.begin_put("m", "", U)
    with pytest.raises(ValueError):
        idx.begin_put("m", "k", U, ttl=0)
    with pytest.raises(TypeError):
        idx.begin_put(b"m", "k", U)
    with pytest.raises(TypeError):
        idx.get("m", 5)
    with pytest.raises(TypeError):
        idx.begin_put("m", "k", U, owner=[])
    put(idx, "m", "k")
    with pytest.raises(ValueError):
        idx.batch_get("m", ["k", ""])  # no lease is granted for "k" either
    assert idx.stats()["leases"] == 0
    idx.remove("m", "k")
    assert idx.stats()["pool_used"] == 0 and idx.stats()["namespaces"] == {}
    for kw in ({"high_watermark": 0.5, "low_watermark": 0.8}, {"low_watermark": 0},
               {"high_watermark": 1.5}, {"default_lease_s": 0}, {"put_timeout_s": -1}):
        with pytest.raises(ValueError):
            KVIndex(PoolAllocator(U), **kw)


def test_timer_heaps_stay_bounded_under_lease_churn():
    idx, _ = make(default_lease_s=3600)
    put(idx, "m", "k")
    for _ in range(5000):
        idx.release(idx.get("m", "k").lease_id)
    assert len(idx._leases.timers._heap) <= 2 * len(idx._leases) + 65
    assert len(idx._leases.young) < 64  # leases whose timer entry is not armed yet


def test_lease_timer_heap_stays_bounded_under_renewals():
    """Every renew pushes a timer entry, and the heap's rebuild keeps every entry whose lease
    still exists (dead = "lease gone", not "superseded"), so a lease renewed N times (one
    Renew message naming it N times will do) leaves N live-looking entries; once past
    2*live+64 every push rebuilds the whole heap and drops nothing: O(N**2) work in the
    server's loop (20k renews of one lease: ~60 s measured)."""
    idx, _ = make(default_lease_s=10)
    put(idx, "m", "k")
    lease = idx.get("m", "k")
    for _ in range(2000):
        idx.renew(lease.lease_id, lease_s=10)
    assert len(idx._leases.timers._heap) <= 2 * len(idx._leases) + 65, len(idx._leases.timers._heap)


OPS = ["put"] * 4 + ["commit"] * 3 + ["get"] * 3 + ["release"] * 2 + ["abort", "remove", "tick",
                                                                      "owner", "renew", "hold",
                                                                      "fence"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 11), st.integers(1, 3)),
                min_size=10, max_size=100))
def test_random_operations_keep_invariants(ops):
    """A freed block is never reused while leased (renewed and held leases too); reads see the
    latest commit; bytes add up; no operation fails on the index's own state."""
    idx, clock = make(8, high_watermark=0.9, low_watermark=0.6, default_lease_s=5,
                      put_timeout_s=7)
    idx.set_quota("q", 3 * U)
    tickets: dict[int, tuple[PutTicket, str, str, int, float]] = {}  # id -> (.., owner, deadline)
    #: tickets past their deadline: refused, their blocks held until their owner is done
    expired: dict[int, tuple[PutTicket, str, str, int, float]] = {}
    #: leases the index must still hold: id -> (lease, owner, until, end of its hold)
    leases: dict[int, tuple[Lease, int, float, float]] = {}
    latest: dict[tuple[str, str], int] = {}
    #: owner -> tickets it held when it departed: their blocks are kept until it is fenced
    quarantined: dict[int, list[PutTicket]] = {0: [], 1: []}

    def released(lid: int) -> None:  # the model of a release the index accepted
        lease, lowner, _, hold_until = leases.pop(lid)
        if hold_until > clock.now:  # a held read lease lasts its hold
            leases[lid] = (lease, lowner, hold_until, hold_until)

    for op, a, b in ops:
        ns, key, owner = "pqr"[a % 3], str(a % 4), a % 2
        if op == "put":
            try:
                ticket = idx.begin_put(ns, key, b * U - a % 2, ttl=(None, 3)[b % 2], owner=owner)
            except PoolFull:
                continue
            start, end = ticket.offset, ticket.offset + b * U
            held = [(t.offset, t.size) for t, *_ in (*tickets.values(), *expired.values())]
            held += [(t.offset, t.size) for ts in quarantined.values() for t in ts]
            held += [(lease.offset, lease.size) for lease, *_ in leases.values()]
            assert all(end <= o or o + s <= start for o, s in held), "range reused while held"
            tickets[ticket.ticket_id] = (ticket, ns, key, owner, clock.now + 7)
        elif op in ("commit", "abort") and expired and a % 3 == 0:
            # too late: refused, and the block its writer held is freed now
            tid = sorted(expired)[a % len(expired)]
            expired.pop(tid)
            if op == "abort":
                assert not idx.abort_put(tid)
            else:
                with pytest.raises(KeyError):
                    idx.commit_put(tid)
        elif op in ("commit", "abort") and tickets:
            tid = sorted(tickets)[a % len(tickets)]
            _, tns, tkey, *_ = tickets.pop(tid)
            if op == "abort":
                idx.abort_put(tid)
                continue
            latest[tns, tkey] = idx.commit_put(tid)
        elif op in ("get", "hold"):
            # hold: a read lease that outlives its release by up to b seconds, released at
            # once; it carries the release of another lease, as a client's next get does
            carried = sorted(leases)[a % len(leases)] if leases and op == "hold" else None
            hold_s = b if op == "hold" else 0
            (lease,) = idx.batch_get(ns, [key], lease_s=b, owner=owner, hold_s=hold_s,
                                     release=[] if carried is None else [carried])
            if carried is not None and leases[carried][1] == owner:
                released(carried)  # only the owner's release counts
            if lease is None:
                continue
            assert lease.version == latest[ns, key]
            leases[lease.lease_id] = (lease, owner, lease.expires_at, clock.now + hold_s)
            if op == "hold":
                assert idx.release(lease.lease_id, owner)
                released(lease.lease_id)
        elif op == "release" and leases:
            lid = sorted(leases)[a % len(leases)]
            assert idx.release(lid)
            released(lid)
        elif op == "renew" and leases:
            lid = sorted(leases)[a % len(leases)]
            lease, lowner, _, hold_until = leases[lid]
            assert idx.renew(lid, lowner, lease_s=b) == clock.now + b
            leases[lid] = (lease, lowner, clock.now + b, hold_until)
        elif op == "remove":
            idx.remove(ns, key)
        elif op == "tick":
            clock.now += b
            leases = {k: v for k, v in leases.items() if v[2] > clock.now}
            expired.update((k, v) for k, v in tickets.items() if v[4] <= clock.now)
            tickets = {k: v for k, v in tickets.items() if v[4] > clock.now}
        elif op in ("owner", "fence"):
            idx.release_owner(owner)
            quarantined[owner] += [v[0] for v in (*tickets.values(), *expired.values())
                                   if v[3] == owner]
            if op == "fence":
                assert idx.fence_owner(owner) == len(quarantined[owner])
                quarantined[owner] = []
            tickets = {k: v for k, v in tickets.items() if v[3] != owner}
            expired = {k: v for k, v in expired.items() if v[3] != owner}
            leases = {k: v for k, v in leases.items() if v[1] != owner}
        stats = idx.stats()
        assert stats["pool_used"] == sum(n["bytes"] for n in stats["namespaces"].values())
        assert stats["entries"] == sum(n["entries"] for n in stats["namespaces"].values())
        assert stats["namespaces"].get("q", {"bytes": 0})["bytes"] <= 3 * U
        assert stats["leases"] >= len(leases)
        assert stats["expired_puts_held"] == len(expired)
        assert stats["quarantined_blocks"] == sum(map(len, quarantined.values()))
        assert stats["quarantined_bytes"] == sum(-(-t.size // U) * U for ts in quarantined.values()
                                                 for t in ts)
    clock.now += 100
    for owner in (0, 1):  # the owners depart and are fenced, as a server's connections all end
        idx.release_owner(owner)
        idx.fence_owner(owner)
    for ns in "pqr":
        for key in "0123":
            idx.remove(ns, key)
    stats = idx.stats()
    assert stats["pool_used"] == 0 and stats["leases"] == stats["pending_puts"] == 0
    assert stats["expired_puts_held"] == stats["quarantined_blocks"] == 0
    assert stats["namespaces"] == {"q": {"bytes": 0, "entries": 0, "quota": 3 * U}}


def test_quota_is_a_guaranteed_share_against_namespaces_without_one():
    """A namespace within its quota grows to it by evicting others' unprotected (quota-less)
    blocks before its own; without a quota the old rule holds (own blocks first)."""
    idx, clock = make(8)
    for k in "123456":
        clock.now += 1
        put(idx, "b", k)
    idx.set_quota("a", 4 * U)
    for k in "wxyz":
        clock.now += 1
        put(idx, "a", k)
    assert keys(idx, "a", "wxyz") == list("wxyz")  # its whole share
    assert keys(idx, "b", "123456") == ["3", "4", "5", "6"]  # b's oldest paid
    clock.now += 1
    with pytest.raises(QuotaExceeded):  # and the share is a ceiling too
        idx.begin_put("a", "over", 5 * U)
    put(idx, "b", "7")  # b (no quota) now evicts its own oldest, never a's share
    assert keys(idx, "a", "wxyz") == list("wxyz")
    assert keys(idx, "b", "1234567") == ["4", "5", "6", "7"]
