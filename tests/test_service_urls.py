"""The service URLs the engine adapters take (``kvservice.integrations.parse_service_url``);
the adapters themselves run against the real engines in the engines suite
(tests/test_engines_*.py)."""
from __future__ import annotations

import pytest

from kvservice.integrations import parse_service_url


def test_service_urls():
    assert parse_service_url("kvservice://kv").url == "shm://kv"
    u = parse_service_url("kvservice://file/dev/shm/x.region?namespace=m&ttl=30&lease_s=5")
    assert (u.url, u.namespace, u.ttl, u.lease_s) == ("file:///dev/shm/x.region", "m", 30.0, 5.0)
    assert parse_service_url("kvservice://?url=file:///tmp/r").url == "file:///tmp/r"
    assert parse_service_url("kvservice://?url=shm://a&namespace=n").namespace == "n"
    assert parse_service_url("shm://kv").url == "shm://kv"
    assert parse_service_url("file:///tmp/r?namespace=q").url == "file:///tmp/r"
    for bad in ("redis://x", "kvservice://", "kvservice://a/b", "kvservice://a?url=shm://b",
                "kvservice://a?bogus=1", "kvservice://a?ttl=zero", "kvservice://a?ttl=-1",
                "kvservice://file/rel?x=1", "kvservice://bad name"):
        with pytest.raises(Exception):
            parse_service_url(bad)
