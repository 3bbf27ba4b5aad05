"""The package as a user gets it. `python -m build` makes an sdist and a wheel from a copy of
the checkout: the wheel holds the native modules, the py.typed markers and the Mooncake shim
(not bench, not the C sources), the sdist the C sources and headers it builds from. The wheel,
installed into a fresh venv outside the source tree, runs an echo and a kv round trip from
there; and the sdist, installed with the C compiler made unavailable (CC=/bin/false), still
installs, warns once on import and runs both round trips on the reference paths.

Offline, as CI may be: the build runs without isolation (the running interpreter's setuptools),
and each venv sees the running interpreter's site-packages as a plain path entry for the
dependencies, so their .pth files (an editable install of this checkout among them) are not
processed: the only cxlrpc a venv can import is the one installed into it, which the report of
every loaded module's file checks."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)  # a build, two venvs, two installs: ~30 s here, more under load
ROOT = Path(__file__).resolve().parents[1]
NATIVES = ("cxlrpc._atomic", "cxlrpc._flush", "cxlrpc._ring", "cxlrpc._frame", "cxlrpc._dispatch",
           "kvservice._block")
HEADERS = ("cxlrpc/_copy.h", "cxlrpc/_follow.h", "cxlrpc/_ring_api.h")
TYPED = ("cxlrpc/py.typed", "kvservice/py.typed")
SHIM = ("kvservice/compat/shim/mooncake/__init__.py", "kvservice/compat/shim/mooncake/store.py")
ECHO = ["across processes", "in process"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel `python -m build` makes (the wheel built from the sdist)."""
    tmp = tmp_path_factory.mktemp("build")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache", ".hypothesis"))
    out = tmp / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def _venv(path: Path) -> Path:
    """A fresh venv (its python) whose only cxlrpc is what gets installed into it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _environ(**extra: str) -> dict[str, str]:
    """This process's environment without what points Python at the checkout or off the native
    paths (PYTHONPATH, CXLRPC_NO_NATIVE), with ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CXLRPC"))}, **extra}


def _install(python: Path, what: Path, **env: str) -> str:
    """pip install ``what`` into the venv, from no index (its dependencies are already there)."""
    proc = subprocess.run([python, "-m", "pip", "install", "-v", "--no-index", "--no-build-isolation", str(what)],
                          capture_output=True, text=True, timeout=600, env=_environ(**env), cwd=python.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _run_check(python: Path, venv: Path, name: str, tmp_path: Path) -> dict[str, Any]:
    """installed_check.py run by the venv's python in an empty directory outside the tree; its
    report, after checking that everything of cxlrpc and kvservice it loaded is the venv's."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(ROOT / "tests" / "installed_check.py", work)
    proc = subprocess.run([python, "-I", "installed_check.py", name], cwd=work, env=_environ(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    assert report["echo"] == ECHO and report["kv"] == [True, True, True]
    outside = {n: f for n, f in report["modules"].items() if f is None or not f.startswith(str(venv) + os.sep)}
    assert not outside, f"modules not loaded from the venv: {outside}"
    shim = Path(report["shim"])
    assert shim.is_relative_to(venv) and (shim / "mooncake" / "store.py").is_file()
    return report


def test_the_sdist_and_the_wheel_hold_what_they_should(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        sdist = {n.removeprefix(top + "/") for n in tar.getnames()}
    for path in (*HEADERS, *TYPED, *SHIM, "setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        assert path in sdist, path
    assert {m.replace(".", "/") + ".c" for m in NATIVES} <= sdist
    assert not [n for n in sdist if n.split("/")[0] in ("tests", "docs", "bench", ".ci") or n.endswith((".so", ".pyc"))]
    with zipfile.ZipFile(dist["wheel"]) as whl:
        wheel = set(whl.namelist())
    built = {n.split(".")[0].replace("/", ".") for n in wheel if n.endswith(".so")}
    assert built == set(NATIVES)
    stubs = [str(p.relative_to(ROOT)) for package in ("cxlrpc", "kvservice") for p in (ROOT / package).rglob("*.pyi")]
    for path in (*TYPED, *SHIM, *stubs, "cxlrpc/_atomic_ref.py"):
        assert path in wheel, path
    assert not [n for n in wheel if n.startswith("bench/") or n.endswith((".c", ".h"))]


def test_the_wheel_runs_from_a_venv_outside_the_tree(dist: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Installed from the wheel: echo and kv work, every module (the native ones too) is the
    venv's, and nothing warned."""
    venv = tmp_path / "venv"
    python = _venv(venv)
    _install(python, dist["wheel"])
    report = _run_check(python, venv, name, tmp_path)
    assert set(NATIVES) <= set(report["modules"]) and report["atomics"] == "cxlrpc._atomic"
    assert report["warnings"] == []


def test_without_a_compiler_the_sdist_installs_and_runs_on_the_reference_paths(
        dist: dict[str, Path], tmp_path: Path, name: str) -> None:
    """CC=/bin/false: every extension fails to build, pip installs anyway, the import warns
    once (what runs slower, what is unavailable), and echo and kv work on the reference paths
    with libatomic standing in for cxlrpc._atomic."""
    venv = tmp_path / "venv"
    python = _venv(venv)
    log = _install(python, dist["sdist"], CC="/bin/false", CXX="/bin/false")
    for native in NATIVES:
        assert f'building extension "{native}" failed' in log
    report = _run_check(python, venv, name, tmp_path)
    assert not set(NATIVES) & set(report["modules"]) and report["atomics"] == "cxlrpc._atomic_ref"
    (category, filename, message), = report["warnings"]
    assert category == "RuntimeWarning" and filename.endswith("cxlrpc/memory.py")
    for part in ("without its native module cxlrpc._atomic", "libatomic", "the rings", "frame decoding",
                 "call dispatch", "kvservice's leased blocks", "coherence='flush' is unavailable",
                 "apt-get install gcc"):
        assert part in message, part
