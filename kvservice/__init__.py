"""kvservice: an LLM KV-cache store on cxlrpc (metadata service, pool allocator, keys)."""
from kvservice.client import KeyNotFound, KVClient, SyncKVClient
from kvservice.index import ABSENT, LEASED, REMOVED
from kvservice.keys import chunk_keys
from kvservice.pool import Block, LeaseExpired, PendingPut, PutFenced
from kvservice.server import KVServer

__all__ = ["KVServer", "KVClient", "SyncKVClient", "KeyNotFound", "LeaseExpired", "Block", "PendingPut",
           "PutFenced",
           "REMOVED", "ABSENT", "LEASED",
           "chunk_keys"]
