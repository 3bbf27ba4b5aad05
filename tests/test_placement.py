"""Pollers that find their CPU shared move off it (cxlrpc.doorbell.placement): the evidence
is counted yield by yield, a doorbell wake-up sent from the woken thread's own CPU makes its
next late yield a move, and a move changes the thread's CPU but not its affinity mask. (What the kernel does to
a client and server after a sync wake-up could not be made on purpose here: pinned peers are
separated by the balancer as soon as they are let go. Its effect is measured in the
benchmark's idle section: the p50 of calls right after idle periods.)"""
from __future__ import annotations

import asyncio
import mmap
import os
import socket
import time

import pytest

from cxlrpc.doorbell import Doorbell, DoorbellReceiver, placement
from cxlrpc.doorbell.bell import wake_datagram
from cxlrpc.memory import SEQ_CST, AtomicMemory
from cxlrpc.doorbell.placement import EVIDENCE, MOVE_EVERY_S, SharedCpu

pytestmark = pytest.mark.timeout(60)
ALLOWED = os.sched_getaffinity(0)
needs_two = pytest.mark.skipif(len(ALLOWED) < 2 or placement._getcpu is None,
                               reason="needs two CPUs and sched_getcpu")


def _late_yields(monkeypatch, late: list[bool]) -> list[int]:
    """Yields that take 5 us (or none) as ``late`` says, one per call; moves recorded, not made."""
    moves: list[int] = []

    def fake_yield() -> None:
        if late.pop(0):
            end = time.perf_counter() + 5e-6
            while time.perf_counter() < end:
                pass

    monkeypatch.setattr(placement.os, "sched_yield", fake_yield)
    monkeypatch.setattr(placement, "move_off_this_cpu", lambda: moves.append(1) or 0)
    return moves


def test_a_move_needs_evidence_in_a_row_and_waits_its_turn(monkeypatch):
    pattern = [True] * (EVIDENCE - 1) + [False] + [True] * EVIDENCE + [True] * EVIDENCE
    moves = _late_yields(monkeypatch, list(pattern))
    shared = SharedCpu()
    for _ in range(EVIDENCE):  # one prompt yield breaks the run: no move
        shared.yield_cpu()
    assert moves == [] and shared.late == 0
    for _ in range(EVIDENCE):
        shared.yield_cpu()
    assert moves == [1] and shared.moves == 1
    for _ in range(EVIDENCE):  # evidence again, but within MOVE_EVERY_S of the move
        shared.yield_cpu()
    assert moves == [1]
    shared.moved_at -= MOVE_EVERY_S
    _late_yields(monkeypatch, [True])
    shared.late = EVIDENCE - 1
    shared.yield_cpu()
    assert shared.moves == 2


@needs_two
def test_a_move_changes_the_cpu_and_keeps_the_mask():
    left = placement.move_off_this_cpu()
    assert left is not None and left in ALLOWED
    assert placement._getcpu() != left
    assert os.sched_getaffinity(0) == ALLOWED


def test_a_wake_from_this_cpu_makes_the_next_late_yield_a_move(monkeypatch):
    """The wake-up is the evidence: one late yield after it moves, even just after a move."""
    moves = _late_yields(monkeypatch, [True])
    monkeypatch.setattr(placement, "this_cpu", lambda: 3)
    shared = SharedCpu()
    shared.moved_at = time.perf_counter()  # a move just now: the yields' evidence would wait
    shared.woken_from(3)
    assert moves == []  # not at once: the call that woke it would wait for the move
    shared.yield_cpu()
    assert moves == [1] and shared.moves == 1


def test_a_wake_from_elsewhere_or_a_prompt_yield_makes_no_move(monkeypatch):
    moves = _late_yields(monkeypatch, [True, False, True])
    monkeypatch.setattr(placement, "this_cpu", lambda: 3)
    shared = SharedCpu()
    for cpu in (2, 4, -1):  # another CPU's wake-up, or one that names none
        shared.woken_from(cpu)
    shared.yield_cpu()
    assert moves == [] and shared.late == 1
    shared.woken_from(3)
    shared.yield_cpu()  # prompt: nobody else runs here after all
    shared.yield_cpu()
    assert moves == [] and shared.late == 1


def test_the_wake_up_names_the_ringing_cpu_and_the_receiver_reads_it(monkeypatch):
    """Doorbell.ring sends its CPU; the receiver takes the last one named (a datagram of
    another length, as an older peer's, names none) and tells its placement."""
    monkeypatch.setattr(placement, "_getcpu", lambda: 7)  # the ringer's CPU, as the kernel says
    buf = mmap.mmap(-1, 4096)
    mem = AtomicMemory(buf)
    address = f"\0cxlrpc-test-placement-{os.getpid()}".encode()
    receiver = DoorbellReceiver(mem.counter(0), address)
    seen: list[int] = []

    class Placement:  # what the receiver tells its placement
        woken_from = staticmethod(seen.append)

    receiver.shared_cpu = Placement()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        bell = Doorbell(mem.counter(0), address)
        mem.counter(0).store(bell.me, SEQ_CST)  # the consumer parked on this host
        bell.ring()
        assert mem.counter(0).load(SEQ_CST) == 0
        assert receiver._drain() == 7
        sender.sendto(wake_datagram(5), address)
        sender.sendto(b"\x01", address)  # names no CPU: the last one that did counts
        assert receiver._drain() == 5
        assert receiver._drain() == -1  # nothing queued

        receiver._loop = asyncio.new_event_loop()
        try:  # the loop's reader callback: placement told before the waiting task is woken
            receiver._waiter = receiver._loop.create_future()
            sender.sendto(wake_datagram(3), address)
            receiver._on_readable()
            assert seen == [3] and receiver._waiter.done()
        finally:
            receiver._loop.close()
    finally:
        sender.close()
        receiver._loop = None
        receiver.close()
        mem.close()
        buf.close()
