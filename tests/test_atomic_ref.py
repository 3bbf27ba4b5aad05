"""cxlrpc._atomic_ref, libatomic through ctypes where cxlrpc._atomic was not built: the same
results and the same refusals as the native module, call for call; exact on one word shared
with processes using the native module; no access after close; one warning when cxlrpc falls
back to it, and one clear error when libatomic is missing too."""
from __future__ import annotations

import mmap
import multiprocessing
import random
import re
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Any, Callable

import pytest

from cxlrpc import _atomic, _atomic_ref
from test_atomic import JOIN_TIMEOUT, USE_AFTER_CLOSE, _run_all, _start_line

N = 50_000
MODULES = {"native": _atomic, "ref": _atomic_ref}


class Index:
    """An int-like argument (converted through __index__, as the native module converts)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _outcome(call: Callable[[], Any]) -> tuple[str, object]:
    """A call's result, or its exception's type and message (addresses masked: the two views'
    buffers lie apart)."""
    try:
        return "ok", call()
    except (TypeError, ValueError, OverflowError) as e:
        message = re.sub(r"0x[0-9a-f]+", "ADDR", str(e))
        return type(e).__name__, None if isinstance(e, TypeError) else message  # arity texts differ


def _random_args(rnd: random.Random, op: str) -> tuple[Any, ...]:
    values = (0, 1, 7, 1 << 63, (1 << 64) - 1, -1, -(1 << 63), 1 << 64, -(1 << 63) - 1, 1 << 32, Index(5), 2.0)
    orders = (0, 1, 2, 3, 4, 4, 4, 5, -1, 1 << 40, 1 << 70, True, Index(1), 1.0)
    nvalues = {"load": 0, "store": 1, "cas": 2, "fetch_add": 1, "exchange": 1}[op]
    args: list[Any] = [rnd.choice(values) for _ in range(nvalues)]
    extra = rnd.choice((0, 1, 1, 1, 2 if op == "cas" else 1, 3))  # orders given; 3: one too many for most
    args += [rnd.choice(orders) for _ in range(extra)]
    if rnd.random() < 0.03:
        args = args[:-1] if args else [0, 0, 0, 0, 0, 0]
    return tuple(args)


def _arity_ok(op: str, args: tuple[Any, ...]) -> bool:
    nvalues = {"load": 0, "store": 1, "cas": 2, "fetch_add": 1, "exchange": 1}.get(op, 0)
    return nvalues <= len(args) <= nvalues + 1 + (op == "cas")


def _call(view: Any, cell: Any, mod: ModuleType, op: str, on_cell: bool, offset: Any, args: tuple[Any, ...],
          order: Any) -> Callable[[], Any]:
    """One operation of one module: binding a cell, a fence, or a load/store/cas/fetch_add/
    exchange on the view at ``offset`` or on the cell."""
    if op == "cell":
        return lambda: view.cell_u64(offset).offset
    if op == "fence":
        return lambda: mod.fence(order)
    if on_cell:
        return lambda: getattr(cell, op)(*args)
    return lambda: getattr(view, f"{op}_u64")(offset, *args)


def test_every_call_does_what_the_native_module_does() -> None:
    """Random operations, with good and bad offsets, values and orders, on a native view and a
    ref view over equal bytes (one pair at an 8-byte aligned base, one pair one byte off), on
    the views, on cells, binding cells and fencing: the same results, the same exceptions, the
    same bytes after, and after close the same refusals."""
    rnd = random.Random(41)
    offsets = (0, 7, 8, 15, 16, 56, 3, 57, 64, -8, 1 << 40, 1 << 70, Index(8), 8.0)
    for skew in (0, 1):
        bufs = {k: memoryview(bytearray(64 + skew))[skew:] for k in MODULES}
        views = {k: m.AtomicView(bufs[k]) for k, m in MODULES.items()}
        cells = {k: v.cell_u64(16 + (8 - skew) % 8) for k, v in views.items()}
        for _ in range(20_000):
            op = rnd.choice(("load", "store", "cas", "fetch_add", "exchange", "cell", "fence"))
            offset, on_cell = rnd.choice(offsets), rnd.random() < 0.4
            args = _random_args(rnd, op) if op not in ("cell", "fence") else ()
            if not _arity_ok(op, args):
                offset = 8  # the native module converts the offset before it counts the rest
            order = rnd.choice((0, 2, 4, 5, Index(3)))
            calls = [_call(views[k], cells[k], m, op, on_cell, offset, args, order) for k, m in MODULES.items()]
            results = [_outcome(call) for call in calls]
            assert results[0] == results[1], (op, on_cell, offset, args, results)
            assert bufs["native"] == bufs["ref"]
        for v in views.values():
            v.close()
        closed = [(_outcome(lambda: v.load_u64(8)), _outcome(lambda: c.store(1)), repr(c))
                  for v, c in zip(views.values(), cells.values())]
        assert closed[0] == closed[1] and closed[0][0] == ("ValueError", "operation on a closed AtomicView")


def test_buffers_are_taken_and_held_as_the_native_module_takes_them() -> None:
    for make in (lambda: b"read-only", lambda: memoryview(bytearray(64))[::2], lambda: 42):
        kinds = []
        for m in MODULES.values():
            with pytest.raises((TypeError, BufferError)) as info:
                m.AtomicView(make())
            kinds.append(info.type)
        assert kinds[0] is kinds[1]
    buf = bytearray(64)
    with _atomic_ref.AtomicView(buf) as v:
        with pytest.raises(BufferError):
            buf.append(0)
        assert v.address == _atomic.AtomicView(buf).address and v.nbytes == 64
        cell = v.cell_u64(8)
        assert (cell.view, cell.offset, cell.address) == (v, 8, v.address + 8)
    buf.append(0)  # released by the close
    assert v.closed and v.nbytes == 0
    with _atomic_ref.AtomicView(bytearray()) as empty, pytest.raises(ValueError):
        empty.load_u64(0)


def test_use_after_close_raises_and_never_touches_the_memory() -> None:
    """test_atomic's child, on the ref module: after close (the mapping unmapped) every operation
    raises ValueError, also when an argument's __index__ closes the view mid-call."""
    script = USE_AFTER_CLOSE.replace("from cxlrpc._atomic import", "from cxlrpc._atomic_ref import")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=JOIN_TIMEOUT)
    assert proc.returncode == 0, f"child ended with {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "ok"


