"""safetensors both ways with the library itself, on the in-memory store and a real S3
server (rclone): files it writes load with cloudckpt, files cloudckpt writes load with
it (and are its bytes exactly), sharded and not, whole and partial."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import save as st_save
from st_cases import (
    LIBRARY_READS,
    OURS,
    assert_same,
    bits,
    download,
    every_dtype_state,
    library_reads,
    listing,
    upload,
)

import cloudckpt
from cloudckpt.errors import MissingKeyError
from conftest import make_target
from servers import StoreTarget


@pytest.fixture(params=["memory", "rclone"])
def target(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreTarget]:
    yield from make_target(request, request.param, tmp_path)


def _opts(target: StoreTarget) -> dict:
    return {"storage_options": target.storage_options}


def test_cloudckpt_covers_every_dtype_the_library_reads():
    assert set(OURS) >= LIBRARY_READS


def test_library_files_load_with_cloudckpt(target):
    state = every_dtype_state()  # F8_E8M0 and F4 too: the library writes them
    upload(target, "lib/model.safetensors", st_save(state, metadata={"format": "pt"}))
    got = cloudckpt.load(f"{target.base_url}/lib/model.safetensors", **_opts(target))
    assert_same(got, state)


def test_cloudckpt_files_are_the_librarys_bytes_and_load_with_it(target, tmp_path):
    state = every_dtype_state(seed=1)
    url = f"{target.base_url}/ours/model.safetensors"
    result = cloudckpt.save_safetensors(state, url, **_opts(target))
    assert result.url.endswith("/ours/model.safetensors")
    data = download(target, "ours/model.safetensors")
    assert result.size == len(data)
    assert data == st_save(state, metadata={"format": "pt"})
    readable = {k: v for k, v in state.items() if v.dtype in LIBRARY_READS}
    assert_same(library_reads(data, tmp_path / "x.safetensors"), readable)


def test_library_shards_load_with_cloudckpt_by_index_and_by_folder(target):
    state = every_dtype_state(seed=2)
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, members in shards.items():
        upload(
            target, f"hf/{file}", st_save({n: state[n] for n in members}, metadata={"format": "pt"})
        )
        weight_map.update(dict.fromkeys(members, file))
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in state.values())},
        "weight_map": weight_map,
    }
    upload(target, "hf/model.safetensors.index.json", json.dumps(index).encode())
    for url in ("hf/model.safetensors.index.json", "hf", "hf/"):
        assert_same(cloudckpt.load_safetensors(f"{target.base_url}/{url}", **_opts(target)), state)


def test_cloudckpt_shards_load_with_the_library(target, tmp_path):
    state = every_dtype_state(seed=3)
    limit = 100_000  # each 70 KiB vector in a shard of its own or with small tensors
    result = cloudckpt.save_safetensors(
        state, f"{target.base_url}/sh", max_shard_size=limit, **_opts(target)
    )
    assert result.url.endswith("/sh/model.safetensors.index.json")
    index = json.loads(download(target, "sh/model.safetensors.index.json"))
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in state.values())}
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 5 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(state)
    seen = {}
    for file in files:
        data = download(target, f"sh/{file}")
        members = sorted(k for k, f in index["weight_map"].items() if f == file)
        assert len(members) == 1 or sum(state[m].nbytes for m in members) <= limit
        assert data == st_save({m: state[m] for m in members}, metadata={"format": "pt"})
        seen.update(library_reads(data, tmp_path / file))
    readable = {k: v for k, v in state.items() if v.dtype in LIBRARY_READS}
    assert_same({k: seen[k] for k in sorted(seen)}, readable)
    assert_same(cloudckpt.load(result.url, **_opts(target)), state)


def test_partial_loads_by_key_and_prefix_read_only_their_shards(target):
    state = {f"layer{i}.{p}": torch.full((1000,), float(i)) for i in range(6) for p in ("w", "b")}
    base = f"{target.base_url}/part"
    cloudckpt.save_safetensors(state, base, max_shard_size=8_000, **_opts(target))
    got = cloudckpt.load_safetensors(base, keys=["layer5.b"], prefix="layer1.", **_opts(target))
    assert list(got) == ["layer1.b", "layer1.w", "layer5.b"]
    assert torch.equal(got["layer5.b"], state["layer5.b"])
    got = cloudckpt.load(f"{base}/model.safetensors.index.json", keys="layer0.w", **_opts(target))
    assert list(got) == ["layer0.w"]
    with pytest.raises(MissingKeyError, match="nope"):
        cloudckpt.load_safetensors(base, keys=["nope"], **_opts(target))
    with pytest.raises(MissingKeyError, match="decoder"):
        cloudckpt.load_safetensors(base, prefix=["layer1.", "decoder."], **_opts(target))


def test_huggingface_hub_loads_a_sharded_save_into_a_model(target, tmp_path):
    """The layout transformers' sharded loader reads (huggingface_hub implements it)."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import load_torch_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    base = f"{target.base_url}/hub"
    cloudckpt.save_safetensors(model.state_dict(), base, max_shard_size="10KB", **_opts(target))
    folder = tmp_path / "download"
    folder.mkdir()
    for key in listing(target, "hub/"):
        (folder / key.split("/")[-1]).write_bytes(download(target, key))
    assert len(list(folder.iterdir())) >= 3  # two shards and the index
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    load_torch_model(fresh, folder, strict=True)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_device_and_map_location():
    state = {"w": torch.randn(4, 4), "i": torch.arange(3)}
    url = "memory://st-device/m.safetensors"
    cloudckpt.save_safetensors(state, url)
    meta = cloudckpt.load_safetensors(url, device="meta")
    assert all(t.device.type == "meta" for t in meta.values())
    assert meta["w"].shape == (4, 4) and meta["i"].dtype == torch.int64
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        out = cloudckpt.load(url, map_location=where)
        assert torch.equal(out["w"], state["w"]) and out["w"].device.type == "cpu"


def test_non_contiguous_and_views_are_written_contiguously():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "row": base[1], "col": base[:, 2]}
    with pytest.raises(cloudckpt.errors.SerializationError, match="share memory"):
        cloudckpt.save_safetensors(state, "memory://st-views/x.safetensors")
    flat = torch.arange(10.0)
    state = {"t": base.t(), "strided": torch.arange(10.0)[::3], "lo": flat[:4], "hi": flat[4:]}
    cloudckpt.save_safetensors(state, "memory://st-views/y.safetensors")
    got = cloudckpt.load("memory://st-views/y.safetensors")
    for name, t in state.items():
        assert torch.equal(got[name], t) and got[name].is_contiguous()
    assert torch.equal(bits(got["t"]), bits(base.t().contiguous()))
