"""A registered handler, its calling convention decided once (the server's method table
holds these; ``cxlrpc.server_dispatch`` serves them)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from . import frame as fr
from .server_context import Handler
from .service import stream_item

#: Mode bits of a method's entry in the native dispatcher's table (see _dispatch.c).
_TAKES_ARG, _IS_ASYNC, _RAW_ARG, _VIEW_ARG = 1, 2, 4, 8


class _Method:
    """A registered handler with its calling convention and request decoding decided once,
    at registration (a handler that cannot be served is refused there, not on every call)."""

    __slots__ = ("fn", "is_async", "streaming", "requests", "streams", "blocking", "arg_type",
                 "raw_arg", "takes_arg", "view_arg", "decode")

    def __init__(self, name: str, fn: Handler, blocking: bool = False,
                 requests: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"handler for {name!r} is not callable: {fn!r}")
        self.fn = fn
        target = inspect.unwrap(fn)
        while isinstance(target, functools.partial):
            target = inspect.unwrap(target.func)
        # a plain wrapper of a coroutine function (functools.wraps, partial) is served as one
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)
        #: An async generator: a server stream, each value it yields one item to the caller.
        self.streaming = inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(target)
        if blocking and (self.is_async or self.streaming):
            raise ValueError(f"handler for {name!r} is a coroutine function: blocking=True is "
                             f"for plain functions that block (they run in a thread)")
        self.blocking = blocking
        params = list(inspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p.name for p in positional if p.default is p.empty]
        required += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        if len(required) > 1:
            raise TypeError(f"handler for {name!r} must take at most one argument (the request); "
                            f"it requires {', '.join(required)}")
        keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        if keyword_only:
            raise TypeError(f"handler for {name!r} must take the request as a positional "
                            f"parameter, not keyword-only {keyword_only[0]!r}")
        first = positional[0] if positional else None
        self.takes_arg = first is not None or any(p.kind is p.VAR_POSITIONAL for p in params)
        self.arg_type: Any = None
        if first is not None:
            ann = first.annotation
            if ann is not inspect.Parameter.empty and not isinstance(ann, str):
                self.arg_type = ann
            elif isinstance(ann, str):
                hints = inspect.get_annotations(fn, eval_str=True)
                self.arg_type = hints.get(first.name)
        #: The request is a stream (its parameter is an ``AsyncIterator[T]``; a typed
        #: service's contract may say so instead): the handler gets a RequestStream of T.
        stream_of, item_type = stream_item(self.arg_type)
        self.requests = stream_of if requests is None else requests
        if self.requests:
            if not self.takes_arg or not (self.is_async or self.streaming):
                raise TypeError(f"handler for {name!r} reads a stream of requests: it must be an "
                                f"`async def` (or an async generator) taking it as its argument")
            self.arg_type = item_type if stream_of else None
        self.streams = self.streaming or self.requests
        #: The request is a read-only ``memoryview`` of the body (``arg: memoryview``), where
        #: it lies when the handler's shape allows (see ``lends``).
        self.view_arg = self.arg_type is memoryview
        #: A raw (bytes-like) body is the argument itself: no decoding to do.
        self.raw_arg = (self.arg_type is None or self.arg_type is bytes or self.arg_type is Any
                        or self.view_arg)
        #: Decodes a MessagePack body into the argument (validated as its annotation says).
        self.decode: Callable[[Any], Any] = fr.decoder(self.arg_type)

    @property
    def lends(self) -> bool:
        """Whether the body may be lent to the handler, in place: it takes a memoryview and
        runs in the loop (a plain function reads the ring record before it is reused; a
        coroutine, which may outlive the record, gets a copy of it but keeps a heap extent)."""
        return self.view_arg and not (self.blocking or self.streams)

    @property
    def native_mode(self) -> int | None:
        """The mode bits of its entry in the native dispatcher's table, or None: a shape the
        native dispatch does not take (a blocking or streaming handler)."""
        if self.blocking or self.streams:
            return None
        return ((_TAKES_ARG * self.takes_arg) | (_IS_ASYNC * self.is_async) | (_RAW_ARG * self.raw_arg)
                | (_VIEW_ARG * self.view_arg))
