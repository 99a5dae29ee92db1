"""DCP loads check what they read: a flipped bit or a truncated object is an error.

Whole loads and partial (resharded) slices of checkpoints written by
CloudStorageWriter are checked block by block against the layout index; chunks read
whole by their CRC-32; checkpoints written by torch's FileSystemWriter by the zip
CRC-32 of every record read in full. Never a silently wrong tensor.
"""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import ChecksumError, CorruptCheckpointError, UnsafeCheckpointError
from cloudckpt.format.dcp.checks import MAX_BLOCK, block_size_for
from cloudckpt.format.torch.zipdir import parse_directory

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROWS, COLS = 1024, 512  # float32: 2 MiB, read by slices


class _Planner:
    """The LoadPlanner methods read_data uses, over a dict of destinations."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.loaded: dict[str, bytes] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[item.dest_index.fqn] = value.read()


def _rows(fqn: str, first: int, count: int, cols: int = COLS) -> ReadItem:
    """Rows ``first .. first+count`` of a 2-D tensor saved as one chunk."""
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(fqn, torch.Size([0, 0])),
        storage_offsets=torch.Size([first, 0]),
        lengths=torch.Size([count, cols]),
    )


def _elements(fqn: str, first: int, count: int) -> ReadItem:
    """Elements ``first .. first+count`` of a 1-D tensor saved as one chunk."""
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(fqn, torch.Size([0])),
        storage_offsets=torch.Size([first]),
        lengths=torch.Size([count]),
    )


def _reader(url: str) -> CloudStorageReader:
    reader = CloudStorageReader(url)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    return reader


def _load(url: str, like: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in like.items()}
    dcp.load(out, storage_reader=CloudStorageReader(url))
    return out


def _failure(caught: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """The one rank failure DCP wrapped in its CheckpointException."""
    (failure,) = caught.value.failures.values()
    return failure[0]


def _layout(path: Path) -> dict[str, Any]:
    return json.loads((path / ".cloudckpt-layout.json").read_text())


def _record_start(path: Path) -> tuple[int, int]:
    """(object offset of the first large record's bytes, its size), from the layout."""
    ((where, entry),) = _layout(path)["archives"].items()
    return int(where.rpartition("@")[2]) + entry[4], entry[5]


def _flip(path: Path, offset: int, bit: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def state(weight: torch.Tensor) -> dict[str, Any]:
    return {"w": weight, "b": torch.arange(10, dtype=torch.int32), "step": 7}


@pytest.fixture
def saved(tmp_path: Path, state: dict[str, Any]) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=CloudStorageWriter(str(path)))
    return path


def test_an_untouched_checkpoint_loads_exactly(saved: Path, state: dict[str, Any]) -> None:
    out = _load(str(saved), state)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["step"] == 7
    layout = _layout(saved)
    assert layout["format"] == 2 and isinstance(layout["metadata_crc32"], int)
    (entry,) = layout["archives"].values()
    assert entry[6] == block_size_for(ROWS * COLS * 4) == 64 * 1024  # 2 MiB / 64 -> 64 KiB
    assert len(layout["chunks"]) == 2  # "b" and "step" as read whole by older readers
    (placed,) = layout["records"].values()  # "b"'s record placed; "step" is a byte item
    assert len(placed) == 3


def _small_record(saved: Path, fqn: str = "b") -> tuple[int, int]:
    """(object offset of a small tensor's record bytes, the chunk's length)."""
    metadata = CloudStorageReader(str(saved)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    flat = _layout(saved)["records"][info.relative_path]
    placed = {flat[i]: flat[i + 1] for i in range(0, len(flat), 3)}
    return info.offset + placed[info.offset], info.length


@pytest.mark.parametrize("where", [0, 1, 777_777, ROWS * COLS * 4 - 1])
def test_a_flipped_bit_fails_a_full_load(saved: Path, state: dict[str, Any], where: int) -> None:
    start, _ = _record_start(saved)
    _flip(saved / "__0_0.distcp", start + where)
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    error = _failure(caught)
    assert isinstance(error, ChecksumError)
    block = where // (64 * 1024)
    assert f"{saved.as_uri()}/__0_0.distcp: bytes {start + block * 65536}-" in str(error)
    assert "(w, block" in str(error)


def test_a_flipped_bit_fails_a_partial_slice(saved: Path, weight: torch.Tensor) -> None:
    start, _ = _record_start(saved)
    row_bytes = COLS * 4
    # Rows 301..400: bytes 616448..821248, widened to blocks 9..12 (589824..851968).
    _flip(saved / "__0_0.distcp", start + 350 * row_bytes + 5)
    reader = _reader(str(saved))
    target = torch.empty(100, COLS)
    with pytest.raises(ChecksumError, match=r"__0_0\.distcp: bytes .* \(w, block 10 of"):
        reader.read_data(LoadPlan([_rows("w", 301, 100)]), _Planner({"w": target}))


def test_a_flipped_bit_on_an_s3_server_fails_the_slice_that_covers_it(
    s3_server: Any, weight: torch.Tensor
) -> None:
    """The same check over a real S3 server: the widened ranged GETs (presigned, read
    into the destination and scratch buffers) and the per-block check after them."""
    bucket = s3_server.make_bucket(f"dcp-flip-{s3_server.name}")
    url = f"s3://{bucket}/ckpt"
    opts = {"storage_options": s3_server.storage_options()}
    dcp.save({"w": weight}, storage_writer=CloudStorageWriter(url, **opts))
    client = s3_server.client()
    layout = json.loads(
        client.get_object(Bucket=bucket, Key="ckpt/.cloudckpt-layout.json")["Body"].read()
    )
    ((where, entry),) = layout["archives"].items()
    start = int(where.rpartition("@")[2]) + entry[4]
    data = bytearray(client.get_object(Bucket=bucket, Key="ckpt/__0_0.distcp")["Body"].read())
    data[start + 350 * COLS * 4 + 5] ^= 1 << 3  # inside row 350
    client.put_object(Bucket=bucket, Key="ckpt/__0_0.distcp", Body=bytes(data))

    def read(first: int, count: int) -> torch.Tensor:
        reader = CloudStorageReader(url, **opts)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        target = torch.empty(count, COLS)
        reader.read_data(LoadPlan([_rows("w", first, count)]), _Planner({"w": target}))
        return target

    with pytest.raises(
        ChecksumError, match=rf"s3://{bucket}/ckpt/__0_0\.distcp: bytes .* \(w, block 10 of"
    ):
        read(301, 100)
    assert torch.equal(read(0, 200), weight[:200])  # blocks that do not hold the flip


def test_a_flip_next_to_a_slice_is_caught_in_its_blocks_and_ignored_beyond(
    saved: Path, weight: torch.Tensor
) -> None:
    start, _ = _record_start(saved)
    row_bytes = COLS * 4
    # A flip in row 299: outside the slice, inside its first block (bytes 589824..).
    _flip(saved / "__0_0.distcp", start + 299 * row_bytes)
    with pytest.raises(ChecksumError, match="block 9 of"):
        _reader(str(saved)).read_data(
            LoadPlan([_rows("w", 301, 100)]), _Planner({"w": torch.empty(100, COLS)})
        )
    # Rows 600.. lie in blocks the flip is not in: read and checked, exactly.
    target = torch.empty(100, COLS)
    _reader(str(saved)).read_data(LoadPlan([_rows("w", 600, 100)]), _Planner({"w": target}))
    assert torch.equal(target, weight[600:700])


def test_a_partial_slice_into_a_strided_destination_is_checked(
    saved: Path, weight: torch.Tensor
) -> None:
    start, _ = _record_start(saved)
    destination = torch.zeros(200, COLS, dtype=torch.float64)
    target = destination[50:150]  # another dtype: read into a scratch buffer, copied
    _reader(str(saved)).read_data(LoadPlan([_rows("w", 10, 100)]), _Planner({"w": target}))
    assert torch.equal(target, weight[10:110].double())
    _flip(saved / "__0_0.distcp", start + 12 * COLS * 4 + 1)
    with pytest.raises(ChecksumError, match=r"\(w, block 0 of"):
        _reader(str(saved)).read_data(LoadPlan([_rows("w", 10, 100)]), _Planner({"w": target}))


def test_resharded_reads_stay_within_two_blocks_of_the_slice(tmp_path: Path) -> None:
    rows, cols = 3000, 1000  # 12 MB record: 128 KiB blocks
    weight = torch.randn(rows, cols)
    path = tmp_path / "big"
    dcp.save({"w": weight}, storage_writer=CloudStorageWriter(str(path)))
    block = block_size_for(rows * cols * 4)
    assert block == 128 * 1024
    for first, count in [(0, 1000), (1000, 1000), (2000, 1000), (7, 333), (1234, 1)]:
        reader = _reader(str(path))
        target = torch.empty(count, cols)
        reader.read_data(LoadPlan([_rows("w", first, count, cols)]), _Planner({"w": target}))
        assert torch.equal(target, weight[first : first + count])
        extra = reader.last_read_bytes - target.numel() * 4
        assert 0 <= extra < 2 * block, (first, count, extra)
    # Whole tensor: not one byte more than the tensor.
    reader = _reader(str(path))
    target = torch.empty(rows, cols)
    reader.read_data(LoadPlan([_rows("w", 0, rows, cols)]), _Planner({"w": target}))
    assert reader.last_read_bytes == rows * cols * 4


def test_blocks_are_at_most_one_mib() -> None:
    assert block_size_for(300 * 1024) == 64 * 1024
    assert block_size_for(16 << 20) == 256 * 1024
    assert block_size_for(1 << 30) == MAX_BLOCK == 1 << 20


def test_byte_items_are_checked_whole(saved: Path, state: dict[str, Any]) -> None:
    layout = _layout(saved)
    metadata = CloudStorageReader(str(saved)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == "step"]
    assert f"{info.relative_path}@{info.offset}" in layout["chunks"]
    _flip(saved / "__0_0.distcp", info.offset + info.length - 100)
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    error = _failure(caught)
    assert isinstance(error, ChecksumError)
    assert f"bytes {info.offset}-{info.offset + info.length} (step)" in str(error)


def test_a_small_tensor_is_read_into_its_destination_and_checked_there(
    saved: Path, state: dict[str, Any]
) -> None:
    start, _ = _small_record(saved)
    reader = _reader(str(saved))
    item = _elements("b", 0, 10)
    target = torch.zeros(10, dtype=torch.int32)
    reader.read_data(LoadPlan([item]), _Planner({"b": target}))
    assert torch.equal(target, state["b"])
    assert reader.last_read_bytes == 40  # the record alone, not its archive
    data = saved / "__0_0.distcp"
    original = data.read_bytes()
    _flip(data, start + 17)
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    error = _failure(caught)
    assert isinstance(error, ChecksumError)
    assert f"__0_0.distcp bytes {start}-{start + 40} (b, its storage record)" in str(error)
    data.write_bytes(original)
    # The archive's other bytes are not read: damage there does not reach the tensor.
    _flip(data, start + 40 + 30)
    assert torch.equal(_load(str(saved), state)["b"], state["b"])


def test_part_of_a_small_tensor_is_read_as_its_record_s_one_block(
    saved: Path, state: dict[str, Any]
) -> None:
    start, _ = _small_record(saved)
    item = _elements("b", 3, 4)
    reader = _reader(str(saved))
    target = torch.zeros(4, dtype=torch.int32)
    reader.read_data(LoadPlan([item]), _Planner({"b": target}))
    assert torch.equal(target, state["b"][3:7])
    assert reader.last_read_bytes == 40  # widened to the whole record, to check it
    _flip(saved / "__0_0.distcp", start + 36)  # outside the slice, inside the record
    with pytest.raises(ChecksumError, match=r"\(b, block 0 of"):
        _reader(str(saved)).read_data(LoadPlan([item]), _Planner({"b": target}))


def test_a_layout_without_records_reads_small_tensors_whole(
    saved: Path, state: dict[str, Any]
) -> None:
    """An index written before ``records``: small archives are read whole, checked by
    their CRC-32, as before."""
    layout = _layout(saved)
    del layout["records"]
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(layout))
    metadata = CloudStorageReader(str(saved)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == "b"]
    assert torch.equal(_load(str(saved), state)["b"], state["b"])
    _flip(saved / "__0_0.distcp", info.offset + info.length - 100)
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    assert isinstance(_failure(caught), ChecksumError)
    assert f"bytes {info.offset}-{info.offset + info.length} (b)" in str(_failure(caught))


@pytest.mark.parametrize(
    "damage",
    [
        lambda flat: flat.append(5),  # not triples
        lambda flat: flat.__setitem__(1, -1),  # a negative data offset
        lambda flat: flat.__setitem__(2, 1 << 32),  # not a CRC-32
        lambda flat: flat.__setitem__(0, "0"),  # not an offset
    ],
)
def test_a_damaged_records_entry_is_refused(saved: Path, damage: Any) -> None:
    layout = _layout(saved)
    (flat,) = layout["records"].values()
    damage(flat)
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(layout))
    with pytest.raises(CorruptCheckpointError, match=r"records? .*delete it to load"):
        CloudStorageReader(str(saved)).read_metadata()


