"""Typed services: one class of ``async def`` signatures that server and client share, so method
names and request/response types are checked by mypy or pyright instead of strings.

    class Greeter(cxlrpc.Service, Protocol):   # a Protocol: mypy accepts the empty bodies
        async def norm(self, p: Point) -> int: ...
        async def hello(self) -> str: ...

    server.add_service(Greeter, GreeterImpl())         # serves "Greeter.norm", "Greeter.hello"
    greeter = client.stub(Greeter, timeout=1.0)       # typed as Greeter
    n: int = await greeter.norm(Point(3, 4))          # response decoded as int

The class is the contract: each of its public ``async def`` methods takes at most one request
argument and declares its return type (the reply is decoded into it). The implementation may
subclass it or just have methods of the same names.
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

if TYPE_CHECKING:
    from .client import Client
    from .server import Server

S = TypeVar("S")


class Service(Protocol):
    """Base of a typed service's contract: ``class Greeter(cxlrpc.Service, Protocol)`` with
    ``async def`` methods (a Protocol, so implementations need not subclass it)."""


@dataclass(frozen=True)
class Rpc:
    """One method of a service: its wire name, whether it takes a request, its reply type."""

    attr: str
    name: str
    takes_request: bool
    response_type: Any


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
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{service.__name__}.{attr} must be declared `async def`")
        params = list(inspect.signature(fn).parameters.values())[1:]  # after self
        if len(params) > 1 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                  for p in params):
            raise TypeError(f"{service.__name__}.{attr} must take at most one request argument")
        hints = typing.get_type_hints(fn)
        if "return" not in hints:
            raise TypeError(f"{service.__name__}.{attr} must declare its return type")
        response = hints["return"]
        out.append(Rpc(attr, prefix + attr, bool(params), None if response is Any else response))
    if not out:
        raise TypeError(f"{service.__name__} declares no `async def` methods")
    return out


def add_service(server: "Server", service: type[S], impl: S, prefix: str | None = None) -> None:
    """Serve ``impl``'s methods under the names ``service`` declares."""
    for rpc in rpcs(service, prefix):
        handler = getattr(impl, rpc.attr, None)
        if handler is None:
            raise TypeError(f"{type(impl).__name__} lacks {service.__name__}.{rpc.attr}")
        server.add_method(rpc.name, handler)


class _Stub:
    """The client side of a service: an ``async`` method per declared one."""

    def __init__(self, client: "Client", service: type, timeout: float | None,
                 prefix: str | None) -> None:
        self._service = service.__name__
        for rpc in rpcs(service, prefix):
            setattr(self, rpc.attr, _method(client, rpc, timeout))

    def __repr__(self) -> str:
        return f"<cxlrpc stub of {self._service}>"


def _method(client: "Client", rpc: Rpc, timeout: float | None):
    call, name, response_type = client.call, rpc.name, rpc.response_type
    if rpc.takes_request:
        async def method(request: Any) -> Any:
            return await call(name, request, timeout=timeout, response_type=response_type)
    else:
        async def method() -> Any:
            return await call(name, timeout=timeout, response_type=response_type)
    method.__name__ = method.__qualname__ = rpc.attr
    return method


def stub(client: "Client", service: Callable[..., S], timeout: float | None = None,
         prefix: str | None = None) -> S:
    """An object typed as ``service`` whose methods call the server (``timeout`` per call).
    ``service`` is the contract class (typed as a callable: mypy refuses protocol classes
    where ``type[S]`` is asked for)."""
    return typing.cast(S, _Stub(client, typing.cast(type, service), timeout, prefix))
