"""Mooncake's codes, sizes and replication settings, as the facade answers them."""
from __future__ import annotations

import itertools
import logging
import os
from enum import IntEnum
from typing import Any

import cxlrpc
from cxlrpc.region import RegionError
from kvservice.client import KeyNotFound
from kvservice.pool import LeaseExpired

logger = logging.getLogger("kvservice.compat.mooncake")

#: Mooncake's default read lease (0.3.13's ``mooncake_master --default_kv_lease_ttl``, 10000 ms):
#: after a read, a non-forced remove of the object fails with OBJECT_HAS_LEASE for this long.
#: Mooncake sets it on the master; here it is the store's ``kv_lease_ttl`` keyword.
DEFAULT_KV_LEASE_TTL = 10.0

#: The shortest lease a copying read asks for: time enough to copy a value out of the pool.
_COPY_LEASE_S = 0.25
_DEFAULT_SEGMENT = 16 << 20      # DEFAULT_GLOBAL_SEGMENT_SIZE / DEFAULT_LOCAL_BUFFER_SIZE
_MIN_SEGMENT = 1 << 10           # MIN_SEGMENT_SIZE (1 KB); 0 means "contribute none"
_MAX_SEGMENT = 1 << 40           # MAX_SEGMENT_SIZE (1 TB)
_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "nvlink_intra", "hip", "barex",
                        "cxl", "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only"})
_SIZE_SUFFIXES = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
                  ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))


class ErrorCode(IntEnum):
    """Mooncake's ``ErrorCode`` values (mooncake-store/include/types.h) this facade returns."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10          # destination buffer too small
    NO_AVAILABLE_HANDLE = -200     # no space (kvservice ResourceExhausted / quota)
    INVALID_KEY = -400
    INVALID_PARAMS = -600          # bad argument, or the store is not set up
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706        # remove of a read-leased object without force
    LEASE_EXPIRED = -707           # a read's lease lapsed and its block was reused
    TRANSFER_FAIL = -800           # address not inside a registered buffer
    RPC_FAIL = -900                # the kvservice server is unreachable


def _code(exc: BaseException) -> int:
    """The Mooncake error code for a kvservice exception."""
    if isinstance(exc, KeyNotFound):
        return ErrorCode.OBJECT_NOT_FOUND
    if isinstance(exc, LeaseExpired):
        return ErrorCode.LEASE_EXPIRED
    if isinstance(exc, cxlrpc.ResourceExhausted):
        return ErrorCode.NO_AVAILABLE_HANDLE
    if isinstance(exc, (cxlrpc.InvalidArgument, ValueError, TypeError)):
        return ErrorCode.INVALID_PARAMS
    if isinstance(exc, cxlrpc.NotFound):
        return ErrorCode.OBJECT_NOT_FOUND
    if isinstance(exc, (cxlrpc.RpcError, RegionError, OSError)):
        return ErrorCode.RPC_FAIL
    return ErrorCode.INTERNAL_ERROR


def parse_segment_size(value: Any) -> int:
    """A size as Mooncake's ``mooncake_config._parse_segment_size`` reads it: an int, or a
    string like ``"16MB"``, ``"16 mb"``, ``"1.5GB"``, ``"4096"`` (binary units)."""
    if isinstance(value, bool):
        raise TypeError("a size must be an int or a string, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        if not s:
            raise ValueError("invalid segment size: empty string")
        for suffix, multiplier in _SIZE_SUFFIXES:
            if s.endswith(suffix):
                num = s[:-len(suffix)].strip()
                if not num:
                    raise ValueError(f"invalid segment size: missing number before {suffix!r}")
                return int(float(num) * multiplier)
        return int(float(s))
    return int(value)


class SoftPinAction(IntEnum):
    """Mooncake 0.3.13's soft-pin request of a put (``ReplicateConfig.soft_pin_action``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Mooncake 0.3.13's replication settings, with its fields and defaults. kvservice has one
    pool, so replicas, pins, groups and placement hints are accepted and ignored; what is
    checked, as Mooncake does: ``soft_pin_ttl_ms`` comes only with ``ENABLE``, and
    ``group_ids`` has one entry per key of the put."""

    __slots__ = ("replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
                 "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment", "preferred_segments",
                 "preferred_nof_segments", "prefer_alloc_in_same_node", "group_ids")

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] | None = None

    def problem(self, n_keys: int) -> str | None:
        """Why Mooncake would refuse a put of ``n_keys`` keys with this config, or None."""
        if self.group_ids is not None and len(self.group_ids) != n_keys:
            return f"{len(self.group_ids)} group_ids for {n_keys} keys (one per key)"
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            return "soft_pin_ttl_ms is only valid with soft_pin_action=ENABLE"
        if self.soft_pin_ttl_ms is not None and self.soft_pin_ttl_ms <= 0:
            return "soft_pin_ttl_ms must be positive"
        return None

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{SoftPinAction(self.soft_pin_action).name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(self.with_hard_pin)}, preferred_segments: "
                f"{self.preferred_segments}, group_ids: {self.group_ids} }}")

    __repr__ = __str__


def _config_code(config: Any, n_keys: int) -> int:
    """INVALID_PARAMS for a config Mooncake refuses for a put of ``n_keys`` keys, else OK."""
    problem = config.problem(n_keys) if isinstance(config, ReplicateConfig) else None
    if problem is not None:
        logger.error("invalid ReplicateConfig: %s", problem)
        return ErrorCode.INVALID_PARAMS
    return ErrorCode.OK


#: Mooncake's transfer engine takes its RPC port from [12300, 14300) (its tests check the range)
_PORT_BASE, _PORT_SPAN = 12300, 2000
_PORTS = itertools.count(os.getpid())


def _segment_port() -> int:
    """A port number for get_hostname's ``host:port`` in Mooncake's range (Mooncake: its
    transfer engine's port; here only a distinct name per store, since nothing listens)."""
    return _PORT_BASE + next(_PORTS) % _PORT_SPAN
