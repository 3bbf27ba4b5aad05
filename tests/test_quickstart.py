"""The README's quickstart: its two code blocks are the example files, and, copied into two
files elsewhere as a newcomer would, they serve and call as written."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ("echo_server.py", "echo_client.py")


def _readme_block(name: str) -> str:
    """The python block that follows the README's "`examples/NAME`:" line."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"`examples/{re.escape(name)}`:\n\n```python\n(.*?)```", text, re.S)
    assert match, f"README.md shows no block for examples/{name}"
    return match.group(1)


@pytest.mark.parametrize("name", FILES)
def test_readme_blocks_are_the_example_files(name):
    assert _readme_block(name) == (ROOT / "examples" / name).read_text()


def test_quickstart_copied_into_two_files_runs_as_written(tmp_path):
    if os.path.exists("/dev/shm/cxlrpc.demo"):
        pytest.skip("shm://demo is in use on this machine (someone's quickstart is running)")
    for name in FILES:
        (tmp_path / name).write_text(_readme_block(name))
    server = subprocess.Popen([sys.executable, "echo_server.py"], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert "serving echo on shm://demo" in server.stdout.readline()  # printed once serving
        client = subprocess.run([sys.executable, "echo_client.py"], cwd=tmp_path, text=True,
                                capture_output=True, timeout=60)
        assert client.returncode == 0, client.stderr[-2000:]
        assert client.stdout.splitlines() == ["async: b'hi'", "blocking: b'hi'"]
        server.send_signal(signal.SIGINT)  # Ctrl-C: the server closes cleanly
        assert server.wait(30) == 0, server.stderr.read()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        server.stderr.close()
    assert not os.path.exists("/dev/shm/cxlrpc.demo"), "the server left its region behind"
