"""Compatibility facades: other KV stores' client APIs on kvservice.

``kvservice.compat.mooncake`` is Mooncake Store's ``MooncakeDistributedStore``; the opt-in
directory ``kvservice/compat/shim`` (``python -m kvservice mooncake-shim-path``) holds a
``mooncake`` package re-exporting it, for engines that ``from mooncake.store import ...``.
"""
import os

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")


def mooncake_shim_path() -> str:
    """The directory to put on ``PYTHONPATH`` so ``import mooncake.store`` loads the facade."""
    return SHIM_DIR
