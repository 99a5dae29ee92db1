"""Saves that fail leave nothing loadable, overwrites never mix two saves, and loads
make the requests the design says (faults injected at the store seam: tests/faults.py)."""

from __future__ import annotations

import json

import pytest
import torch

import cloudckpt
from cloudckpt.engine import safetensors as st_engine
from cloudckpt.errors import NotFoundError, SerializationError, StorageError
from cloudckpt.options import MiB
from cloudckpt.store.memory import MemoryStore, clear
from faults import FaultyStore

FAST = {"backoff_base": 0.001, "backoff_max": 0.002, "max_attempts": 2}


@pytest.fixture
def faulty(monkeypatch):
    name = "st-faults"
    clear(name)
    store = FaultyStore(MemoryStore(name))
    monkeypatch.setattr(st_engine, "open_target", store.opener())
    yield store
    clear(name)


def keys(store: FaultyStore) -> list[str]:
    return [o.key for o in store.inner.list("")]


def state(n: int, size: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    return {f"layer{i}.w": torch.full((size,), float(i + seed)) for i in range(n)}


def test_a_failed_sharded_save_leaves_nothing(faulty):
    faulty.faults["put"] = lambda n: StorageError("InternalError") if n == 2 else None
    with pytest.raises(StorageError):
        cloudckpt.save_safetensors(state(3), "ck", max_shard_size=4000, **FAST)
    assert keys(faulty) == []
    assert list(faulty.inner.list_multipart("")) == []
    with pytest.raises(NotFoundError):
        cloudckpt.load_safetensors("ck")


def test_a_failed_multipart_shard_is_aborted_and_the_others_removed(faulty):
    big = {f"w{i}": torch.zeros(3 * MiB) for i in range(3)}  # 12 MiB shards, 5 MiB parts
    faulty.faults["upload_part"] = lambda n: StorageError("InternalError") if n == 5 else None
    with pytest.raises(StorageError):
        cloudckpt.save_safetensors(
            big, "ck", max_shard_size=13 * MiB, part_size=5 * MiB, write_concurrency=1, **FAST
        )
    assert keys(faulty) == [] and list(faulty.inner.list_multipart("")) == []


def test_a_failed_index_leaves_no_index_pointing_at_missing_shards(faulty):
    faulty.faults["put"] = lambda n: StorageError("InternalError") if n == 4 else None
    with pytest.raises(StorageError):
        cloudckpt.save_safetensors(state(3), "ck", max_shard_size=4000, **FAST)
    assert keys(faulty) == []


def test_overwriting_the_same_shard_names_retires_the_old_index_first(faulty):
    cloudckpt.save_safetensors(state(3), "ck", max_shard_size=4000)
    faulty.faults["put"] = lambda n: StorageError("InternalError") if n == 5 else None  # 2nd shard
    with pytest.raises(StorageError):
        cloudckpt.save_safetensors(state(3, seed=10), "ck", max_shard_size=4000, **FAST)
    # No index may combine a new shard with old ones: the old index went first.
    assert "ck/model.safetensors.index.json" not in keys(faulty)
    with pytest.raises(NotFoundError):
        cloudckpt.load_safetensors("ck")


def test_a_failed_save_with_other_shard_names_keeps_the_old_checkpoint(faulty):
    old = state(3)
    cloudckpt.save_safetensors(old, "ck", max_shard_size=4000)
    faulty.faults["put"] = lambda n: StorageError("InternalError") if n == 5 else None
    with pytest.raises(StorageError):
        cloudckpt.save_safetensors(state(4, seed=10), "ck", max_shard_size=4000, **FAST)
    got = cloudckpt.load_safetensors("ck")
    assert all(torch.equal(got[k], old[k]) for k in old) and list(got) == sorted(old)


def test_overwrites_remove_what_the_new_checkpoint_does_not_use(faulty):
    cloudckpt.save_safetensors(state(3), "ck", max_shard_size=4000)
    cloudckpt.save_safetensors(state(2, seed=5), "ck", max_shard_size=4000)
    assert keys(faulty) == [
        "ck/model-00001-of-00002.safetensors",
        "ck/model-00002-of-00002.safetensors",
        "ck/model.safetensors.index.json",
    ]
    cloudckpt.save_safetensors(state(2, seed=6), "ck")  # one file: the shards go
    assert keys(faulty) == ["ck/model.safetensors"]
    cloudckpt.save_safetensors(state(3, seed=7), "ck", max_shard_size=4000)  # and back
    assert len(keys(faulty)) == 4 and "ck/model.safetensors" not in keys(faulty)
    got = cloudckpt.load_safetensors("ck")
    assert torch.equal(got["layer2.w"], state(3, seed=7)["layer2.w"])


def test_an_invalid_state_writes_nothing(faulty):
    tied = torch.zeros(10)
    bad = [
        ({"w": torch.zeros(2), "step": 3}, "state\\['step'\\] is a int"),
        ({"model": {"w": torch.zeros(2)}}, "flatten nested dicts"),
        ({"a": tied, "b": tied}, r"share memory: \[\['a', 'b'\]\]"),
        ({"a": tied, "b": tied[2:5]}, "share memory"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "complex128"),
        ({"s": torch.zeros(3, 3).to_sparse()}, "sparse"),
        ({"m": torch.zeros(2, device="meta")}, "meta"),
        ({"__metadata__": torch.zeros(1)}, "reserved"),
        ({1: torch.zeros(1)}, "names are strings"),
    ]
    for value, message in bad:
        with pytest.raises(SerializationError, match=message):
            cloudckpt.save_safetensors(value, "ck/model.safetensors")
    with pytest.raises(SerializationError, match="metadata"):
        cloudckpt.save_safetensors({"w": torch.zeros(1)}, "ck/m.safetensors", metadata={"a": 1})
    with pytest.raises(cloudckpt.errors.ConfigError, match="max_shard_size"):
        cloudckpt.save_safetensors({"w": torch.zeros(1)}, "ck", max_shard_size="5 parsecs")
    assert faulty.calls == {}


def test_a_small_file_loads_with_one_head_and_one_read(faulty):
    cloudckpt.save_safetensors(state(100, size=100), "m.safetensors", metadata={"k": "v"})
    faulty.calls.clear()
    got = cloudckpt.load("m.safetensors")
    assert len(got) == 100
    assert faulty.calls == {"head": 1, "get_range": 1}


def test_tensors_past_the_probe_are_read_together_and_large_ones_split(faulty):
    s = {f"t{i:03d}": torch.full((16_384,), float(i)) for i in range(64)}  # 64 KiB each
    s["big"] = torch.arange(8 * MiB // 8, dtype=torch.float64)
    cloudckpt.save_safetensors(s, "m.safetensors")
    faulty.calls.clear()
    got = cloudckpt.load("m.safetensors", read_chunk_size=4 * MiB, read_concurrency=2)
    assert all(torch.equal(got[k], s[k]) for k in s)
    # The big tensor comes first (float64): 2 pieces of 4 MiB; the 4 MiB of float32
    # after it in one read (the probe held the first tensors' start, not all of one).
    assert faulty.calls["head"] == 1 and faulty.calls["get_range"] == 1
    assert faulty.calls["read_into"] == 3


def test_a_long_header_costs_one_more_read(faulty):
    s = {f"a-rather-long-tensor-name-{i:05d}": torch.zeros(1) for i in range(2000)}
    cloudckpt.save_safetensors(s, "m.safetensors")
    faulty.calls.clear()
    assert len(cloudckpt.load("m.safetensors")) == 2000
    assert faulty.calls == {"head": 1, "get_range": 2}


def test_a_partial_sharded_load_reads_only_the_index_and_its_shard(faulty):
    cloudckpt.save_safetensors(state(8), "ck", max_shard_size=4000)
    faulty.calls.clear()
    got = cloudckpt.load_safetensors("ck/model.safetensors.index.json", keys=["layer7.w"])
    assert list(got) == ["layer7.w"]
    assert faulty.calls["head"] == 2  # the index and one shard
    index = json.loads(faulty.inner.get("ck/model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) == 8
