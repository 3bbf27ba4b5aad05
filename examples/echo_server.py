"""Echo server on shm://demo: run it, then echo_client.py in a second terminal; Ctrl-C stops it."""
import asyncio
import signal

import cxlrpc


async def main() -> None:
    server = cxlrpc.Server("shm://demo")  # options: slots=, max_message_size=, coherence=, ...

    @server.method("echo")  # async or plain functions
    async def echo(payload: bytes) -> bytes:
        return payload

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: loop.create_task(server.close()))
    async with server:  # creates the region, serves in the background
        print("serving echo on shm://demo (Ctrl-C to stop)", flush=True)
        await server.serve_forever()  # returns after server.close(); the region is removed


if __name__ == "__main__":
    cxlrpc.run(main())
