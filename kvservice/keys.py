"""Cache keys: LMCache-style prefix-chained chunk hashes and validation of user-supplied keys."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

KEY_DIGEST_SIZE = 16
MAX_KEY_BYTES = 1024
_PERSON = b"kvservice-chunk1"  # blake2b personalisation: separates these hashes from any other use
_INT64_MAX = np.iinfo(np.int64).max


def _tokens_le_int64(token_ids: Iterable[int] | npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.int64]:
    """Token ids as a 1-D little-endian int64 array (the canonical encoding); validates them."""
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must have an integer dtype, not {token_ids.dtype}")
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype == np.uint64 and token_ids.size and int(token_ids.max()) > _INT64_MAX:
            raise ValueError("token ids must fit in int64")
        return np.ascontiguousarray(token_ids, dtype="<i8")
    try:
        packed = array("q", token_ids)  # C-speed check that every item is an int within int64
    except OverflowError as exc:
        raise ValueError("token ids must fit in int64") from exc
    except TypeError as exc:
        raise TypeError(f"token ids must be ints: {exc}") from exc
    if sys.byteorder != "little":
        packed.byteswap()
    return np.frombuffer(packed, dtype="<i8")


def chunk_keys(token_ids: Iterable[int] | npt.NDArray[np.integer[Any]], chunk_size: int = 256,
               namespace: str = "") -> list[bytes]:
    """16-byte keys of the full ``chunk_size``-token chunks: key i = H(namespace, key i-1, chunk i).

    Each key therefore covers the namespace and every token before its chunk's end, so requests
    sharing a prefix share its keys. A trailing partial chunk gets no key (it is not cached).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError("chunk_size must be an int")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(namespace, str):
        raise TypeError("namespace must be a str")
    tokens = _tokens_le_int64(token_ids).data.cast("B")
    ns = namespace.encode("utf-8")
    base = hashlib.blake2b(digest_size=KEY_DIGEST_SIZE, person=_PERSON)
    base.update(len(ns).to_bytes(4, "little") + ns)  # length prefix keeps the encoding unambiguous
    step = chunk_size * 8
    keys: list[bytes] = []
    prev = bytes(KEY_DIGEST_SIZE)  # the chain starts from an all-zero "key -1"
    for start in range(0, len(tokens) - step + 1, step):
        h = base.copy()
        h.update(prev)
        h.update(tokens[start:start + step])
        prev = h.digest()
        keys.append(prev)
    return keys


def normalize_key(key: str | bytes) -> bytes:
    """A user key as bytes (str is UTF-8 encoded); rejects empty keys and keys over 1024 bytes."""
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:  # what the server gets: one test
        return key
    if isinstance(key, str):
        key = key.encode("utf-8")
    elif not isinstance(key, bytes):
        raise TypeError(f"key must be str or bytes, not {type(key).__name__}")
    if not key:
        raise ValueError("key must not be empty")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key is {len(key)} bytes, the limit is {MAX_KEY_BYTES}")
    return key
