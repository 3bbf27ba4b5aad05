"""A client frozen (SIGSTOP) in the middle of a followed body is reaped, other clients' traffic
reuses the heap meanwhile, and the frozen client resumes (SIGCONT): it must change no byte
another client reads (issue 40, item 1) and never return another's body as its own (item 2);
what it held is freed once it is dead (SIGKILL)."""
from __future__ import annotations

import asyncio
import os
import signal

import cxlrpc
from cxlrpc.heap import FOLLOW_HEADER, UNIT
from frozen_peers import frozen_client_main
from procs import CTX, made, stop, until

SIZE = 4 << 20  # a followed body (past FOLLOW_MIN), too big for a spare extent
EXTENT = (FOLLOW_HEADER + SIZE + UNIT - 1) // UNIT * UNIT


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _server(url: str) -> cxlrpc.Server:
    # room for two followed extents: the frozen client's and one other (so the others' traffic
    # must reuse the frozen client's once it is freed); reaped after 1 s without a heartbeat
    server = cxlrpc.Server(url, client_timeout=1.0, max_message_size=EXTENT, heap_size=2 * EXTENT)

    @server.method("echo")
    def echo(body: bytes) -> bytes:
        return body

    @server.method("make")
    def make(spec: list) -> bytes:
        return made(*spec)

    return server


class Bystander:
    """Another client's echo traffic, every byte checked."""

    def __init__(self, client: cxlrpc.Client) -> None:
        self.client, self.calls, self.wrong, self.errors = client, 0, 0, []

    async def run(self, stop_: asyncio.Event) -> None:
        while not stop_.is_set():
            body = os.urandom(SIZE)
            try:
                got = await self.client.call("echo", body, timeout=30)
            except cxlrpc.RpcError as exc:
                self.errors.append(repr(exc))
                continue
            self.calls += 1
            if got != body:
                self.wrong += sum(a != b for a, b in zip(got, body)) + abs(len(got) - len(body))


async def _frozen_then_resumed(url: str, how: str, traffic_after_resume: bool) -> None:
    server = _server(url)
    left: list[cxlrpc.Peer] = []
    server.on_disconnect(left.append)
    async with server:
        baseline = server._bodies.heap.used
        recv, send = CTX.Pipe(duplex=False)
        seed = 77
        proc = CTX.Process(target=frozen_client_main, args=(url, how, SIZE, seed, send), daemon=True)
        proc.start()
        try:
            assert await until(lambda: _stopped(proc.pid), 30), "the client never froze"
            assert await until(lambda: left, 10), "the frozen client was never reaped"
            async with cxlrpc.connect(url) as other:
                bystander, done = Bystander(other), asyncio.Event()
                traffic = asyncio.ensure_future(bystander.run(done))
                assert await until(lambda: bystander.calls >= 5 or traffic.done(), 30)
                if not traffic_after_resume:  # the heap holds a complete body of the other's
                    done.set()
                    await traffic
                os.kill(proc.pid, signal.SIGCONT)
                assert await asyncio.to_thread(recv.poll, 30), "the resumed client never answered"
                outcome = recv.recv()
                done.set()
                await traffic
                assert bystander.calls >= 5
                assert bystander.wrong == 0 and not bystander.errors, (
                    f"{bystander.wrong} wrong bytes, errors {bystander.errors[:3]}, in {bystander.calls} calls")
            # the resumed client never takes another's bytes as its own (nor its own: it was reaped)
            assert outcome[0] == "error", f"the resumed client got a body ({outcome[1] == made(SIZE, seed)}: its own)"
            assert outcome[1] == "Unavailable", outcome
            assert server._bodies.heap.used >= EXTENT  # quarantined while the frozen process lives
            os.kill(proc.pid, signal.SIGKILL)
            assert await until(lambda: server._bodies.heap.used == baseline, 10), (server._bodies.heap.used, baseline)
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(stop, proc)
            recv.close()
            send.close()


async def test_a_writer_frozen_mid_request_changes_no_byte_others_read(name: str) -> None:
    """Item 1: frozen after the first chunk of its followed request; resumed while the others'
    replies go through the heap it wrote into: none of their bytes change."""
    await _frozen_then_resumed(f"shm://{name}", "write", traffic_after_resume=True)


async def test_a_reader_frozen_mid_reply_never_returns_anothers_body(name: str) -> None:
    """Item 2: frozen as it begins to follow its reply; resumed once another client's body
    fills the heap: it raises Unavailable, never returns that body as its own."""
    await _frozen_then_resumed(f"shm://{name}", "read", traffic_after_resume=False)
