"""Every fenced code block of README.md and docs/**/*.md runs, so the docs cannot rot.

How a page's blocks run (the convention for authors is in docs/internals.md, "Docs that run"):

- ``python`` blocks run in order in one *session* per page: one process (tests/docs_session.py)
  with one namespace and one asyncio loop, top-level ``await`` allowed, the loop kept running
  between blocks. So a page's blocks build on each other, and a server a block starts keeps
  serving the blocks after it until the page closes it.
- An HTML comment on the line before a block changes how it runs:
  ``<!-- docs-test: subprocess -->`` runs a python block as a script of its own (a fresh
  interpreter: a synchronous program, say); ``<!-- docs-test: background URL -->`` is the
  fixture for a block that needs a server in another process: the block (python or bash) is
  started in a process of its own, the page goes on once a server answers ``cxlrpc.health`` at
  URL, and at the page's end the process gets SIGINT and must be gone within 30 s.
- ``bash`` blocks run with ``bash -euo pipefail`` in the repository (every ``python`` there is
  this interpreter, with this checkout first on ``PYTHONPATH``).
- ``yaml`` blocks (engine configurations) are parsed, each plugin's ``module_path`` must define
  its ``class_name`` and each ``*.url`` must parse as a kvservice URL.
- ``text`` blocks (output) are exempt. Any other language, or a fence without one, fails.
- Names are made unique: every ``shm://NAME`` / ``sim://NAME`` / ``kvservice://NAME`` and
  ``--name NAME`` of a page is renamed with this run's prefix, so pages run beside other tests
  and other checkouts on one machine, and conftest's leak check sees every segment they make.
- The few blocks that cannot run in a test are in NOT_RUN below with the reason, keyed by page
  and first line; an entry that matches no block fails, and so does a block that neither runs
  nor is listed.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import PREFIX

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
BLOCK_TIMEOUT = 120.0  # seconds; a block under a loaded 2-core machine, a server start included

# (page, first line of the block) -> why no test runs it
NOT_RUN = {
    ("README.md", "python -m pip install -e '.[bench]' && python -m bench        # the benchmark against gRPC, prints its tables"):
        "installs the package and runs the 12-minute benchmark; .ci/run runs the install and the suite",
    ("docs/benchmark.md", "python -m bench --huge                  # every section, 16 MiB payloads too: ~12 min here"):
        "the benchmark itself: minutes of both cores; tests/test_bench_procs.py runs its processes",
    ("README.md", "python -m sglang.launch_server --model-path … --enable-hierarchical-cache \\"):
        "needs SGLang and a model; tests/test_engines_sglang.py drives SGLang's HiCache with this backend",
    ("docs/engines.md", "python -m sglang.launch_server --model-path … --enable-hierarchical-cache \\"):
        "needs SGLang and a model; tests/test_engines_sglang.py drives SGLang's HiCache with this backend",
    ("docs/engines.md", "export PYTHONPATH=$(python -m kvservice mooncake-shim-path):$PYTHONPATH"):
        "needs SGLang and a model; tests/test_engines_sglang_mooncake.py runs SGLang's mooncake backend on the shim",
    ("docs/engines.md", "bash .ci/install-engines"):
        "installs torch, LMCache, SGLang, Mooncake and a vLLM venv (~3 GB, minutes); .ci/run runs it",
    ("docs/peers.md", "CXLRPC_FUZZ_SEED=12345 python -m pytest tests/test_fuzz_region.py -k reply-ring -s"):
        "runs the region fuzz, a pytest run inside this one (a minute and more); the default suite runs it",
    ("docs/internals.md", "bash .ci/run"):
        "the CI command: installs Debian packages and runs every suite (tens of minutes)",
}
# blocks another test runs as they are
RUN_ELSEWHERE = {
    ("README.md", '"""Echo server on shm://demo: run it, then echo_client.py in a second terminal; Ctrl-C stops it."""'):
        "tests/test_quickstart.py (copied into a file, served in a process of its own)",
    ("README.md", '"""Call echo_server.py\'s echo with the asyncio client, then with the blocking one."""'):
        "tests/test_quickstart.py (copied into a file, run against the server)",
}
EXEMPT = {"text"}
SHELLS = {"bash", "sh", "shell"}


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the block's first line of code
    lang: str
    code: str
    directive: str  # what a `<!-- docs-test: ... -->` comment right before it says, or ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.page, self.code.strip().splitlines()[0].strip() if self.code.strip() else "")

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def blocks(page: str) -> list[Block]:
    """The page's fenced and indented code blocks, in order, with their directives."""
    tokens = MarkdownIt("commonmark").parse((ROOT / page).read_text())
    found = []
    for i, tok in enumerate(tokens):
        if tok.type in ("fence", "code_block") and tok.map:
            before = tokens[i - 1] if i and tokens[i - 1].type == "html_block" else None
            m = re.search(r"<!--\s*docs-test:\s*(.*?)\s*-->", before.content) if before else None
            lang = tok.info.split()[0] if tok.type == "fence" and tok.info.strip() else ""
            start = tok.map[0] + (2 if tok.type == "fence" else 1)
            found.append(Block(page, start, lang, tok.content, m.group(1) if m else ""))
    return found