def _cas_incrementer(mod: ModuleType, buf: mmap.mmap, n: int) -> None:
    with mod.AtomicView(buf) as v:
        cell = v.cell_u64(8)
        _start_line(v)
        for i in range(n):
            seen = cell.load(_atomic.RELAXED)
            while (prev := cell.cas(seen, seen + 1, _atomic.ACQ_REL, _atomic.ACQUIRE)) != seen:
                seen = prev
            v.fetch_add_u64(0, 1, i % 5)


def test_cas_races_with_native_processes_lose_nothing() -> None:
    """Two processes on the native module and two on the ref module CAS-increment one word and
    fetch_add another, N times each, all at once: the totals are exact."""
    ctx = multiprocessing.get_context("fork")
    with mmap.mmap(-1, 4096) as buf:
        workers: list[Any] = [ctx.Process(target=_cas_incrementer, args=(m, buf, N)) for m in MODULES.values() for _ in range(2)]
        with _atomic.AtomicView(buf) as v:
            _run_all(workers, v)
            assert (v.load_u64(0), v.load_u64(8), v.load_u64(16)) == (4 * N, 4 * N, 0)


# cxlrpc imported with native modules unimportable, as where they were not built: argv[1] says
# which ("atomic": cxlrpc._atomic alone, "all": every one, "ring": cxlrpc._ring alone;
# "no-libatomic": cxlrpc._atomic, and PyDLL refuses libatomic too).
FALLBACK = textwrap.dedent("""
    import ctypes, sys, warnings

    NATIVES = ("cxlrpc._atomic", "cxlrpc._flush", "cxlrpc._ring", "cxlrpc._frame", "cxlrpc._dispatch",
               "kvservice._block")
    unbuilt = {"all": NATIVES, "ring": ("cxlrpc._ring",)}.get(sys.argv[1], NATIVES[:1])

    class NotBuilt:
        def find_spec(self, name, path=None, target=None):
            if name in unbuilt:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NotBuilt())
    if sys.argv[1] == "no-libatomic":
        real = ctypes.PyDLL
        def refuse(name, *args, **kwargs):
            if "atomic" in name:
                raise OSError(f"{name}: cannot open shared object file")
            return real(name, *args, **kwargs)
        ctypes.PyDLL = refuse
        try:
            import cxlrpc
        except ImportError as e:
            print(e)
        sys.exit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import cxlrpc, kvservice
        from cxlrpc import memory
    for w in caught:
        print(w.category.__name__, w.filename, w.message, sep="|")

    async def echo():
        server = cxlrpc.Server(sys.argv[2])
        server.method("echo")(lambda payload: payload)
        async with server, cxlrpc.connect(sys.argv[2]) as client:
            return await client.call("echo", b"hi", timeout=30.0)

    natives = sorted(n for n in NATIVES if n in sys.modules)
    print(memory.Counter.__module__, cxlrpc.run(echo()), ",".join(natives), sep="|")
""")
SLOWER = ("the rings", "frame decoding", "call dispatch", "kvservice's leased blocks")


