"""Optional native pieces: cache-line write-back/invalidate for non-coherent memory, the rings'
hot path over coherent memory, and frame decoding. Without a compiler the package installs: the
rings and frames run their Python reference, and only coherence="flush" is unavailable."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cxlrpc._flush", ["cxlrpc/_flush.c"], optional=True),
                   Extension("cxlrpc._ring", ["cxlrpc/_ring.c"], optional=True),
                   Extension("cxlrpc._frame", ["cxlrpc/_frame.c"], optional=True)])
