"""Every write-back and invalidate site of the native paths (``cxlrpc._flush.sites()``, the list
in cxlrpc/_flush_api.h) belongs to a family whose mutation test removes each of its sites in
turn and requires the removal to be caught; a site added outside those families fails here
until a mutation test covers it. The families' own tests check their tables hold every site of
the family: ring and caller (tests/test_flush_native_ring.py), kv block
(tests/test_flush_native_kv.py), heap and followed bodies (tests/test_flush_native_bodies.py)."""
from __future__ import annotations

import pytest

from cxlrpc.memory import _native

#: site prefix -> the test module whose mutation test covers every site with that prefix
FAMILIES = {"RING_": "test_flush_native_ring", "CALL_": "test_flush_native_ring",
            "BLOCK_": "test_flush_native_kv", "BODY_": "test_flush_native_bodies",
            "FOLLOW_": "test_flush_native_bodies"}
#: not native sites: no site (the skip value 0), and the Python callers' calls, whose sites are
#: the Python reference's own (tests/test_noncoherent.py, test_flush_rpc.py, test_flush_sites.py)
NOT_NATIVE = {"NONE", "PY"}

pytestmark = pytest.mark.skipif(_native is None, reason="cxlrpc._flush was not built")


def test_every_native_site_is_in_a_family_a_mutation_test_covers():
    sites = [name for name, _ in _native.sites()]
    assert sites[:2] == ["NONE", "PY"]  # skip = 0 means no site; 1 is the Python callers'
    orphans = [s for s in sites if s not in NOT_NATIVE and not s.startswith(tuple(FAMILIES))]
    assert not orphans, f"native flush sites no mutation test covers: {orphans}"
    assert len(set(sites)) == len(sites)


def test_every_site_says_what_it_protects():
    assert all(len(what) > 20 for _, what in _native.sites()[1:])


@pytest.mark.parametrize("module", sorted(set(FAMILIES.values())))
def test_each_family_has_its_mutation_test(module):
    """The modules named above exist and hold a mutation test over their family's sites."""
    mod = pytest.importorskip(module)
    names = [n for n in dir(mod) if n.startswith("test_") and ("mutation" in n or "remov" in n)]
    assert names, f"{module} has no mutation test"
