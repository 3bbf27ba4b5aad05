"""bench.flush (issue 42's acceptance measurement): a quick run makes the table's rows with both
modes timed and every reply verified, and the checks compare whole replies. Not the speed."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import flush

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["echo 64 B", "echo 4 KiB", "echo 64 KiB", "echo 1 MiB",
        "kv get 4 KiB", "kv get_into 4 KiB", "kv get 64 KiB", "kv get_into 64 KiB",
        "kv get 1 MiB", "kv get_into 1 MiB"]


def test_quick_run_times_both_modes_of_every_row_and_verifies_every_reply(tmp_path: Path) -> None:
    out = tmp_path / "flush.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "bench.flush", "--quick", "--rounds", "1", "--json", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the run stops its workers on SIGTERM
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, text
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"cxlrpc.bench-{proc.pid}-")]
    assert not leftovers, leftovers
    data = json.loads(out.read_text())
    assert [r["row"] for r in data["rows"]] == ROWS
    assert data["errors"] == {}
    for r in data["rows"]:
        modes = r["modes"]
        assert modes == ({"hardware": "cxl-aio", "flush": "cxl-aio-flush"} if r["op"] == "echo"
                         else {"hardware": "kv-shm", "flush": "kv-shm-flush"})
        for mode in modes.values():
            assert r["verified"][mode] >= r["timed_calls"][mode] > 0, (r["row"], mode)
            assert r["figures"][mode]["pooled"]["count"] == r["timed_calls"][mode]
        assert r["ratio_p50"] > 0 and math.isfinite(r["ratio_p50"])
        assert r["target"] == flush.TARGETS[(r["op"], r["size"])]
        line = next(line for line in text.splitlines() if line.startswith(f"│ {r['row']} "))
        assert ("PASS" if r["pass"] else "FAIL") in line, line


class _Lent:
    """A leased block of a fake kv client: its view, and whether it was released."""

    def __init__(self, data: bytes) -> None:
        self.data, self.released = memoryview(data), False

    def view(self) -> memoryview:
        return self.data

    def release(self) -> None:
        self.released = True


class _FakeKV:
    """A kv client whose ``bad``-th read returns the right value with one byte changed midway."""

    def __init__(self, size: int, bad: int) -> None:
        self.values = {flush.kv_key(size, j): flush.value(size, j) for j in range(flush.VALUES)}
        self.reads, self.bad, self.blocks = 0, bad, []

    def _read(self, key: str) -> bytes:
        self.reads += 1
        data = bytearray(self.values[key])
        if self.reads == self.bad:
            data[len(data) // 2] ^= 1
        return bytes(data)

    async def get(self, key: str) -> _Lent:
        self.blocks.append(_Lent(self._read(key)))
        return self.blocks[-1]

    async def get_into(self, key: str, out: Any) -> int:
        data = self._read(key)
        memoryview(out)[:len(data)] = data
        return len(data)


@pytest.mark.parametrize("op", ["echo", "get", "get_into"])
def test_a_reply_wrong_in_one_byte_midway_fails_its_check(op: str) -> None:
    """The checks compare whole replies (the main bench's first-call check reads the ends only)."""
    size, bad = 64 << 10, 3
    kv = _FakeKV(size, bad)
    if op == "echo":
        async def echo(payload: bytes) -> bytes:
            return kv._read(next(k for k, v in kv.values.items() if v == payload))
        step = flush.echo_step(echo, size)
    else:
        step = flush.kv_step(kv, op, size)

    async def run() -> None:
        for _ in range(bad - 1):
            assert await step() >= 0
        with pytest.raises(AssertionError, match="not the 65536 bytes expected"):
            await step()

    asyncio.run(run())
    if op == "get":
        assert [b.released for b in kv.blocks] == [True] * (bad - 1) + [False]


def test_the_main_bench_table_pairs_each_flush_row_with_its_hardware_twin() -> None:
    """``python -m bench`` derives the table from its echo and kv sections' rows (their JSON)."""
    def fig(*p50s: float) -> dict:
        return {"rounds": [{"p50": v, "p99": 2 * v} for v in p50s], "median": {"p50": p50s[0], "p99": 2 * p50s[0]}}

    data = {"echo": {"transports": {"cxl-aio": {"sizes": {"64": fig(2.0, 2.0)}},
                                    "cxl-aio-flush": {"sizes": {"64": fig(5.0, 7.0)}},
                                    "grpc-aio-tcp": {"sizes": {"64": fig(90.0, 90.0)}}}},
            "kv": {"ops": {"backends": {"kv-shm": {"items": {"get_into:65536": fig(4.0)}},
                                        "kv-shm-flush": {"items": {"get_into:65536": fig(10.0)}}}}}}
    rows = {r["row"]: r for r in flush.from_bench(data)}
    assert sorted(rows) == ["echo 64 B", "kv get_into 64 KiB"]
    echo, kv = rows["echo 64 B"], rows["kv get_into 64 KiB"]
    assert (echo["ratio_p50"], echo["round_ratios"], echo["pass"]) == (2.5, [2.5, 3.5], True)
    assert (kv["ratio_p50"], kv["round_ratios"], kv["pass"]) == (2.5, [2.5], False)
    assert echo["verified"] is None
