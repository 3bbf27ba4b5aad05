"""Native pieces, all optional: without a C compiler (gcc or clang) the package still installs,
and importing it warns once that it runs on its reference paths. cxlrpc._atomic, the atomic u64
operations every layer uses, is then stood in for by libatomic through ctypes
(cxlrpc/_atomic_ref.py: the same instructions, ~40 times the cost per operation); the rings' hot
path over coherent memory, frame decoding, the common call's dispatch on both sides and
kvservice's leased Block run their Python reference; and coherence="flush" is unavailable, as it
needs cxlrpc._flush's cache-line write-back and invalidate."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cxlrpc._atomic", ["cxlrpc/_atomic.c"], optional=True),
                   Extension("cxlrpc._flush", ["cxlrpc/_flush.c"],
                             depends=["cxlrpc/_follow.h", "cxlrpc/_copy.h", "cxlrpc/_flush_api.h", "cxlrpc/_stream.h"],
                             optional=True),
                   Extension("cxlrpc._ring", ["cxlrpc/_ring.c"],
                             depends=["cxlrpc/_ring_api.h", "cxlrpc/_copy.h", "cxlrpc/_flush_api.h"],
                             optional=True),
                   Extension("cxlrpc._frame", ["cxlrpc/_frame.c"], depends=["cxlrpc/_copy.h"], optional=True),
                   Extension("cxlrpc._dispatch",
                             ["cxlrpc/_dispatch.c", "cxlrpc/_dispatch_serve.c", "cxlrpc/_dispatch_request.c",
                              "cxlrpc/_dispatch_handler.c", "cxlrpc/_dispatch_follow.c", "cxlrpc/_dispatch_call.c"],
                             depends=["cxlrpc/_dispatch.h", "cxlrpc/_ring_api.h", "cxlrpc/_follow.h",
                                      "cxlrpc/_copy.h", "cxlrpc/_flush_api.h"],
                             optional=True),
                   Extension("kvservice._block", ["kvservice/_block.c"], include_dirs=["cxlrpc"],
                             depends=["cxlrpc/_flush_api.h", "cxlrpc/_copy.h", "cxlrpc/_stream.h"],
                             optional=True)])
