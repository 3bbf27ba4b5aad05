"""Call the echo server from examples/echo_server.py with the asyncio and the blocking client."""
import time

import cxlrpc


async def main() -> None:
    async with cxlrpc.connect("shm://demo") as client:
        print("async:", await client.call("echo", b"hi", timeout=1.0))
        t0 = time.perf_counter()
        for _ in range(10_000):
            await client.call("echo", b"x" * 64, timeout=1.0)
        print(f"async: 10000 calls, {(time.perf_counter() - t0) / 10_000 * 1e6:.1f} us per call")
    with cxlrpc.connect_sync("shm://demo") as client:
        print("blocking:", client.call("echo", b"hi", timeout=1.0))


if __name__ == "__main__":
    cxlrpc.run(main())
