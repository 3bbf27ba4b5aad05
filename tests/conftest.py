"""Shared fixtures: unique region names, and a check that no test leaks a /dev/shm segment."""
from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import settings

from cxlrpc import memory
from cxlrpc.region import unlink_shm

# CI runs property tests with a fixed seed (a red CI must be reproducible, not a dice roll);
# local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

_counter = itertools.count()
PREFIX = f"t{os.getpid()}-"


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm")
            if n.startswith(("cxlrpc." + PREFIX, "cxlrpc.sim." + PREFIX))}


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """The engines suite's modules import the engine packages (``.ci/install-engines``), which
    the default run does not install: collect them only in a run that selects ``engines``."""
    if collection_path.name.startswith("test_engines_"):
        expr = " ".join((config.getoption("markexpr") or "").split())
        if "engines" not in expr or "not engines" in expr:
            return True
    return None


@pytest.fixture
def name() -> str:
    """A region name unique to this test (shm://NAME)."""
    return f"{PREFIX}{next(_counter)}"


@pytest.fixture
def scheme(request) -> str:
    """The memory a test's region is on: shm (coherent), or, in a module that sets
    ``MEMORIES = ("shm", "sim")``, each of those (sim: the simulator of memory without
    coherence, where every process has its own cache: flush mode)."""
    return getattr(request, "param", "shm")


@pytest.fixture
def url(name: str, scheme: str) -> str:
    return f"{scheme}://{name}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    memories = getattr(metafunc.module, "MEMORIES", None)
    if memories and "scheme" in metafunc.fixturenames:
        metafunc.parametrize("scheme", memories, indirect=True)


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail a test that leaves a segment of ours in /dev/shm (and remove it)."""
    before = _ours()
    yield
    leaked = _ours() - before
    for n in leaked:
        unlink_shm("/" + n)
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@pytest.fixture(scope="session")
def image():
    """The QEMU guest image (built once; see tests/guest_vm.py)."""
    import tempfile
    from pathlib import Path

    from guest_vm import image_or_skip

    return image_or_skip(Path(tempfile.gettempdir()))


@pytest.fixture(params=["native", "fallback"])
def copies(request, monkeypatch) -> str:
    """Followed bodies copied by the native module, and without it (its Python reference):
    the tests of followed requests and replies run with both."""
    if request.param == "native":
        if memory._native is None:
            pytest.skip("cxlrpc._flush was not built")
    else:
        monkeypatch.setattr(memory, "_native", None)
    return request.param
