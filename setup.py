"""The one native piece: cache-line write-back/invalidate for non-coherent memory (optional:
without a compiler the package installs, and only coherence="flush" is unavailable)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cxlrpc._flush", ["cxlrpc/_flush.c"], optional=True)])
