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
    monkeypatch.setattr(load_mod, "open_target", store.opener())
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


def test_read_gap_joins_ranges_across_records_that_are_not_needed(tmp_path, counting):
    # "a" and "c" are wanted; "b" (256 KiB) lies between them in the archive.
    state = {"a": torch.randn(1 << 16), "b": torch.randn(1 << 16), "c": torch.randn(1 << 16)}
    cloudckpt.save(state, tmp_path / "gap.pt")
    apart = cloudckpt.load("gap.pt", keys=["a", "c"], read_gap=0)
    separate = counting.calls["read_into"]
    counting.calls.clear()
    joined = cloudckpt.load("gap.pt", keys=["a", "c"], read_gap=1 << 20)
    assert torch.equal(apart["c"], state["c"]) and torch.equal(joined["c"], state["c"])
    assert set(joined) == {"a", "c"}
    # Without a gap "a" and "c" take a request each (besides data.pkl and the small
    # records); with one, a single request spans from "a" across "b" to "c".
    assert separate >= 3
    assert counting.calls["read_into"] == 2, (separate, counting.calls)


def test_verify_reads_small_records_together_and_streams_large_ones(tmp_path):
    from cloudckpt.engine.verify import verify_archive
    from cloudckpt.errors import ChecksumError
    from cloudckpt.options import resolve_options

    store = FaultyStore(LocalStore(tmp_path))
    state = {f"n{i}": torch.randn(64) for i in range(500)}
    state["big"] = torch.randn(3 << 20)  # 12 MiB: more than one read of 4 MiB
    cloudckpt.save(state, tmp_path / "v.pt")
    opts = resolve_options(read_chunk_size=4 << 20)
    checked = verify_archive(store, "v.pt", opts)
    assert checked > 12 << 20
    # 500 records of 256 bytes in a request or two, the big one in 3 pieces + header;
    # record by record it was over a thousand requests.
    assert store.calls["read_into"] <= 3, store.calls
    assert store.calls["get_range"] <= 2 + 4, store.calls
    # A flipped byte in the big record's last piece is found, named.
    data = bytearray((tmp_path / "v.pt").read_bytes())
    entry_end = data.rfind(bytes(state["big"].numpy().tobytes()[-64:])) + 32
    data[entry_end] ^= 0xFF
    (tmp_path / "v.pt").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="data/"):
        verify_archive(store, "v.pt", opts)


def test_small_records_between_large_ones_load_exactly_and_each_is_checked(tmp_path, counting):
    """Small records are read in batches and copied out; each keeps its own CRC-32."""
    from cloudckpt.errors import ChecksumError

    sizes = [1, 300_000, 4, 65_536, 65_537, 0, 600_000, 7, 8, 9, 250_000, 3]
    state = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    path = tmp_path / "mixed.pt"
    cloudckpt.save(state, path)
    out = cloudckpt.load("mixed.pt")
    assert all(torch.equal(out[k], state[k]) for k in state)
    partial = cloudckpt.load("mixed.pt", keys=["t2", "t9", "t6"])
    assert set(partial) == {"t2", "t9", "t6"} and torch.equal(partial["t9"], state["t9"])

    # Flip a byte of the record holding t8, a small record in the middle of a batch.
    import zipfile

    raw = bytearray(path.read_bytes())
    wanted = state["t8"].numpy().tobytes()
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and zf.read(i) == wanted)
    name_len, extra_len = (
        int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    raw[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=info.filename):
        cloudckpt.load("mixed.pt")
