"""Round trips through every store: what load returns is what torch.load returns."""

from __future__ import annotations

import io
import math
from collections import OrderedDict

import pytest
import torch

import cloudckpt
from cloudckpt.options import MiB


def _weights_only_loads_bytes() -> bool:
    """torch before 2.5 refuses ``bytes`` (pickled through ``_codecs.encode``) with
    weights_only=True; the state then leaves them out, as torch.load would refuse it."""
    buf = io.BytesIO()
    torch.save(b"x", buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception:
        return False
    return True


def nested_state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    shared = torch.arange(100, dtype=torch.int64)
    sd = OrderedDict(
        [
            ("decoder.mlp.weight", torch.randn(32, 16)),
            ("decoder.mlp.bias", torch.zeros(32, dtype=torch.float16)),
            ("emb", torch.randn(10, 8).to(torch.bfloat16)),
        ]
    )
    return {
        "model": sd,
        "dtypes": {
            "f64": torch.randn(5, dtype=torch.float64),
            "i8": torch.tensor([-1, 2, 3], dtype=torch.int8),
            "u8": torch.tensor([250, 1], dtype=torch.uint8),
            "bool": torch.tensor([True, False]),
            "c64": torch.randn(3, dtype=torch.complex64),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 7),
        },
        "views": {
            "base": base,
            "transposed": base.t(),  # non-contiguous view of the same storage
            "strided": base[::3, 1::2],
            "slice": base[10:20],
        },
        "shared": [shared, shared[10:], shared.view(10, 10)],
        "param": torch.nn.Parameter(torch.randn(4, 4)),
        "step": 1234,
        "lr": 3e-4,
        "nan": math.nan,
        "name": "run-1 ✓",
        "flags": (True, None, b"bytes") if _weights_only_loads_bytes() else (True, None),
        "history": [1.0, 2.5, {"k": [3]}],
    }


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert type(a) is type(b), path
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert a.storage_offset() == b.storage_offset(), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_nested_state_round_trip_matches_torch_load(store_url):
    state = nested_state()
    url = f"{store_url.base_url}/run/ckpt.pt"
    result = cloudckpt.save(state, url, storage_options=store_url.storage_options)
    assert result.size > 0

    loaded = cloudckpt.load(url, storage_options=store_url.storage_options)
    assert_same(state, loaded)
    # Shared storages stay shared, as torch.load keeps them.
    views = loaded["views"]
    assert (
        views["transposed"].untyped_storage().data_ptr()
        == views["base"].untyped_storage().data_ptr()
    )
    assert (
        loaded["shared"][1].untyped_storage().data_ptr()
        == loaded["shared"][0].untyped_storage().data_ptr()
    )

    # The stored object is a standard torch.save archive.
    raw = store_url.read_object(url)
    assert len(raw) == result.size
    assert_same(torch.load(io.BytesIO(raw), weights_only=True), loaded)


def test_multipart_round_trip_is_bit_identical(store_url):
    torch.manual_seed(1)
    # ~22 MiB over several tensors: five 5 MiB parts plus a short last part.
    state = {f"layer{i}": torch.randn(1024, 1024 + i) for i in range(5)}
    state["small"] = [torch.randn(10) for _ in range(50)]
    url = f"{store_url.base_url}/big.pt"
    opts = {"storage_options": store_url.storage_options}
    result = cloudckpt.save(state, url, part_size=5 * MiB, write_concurrency=3, **opts)
    assert result.size > 20 * MiB
    loaded = cloudckpt.load(url, read_chunk_size=3 * MiB, read_concurrency=4, **opts)
    assert_same(state, loaded)
    raw = store_url.read_object(url)
    assert_same(torch.load(io.BytesIO(raw), weights_only=True), loaded)


def test_partial_load_fetches_only_the_requested_keys(store_url, monkeypatch):
    state = {
        "model": {"w": torch.randn(256, 256)},
        "optimizer": {"m": torch.randn(512, 512)},
        "step": 5,
    }
    url = f"{store_url.base_url}/partial.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save(state, url, **opts)

    from cloudckpt.io.ranges import RangeReader

    fetched: list[int] = []
    real_submit = RangeReader._submit

    def counting_submit(self, key, start, buffers, covers, n):
        fetched.append(n)
        return real_submit(self, key, start, buffers, covers, n)

    monkeypatch.setattr(RangeReader, "_submit", counting_submit)
    part = cloudckpt.load(url, keys=["model", "step"], **opts)
    assert list(part) == ["model", "step"]
    assert torch.equal(part["model"]["w"], state["model"]["w"]) and part["step"] == 5
    tensor_bytes = sum(fetched) - sum(fetched[:1])  # first request is data.pkl
    assert 256 * 256 * 4 <= sum(fetched) < 512 * 512 * 4, (fetched, tensor_bytes)


def test_partial_load_of_a_missing_key_names_it(store_url):
    url = f"{store_url.base_url}/p.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"model": torch.zeros(3)}, url, **opts)
    with pytest.raises(cloudckpt.errors.MissingKeyError, match="optimizer"):
        cloudckpt.load(url, keys=["optimizer"], **opts)
    with pytest.raises(KeyError):
        cloudckpt.load(url, keys=["optimizer"], **opts)


def test_load_reads_a_plain_torch_save_upload(store_url, tmp_path):
    """Objects written by torch.save and uploaded by other tools load too."""
    state = nested_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    url = f"{store_url.base_url}/from-torch.pt"
    from cloudckpt.options import resolve_options
    from cloudckpt.store import open_url

    store, key = open_url(url, resolve_options(storage_options=store_url.storage_options))
    store.put(key, buf.getvalue())
    assert_same(state, cloudckpt.load(url, storage_options=store_url.storage_options))


def test_map_location_and_weights_only_false(store_url):
    class Config:  # importable from this test module, so pickle can name it
        pass

    url = f"{store_url.base_url}/m.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"w": torch.ones(4), "cfg": {"lr": 1}}, url, **opts)
    out = cloudckpt.load(url, map_location=lambda storage, loc: storage, **opts)
    assert torch.equal(out["w"], torch.ones(4))
    out = cloudckpt.load(url, map_location={"cpu": "cpu"}, weights_only=False, **opts)
    assert out["cfg"] == {"lr": 1}


def test_overwrite_replaces_the_object_whole(store_url):
    url = f"{store_url.base_url}/same.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"v": torch.full((1000,), 1.0)}, url, **opts)
    cloudckpt.save({"v": torch.full((10,), 2.0)}, url, **opts)
    assert torch.equal(cloudckpt.load(url, **opts)["v"], torch.full((10,), 2.0))
