"""CloudStorageWriter / CloudStorageReader in one process: slices, coalescing, errors, pickling.

Reads are driven with hand-made DCP read items so each test can say exactly which
slice of a saved tensor it wants, and check the bytes the reader fetched for it.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp.destinations import Destinations
from cloudckpt.dcp.slices import HEAD_PROBE, TAIL_PROBE, Archive, SliceReader
from cloudckpt.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
)
from cloudckpt.format.dcp.archive import SavedTensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROWS, COLS = 1024, 512  # float32: 2 MiB, well above the whole-archive limit


class _Planner:
    """The three LoadPlanner methods read_data uses, over a dict of destinations."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []
        self.loaded: dict[str, bytes] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[item.dest_index.fqn] = value.read()


def _slice_item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    zeros = torch.Size([0] * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn),
        dest_offsets=zeros,
        storage_index=MetadataIndex(fqn, zeros),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def _reader(url: str, **kw: Any) -> CloudStorageReader:
    reader = CloudStorageReader(url, **kw)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    return reader


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS)


@pytest.fixture
def saved(tmp_path: Path, weight: torch.Tensor) -> str:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": weight, "step": 3}, storage_writer=CloudStorageWriter(url))
    return url


def test_row_slice_is_read_in_place_and_alone(saved: str, weight: torch.Tensor) -> None:
    reader = _reader(saved)
    target = torch.empty(128, COLS)
    address = target.data_ptr()
    planner = _Planner({"w": target})
    reader.read_data(LoadPlan([_slice_item("w", (256, 0), (128, COLS))]), planner).wait()
    assert torch.equal(target, weight[256:384])
    assert target.data_ptr() == address and planner.committed == ["w"]
    # cloudckpt's layout index says where the bytes are: one request, exactly the
    # slice's bytes, never the whole 2 MiB object (the slice starts and ends on the
    # boundaries of its 64 KiB checksum blocks, so checking it reads nothing more)
    assert reader.last_read_bytes == 128 * COLS * 4
    assert reader.last_read_requests == 1


def test_large_slice_is_split_into_read_chunk_size_requests(
    saved: str, weight: torch.Tensor
) -> None:
    reader = _reader(saved, read_chunk_size=256 * 1024)
    target = torch.empty(512, COLS)  # 1 MiB -> 4 requests of 256 KiB
    reader.read_data(LoadPlan([_slice_item("w", (512, 0), (512, COLS))]), _Planner({"w": target}))
    assert torch.equal(target, weight[512:])
    assert reader.last_read_requests == 4


def test_column_slice_into_strided_destination_with_dtype_change(
    saved: str, weight: torch.Tensor
) -> None:
    reader = _reader(saved)
    destination = torch.zeros(ROWS, 200, dtype=torch.float64)
    target = destination[:, 10:60]  # non-contiguous view, another dtype
    reader.read_data(LoadPlan([_slice_item("w", (0, 100), (ROWS, 50))]), _Planner({"w": target}))
    assert torch.equal(destination[:, 10:60], weight[:, 100:150].double())
    assert destination[:, :10].abs().sum() == 0 and destination[:, 60:].abs().sum() == 0
    assert reader.last_read_bytes <= ROWS * COLS * 4


def test_strided_tensor_saved_by_filesystem_writer(tmp_path: Path) -> None:
    base = torch.randn(COLS, ROWS)
    transposed = base.t()  # FileSystemWriter keeps these strides in its archive
    url = str(tmp_path / "fs")
    dcp.save({"w": transposed}, storage_writer=dcp.FileSystemWriter(url))
    reader = _reader(url)
    target = torch.empty(100, COLS)
    reader.read_data(LoadPlan([_slice_item("w", (900, 0), (100, COLS))]), _Planner({"w": target}))
    assert torch.equal(target, transposed[900:1000])
    # No layout index from torch's writer: the archive's head and tail are read
    # first (data.pkl and the zip directory), then the span holding the slice.
    span = (99 + (COLS - 1) * ROWS + 1) * 4
    assert reader.last_read_requests == 3
    assert reader.last_read_bytes == HEAD_PROBE + TAIL_PROBE + span


