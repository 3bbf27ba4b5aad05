"""Typed services: one class of ``async def`` signatures that server and client share, so method
names and request/response types are checked by mypy or pyright instead of strings.

    class Greeter(cxlrpc.Service, Protocol):   # a Protocol: mypy accepts the empty bodies
        async def norm(self, p: Point) -> int: ...
        async def hello(self) -> str: ...

    server.add_service(Greeter, GreeterImpl())         # serves "Greeter.norm", "Greeter.hello"
    greeter = client.stub(Greeter, timeout=1.0)       # typed as Greeter
    n: int = await greeter.norm(Point(3, 4))          # response decoded as int

The class is the contract: each of its public methods takes at most one request argument and
declares its return type (the reply is decoded into it). Streams are declared by their types:

    async def norm(self, p: Point) -> float: ...                          # unary
    def ticks(self, n: int) -> AsyncIterator[Tick]: ...                    # server stream
    async def total(self, xs: AsyncIterator[int]) -> int: ...             # client stream
    def chat(self, msgs: AsyncIterator[Msg]) -> AsyncIterator[Reply]: ...  # bidirectional

(a method whose replies stream is a plain ``def`` returning ``AsyncIterator[R]``: the type an
async generator has, so its implementation is ``async def ... yield``). Stubs of client- and
bidirectional streams take the requests as an async iterable (a plain one is accepted too).
The implementation may subclass the contract or just have methods of the same names.
"""
from __future__ import annotations

import collections.abc
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Protocol, TypeVar

from .streams import StreamCall, bidi, feed

S = TypeVar("S")


class ServiceCaller(Protocol):
    """What a stub needs of its client (``cxlrpc.Client`` has it): the four call shapes."""

    def call(self, method: str, arg: Any = ..., *, timeout: float | None = ...,
             response_type: Any = ...) -> Awaitable[Any]:
        """A unary call."""
        ...

    def stream(self, method: str, arg: Any = ..., *, timeout: float | None = ...,
               response_type: Any = ...) -> AsyncIterator[Any]:
        """A server-streaming call's replies."""
        ...

    def open_stream(self, method: str, *, timeout: float | None = ...,
                    response_type: Any = ...) -> StreamCall[Any]:
        """A client-streaming or bidirectional call."""
        ...


class MethodRegistry(Protocol):
    """What ``add_service`` needs of a server (``cxlrpc.Server`` has it)."""

    def add_method(self, name: str, fn: Callable[..., Any], *, blocking: bool = False,
                   requests: bool | None = None) -> None:
        """Serve ``fn`` as ``name`` (``requests``: whether it reads a stream of requests)."""
        ...


def streams_replies(fn: Callable[..., Any]) -> bool:
    """Does handler ``fn`` stream its replies (an async generator, or a plain wrapper of one:
    ``functools.wraps``, ``partial``)?"""
    target = inspect.unwrap(fn)
    while isinstance(target, functools.partial):
        target = inspect.unwrap(target.func)
    return inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(target)


class Service(Protocol):
    """Base of a typed service's contract: ``class Greeter(cxlrpc.Service, Protocol)`` with
    ``async def`` methods (a Protocol, so implementations need not subclass it)."""


_STREAMS = (collections.abc.AsyncIterator, collections.abc.AsyncIterable,
            collections.abc.AsyncGenerator)


@dataclass(frozen=True)
class Rpc:
    """One method of a service: its wire name, whether it takes a request, its reply type
    (of each item, for a stream), and which sides stream."""

    attr: str
    name: str
    takes_request: bool
    response_type: Any
    request_stream: bool = False
    response_stream: bool = False


def stream_item(hint: Any) -> tuple[bool, Any]:
    """(is ``hint`` an async iterator type, the type of its items or None for any): how a
    handler's parameter or a contract's types say a side streams."""
    if typing.get_origin(hint) not in _STREAMS:
        return False, hint
    args = typing.get_args(hint)
    return True, args[0] if args and args[0] is not Any else None


