"""Safetensors shards that lie are refused by name: a header longer than its file, byte ranges beyond the data, a
malformed header or index, an index naming a missing or outside file, a truncated shard."""

import json
import os
import struct

import numpy as np
import pytest

from csa2.checkpoints.shards import INDEX, Shards, write_shards


@pytest.fixture
def shards(tmp_path):
    """Two shards of two tensors each, and the index."""
    tensors = [(f"t{i}", np.arange(64, dtype=np.float32).reshape(8, 8) + i) for i in range(4)]
    write_shards(tmp_path, tensors, max_shard_bytes=2 * 64 * 4)
    return tmp_path


def _first_shard(directory):
    return directory / sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))[0]


def _rewrite_header(path, change):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _index(directory, weight_map):
    (directory / INDEX).write_text(json.dumps({"weight_map": weight_map}))


LIES = {
    "header longer than the file": (lambda d: _first_shard(d).write_bytes(
        struct.pack("<Q", 10**9) + _first_shard(d).read_bytes()[8:]), "the header claims 1000000000 bytes"),
    "header not JSON": (lambda d: _first_shard(d).write_bytes(
        struct.pack("<Q", 4) + b"{{{{" + _first_shard(d).read_bytes()[8:]), "the header is not JSON"),
    "range beyond the data": (lambda d: _rewrite_header(_first_shard(d), lambda h: h["t0"].update(
        data_offsets=[0, 10**6])), "tensor 't0' claims bytes \\[0, 1000000\\)"),
    "malformed entry": (lambda d: _rewrite_header(_first_shard(d), lambda h: h["t0"].pop("shape")),
                        "tensor 't0' has a malformed header entry"),
    "truncated shard": (lambda d: os.truncate(_first_shard(d), os.path.getsize(_first_shard(d)) - 100),
                        "claims bytes"),
    "index names a missing file": (lambda d: _index(d, {"t0": "model-gone.safetensors"}), "no such safetensors file"),
    "index names a file outside": (lambda d: _index(d, {"t0": "../model.safetensors"}), "not a safetensors index"),
    "index without a weight map": (lambda d: (d / INDEX).write_text("{}"), "not a safetensors index"),
    "index not JSON": (lambda d: (d / INDEX).write_text("{"), "not a safetensors index"),
}


@pytest.mark.parametrize("name", list(LIES))
def test_a_lying_checkpoint_is_refused_by_name(shards, name):
    lie, match = LIES[name]
    lie(shards)
    with pytest.raises(ValueError, match=match):
        Shards(shards)


def test_an_honest_checkpoint_reads_back(shards):
    read = Shards(shards)
    assert read.names() == ["t0", "t1", "t2", "t3"]
    np.testing.assert_array_equal(read.read("t3"), np.arange(64, dtype=np.float32).reshape(8, 8) + 3)
