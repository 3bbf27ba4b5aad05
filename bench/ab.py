"""Two checkouts side by side in alternated rounds: the runner behind ``pool_ab.py`` and
``hot_ab.py`` (each round runs a child of this machine's Python, once per checkout, the order
alternating, with that checkout first on ``PYTHONPATH``; its last output line is JSON
``{op: [ns, ...]}``). The table: per checkout, the median across rounds of each round's p50 and
p99, and B/A."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np


def _pct(samples: list[int], q: float) -> float:
    return float(np.percentile(np.array(samples) / 1e3, q))


def _round(script: str, tree: str, args: Sequence[str], timeout: float) -> dict[str, list[int]]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, script, *args], cwd=tree, env=env, check=True,
                         capture_output=True, text=True, timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(script: str, trees: dict[str, str], rounds: int, args: Sequence[str],
              timeout: float = 300.0) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Run ``script ARGS`` from each tree ``rounds`` times, alternating which goes first:
    per tree, per op, each round's (p50, p99) in us (an op ending in "faults": median, max)."""
    per: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k in trees}
    order = list(trees)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            for op, samples in _round(script, trees[k], args, timeout).items():
                figure = ((statistics.median(samples), max(samples)) if op.endswith("faults")
                          else (_pct(samples, 50), _pct(samples, 99)))
                per[k].setdefault(op, []).append(figure)
            print(f"round {r + 1}/{rounds} {k} done", file=sys.stderr, flush=True)
    return per


def table(per: dict[str, dict[str, list[tuple[float, float]]]], trees: dict[str, str],
          rounds: int, ops: Sequence[str]) -> str:
    """The A/B table: medians across rounds of p50 and p99, and B/A."""
    lines = [f"A = {trees['A']}", f"B = {trees['B']}",
             f"{rounds} rounds, medians of per-round figures (us; faults: count)",
             f"{'op':<20} {'A p50':>9} {'B p50':>9} {'B/A':>6} | {'A p99':>9} {'B p99':>9} {'B/A':>6}"]
    for op in ops:
        a50, a99 = (statistics.median(x) for x in zip(*per["A"][op]))
        b50, b99 = (statistics.median(x) for x in zip(*per["B"][op]))
        lines.append(f"{op:<20} {a50:>9.1f} {b50:>9.1f} {b50 / a50 if a50 else float('nan'):>6.2f} | "
                     f"{a99:>9.1f} {b99:>9.1f} {b99 / a99 if a99 else float('nan'):>6.2f}")
    return "\n".join(lines)


def cli(doc: str, script: str, child: Callable[[int], None], ops: Sequence[str], rounds: int,
        n_help: str) -> None:
    """The A/B scripts' command line: ``--a``/``--b`` checkouts, ``--rounds``, ``--n``; run as
    ``--child N`` inside a round, ``child(N)`` measures and prints its JSON line."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--a", help="checkout A (before)")
    parser.add_argument("--b", help="checkout B (after)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--n", type=int, default=300, help=n_help)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    trees = {"A": args.a, "B": args.b}
    per = alternate(script, trees, args.rounds, ["--child", str(args.n)])
    print(table(per, trees, args.rounds, ops))
