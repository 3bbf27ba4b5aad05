"""cxlrpc._atomic's interface in Python, each operation one call of libatomic through ctypes.

cxlrpc.memory imports this where the native module was not built (no C compiler at install
time). There is no correct read-modify-write on shared memory in pure Python; libatomic's
``__atomic_*_8`` are the same lock-free instructions the native module inlines (``lock xadd``,
``lock cmpxchg``, ``xchg`` on x86-64), so processes using either interoperate on one word.
The calls go through ``ctypes.PyDLL``, which keeps the GIL: a view cannot be closed, nor its
mapping unmapped, between an operation's open check and its access, as in the native module.
Arguments are checked as the native module checks them, in the same order (the view's open
check after every conversion), with the same exception types. Imported in the native module's
stead it warns once, naming what runs slower and what is unavailable; without libatomic the
import raises ImportError saying what to install.
"""
from __future__ import annotations

import ctypes
import operator
import os
import sys
import warnings
from importlib.machinery import ModuleSpec
from typing import Any, Callable, SupportsIndex, Union

RELAXED, ACQUIRE, RELEASE, ACQ_REL, SEQ_CST = 0, 1, 2, 3, 4
_NAMES = ("RELAXED", "ACQUIRE", "RELEASE", "ACQ_REL", "SEQ_CST")
#: The orders each operation may take, as libatomic's (GCC's __ATOMIC_*, C11's memory_order:
#: RELAXED 0, ACQUIRE 2, RELEASE 3, ACQ_REL 4, SEQ_CST 5; 1 is CONSUME).
_LOAD_ORDERS = {RELAXED: 0, ACQUIRE: 2, SEQ_CST: 5}
_STORE_ORDERS = {RELAXED: 0, RELEASE: 3, SEQ_CST: 5}
_ALL_ORDERS = {RELAXED: 0, ACQUIRE: 2, RELEASE: 3, ACQ_REL: 4, SEQ_CST: 5}
#: A CAS's failure order by its success order: the success order without its release half.
_FAIL_OF = {0: 0, 2: 2, 3: 0, 4: 2, 5: 5}
_U64 = (1 << 64) - 1
_SSIZE_MIN, _SSIZE_MAX = -(1 << 63), (1 << 63) - 1

_MISSING_LIBATOMIC = (
    "cxlrpc needs atomic operations on shared memory: its native module cxlrpc._atomic was not "
    "built (there was no C compiler when cxlrpc was installed), and libatomic, which stands in for "
    "it, was not found. Install libatomic (Debian/Ubuntu: apt-get install libatomic1; Fedora: dnf "
    "install libatomic), or install a C compiler and the Python headers (apt-get install gcc "
    "python3-dev) and reinstall cxlrpc.")


def _libatomic() -> ctypes.PyDLL:
    try:
        lib = ctypes.PyDLL("libatomic.so.1")
        for name in ("__atomic_load_8", "__atomic_store_8", "__atomic_compare_exchange_8",
                     "__atomic_fetch_add_8", "__atomic_exchange_8", "atomic_thread_fence"):
            getattr(lib, name)
    except (OSError, AttributeError):
        raise ImportError(_MISSING_LIBATOMIC, name=__name__) from None
    return lib


_lib = _libatomic()
_u64, _int, _ptr = ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p


