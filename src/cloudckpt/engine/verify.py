"""Looking inside a ``torch.save`` archive on storage without downloading its tensors.

``describe`` reads the zip directory (one ranged read of the tail) and ``data.pkl``,
then unpickles it onto the ``meta`` device: names, dtypes, shapes and bytes of every
tensor, for the cost of a few KiB, and the scalar values near its top (``scalars_of``).
``verify_archive`` streams every record and checks its CRC-32 against the directory.
Other checkpoint kinds (DCP, Megatron, safetensors) are engine/inspect.py's.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..format.checksum import crc32
from ..format.torch.unpickle import parse_persistent_id, unpickle
from ..format.torch.zipdir import (
    Directory,
    Entry,
    check_local_header,
    check_record_crc,
)
from ..io.ranges import RangeReader, split
from ..io.scheduler import TransferGroup
from ..options import TransferOptions
from ..store import Store
from .directory import read_directory

__all__ = [
    "ArchiveInfo",
    "TensorInfo",
    "describe",
    "scalars_of",
    "verify_archive",
]

#: Largest range one verify request reads (bounds memory: read_concurrency of these).


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's name, dtype, shape and bytes (and its file, in a sharded checkpoint)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str
    file: str = ""


@dataclass
class ArchiveInfo:
    """What ``info`` reports about one archive."""

    url: str
    size: int
    format: str
    records: int
    top_level_keys: list[str] | None = None
    top_level_type: str = ""
    tensors: list[TensorInfo] = field(default_factory=list)
    #: Scalar values near the top of the structure (step, epoch, learning rates).
    scalars: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _pkl_entry(directory: Directory, url: str) -> tuple[str, Entry]:
    names = [n for n in directory.entries if n.endswith("data.pkl") and n.count("/") == 1]
    if len(names) != 1:
        raise CorruptCheckpointError(f"{url} is a zip archive but not a torch checkpoint")
    return names[0][: -len("data.pkl")], directory.entries[names[0]]


def _walk(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if depth > 100:
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", depth + 1)


#: Keys whose scalar values ``info`` shows at any depth it walks (learning rates, counters
#: of optimizers and schedulers), besides every scalar at the top two levels.
_SCALAR_KEYS = frozenset({"lr", "_last_lr", "base_lrs", "last_epoch", "_step_count"})
#: How deep :func:`scalars_of` walks, and how many values it keeps.
_SCALAR_DEPTH = 5
_SCALAR_LIMIT = 200


def _scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 200)


def scalars_of(obj: Any, path: str = "") -> dict[str, Any]:
    """The scalar values (numbers, booleans, short strings) at the top level or one level
    down of ``obj`` (a checkpoint's unpickled structure, tensors on the meta device), and
    learning rates and step counters further down (``optimizer.param_groups[0].lr``,
    ``lr_schedulers[0]._last_lr[0]``). ``path`` names ``obj`` itself (a DCP item's FQN)."""
    out: dict[str, Any] = {}
    start = path.count(".") + 1 if path else 0

    def visit(value: Any, where: str, depth: int, key: str, listed: bool) -> None:
        if len(out) >= _SCALAR_LIMIT:
            return
        if _scalar(value):
            if (depth <= 2 and not listed) or key in _SCALAR_KEYS:
                finite = not isinstance(value, float) or math.isfinite(value)
                out[where or "<root>"] = value if finite else repr(value)  # JSON has no NaN
        elif depth < _SCALAR_DEPTH and isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{where}.{k}" if where else str(k), depth + 1, str(k), False)
        elif depth < _SCALAR_DEPTH and isinstance(value, (list, tuple)) and len(value) <= 64:
            for i, v in enumerate(value):
                visit(v, f"{where}[{i}]", depth + 1, key, True)

    visit(obj, path, start, path.rpartition(".")[2], False)
    return out


def describe(store: Store, key: str, *, weights_only: bool = True) -> ArchiveInfo:
    """Names, dtypes, shapes and bytes of the tensors in the archive at ``key``."""
    url = store.url(key)
    size = store.head(key).size
    directory = read_directory(store, key, size).directory
    fmt = "torch zip archive" + (
        " (zip64)" if any(e.zip64 for e in directory.entries.values()) else ""
    )
    info = ArchiveInfo(url=url, size=size, format=fmt, records=len(directory.entries))
    _, entry = _pkl_entry(directory, url)
    if entry.method != 0:
        info.note = "data.pkl is compressed; tensor listing skipped"
        return info
    data = store.get_range(key, entry.data_offset, entry.end)

    def persistent_load(saved_id: Any) -> Any:
        ref = parse_persistent_id(saved_id, url)
        storage = torch.UntypedStorage(ref.nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=ref.dtype, _internal=True)

    result = unpickle(data, persistent_load, weights_only=weights_only, url=url)
    info.top_level_type = type(result).__name__
    if isinstance(result, dict):
        info.top_level_keys = [str(k) for k in result]
    info.scalars = scalars_of(result)
    for path, t in _walk(result, ""):
        info.tensors.append(
            TensorInfo(
                path=path or "<root>",
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
                nbytes=t.numel() * t.element_size(),
                device="",
            )
        )
    return info


def verify_archive(
    store: Store,
    key: str,
    options: TransferOptions,
    *,
    expected_size: int | None = None,
    advance: Callable[[int], None] = lambda n: None,
) -> int:
    """Check every record's local header and CRC-32; returns the bytes checked.

    Records of up to ``read_chunk_size`` bytes are read through the shared range
    planner (neighbours in one request) and checked in the thread that read them;
    larger ones are streamed in ``read_chunk_size`` pieces, their CRC-32 built in
    order, so memory stays bounded whatever the record size. Raises ChecksumError
    naming the first bad record, CorruptCheckpointError for a damaged or truncated
    archive (or a size different from ``expected_size``).
    """
    url = store.url(key)
    size = store.head(key).size
    if expected_size is not None and size != expected_size:
        raise CorruptCheckpointError(
            f"{url} holds {size} bytes, but its checkpoint marker recorded {expected_size}"
        )
    directory = read_directory(store, key, size).directory
    chunk = options.read_chunk_size
    records = sorted(directory.entries.values(), key=lambda e: e.header_offset)
    for e in records:
        if e.method not in (0, 8):
            raise CorruptCheckpointError(f"{url}: record {e.name!r} uses compression {e.method}")
    small = [e for e in records if e.end - e.header_offset <= chunk]
    large = [e for e in records if e.end - e.header_offset > chunk]

    def check(e: Entry, header: memoryview, data: memoryview) -> None:
        check_local_header(header, e, url)
        _check_crc(e, _crc_of(e, [data]), url)
        advance(e.compressed_size)

    def stream(e: Entry) -> None:
        check_local_header(store.get_range(key, e.header_offset, e.data_offset), e, url)
        pieces = (
            store.get_range(key, s, s + n)
            for s, n in split(e.data_offset, e.compressed_size, chunk)
        )
        _check_crc(e, _crc_of(e, pieces, advance), url)

    # A verify holds what it reads only to check it: at most 8 reads in flight.
    options = options.replace(read_concurrency=min(options.read_concurrency, 8))
    reader = RangeReader(store, options, stream=True)
    group = TransferGroup(options, max(1, options.read_concurrency // 2))
    try:
        for e in large:
            group.submit(functools.partial(stream, e), f"verify {url} record {e.name}")
        with reader:
            for e in small:
                header = memoryview(bytearray(e.local_header_size))
                data = memoryview(bytearray(e.compressed_size))
                reader.add(
                    key, e.header_offset, [header, data], functools.partial(check, e, header, data)
                )
            reader.run()
        group.wait()
    except BaseException:
        group.cancel()
        raise
    return sum(e.compressed_size for e in records)


def _crc_of(
    e: Entry, pieces: Iterable[bytes | memoryview], advance: Callable[[int], None] | None = None
) -> int:
    """The CRC-32 of a record's uncompressed bytes, from its stored bytes in order."""
    crc = 0
    inflate = zlib.decompressobj(-15) if e.method == 8 else None
    for piece in pieces:
        crc = crc32(inflate.decompress(piece) if inflate else piece, crc)
        if advance is not None:
            advance(len(piece))
    return crc32(inflate.flush(), crc) if inflate is not None else crc


def _check_crc(e: Entry, crc: int, url: str) -> None:
    check_record_crc(url, e.name, e.crc32, crc)
