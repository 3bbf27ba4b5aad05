"""kvservice: an LLM KV-cache store on cxlrpc (metadata service, pool allocator, keys)."""
from kvservice.keys import chunk_keys

__all__ = ["chunk_keys"]
