"""How many requests a load makes: the directory in one read, small records coalesced."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.engine import load as load_mod
from cloudckpt.store.local import LocalStore
from faults import FaultyStore


@pytest.fixture
def counting(tmp_path, monkeypatch):
    store = FaultyStore(LocalStore(tmp_path))
    monkeypatch.setattr(load_mod, "open_url", lambda url, opts: (store, url))
    return store


def test_many_small_tensors_load_in_few_requests(tmp_path, counting):
    state = {f"layer{i}.weight": torch.randn(16, 16) for i in range(2000)}
    cloudckpt.save(state, tmp_path / "small.pt")
    out = cloudckpt.load("small.pt", read_chunk_size=8 << 20)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert counting.calls["head"] == 1
    assert counting.calls["get_range"] == 1  # the zip directory: one ranged read
    # data.pkl is one request; ~2.5 MiB of records coalesce into a handful more.
    assert counting.calls["read_into"] <= 4, counting.calls


def test_large_records_are_split_into_parallel_chunks(tmp_path, counting):
    state = {"big": torch.randn(4 << 20)}  # 16 MiB
    cloudckpt.save(state, tmp_path / "big.pt")
    out = cloudckpt.load("big.pt", read_chunk_size=1 << 20)
    assert torch.equal(out["big"], state["big"])
    assert counting.calls["read_into"] >= 16
