"""cxlrpc and kvservice between two QEMU guests (two kernels) sharing only ivshmem memory.

Device 0 (64 MiB) is the RPC region, device 1 (64 MiB) the kvservice pool; every guest gets
both, in that order. Guest A serves (``guest_peer.py server``); guest B is the client
(``guest_peer.py client``): (a) the RPC contract, (b) 10,000 verified echoes, (c) calls after
idle periods, (d) kvservice values written in one guest and read zero-copy in the other, both
ways; then (e) B is killed mid-traffic and the host times, through the backing file, how long
the server takes to reclaim B's slot; (f) a new client guest B2 calls in a loop while A is
killed and measures how long ``Unavailable`` takes. At most two guests run at once.

The whole scenario runs once per coherence mode (module fixture: "hardware", and "flush", the
single-writer layout with write-backs and invalidates); each test asserts one part of it. The
figures are printed (a line starting ``GUEST-FIGURES ``) and saved as JSON beside
$CXLRPC_GUEST_FIGURES (default /tmp/cxlrpc-guest-figures-MODE.json).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import pytest

from cxlrpc.channel import read_geometry
from cxlrpc.memory import ACQUIRE
from cxlrpc.region import Region
from guest_vm import Guest, GuestError, GuestImage

pytestmark = [pytest.mark.guests, pytest.mark.timeout(900)]

SHM_SIZE = 64 << 20
BOOT_TIMEOUT = 120.0  # boot + Python imports under TCG
PEER = Path(__file__).resolve().parent / "guest_peer.py"
FIGURES = Path(os.environ.get("CXLRPC_GUEST_FIGURES",
                             Path(tempfile.gettempdir()) / "cxlrpc-guest-figures.json"))


def _host_write_json(guest: Guest, name: str, data: Any) -> None:
    """Hand a file to a guest through its share, atomically (temporary name, then rename)."""
    tmp = guest.out / f".{name}.host.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, guest.out / name)


def _read_json(guest: Guest, name: str, timeout: float) -> Any:
    return json.loads(guest.wait_file(name, timeout))


def _evidence(guests: list[Guest]) -> str:
    """Stack dumps, error reports and stderr tails the guests left in their shares."""
    parts = []
    for g in guests:
        for f in sorted(g.out.glob("stack-*.txt")) + sorted(g.out.glob("error-*.json")) + sorted(
            g.out.glob("loop-error.json")
        ):
            parts.append(f"--- {g.name}: {f.name} ---\n{f.read_text(errors='replace')[-4000:]}")
        for f in ("stderr", "stdout"):
            p = g.out / f
            if p.exists() and p.stat().st_size:
                parts.append(f"--- {g.name}: {f} ---\n{p.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


class SlotTable:
    """The host's read-only look at the RPC region's slot table, through the backing file."""

    def __init__(self, backing: Path) -> None:
        self.region = Region.open(f"file://{backing}")
        self.geo = read_geometry(self.region)

    def claimed(self) -> list[int]:
        """Slots a client holds (flush mode: a grant naming a knock; a slot reaped from a
        stale heartbeat reads held by nobody, nonce 0, until its holder is fenced)."""
        words = [self.word(i) for i in range(self.geo.slots)]
        return [i for i, w in enumerate(words) if w & 1 and (not self.geo.per_client_requests or w >> 32)]

    def word(self, slot: int) -> int:
        """A slot's state word (flush mode: the server's grant word, same held bit)."""
        self.region.mem.invalidate(self.geo.slot(slot), 8)  # the host reads as one more peer
        return self.region.mem.load(self.geo.slot(slot), ACQUIRE)

    def request_tail(self) -> int:
        """Bytes of requests sent so far: the shared ring's tail, or (flush mode: a request
        ring per client) the sum of the clients' tails."""
        mem, geo = self.region.mem, self.geo
        if not geo.per_client_requests:
            return mem.load(geo.request_ring, ACQUIRE)
        rings = [geo.client_request_ring(i) for i in range(geo.slots)]
        for at in rings:
            mem.invalidate(at, 8)
        return sum(mem.load(at, ACQUIRE) for at in rings)

    def close(self) -> None:
        self.region.close()


def _until(cond, timeout: float, interval: float = 0.001) -> float | None:
    """Poll ``cond`` until true; seconds it took, or None after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(interval)
    return time.monotonic() - t0


def _run_scenario(image: GuestImage, shm: list[Path], log: dict[str, Any], coherence: str) -> None:
    guests: list[Guest] = []
    with ExitStack() as stack:
        def guest(name: str, script: str) -> Guest:
            g = stack.enter_context(Guest(image, name, shm, mem_mb=512, smp=1))
            guests.append(g)
            env = {"CXLRPC_GUEST_COHERENCE": coherence}
            knob = "CXLRPC_GUEST_POLL_INTERVAL"
            if knob in os.environ:
                env[knob] = os.environ[knob]
            g.start(script, env)
            return g

        try:
            t0 = time.monotonic()
            a = guest("srv-a", f'python "{PEER}" server &\npython "{PEER}" kvpeer\nwait')
            log["server_ready"] = _read_json(a, "ready", BOOT_TIMEOUT)
            log["server_ready"]["host_s_to_ready"] = round(time.monotonic() - t0, 2)

            t0 = time.monotonic()
            b = guest("cli-b", f'exec python "{PEER}" client')
            kv_put = _read_json(b, "kv-put.json", BOOT_TIMEOUT + 600)
            log["host_s_boot_to_kv_put"] = round(time.monotonic() - t0, 2)
            assert "error" not in kv_put, kv_put["error"]
            _host_write_json(a, "kv-request.json", kv_put)
            log["kv_a"] = kv_a = _read_json(a, "kv-a.json", 120)
            _host_write_json(b, "kv-from-a.json", kv_a["put"])
            b.wait_file("looping", 120)
            log["phases"] = json.loads((b.out / "phases.json").read_text())

            # (e) kill the client guest mid-traffic; time the reclaim of its slot from the host
            slots = SlotTable(shm[0])
            stack.callback(slots.close)
            e: dict[str, Any] = {}
            log["e_client_kill"] = e
            # B's kv client closed just before ``looping``: in flush mode its release is seen
            # at the server's next housekeeping round (~0.1 s), so let the table settle first
            took = _until(lambda: len(slots.claimed()) <= 1, 3, 0.01)
            e["s_for_closed_clients_to_leave"] = None if took is None else round(took, 4)
            e["claimed_before"] = claimed = slots.claimed()
            tail = slots.request_tail()
            # mid-traffic: B keeps pushing requests (the ring tail, a byte counter, advances 8 KiB)
            took = _until(lambda: slots.request_tail() - tail >= 8192, 10)
            e["s_for_8KiB_of_requests_before_kill"] = None if took is None else round(took, 4)
            loop_error = b.out / "loop-error.json"
            e["loop_error"] = loop_error.read_text() if loop_error.exists() else None
            words = {i: slots.word(i) for i in claimed}
            t_kill = time.monotonic()
            b.kill()
            e["kill_s"] = round(time.monotonic() - t_kill, 4)
            took = _until(lambda: all(slots.word(i) != w for i, w in words.items()), 10)
            e["slot_reclaim_s"] = None if took is None else round(took, 4)
            e["claimed_after"] = slots.claimed()
            e["words_before"] = {i: f"{w:#x}" for i, w in words.items()}
            e["words_after"] = {i: f"{slots.word(i):#x}" for i in words}
            e["server_saw"] = None
            departures = a.out / "disconnects.json"  # the server's on_disconnect log

            def server_saw() -> bool:
                return departures.exists() and any(
                    d["slot"] in words for d in json.loads(departures.read_text()))

            if _until(server_saw, 5, 0.02) is not None:
                e["server_saw"] = json.loads(departures.read_text())

            # (f) a new client guest calls in a loop while the server guest is killed
            b2 = guest("cli-b2", f'exec python "{PEER}" client2')
            f: dict[str, Any] = {}
            log["f_server_kill"] = f
            f["before"] = _read_json(b2, "looping", BOOT_TIMEOUT)
            tail = slots.request_tail()
            f["traffic_before_kill"] = (
                _until(lambda: slots.request_tail() - tail >= 8192, 10) is not None)
            t_kill = time.monotonic()
            a.kill()
            result = _read_json(b2, "result.json", 60)
            f["host_s_kill_to_result_file"] = round(time.monotonic() - t_kill, 4)
            f.update(result)
            rc, _, err = b2.wait(60)
            f["client_rc"], f["client_stderr"] = rc, err[-2000:]
        except (GuestError, AssertionError, OSError, ValueError) as exc:
            log["error"] = f"{type(exc).__name__}: {exc}\n{_evidence(guests)}"
        finally:
            # a watchdog file with content means a phase overran its budget: keep the stacks
            log["stacks"] = {f"{g.name}/{p.name}": p.read_text(errors="replace")[-4000:]
                             for g in guests for p in g.out.glob("stack-*.txt") if p.stat().st_size}


def _figures(log: dict[str, Any]) -> dict[str, Any]:
    ph = log.get("phases", {})
    b = ph.get("b_echo", {})
    kv_a, kv_b = log.get("kv_a", {}), ph.get("d_kv", {})
    return {
        "connect_ms": ph.get("connect_ms"),
        "busy_64B": b.get("sequential_64B"),
        "busy_64B_busy_spin_client": b.get("sequential_64B_busy_spin_client"),
        "tcg_slowdown_x": log.get("tcg_slowdown_x"),
        "gather8_calls_per_s": b.get("gather8_calls_per_s"),
        "echo_wrong_lost_dup_missing": [b.get(k) for k in ("wrong", "lost", "duplicated", "missing")],
        "after_idle_ms": [(c["idle_s"], c["latency_ms"]) for c in ph.get("c_idle", {}).get("calls", [])],
        "after_0.3s_idle_x30": ph.get("c_idle", {}).get("after_0.3s_idle_x30"),
        "server_loop_1ms_sleep": ph.get("c_idle", {}).get("server_1ms_sleep"),
        "host_loadavg": log.get("host_loadavg"),
        "server_poll_interval_s": log.get("server_ready", {}).get("poll_interval"),
        "kv_B_to_A_ok": kv_a.get("read", {}).get("ok"),
        "kv_A_to_B_ok": kv_b.get("read", {}).get("ok"),
        "kv_zero_copy": [kv_a.get("read", {}).get("zero_copy"), kv_b.get("read", {}).get("zero_copy")],
        "kv_put_1MiB_ms": [kv_b.get("put_ms"), kv_a.get("put_ms")],
        "kv_get_ms": [kv_a.get("get_ms"), kv_b.get("get_ms")],
        "slot_reclaim_s": log.get("e_client_kill", {}).get("slot_reclaim_s"),
        "server_death_detect_s": log.get("f_server_kill", {}).get("detect_s"),
        "server_death_outcome": log.get("f_server_kill", {}).get("outcome"),
        "scenario_s": log.get("scenario_s"),
    }


def _table(fig: dict[str, Any]) -> str:
    def pct(name: str, *keys: str) -> str:
        d = fig.get(name) or {}
        return " / ".join(str(d.get(k)) for k in keys)

    rows = [
        ("busy 64 B echo p50 / p99 / max (ms)",
         f"{pct('busy_64B', 'p50_ms', 'p99_ms', 'max_ms')} (n={(fig['busy_64B'] or {}).get('n')})"),
        ("  same, busy-spinning client p50 / p99 (ms)",
         pct("busy_64B_busy_spin_client", "p50_ms", "p99_ms")),
        ("TCG slowdown of pure Python (guest / host)", fig["tcg_slowdown_x"]),
        ("gather-of-8 echo throughput (calls/s)", fig["gather8_calls_per_s"]),
        ("echo wrong / lost / duplicated / missing", fig["echo_wrong_lost_dup_missing"]),
        ("connect (ms)", fig["connect_ms"]),
        ("call after idle (idle s, ms)", fig["after_idle_ms"]),
        ("30 calls after 0.3 s idle p50 / max (ms)", pct("after_0.3s_idle_x30", "p50_ms", "max_ms")),
        ("server loop's asyncio.sleep(1 ms) p50 / max (ms)",
         pct("server_loop_1ms_sleep", "p50_ms", "max_ms")),
        ("server poll_interval (s)", fig["server_poll_interval_s"]),
        ("host load average (1 min) before / after", fig["host_loadavg"]),
        ("kv 1 MiB B->A / A->B checksum ok", f"{fig['kv_B_to_A_ok']} / {fig['kv_A_to_B_ok']}"),
        ("kv read zero-copy (A, B)", fig["kv_zero_copy"]),
        ("kv put 1 MiB (ms, B / A)", fig["kv_put_1MiB_ms"]),
        ("kv get lease (ms, A / B)", fig["kv_get_ms"]),
        ("killed client's slot reclaimed after (s)", fig["slot_reclaim_s"]),
        ("killed server seen by client after (s)",
         f"{fig['server_death_detect_s']} ({fig['server_death_outcome']})"),
        ("whole scenario (s)", fig["scenario_s"]),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@pytest.fixture(scope="module", params=["hardware", "flush"])
def scenario(image: GuestImage, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The whole scenario, once per coherence mode of the server (clients learn it from the
    region): "flush" runs the single-writer layout with write-backs and invalidates."""
    coherence = request.param
    shm: list[Path] = []
    log: dict[str, Any] = {"coherence": coherence}
    try:
        for i in range(2):
            path = Path(f"/dev/shm/cxlrpc-guests-rpc-{os.getpid()}-{i}")
            with open(path, "xb") as f:
                f.truncate(SHM_SIZE)
            shm.append(path)
        t0 = time.monotonic()
        load = os.getloadavg()[0]
        _run_scenario(image, shm, log, coherence)
        log["host_loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        guest_loop = log.get("phases", {}).get("calibrate_s")
        if guest_loop:
            from guest_peer import calibrate

            log["tcg_slowdown_x"] = round(guest_loop / min(calibrate() for _ in range(3)), 1)
        log["scenario_s"] = round(time.monotonic() - t0, 1)
    finally:
        for path in shm:
            path.unlink(missing_ok=True)
    fig = _figures(log)
    figures = FIGURES.with_name(f"{FIGURES.stem}-{coherence}{FIGURES.suffix}")
    try:
        figures.write_text(json.dumps({"figures": fig, "raw": log}, indent=1, default=str))
    except OSError:
        pass
    text = f"\n{coherence}:\n{_table(fig)}\nGUEST-FIGURES {json.dumps(fig)}\n(raw log: {figures})"
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(text)
    else:
        print(text)
    yield log


def _ok(log: dict[str, Any]) -> None:
    assert "error" not in log, log["error"]


def test_rpc_contract_across_guests(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    a = scenario["phases"]["a_contract"]
    assert "error" not in a, a["error"]
    failed = {k: v for k, v in a.items() if not v["ok"]}
    assert not failed, failed
    assert scenario["phases"]["connect_ms"] < 2000


def test_ten_thousand_echoes_each_verified(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    b = scenario["phases"]["b_echo"]
    assert "error" not in b, b["error"]
    assert (b["wrong"], b["lost"], b["duplicated"], b["missing"]) == (0, 0, 0, 0), b
    assert b["calls"] == 10_000
    # TCG runs guest Python ~20-50x slower than the host; 100 ms would mean a stuck doorbell.
    # On a loaded host (TCG 27-31x) flush mode's p50 was 6-10 ms (p10 1.8 ms), in runs where
    # the server guest's 1 ms sleep (measured in phase c) took 3-4 ms at p50, 10-16 at p90
    wake = scenario["phases"].get("c_idle", {}).get("server_1ms_sleep") or {"p90_ms": 0.0}
    bound = max(20.0, wake["p90_ms"] + 20)
    assert b["sequential_64B"]["p50_ms"] < bound, (b["sequential_64B"], wake)


def test_call_after_idle_is_not_slow(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    c = scenario["phases"]["c_idle"]
    assert "error" not in c, c["error"]
    assert all(row["ok"] for row in c["calls"]), c["calls"]
    # A call after idle finds the server parked: it costs a busy call plus one of the server's
    # poll steps, a 1 ms sleep whose length in this guest the run measures (TCG's timers: 1-4 ms
    # at p50, 30-80 ms at worst on a loaded host, where single busy calls reach 100 ms too).
    # A lost wake-up costs up to the server's 0.1 s wait on top: systematic ones move the
    # median by ~50 ms, frequent ones (a fifth of the calls) the p90 past the run's noise; a
    # single one is told from the host's stalls only when it lasts longer than any of them.
    # The bounds never go below the fixed ones of a quiet host.
    busy = scenario["phases"]["b_echo"]["sequential_64B"]
    wake = c["server_1ms_sleep"]
    idle = c["after_0.3s_idle_x30"]
    median_bound = max(15.0, busy["p50_ms"] + wake["p90_ms"] + 20)
    assert idle["p50_ms"] < median_bound, (idle, busy, wake, median_bound)
    tail_bound = max(30.0, busy["p90_ms"] + wake["p99_ms"] + 25)
    slow = [row for row in c["calls"] if row["latency_ms"] >= tail_bound]
    assert idle["p90_ms"] < tail_bound and len(slow) <= 1, (idle, slow, busy, wake, tail_bound)
    worst_bound = max(75.0, busy["max_ms"] + wake["max_ms"] + 25)
    worst = max([row["latency_ms"] for row in c["calls"]] + [idle["max_ms"]])
    assert worst < worst_bound, (c["calls"], idle, busy, wake, worst_bound)


def test_kv_values_cross_guests_zero_copy(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    kv_b = scenario["phases"]["d_kv"]
    kv_a = scenario["kv_a"]
    assert "error" not in kv_b, kv_b["error"]
    assert kv_a["read"]["ok"] and kv_a["read"]["zero_copy"], kv_a  # B's value read in A
    assert kv_a["exists_b"] is True
    assert kv_b["own_read_ok"]
    assert kv_b["read"]["ok"] and kv_b["read"]["zero_copy"], kv_b  # A's value read in B
    assert kv_b["missing_key_raises"]


def test_killed_client_guest_slot_is_reclaimed(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    e = scenario["e_client_kill"]
    assert e["loop_error"] is None, e["loop_error"]
    assert len(e["claimed_before"]) == 1, e  # only B's looping client holds a slot
    assert e["s_for_8KiB_of_requests_before_kill"] is not None, e  # killed mid-traffic
    # client_timeout is 1 s (heartbeats every 0.1 s, housekeeping every 0.1 s)
    assert e["slot_reclaim_s"] is not None and e["slot_reclaim_s"] < 3.0, e
    assert e["claimed_after"] == [], e
    assert e["server_saw"] is not None, "the server never reported the departure (on_disconnect)"


def test_killed_server_guest_is_unavailable_within_2s(scenario: dict[str, Any]) -> None:
    _ok(scenario)
    f = scenario["f_server_kill"]
    assert f["before"]["echo_1000_wrong"] == 0, f  # the server still serves after (e)
    assert f["traffic_before_kill"], f
    assert f["outcome"] == "Unavailable", f
    assert f["detect_s"] < 2.0, f
    assert f["client_rc"] == 0, f["client_stderr"]
