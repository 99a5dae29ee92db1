"""The safetensors codec and the load path's refusals: every malformed file is a
CorruptCheckpointError (a valid one in a dtype torch lacks, UnsupportedFormatError);
index entries cannot leave their folder; sizes and shards as huggingface_hub has them."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

import cloudckpt
from cloudckpt.engine import safetensors as st_engine
from cloudckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    UnsupportedFormatError,
)
from cloudckpt.format.safetensors import (
    MAX_HEADER_SIZE,
    is_shard_name,
    parse_shard_size,
    plan_shards,
)
from cloudckpt.store import open_target
from cloudckpt.store.memory import MemoryStore, clear
from faults import FaultyStore

BUCKET = "st-codec"


@pytest.fixture(autouse=True)
def _fresh_bucket():
    clear(BUCKET)
    yield
    clear(BUCKET)


def put(key: str, data: bytes) -> str:
    where = open_target(f"memory://{BUCKET}/{key}")
    where.store.put(where.key, data)
    return f"memory://{BUCKET}/{key}"


def file_of(header: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


VALID = {"a": t("F32", [2], 0, 8), "b": t("U8", [3], 8, 11)}
CORRUPT = {
    "empty file": b"",
    "shorter than the length": b"\x05\x00\x00",
    "header past the end": file_of("{}", length=100),
    "huge declared header": file_of("{}", length=2**64 - 1),
    "header just over the cap": file_of("{}", length=MAX_HEADER_SIZE + 1),
    "truncated data": file_of(json.dumps(VALID), bytes(10)),
    "trailing bytes": file_of(json.dumps(VALID), bytes(12)),
    "not UTF-8": file_of(b'{"\xff\xfe":1}'),
    "not JSON": file_of("{'a': 1}"),
    "not an object": file_of("[]"),
    "duplicate key": file_of(
        '{"a":' + json.dumps(t("U8", [1], 0, 1)) + ',"a":' + json.dumps(t("U8", [1], 1, 2)) + "}",
        b"xy",
    ),
    "NaN in a shape": file_of('{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,0]}}'),
    "overlapping": file_of(json.dumps({"a": t("U8", [2], 0, 2), "b": t("U8", [2], 1, 3)}), b"xyz"),
    "gap": file_of(json.dumps({"a": t("U8", [1], 0, 1), "b": t("U8", [1], 2, 3)}), b"xyz"),
    "out of range": file_of(json.dumps({"a": t("U8", [4], 0, 4)}), b"xy"),
    "reversed offsets": file_of(json.dumps({"a": t("U8", [0], 2, 0)}), b"xy"),
    "unknown dtype": file_of(json.dumps({"a": t("F128", [1], 0, 16)}), bytes(16)),
    "dtype not a string": file_of(json.dumps({"a": t(5, [1], 0, 1)}), b"x"),  # type: ignore[arg-type]
    "wrong byte count": file_of(json.dumps({"a": t("F32", [3], 0, 8)}), bytes(8)),
    "shape too large": file_of(json.dumps({"a": t("F32", [2**40, 2**40], 0, 8)}), bytes(8)),
    "negative dimension": file_of(json.dumps({"a": t("U8", [-1], 0, 0)})),
    "boolean dimension": file_of(json.dumps({"a": t("U8", [True], 0, 1)}), b"x"),
    "float dimension": file_of(json.dumps({"a": t("U8", [1.0], 0, 1)}), b"x"),
    "three offsets": file_of('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,1]}}', b"x"),
    "missing shape": file_of('{"a":{"dtype":"U8","data_offsets":[0,0]}}'),
    "tensor not an object": file_of('{"a":[1,2]}'),
    "metadata not strings": file_of('{"__metadata__":{"k":1}}'),
    "metadata a list": file_of('{"__metadata__":["k"]}'),
    "lone surrogate name": file_of('{"\\ud800":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'),
    "deep nesting": file_of("{" + '"a":' * 1 + "[" * 100_000 + "]" * 100_000 + "}"),
    "bits not whole bytes": file_of(json.dumps({"a": t("F4", [3], 0, 1)}), b"x"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_malformed_files_are_corrupt_checkpoints(case):
    url = put("bad.safetensors", CORRUPT[case])
    with pytest.raises(CorruptCheckpointError):
        cloudckpt.load(url)


def test_the_library_refuses_them_too_but_duplicates():
    from safetensors.torch import load

    for case, data in CORRUPT.items():
        if case in ("duplicate key", "deep nesting", "header just over the cap"):
            continue  # the library reads duplicates (the last wins); refuses the others
        with pytest.raises(Exception):  # noqa: B017 - any refusal
            load(data)


def test_a_huge_declared_header_reads_no_more_than_the_probe(monkeypatch):
    store = FaultyStore(MemoryStore(BUCKET))
    monkeypatch.setattr(st_engine, "open_target", store.opener())
    store.inner.put("x.safetensors", file_of("{}", length=MAX_HEADER_SIZE - 8))
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        cloudckpt.load_safetensors("x.safetensors")
    assert store.calls == {"head": 1, "get_range": 1}


def test_valid_files_load_exactly():
    edge = {
        "leading space": (" " + json.dumps(VALID), bytes(range(11))),
        "metadata null": (json.dumps({"__metadata__": None, **VALID}), bytes(range(11))),
        "extra field": (json.dumps({"a": {**t("U8", [1], 0, 1), "x": 1}}), b"z"),
        "zero-size at the same offset": (
            json.dumps({"e": t("F32", [0, 4], 0, 0), "a": t("U8", [1], 0, 1)}),
            b"z",
        ),
        "no tensors": ("{}", b""),
    }
    from safetensors.torch import load

    for case, (header, data) in edge.items():
        blob = file_of(header, data)
        got = cloudckpt.load(put("ok.safetensors", blob))
        want = load(blob)
        assert list(got) == sorted(want), case
        assert all(torch.equal(got[k], want[k]) for k in want), case


def test_dtypes_torch_cannot_hold_are_unsupported_not_corrupt():
    f6 = file_of(json.dumps({"a": t("U8", [1], 0, 1), "q": t("F6_E2M3", [4], 1, 4)}), b"xyzw")
    url = put("f6.safetensors", f6)
    with pytest.raises(UnsupportedFormatError, match="F6_E2M3"):
        cloudckpt.load(url)
    assert list(cloudckpt.load(url, keys=["a"])) == ["a"]  # the rest still loads
    odd = file_of(json.dumps({"q": t("F4", [2, 1], 0, 1)}), b"x")  # torch packs pairs
    with pytest.raises(UnsupportedFormatError, match="multiple of 2"):
        cloudckpt.load(put("f4.safetensors", odd))


def _index(weight_map: dict) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


@pytest.mark.parametrize(
    "file", ["../evil.safetensors", "/abs.safetensors", "a/../../x.safetensors", "a\\b", ""]
)
def test_index_entries_cannot_leave_their_folder(file):
    put("ck/x/evil.safetensors", st_save({"w": torch.zeros(1)}))
    url = put("ck/x/model.safetensors.index.json", _index({"w": file}))
    with pytest.raises(CorruptCheckpointError):
        cloudckpt.load(url)


def test_index_that_names_missing_tensors_or_is_not_an_index():
    put("ck/s.safetensors", st_save({"w": torch.zeros(1)}))
    url = put(
        "ck/model.safetensors.index.json", _index({"w": "s.safetensors", "v": "s.safetensors"})
    )
    with pytest.raises(CorruptCheckpointError, match="does not hold"):
        cloudckpt.load(url)
    for raw in (b"", b"not json", b"[]", b'{"weight_map": {"w": 3}}', b'{"metadata": {}}'):
        url = put("ck/model.safetensors.index.json", raw)
        with pytest.raises(CorruptCheckpointError):
            cloudckpt.load(url)
    put("ck/model.safetensors.index.json", _index({"w": "gone.safetensors"}))
    with pytest.raises(NotFoundError):
        cloudckpt.load(url)


def test_a_folder_is_searched_as_transformers_does():
    one = st_save({"w": torch.ones(1)})
    put("f/model-00001-of-00002.safetensors", one)
    with pytest.raises(NotFoundError, match="no safetensors checkpoint"):
        cloudckpt.load_safetensors(f"memory://{BUCKET}/f")  # shards without an index
    put("f/adapter.safetensors", one)
    assert list(cloudckpt.load_safetensors(f"memory://{BUCKET}/f/")) == ["w"]
    put("f/other.safetensors", one)
    with pytest.raises(ConfigError, match=r"adapter\.safetensors, other\.safetensors"):
        cloudckpt.load_safetensors(f"memory://{BUCKET}/f")
    put("f/model.safetensors", st_save({"m": torch.ones(1)}))
    assert list(cloudckpt.load_safetensors(f"memory://{BUCKET}/f")) == ["m"]


def test_shard_sizes_read_as_transformers_reads_them():
    assert parse_shard_size(123) == 123
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MiB") == 500 * 2**20
    assert parse_shard_size("1.5gb") == 1_500_000_000
    assert parse_shard_size(" 10 KB ") == 10_000
    assert parse_shard_size("1000") == 1000
    for bad in ("", "5 parsecs", "-1GB", 0, True, 1.5, "GB"):
        with pytest.raises(ConfigError):
            parse_shard_size(bad)  # type: ignore[arg-type]


def test_shards_split_as_huggingface_hub_splits_them():
    hub = pytest.importorskip("huggingface_hub")
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        sizes = torch.randint(1, 400, (12,), generator=g).tolist()
        state = {f"t{i:02d}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
        limit = int(torch.randint(50, 1200, (1,), generator=g))
        split = hub.split_torch_state_dict_into_shards(state, max_shard_size=limit)
        ours = plan_shards([(k, v.nbytes) for k, v in state.items()], limit)
        assert [sorted(g) for g in ours] == [
            sorted(v) for v in split.filename_to_tensors.values()
        ], trial


def test_shard_names():
    assert is_shard_name("model-00001-of-00003.safetensors", "model")
    assert is_shard_name("a-b-00010-of-00010.safetensors", "a-b")
    assert not is_shard_name("model-00001-of-00003.safetensors", "mod")
    assert not is_shard_name("model.safetensors")
    assert not is_shard_name("model-1-of-3.safetensors")
