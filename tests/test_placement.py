"""Pollers that find their CPU shared move off it (cxlrpc.doorbell.placement): the evidence
is counted yield by yield, and a move changes the thread's CPU but not its affinity mask.
(What the kernel does to a client and server after a sync wake-up could not be made on purpose
here: pinned peers are separated by the balancer as soon as they are let go. Its effect is
measured in the benchmark's idle section: the p50 of calls right after idle periods.)"""
from __future__ import annotations

import os
import time

import pytest

from cxlrpc.doorbell import placement
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