def test_views_are_saved_as_their_own_bytes_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = torch.randn(3 * ROWS, COLS)
    state = {
        "rows": parent[ROWS : 2 * ROWS],  # contiguous view: aliased, not copied
        "cols": parent[:ROWS, : COLS // 2],  # strided view: copied
        "scalar": parent[5, 7],
        "flags": (parent[:ROWS] > 0)[10:20],
    }
    copies = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(
        torch.Tensor, "clone", lambda t, *a, **k: copies.append(t.shape) or real_clone(t, *a, **k)
    )
    url = str(tmp_path / "views")
    dcp.save(state, storage_writer=CloudStorageWriter(url))
    monkeypatch.undo()
    assert copies == []
    # Each saved archive holds the view's bytes only, not the parent's storage.
    tensor_bytes = sum(v.nbytes for v in state.values())
    assert (tmp_path / "views" / "__0_0.distcp").stat().st_size < tensor_bytes + 64 * 1024
    for reader in (CloudStorageReader(url), dcp.FileSystemReader(url)):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=reader)
        assert all(torch.equal(out[k], state[k]) for k in state)


def test_stale_layout_index_is_ignored(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.zeros(ROWS, COLS)}, storage_writer=CloudStorageWriter(url))
    assert (tmp_path / "ckpt" / ".cloudckpt-layout.json").exists()
    # Same object, same offset, but strides the old index does not describe.
    fresh = {"w": torch.randn(COLS, ROWS).t()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(fresh, storage_writer=dcp.FileSystemWriter(url))
    out = {"w": torch.zeros(ROWS, COLS)}
    dcp.load(out, storage_reader=CloudStorageReader(url))
    assert torch.equal(out["w"], fresh["w"])


def test_small_items_are_coalesced_into_one_request(tmp_path: Path) -> None:
    state = {f"t{i:03d}": torch.full((64,), float(i)) for i in range(100)}
    state["step"] = 12  # a byte item between them
    url = str(tmp_path / "many")
    dcp.save(state, storage_writer=CloudStorageWriter(url))
    out: dict[str, Any] = {k: torch.zeros(64) for k in state if k != "step"}
    out["step"] = 0
    reader = CloudStorageReader(url)
    dcp.load(out, storage_reader=reader)
    assert all(torch.equal(out[k], state[k]) for k in state if k != "step")
    assert out["step"] == 12
    assert reader.last_read_requests == 1


def test_metadata_writes_equal_shapes_and_properties_once(tmp_path: Path) -> None:
    """.metadata as torch's FileSystemWriter describes the same state, in fewer bytes:
    equal shapes and tensor properties are pickled once and referred to after."""
    state: dict[str, Any] = {f"t{i:02d}": torch.randn(3, 5) for i in range(40)}
    state["h"] = torch.zeros(2, 5, dtype=torch.float16)
    state["g"] = torch.zeros(3, 5, requires_grad=True)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(state, storage_writer=CloudStorageWriter(str(ours)))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(theirs)))
    # Test-only: both files were just written here.
    mine = pickle.loads((ours / ".metadata").read_bytes())
    ref = pickle.loads((theirs / ".metadata").read_bytes())
    assert mine.state_dict_metadata == ref.state_dict_metadata
    described = mine.state_dict_metadata.values()
    assert len({id(md.properties) for md in described}) == 3  # fp32, fp16, requires_grad
    assert len({id(md.size) for md in described}) == 2
    assert (ours / ".metadata").stat().st_size < (theirs / ".metadata").stat().st_size
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(ours)))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("writer", [CloudStorageWriter, dcp.FileSystemWriter])
def test_small_archives_are_copied_from_their_record_without_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: Any
) -> None:
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    state = {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(33).to(torch.bfloat16),
        "i8": torch.arange(-8, 8, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": base.t(),  # torch's writer keeps a view's strides in its archive
    }
    url = str(tmp_path / "small")
    dcp.save(state, storage_writer=writer(url))
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dcp.load(out, storage_reader=CloudStorageReader(url))
    assert calls == []
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_a_small_archive_whose_slice_is_out_of_range_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "small")
    dcp.save({"b": torch.arange(16.0)}, storage_writer=CloudStorageWriter(url))
    reader = _reader(url)
    item = _slice_item("b", (8,), (16,))  # past the saved chunk of 16 elements
    with pytest.raises(CorruptCheckpointError, match="asks for offsets"):
        reader.read_data(LoadPlan([item]), _Planner({"b": torch.empty(16)}))


