"""The state under MooncakeDistributedStore's calls: the kvservice client, the lock calls are
serialized by, the registered ranges, the read leases granted, and the error guard that turns
kvservice's exceptions into Mooncake's codes."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, TypeVar

from kvservice.client import SyncKVClient
from kvservice.compat.mooncake.config import _COPY_LEASE_S, DEFAULT_KV_LEASE_TTL, ErrorCode, _code
from kvservice.compat.mooncake.memory import _Registered
from kvservice.pool import Block

logger = logging.getLogger("kvservice.compat.mooncake")
R = TypeVar("R")


class _Session:
    """A store's connection and bookkeeping (the base of its transfers and of the store)."""

    def __init__(self, *, namespace: str = "", kv_lease_ttl: float = DEFAULT_KV_LEASE_TTL,
                 buffer_lease_s: float | None = 60.0) -> None:
        """Mooncake's constructor takes no arguments; the keyword-only ones are kvservice's:
        the namespace keys live in, the read-lease time that makes a non-forced remove fail
        with OBJECT_HAS_LEASE, and the kvservice lease a get_buffer handle asks for (the
        server caps it at its ``max_lease_s``; None: the server's default)."""
        self._namespace = namespace
        self._kv_lease_ttl = kv_lease_ttl
        self._buffer_lease_s = buffer_lease_s
        self._kv: SyncKVClient | None = None
        self._lock = threading.RLock()
        self._hostname = ""
        self._local_buffer = 0  # local_buffer_size of setup: 0 refuses the copying calls
        self._registered = _Registered()
        self._lease_until: dict[str, float] = {}  # key -> end of the read lease we granted
        self._handles: dict[str, int] = {}        # key -> open get_buffer handles

    def _client(self) -> SyncKVClient:
        if self._kv is None:
            raise _NotSetUp
        return self._kv

    def _buffered(self) -> SyncKVClient:
        """The client, for a call Mooncake stages through its local buffer."""
        kv = self._client()
        if not self._local_buffer:
            raise _NoLocalBuffer
        return kv

    def _note_read(self, key: str) -> None:
        if self._kv_lease_ttl > 0:
            self._lease_until[key] = time.monotonic() + self._kv_lease_ttl

    def _leased(self, key: str) -> bool:
        if self._handles.get(key):
            return True
        until = self._lease_until.get(key)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._lease_until[key]
            return False
        return True

    def _leases(self, keys: Sequence[str], lease_s: float | None = None) -> list[Block | None]:
        """Leases on ``keys``. The read lease (``hold``) blocks removal and eviction for
        kv_lease_ttl, for every client. A copying read asks for a lease of that length too, so
        the server ends it then even if our release is still queued in the client (with the
        server's default lease, another store's remove stayed blocked 10 s)."""
        if lease_s is None:
            lease_s = max(self._kv_lease_ttl, _COPY_LEASE_S)
        blocks = self._client().batch_get(keys, self._namespace, lease_s, self._kv_lease_ttl)
        for key, block in zip(keys, blocks):
            if block is not None:
                self._note_read(key)
        return blocks

    def _exists(self, key: str) -> bool:
        return self._client().exists(key, self._namespace)

    def _store(self, keys: Sequence[str], values: Sequence[Any], overwrite: bool) -> list[int]:
        """Store each value (skipping keys that exist unless ``overwrite``); a code per key."""
        kv = self._client()
        codes: list[int] = [ErrorCode.OK] * len(keys)
        todo: dict[str, Any] = {}
        for i, (key, value) in enumerate(zip(keys, values)):
            if not isinstance(key, str) or not key:
                codes[i] = ErrorCode.INVALID_PARAMS
            elif isinstance(value, int):  # an error code from a registered-address lookup
                codes[i] = value
            elif len(value) == 0:
                codes[i] = ErrorCode.INVALID_PARAMS  # kvservice stores no empty values
            elif key not in todo or overwrite:
                todo[key] = value  # a repeated key without overwrite keeps its first value
        if not todo:
            return codes
        if_absent = not overwrite  # decided atomically by the server (OBJECT_ALREADY_EXISTS is 0)
        try:
            kv.batch_put(todo, self._namespace, if_absent=if_absent)
        except Exception as exc:
            if len(todo) == 1:
                err = _code(exc)
                return [err if k in todo else c for k, c in zip(keys, codes)]
            for key, value in todo.items():  # all or none was reserved: retry one by one
                try:
                    kv.put(key, value, self._namespace, if_absent=if_absent)
                except Exception as one:
                    codes[keys.index(key)] = _code(one)
        return codes

    def _guard(self, fallback: int | Callable[[int], R], fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` under the lock, answered as Mooncake does: its result with codes as
        plain ints, or on an error the code (``fallback(code)`` for calls answering a list)."""
        with self._lock:
            try:
                result: R = _plain(fn(*args))
                return result
            except _NotSetUp:
                logger.error("Client is not initialized")
                code: int = ErrorCode.INVALID_PARAMS
            except _NoLocalBuffer:
                logger.error("no local buffer (local_buffer_size=0): use the registered-buffer calls")
                code = ErrorCode.INVALID_PARAMS
            except Exception as exc:
                code = _code(exc)
                if code == ErrorCode.INTERNAL_ERROR:
                    logger.exception("kvservice call failed")
        result = _plain(fallback(code) if callable(fallback) else code)
        return result

    def _close_client(self) -> None:
        if self._kv is not None:
            kv, self._kv = self._kv, None
            try:
                kv.close()
            except Exception as exc:  # pragma: no cover - a failing unmap
                logger.warning("closing the kvservice client: %s", exc)

    def __del__(self) -> None:
        try:
            self._close_client()
        except Exception:
            pass


def _plain(result: Any) -> Any:
    """Codes as plain ints (Mooncake returns int, not an enum), through nested lists."""
    if isinstance(result, IntEnum):
        return int(result)
    if isinstance(result, list):
        return [_plain(r) for r in result]
    return result


class _NoLocalBuffer(Exception):
    """A copying call on a store set up with local_buffer_size=0 (Mooncake: INVALID_PARAMS)."""


class _NotSetUp(Exception):
    """A call before setup() (Mooncake: "Client is not initialized")."""
