"""Native pieces. cxlrpc._atomic (the atomic u64 operations every layer uses) is required: there is
no correct pure-Python atomic read-modify-write on shared memory, so without a C compiler (gcc or
clang) the install fails there, clearly. The others are optional: cache-line write-back/invalidate for non-coherent memory, the rings'
hot path over coherent memory, frame decoding, the common call's dispatch on both sides, and
kvservice's leased Block. Without a compiler the package installs: the rings, frames, calls and
blocks run their Python reference, and only coherence="flush" is unavailable."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cxlrpc._atomic", ["cxlrpc/_atomic.c"]),
                   Extension("cxlrpc._flush", ["cxlrpc/_flush.c"], depends=["cxlrpc/_follow.h", "cxlrpc/_copy.h"],
                             optional=True),
                   Extension("cxlrpc._ring", ["cxlrpc/_ring.c"], depends=["cxlrpc/_ring_api.h", "cxlrpc/_copy.h"],
                             optional=True),
                   Extension("cxlrpc._frame", ["cxlrpc/_frame.c"], depends=["cxlrpc/_copy.h"], optional=True),
                   Extension("cxlrpc._dispatch",
                             ["cxlrpc/_dispatch.c", "cxlrpc/_dispatch_serve.c", "cxlrpc/_dispatch_request.c",
                              "cxlrpc/_dispatch_handler.c", "cxlrpc/_dispatch_follow.c", "cxlrpc/_dispatch_call.c"],
                             depends=["cxlrpc/_dispatch.h", "cxlrpc/_ring_api.h", "cxlrpc/_follow.h",
                                      "cxlrpc/_copy.h"],
                             optional=True),
                   Extension("kvservice._block", ["kvservice/_block.c"], optional=True)])
