"""A stand-in ``mooncake`` package backed by kvservice (opt-in: only importable when
``python -m kvservice mooncake-shim-path`` is on PYTHONPATH). Only ``mooncake.store`` is provided."""
__version__ = "0.0.0+kvservice"
