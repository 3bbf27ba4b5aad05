"""Status codes (gRPC's names) and the exceptions that carry them to callers."""
from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcError(Exception):
    """A call failed with a status ``code`` and a human-readable ``message``."""

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str = "", code: StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}" if self.message else self.code.name


class Cancelled(RpcError):
    code = StatusCode.CANCELLED


class InvalidArgument(RpcError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(RpcError):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFound(RpcError):
    code = StatusCode.NOT_FOUND


class ResourceExhausted(RpcError):
    code = StatusCode.RESOURCE_EXHAUSTED


class Internal(RpcError):
    code = StatusCode.INTERNAL


class Unavailable(RpcError):
    code = StatusCode.UNAVAILABLE


_BY_CODE: dict[int, type[RpcError]] = {
    cls.code: cls for cls in (Cancelled, InvalidArgument, DeadlineExceeded, NotFound,
                              ResourceExhausted, Internal, Unavailable)
}


def error_for(code: int, message: str) -> RpcError:
    """The exception for a status code received on the wire (unknown codes become Internal)."""
    try:
        status = StatusCode(code)
    except ValueError:
        return Internal(f"unknown status {code}: {message}")
    return _BY_CODE.get(status, RpcError)(message, status)
