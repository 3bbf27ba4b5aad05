"""Types of ``cxlrpc._frame`` (cxlrpc/_frame.c): cxlrpc.frame's decode in C, for frames without
call metadata (those go to the reference it was configured with)."""
from collections.abc import Callable, Set
from typing import Any

from typing_extensions import Buffer

def configure(frame_type: Callable[..., object], frame_error: type[Exception], method_cache: dict[bytes, str],
              method_name: Callable[[bytes], str], reference_decode: Callable[..., object], /) -> None:
    """Bind the reference's pieces: decode builds ``frame_type(kind, flags, status, slot, gen,
    call_id, timeout, method, body)``."""

def decode(view: Buffer, lend: Set[str] | None = None, /) -> Any:
    """The frame_type instance configure() named (cxlrpc.frame.Frame; typed there, where
    cxlrpc.frame binds ``decode``: this stub cannot import it without an import circle)."""
