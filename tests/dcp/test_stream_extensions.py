"""Checkpoints written through torch's stream extensions (``FileSystemWriter(...,
_extensions=[...])``): decoded through an ``ExtensionRegistry``, or refused by name."""

from __future__ import annotations

import gzip
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from cloudckpt.dcp import CloudStorageReader
from cloudckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from cloudckpt.format.dcp.metadata import decode_metadata
from dcp_compat import SINGLE

_extension = pytest.importorskip("torch.distributed.checkpoint._extension")

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.skipif(
        "_extensions" not in FileSystemWriter.__init__.__code__.co_varnames,
        reason="this torch's FileSystemWriter takes no stream extensions",
    ),
]


class Gzip(_extension.StreamTransformExtension):  # type: ignore[misc]
    """A stream extension torch does not ship: gzip."""

    @staticmethod
    def registry_name() -> str:
        return "tests.gzip"

    @staticmethod
    def from_descriptor(version: str) -> Gzip:
        return Gzip()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=output, mode="wb")  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=input, mode="rb")  # type: ignore[return-value]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(300, 256, generator=g),  # 300 KiB: above the whole-read limit
        "small": torch.arange(10),
        "step": 5,
        "cfg": {"name": "run"},
    }


def _empty() -> dict[str, Any]:
    return {
        "big": torch.zeros(300, 256),
        "small": torch.zeros(10, dtype=torch.int64),
        "step": 0,
        "cfg": {"name": ""},
    }


def _registry() -> Any:
    registry = _extension.ExtensionRegistry()
    registry.register(Gzip)
    return registry


def _assert_same(out: dict[str, Any], state: dict[str, Any]) -> None:
    assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"])
    assert out["step"] == state["step"] and out["cfg"] == state["cfg"]


def _raised(fn: Callable[[], Any]) -> BaseException:
    """The exception ``fn`` raised, unwrapped from DCP's CheckpointException."""
    try:
        fn()
    except BaseException as exc:  # CheckpointException is a BaseException
        failures = getattr(exc, "failures", None)
        return next(iter(failures.values()))[0] if failures else exc
    raise AssertionError("no exception")


def _copy(src: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    return path


@pytest.fixture(scope="module")
def gzip_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gzip") / "ckpt"
    dcp.save(_state(), storage_writer=FileSystemWriter(str(path), _extensions=[Gzip()]), **SINGLE)
    return path


def test_encoded_chunks_decode_through_the_registry(gzip_checkpoint: Path) -> None:
    raw = (gzip_checkpoint / ".metadata").read_bytes()
    metadata = decode_metadata(raw, "mem://.metadata")
    descriptors = {tuple(i.transform_descriptors) for i in metadata.storage_data.values()}
    assert descriptors == {("tests.gzip/1",)}
    ours = _empty()
    reader = CloudStorageReader(str(gzip_checkpoint), extension_registry=_registry())
    dcp.load(ours, storage_reader=reader, **SINGLE)
    _assert_same(ours, _state())
    theirs = _empty()
    torch_reader = FileSystemReader(str(gzip_checkpoint), _extension_registry=_registry())
    dcp.load(theirs, storage_reader=torch_reader, **SINGLE)
    for key in ("big", "small"):
        assert ours[key].numpy().tobytes() == theirs[key].numpy().tobytes()
    # Every chunk read whole and once: one coalesced request over the one data object.
    assert reader.last_read_bytes == (gzip_checkpoint / "__0_0.distcp").stat().st_size
    assert reader.last_read_requests == 1


def test_an_unknown_stream_extension_is_refused_by_name(gzip_checkpoint: Path) -> None:
    reader = CloudStorageReader(str(gzip_checkpoint))
    error = _raised(lambda: dcp.load(_empty(), storage_reader=reader, **SINGLE))
    assert isinstance(error, UnsupportedFormatError), error
    assert "'tests.gzip/1'" in str(error) and str(gzip_checkpoint) in str(error)
    assert reader.last_read_requests == 0  # refused before any read


def test_a_damaged_encoded_chunk_is_corrupt(gzip_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(gzip_checkpoint, tmp_path)
    metadata = decode_metadata((path / ".metadata").read_bytes(), "mem://.metadata")
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "big")
    data = bytearray((path / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF
    (path / info.relative_path).write_bytes(bytes(data))
    reader = CloudStorageReader(str(path), extension_registry=_registry())
    error = _raised(lambda: dcp.load(_empty(), storage_reader=reader, **SINGLE))
    assert isinstance(error, CorruptCheckpointError), error
    assert "big" in str(error) and info.relative_path in str(error)


def test_zstandard_by_torchs_own_extension(tmp_path: Path) -> None:
    """torch's built-in ZStandard extension, decoded by the default registry."""
    if not _extension.ZStandard.is_available():
        pytest.skip("needs zstandard or pyzstd")
    state = _state()
    writer = FileSystemWriter(str(tmp_path), _extensions=[_extension.ZStandard()])
    dcp.save(state, storage_writer=writer, **SINGLE)
    out = _empty()
    dcp.load(out, storage_reader=CloudStorageReader(str(tmp_path)), **SINGLE)
    _assert_same(out, state)


def test_zstandard_without_its_module_is_refused_by_name(
    gzip_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint naming torch's zstd extension where no zstd module is installed."""
    path = _copy(gzip_checkpoint, tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # torch's own file
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.zstd/1"]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    monkeypatch.setattr(_extension, "zstandard", None)
    monkeypatch.setattr(_extension, "pyzstd", None)
    reader = CloudStorageReader(str(path))
    error = _raised(lambda: dcp.load(_empty(), storage_reader=reader, **SINGLE))
    assert isinstance(error, UnsupportedFormatError), error
    assert "'stream.zstd/1'" in str(error) and "zstandard" in str(error)


@pytest.mark.parametrize("value", [5, "stream.zstd/1", [b"x"], [None]])
def test_damaged_descriptors_are_corrupt(gzip_checkpoint: Path, value: Any) -> None:
    metadata = pickle.loads((gzip_checkpoint / ".metadata").read_bytes())
    next(iter(metadata.storage_data.values())).transform_descriptors = value
    with pytest.raises(CorruptCheckpointError, match="storage entry"):
        decode_metadata(pickle.dumps(metadata), "mem://.metadata")
