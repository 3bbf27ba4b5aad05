"""A handler's run on the server: its first step inline (with a stand-in current task), the
task that carries it on once it suspends, and the interceptor chain around it.

Also the contracts the server's rooms keep with the dispatch room above them
(``Calls``) and with the native dispatcher (``NativeDispatcher``), so that the
rooms below dispatch (streams, bodies) import no room above them.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
from asyncio import current_task as _current_task
from asyncio.tasks import _enter_task, _leave_task
from typing import Any, Awaitable, Callable, Generator, Protocol, Sequence

from . import frame as fr
from .errors import InvalidArgument, Unimplemented
from .server_context import CallKey, HandlerContext, ServerInterceptor, _current_call
from .server_methods import _Method

_NO_ARG = object()
_UNDECODED = object()  # an intercepted call's request is decoded inside the chain
_SUSPENDED, _FAILED = object(), object()  # what _run_eagerly returns instead of a result
_RETURNED = object()  # what _first_step returns when the handler returned
_STREAMED = object()  # what a stream's task returns: its items and END are already sent


class NativeDispatcher(Protocol):
    """The native dispatcher (``cxlrpc._dispatch.Dispatcher``) as the server drives it."""

    enabled: int
    polled_at: float

    def poll(self, ring: Any, now: float, until: float, /) -> int:
        """Serve one batch of the request ring natively; how many records it handled."""

    def serve(self, ring: Any, seconds: float, until: float, /) -> int:
        """Serve batches while nothing needs the loop, looking ``seconds`` for each."""

    def dispatch_body(self, slot: int, gen: int, call_id: int, flags: int, timeout: float,
                      method: bytes, body: bytes, /) -> bool:
        """Dispatch a followed request whose body is at hand; False: the reference's."""


class Calls(Protocol):
    """What the rooms below dispatch (streams, bodies) ask of it (``cxlrpc.server_dispatch``)."""

    _polled_at: float
    _fast: NativeDispatcher | None
    _closing: bool

    def _dispatch_request(self, f: fr.Frame, extent: int = -1) -> bool | None:
        """Run a request whose body is at hand, and reply."""

    def _run_eagerly(self, coro: Any, f: fr.Frame, slot: int, call: HandlerContext,
                     extent: int = -1, ctx: contextvars.Context | None = None) -> Any:
        """Run a handler's coroutine inline up to its first suspension."""

    def _track(self, f: fr.Frame, slot: int,
               start: Callable[[CallKey], asyncio.Task[Any]]) -> asyncio.Task[Any]:
        """Register the task that finishes a call."""

    async def _finish(self, handler: Awaitable[Any], f: fr.Frame, key: CallKey) -> None:
        """Await a call's handler in its task and reply with its outcome."""

    def _reply(self, f: fr.Frame, result: Any, held: bool = False, hint: int = 0) -> None:
        """Answer ``f`` with ``result``."""

    def _broken(self, exc: Exception) -> None:
        """A request broke dispatch: logged, counted, dropped."""

    def _drop(self) -> None:
        """Count a dropped frame."""


class _Resumed:
    """Awaiting it goes on driving a coroutine that already ran up to ``step`` (its first
    suspension): what it yields goes to the task, what the task sends or throws goes back."""

    __slots__ = ("_coro", "_step")

    def __init__(self, coro: Any, step: Any) -> None:
        self._coro, self._step = coro, step

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, step = self._coro, self._step
        while True:
            try:
                value = yield step
            except BaseException as exc:  # cancellation (or close) of the task
                try:
                    step = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    step = coro.send(value)
                except StopIteration as done:
                    return done.value


