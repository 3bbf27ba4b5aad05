"""The docs site (mkdocs.yml, docs/, the API reference rendered from the docstrings) builds with
``mkdocs build --strict``: a warning (a broken link or anchor, a page left out of the nav, a
docstring griffe cannot read, a reference to a name that is gone) fails it. And the README's
relative links lead to files that exist (the README is not part of the site)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_docs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0 and not warnings, done.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "cxlrpc" / "index.html").read_text()
    assert "cxlrpc.Server" in reference and "serve_forever" in reference  # the docstrings made it in


def test_readme_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
