"""Rich tables, the JSON file of raw figures, the environment record and the latency plot."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.table import Table

from .stats import change


def environment(loop: str) -> dict[str, Any]:
    """Versions, CPU model, core count and loop: what a reader needs to compare runs."""
    versions = {}
    for pkg in ("grpcio", "protobuf", "msgspec", "uvloop", "numpy", "pyzmq", "posix-ipc", "cxlrpc"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except Exception:
        commit = None
    return {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "versions": versions, "cpu_model": cpu, "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "kernel": platform.release(), "loop": loop,
            "loadavg_start": os.getloadavg(), "git_commit": commit,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def fmt_us(v: float | None) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def fmt_rate(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:,.0f}"


def fmt_change(ours: float | None, base: float | None, is_base: bool = False) -> str:
    """``-96.5%`` style change vs the baseline, coloured (green = lower latency)."""
    if is_base:
        return "[dim]baseline"
    if ours is None or base is None:
        return "-"
    c = change(ours, base)
    if c != c:
        return "-"
    colour = "green" if c < 0 else "red"
    return f"[{colour}]{c * 100:+.1f}%"


def size_label(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def echo_table(res: dict) -> Table:
    """Echo round trip: one section per payload; changes relative to the fastest gRPC variant, and
    of flush-mode rows relative to their hardware twin."""
    t = Table(title="Echo round trip (median of rounds; change vs fastest gRPC at that payload; "
                    "flush-mode rows vs their hardware twin)")
    for col in ("payload", "transport", "p50 µs", "p99 µs", "p99.9 µs", "calls/s", "p50 vs gRPC", "p99 vs gRPC",
                "p50 vs hw", "p99 vs hw"):
        t.add_column(col, justify="left" if col in ("payload", "transport") else "right")
    twins = _hardware_twins(res["transports"])
    for s in res["sizes"]:
        base = res["baseline"].get(str(s), {})
        rows = [(k, v) for k, v in res["transports"].items() if str(s) in v["sizes"]]
        for i, (k, v) in enumerate(rows):
            row = v["sizes"][str(s)]
            m, hw = row["median"], row.get("vs_hardware", {})
            b50, b99 = base.get("p50", {}), base.get("p99", {})
            t.add_row(size_label(s) if i == 0 else "", v["label"], fmt_us(m["p50"]), fmt_us(m["p99"]),
                      fmt_us(m["p99.9"]), fmt_rate(m["calls_per_s"]),
                      fmt_change(m["p50"], b50.get("us"), b50.get("transport") == k),
                      fmt_change(m["p99"], b99.get("us"), b99.get("transport") == k),
                      _vs_hardware(hw.get("p50"), k in twins), _vs_hardware(hw.get("p99"), k in twins))
        t.add_section()
    return t


def _hardware_twins(rows: dict[str, dict]) -> set[str]:
    """Keys of the rows some flush-mode row of ``rows`` is compared with."""
    return {v["hardware"] for v in rows.values() if v.get("hardware") in rows}


def _vs_hardware(c: float | None, is_twin: bool) -> str:
    """A flush-mode row's change vs its hardware twin; "baseline" on the twin, blank on other rows."""
    if is_twin:
        return "[dim]baseline"
    return "" if c is None else _pct(c)


def concurrency_table(res: dict) -> Table:
    """Concurrency: calls/s and latency per setting; ratios vs grpc.aio at the same setting."""
    t = Table(title=f"Concurrency, {res['payload']} B echo (median of rounds; vs grpc.aio TCP)")
    for col in ("in flight", "transport", "p50 µs", "p99 µs", "calls/s", "calls/s vs gRPC", "p99 vs gRPC"):
        t.add_column(col, justify="left" if col in ("in flight", "transport") else "right")
    grpc = next((v for v in res["transports"].values() if v["family"] == "grpc"), None)
    for s in res["settings"]:
        procs, k = s.split("x")
        label = f"{k} (1 process)" if procs == "1" else f"{procs} processes x {k}"
        first = True
        for key, v in res["transports"].items():
            m = v["settings"].get(s, {}).get("median")
            if not m:
                continue
            gm = grpc["settings"].get(s, {}).get("median") if grpc else None
            is_base = v is grpc
            ratio = "[dim]baseline" if is_base else (f"[green]{m['calls_per_s'] / gm['calls_per_s']:.1f}x"
                                                     if gm else "-")
            t.add_row(label if first else "", v["label"], fmt_us(m["p50"]), fmt_us(m["p99"]),
                      fmt_rate(m["calls_per_s"]), ratio, fmt_change(m["p99"], gm and gm["p99"], is_base))
            first = False
        t.add_section()
    return t


