"""The description of ``.metadata`` in the layout index (format/dcp/described.py): a load
of a checkpoint cloudckpt wrote builds its metadata from that JSON and never unpickles
``.metadata``; anything the description cannot say exactly, or a ``.metadata`` whose
CRC-32 is not the one the index recorded, decodes ``.metadata`` as before; a damaged
description is a CorruptCheckpointError naming the index, never a crash."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.format.dcp import index as index_module
from cloudckpt.format.dcp.described import build_metadata, describe_metadata
from cloudckpt.format.dcp.layout import LAYOUT_NAME, METADATA_NAME
from cloudckpt.format.dcp.metadata import MCoreMetadata, check_metadata


def _state() -> dict[str, Any]:
    """Every kind of item a description holds: dtypes, shapes shared and not, a
    channels-last tensor, a nested container (planner paths with indices), bytes
    items, a scalar, an empty tensor."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {f"layer{i}.weight": torch.randn(8, 4, generator=g) for i in range(5)},
        "half": torch.randn(3, 5, generator=g).half(),
        "ints": torch.arange(7, dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "image": torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "step": 12},
        "note": "a string",
    }


def _template(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    return state


def _save(path: Path) -> dict[str, Any]:
    state = _state()
    dcp.save(state, storage_writer=CloudStorageWriter(str(path)))
    return state


def _index(path: Path) -> dict[str, Any]:
    return json.loads((path / LAYOUT_NAME).read_bytes())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_the_description_builds_the_metadata_torch_unpickles(tmp_path: Path) -> None:
    _save(tmp_path)
    doc = _index(tmp_path)
    assert "metadata" in doc
    unpickled = FileSystemReader(str(tmp_path)).read_metadata()  # torch's own reader
    built = build_metadata(doc["metadata"], "index")
    assert isinstance(built, Metadata)
    unpickled.storage_meta.load_id = None  # set by the reader, not stored
    assert built == unpickled
    check_metadata(built, "x")


def test_a_load_builds_from_the_description_without_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _save(tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr(index_module, "decode_metadata", refuse)
    out = _template(state)
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)))
    assert _equal(out, state)