def test_a_record_placed_past_its_chunk_is_refused(saved: Path, state: dict[str, Any]) -> None:
    layout = _layout(saved)
    (flat,) = layout["records"].values()
    _, length = _small_record(saved)
    flat[1] = length - 39  # the 40 record bytes would end past the chunk
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(layout))
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    error = _failure(caught)
    assert isinstance(error, CorruptCheckpointError)
    assert "the layout index places b at bytes" in str(error)


def test_a_flipped_bit_in_metadata_fails_its_crc(saved: Path) -> None:
    meta = saved / ".metadata"
    payload = meta.read_bytes()
    assert payload.count(b"/ckpt") == 1  # the checkpoint id: changed, still valid metadata
    meta.write_bytes(payload.replace(b"/ckpt", b"/ckpT"))
    with pytest.raises(ChecksumError, match=r"\.metadata fails the CRC-32 check recorded in"):
        CloudStorageReader(str(saved)).read_metadata()


def test_a_truncated_data_object_is_reported(saved: Path, state: dict[str, Any]) -> None:
    data = saved / "__0_0.distcp"
    start, size = _record_start(saved)
    small, _ = _small_record(saved)
    for cut in (start + size // 2, small + 20):  # inside the large record, the small one
        original = data.read_bytes()
        data.write_bytes(original[:cut])
        with pytest.raises(CheckpointException) as caught:
            _load(str(saved), state)
        assert isinstance(_failure(caught), CorruptCheckpointError)
        assert "__0_0.distcp" in str(_failure(caught))
        data.write_bytes(original)


def test_a_layout_without_checksums_still_loads(saved: Path, state: dict[str, Any]) -> None:
    """A checkpoint written before block checksums: format 1, six-field entries."""
    layout = _layout(saved)
    old = {
        "format": 1,
        "save_id": layout["save_id"],
        "archives": {k: v[:6] for k, v in layout["archives"].items()},
    }
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(old))
    out = _load(str(saved), state)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7
    reader = _reader(str(saved))
    target = torch.empty(100, COLS)
    reader.read_data(LoadPlan([_rows("w", 301, 100)]), _Planner({"w": target}))
    assert torch.equal(target, state["w"][301:401])
    assert reader.last_read_bytes == 100 * COLS * 4  # exactly the slice, as before