def idle_table(res: dict) -> Table:
    """Idle: CPU of each process with no calls, the first call after idling, and the p99 of
    the 4 KiB burst after it."""
    t = Table(title=f"Idle ({res['cpu_window_s']:.0f} s CPU window; first call after {res['idle_s']:.0f} s idle, "
                    f"then {res['burst']} calls of 4 KiB; medians)")
    for col in ("transport", "server CPU %", "client CPU %", "first call µs", "busy p50 µs", "first call vs gRPC",
                "4 KiB burst p99 µs", "burst p99 vs gRPC"):
        t.add_column(col, justify="left" if col == "transport" else "right")
    grpc = next((v for v in res["transports"].values() if v["family"] == "grpc"), None)
    for v in res["transports"].values():
        m = v["median"]
        g = grpc["median"]["first_call_us"] if grpc else None
        gb = grpc["median"]["burst_p99_us"] if grpc else None
        t.add_row(v["label"], f"{m['server_cpu_pct']:.1f}", f"{m['client_cpu_pct']:.1f}", fmt_us(m["first_call_us"]),
                  fmt_us(m["busy_p50_us"]), fmt_change(m["first_call_us"], g, v is grpc),
                  fmt_us(m["burst_p99_us"]), fmt_change(m["burst_p99_us"], gb, v is grpc))
    return t