def _fn(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    f = getattr(_lib, name)
    f.argtypes, f.restype = argtypes, restype
    return f


_Address = Union[int, ctypes.c_void_p]
_load: Callable[[_Address, int], int] = _fn("__atomic_load_8", (_ptr, _int), _u64)
_store: Callable[[_Address, int, int], None] = _fn("__atomic_store_8", (_ptr, _u64, _int), None)
_cas: Callable[[_Address, ctypes.c_uint64, int, int, int], bool] = _fn(
    "__atomic_compare_exchange_8", (_ptr, ctypes.POINTER(_u64), _u64, _int, _int), ctypes.c_bool)
_fetch_add: Callable[[_Address, int, int], int] = _fn("__atomic_fetch_add_8", (_ptr, _u64, _int), _u64)
_exchange: Callable[[_Address, int, int], int] = _fn("__atomic_exchange_8", (_ptr, _u64, _int), _u64)
_fence: Callable[[int], None] = _fn("atomic_thread_fence", (_int,), None)


class _Unset:
    """The type of a CAS's left-out failure order (any int given is checked as an order)."""


_UNSET = _Unset()


def _offset(obj: SupportsIndex) -> int:
    off = operator.index(obj)
    if not _SSIZE_MIN <= off <= _SSIZE_MAX:
        raise OverflowError("Python int too large to convert to C ssize_t" if isinstance(obj, int)
                            else "cannot fit 'int' into an index-sized integer")
    return off


def _value(obj: SupportsIndex) -> int:
    """An int in [-2**63, 2**64), as the u64 with its bits (negative values wrap)."""
    if obj.__class__ is int and 0 <= obj <= _U64:
        return obj
    v = operator.index(obj)
    if not -(1 << 63) <= v <= _U64:
        raise OverflowError(f"value {v!r} is outside [-2**63, 2**64)")
    return v & _U64


def _order(obj: SupportsIndex, allowed: dict[int, int]) -> int:
    """libatomic's order for an operation's order argument, refused as the native module
    refuses it (an exact int it may take is looked up at once)."""
    if obj.__class__ is int:
        c = allowed.get(obj)
        if c is not None:
            return c
    o = operator.index(obj)
    if not _SSIZE_MIN <= o <= _SSIZE_MAX:
        raise OverflowError("Python int too large to convert to C long")
    if not 0 <= o < 5:
        raise ValueError(f"unknown memory order: {o}")
    if o not in allowed:
        raise ValueError(f"{_NAMES[o]} is not a valid memory order for this operation")
    return allowed[o]


def _do_cas(address: _Address, expected: int, desired: int, o: int, fail: int) -> int:
    """Strong CAS; the previous value. A failure order (-1: none given) stronger than the
    success order's own strengthens the success order to cover it, as the native module does."""
    if fail == 5:
        o = 5
    elif fail == 2:
        o = 2 if o == 0 else 4 if o == 3 else o
    seen = _u64(expected)
    _cas(address, seen, desired, o, _FAIL_OF[o])
    return seen.value


def _closed() -> ValueError:
    return ValueError("operation on a closed AtomicView")


class AtomicView:
    """Atomic u64 access to a writable, C-contiguous buffer (an mmap, a bytearray, a
    memoryview). The buffer stays exported until close()."""

    __slots__ = ("_buffer", "_base", "_len")

    def __init__(self, buffer: Any) -> None:
        view = memoryview(buffer)
        if view.readonly:
            view.release()
            raise BufferError("Object is not writable.")
        if not view.c_contiguous:
            view.release()
            raise BufferError("memoryview: underlying buffer is not C-contiguous")
        self._buffer: memoryview | None = view
        self._len = view.nbytes
        if self._len:
            anchor = ctypes.c_char.from_buffer(view)  # its export ends with it, at once
            self._base: int | None = ctypes.addressof(anchor)
            del anchor
        else:
            self._base = 0

    def _word(self, off: int) -> int:
        """The word's address: open, inside the buffer and 8-byte aligned, else ValueError
        (checked after every argument's conversion, as the native module checks)."""
        base = self._base
        if base is None:
            raise _closed()
        if off < 0 or off > self._len - 8:
            raise ValueError(f"offset {off} out of range for an 8-byte access into a {self._len}-byte view")
        address = base + off
        if address & 7:
            raise ValueError(f"offset {off} gives address {address:#x}, which is not 8-byte aligned")
        return address

    def load_u64(self, offset: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> int:
        off = offset if offset.__class__ is int and 0 <= offset <= _SSIZE_MAX else _offset(offset)
        o = _order(order, _LOAD_ORDERS)
        return _load(self._word(off), o)

    def store_u64(self, offset: SupportsIndex, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> None:
        off = offset if offset.__class__ is int and 0 <= offset <= _SSIZE_MAX else _offset(offset)
        v, o = _value(value), _order(order, _STORE_ORDERS)
        _store(self._word(off), v, o)

    def cas_u64(self, offset: SupportsIndex, expected: SupportsIndex, desired: SupportsIndex,
                order: SupportsIndex = SEQ_CST, fail_order: SupportsIndex | _Unset = _UNSET, /) -> int:
        """The previous value (desired was stored when it equals expected)."""
        off = offset if offset.__class__ is int and 0 <= offset <= _SSIZE_MAX else _offset(offset)
        e, d, o = _value(expected), _value(desired), _order(order, _ALL_ORDERS)
        fail = -1 if isinstance(fail_order, _Unset) else _order(fail_order, _LOAD_ORDERS)
        return _do_cas(self._word(off), e, d, o, fail)

    def fetch_add_u64(self, offset: SupportsIndex, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> int:
        """The previous value."""
        off = offset if offset.__class__ is int and 0 <= offset <= _SSIZE_MAX else _offset(offset)
        v, o = _value(value), _order(order, _ALL_ORDERS)
        return _fetch_add(self._word(off), v, o)

    def exchange_u64(self, offset: SupportsIndex, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> int:
        """The previous value."""
        off = offset if offset.__class__ is int and 0 <= offset <= _SSIZE_MAX else _offset(offset)
        v, o = _value(value), _order(order, _ALL_ORDERS)
        return _exchange(self._word(off), v, o)

    def cell_u64(self, offset: SupportsIndex, /) -> AtomicU64:
        """The word at offset (bounds and alignment checked once, here)."""
        return AtomicU64(self, offset)

    def close(self) -> None:
        """Release the buffer's export (idempotent); later operations, and those of its cells,
        raise ValueError."""
        if self._buffer is not None:
            self._base = None
            self._len = 0
            self._buffer.release()
            self._buffer = None

    def __enter__(self) -> AtomicView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> int:
        """Where the buffer starts in this process (ValueError once closed)."""
        if self._base is None:
            raise _closed()
        return self._base

    @property
    def nbytes(self) -> int:
        """The buffer's length (0 once closed)."""
        return self._len

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._base is None

    def __repr__(self) -> str:
        if self._base is None:
            return "<AtomicView (closed)>"
        return f"<AtomicView of {self._len} bytes at {self._base:#x}>"


class AtomicU64:
    """One atomic u64 word of an AtomicView, bound once (bounds and alignment checked here);
    each operation checks only that the view is still open."""

    __slots__ = ("_view", "_word", "_offset")

    def __init__(self, view: AtomicView, offset: SupportsIndex) -> None:
        if not isinstance(view, AtomicView):
            raise TypeError(f"AtomicU64() argument 1 must be AtomicView, not {type(view).__name__}")
        off = _offset(offset)
        self._word = ctypes.c_void_p(view._word(off))  # passed to libatomic as it is
        self._view = view
        self._offset = off

    def _address(self) -> ctypes.c_void_p:
        if self._view._base is None:  # after the conversions: they may run Python code
            raise _closed()
        return self._word

    def load(self, order: SupportsIndex = SEQ_CST, /) -> int:
        o = _order(order, _LOAD_ORDERS)
        return _load(self._address(), o)

    def store(self, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> None:
        v, o = _value(value), _order(order, _STORE_ORDERS)
        _store(self._address(), v, o)

    def cas(self, expected: SupportsIndex, desired: SupportsIndex, order: SupportsIndex = SEQ_CST,
            fail_order: SupportsIndex | _Unset = _UNSET, /) -> int:
        """The previous value (desired was stored when it equals expected)."""
        e, d, o = _value(expected), _value(desired), _order(order, _ALL_ORDERS)
        fail = -1 if isinstance(fail_order, _Unset) else _order(fail_order, _LOAD_ORDERS)
        return _do_cas(self._address(), e, d, o, fail)

    def fetch_add(self, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> int:
        """The previous value."""
        v, o = _value(value), _order(order, _ALL_ORDERS)
        return _fetch_add(self._address(), v, o)

    def exchange(self, value: SupportsIndex, order: SupportsIndex = SEQ_CST, /) -> int:
        """The previous value."""
        v, o = _value(value), _order(order, _ALL_ORDERS)
        return _exchange(self._address(), v, o)

    @property
    def view(self) -> AtomicView:
        """The AtomicView the word lies in."""
        return self._view

    @property
    def offset(self) -> int:
        """The word's byte offset in its view."""
        return self._offset

    @property
    def address(self) -> int:
        """The word's address in this process (ValueError once closed)."""
        return self._address().value or 0

    def __repr__(self) -> str:
        return f"<AtomicU64 at offset {self._offset}{'' if self._view._base is not None else ' (closed)'}>"


def fence(order: SupportsIndex = SEQ_CST, /) -> None:
    """A memory fence of this thread's loads and stores (RELAXED: none)."""
    o = _order(order, _ALL_ORDERS)
    if o:  # RELAXED orders nothing
        _fence(o)


def _spec(name: str, path: list[str] | None) -> ModuleSpec | None:
    """The module's spec, as the import system would find it, without importing it or its
    parent (None where it is not there, or a finder refuses it)."""
    try:
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
    except ImportError:
        pass
    return None


def _unbuilt() -> list[str]:
    """The native modules besides this one's that are not there either (kvservice's looked up
    beside its package: cxlrpc never imports kvservice)."""
    here = [os.path.dirname(__file__)]
    missing = [name for name in ("cxlrpc._ring", "cxlrpc._frame", "cxlrpc._dispatch", "cxlrpc._flush")
               if _spec(name, here) is None]
    kvservice = _spec("kvservice", None)
    if kvservice is not None and kvservice.submodule_search_locations is not None:
        if _spec("kvservice._block", list(kvservice.submodule_search_locations)) is None:
            missing.append("kvservice._block")
    return missing


def _warning() -> str:
    """What runs slower on this module and the other missing ones, and what is unavailable."""
    unbuilt = _unbuilt()
    slower = ["atomic operations (each a ctypes call into libatomic, some 40 times the native module's cost)"]
    slower += [what for name, what in (("cxlrpc._ring", "the rings"), ("cxlrpc._frame", "frame decoding"),
                                       ("cxlrpc._dispatch", "call dispatch"),
                                       ("kvservice._block", "kvservice's leased blocks")) if name in unbuilt]
    text = ("cxlrpc runs without its native module cxlrpc._atomic (there was no C compiler when it "
            f"was installed), so these run their slower reference: {', '.join(slower)}.")
    if "cxlrpc._flush" in unbuilt:
        text += " coherence='flush' is unavailable: it needs cxlrpc._flush."
    return text + (" For the native paths install gcc and the Python headers (apt-get install gcc python3-dev), "
                   "then reinstall cxlrpc.")


if "cxlrpc._atomic" not in sys.modules:  # cxlrpc.memory is falling back here: one warning, at its import
    warnings.warn(_warning(), RuntimeWarning, stacklevel=2)
