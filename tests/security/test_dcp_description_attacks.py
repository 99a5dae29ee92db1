"""What an outside attempt found after ``.metadata`` could be built from the layout
index's description (issue 39), each file built here by code. Most reached both paths,
the description and a decoded ``.metadata``:

1. A second BUILD called a ``__setstate__`` that a first BUILD had put on the instance
   (``bytearray``): 1 GiB of zeros from a 426-byte byte item, the constructor checks
   skipped. torch's weights-only unpickler calls it too.
2. Items whose bytes overlap in a data object: each chunk read whole is allocated, so
   2,048 overlapping 256 KiB chunks asked for 512 MiB from a 183 KB index.
3. Shapes of 100,000 dimensions: a tuple copy per chunk (+920 MiB from 609 KB), and an
   element count that took minutes to multiply out.
4. A dtype name in the index (``_dynamo``) looked up with ``getattr(torch, ...)``: it
   imported 213 modules and replaced ``torch.manual_seed`` before the refusal.
5. Two identical chunks of a tensor passed the "chunks cover the tensor" check (their
   element counts add up): half the destination kept its old values.
6. A quantized dtype in the metadata: torch's bare ``NotImplementedError`` from the copy.
7. List indices in ``planner_data`` unbounded (a list of 10**7 made by a planner that
   rebuilds the state), negative or ``True``.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import craft
from test_memory_safety_repro import _peak, in_child

import cloudckpt
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from cloudckpt.format.dcp.layout import LAYOUT_NAME, StorageInfo
from cloudckpt.format.dcp.metadata import ChunkIndex, check_metadata

MiB = 1 << 20


def _save(root: Path, state: dict[str, Any]) -> dict[str, Any]:
    dcp.save(state, storage_writer=CloudStorageWriter(str(root)))
    return json.loads((root / LAYOUT_NAME).read_bytes())


def _write_index(root: Path, doc: dict[str, Any]) -> None:
    (root / LAYOUT_NAME).write_text(json.dumps(doc))


def _read_metadata(root: Path) -> Any:
    return CloudStorageReader(str(root)).read_metadata()


# -- 1. a __setstate__ put on the instance --------------------------------------------


def _setstate_gadget(n: int) -> bytes:
    """``Counter()``, BUILD ``{"__setstate__": bytearray}``, BUILD ``n``."""
    return (
        b"\x80\x02ccollections\nCounter\n)R"
        + b"}X\x0c\x00\x00\x00__setstate__cbuiltins\nbytearray\nsb"
        + b"J"
        + struct.pack("<i", n)
        + b"b."
    )


def test_a_setstate_set_by_a_build_is_never_called(tmp_path: Path) -> None:
    path = tmp_path / "gadget.pt"
    path.write_bytes(craft.torch_archive(_setstate_gadget(1 << 30)))
    found = in_child(_peak, lambda: cloudckpt.load(str(path)))
    assert found.get("refused") == "UnsafeCheckpointError", found
    assert "__setstate__" in found["message"]
    assert found["peak"] < 256 * MiB, found
    # torch's weights-only unpickler calls it (here with a small size)
    small = tmp_path / "small.pt"
    small.write_bytes(craft.torch_archive(_setstate_gadget(1 << 10)))
    assert type(torch.load(small, weights_only=True)).__name__ == "Counter"


def test_a_build_setting_the_class_or_any_dunder_is_refused(tmp_path: Path) -> None:
    pkl = b"\x80\x02ccollections\nOrderedDict\n)R}X\t\x00\x00\x00__class__K\x01sb."
    path = tmp_path / "dunder.pt"
    path.write_bytes(craft.torch_archive(pkl))
    with pytest.raises(UnsafeCheckpointError, match="__class__"):
        cloudckpt.load(str(path))


def test_the_gadget_as_a_dcp_byte_item_is_refused(tmp_path: Path) -> None:
    doc = _save(tmp_path, {"w": torch.ones(4), "step": 3})
    gadget = craft.torch_archive(_setstate_gadget(1 << 30))
    data = tmp_path / "__0_0.distcp"
    at = data.stat().st_size
    with data.open("ab") as f:
        f.write(gadget)
    for entry in doc["metadata"]["storage"]:
        if entry[0] == "step":
            old, entry[4], entry[5] = entry[4], at, len(gadget)
    doc["chunks"].pop(f"__0_0.distcp@{old}")
    doc["chunks"][f"__0_0.distcp@{at}"] = zlib.crc32(gadget)
    _write_index(tmp_path, doc)

    def load() -> Any:
        state = {"w": torch.zeros(4), "step": 0}
        try:
            dcp.load(state, storage_reader=CloudStorageReader(str(tmp_path)))
        except CheckpointException as exc:  # a BaseException: said as an Exception
            raise RuntimeError(" ".join(map(str, exc.failures.values()))) from None
        return state

    found = in_child(_peak, load)
    assert "refused" in found and "__setstate__" in found["message"], found
    assert found["peak"] < 256 * MiB, found


# -- 2. overlapping items ----------------------------------------------------------------


def test_items_whose_bytes_overlap_are_refused(tmp_path: Path) -> None:
    doc = _save(tmp_path, {"a": torch.ones(64), "b": torch.zeros(64)})
    storage = doc["metadata"]["storage"]
    first, second = sorted(storage, key=lambda e: e[4])
    second[4] = first[4] + 1  # b's bytes start inside a's
    _write_index(tmp_path, doc)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        _read_metadata(tmp_path)


def test_two_items_naming_the_same_bytes_are_not_an_overlap() -> None:
    props = TensorProperties(dtype=torch.float32)
    size = torch.Size([4])
    whole = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
    md = TensorStorageMetadata(properties=props, size=size, chunks=[whole])
    info = StorageInfo("__0_0.distcp", 0, 100)
    metadata = Metadata(
        state_dict_metadata={"a": md, "b": md},
        storage_data={MetadataIndex("a", [0]): info, MetadataIndex("b", [0]): info},
    )
    check_metadata(metadata, "mem://x")


# -- 3. many dimensions ------------------------------------------------------------------


def _tensor(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> Any:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size(size),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in chunks
        ],
    )


def test_shapes_of_more_than_64_dimensions_are_refused() -> None:
    ones, zeros = [1] * 65, [0] * 65
    metadata = Metadata(state_dict_metadata={"x": _tensor(ones, [(zeros, ones)])})
    with pytest.raises(CorruptCheckpointError, match="at most 64"):
        check_metadata(metadata, "mem://x")


def test_a_shape_of_more_than_2_62_elements_is_refused() -> None:
    huge = [2**61] * 40
    metadata = Metadata(state_dict_metadata={"x": _tensor(huge, [([0] * 40, huge)])})
    with pytest.raises(CorruptCheckpointError, match="elements"):
        check_metadata(metadata, "mem://x")


def test_the_chunk_index_keeps_one_tuple_per_shared_shape() -> None:
    shape, zeros = torch.Size([1] * 64), torch.Size([0] * 64)
    whole = ChunkStorageMetadata(offsets=zeros, sizes=shape)
    props = TensorProperties(dtype=torch.float32)
    state = {
        f"x{i}": TensorStorageMetadata(properties=props, size=shape, chunks=[whole])
        for i in range(100)
    }
    index = ChunkIndex(Metadata(state_dict_metadata=state))
    found = [index.get(MetadataIndex(f"x{i}", zeros)) for i in range(100)]
    assert all(f is not None and f[0] is found[0][0] for f in found)  # type: ignore[index]


# -- 4. dtype names ----------------------------------------------------------------------

_LAZY = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import CorruptCheckpointError
root = sys.argv[1]
dcp.save({"w": torch.randn(512, 256)}, storage_writer=CloudStorageWriter(root))
doc = json.load(open(root + "/.cloudckpt-layout.json"))
for entry in doc["archives"].values():
    entry[0] = "_dynamo"
json.dump(doc, open(root + "/.cloudckpt-layout.json", "w"))
seed, before = torch.manual_seed, set(sys.modules)
try:
    CloudStorageReader(root).read_metadata()
    print("accepted")
except CorruptCheckpointError:
    print("refused")
new = sorted(m for m in set(sys.modules) - before if m.startswith("torch"))
print(json.dumps({"new": new, "seed_kept": torch.manual_seed is seed}))
"""