def uniquely_named(text: str) -> str:
    """The block with every region name prefixed by this run's (see the module docstring)."""
    p = PREFIX + "docs-"
    text = re.sub(r"\b(shm|sim)://(?=[A-Za-z0-9_])", rf"\1://{p}", text)
    text = re.sub(r"\bkvservice://(?!file/|\?)(?=[A-Za-z0-9_])", f"kvservice://{p}", text)
    return re.sub(r"(--name[ =])(?=[A-Za-z0-9_])", rf"\g<1>{p}", text)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e["PATH"]])  # `python` is ours
    return e


def how(block: Block) -> str:
    """What the test does with a block: run, background, elsewhere, not-run, exempt."""
    if block.lang in EXEMPT:
        return "exempt"
    if block.key in RUN_ELSEWHERE:
        return "elsewhere"
    if block.key in NOT_RUN:
        return "not-run"
    if block.lang == "python" or block.lang in SHELLS or block.lang == "yaml":
        return "background" if block.directive.startswith("background") else "run"
    raise AssertionError(f"{block}: no runner for a block {'in ' + block.lang if block.lang else 'without a language'}"
                         " (tag it python, bash, yaml or text, or list it in NOT_RUN with the reason)")


class Page:
    """A page's run: its session, its background processes, its scratch directory."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.session: subprocess.Popen[str] | None = None
        self.replies = -1
        self.log = tmp / "session.log"
        self.background: list[tuple[Block, subprocess.Popen[bytes], Path]] = []

    def run(self, block: Block) -> None:
        code = uniquely_named(block.code)
        if block.lang == "yaml":
            check_yaml(block, code)
        elif how(block) == "background":
            self.start_background(block, code)
        elif block.lang in SHELLS:
            self.run_process(block, ["bash", "-euo", "pipefail", "-c", code])
        elif block.directive == "subprocess":
            script = self.tmp / f"block_{block.line}.py"
            script.write_text(code)
            self.run_process(block, [sys.executable, str(script)])
        else:
            self.run_in_session(block, code)

    def run_process(self, block: Block, argv: list[str]) -> None:
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr
            raise AssertionError(f"{block} still ran after {BLOCK_TIMEOUT} s:\n{err}") from None
        assert done.returncode == 0, f"{block} exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"

    def run_in_session(self, block: Block, code: str) -> None:
        if self.session is None:
            self.replies, w = os.pipe()
            with open(self.log, "w") as log:
                self.session = subprocess.Popen(
                    [sys.executable, str(ROOT / "tests" / "docs_session.py"), str(w)], cwd=ROOT, env=env(),
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, pass_fds=(w,))
            os.close(w)
        assert self.session.stdin is not None
        self.session.stdin.write(json.dumps({"page": str(ROOT / block.page), "line": block.line, "code": code}) + "\n")
        self.session.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], BLOCK_TIMEOUT)
        line = os.read(self.replies, 1 << 20).decode() if ready else ""
        assert line, f"{block} gave no answer within {BLOCK_TIMEOUT} s (or its session died):\n{self.log.read_text()[-4000:]}"
        reply = json.loads(line)
        assert reply["ok"], f"{block} failed:\n{reply['error']}\noutput:\n{self.log.read_text()[-2000:]}"

    def start_background(self, block: Block, code: str) -> None:
        url = uniquely_named(block.directive.split(maxsplit=1)[1])
        log = self.tmp / f"background_{block.line}.log"
        if block.lang == "python":
            (self.tmp / f"background_{block.line}.py").write_text(code)
            argv = [sys.executable, str(self.tmp / f"background_{block.line}.py")]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", code]
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.background.append((block, proc, log))
        import cxlrpc
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while True:
            assert proc.poll() is None, f"{block} exited with {proc.returncode} before serving:\n{log.read_text()[-4000:]}"
            try:
                with cxlrpc.connect_sync(url, wait_for_ready=0.5) as client:
                    if client.health(timeout=2.0) == "SERVING":
                        return
            except cxlrpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{block}: nothing served {url} within {BLOCK_TIMEOUT} s"

    def close(self) -> list[str]:
        """End the session, then the background processes; what went wrong, if anything."""
        problems = []
        if self.session is not None and self.session.stdin is not None:
            self.session.stdin.close()
            try:
                self.session.wait(30)
            except subprocess.TimeoutExpired:
                self.session.kill()
                self.session.wait()
                problems.append(f"the session did not end within 30 s:\n{self.log.read_text()[-2000:]}")
            os.close(self.replies)
        for block, proc, log in reversed(self.background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    problems.append(f"{block} did not stop within 30 s of SIGINT:\n{log.read_text()[-2000:]}")
            else:
                problems.append(f"{block} exited with {proc.returncode} before the page ended:\n{log.read_text()[-2000:]}")
        return problems


def check_yaml(block: Block, code: str) -> None:
    """An engine configuration: it parses, its plugin classes exist, its URLs parse."""
    import ast
    import importlib.util

    import yaml

    from kvservice.integrations import parse_service_url

    config = yaml.safe_load(code)
    assert isinstance(config, dict), f"{block} is not a mapping"
    extra = config.get("extra_config", {})
    for key, module in extra.items():
        if key.endswith(".module_path"):
            spec = importlib.util.find_spec(module)
            assert spec and spec.origin, f"{block}: no module {module}"
            defined = {n.name for n in ast.parse(Path(spec.origin).read_text()).body if isinstance(n, ast.ClassDef)}
            cls = extra[key.removesuffix("module_path") + "class_name"]
            assert cls in defined, f"{block}: {module} defines no class {cls}"
    urls = [v for k, v in extra.items() if k.endswith(".url")] + [v for k, v in config.items() if k == "remote_url"]
    assert urls, f"{block} names no kvservice URL"
    for u in urls:
        parse_service_url(u)


def test_every_block_runs_or_says_why_not() -> None:
    """No block is left out silently, and every NOT_RUN / RUN_ELSEWHERE entry is still a block."""
    seen = set()
    for page in PAGES:
        for block in blocks(page):
            assert block.lang, f"{block}: a fence without a language (an indented block?): use ```LANG"
            how(block)
            seen.add(block.key)
    stale = (set(NOT_RUN) | set(RUN_ELSEWHERE)) - seen
    assert not stale, f"listed blocks that no page has any more: {sorted(stale)}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang and b.key not in NOT_RUN and b.key not in RUN_ELSEWHERE
                                                           and b.lang not in EXEMPT for b in blocks(p))])
def test_page_blocks_run(page: str, tmp_path: Path) -> None:
    run = Page(tmp_path)
    try:
        for block in blocks(page):
            if how(block) in ("run", "background"):
                run.run(block)
    finally:
        problems = run.close()
    assert not problems, "\n".join(problems)
