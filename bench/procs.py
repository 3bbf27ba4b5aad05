"""Worker processes (spawn) with pipe-based ready/stop signalling and guaranteed cleanup."""
from __future__ import annotations

import atexit
import glob
import importlib
import multiprocessing as mp
import os
import signal
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable

CTX = mp.get_context("spawn")
_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()
#: Prefix of every shm segment this benchmark run creates (under /dev/shm as cxlrpc.<prefix>...).
RUN_ID = f"bench-{os.getpid()}"


class WorkerError(RuntimeError):
    """A worker failed, died, or did not answer in time."""


def _child_main(target: str, conn: Connection, kwargs: dict[str, Any]) -> None:
    """Child entry: its own process group, Ctrl-C ignored (the parent drives shutdown), a
    hang-up an exit (atexit cleanup runs), then ``module:function``.

    In the run's group, a paused worker got the SIGHUP the kernel sends stopped processes of
    an orphaned group when the shell that started the run in the background exited mid-turn.
    """
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, _exit_on_hangup)
    modname, fname = target.split(":")
    try:
        getattr(importlib.import_module(modname), fname)(conn, **kwargs)
    except BaseException as exc:  # report, then exit non-zero
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1)


def _exit_on_hangup(*_: object) -> None:
    raise SystemExit(1)


class Worker:
    """One child process running ``target(conn, **kwargs)``; a context manager that always ends it.

    Protocol: the child sends ``("ready", info)`` once set up, may send ``("progress", x)``,
    and sends ``("error", text, tb)`` on failure; the parent sends ``("stop",)`` to end it.
    """

    def __init__(self, target: str, name: str, **kwargs: Any) -> None:
        self.target, self.name, self.kwargs = target, name, kwargs
        self.conn, child_conn = CTX.Pipe(duplex=True)
        self.proc = CTX.Process(target=_child_main, args=(target, child_conn, kwargs), name=name, daemon=True)
        self._child_conn = child_conn
        self.info: Any = None
        self.paused = False

    @property
    def pid(self) -> int:
        return self.proc.pid or -1

    def launch(self) -> "Worker":
        """Start the process without waiting (pair with :meth:`wait_ready`)."""
        _LIVE.add(self)
        self.proc.start()
        self._child_conn.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> Any:
        """Wait for the ready message; returns the info it carried."""
        self.info = self.expect("ready", timeout)
        return self.info

    def start(self, timeout: float = 60.0) -> Any:
        """Start the process and wait for its ready message; returns the info it sent."""
        self.launch()
        return self.wait_ready(timeout)

    def send(self, *msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"{self.name}: pipe closed ({exc}); exit code {self.proc.exitcode}") from exc

    def recv(self, timeout: float, on_progress: Callable[[Any], None] | None = None) -> tuple:
        """Next non-progress message; raises WorkerError on error, death or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s")
            try:
                ready = self.conn.poll(min(left, 0.2))
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError) as exc:
                    self.proc.join(1.0)
                    raise WorkerError(f"{self.name}: died (exit code {self.proc.exitcode})") from exc
                if msg[0] == "error":
                    raise WorkerError(f"{self.name}: {msg[1]}\n{msg[2]}")
                if msg[0] == "progress":
                    if on_progress:
                        on_progress(msg[1])
                    continue
                return msg
            if not self.proc.is_alive():
                raise WorkerError(f"{self.name}: exited (code {self.proc.exitcode}) without answering")

    def expect(self, kind: str, timeout: float, on_progress: Callable[[Any], None] | None = None) -> Any:
        """Wait for a ``(kind, payload)`` message and return the payload."""
        msg = self.recv(timeout, on_progress)
        if msg[0] != kind:
            raise WorkerError(f"{self.name}: expected {kind!r}, got {msg[0]!r}")
        return msg[1] if len(msg) > 1 else None

    def pause(self) -> None:
        """SIGSTOP the child: it takes no CPU until :meth:`resume` (for peers that busy-poll
        while idle and keep no heartbeats, between their turns)."""
        if self.proc.pid is not None and not self.paused and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT a paused child."""
        if self.paused:
            self.paused = False
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the child to stop, then SIGTERM, then SIGKILL; idempotent."""
        self.resume()
        if self.proc.pid is None:
            for c in (self.conn, self._child_conn):
                c.close()
            return
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except Exception:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3.0)
        try:
            self.conn.close()
        except Exception:
            pass
        _LIVE.discard(self)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all() -> None:
    """End every worker still running (atexit, and after Ctrl-C)."""
    for w in list(_LIVE):
        w.stop(timeout=3.0)


atexit.register(stop_all)


def wait_for_stop(conn: Connection) -> None:
    """Child side: block until the parent sends stop (or the pipe closes)."""
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
    except (EOFError, OSError):
        return


async def wait_readable(conn: Connection, on_sigterm: bool = False) -> None:
    """Child side, in asyncio: wait until the pipe has a message or EOF (or SIGTERM, if asked).

    The event loop makes the fd non-blocking while watched; blocking mode is restored after,
    so later ``conn.send`` of a large message cannot fail with EAGAIN.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    if on_sigterm:
        loop.add_signal_handler(signal.SIGTERM, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)
        os.set_blocking(fd, True)
        if on_sigterm:
            loop.remove_signal_handler(signal.SIGTERM)


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process in clock ticks, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()
    return int(fields[11]) + int(fields[12])


CLK_TCK: int = os.sysconf("SC_CLK_TCK")


def shm_leftovers(prefix: str = RUN_ID) -> list[str]:
    """Names under /dev/shm that this run created and did not remove."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("cxlrpc." + prefix))
    except FileNotFoundError:
        return []


def clean_shm(prefix: str = RUN_ID) -> list[str]:
    """Unlink this run's leftover shm segments; returns their names."""
    import posix_ipc

    gone = shm_leftovers(prefix)
    for name in gone:
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            pass
    return gone


def cleanup(say: Callable[[str], None]) -> None:
    """End every worker, unlink this run's shm segments and socket files (saying what was left)."""
    stop_all()
    for name in clean_shm():
        say(f"[yellow]removed leftover shm segment /dev/shm/{name}")
    for path in glob.glob(f"/tmp/{RUN_ID}-*"):
        try:
            os.unlink(path)
            say(f"[yellow]removed leftover socket {path}")
        except OSError:
            pass


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """A run's main process: SIGTERM and SIGHUP (a closed terminal) interrupt it as Ctrl-C does,
    so it stops its workers (each in a group of its own, which the hang-up does not reach)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