def test_without_a_description_metadata_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index written before descriptions (or with one left out): the same load."""
    state = _save(tmp_path)
    doc = _index(tmp_path)
    del doc["metadata"]
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    decoded: list[str] = []
    real = index_module.decode_metadata
    monkeypatch.setattr(
        index_module, "decode_metadata", lambda *a, **k: decoded.append("x") or real(*a, **k)
    )
    out = _template(state)
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)))
    assert _equal(out, state) and decoded == ["x"]


def test_a_description_of_another_version_is_left_for_decoding(tmp_path: Path) -> None:
    state = _save(tmp_path)
    doc = _index(tmp_path)
    doc["metadata"]["v"] = 99
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    assert build_metadata(doc["metadata"], "index") is None
    out = _template(state)
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)))
    assert _equal(out, state)


def test_a_metadata_that_fails_its_crc_is_not_built_from_the_description(
    tmp_path: Path,
) -> None:
    """``.metadata`` replaced after the save (one byte changed inside a string): the
    description no longer vouches for it, and the CRC-32 the index holds refuses it."""
    _save(tmp_path)
    raw = bytearray((tmp_path / METADATA_NAME).read_bytes())
    at = raw.index(b"layer0.weight")
    raw[at] = ord("L")
    (tmp_path / METADATA_NAME).write_bytes(bytes(raw))
    with pytest.raises(Exception, match="CRC-32"):
        CloudStorageReader(str(tmp_path)).read_metadata()


def _damaged_cases() -> list[tuple[str, Any]]:
    return [
        ("shapes", lambda d: d["shapes"].append([True])),
        ("shapes", lambda d: d["shapes"].append([-1])),
        ("dtype", lambda d: d["properties"][0].__setitem__(0, "os.system")),
        ("layout", lambda d: d["properties"][0].__setitem__(1, 3)),
        ("memory format", lambda d: d["properties"][0].__setitem__(3, "torch.channels_last")),
        ("boolean", lambda d: d["properties"][0].__setitem__(2, 1)),
        ("items", lambda d: d["items"][0].__setitem__(2, 10**6)),
        ("items", lambda d: d["items"][0].__setitem__(1, -1)),
        ("items", lambda d: d["items"][0].append(0)),
        ("items", lambda d: d["items"].append({"fqn": "x"})),
        ("name", lambda d: d["items"][0].__setitem__(0, 7)),
        ("storage", lambda d: d["storage"][0].__setitem__(3, 5)),
        ("storage", lambda d: d["storage"][0].__setitem__(4, 2**63)),
        ("storage", lambda d: d["storage"][0].pop()),
        ("planner", lambda d: d["planner"].append(["x", 1.5])),
        ("storage_meta", lambda d: d.__setitem__("storage_meta", [1, 2, 3, []])),
        ("version", lambda d: d.__setitem__("version", 1)),
        ("missing", lambda d: d.pop("shapes")),
    ]


@pytest.mark.parametrize("case", range(len(_damaged_cases())))
def test_a_damaged_description_is_refused_naming_the_index(tmp_path: Path, case: int) -> None:
    _save(tmp_path)
    doc = _index(tmp_path)
    _, damage = _damaged_cases()[case]
    damage(doc["metadata"])
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=LAYOUT_NAME):
        CloudStorageReader(str(tmp_path)).read_metadata()


def test_a_description_of_another_save_is_refused(tmp_path: Path) -> None:
    _save(tmp_path)
    doc = _index(tmp_path)
    doc["metadata"]["storage_meta"][1] = "another-save"
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="names another save"):
        CloudStorageReader(str(tmp_path)).read_metadata()


def test_a_description_that_breaks_the_metadata_checks_is_refused(tmp_path: Path) -> None:
    """Values of the right types that say something impossible (a chunk larger than
    its tensor): the same check a decoded ``.metadata`` meets."""
    _save(tmp_path)
    doc = _index(tmp_path)
    described = doc["metadata"]
    described["shapes"].append([10**6, 10**6])
    big = len(described["shapes"]) - 1
    tensor = next(e for e in described["items"] if len(e) >= 5)
    tensor[4] = big  # the first chunk's sizes
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="chunk outside its size"):
        CloudStorageReader(str(tmp_path)).read_metadata()


def test_mutated_descriptions_never_crash(tmp_path: Path) -> None:
    """Random damage to every position of a real description (seeded): each build
    either gives metadata that passes the checks or raises CorruptCheckpointError."""
    _save(tmp_path)
    original = json.dumps(_index(tmp_path)["metadata"])
    rng = random.Random(7)
    values: list[Any] = [
        True, False, None, -1, 0, 1, 2**31, 2**63, 1.5, "", "torch.float32",
        "torch.strided", "contiguous", [], [0], [[0]], {}, "x" * 100,
    ]  # fmt: skip
    built = refused = 0
    for _ in range(3000):
        doc = json.loads(original)
        for _ in range(rng.randint(1, 3)):
            _mutate(doc, rng, values)
        try:
            metadata = build_metadata(doc, "index")
            if metadata is not None:
                check_metadata(metadata, "x")
            built += 1
        except CorruptCheckpointError:
            refused += 1
    assert built > 0 and refused > 0, (built, refused)


def _mutate(node: Any, rng: random.Random, values: list[Any]) -> None:
    """Replace, drop or add one value somewhere inside ``node``."""
    while True:
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            child = node[key]
        elif isinstance(node, list) and node:
            key = rng.randrange(len(node))
            child = node[key]
        else:
            return
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.3:
            action = rng.random()
            if action < 0.7:
                node[key] = rng.choice(values)
            elif action < 0.85:
                del node[key]
            elif isinstance(node, list):
                node.insert(key, rng.choice(values))
            return
        node = child


def test_what_a_description_cannot_say_is_not_described() -> None:
    base = Metadata(state_dict_metadata={})
    assert describe_metadata(base) is not None
    assert describe_metadata(MCoreMetadata(state_dict_metadata={})) is None  # a subclass
    extra = Metadata(state_dict_metadata={})
    extra.all_local_plans = []  # type: ignore[attr-defined]  # megatron's addition
    assert describe_metadata(extra) is None
    odd_planner = Metadata(state_dict_metadata={}, planner_data={"a": ["list"]})
    assert describe_metadata(odd_planner) is None


def test_a_description_too_large_for_the_index_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_module, "MAX_INDEX_BYTES", 4096)
    state = _save(tmp_path)
    assert "metadata" not in _index(tmp_path)
    monkeypatch.undo()
    out = _template(state)
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)))
    assert _equal(out, state)
