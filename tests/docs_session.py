"""One page's python session for tests/test_docs_blocks.py: runs the blocks it is sent, in
order, in one namespace and one asyncio loop (top-level ``await`` allowed, as in ``python -m
asyncio``), and keeps the loop running between blocks so servers a block started keep serving.

Protocol: one JSON object a line on stdin, ``{"page": PATH, "line": N, "code": SOURCE}``; one
reply a line on the file descriptor named by argv[1], ``{"ok": true}`` or ``{"ok": false,
"error": TRACEBACK}``. A block's own output goes to stdout/stderr. End of input ends the loop.
"""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import sys
import traceback


async def serve(reply_fd: int) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        block = json.loads(line)
        try:
            # padded so that tracebacks name the page's own line numbers
            source = "\n" * (block["line"] - 1) + block["code"]
            code = compile(source, block["page"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)  # noqa: S307 - the docs' own blocks
            if inspect.iscoroutine(result):
                await result
            reply: dict[str, object] = {"ok": True}
        except BaseException:  # a block's failure, whatever it raised, is the test's to report
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(reply_fd, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
