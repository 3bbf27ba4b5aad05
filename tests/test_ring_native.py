"""The rings' native hot path (cxlrpc/_ring.c) against its Python reference.

The model-checked ring suites run the native path wherever it is built; here they run again
with ``CXLRPC_NO_NATIVE=1`` (the reference), and the native path's callouts into the
Python slow paths, its closed-region check and its state sharing are tested directly.
"""
from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cxlrpc.memory import RELEASE, AtomicMemory
from cxlrpc.ring import ClaimRevoked, MpscRing, SpscRing, base
from cxlrpc.ring.mpsc import NO_CLAIM
from cxlrpc.ring.record import COMMITTED, KIND_PADDING, TAIL_OFFSET

from ring_env import Env, payload

pytestmark = pytest.mark.timeout(120)
native = pytest.mark.skipif(not base.NATIVE, reason="cxlrpc._ring is not built (no C compiler)")
TESTS = Path(__file__).parent


def test_native_rings_are_built_where_a_compiler_is() -> None:
    """A build that silently fell back to the reference would make every ring 5-8x slower."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    if os.environ.get("CXLRPC_NO_NATIVE"):
        pytest.skip("the reference was asked for")
    assert base.NATIVE, "cxlrpc._ring did not build: run pip install -e . and read its output"
    assert SpscRing.try_push_parts is not SpscRing._try_push_parts_py
    assert MpscRing.poll is not MpscRing._poll_py


@native
def test_reference_rings_pass_the_ring_suites() -> None:
    """The same model-checked, cross-process and garbage suites, on the Python reference."""
    import cxlrpc
    root = str(Path(cxlrpc.__file__).resolve().parents[1])  # the package this run imports
    env = {**os.environ, "CXLRPC_NO_NATIVE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    files = ["test_ring_spsc.py", "test_ring_mpsc.py", "test_ring_claims.py"]
    check = "import cxlrpc.ring.base as b; assert not b.NATIVE"
    assert subprocess.run([sys.executable, "-c", check], env=env, timeout=60).returncode == 0
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def _claims() -> tuple[mmap.mmap, AtomicMemory]:
    """Claim words outside the ring, each holding no claim (as a channel's slot starts)."""
    words = mmap.mmap(-1, 4096)
    mem = AtomicMemory(words)
    for at in range(0, 4096, 8):
        mem.store(at, NO_CLAIM, RELEASE)
    return words, mem


@native
@pytest.mark.parametrize("wrap", [False, True])
def test_garbage_where_the_header_goes_is_overwritten_by_a_live_producer(wrap: bool) -> None:
    """The header CAS finds garbage in free space: the native push calls the reference's
    slow path, which overwrites it (the producer is alive), and the record arrives whole."""
    env = Env(MpscRing, 4096, start=4096 - 64 if wrap else 0)
    ring = env.ring
    words, mem = _claims()
    claim = mem.counter(0)
    rec = payload(1, 200)
    at = env.data + (0 if wrap else ring._head_local & ring.mask)
    env.mem.store(at, 0xDEAD_BEEF, RELEASE)
    seen = []  # the claim word while the slow path asks revoked()
    assert ring.try_push_parts((rec[:50], rec[50:]), 3, 5, claim, lambda: seen.append(claim.load(0)) or False)
    assert seen and seen[0] == ring._head_local  # held where it claimed while writing
    assert claim.load(0) == NO_CLAIM  # and no position once committed
    assert ring.pop() == rec
    assert env.guards_intact()


@native
def test_claim_word_inside_the_ring_buffer_is_stored_directly() -> None:
    """A claim counter whose word lies in the ring's own buffer (a channel's slot word) is
    written without a call: the claim while the push writes, NO_CLAIM after (by a CAS from the
    claim: a word a new holder of the slot wrote meanwhile stays)."""
    env = Env(MpscRing, 4096, start=1024)
    ring = env.ring

    class Claim:  # an AtomicU64's address, and methods the native push must not call
        address = env.base_addr + 8  # in the leading guard bytes, outside the ring

        def store(self, value, order):
            raise AssertionError("the native push called store()")

        cas = store

    claim, rec = Claim(), payload(2, 100)
    env.mem.store(8, NO_CLAIM, RELEASE)  # as a channel's slot starts
    seen = []

    def garbage_at_tail() -> None:  # the header CAS then takes the slow path, which asks revoked()
        env.mem.store(env.data + (env.load_counter(TAIL_OFFSET) & ring.mask), 0xDEAD_BEEF, RELEASE)

    garbage_at_tail()
    assert ring.try_push_parts((rec,), 3, 5, claim, lambda: seen.append(env.mem.load(8, 0)) or False)
    assert seen == [1024] and env.mem.load(8, 0) == NO_CLAIM
    garbage_at_tail()
    new_holder = lambda: env.mem.store(8, 8192, RELEASE) or False  # the slot changes hands mid-push
    assert ring.try_push_parts((rec,), 3, 5, claim, new_holder) and env.mem.load(8, 0) == 8192
    assert ring.pop_batch() == [rec, rec]
    env.buf[8:16] = bytes([0xA5]) * 8  # the guard as it was
    assert env.guards_intact()


@native
def test_producer_judged_dead_before_its_header_commits_nothing() -> None:
    """The consumer's padding sits where the header goes and ``revoked()`` agrees: the native
    push raises ClaimRevoked, as the reference does, and the ring reads as before."""
    env = Env(MpscRing, 4096)
    ring = env.ring
    words, mem = _claims()
    claim = mem.counter(0)
    claim.store(NO_CLAIM, RELEASE)
    pad = COMMITTED | (KIND_PADDING << 48) | (3 << 32) | 200
    env.mem.store(env.data, pad, RELEASE)
    with pytest.raises(ClaimRevoked):
        ring.try_push_parts((payload(2, 200),), 3, 5, claim, lambda: True)
    assert env.mem.load(env.data, 0) == pad  # our header was never left over it


@native
def test_full_ring_gives_the_claim_word_back() -> None:
    """A push that finds no room leaves the producer's claim word at NO_CLAIM (a lost claim
    must not look like one in progress)."""
    env = Env(MpscRing, 1024)
    ring = env.ring
    words, mem = _claims()
    claim = mem.counter(0)
    while ring.try_push_parts((payload(3, 100),), 1, 0, claim):
        pass
    assert claim.load(0) == NO_CLAIM


@native
@pytest.mark.parametrize("ring_cls", [SpscRing, MpscRing])
def test_closed_region_raises_instead_of_touching_the_mapping(ring_cls: type) -> None:
    env = Env(ring_cls, 4096)
    ring = env.ring
    assert ring.try_push_parts((b"x" * 10,))
    env.mem.close()
    env.buf.release()
    with pytest.raises(ValueError, match="closed"):
        ring.poll(lambda view: None)
    with pytest.raises(ValueError, match="closed"):
        ring.try_push_parts((b"y",))


@native
def test_handler_that_closes_the_region_stops_the_poll() -> None:
    env = Env(SpscRing, 4096)
    ring = env.ring
    for i in range(3):
        assert ring.try_push_parts((payload(i, 40),))
    seen = []

    def handler(view: memoryview) -> None:
        seen.append(bytes(view))
        view.release()
        env.mem.close()
        env.buf.release()

    with pytest.raises(ValueError, match="closed"):
        ring.poll(handler)
    assert seen == [payload(0, 40)]


@native
def test_handler_polling_its_own_ring_is_refused() -> None:
    """A nested poll of the same ring would move the head under the outer one."""
    env = Env(SpscRing, 4096)
    ring = env.ring
    for i in range(2):
        assert ring.try_push_parts((payload(i, 40),))
    with pytest.raises(RuntimeError, match="polled the ring"):
        ring.poll(lambda view: ring.poll(lambda inner: None))


@native
@pytest.mark.parametrize("ring_cls", [SpscRing, MpscRing])
def test_native_and_reference_share_one_state(ring_cls: type) -> None:
    """Records pushed by either are read by either, in order, and the dropped count is one."""
    env = Env(ring_cls, 4096)
    ring = env.ring
    recs = [payload(i, 30 + 50 * i) for i in range(40)]
    got: list[bytes] = []
    for i, r in enumerate(recs):
        push = ring.try_push_parts if i % 2 else ring._try_push_parts_py
        while not push((r,)):
            poll = ring.poll if i % 3 else ring._poll_py
            poll(lambda view: got.append(bytes(view)))
    ring._poll_py(lambda view: got.append(bytes(view)))
    assert got == recs
    assert ring.try_push_parts((b"z" * 8,))
    at = env.data + (ring._head_local & ring.mask)
    env.mem.store(at, COMMITTED | (9 << 48) | 8, RELEASE)  # a kind no producer writes
    assert ring.poll(lambda view: None) == 0
    assert ring.dropped == 1
    assert ring.try_push_parts((b"w" * 8,))
    assert ring._poll_py(lambda view: got.append(bytes(view))) == 1 and got[-1] == b"w" * 8
    assert ring.dropped == 1


@native
def test_oversize_and_bad_arguments_raise() -> None:
    env = Env(MpscRing, 1024)
    ring = env.ring
    with pytest.raises(ValueError, match="exceeds"):
        ring.try_push_parts((b"x" * 600,))
    with pytest.raises(ValueError, match="16 bits"):
        ring.try_push_parts((b"x",), 1 << 16)
    with pytest.raises(TypeError):
        ring.try_push_parts(([1, 2],))
    with pytest.raises(ValueError, match="16 bits"):
        ring.try_push_parts((b"x",), 2**70)
    assert ring.pop() is None
    assert ring.try_push_parts((b"x",) * 9, producer=2)  # more parts, keywords: the reference takes them
    assert ring.pop() == b"x" * 9


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("ring_cls", [SpscRing, MpscRing])
def test_poll_within_waits_for_a_record_and_no_longer_than_told(ring_cls: type, impl: str) -> None:
    """poll_within hands over what is there at once, takes a record another process commits
    while it looks, never hands over a claimed record before its commit, and returns 0 once
    its seconds passed (a garbage tail included)."""
    if impl == "native" and not base.NATIVE:
        pytest.skip("cxlrpc._ring is not built")
    env = Env(ring_cls, 4096)
    ring = env.ring
    within = ring.poll_within if impl == "native" else ring._poll_within_py
    got: list[bytes] = []
    take = lambda view: got.append(bytes(view))  # noqa: E731
    t0 = time.monotonic()
    assert within(take, 256, 0.05) == 0 and time.monotonic() - t0 >= 0.05
    assert ring.try_push_parts((b"here",)) and ring.try_push_parts((b"too",))
    assert within(take, 256, 5.0) == 2 and got == [b"here", b"too"]
    pid = os.fork()  # the anonymous mapping is shared with the child
    if pid == 0:
        try:
            time.sleep(0.05)
            ring.try_push_parts((b"from another process",))
        finally:
            os._exit(0)
    try:
        t0 = time.monotonic()
        assert within(take, 256, 10.0) == 1 and got[-1] == b"from another process"
        assert time.monotonic() - t0 < 5
    finally:
        os.waitpid(pid, 0)
    if ring_cls is MpscRing:  # claimed, its header not committed: nothing until the commit
        head = ring._head_local
        env.store_counter(TAIL_OFFSET, head + 16)
        at = env.data + (head & ring.mask)
        env.mem.store(at, (1 << 48) | 4, RELEASE)  # DATA, 4 bytes, not committed
        t0 = time.monotonic()
        assert within(take, 256, 0.05) == 0 and time.monotonic() - t0 >= 0.05
        env.buf[at + 8:at + 12] = b"late"
        env.mem.store(at, COMMITTED | (1 << 48) | 4, RELEASE)
        assert within(take, 256, 5.0) == 1 and got[-1] == b"late"
    env.store_counter(TAIL_OFFSET, ring._head_local + 3)  # garbage: not a position
    assert within(take, 256, 0.02) == 0
    assert env.guards_intact()
