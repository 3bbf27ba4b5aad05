"""Chunk-key chaining and key validation of kvservice.keys."""
import hashlib

import numpy as np
import pytest

from kvservice import chunk_keys
from kvservice.keys import normalize_key


def reference_keys(tokens, chunk_size, namespace=""):
    """The documented encoding, written out independently."""
    ns = namespace.encode()
    prev = bytes(16)
    out = []
    for i in range(len(tokens) // chunk_size):
        h = hashlib.blake2b(digest_size=16, person=b"kvservice-chunk1")
        h.update(len(ns).to_bytes(4, "little") + ns + prev)
        for t in tokens[i * chunk_size:(i + 1) * chunk_size]:
            h.update(t.to_bytes(8, "little", signed=True))
        prev = h.digest()
        out.append(prev)
    return out


def test_matches_reference_encoding():
    tokens = list(range(-5, 1000))
    assert chunk_keys(tokens, 64, "m") == reference_keys(tokens, 64, "m")


def test_only_full_chunks_get_keys():
    assert len(chunk_keys(range(1000), 256)) == 3
    assert len(chunk_keys(range(1024), 256)) == 4
    assert chunk_keys(range(255), 256) == []
    assert chunk_keys([], 256) == []
    assert chunk_keys(np.array([], dtype=np.int64), 4) == []


def test_keys_are_16_bytes_and_distinct():
    keys = chunk_keys([7] * 4096, 256)  # identical chunk contents still get distinct keys
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == len(keys)


def test_shared_prefix_shares_keys_and_divergence_changes_all_later():
    a = list(range(1024))
    b = a[:512] + [x + 1 for x in a[512:]]
    ka, kb = chunk_keys(a, 256), chunk_keys(b, 256)
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_change_in_first_chunk_changes_every_key():
    a = list(range(1024))
    b = [a[0] + 1] + a[1:]
    assert all(x != y for x, y in zip(chunk_keys(a, 256), chunk_keys(b, 256)))


def test_namespace_changes_every_key():
    tokens = list(range(512))
    assert not set(chunk_keys(tokens, 256, "a")) & set(chunk_keys(tokens, 256, "b"))
    assert chunk_keys(tokens, 256, "") != chunk_keys(tokens, 256, "a")


def test_chunk_size_changes_keys():
    tokens = list(range(512))
    assert set(chunk_keys(tokens, 256)).isdisjoint(chunk_keys(tokens, 128))


@pytest.mark.parametrize("convert", [
    list, tuple, iter,
    lambda t: np.array(t, dtype=np.int64),
    lambda t: np.array(t, dtype=np.int32),
    lambda t: np.array(t, dtype=np.uint32),
    lambda t: np.array(t, dtype=">i8"),
    lambda t: np.repeat(np.array(t), 2)[::2],  # non-contiguous view
], ids=["list", "tuple", "iter", "int64", "int32", "uint32", "big-endian", "strided"])
def test_input_types_agree(convert):
    tokens = list(range(300))
    assert chunk_keys(convert(tokens), 100) == chunk_keys(tokens, 100)


@pytest.mark.parametrize("bad", [
    [1, 2.0], [1.5], ["a"], "abc", b"abcdefgh", np.array([1.0, 2.0]),
    np.array([True, False]), np.array(["1"]), [None],
])
def test_non_integer_tokens_rejected(bad):
    with pytest.raises(TypeError):
        chunk_keys(bad, 1)


@pytest.mark.parametrize("bad", [[2**63], [-(2**63) - 1], np.array([2**64 - 1], dtype=np.uint64),
                                 np.zeros((2, 2), dtype=np.int64)])
def test_out_of_range_or_shape_rejected(bad):
    with pytest.raises(ValueError):
        chunk_keys(bad, 1)


def test_int64_extremes_accepted():
    tokens = [-(2**63), 2**63 - 1]
    assert chunk_keys(tokens, 2) == reference_keys(tokens, 2)


@pytest.mark.parametrize("size", [0, -1])
def test_chunk_size_must_be_positive(size):
    with pytest.raises(ValueError):
        chunk_keys([1, 2], size)


@pytest.mark.parametrize("size", [2.0, "2", True])
def test_chunk_size_must_be_int(size):
    with pytest.raises(TypeError):
        chunk_keys([1, 2], size)


def test_namespace_must_be_str():
    with pytest.raises(TypeError):
        chunk_keys([1, 2], 1, namespace=b"ns")


def test_normalize_key():
    assert normalize_key("abc") == b"abc"
    assert normalize_key("é") == "é".encode()
    assert normalize_key(b"\x00\xff") == b"\x00\xff"
    assert normalize_key(b"k" * 1024) == b"k" * 1024
    key = chunk_keys(range(4), 4)[0]
    assert normalize_key(key) is key


@pytest.mark.parametrize("bad", ["", b"", b"k" * 1025, "é" * 513])
def test_normalize_key_rejects_empty_and_long(bad):
    with pytest.raises(ValueError):
        normalize_key(bad)


@pytest.mark.parametrize("bad", [None, 1, bytearray(b"k"), memoryview(b"k"), ["k"]])
def test_normalize_key_rejects_other_types(bad):
    with pytest.raises(TypeError):
        normalize_key(bad)
