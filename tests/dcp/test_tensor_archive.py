"""Tensor archives built without torch.save: byte for byte what torch.save writes.

``format/dcp/tensor_archive.py`` builds a tensor's ``torch.save`` archive as header,
storage view and trailer; ``format/dcp/archive.py`` parses one with the C unpickler.
Each built archive is compared with torch.save's own for the same tensor, loaded back
with ``torch.load(weights_only=True)`` and checked by ``zipfile``; DCP checkpoints
written with the builder load with torch's FileSystemReader and with
CloudStorageReader, and a damaged byte in a small archive is still caught.
"""

from __future__ import annotations

import ctypes
import io
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cloudckpt
from cloudckpt._runtime import probes
from cloudckpt._runtime.memview import writable_view
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp import writer as writer_module
from cloudckpt.errors import ChecksumError, CorruptCheckpointError
from cloudckpt.format.checksum import crc32
from cloudckpt.format.dcp.archive import ArchiveParses, parse_archive
from cloudckpt.format.dcp.checks import block_crcs, block_size_for
from cloudckpt.format.dcp.layout import WHOLE_LIMIT
from cloudckpt.format.dcp.tensor_archive import (
    TensorArchive,
    archive_builder_on,
    tensor_archive,
)
from cloudckpt.format.torch import archive_writer
from dtypes import DTYPES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (0/1 for bool), any dtype alike."""
    numel = 1
    for n in shape:
        numel *= n
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    storage = t.untyped_storage()
    return ctypes.string_at(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else b""


def _storage_view(t: torch.Tensor) -> memoryview:
    storage = t.untyped_storage()
    return writable_view(storage.data_ptr(), storage.nbytes())


def _torch_save(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def _records(data: bytes) -> list[tuple[str, int, int, int, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None
        return [
            (i.filename, i.header_offset, i.file_size, i.CRC, i.flag_bits)
            for i in archive.infolist()
        ]


def _built(t: torch.Tensor) -> TensorArchive:
    built = tensor_archive(t, _storage_view(t))
    assert built is not None
    return built


# The writer saves each tensor through ``_cpu_tensor``: contiguous, its own storage.
SHAPES = {
    "small": lambda dtype: _random((3, 5), dtype),
    "scalar": lambda dtype: _random((), dtype),
    "empty": lambda dtype: _random((0, 4), dtype),
    "non_contiguous": lambda dtype: writer_module._cpu_tensor(_random((6, 4), dtype).t()),
    "large": lambda dtype: _random((WHOLE_LIMIT // dtype.itemsize + 1000,), dtype),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_archive_is_torch_saves_byte_for_byte(dtype: torch.dtype, shape: str) -> None:
    t = SHAPES[shape](dtype)
    built = _built(t)
    data = built.tobytes()
    theirs = _torch_save(t)
    assert _records(data) == _records(theirs)
    assert data == theirs

    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.dtype == t.dtype and loaded.shape == t.shape
    assert loaded.stride() == t.stride() and _bytes(loaded) == _bytes(t)

    # What the writer records: the storage record's place and checksums.
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo("archive/data/0")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data_start = info.header_offset + 30 + name_len + extra_len
    assert built.data_offset == len(built.header) == data_start
    assert built.data_offset % 64 == 0
    assert built.record_crc == info.CRC == crc32(_bytes(t))
    if len(data) <= WHOLE_LIMIT:
        assert built.crc == crc32(data) and built.block_size == 0
    else:
        assert built.crc is None
        assert built.block_size == block_size_for(t.nbytes)
        assert built.block_crcs == block_crcs(memoryview(_bytes(t)), built.block_size)

    # Both archives parse alike: the record our parse finds is the one zipfile finds.
    for archive_bytes in (data, theirs):
        saved = parse_archive(
            archive_bytes[:4096], archive_bytes[-8192:], len(data), "x", ArchiveParses()
        )
        assert saved is not None
        assert saved.dtype == t.dtype and saved.size == tuple(t.shape)
        assert saved.stride == t.stride() and saved.storage_offset == 0
        assert saved.data_offset == built.data_offset and saved.record_size == t.nbytes
        assert saved.record_crc == built.record_crc


def test_strided_views_of_their_storage_are_torch_saves_too() -> None:
    """torch.save writes a view's whole storage and its strides: so does the builder."""
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    for t in (base.t(), base[1:3], base[:, 2], base.expand(2, 6, 10)):
        assert _built(t).tobytes() == _torch_save(t)
        saved = parse_archive(
            _torch_save(t), _torch_save(t), len(_torch_save(t)), "x", ArchiveParses()
        )
        assert saved is not None and saved.storage_offset == t.storage_offset()