def test_a_dtype_name_from_the_index_imports_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LAZY, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.strip().splitlines()
    assert lines and lines[0] == "refused", done.stdout + done.stderr[-2000:]
    found = json.loads(lines[1])
    assert found == {"new": [], "seed_kept": True}, found


# -- 5. chunks that overlap, or leave a gap ----------------------------------------------


def _covering(chunks: list[tuple[list[int], list[int]]], size: list[int]) -> None:
    check_metadata(Metadata(state_dict_metadata={"w": _tensor(size, chunks)}), "mem://x")


def test_two_identical_chunks_do_not_cover_a_tensor() -> None:
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        _covering([([0, 0], [32, 32]), ([0, 0], [32, 32])], [64, 32])


def test_grids_and_other_partitions_cover_a_tensor() -> None:
    _covering([([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)], [4, 6])  # a 2x2 grid
    _covering([([0, 0], [2, 4]), ([2, 0], [2, 1]), ([2, 1], [2, 3])], [4, 4])  # not a grid
    _covering([([i], [1]) for i in range(5000)], [5000])  # row shards, many


def test_chunks_that_overlap_off_the_grid_do_not_cover_a_tensor() -> None:
    # 4 + 8 + 4 = 16 elements, but the second overlaps the first: a cell is left out
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        _covering([([0, 0], [2, 2]), ([1, 0], [2, 4]), ([3, 0], [1, 4])], [4, 4])


def test_an_overlap_in_the_description_leaves_no_stale_rows(tmp_path: Path) -> None:
    doc = _save(tmp_path, {"w": torch.randn(64, 32)})
    described = doc["metadata"]
    described["shapes"] += [[32, 32]]
    half = len(described["shapes"]) - 1
    entry = described["items"][0]
    described["items"][0] = [entry[0], entry[1], entry[2], entry[3], half, entry[3], half]
    _write_index(tmp_path, doc)
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        _read_metadata(tmp_path)


# -- 6. dtypes torch cannot copy ---------------------------------------------------------


def test_a_quantized_dtype_in_the_description_is_a_typed_error(tmp_path: Path) -> None:
    doc = _save(tmp_path, {"b": torch.arange(10, dtype=torch.int8)})
    described = doc["metadata"]
    described["properties"][0][0] = "torch.qint8"
    _write_index(tmp_path, doc)
    state = {"b": torch.zeros(10, dtype=torch.int8)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=CloudStorageReader(str(tmp_path)))
    assert "CorruptCheckpointError" in str(info.value) and "qint8" in str(info.value)
    assert "NotImplementedError" not in str(info.value)


# -- 7. planner list indices --------------------------------------------------------------


@pytest.mark.parametrize("index", [10**7, -5, True])
def test_planner_indices_beyond_the_items_are_refused(index: Any) -> None:
    metadata = Metadata(
        state_dict_metadata={"w": _tensor([2], [([0], [2])])},
        planner_data={"w": ("w", index)},
    )
    with pytest.raises(CorruptCheckpointError, match="planner_data"):
        check_metadata(metadata, "mem://x")
