"""Engines suite: vLLM 0.33's own MooncakeStoreConnector code, its worker
(``MooncakeStoreWorker``) and its scheduler side (``MooncakeStoreScheduler``), on the kvservice
Mooncake facade, with host (CPU tensor) KV caches.

vLLM is installed ``--no-deps`` in its own venv (``.ci/install-engines`` makes it at VLLM_VENV,
with the system site packages, so it shares the CPU torch); each role of
``tests/vllm_store_worker.py`` runs there as its own process: one stores blocks through the
worker's sending thread, another process looks them up and loads them through its receiving
threads into fresh zeroed caches and compares the bytes. The facade refuses caches the CPU
cannot read (device memory): vLLM's register path logs the refusal and its loads fail per block,
with no crash."""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from kvservice.compat import mooncake_shim_path
from test_mooncake_compat import ThreadServer

pytestmark = pytest.mark.engines

VLLM_VENV = "/opt/kvservice-vllm-venv"
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "vllm_store_worker.py")
MiB = 1 << 20
# the tiny model the worker's ModelConfig reads (no hub access): 2 layers, 2 KV heads of 64
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256,
              "torch_dtype": "float32", "rms_norm_eps": 1e-5}
LAYERS, BLOCK_BYTES = 2, 2 * 16 * 2 * 64 * 4  # per layer: K and V of 16 tokens x 2 heads x 64
STORED_BLOCKS, PROMPT_TOKENS = 5, 5 * 16 + 9
TRANSFER_FAIL = -800


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's interpreter; missing is a failure under CI, a skip elsewhere."""
    if not os.path.exists(VLLM_PYTHON):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{VLLM_PYTHON} missing: .ci/install-engines makes the vLLM venv")
        pytest.skip(f"no vLLM venv at {VLLM_VENV} (made by .ci/install-engines)")
    return VLLM_PYTHON


@pytest.fixture
def facade_env(url: str, tmp_path) -> Iterator[dict[str, str]]:
    """A kvservice server, a Mooncake config naming it as vLLM's master, a tiny local model,
    and the environment the vLLM processes run with."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": url, "protocol": "tcp",
        "device_name": "", "global_segment_size": "64MB", "local_buffer_size": "16MB"}))
    env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(config), HF_HUB_OFFLINE="1",
               VLLM_RPC_BASE_PATH=str(tmp_path), MODEL_DIR=str(model),
               PYTHONPATH=os.pathsep.join([mooncake_shim_path(), ROOT]))
    with ThreadServer(url, pool_size=32 * MiB):
        yield env


def _run(python: str, role: str, env: dict[str, str], out: str, *args: str) -> dict:
    """One role of the helper in its own vLLM process; its figures."""
    proc = subprocess.Popen([python, SCRIPT, role, env["MODEL_DIR"], out, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, f"vLLM {role} process exited {proc.returncode}:\n{log[-4000:]}"
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(400)
def test_vllm_store_worker_round_trip(vllm_python, facade_env, tmp_path) -> None:
    """vLLM's MooncakeStoreWorker, fed by the connector's own scheduler side, saves the 5 full
    blocks of an 89-token prompt from its CPU KV cache in one process; in another process the
    scheduler's lookup finds them (none of a foreign prompt; a hit over a whole request is cut
    a block short so its last token is recomputed) and the worker loads them into other blocks
    of zeroed caches: byte-equal, nothing else written."""
    stored = _run(vllm_python, "store", facade_env, str(tmp_path / "store.json"))
    assert stored["hit_before"] == 0
    assert stored["save_jobs"] == stored["completed_saves"] == 1
    assert stored["stored_keys"] == STORED_BLOCKS  # one key per block, all layers in it
    assert stored["stored_bytes"] == STORED_BLOCKS * LAYERS * BLOCK_BYTES
    loaded = _run(vllm_python, "load", facade_env, str(tmp_path / "load.json"),
                  json.dumps(stored["block_ids"]))
    assert loaded["hits_prompt"] == STORED_BLOCKS * 16  # the 9-token tail is not a block
    assert loaded["hits_exact"] == (STORED_BLOCKS - 1) * 16
    assert loaded["hits_foreign"] == 0
    assert set(loaded["block_ids"]).isdisjoint(stored["block_ids"])
    assert loaded["loaded_blocks"] == STORED_BLOCKS
    assert loaded["compared_bytes"] == STORED_BLOCKS * LAYERS * BLOCK_BYTES


@pytest.mark.timeout(400)
def test_vllm_register_unreadable_cache(vllm_python, facade_env, tmp_path) -> None:
    """Caches the CPU cannot read (PROT_NONE pages, as GPU memory is to the facade): vLLM's
    ``register_kv_caches`` logs the facade's refusal per layer, and a load of stored keys into
    them fails with TRANSFER_FAIL that vLLM reports for every block, the process unharmed."""
    _run(vllm_python, "store", facade_env, str(tmp_path / "store.json"))
    bad = _run(vllm_python, "unreadable", facade_env, str(tmp_path / "bad.json"))
    assert len(bad["register_errors"]) == LAYERS
    assert all(e.endswith(": -600") for e in bad["register_errors"])
    assert bad["hits_prompt"] == STORED_BLOCKS * 16
    assert bad["load_error_blocks"] == sorted(bad["block_ids"][:STORED_BLOCKS])
    assert len(bad["load_failures"]) == 1 and str(TRANSFER_FAIL) in bad["load_failures"][0]