class _EagerTask:
    """The current task while a coroutine handler runs its first step inline: what it hands
    to ``asyncio.timeout`` or a TaskGroup there (cancel, cancelling, uncancel) goes to the
    task that carries the handler on once it suspends. (Slots only: the native dispatcher
    reuses one that no handler kept a reference to, so nothing of a call stays on it.)"""

    __slots__ = ("task", "value", "__weakref__")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = None  # carries the handler on, once it suspends
        self.value: Any = None  # the handler's result, when its first step returned

    def cancel(self, msg: Any = None) -> bool:
        return self.task.cancel(msg) if self.task is not None else False

    if sys.version_info >= (3, 11):  # what asyncio.timeout and TaskGroup call (Python 3.11+)
        def cancelling(self) -> int:
            return self.task.cancelling() if self.task is not None else 0

        def uncancel(self) -> int:
            return self.task.uncancel() if self.task is not None else 0

    def done(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.task.get_name() if self.task is not None else "cxlrpc-handler"

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()


def _take_back(view: memoryview) -> None:
    """End a lent body's view once its handler returned: a handler that kept it gets an error
    on use, not bytes of a later request (views it derived stay its own to drop)."""
    try:
        view.release()
    except BufferError:  # the handler still exports it (say, np.frombuffer): it must not
        pass


def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel a call's task once it has started: a task cancelled before its first step never
    runs its body, so its handler's cleanup and the call's bookkeeping would be skipped (a
    CANCEL frame can come in the same batch as its request)."""
    task.get_loop().call_soon(task.cancel)


async def _ready(value: Any) -> Any:
    """An awaitable of ``value`` (a stream handler's replies, when no interceptor makes them)."""
    return value


def _handler_context(call: HandlerContext) -> contextvars.Context:
    """A context of the handler's own (as a task would have), where ``context()`` holds."""
    ctx = contextvars.copy_context()
    ctx.run(_current_call.set, call)
    return ctx


def _current_tasks() -> dict[Any, Any] | None:
    """asyncio's dict of each loop's current task, when ``current_task``, ``_enter_task`` and
    ``_leave_task`` all read and write that one dict (the C accelerator of Python 3.10-3.13):
    the native dispatcher then swaps tasks in it directly. None elsewhere (it calls them)."""
    try:
        import _asyncio
    except ImportError:
        return None
    tasks = getattr(_asyncio, "_current_tasks", None)
    if (type(tasks) is dict and tasks is getattr(asyncio.tasks, "_current_tasks", None)
            and _enter_task is getattr(_asyncio, "_enter_task", None)
            and _leave_task is getattr(_asyncio, "_leave_task", None)):
        return tasks
    return None


def _first_step(coro: Any, eager: _EagerTask, loop: asyncio.AbstractEventLoop,
                call: HandlerContext) -> Any:
    """In the handler's context, where ``context()`` becomes ``call``: ``coro.send(None)``
    with ``eager`` as ``loop``'s current task (the reader's, if any, restored): what it yields, or
    _RETURNED with its result in ``eager.value`` (caught here, the StopIteration costs no
    traceback through the callers' frames)."""
    _current_call.set(call)
    reader = _current_task(loop)  # None in a loop callback (a followed request's last step)
    if reader is not None:
        _leave_task(loop, reader)
    _enter_task(loop, eager)  # type: ignore[arg-type]  # (a stand-in: see _EagerTask)
    try:
        return coro.send(None)
    except StopIteration as done:
        eager.value = done.value
        return _RETURNED
    finally:
        _leave_task(loop, eager)  # type: ignore[arg-type]
        if reader is not None:
            _enter_task(loop, reader)


async def _intercepted(chain: Sequence[ServerInterceptor], m: _Method | None, f: fr.Frame,
                       call: HandlerContext, arg: Any = _UNDECODED) -> Any:
    """The interceptors, first outermost, around the handler."""

    def next_at(i: int) -> Awaitable[Any]:
        if i == len(chain):
            return _handle(m, f, arg)
        return chain[i](call, lambda: next_at(i + 1))

    return await next_at(0)


async def _handle(m: _Method | None, f: fr.Frame, arg: Any) -> Any:
    """The innermost step of an intercepted call: decode the request (unless ``arg`` is
    it already) and run the handler; a failure is raised, so that the interceptors see
    it. A stream handler's result is its stream of replies, not yet iterated."""
    if m is None:
        raise Unimplemented(f"unknown method {f.method!r}")
    if arg is not _UNDECODED:
        args: tuple[Any, ...] = () if arg is _NO_ARG else (arg,)
    else:
        try:
            args = (fr.decode_body(f.flags, f.body, m.arg_type),) if m.takes_arg else ()
        except Exception as exc:  # DecodeError, ValidationError, RecursionError on deep nesting
            raise InvalidArgument(f"bad request for {f.method!r}: {exc}") from None
    if m.streaming:
        return m.fn(*args)
    if m.blocking:
        run = functools.partial(contextvars.copy_context().run, m.fn, *args)
        return await asyncio.get_running_loop().run_in_executor(None, run)
    result = m.fn(*args)
    if inspect.iscoroutine(result):
        result = await result
    return result
