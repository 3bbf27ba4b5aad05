"""Interceptors on both sides of a call: logging, and an auth token sent as call metadata.

``python examples/interceptors.py [URL]`` serves and calls in one process, prints what the
interceptors saw, and exits (status 0 when the server let the right token in and kept the
wrong one out).
"""
import sys
import time
from typing import Any, Awaitable, Callable

import cxlrpc

TOKEN = "s3cret"


# ---------------------------------------------------------------- server side
async def log_calls(call: cxlrpc.HandlerContext, next: Callable[[], Awaitable[Any]]) -> Any:
    """Log every call with its peer, outcome and duration (errors too: it is outermost)."""
    t0 = time.perf_counter()
    try:
        result = await next()
    except cxlrpc.RpcError as exc:
        print(f"server: {call.method} from slot {call.peer.slot} -> {exc.code.name} ({exc.message})")
        raise
    print(f"server: {call.method} from slot {call.peer.slot} -> OK in "
          f"{(time.perf_counter() - t0) * 1e6:.0f} us")
    return result


async def require_token(call: cxlrpc.HandlerContext, next: Callable[[], Awaitable[Any]]) -> Any:
    """Refuse calls without the right bearer token: the handler never runs for them."""
    if call.metadata.get("authorization") != f"Bearer {TOKEN}":
        raise cxlrpc.Unauthenticated("missing or wrong token")
    return await next()


# ---------------------------------------------------------------- client side
def bearer(token: str) -> cxlrpc.ClientInterceptor:
    """A client interceptor that sends ``token`` with every call."""
    async def add_token(method: str, arg: Any, metadata: dict, next: Callable) -> Any:
        metadata["authorization"] = f"Bearer {token}"
        return await next(method, arg, metadata)
    return add_token


async def log_replies(method: str, arg: Any, metadata: dict, next: Callable) -> Any:
    """Log each call's result or error as the caller sees it."""
    try:
        result = await next(method, arg, metadata)
    except cxlrpc.RpcError as exc:
        print(f"client: {method}({arg!r}) failed: {exc}")
        raise
    print(f"client: {method}({arg!r}) -> {result!r}")
    return result


async def main(url: str) -> int:
    server = cxlrpc.Server(url, slots=4, interceptors=[log_calls, require_token])

    @server.method("greet")
    def greet(name: str) -> str:
        trace = cxlrpc.context().metadata.get("trace-id", "-")
        return f"hello {name} (trace {trace})"

    async with server:
        async with cxlrpc.connect(url, interceptors=[log_replies, bearer(TOKEN)]) as client:
            await client.call("greet", "ada", timeout=1.0, metadata={"trace-id": "t-1"})
        async with cxlrpc.connect(url, interceptors=[log_replies, bearer("guess")]) as intruder:
            try:
                await intruder.call("greet", "eve", timeout=1.0)
            except cxlrpc.Unauthenticated:
                return 0
    print("the wrong token was let in", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(cxlrpc.run(main(sys.argv[1] if len(sys.argv) > 1 else "shm://interceptors-demo")))
