"""The layering of docs/internals.md holds: import-linter checks `.importlinter`'s contracts (no
import from a lower layer up, none between siblings, TYPE_CHECKING imports included), and every
module of both packages sits in a layer, so a new module cannot slip past the contracts."""
from __future__ import annotations

import configparser
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cxlrpc
import kvservice

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def _layered(container: str) -> set[str]:
    """The module names one `layers` contract places, for the package `container`."""
    config = configparser.ConfigParser()
    config.read(CONFIG)
    for section in config.sections():
        if config[section].get("type") == "layers" and config[section]["containers"].strip() == container:
            return {name for line in config[section]["layers"].split("\n")
                    for name in re.split(r"[|\s]+", line) if name}
    raise AssertionError(f"no layers contract for {container} in {CONFIG}")


def test_every_module_sits_in_a_layer() -> None:
    for package in (cxlrpc, kvservice):
        python_modules = {m.name for m in pkgutil.iter_modules(package.__path__)
                          if (Path(package.__path__[0]) / f"{m.name}.py").exists() or m.ispkg}
        missing = python_modules - _layered(package.__name__)
        assert not missing, f"{package.__name__} modules in no layer of {CONFIG.name}: {sorted(missing)}"


def test_no_import_runs_up_a_layer_or_in_a_circle() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is not installed (the test extra installs it)"
    done = subprocess.run([lint, "--config", str(CONFIG), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout
