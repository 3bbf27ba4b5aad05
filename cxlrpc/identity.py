"""Host identity: which peers share this process's kernel, PID namespace and network namespace.

Peers that map one region may live on other hosts (a CXL pool), in other containers of one
pod (another PID namespace) or in guests of one machine; host names and PIDs prove nothing
across them.  The identity hashes the kernel's boot id with the inodes of this process's PID
and network namespaces, so two processes have equal identities only when a PID one of them
writes names a process the other can see (``kill(pid, 0)`` means something) and an abstract
Unix socket one binds is reachable by the other.  Host-local accelerators (PID checks,
wake-up sockets) are used only between peers of equal identity.
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache

#: The identity word written in headers and slots is never zero (zero means "not written").
IDENTITY_MASK = (1 << 63) - 1


def _namespace(kind: str) -> str:
    try:
        st = os.stat(f"/proc/self/ns/{kind}")
    except OSError:
        return "?"
    return f"{st.st_dev}:{st.st_ino}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "?"


@lru_cache(maxsize=1)
def _identity(pid: int) -> int:
    text = f"{_boot_id()}|pid:{_namespace('pid')}|net:{_namespace('net')}".encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return (digest & IDENTITY_MASK) or 1


def host_identity() -> int:
    """This process's identity word (nonzero, 63 bits; recomputed in a forked child, whose
    namespaces may differ from its parent's after ``unshare``)."""
    return _identity(os.getpid())


def same_host(identity: int) -> bool:
    """True when ``identity`` (read from a region) is this process's: PIDs and wake-up
    sockets of that peer are meaningful here."""
    return identity == host_identity()
