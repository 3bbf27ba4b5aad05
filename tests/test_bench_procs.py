"""bench.procs: a benchmark worker lives in its own process group, so pausing it between turns
never lets a hang-up meant for the run's shell kill it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.procs import Worker

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_worker_leads_its_own_process_group() -> None:
    w = Worker("bench.procs:wait_for_stop", "group-check").launch()
    try:
        _wait_for(lambda: os.getpgid(w.pid) == w.pid, 30, "the worker's setpgid")
        assert os.getpgid(0) != w.pid
    finally:
        w.stop()
    assert w.proc.exitcode == 0


# Starts a worker, pauses it, says so, and once told to go on resumes and stops it, writing
# its exit code: what a bench run does around a paused row while its launching shell exits.
_LAUNCHED = textwrap.dedent("""
    import os, sys, time
    from bench.procs import Worker, wait_for_stop

    def ready_then_wait(conn):
        conn.send(("ready", None))
        wait_for_stop(conn)

    def main():
        out = sys.argv[1]
        w = Worker("launched:ready_then_wait", "paused")
        w.start(timeout=30)
        with open(out + ".pids", "w") as f:
            f.write(f"{os.getpid()} {w.pid}")
        w.pause()
        open(out + ".paused", "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(out + ".go") and time.monotonic() < deadline:
            time.sleep(0.01)
        w.stop()
        with open(out + ".tmp", "w") as f:
            f.write(str(w.proc.exitcode))
        os.rename(out + ".tmp", out)

    if __name__ == "__main__":  # spawn's children import this file
        main()
""")


def test_paused_worker_survives_its_launching_shell_exiting(tmp_path: Path) -> None:
    script, out = tmp_path / "launched.py", str(tmp_path / "exitcode")
    script.write_text(_LAUNCHED)
    # A shell in a group of its own starts the run in the background and exits while the
    # worker is stopped: that orphans the shell's group.
    shell = (f'"{sys.executable}" "{script}" "{out}" & '
             f'while [ ! -e "{out}.paused" ]; do sleep 0.01; done')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sh = subprocess.Popen(["sh", "-c", shell], env=env, process_group=0)
    pids: list[int] = []
    try:
        assert sh.wait(timeout=40) == 0
        pids = [int(x) for x in Path(out + ".pids").read_text().split()]
        Path(out + ".go").touch()
        _wait_for(lambda: os.path.exists(out), 30, "the launched run's report")
        assert Path(out).read_text() == "0", "the paused worker died (-1: SIGHUP)"
    finally:
        if sh.poll() is None:
            sh.kill()
            sh.wait()
        for pid in reversed(pids):  # the worker, then the run: gone already unless this failed
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        _wait_for(lambda: not any(_alive(p) for p in pids), 10, "the launched processes' end")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