def save_json(path: Path, data: dict) -> None:
    """Write the results file atomically (a partial run still leaves valid JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)


def plot(path: Path, echo: dict) -> None:
    """p50 (solid) and p99 (dashed) by payload, log scales; and the CDF of 64 B latencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (k, v) in enumerate(echo["transports"].items()):
        sizes = [int(s) for s in v["sizes"]]
        if not sizes:
            continue
        c = colours[i % len(colours)]
        ax1.plot(sizes, [v["sizes"][str(s)]["median"]["p50"] for s in sizes], "o-", color=c, label=f"{v['label']} p50")
        ax1.plot(sizes, [v["sizes"][str(s)]["median"]["p99"] for s in sizes], "x--", color=c, alpha=0.6,
                 label=f"{v['label']} p99")
        cdf = echo["cdf_64"].get(k)
        if cdf:
            ax2.plot(cdf["us"], cdf["frac"], color=c, label=v["label"])
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(echo["sizes"], [size_label(s) for s in echo["sizes"]])
    ax1.set_xlabel("payload")
    ax1.set_ylabel("round trip (µs)")
    ax1.set_title("Echo latency by payload (solid p50, dashed p99)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=6.5, ncol=2, loc="upper left")
    ax2.set_xscale("log")
    ax2.set_xlabel("round trip (µs)")
    ax2.set_ylabel("fraction of calls")
    ax2.set_title("CDF of 64 B echo latency (all rounds)")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kv_tables(res: dict) -> Any:
    """The kv section: per-operation latency vs the gRPC twin, then the multi-pod replay."""
    from rich.console import Group

    parts: list[Any] = []
    ops = res.get("ops")
    if ops:
        t = Table(title="kvservice operations (median of rounds; change vs the gRPC twin; "
                        "flush-mode rows vs their hardware twin)")
        for col in ("op", "value", "backend", "p50 µs", "p99 µs", "calls/s", "p50 vs gRPC", "p99 vs gRPC",
                    "p50 vs hw", "p99 vs hw"):
            t.add_column(col, justify="left" if col in ("op", "value", "backend") else "right")
        base_key = ops["baseline"]
        twins = _hardware_twins(ops["backends"])
        for it in ops["items"]:
            first = True
            for key, v in ops["backends"].items():
                s = v["items"].get(it["id"])
                if not s:
                    continue
                m, vs, hw = s["median"], s.get("vs_grpc", {}), s.get("vs_hardware", {})
                is_base = key == base_key
                value = size_label(it["size"]) if it["count"] == 1 else f"{it['count']} x {size_label(it['size'])}"
                t.add_row(it["op"] if first else "", value if first else "", v["label"], fmt_us(m["p50"]),
                          fmt_us(m["p99"]), fmt_rate(m["calls_per_s"]),
                          "[dim]baseline" if is_base else _pct(vs.get("p50")),
                          "[dim]baseline" if is_base else _pct(vs.get("p99")),
                          _vs_hardware(hw.get("p50"), key in twins), _vs_hardware(hw.get("p99"), key in twins))
                first = False
            t.add_section()
        parts.append(t)
        if ops.get("targets"):
            t = Table(title="kvservice targets: p50 as a share of the gRPC twin's p50")
            for col in ("backend", "op", "value", "share", "target", ""):
                t.add_column(col, justify="left" if col in ("backend", "op", "value", "") else "right")
            for tg in ops["targets"]:
                t.add_row(ops["backends"][tg["backend"]]["label"], tg["op"], size_label(tg["size"]),
                          f"{tg['ratio_p50'] * 100:.1f}%", f"<= {tg['limit'] * 100:.0f}%",
                          "[green]met" if tg["met"] else "[red]missed")
            parts.append(t)
    for key, reason in res.get("skipped", {}).items():
        parts.append(f"[yellow]skipped {key}: {reason}")
    pods = res.get("pods")
    if pods and pods["backends"]:
        sp = pods["spec"]
        t = Table(title=f"kvservice multi-pod replay: {sp['pods']} pods, {sp['chats']} chats x {sp['turns']} turns "
                        f"sharing a {sp['system_tokens']}-token system prompt; chunks of {sp['chunk_size']} tokens = "
                        f"{size_label(sp['chunk_bytes'])}; get = batch_get of the present chunks; µs, median of rounds")
        for col in ("backend", "hits", "cross-pod", "new to pod", "private", "pool MiB", "4 private MiB",
                    "lookup p50", "get p50", "get p99", "get p50 vs gRPC", "get p99 vs gRPC"):
            t.add_column(col, justify="left" if col == "backend" else "right")
        for key, v in pods["backends"].items():
            f, lat = v["figures"], v["lat"]
            look, bg = lat.get("lookup_prefix", {}).get("median", {}), lat.get("batch_get", {})
            bm, vs = bg.get("median", {}), bg.get("vs_grpc", {})
            is_base = key == pods["baseline"]
            t.add_row(key, f"{f['hit_rate'] * 100:.1f}%", f"{f['cross_pod_hit_rate'] * 100:.1f}%",
                      f"{f['new_to_pod_hit_rate'] * 100:.1f}%",
                      f"{f['private_hit_rate'] * 100:.1f}%", f"{f['pool_bytes'] / (1 << 20):,.1f}",
                      f"{f['private_bytes'] / (1 << 20):,.1f}", fmt_us(look.get("p50")), fmt_us(bm.get("p50")),
                      fmt_us(bm.get("p99")), "[dim]baseline" if is_base else _pct(vs.get("p50")),
                      "[dim]baseline" if is_base else _pct(vs.get("p99")))
        t.caption = ("shares of chunks needed. hits: found; cross-pod: found and not written by this pod "
                     "(depends on who wins the first writes); new to pod: found and never held by this pod; "
                     "private: hits had each pod kept a private cache. pool MiB vs what 4 private caches hold")
        parts.append(t)
    for sub in ("ops", "pods"):
        for key, errs in (res.get(sub) or {}).get("errors", {}).items():
            parts.append(f"[red]kv {sub} {key}: {len(errs)} failed round(s): {errs[0].splitlines()[0]}")
    return Group(*parts)


def _pct(c: float | None) -> str:
    """A change (ours/base - 1) as ``-98.0%``, green when lower."""
    if c is None or c != c:
        return "-"
    return f"[{'green' if c < 0 else 'red'}]{c * 100:+.1f}%"


def flush_table(rows: list[dict], title: str) -> Table:
    """Flush mode vs hardware mode (bench.flush): per row both modes' p50 and p99 (medians of
    rounds), the ratio of the p50s with the range of the rounds' own ratios, the target and
    the verdict, and the replies verified against the calls timed (all modes)."""
    t = Table(title=title)
    for col in ("row", "hw p50 µs", "hw p99 µs", "flush p50 µs", "flush p99 µs", "flush/hw p50", "rounds",
                "target", "", "verified / timed"):
        t.add_column(col, justify="left" if col in ("row", "") else "right", no_wrap=col == "row")
    for r in rows:
        hw, fl, rr = r["hardware"], r["flush"], r["round_ratios"]
        spread = f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"
        checked = "-" if r["verified"] is None else (
            f"{sum(r['verified'].values()):,} / {sum(r['timed_calls'].values()):,}")
        t.add_row(r["row"], fmt_us(hw["p50"]), fmt_us(hw["p99"]), fmt_us(fl["p50"]), fmt_us(fl["p99"]),
                  "-" if r["ratio_p50"] != r["ratio_p50"] else f"{r['ratio_p50']:.2f}x", spread,
                  f"<= {r['target']:g}x", "[green]PASS" if r["pass"] else "[red]FAIL", checked)
    t.caption = ("rounds: range of the rounds' own ratios; verified: replies checked whole (warm-up "
                 "included), timed: calls timed, both modes")
    return t
