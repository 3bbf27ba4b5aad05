"""Status codes (gRPC's names and numbers) and the exceptions that carry them to callers."""
from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC's status codes, with gRPC's numbers (what crosses the wire)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


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


class Unknown(RpcError):
    code = StatusCode.UNKNOWN


class InvalidArgument(RpcError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(RpcError):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFound(RpcError):
    code = StatusCode.NOT_FOUND


class AlreadyExists(RpcError):
    code = StatusCode.ALREADY_EXISTS


class PermissionDenied(RpcError):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhausted(RpcError):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(RpcError):
    code = StatusCode.FAILED_PRECONDITION


class Aborted(RpcError):
    code = StatusCode.ABORTED


class OutOfRange(RpcError):
    code = StatusCode.OUT_OF_RANGE


class Unimplemented(RpcError):
    code = StatusCode.UNIMPLEMENTED


class Internal(RpcError):
    code = StatusCode.INTERNAL


class Unavailable(RpcError):
    code = StatusCode.UNAVAILABLE


class DataLoss(RpcError):
    code = StatusCode.DATA_LOSS


class Unauthenticated(RpcError):
    code = StatusCode.UNAUTHENTICATED


#: The exception class of every status code but OK.
ERRORS: dict[int, type[RpcError]] = {
    cls.code: cls for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound,
                              AlreadyExists, PermissionDenied, ResourceExhausted,
                              FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal,
                              Unavailable, DataLoss, Unauthenticated)
}


def error_for(code: int, message: str) -> RpcError:
    """The exception for a status code received on the wire; codes gRPC does not define (and
    OK, which is no error) become Unknown, naming the code."""
    cls = ERRORS.get(code)
    if cls is None:
        return Unknown(f"status {code}: {message}")
    return cls(message)