def test_a_damaged_layout_is_an_error_not_a_silent_downgrade(
    saved: Path, state: dict[str, Any]
) -> None:
    layout = _layout(saved)
    (where,) = layout["archives"]
    layout["archives"][where][7] = "not base64!"
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(layout))
    with pytest.raises(CorruptCheckpointError, match="delete it to load"):
        CloudStorageReader(str(saved)).read_metadata()


def test_a_layout_that_disagrees_with_metadata_is_refused(
    saved: Path, state: dict[str, Any]
) -> None:
    layout = _layout(saved)
    (where,) = layout["archives"]
    layout["archives"][where][1] = [COLS, ROWS]  # same bytes, another shape
    layout["archives"][where][2] = [ROWS, 1]
    (saved / ".cloudckpt-layout.json").write_text(json.dumps(layout))
    with pytest.raises(CheckpointException) as caught:
        _load(str(saved), state)
    assert isinstance(_failure(caught), CorruptCheckpointError)
    assert ".metadata says w is torch.float32 (1024, 512)" in str(_failure(caught))


# -- checkpoints written by torch's FileSystemWriter: no layout index --------------------


@pytest.fixture
def fs_saved(tmp_path: Path, state: dict[str, Any]) -> Path:
    path = tmp_path / "fs"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
    return path