def _neg_bit() -> torch.Tensor:
    return torch.randn(4, dtype=torch.complex64).conj().imag


UNUSUAL = {
    "requires_grad": lambda: torch.randn(4, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.randn(4)),
    "subclass": lambda: torch.randn(4).as_subclass(type("Sub", (torch.Tensor,), {})),
    "conjugate": lambda: torch.randn(4, dtype=torch.complex64).conj(),
    "negative_bit": _neg_bit,
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
    "sparse": lambda: torch.randn(4, 4).to_sparse(),
    "python_state": lambda: _with_attribute(torch.randn(4)),
    "complex32": lambda: torch.randn(4).to(torch.complex32),
}


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "kept by torch.save"  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize("kind", list(UNUSUAL))
def test_unusual_tensors_are_left_to_torch_save(kind: str) -> None:
    t = UNUSUAL[kind]()
    plain_layout = t.layout == torch.strided and not t.is_quantized
    view = _storage_view(t) if plain_layout else memoryview(b"")
    built = tensor_archive(t, view)
    if kind == "complex32":  # rebuilt with _rebuild_tensor_v3: an ordinary dtype to it
        assert built is not None and built.tobytes() == _torch_save(t)
    else:
        assert built is None


@pytest.mark.parametrize("kind", ["conjugate", "negative_bit"])
def test_archives_with_view_bits_are_left_to_torch_load(kind: str) -> None:
    """torch.save keeps a conjugate or negative view's bit beside the rebuild's
    arguments; the fast parse does not apply it, so it hands the archive to torch.load."""
    data = _torch_save(UNUSUAL[kind]())
    assert parse_archive(data, data, len(data), "x", ArchiveParses()) is None


@pytest.mark.parametrize("option", [("storage_alignment", 4096), ("compute_crc32", False)])
def test_builder_is_off_where_torch_save_would_write_otherwise(option: tuple[str, Any]) -> None:
    assert archive_builder_on()
    with torch.serialization.skip_data():
        assert not archive_builder_on()
    from torch.utils.serialization import config

    name, value = option
    default = getattr(config.save, name)
    setattr(config.save, name, value)  # torch's config module: not pytest's monkeypatch
    try:
        assert not archive_builder_on()
    finally:
        setattr(config.save, name, default)
    assert archive_builder_on()


def test_a_failed_archive_check_turns_both_builders_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One check covers both forms of the builder: when it fails, ``cloudckpt.save``
    and the DCP writer hand every tensor to torch.save, and what they write loads."""

    def differs() -> None:
        raise ValueError("the archive differs from torch.save's")

    assert archive_builder_on()  # the real check has passed: its constants are known
    monkeypatch.setitem(probes._checks, archive_writer.PROBE, differs)
    monkeypatch.setitem(probes._results, archive_writer.PROBE, None)
    t = torch.randn(4)
    assert tensor_archive(t, _storage_view(t)) is None
    assert not archive_builder_on() and not archive_writer.writer_on()
    assert archive_writer.plan_archive({"w": t}) is None

    saved: list[type] = []
    real = torch.save

    def counting(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        saved.append(type(obj))
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    state = _state(20)
    cloudckpt.save(state, tmp_path / "object.pt")
    assert saved == [dict]
    out = torch.load(tmp_path / "object.pt", weights_only=True)
    _assert_loaded(out, state)

    dcp.save(state, storage_writer=CloudStorageWriter(str(tmp_path / "dcp")))
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    assert saved.count(torch.Tensor) == len(tensors)
    out = _empty_like(state)
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path / "dcp")))
    _assert_loaded(out, state)


def _state(n: int) -> dict[str, Any]:
    """``n`` small tensors of every dtype, two large ones and a byte item."""
    state: dict[str, Any] = {
        f"t{i:04d}": _random((i % 7 + 1, 16), DTYPES[i % len(DTYPES)]) for i in range(n)
    }
    state["big"] = torch.randn(512, 256)  # 512 KiB: read by slice
    state["big_bf16"] = torch.randn(1024, 300).to(torch.bfloat16)
    state["scalar"] = torch.tensor(3.5)
    state["step"] = 17
    return state


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def _assert_loaded(out: dict[str, Any], state: dict[str, Any]) -> None:
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert _bytes(out[k].contiguous()) == _bytes(v.contiguous()), k
        else:
            assert out[k] == v, k


def test_dcp_round_trip_of_many_small_tensors(moto_server: Any, tmp_path: Path) -> None:
    """Saved with the builder to S3: downloaded, it loads with torch's FileSystemReader;
    in place, with CloudStorageReader; and the data object is the one torch.save would
    have made (the writer's torch.save path writes the same bytes)."""
    state = _state(500)
    so = moto_server.storage_options()
    bucket = moto_server.make_bucket("dcp-tensor-archive")
    url = f"s3://{bucket}/ckpt"
    dcp.save(state, storage_writer=CloudStorageWriter(url, storage_options=so))

    client = moto_server.client()
    down = tmp_path / "down"
    down.mkdir()
    listed = client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]
    for obj in listed:
        client.download_file(bucket, obj["Key"], str(down / obj["Key"].removeprefix("ckpt/")))
    out = _empty_like(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(down)))
    _assert_loaded(out, state)

    out = _empty_like(state)
    dcp.load(out, storage_reader=CloudStorageReader(url, storage_options=so))
    _assert_loaded(out, state)

    # The same state through torch.save (builder off): the same data object.
    plain = tmp_path / "plain"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer_module, "archive_builder_on", lambda: False)
        dcp.save(state, storage_writer=CloudStorageWriter(str(plain)))
    assert (plain / "__0_0.distcp").read_bytes() == (down / "__0_0.distcp").read_bytes()