def test_a_saved_tensor_reaching_past_its_record_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "small")
    dcp.save({"b": torch.arange(4.0)}, storage_writer=CloudStorageWriter(url))
    reader = _reader(url)
    archive = Archive("__0_0.distcp", 0, 1000)
    # Strides of 2 over a record of 4 floats: the last element would lie at byte 24.
    saved = SavedTensor(torch.float32, 0, (4,), (2,), data_offset=64, record_size=16)
    with pytest.raises(CorruptCheckpointError, match="past the end of its storage record"):
        dest = Destinations(cast(Any, _Planner({})))
        slices = SliceReader(reader.location, reader._chunks, weights_only=True, dest=dest)
        slices.slice_of(archive, saved, _slice_item("b", (0,), (4,)), url)


def test_every_store_round_trip(store_url: Any, weight: torch.Tensor) -> None:
    url = f"{store_url.base_url}/one/ckpt"
    so = store_url.storage_options
    state = {"w": weight, "b": torch.arange(10), "meta": {"epoch": 2}}
    dcp.save(state, storage_writer=CloudStorageWriter(url, storage_options=so, files_per_rank=2))
    out = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(10, dtype=torch.long), "meta": {}}
    out["meta"]["epoch"] = 0
    dcp.load(out, storage_reader=CloudStorageReader(url, storage_options=so))
    assert torch.equal(out["w"], weight) and torch.equal(out["b"], state["b"])
    assert out["meta"]["epoch"] == 2


def test_missing_metadata_is_not_a_checkpoint(tmp_path: Path) -> None:
    url = str(tmp_path / "nothing")
    with pytest.raises(NotFoundError, match=r"no committed checkpoint at .*nothing"):
        CloudStorageReader(url).read_metadata()


def test_overwrite_false_refuses_a_committed_checkpoint(saved: str) -> None:
    # The phrase torch's own e2e test matches against FileSystemWriter's refusal.
    with pytest.raises(CheckpointException, match=r".*Checkpoint already exists.*") as caught:
        dcp.save({"w": torch.zeros(2)}, storage_writer=CloudStorageWriter(saved, overwrite=False))
    assert any(isinstance(f[0], AlreadyExistsError) for f in caught.value.failures.values())
    reader = _reader(saved)  # and the old checkpoint is untouched
    assert reader.storage_data


def test_overwrite_replaces_the_checkpoint(saved: str) -> None:
    new = torch.ones(ROWS, COLS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": new, "step": 4}, storage_writer=CloudStorageWriter(saved))
    out = {"w": torch.zeros(ROWS, COLS), "step": 0}
    dcp.load(out, storage_reader=CloudStorageReader(saved))
    assert torch.equal(out["w"], new) and out["step"] == 4


def test_writer_and_reader_pickle_without_clients(saved: str, moto_server: Any) -> None:
    so = moto_server.storage_options()
    writer = CloudStorageWriter("s3://some-bucket/ckpt", storage_options=so, part_size=8 << 20)
    assert writer.location.store is not None  # opened in this process ...
    restored = pickle.loads(pickle.dumps(writer))
    assert restored.location._opened is None  # ... but never shipped
    assert restored.location.options.part_size == 8 << 20
    reader = _reader(saved)
    restored_reader = pickle.loads(pickle.dumps(reader))
    assert restored_reader.location._opened is None and restored_reader.url == saved


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        CloudStorageWriter("s3://b/k", files_per_rank=0)
    with pytest.raises(ConfigError):
        CloudStorageWriter("ftp://b/k")
    assert CloudStorageWriter.validate_checkpoint_id("s3://b/k")
    assert not CloudStorageReader.validate_checkpoint_id("ftp://b/k")


def test_many_ranks_spread_their_objects_over_sub_prefixes_by_default() -> None:
    from collections import Counter

    from torch.distributed.checkpoint.planner import SavePlan

    from cloudckpt.format.dcp.layout import auto_fanout

    assert [auto_fanout(n) for n in (1, 8, 64, 65, 128, 1024)] == [1, 1, 1, 2, 2, 16]
    few = CloudStorageWriter("memory://fanout/a").prepare_global_plan([SavePlan([])] * 64)
    assert {p.storage_data for p in few} == {f"__{r}_" for r in range(64)}  # flat
    many = CloudStorageWriter("memory://fanout/b").prepare_global_plan([SavePlan([])] * 1024)
    assert many[0].storage_data == "d00/__0_" and many[17].storage_data == "d01/__17_"
    per_prefix = Counter(p.storage_data.split("/")[0] for p in many)
    assert len(per_prefix) == 16 and set(per_prefix.values()) == {64}
    flat = CloudStorageWriter("memory://fanout/c", prefix_fanout=1)
    assert all("/" not in p.storage_data for p in flat.prepare_global_plan([SavePlan([])] * 1024))
