"""The puts and reads of Mooncake's store API (MooncakeDistributedStore's base: on a _Session,
which holds the client, the lock, the registered ranges and the error guard)."""
from __future__ import annotations

import functools
from typing import Any

import cxlrpc
from kvservice.compat.mooncake.config import ErrorCode, ReplicateConfig, _config_code
from kvservice.compat.mooncake.memory import BufferHandle, _bytes, _make_handle, _part
from kvservice.compat.mooncake.session import _Session
from kvservice.pool import Block, LeaseExpired


class _Transfers(_Session):
    """put*/upsert*/get*/batch_* of MooncakeDistributedStore (copies and registered ranges)."""


    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) unless ``key`` exists (then 0, the old value stays)."""
        value = _bytes(value)  # TypeError for a non-buffer, as pybind's py::buffer
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, [key], [value], False, config)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value``, replacing any existing one."""
        value = _bytes(value)
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, [key], [value], True, config)

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        """Store several values (no overwrite); 0, or the first failing key's code."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, keys, values, False, config)

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, keys, values, True, config)

    def _put_copy(self, keys: list[str], values: list[Any], overwrite: bool, config: Any) -> int:
        """A put staged through Mooncake's local buffer: 0, or the first failing key's code."""
        if len(keys) != len(values):
            return ErrorCode.INVALID_PARAMS
        if _config_code(config, len(keys)):
            return ErrorCode.INVALID_PARAMS
        self._buffered()
        codes = self._store(list(keys), [_bytes(v) for v in values], overwrite)
        return next((c for c in codes if c != ErrorCode.OK), ErrorCode.OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like); an empty total stores nothing."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._parts, key, [_part(p) for p in parts],
                           False, config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS, self._parts, key, [_part(p) for p in parts],
                           True, config)

    def _parts(self, key: str, views: list[memoryview], overwrite: bool, config: Any) -> int:
        if sum(len(v) for v in views) == 0:
            return ErrorCode.OK  # as Mooncake: a warning, nothing stored
        return self._put_copy([key], [b"".join(views)], overwrite, config)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (inside a registered buffer), no overwrite."""
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._put_from_many([key], [buffer_ptr], [size], False, config)[0])

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._put_from_many([key], [buffer_ptr], [size], True, config)[0])

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Store each registered range under its key (no overwrite); a code per key."""
        return self._guard(lambda c: [c] * len(keys), self._put_from_many, keys, buffer_ptrs, sizes, False,
                           config)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._guard(lambda c: [c] * len(keys), self._put_from_many, keys, buffer_ptrs, sizes, True,
                           config)

    def _put_from_many(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       overwrite: bool, config: Any) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes) or _config_code(config, len(keys)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        views = [self._registered.view(p, s) for p, s in zip(buffer_ptrs, sizes)]
        return self._store(list(keys), views, overwrite)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Store each key's buffers, concatenated (one copy through a bounce buffer)."""
        def run() -> list[int]:
            if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) or _config_code(config, len(keys)):
                return [ErrorCode.INVALID_PARAMS] * len(keys)
            values: list[Any] = []
            for ptrs, sizes in zip(all_buffer_ptrs, all_sizes):
                views = self._registered.views(ptrs, sizes)
                if isinstance(views, int):
                    values.append(views)
                elif len(ptrs) != len(sizes):
                    values.append(None)  # refused by _store (INVALID_PARAMS for the call)
                else:
                    values.append(b"".join(views))
            return self._store(list(keys), values, False)
        return self._guard(lambda c: [c] * len(keys), run)

    # ---- reads ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """A copy of the value; ``b""`` if missing (or on error)."""
        return self._guard(lambda c: [b""], self._get_bytes, [key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Copies of the values; ``b""`` for each missing key."""
        return self._guard(lambda c: [b""] * len(keys), self._get_bytes, list(keys))

    def _get_bytes(self, keys: list[str]) -> list[bytes]:
        self._buffered()
        out: list[bytes] = []
        for block in self._leases(keys):
            if block is None:
                out.append(b"")
                continue
            with block:
                try:
                    out.append(block.tobytes())
                except LeaseExpired:
                    out.append(b"")
        return out

    def get_size(self, key: str) -> int:
        """The value's size in bytes; OBJECT_NOT_FOUND (-704) if missing."""
        def run() -> int:
            (block,) = self._leases([key])
            if block is None:
                return ErrorCode.OBJECT_NOT_FOUND
            with block:
                return block.size
        return self._guard(ErrorCode.INVALID_PARAMS, run)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in place (zero-copy ``BufferHandle``); None if missing."""
        return self._guard(lambda c: None, lambda: self._buffers([key])[0])

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return self._guard(lambda c: [None] * len(keys), self._buffers, list(keys))

    def _buffers(self, keys: list[str]) -> list[BufferHandle | None]:
        try:
            blocks = self._leases(keys, self._buffer_lease_s)
        except cxlrpc.InvalidArgument:  # longer than the server's max_lease_s
            blocks = self._leases(keys)
        out: list[BufferHandle | None] = []
        for key, block in zip(keys, blocks):
            if block is None:
                out.append(None)
                continue
            self._handles[key] = self._handles.get(key, 0) + 1
            out.append(_make_handle(block, functools.partial(self._handle_closed, key)))
        return out

    def _handle_closed(self, key: str) -> None:
        n = self._handles.get(key, 0) - 1
        if n > 0:
            self._handles[key] = n
        else:
            self._handles.pop(key, None)
        self._note_read(key)  # the read lease runs on from the handle's end, as a fresh read

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the value into the registered buffer at ``buffer_ptr``; its size, or a code."""
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._get_into_many([key], [buffer_ptr], [size])[0])

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """``get_into`` for each key (one RPC); bytes read or a negative code per key."""
        return self._guard(lambda c: [c] * len(keys), self._get_into_many, list(keys),
                           list(buffer_ptrs), list(sizes))

    def _get_into_many(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        dsts = [self._registered.view(p, s) for p, s in zip(ptrs, sizes)]
        results: list[int] = [d if isinstance(d, int) else 0 for d in dsts]
        wanted = [(i, d) for i, d in enumerate(dsts) if not isinstance(d, int)]
        blocks = self._leases([keys[i] for i, _ in wanted]) if wanted else []
        for (i, dst), block in zip(wanted, blocks):
            if block is None:
                results[i] = ErrorCode.OBJECT_NOT_FOUND
                continue
            with block:
                if block.size > len(dst):
                    results[i] = ErrorCode.INVALID_PARAMS  # as Mooncake: the size is wrong
                    continue
                try:
                    results[i] = block.copy_into(dst)
                except LeaseExpired:
                    results[i] = ErrorCode.LEASE_EXPIRED
        return results

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each value over its buffers in order; bytes read or a code per key."""
        def run() -> list[int]:
            if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
                return [ErrorCode.INVALID_PARAMS] * len(keys)
            results: list[int] = []
            for key, block, ptrs, sizes in zip(keys, self._leases(list(keys)), all_buffer_ptrs, all_sizes):
                if block is None:
                    results.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                with block:
                    results.append(self._scatter(block, ptrs, sizes))
            return results
        return self._guard(lambda c: [c] * len(keys), run)

    def _scatter(self, block: Block, ptrs: list[int], sizes: list[int]) -> int:
        if len(ptrs) != len(sizes):
            return ErrorCode.INVALID_PARAMS
        dsts = self._registered.views(ptrs, sizes)
        if isinstance(dsts, int):
            return dsts
        if sum(len(d) for d in dsts) < block.size:
            return ErrorCode.INVALID_PARAMS  # as Mooncake
        try:
            src, done = block.view(), 0
            for dst in dsts:
                n = min(len(dst), block.size - done)
                dst[:n] = src[done:done + n]
                done += n
            block.check()
        except LeaseExpired:
            return ErrorCode.LEASE_EXPIRED
        return block.size

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Copy byte ranges of values into registered buffers; bytes or a code per fragment
        (INVALID_PARAMS, as Mooncake, for a range outside the object or the registered buffer,
        and for an unregistered buffer)."""
        def shaped(code: int) -> list[list[list[int]]]:
            return [[[code] * len(frag) for frag in (sizes if isinstance(sizes, list) else [])]
                    for sizes in all_sizes]
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return [[[int(ErrorCode.INVALID_PARAMS)]] for _ in buffer_ptrs]  # Mooncake's shape
        return self._guard(shaped, self._ranges, buffer_ptrs, all_keys, all_dst_offsets,
                           all_src_offsets, all_sizes)

    def _ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]], all_dst: list[list[list[int]]],
                all_src: list[list[list[int]]], all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        unique = list(dict.fromkeys(k for keys in all_keys for k in keys))
        blocks = dict(zip(unique, self._leases(unique))) if unique else {}
        try:
            out: list[list[list[int]]] = []
            for ptr, keys, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst, all_src, all_sizes):
                room = self._registered.room(ptr) if isinstance(ptr, int) and ptr > 0 else -1
                per_buffer: list[list[int]] = []
                if not len(keys) == len(dsts) == len(srcs) == len(sizes):
                    out.append([[ErrorCode.INVALID_PARAMS] * len(s) for s in sizes])
                    continue
                for key, d_offs, s_offs, lens in zip(keys, dsts, srcs, sizes):
                    if not len(d_offs) == len(s_offs) == len(lens):
                        per_buffer.append([ErrorCode.INVALID_PARAMS] * len(lens))
                        continue
                    block = blocks.get(key)
                    frags = []
                    for d, s, n in zip(d_offs, s_offs, lens):
                        frags.append(self._fragment(block, ptr, room, d, s, n))
                    per_buffer.append(frags)
                out.append(per_buffer)
            return out
        finally:
            for block in blocks.values():
                if block is not None:
                    block.release()

    def _fragment(self, block: Block | None, ptr: int, room: int, d: int, s: int, n: int) -> int:
        if block is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if room < 0 or min(d, s, n) < 0 or s + n > block.size or d + n > room:
            return ErrorCode.INVALID_PARAMS
        if n == 0:
            return 0
        dst = self._registered.view(ptr + d, n)
        assert not isinstance(dst, int)  # room() above vouched for the range
        try:
            dst[:] = block.view()[s:s + n]
            block.check()
        except LeaseExpired:
            return ErrorCode.LEASE_EXPIRED
        return n
