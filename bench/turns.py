"""Rows measured side by side: every row's server and client live for a round, and each timed
unit (a payload, a kv operation) runs in short blocks that take turns with the other rows'.

This VM's cross-core transfers change level for seconds at a time (``python -m bench.drift``:
the host moves its vCPUs), so rows measured one after another saw different machines; with
turns, every row sees the same spells. A row is "sleep" (its idle peers take no CPU), "pause"
(they busy-poll and keep no heartbeats: SIGSTOPped between turns) or "solo" (they busy-poll
and beat heartbeats a pause would stop: measured alone, after the others).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

import numpy as np

from .procs import Worker, WorkerError

#: Blocks per timed unit, row and round: short enough that a spell of seconds falls on every
#: row's blocks alike (with 6, one row's round could take 2 slow blocks and the next row's 4:
#: 64 B p50 1.1 against 1.6 us, the same code), and few enough that settling stays cheap.
BLOCKS = 16
#: Blocks in a --quick run.
QUICK_BLOCKS = 3
#: Before a block's warm-up calls, its client makes small calls for this long: peers that
#: slept through other rows' turns wake, and a server the kernel woke on its client's CPU is
#: moved off it (cxlrpc.doorbell.placement) before anything is timed.
SETTLE_NS = 10_000_000


class Pair:
    """A row's server and client workers (both started), timed a block at a time. The client
    answers ``("block", unit, calls, warm-up)`` with ``("block", (samples_ns, wall_ns))``."""

    def __init__(self, key: str, idle: str, server: Worker, client: Worker) -> None:
        self.key, self.idle, self.server, self.client = key, idle, server, client
        self._rest()

    @classmethod
    def started(cls, key: str, idle: str, server: Worker, client: Worker, timeout: float) -> "Pair":
        """Start ``client`` (``server`` is up) and pair them; both are stopped if that fails."""
        try:
            client.start(timeout=timeout)
            return cls(key, idle, server, client)
        except BaseException:
            client.stop()
            server.stop()
            raise

    def block(self, unit: Hashable, n: int, warm: int) -> tuple[np.ndarray, int]:
        """``warm`` untimed calls then ``n`` timed ones of ``unit``."""
        for w in (self.server, self.client):
            w.resume()
        try:
            self.client.send("block", unit, n, warm)
            return self.client.expect("block", 120 + (n + warm) * 0.05)
        finally:
            self._rest()

    def _rest(self) -> None:
        if self.idle == "pause":
            for w in (self.server, self.client):
                w.pause()

    def stop(self) -> None:
        """End both processes (a paused one is resumed first)."""
        for w in (self.client, self.server):
            w.stop()


def split(n: int, warm: int, k: int) -> list[tuple[int, int]]:
    """``n`` timed calls in ``k`` blocks of (timed, warm-up): the first block warms as planned,
    the others (after the peers idled through other rows' turns) with a few calls."""
    k = max(1, min(k, n))
    return [(n // k + (i < n % k), warm if i == 0 else max(3, warm // k)) for i in range(k)]


def _round(pairs: list[Pair], plan: list[tuple[Hashable, int, int]], blocks: int, turn: int,
           on_block: Callable[[], None], on_error: Callable[[str, WorkerError], None]) -> dict:
    """One round: each unit in ``blocks`` turns of every pair (order rotated each turn,
    reversed every other); ``{key: {unit: (samples, wall)}}`` of the pairs that did not fail."""
    got: dict[str, dict[Hashable, list]] = {p.key: {} for p in pairs}
    live = list(pairs)
    for unit, n, warm in plan:
        for b, (nb, wb) in enumerate(split(n, warm, blocks)):
            k = (turn + b) % max(1, len(live))
            order = live[k:] + live[:k]
            if b % 2:
                order.reverse()
            for pair in order:
                try:
                    got[pair.key].setdefault(unit, []).append(pair.block(unit, nb, wb))
                except WorkerError as exc:
                    live.remove(pair)
                    del got[pair.key]
                    pair.stop()
                    on_error(pair.key, exc)
                on_block()
    return {key: {u: (np.concatenate([a for a, _ in parts]), sum(w for _, w in parts))
                  for u, parts in units.items()} for key, units in got.items()}


def run_rounds(rows: list[Any], start: Callable[[Any], Pair], plan: list[tuple[Hashable, int, int]],
               rounds: int, blocks: int, progress: Any, name: str,
               failed: Callable[[str, int, WorkerError], None]) -> dict[str, dict[Hashable, list]]:
    """``rounds`` rounds of ``rows`` (each with ``key`` and ``idle``; ``start(row)`` makes its
    pair): ``{key: {unit: [(samples, wall) of each round]}}``."""
    per_round = sum(len(split(n, w, blocks)) for _, n, w in plan)
    task = progress.add_task(name, total=rounds * len(rows) * per_round)
    groups = [[r for r in rows if r.idle != "solo"]] + [[r] for r in rows if r.idle == "solo"]
    raw: dict[str, dict[Hashable, list]] = {r.key: {u: [] for u, _, _ in plan} for r in rows}
    done = 0
    for rnd in range(rounds):
        for group in groups:
            progress.update(task, description=f"{name} r{rnd + 1}/{rounds} {'+'.join(r.key for r in group)}")
            pairs: list[Pair] = []
            try:
                for row in group:
                    try:
                        pairs.append(start(row))
                    except WorkerError as exc:
                        failed(row.key, rnd, exc)
                got = _round(pairs, plan, blocks, rnd, lambda: progress.advance(task),
                             lambda key, exc: failed(key, rnd, exc))
            finally:
                for pair in pairs:
                    pair.stop()
            done += len(group) * per_round  # (a failed pair's blocks count as done)
            progress.update(task, completed=done)
            for key, units in got.items():
                for unit, res in units.items():
                    raw[key][unit].append(res)
    return raw
