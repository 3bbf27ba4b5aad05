"""Two optional native pieces: cache-line write-back/invalidate for non-coherent memory, and the
rings' hot path over coherent memory. Without a compiler the package installs: the rings run
their Python reference, and only coherence="flush" is unavailable."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cxlrpc._flush", ["cxlrpc/_flush.c"], optional=True),
                   Extension("cxlrpc._ring", ["cxlrpc/_ring.c"], optional=True)])
