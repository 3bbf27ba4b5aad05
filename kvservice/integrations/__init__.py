"""Adapters that plug kvservice into LLM serving frameworks as their KV-cache store.

- ``kvservice.integrations.lmcache``: an LMCache remote connector, loaded through
  ``remote_storage_plugins`` (the service URL in ``remote_storage_plugin.NAME.url``, or a
  legacy ``remote_url: kvservice://NAME``).
- ``kvservice.integrations.sglang``: an SGLang HiCache storage backend
  (``--hicache-storage-backend dynamic``).

Each module imports its framework (and, with it, torch), so importing this package imports
neither: values are read and written through the buffer protocol, or through raw pointers
(``data_ptr()``) where a framework hands those out. docs/engines.md has the configurations.

Service URLs (both adapters), the query string being optional:

- ``kvservice://NAME``: the service at ``shm://NAME`` (POSIX shared memory);
- ``kvservice://file/ABS/PATH``: the service at ``file:///ABS/PATH`` (a file or DAX region);
- ``kvservice://?url=file:///ABS/PATH`` (or ``?url=shm://NAME``): any cxlrpc URL spelled out;
- ``shm://NAME`` and ``file:///ABS/PATH`` are accepted as they are.

Query parameters: ``namespace=NS`` (the kvservice namespace the adapter's keys live in),
``ttl=SECONDS`` (a TTL for every value it stores), ``lease_s=SECONDS`` (the lease a read takes).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

SCHEME = "kvservice://"


@dataclass(frozen=True)
class ServiceURL:
    """A parsed adapter URL: the cxlrpc URL to connect to and the adapter's options."""

    url: str
    namespace: str | None = None
    ttl: float | None = None
    lease_s: float | None = None


def parse_service_url(url: str) -> ServiceURL:
    """Parse ``kvservice://NAME``, ``kvservice://file/ABS/PATH``, ``kvservice://?url=...``,
    ``shm://NAME`` or ``file:///ABS/PATH`` (each with an optional ``?namespace=&ttl=&lease_s=``)."""
    if not isinstance(url, str):
        raise TypeError(f"service URL must be a str, not {type(url).__name__}")
    base, _, query = url.partition("?")
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = set(params) - {"url", "namespace", "ttl", "lease_s"}
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} in {url!r}")
    if base.startswith(SCHEME):
        rest = base[len(SCHEME):]
        if "url" in params:
            if rest:
                raise ValueError(f"{url!r} names a service both before '?' and in url=")
            target = params["url"]
        elif rest.startswith("file/"):
            target = "file:///" + rest[len("file/"):].lstrip("/")
        elif rest and "/" not in rest:
            target = "shm://" + rest
        else:
            raise ValueError(f"bad kvservice URL {url!r}: expected kvservice://NAME, "
                             f"kvservice://file/ABS/PATH or kvservice://?url=...")
    elif base.startswith(("shm://", "file://")):
        if "url" in params:
            raise ValueError(f"{url!r} names a service both before '?' and in url=")
        target = base
    else:
        raise ValueError(f"unsupported service URL {url!r}: expected kvservice://, shm:// or file://")
    from cxlrpc.region import parse_url

    parse_url(target)  # validates the name / path (RegionError, a ValueError-like error)
    return ServiceURL(target, params.get("namespace") or None, _float(params, "ttl", url),
                      _float(params, "lease_s", url))


def _float(params: dict[str, str], name: str, url: str) -> float | None:
    if name not in params or params[name] == "":
        return None
    try:
        value = float(params[name])
    except ValueError:
        raise ValueError(f"{name}={params[name]!r} in {url!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive in {url!r}")
    return value


def writable_bytes(obj: Any, size: int | None = None) -> memoryview:
    """A flat writable byte view of ``obj``: a buffer (numpy array, bytearray, memoryview), a
    CPU tensor (through ``data_ptr()``, no torch import), or an int address with ``size``."""
    return _bytes_view(obj, size, writable=True)


def readable_bytes(obj: Any, size: int | None = None) -> memoryview:
    """A flat read-only byte view of ``obj`` (see ``writable_bytes``)."""
    return _bytes_view(obj, size, writable=False)


def _bytes_view(obj: Any, size: int | None, writable: bool) -> memoryview:
    if isinstance(obj, int) and not isinstance(obj, bool):
        if size is None or size < 0:
            raise ValueError("an address needs a non-negative size")
        if obj == 0 and size:
            raise ValueError("null address")
        return memoryview((ctypes.c_char * size).from_address(obj)).cast("B")
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor
        if getattr(obj, "is_cuda", False) or str(getattr(obj, "device", "cpu")) != "cpu":
            raise ValueError("only CPU tensors can be read or written in place")
        if not obj.is_contiguous():
            raise ValueError("tensor must be contiguous")
        nbytes = obj.numel() * obj.element_size()
        if size is not None:
            nbytes = min(nbytes, size)
        return _bytes_view(obj.data_ptr(), nbytes, writable)
    view = memoryview(obj)
    if writable and view.readonly:
        raise ValueError("buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view if size is None else view[:size]
