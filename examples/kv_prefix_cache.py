"""Two inference "pods" share a system prompt's KV cache through kvservice.

A KVServer runs in one process. Pod A "computes" KV chunks for its prompt and stores them under
LMCache-style chunk keys; pod B, whose prompt shares the system prompt, finds the shared leading
chunks with lookup_prefix, reads them in place from the pool (zero-copy) and computes only the
rest. Run: ``python examples/kv_prefix_cache.py`` (exits 0, leaves nothing behind).
"""
import asyncio
import multiprocessing as mp
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from kvservice import KVClient, KVServer, chunk_keys  # noqa: E402

URL = f"shm://kv-example-{os.getpid()}"
CHUNK = 256                  # tokens per chunk (LMCache's default)
LAYERS, HIDDEN = 4, 128      # a toy model: per token and layer, K and V of HIDDEN float16 each
SYSTEM_PROMPT = list(range(1000, 2000))  # 1000 tokens every request starts with


def compute_kv(chunk_tokens: list[int]) -> np.ndarray:
    """Stand-in for the model's prefill of one chunk: (layers, K/V, tokens, hidden) float16."""
    rng = np.random.default_rng(chunk_tokens)
    return rng.standard_normal((LAYERS, 2, len(chunk_tokens), HIDDEN)).astype(np.float16)


def serve(url: str, ready) -> None:
    """The KV-cache service, until SIGTERM."""
    async def main() -> None:
        server = KVServer(url, pool_size=64 << 20)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(server.close()))
        async with server:
            ready.set()
            await server.serve_forever()

    asyncio.run(main())


def pod(url: str, name: str, prompt: list[int]) -> None:
    """Prefill ``prompt``: reuse what the pool has for its prefix, compute and publish the rest."""
    with KVClient.connect_sync(url) as kv:  # blocking client, as an engine connector would use
        keys = chunk_keys(prompt, CHUNK)
        hit = kv.lookup_prefix(prompt, CHUNK)
        blocks = kv.batch_get(keys[:hit])
        shape = (LAYERS, 2, CHUNK, HIDDEN)
        reused = [b.array(np.float16, shape) for b in blocks if b is not None]  # views into the pool
        print(f"pod {name}: {len(prompt)} tokens, {len(keys)} full chunks; "
              f"{len(reused)} reused from the pool, zero-copy "
              f"(chunk sums {[round(float(a.sum(dtype=np.float32)), 1) for a in reused]})")
        fresh = {keys[i]: compute_kv(prompt[i * CHUNK:(i + 1) * CHUNK])
                 for i in range(len(reused), len(keys))}
        kv.batch_put(fresh)
        print(f"pod {name}: computed {len(fresh)} chunks and published them "
              f"(chunk sums {[round(float(a.sum(dtype=np.float32)), 1) for a in fresh.values()]})")
        del reused
        for b in blocks:
            if b is not None:
                b.release()  # ends the leases: the chunks become evictable again


def main() -> int:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=serve, args=(URL, ready))
    server.start()
    try:
        if not ready.wait(30):
            print("the KV server did not start", file=sys.stderr)
            return 1
        for name, question in (("A", range(5000, 5500)), ("B", range(7000, 7700))):
            p = ctx.Process(target=pod, args=(URL, name, SYSTEM_PROMPT + list(question)))
            p.start()
            p.join(60)
            if p.exitcode != 0:
                p.kill()
                p.join()
                print(f"pod {name} failed ({p.exitcode})", file=sys.stderr)
                return 1
    finally:
        server.terminate()  # SIGTERM: the server closes and unlinks its regions
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join()
    return 0 if server.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