def _fs_records(path: Path) -> dict[str, tuple[int, Any]]:
    """fqn -> (archive offset, zip entry of its storage record), for tensor items."""
    metadata = CloudStorageReader(str(path)).read_metadata()
    data = (path / "__0_0.distcp").read_bytes()
    out = {}
    for index, info in metadata.storage_data.items():
        archive = data[info.offset : info.offset + info.length]
        if not archive.startswith(b"PK"):
            continue
        entries = parse_directory(archive, 0, len(archive), "mem").entries
        records = [e for n, e in entries.items() if "/data/" in n and "serialization" not in n]
        if records:
            out[index.fqn] = (info.offset, records[0])
    return out


@pytest.mark.parametrize("fqn", ["w", "b"])
def test_filesystem_writer_checkpoints_are_checked_when_read_whole(
    fs_saved: Path, state: dict[str, Any], fqn: str
) -> None:
    assert not (fs_saved / ".cloudckpt-layout.json").exists()
    assert torch.equal(_load(str(fs_saved), state)["w"], state["w"])
    offset, record = _fs_records(fs_saved)[fqn]
    _flip(fs_saved / "__0_0.distcp", offset + record.data_offset + record.size // 3)
    with pytest.raises(CheckpointException) as caught:
        _load(str(fs_saved), state)
    error = _failure(caught)
    assert isinstance(error, ChecksumError)
    assert "__0_0.distcp" in str(error) and fqn in str(error)


def test_filesystem_writer_data_pkl_is_checked(fs_saved: Path, state: dict[str, Any]) -> None:
    metadata = CloudStorageReader(str(fs_saved)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == "w"]
    data = (fs_saved / "__0_0.distcp").read_bytes()
    archive = data[info.offset : info.offset + info.length]
    entries = parse_directory(archive, 0, len(archive), "mem").entries
    (pkl,) = [e for n, e in entries.items() if n.endswith("data.pkl")]
    _flip(fs_saved / "__0_0.distcp", info.offset + pkl.data_offset + pkl.size // 2)
    with pytest.raises(CheckpointException) as caught:
        _load(str(fs_saved), state)
    assert isinstance(_failure(caught), ChecksumError)
    assert "data.pkl" in str(_failure(caught))


def test_filesystem_writer_partial_slices_load_unchecked(
    fs_saved: Path, weight: torch.Tensor
) -> None:
    """The documented limit: no layout index, no per-block checksums for a slice."""
    target = torch.empty(100, COLS)
    reader = _reader(str(fs_saved))
    reader.read_data(LoadPlan([_rows("w", 301, 100)]), _Planner({"w": target}))
    assert torch.equal(target, weight[301:401])


# -- ranks saving without collectives: __{rank}.metadata and its own layout ---------------


def test_save_and_load_without_collectives(tmp_path: Path, state: dict[str, Any]) -> None:
    if "no_dist" not in inspect.signature(dcp.save).parameters:
        pytest.skip("this torch's dcp.save has no no_dist/use_collectives")
    path = tmp_path / "nocoll"
    dcp.save(
        state, storage_writer=CloudStorageWriter(str(path)), no_dist=True, use_collectives=False
    )
    names = sorted(p.name for p in path.iterdir())
    assert names == ["__0.cloudckpt-layout.json", "__0.metadata", "__0_0.distcp"]
    reader = CloudStorageReader(str(path))
    out = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(10, dtype=torch.int32), "step": 0}
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["step"] == 7
    assert reader.use_collectives is False and reader.rank == 0
    # The rank's layout index was used: the large tensor was read without probing.
    assert reader.last_read_requests == 1
    # One read across the object, short of the small archive's trailer, not needed.
    size = (path / "__0_0.distcp").stat().st_size
    assert ROWS * COLS * 4 + 40 < reader.last_read_bytes < size
    # and its checksums: a flip is caught.
    layout = json.loads((path / "__0.cloudckpt-layout.json").read_text())
    ((where, entry),) = layout["archives"].items()
    _flip(path / "__0_0.distcp", int(where.rpartition("@")[2]) + entry[4] + 2 * 65536 + 4321)
    with pytest.raises(ChecksumError, match=r"__0_0\.distcp: bytes .* \(w, block 2 of"):
        dcp.load(out, storage_reader=CloudStorageReader(str(path)), no_dist=True)


class _Payload:
    """An importable class that weights_only loading does not allow."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_byte_items_are_loaded_weights_only_by_default(tmp_path):
    url = str(tmp_path / "ckpt")
    dcp.save(
        {"w": torch.ones(4), "extra": {"obj": _Payload(3)}}, storage_writer=CloudStorageWriter(url)
    )
    target = {"w": torch.zeros(4), "extra": {"obj": None}}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=CloudStorageReader(url))
    error = _failure(caught)
    assert isinstance(error, UnsafeCheckpointError)
    assert "extra.obj" in str(error) and "weights_only=False" in str(error)
    dcp.load(target, storage_reader=CloudStorageReader(url, weights_only=False))
    assert target["extra"]["obj"].value == 3 and torch.equal(target["w"], torch.ones(4))
    # Plain values (what training loops keep beside tensors) pass the check.
    dcp.save({"step": 7, "meta": {"name": "run"}}, storage_writer=CloudStorageWriter(url + "2"))
    plain = {"step": 0, "meta": {"name": ""}}
    dcp.load(plain, storage_reader=CloudStorageReader(url + "2"))
    assert plain == {"step": 7, "meta": {"name": "run"}}
