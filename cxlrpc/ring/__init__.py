"""Lock-free ring buffers over shared memory: pure data structures, no I/O."""
from .record import max_payload, ring_size
from .spsc import SpscRing
from .mpsc import ClaimRevoked, MpscRing

__all__ = ["SpscRing", "MpscRing", "ClaimRevoked", "ring_size", "max_payload"]
