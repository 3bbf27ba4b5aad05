"""mypy sees the client's calls typed by their ``response_type``: ``call`` returns it, streams
yield it (``StreamCall`` and the server-streaming iterator are generic in their item type),
and without one the result is ``Any``; both client channels implement ``ClientTransport``."""
from __future__ import annotations

from pathlib import Path

import pytest

USAGE = Path(__file__).with_name("typing") / "client_usage.py"


def test_calls_and_streams_are_typed_by_their_response_type(monkeypatch):
    mypy = pytest.importorskip("mypy.api")
    monkeypatch.setenv("MYPYPATH", str(USAGE.parents[2]))  # the checkout: cxlrpc's source
    out, err, _ = mypy.run(["--no-incremental", "--follow-imports=silent", "--cache-dir", "/dev/null",
                            str(USAGE)])
    assert "cxlrpc" not in err and "Cannot find" not in out, (out, err)  # it saw the real types
    revealed = {}
    for line in out.splitlines():
        if "client_usage.py:" in line and 'Revealed type is "' in line:
            revealed[int(line.split(":")[1])] = line.split('Revealed type is "')[1].rstrip('"')
    expected = {i: text.split("# R: ")[1].strip()
                for i, text in enumerate(USAGE.read_text().splitlines(), 1) if "# R: " in text}
    assert revealed == expected, out
    assert ": error:" not in out, out
