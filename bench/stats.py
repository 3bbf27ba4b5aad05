"""Percentiles and summaries of latency samples (int64 nanoseconds from time.perf_counter_ns)."""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

import numpy as np

#: Percentiles recorded for every sample set (the tables show p50, p99 and p99.9).
PERCENTILES: tuple[float, ...] = (0.0, 1.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9, 99.99, 100.0)


def pkey(p: float) -> str:
    """JSON key of a percentile: 50 -> "p50", 99.9 -> "p99.9", 0 -> "min", 100 -> "max"."""
    if p == 0.0:
        return "min"
    if p == 100.0:
        return "max"
    return "p" + (f"{p:g}")


def summarize(samples_ns: np.ndarray, wall_ns: int | None = None) -> dict[str, float]:
    """Percentiles (µs), mean (µs), count and calls/s of one sample set.

    ``calls_per_s`` uses ``wall_ns`` (the timed loop's wall time) when given, else the sum
    of the samples (exact for a closed loop with one call in flight).
    """
    a = np.asarray(samples_ns, dtype=np.int64)
    if a.size == 0:
        return {"count": 0}
    qs = np.percentile(a, PERCENTILES)
    out: dict[str, float] = {pkey(p): float(q) / 1e3 for p, q in zip(PERCENTILES, qs)}
    out["mean"] = float(a.mean()) / 1e3
    out["count"] = int(a.size)
    total = wall_ns if wall_ns else int(a.sum())
    out["calls_per_s"] = a.size / (total / 1e9) if total > 0 else float("nan")
    return out


def median_of(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key-by-key median of several per-round summaries (keys present in all rounds)."""
    if not rounds:
        return {}
    keys = set(rounds[0]).intersection(*rounds[1:])
    return {k: float(statistics.median(r[k] for r in rounds)) for k in sorted(keys)}


def change(ours: float, base: float) -> float:
    """Relative change ours/base - 1 (negative = lower than the baseline)."""
    if not base or base != base:
        return float("nan")
    return ours / base - 1.0


def cdf_points(samples_ns: np.ndarray, points: int = 400) -> tuple[list[float], list[float]]:
    """A down-sampled empirical CDF: (latency µs, cumulative fraction) pairs."""
    a = np.sort(np.asarray(samples_ns, dtype=np.int64))
    if a.size == 0:
        return [], []
    idx = np.unique(np.linspace(0, a.size - 1, min(points, a.size)).astype(np.int64))
    return [float(a[i]) / 1e3 for i in idx], [float((i + 1) / a.size) for i in idx]


def pooled(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """Concatenate sample arrays (e.g. every round's, or every client process's)."""
    arrs = [np.asarray(a, dtype=np.int64) for a in arrays]
    return np.concatenate(arrs) if arrs else np.empty(0, dtype=np.int64)