def rpcs(service: type, prefix: str | None = None) -> list[Rpc]:
    """The methods a service class declares (its own and its bases', not Service's), checked."""
    if not isinstance(service, type):
        raise TypeError(f"a service is a class, not {service!r}")
    prefix = f"{service.__name__}." if prefix is None else prefix
    out = []
    for attr in sorted(dir(service)):
        fn = getattr(service, attr)
        if attr.startswith("_") or not inspect.isfunction(fn) or hasattr(Service, attr):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]  # after self
        if len(params) > 1 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                  for p in params):
            raise TypeError(f"{service.__name__}.{attr} must take at most one request argument")
        hints = typing.get_type_hints(fn)
        if "return" not in hints:
            raise TypeError(f"{service.__name__}.{attr} must declare its return type")
        replies, response = stream_item(hints["return"])
        requests = bool(params) and stream_item(hints.get(params[0].name))[0]
        if replies == inspect.iscoroutinefunction(fn):
            raise TypeError(f"{service.__name__}.{attr}: declare a method whose replies stream "
                            f"as `def ... -> AsyncIterator[R]`, any other as `async def`")
        out.append(Rpc(attr, prefix + attr, bool(params), None if response is Any else response,
                       requests, replies))
    if not out:
        raise TypeError(f"{service.__name__} declares no methods")
    return out


def add_service(server: MethodRegistry, service: type[S], impl: S, prefix: str | None = None) -> None:
    """Serve ``impl``'s methods under the names ``service`` declares."""
    for rpc in rpcs(service, prefix):
        handler = getattr(impl, rpc.attr, None)
        if handler is None:
            raise TypeError(f"{type(impl).__name__} lacks {service.__name__}.{rpc.attr}")
        if callable(handler) and streams_replies(handler) != rpc.response_stream:
            raise TypeError(f"{type(impl).__name__}.{rpc.attr} must "
                            f"{'be an async generator' if rpc.response_stream else 'not yield'}: "
                            f"{service.__name__} declares its replies "
                            f"{'a stream' if rpc.response_stream else 'one reply'}")
        server.add_method(rpc.name, handler, requests=rpc.request_stream)


class _Stub:
    """The client side of a service: an ``async`` method per declared one."""

    def __init__(self, client: ServiceCaller, service: type, timeout: float | None,
                 prefix: str | None) -> None:
        self._service = service.__name__
        for rpc in rpcs(service, prefix):
            setattr(self, rpc.attr, _method(client, rpc, timeout))

    def __repr__(self) -> str:
        return f"<cxlrpc stub of {self._service}>"


def _method(client: ServiceCaller, rpc: Rpc, timeout: float | None) -> Callable[..., Any]:
    """The stub's function for one method, shaped by which sides stream."""
    call, name, response_type = client.call, rpc.name, rpc.response_type

    def opened() -> StreamCall[Any]:
        return client.open_stream(name, timeout=timeout, response_type=response_type)

    def chat(requests: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[Any]:
        return bidi(opened(), requests)

    async def upload(requests: AsyncIterable[Any] | Iterable[Any]) -> Any:
        async with opened() as stream:
            await feed(stream, requests)
            return await stream.response()

    def replies(*request: Any) -> AsyncIterator[Any]:
        return client.stream(name, *request, timeout=timeout, response_type=response_type)

    async def unary(request: Any) -> Any:
        return await call(name, request, timeout=timeout, response_type=response_type)

    async def nullary() -> Any:
        return await call(name, timeout=timeout, response_type=response_type)

    method: Callable[..., Any]
    if rpc.request_stream:
        method = chat if rpc.response_stream else upload
    elif rpc.response_stream:
        method = replies
    else:
        method = unary if rpc.takes_request else nullary
    method.__name__ = method.__qualname__ = rpc.attr
    return method


def stub(client: ServiceCaller, service: Callable[..., S], timeout: float | None = None,
         prefix: str | None = None) -> S:
    """An object typed as ``service`` whose methods call the server (``timeout`` per call).
    ``service`` is the contract class (typed as a callable: mypy refuses protocol classes
    where ``type[S]`` is asked for)."""
    return typing.cast(S, _Stub(client, typing.cast(type, service), timeout, prefix))