@pytest.mark.parametrize("unbuilt", ["atomic", "all"])
def test_cxlrpc_falls_back_with_one_warning(unbuilt: str, name: str) -> None:
    """Without cxlrpc._atomic the import warns once, naming what runs slower and what is
    unavailable, and an RPC works on the ref atomics: beside the native rings and dispatch
    where only cxlrpc._atomic is missing, on the reference paths where nothing was built."""
    proc = subprocess.run([sys.executable, "-c", FALLBACK, unbuilt, f"shm://{name}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warning, last = proc.stdout.splitlines()
    category, filename, message = warning.split("|")
    assert category == "RuntimeWarning" and filename.endswith("cxlrpc/memory.py")
    assert "without its native module cxlrpc._atomic" in message and "libatomic" in message
    atomics, reply, natives = last.split("|")
    assert (atomics, reply) == ("cxlrpc._atomic_ref", "b'hi'")
    if unbuilt == "all":
        assert natives == "" and all(s in message for s in SLOWER) and "coherence='flush' is unavailable" in message
    else:
        assert natives == "cxlrpc._dispatch,cxlrpc._flush,cxlrpc._frame,cxlrpc._ring,kvservice._block"
        assert not any(s in message for s in SLOWER) and "flush" not in message


def test_a_dispatch_built_without_the_rings_leaves_calls_to_the_reference(name: str) -> None:
    """cxlrpc._dispatch built where cxlrpc._ring was not: its import fails as an ImportError (not
    the AttributeError of a capsule it cannot find), so the package imports without a warning
    (its atomics are native) and both sides run the reference call path."""
    proc = subprocess.run([sys.executable, "-c", FALLBACK, "ring", f"shm://{name}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (last,) = proc.stdout.splitlines()
    atomics, reply, natives = last.split("|")
    assert (atomics, reply) == ("cxlrpc._atomic", "b'hi'")
    assert natives == "cxlrpc._atomic,cxlrpc._flush,cxlrpc._frame,kvservice._block"


def test_without_libatomic_too_the_import_says_what_to_install() -> None:
    proc = subprocess.run([sys.executable, "-c", FALLBACK, "no-libatomic"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "libatomic" in proc.stdout and "apt-get install libatomic1" in proc.stdout
    assert "apt-get install gcc" in proc.stdout
