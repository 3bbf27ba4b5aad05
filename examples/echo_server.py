"""Echo server on shm://demo. Run it, then examples/echo_client.py in a second terminal; Ctrl-C stops it."""
import asyncio
import signal

import cxlrpc


async def main() -> None:
    server = cxlrpc.Server("shm://demo")

    @server.method("echo")
    async def echo(payload: bytes) -> bytes:
        return payload

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    async with server:
        print("serving echo on shm://demo (Ctrl-C to stop)")
        await server.serve_forever()


if __name__ == "__main__":
    cxlrpc.run(main())
