"""Call echo_server.py's echo with the asyncio client, then with the blocking one."""
import cxlrpc


async def main() -> None:
    async with cxlrpc.connect("shm://demo") as client:
        print("async:", await client.call("echo", b"hi", timeout=1.0))
    with cxlrpc.connect_sync("shm://demo") as client:  # for synchronous callers
        print("blocking:", client.call("echo", b"hi", timeout=1.0))


if __name__ == "__main__":
    cxlrpc.run(main())