def _small_item_offset(path: Path, fqn: str) -> int:
    reader = CloudStorageReader(str(path))
    metadata = reader.read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    return int(info.offset)


def _central_crc_field(archive: bytes, record: str) -> int:
    """Where the CRC-32 field of ``record``'s central directory entry sits."""
    at = archive.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", archive, at + 28)[0]
        if archive[at + 46 : at + 46 + name_len] == f"archive/{record}".encode():
            return at + 16
        at = archive.find(b"PK\x01\x02", at + 46)
    raise AssertionError(record)


def test_archives_laid_out_alike_are_recognised_and_parse_the_same() -> None:
    from cloudckpt.format.dcp import archive as archive_module

    first, second = (_torch_save(torch.randn(9, 3)) for _ in range(2))
    parses = ArchiveParses()
    assert parse_archive(first, first, len(first), "x", parses) is not None
    assert archive_module._recognised(second, second, len(second), "x", parses) is not None
    parsed = archive_module._parse(second, second, len(second), "x", ArchiveParses())
    assert parsed is not None
    assert parse_archive(second, second, len(second), "x", parses) == parsed[0]
    # Another dtype of the same archive length: not taken for the first layout.
    other = _torch_save(torch.randn(9, 3).to(torch.int32))
    assert len(other) == len(first)
    saved = parse_archive(other, other, len(other), "x", parses)
    assert saved is not None and saved.dtype == torch.int32
    # Nothing is kept past the load that parsed it: a new load starts empty.
    assert archive_module._recognised(second, second, len(second), "x", ArchiveParses()) is None


DAMAGE = {  # where in a small archive a flipped bit lands
    "data.pkl": lambda archive: 64 + 40,
    "storage": lambda archive: 704 + 17,
    "data.pkl_crc": lambda archive: _central_crc_field(archive, "data.pkl"),
    "storage_crc": lambda archive: _central_crc_field(archive, "data/0"),
}


@pytest.mark.parametrize("where", list(DAMAGE))
@pytest.mark.parametrize("index", [True, False], ids=["with_index", "without_index"])
def test_a_damaged_small_archive_is_caught(tmp_path: Path, where: str, index: bool) -> None:
    """Also where the archives before it were recognised by their layout (the
    damaged directory CRC-32s are the fields that recognition leaves out). With the
    layout index, only the storage record is read (into the destination, checked by
    its CRC-32): damage elsewhere in the archive does not reach the load."""
    state = {f"t{i}": torch.randn(64) for i in range(20)}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=CloudStorageWriter(str(path)))
    if not index:  # then data.pkl and the record are checked by their zip CRC-32
        (path / ".cloudckpt-layout.json").unlink()
    start = _small_item_offset(path, "t7")
    obj = path / "__0_0.distcp"
    data = bytearray(obj.read_bytes())
    item = _torch_save(state["t7"])
    assert bytes(data[start + 704 : start + 704 + 256]) == item[704 : 704 + 256]
    data[start + DAMAGE[where](item)] ^= 0x10
    obj.write_bytes(bytes(data))
    out = {k: torch.zeros(64) for k in state}
    if index and where != "storage":
        dcp.load(out, storage_reader=CloudStorageReader(str(path)))
        assert all(torch.equal(out[k], state[k]) for k in state)
        return
    with pytest.raises(CheckpointException) as caught:
        dcp.load(out, storage_reader=CloudStorageReader(str(path)))
    ((failure, _),) = caught.value.failures.values()
    assert isinstance(failure, (ChecksumError, CorruptCheckpointError))
    assert f"{path.as_uri()}/__0_0.distcp" in str(failure)
    assert "CRC-32" in str(failure)
