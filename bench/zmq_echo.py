"""Reference row: pyzmq REQ/REP echo over ipc:// (blocking sockets)."""
from __future__ import annotations

import os
from multiprocessing.connection import Connection

import zmq


def _unlink_ipc(address: str) -> None:
    try:
        os.unlink(address[len("ipc://"):])
    except FileNotFoundError:
        pass


def serve(conn: Connection, address: str, **_: object) -> None:
    """REP socket echoing every message until the parent says stop (polled with the socket)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.linger = 0
    try:
        sock.bind(address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        conn.send(("ready", {"pid": os.getpid(), "address": address}))
        while True:
            events = dict(poller.poll())
            if sock in events:
                sock.send(sock.recv(copy=False), copy=False)
            if conn.fileno() in events:
                break
    finally:
        sock.close(0)
        ctx.term()
        _unlink_ipc(address)


class ZmqClient:
    """Blocking REQ socket: ``client.call(payload) -> bytes``."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.linger = 0
        self.sock.connect(address)

    def call(self, payload: bytes) -> bytes:
        self.sock.send(payload, copy=len(payload) < 65536)
        return self.sock.recv()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def open_sync(address: str, **_: object) -> ZmqClient:
    """Connect a REQ client."""
    return ZmqClient(address)
