"""What a URL holds, for ``cloudckpt info`` and ``cloudckpt verify``: one detection, then
one description and one check per kind.

:func:`detect` names the kind from one HEAD and one listing (``store/paths``): a
``torch.save`` archive, a safetensors file, a DCP data object, a DCP checkpoint prefix
(cloudckpt's writer or torch's ``FileSystemWriter``), a Megatron ``torch_dist``
checkpoint, a safetensors folder. :func:`inspect` describes it without reading tensor
data (the archive's directory and ``data.pkl``, DCP's ``.metadata`` and its small
non-tensor items, safetensors headers); :func:`verify` checks all that can be checked
for its kind. Manager runs and step prefixes belong to the manager, a layer above: the
CLI finds them first and hands a step prefix's DCP checkpoint here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import posixpath
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import (
    BucketNotFoundError,
    CloudCkptError,
    CorruptCheckpointError,
    NotFoundError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from ..format.dcp.archive import ArchiveParses, SavedTensor, parse_archive
from ..format.dcp.checks import BlockCheck, check_chunk, check_zip_records
from ..format.dcp.index import LayoutIndex, decode_committed
from ..format.dcp.layout import DATA_SUFFIX, LAYOUT_NAME, METADATA_NAME
from ..format.dcp.metadata import ChunkIndex
from ..format.megatron import COMMON_NAME, CONFIG_NAME, decode_config
from ..format.safetensors import (
    INDEX_SUFFIX,
    Header,
    TensorEntry,
    read_header,
    read_index,
)
from ..format.torch.unpickle import load_torch_bytes
from ..io.ranges import RangeReader
from ..options import TransferOptions
from ..store import ObjectInfo, Store, join_key
from ..store.paths import (
    MAX_INDEX_BYTES,
    MAX_RECORD_BYTES,
    Entry,
    children,
    classify,
    dir_prefix,
    read_capped,
)
from .verify import ArchiveInfo, TensorInfo, describe, scalars_of, verify_archive

__all__ = [
    "Checked",
    "Found",
    "Inspection",
    "ItemInfo",
    "Verification",
    "detect",
    "inspect",
    "verify",
]

TORCH = "torch"
SAFETENSORS = "safetensors"
DCP_DATA = "dcp-data"
DCP = "dcp"
MEGATRON = "megatron"
PREFIX = "prefix"
MISSING = "missing"

#: Megatron-core's own names beside the DCP files (format/megatron.py).
MEGATRON_CONFIG = CONFIG_NAME
MEGATRON_COMMON = COMMON_NAME
#: What a lone DCP data object's check says of itself.
DATA_FILE_NOTE = "a DCP data file; verify its checkpoint prefix for checksums"
#: Non-tensor items up to this size are read for ``info``'s scalar values.
_SMALL_ITEM = 64 * 1024
#: Bytes of items read together in one batch of ranged reads (bounds memory).
_BATCH = 64 * 1024 * 1024
#: Bytes at each end of a tensor item's archive that its parse looks at.
_EDGE = 1024 * 1024


@dataclass(frozen=True)
class Found:
    """What :func:`detect` found: the kind, where, and every object it spans by name."""

    kind: str
    store: Store
    key: str  # the object's key, or the prefix's without its trailing "/"
    files: dict[str, ObjectInfo] = field(default_factory=dict)
    prefix: bool = False

    @property
    def url(self) -> str:
        return self.store.url(dir_prefix(self.key) if self.prefix else self.key)

    def key_of(self, name: str) -> str:
        """The key of ``name`` under the prefix."""
        return join_key(self.key, name, self.url)


def detect(store: Store, key: str) -> Found:
    """The kind of checkpoint at ``key`` (a trailing "/" asks for a prefix), from one
    HEAD and one listing."""
    entry = Entry("prefix") if key.endswith("/") or not key.strip("/") else classify(store, key)
    key = key.strip("/")
    if entry.kind == "object":
        assert entry.info is not None
        name = posixpath.basename(key)
        kind = TORCH
        if name.endswith((".safetensors", INDEX_SUFFIX)):
            kind = SAFETENSORS
        elif name.endswith(DATA_SUFFIX):
            kind = DCP_DATA
        return Found(kind, store, key, {name: entry.info})
    if entry.kind == "missing":
        return Found(MISSING, store, key, prefix=True)
    below = children(store, key)
    prefix = dir_prefix(key)
    files = dict(below.files)
    for objects in below.dirs.values():
        files.update({o.key[len(prefix) :]: o for o in objects})
    top = below.files
    kind = PREFIX if files else MISSING
    if METADATA_NAME in top:
        kind = MEGATRON if MEGATRON_CONFIG in top else DCP
    elif any(n.endswith((INDEX_SUFFIX, ".safetensors")) for n in top):
        kind = SAFETENSORS
    return Found(kind, store, key, files, prefix=True)


# -- description ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemInfo:
    """A non-tensor item of a DCP checkpoint: its name and stored bytes."""

    name: str
    nbytes: int


@dataclass
class Inspection:
    """What ``info`` reports about one checkpoint of any kind."""

    kind: str
    url: str
    size: int
    files: int
    format: str
    tensors: list[TensorInfo] = field(default_factory=list)
    items: list[ItemInfo] = field(default_factory=list)
    scalars: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    archives: list[ArchiveInfo] = field(default_factory=list)
    note: str = ""

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def inspect(found: Found, options: TransferOptions, *, weights_only: bool = True) -> Inspection:
    """Describe the checkpoint ``found`` names without reading its tensors."""
    size = sum(o.size for o in found.files.values())
    out = Inspection(found.kind, found.url, size, len(found.files), found.kind)
    if found.kind == TORCH:
        archive = describe(found.store, found.key, weights_only=weights_only)
        out.format, out.archives = archive.format, [archive]
        out.tensors, out.scalars = list(archive.tensors), dict(archive.scalars)
    elif found.kind == DCP_DATA:
        out.format = "DCP data file"
        out.note = DATA_FILE_NOTE + "; `info` of the prefix lists its tensors"
    elif found.kind == SAFETENSORS:
        _describe_safetensors(found, out)
    elif found.kind in (DCP, MEGATRON):
        _describe_dcp(found, options, out, weights_only)
    else:
        raise UnsupportedFormatError(
            f"{found.url} holds no checkpoint cloudckpt recognises (a torch archive, DCP, "
            "Megatron or safetensors); `cloudckpt ls` lists what is there"
        )
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_safetensors(found: Found, out: Inspection) -> None:
    """Every tensor of every file (in the index's files, or each lone file), and the
    ``__metadata__`` of each."""
    for key, header in _safetensors_headers(found):
        name = key[len(dir_prefix(found.key)) :] if found.prefix else posixpath.basename(key)
        if header.metadata:
            out.metadata[name] = dict(header.metadata)
        for e in header.tensors.values():
            out.tensors.append(_safetensors_tensor(e, name))
    out.format = "safetensors"


def _safetensors_tensor(e: TensorEntry, file: str) -> TensorInfo:
    dtype = e.dtype.torch
    return TensorInfo(
        path=e.name,
        dtype=_dtype_name(dtype) if dtype is not None else e.dtype.name,
        shape=e.shape,
        nbytes=e.nbytes,
        device="",
        file=file,
    )


def _safetensors_files(found: Found) -> tuple[list[str], list[str]]:
    """(index keys, keys of lone files) of a safetensors file or folder."""
    if not found.prefix:
        return ([found.key], []) if found.key.endswith(INDEX_SUFFIX) else ([], [found.key])
    top = [n for n in found.files if "/" not in n]
    indexes = sorted(found.key_of(n) for n in top if n.endswith(INDEX_SUFFIX))
    singles = sorted(found.key_of(n) for n in top if n.endswith(".safetensors"))
    return indexes, singles


def _safetensors_headers(found: Found) -> Iterator[tuple[str, Header]]:
    indexes, singles = _safetensors_files(found)
    seen: set[str] = set()
    for index in indexes:
        for shard in read_index(found.store, index):
            if shard not in seen:
                seen.add(shard)
                yield shard, read_header(found.store, shard)[0]
    for key in singles:
        if key not in seen:
            seen.add(key)
            yield key, read_header(found.store, key)[0]


@dataclass
class _Dcp:
    """A DCP checkpoint's ``.metadata`` and, for cloudckpt's writer, its layout index."""

    metadata: Any
    layout: LayoutIndex | None

    @property
    def writer(self) -> str:
        return "cloudckpt" if self.layout is not None else "torch"


def _read_dcp(found: Found) -> _Dcp:
    """``.metadata`` through the trust boundary, and the layout index when it is the
    same save's (its save id), checked against ``.metadata``'s CRC-32."""
    url = found.store.url(found.key_of(METADATA_NAME))
    payload = found.store.get(found.key_of(METADATA_NAME))  # a pickle: no JSON cap
    listed = found.files.get(LAYOUT_NAME)
    raw = None
    if listed is not None:
        key = found.key_of(LAYOUT_NAME)
        raw = read_capped(found.store, key, MAX_INDEX_BYTES, size=listed.size, what="layout index")
    layout_url = found.store.url(found.key_of(LAYOUT_NAME))
    metadata, layout = decode_committed(payload, url, raw, layout_url)
    return _Dcp(metadata, layout)


@dataclass(frozen=True)
class _Item:
    """One stored item of a DCP checkpoint: where its bytes are, and what it is."""

    fqn: str
    name: str  # its data object, relative to the prefix
    offset: int
    length: int
    tensor: bool
    index: Any  # DCP's MetadataIndex
    transformed: bool  # stored through a transform (compression): not a plain archive


def _items(dcp: _Dcp) -> list[_Item]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = dcp.metadata.state_dict_metadata
    out = []
    for index, info in (dcp.metadata.storage_data or {}).items():
        out.append(
            _Item(
                fqn=index.fqn,
                name=str(info.relative_path),
                offset=int(info.offset),
                length=int(info.length),
                tensor=isinstance(state.get(index.fqn), TensorStorageMetadata),
                index=index,
                transformed=bool(getattr(info, "transform_descriptors", None)),
            )
        )
    return sorted(out, key=lambda i: (i.name, i.offset))


def _describe_dcp(
    found: Found, options: TransferOptions, out: Inspection, weights_only: bool
) -> None:
    """The tensor table from ``.metadata``, the non-tensor items with their sizes, the
    scalar values among the small ones; for Megatron also ``common.pt`` and
    ``metadata.json``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp = _read_dcp(found)
    out.format = "DCP" if found.kind == DCP else "Megatron torch_dist (DCP)"
    out.metadata["writer"] = MEGATRON if found.kind == MEGATRON else dcp.writer
    out.metadata["checksums"] = dcp.layout is not None  # cloudckpt's layout index
    out.metadata["version"] = getattr(dcp.metadata, "version", None)
    items = _items(dcp)
    lengths: dict[str, int] = {}
    for item in items:
        lengths[item.fqn] = lengths.get(item.fqn, 0) + item.length
    for fqn, md in dcp.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            nbytes = math.prod(md.size) * dtype.itemsize
            out.tensors.append(TensorInfo(fqn, _dtype_name(dtype), tuple(md.size), nbytes, ""))
        else:
            out.items.append(ItemInfo(fqn, lengths.get(fqn, 0)))
    small = [i for i in items if not i.tensor and not i.transformed and i.length <= _SMALL_ITEM]
    values = _read_items(found, options, small, _load_item)
    for item in small:
        value = values.get(item)
        if not isinstance(value, BaseException):
            out.scalars.update(scalars_of(value, item.fqn))
    if found.kind == MEGATRON:
        out.metadata["backend"] = _megatron_config(found)
        if MEGATRON_COMMON in found.files:
            key = found.key_of(MEGATRON_COMMON)
            common = describe(found.store, key, weights_only=weights_only)
            out.archives.append(common)
            out.scalars.update({f"{MEGATRON_COMMON}:{k}": v for k, v in common.scalars.items()})


def _megatron_config(found: Found) -> dict[str, Any]:
    """``metadata.json``, Megatron's backend record, parsed as the integration parses it."""
    key = found.key_of(MEGATRON_CONFIG)
    payload = read_capped(found.store, key, MAX_RECORD_BYTES, what="megatron metadata.json")
    return dataclasses.asdict(decode_config(payload, found.store.url(key)))


def _load_item(found: Found, item: _Item, data: memoryview) -> Any:
    """An item's value through the trust boundary (every zip record checked first)."""
    url = found.store.url(found.key_of(item.name))
    return load_torch_bytes(data, url=f"{url} bytes {item.offset}+{item.length} ({item.fqn})")


def _read_items(
    found: Found,
    options: TransferOptions,
    items: list[_Item],
    use: Callable[[Found, _Item, memoryview], Any],
    advance: Callable[[int], None] = lambda n: None,
) -> dict[_Item, Any]:
    """``use(found, item, bytes)`` for each item (what it returns, or the error it
    raised), read in batches of at most ``_BATCH`` bytes of neighbouring ranges."""
    results: dict[_Item, Any] = {}

    def done(item: _Item, buffer: memoryview) -> None:
        try:
            results[item] = use(found, item, buffer)
        except (CloudCkptError, RuntimeError, ValueError, TypeError) as exc:
            results[item] = exc
        advance(item.length)

    batch: list[_Item] = []
    held = 0

    def flush() -> None:
        reader = RangeReader(found.store, options)
        with reader:
            for item in batch:
                buffer = memoryview(bytearray(item.length))
                reader.add(
                    found.key_of(item.name),
                    item.offset,
                    buffer,
                    functools.partial(done, item, buffer),
                )
            reader.run()
        batch.clear()

    for item in items:
        if held + item.length > _BATCH and batch:
            flush()
            held = 0
        batch.append(item)
        held += item.length
    if batch:
        flush()
    return results


# -- verification --------------------------------------------------------------------------


@dataclass
class Checked:
    """One object's verdict: ``error`` names what is wrong and where."""

    url: str
    ok: bool = True
    bytes: int = 0
    error: str | None = None

    def fail(self, exc: BaseException | str) -> None:
        """Keep the first failure found in this object."""
        if self.ok:
            self.ok, self.error = False, str(exc)


@dataclass
class Verification:
    """What ``verify`` found for one checkpoint: a verdict per object."""

    kind: str
    url: str
    checked: list[Checked] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checked)


#: Errors that mean "this object fails its check" (anything else is raised).
_FAILED = (CorruptCheckpointError, UnsafeCheckpointError, UnsupportedFormatError, NotFoundError)


def _failure(exc: BaseException) -> bool:
    return isinstance(exc, _FAILED) and not isinstance(exc, BucketNotFoundError)


def verify(
    found: Found, options: TransferOptions, *, advance: Callable[[int], None] = lambda n: None
) -> Verification:
    """Check everything that can be checked of the checkpoint ``found`` names."""
    out = Verification(found.kind, found.url)
    if found.kind == TORCH:
        entry = Checked(found.url)
        _guard(entry, lambda: verify_archive(found.store, found.key, options, advance=advance))
        out.checked.append(entry)
    elif found.kind == DCP_DATA:
        entry = Checked(found.url, bytes=found.files[posixpath.basename(found.key)].size)
        _guard(entry, lambda: _check_data_file(found.store, found.key, entry.bytes))
        advance(entry.bytes)
        out.checked.append(entry)
        out.note = DATA_FILE_NOTE
    elif found.kind == SAFETENSORS:
        out.checked += _verify_safetensors(found, advance)
    elif found.kind in (DCP, MEGATRON):
        out.checked += verify_dcp(found, options, advance=advance)
    else:
        raise UnsupportedFormatError(
            f"{found.url} holds no checkpoint cloudckpt recognises (a torch archive, DCP, "
            "Megatron or safetensors); `cloudckpt ls` lists what is there"
        )
    return out


def _guard(entry: Checked, check: Callable[[], Any]) -> None:
    """Run ``check`` (which may return the bytes it checked); a failed check marks
    ``entry``, any other error propagates."""
    try:
        checked = check()
    except CloudCkptError as exc:
        if not _failure(exc):
            raise
        entry.fail(exc)
    else:
        if isinstance(checked, int) and not isinstance(checked, bool):
            entry.bytes = checked


def _verify_safetensors(found: Found, advance: Callable[[int], None]) -> list[Checked]:
    """Each index: it parses and every file it names exists and holds its tensors; each
    file: its header parses and every tensor's bytes lie inside it."""
    indexes, singles = _safetensors_files(found)
    entries: dict[str, Checked] = {}
    headers: dict[str, Header | None] = {}

    def header(key: str) -> Header | None:
        if key not in headers:
            entry = entries.setdefault(key, Checked(found.store.url(key)))
            headers[key] = None
            try:
                parsed = headers[key] = read_header(found.store, key)[0]
                # parse_header checked that the tensors end where the file does
                entry.bytes = parsed.data_start + sum(e.nbytes for e in parsed.tensors.values())
                advance(entry.bytes)
            except CloudCkptError as exc:
                if not _failure(exc):
                    raise
                entry.fail(exc)
        return headers[key]

    for index in indexes:
        entry = entries.setdefault(index, Checked(found.store.url(index)))
        try:
            shards = read_index(found.store, index)
        except CloudCkptError as exc:
            if not _failure(exc):
                raise
            entry.fail(exc)
            continue
        for shard, names in shards.items():
            found_header = header(shard)
            if found_header is None:
                entry.fail(f"{entry.url} names {found.store.url(shard)}, which fails its check")
                continue
            missing = [n for n in names if n not in found_header.tensors]
            if missing:
                entry.fail(
                    f"{entry.url} sends {missing[:5]} to {found.store.url(shard)}, which does "
                    "not hold them"
                )
    for key in singles:
        header(key)
    return list(entries.values())


def verify_dcp(
    found: Found, options: TransferOptions, *, advance: Callable[[int], None] = lambda n: None
) -> list[Checked]:
    """Check a DCP (or Megatron) checkpoint prefix: ``.metadata`` parses through the
    trust boundary; every item's data object exists and holds its bytes; every item's
    zip records match their CRC-32s and each tensor item's ``data.pkl`` (through the
    boundary) describes the chunk ``.metadata`` records; with cloudckpt's layout index,
    ``.metadata``'s CRC-32 and every chunk and block checksum it records. One verdict
    per object; each item is read whole (batches of at most 64 MiB)."""
    meta = Checked(found.store.url(found.key_of(METADATA_NAME)))
    meta.bytes = found.files[METADATA_NAME].size if METADATA_NAME in found.files else 0
    out = [meta]
    if LAYOUT_NAME in found.files:
        out.append(Checked(found.store.url(found.key_of(LAYOUT_NAME))))
        out[-1].bytes = found.files[LAYOUT_NAME].size
    if found.kind == MEGATRON:
        config = Checked(found.store.url(found.key_of(MEGATRON_CONFIG)))
        config.bytes = found.files[MEGATRON_CONFIG].size
        _guard(config, lambda: _megatron_config(found))
        out.append(config)
        common = Checked(found.store.url(found.key_of(MEGATRON_COMMON)))
        if MEGATRON_COMMON in found.files:
            key = found.key_of(MEGATRON_COMMON)
            _guard(common, lambda: verify_archive(found.store, key, options, advance=advance))
        else:
            common.fail(f"{common.url} does not exist (Megatron's common state)")
        out.append(common)
    try:
        dcp = _read_dcp(found)
    except CloudCkptError as exc:
        if not _failure(exc):
            raise
        meta.fail(exc)
        return out
    items = _items(dcp)
    data: dict[str, Checked] = {}
    for name in sorted({i.name for i in items}):
        entry = data[name] = Checked(found.store.url(found.key_of(name)))
        info = found.files.get(name)
        if info is None:
            entry.fail(f"{entry.url} does not exist; .metadata stores items in it")
        else:
            entry.bytes = info.size
    readable = []
    for item in items:
        entry = data[item.name]
        info = found.files.get(item.name)
        if info is None:
            continue
        if item.offset + item.length > info.size:
            entry.fail(
                f"{entry.url} holds {info.size} bytes, but .metadata stores {item.fqn} at bytes "
                f"{item.offset}+{item.length}: the object is truncated"
            )
        elif entry.ok:
            readable.append(item)
    check = _ItemCheck(dcp)
    for item, result in _read_items(found, options, readable, check, advance).items():
        if isinstance(result, BaseException):
            if not _failure(result):
                raise result
            data[item.name].fail(result)
    return out + list(data.values())


class _ItemCheck:
    """What :func:`verify_dcp` checks of one item's bytes."""

    def __init__(self, dcp: _Dcp) -> None:
        self.layout = dcp.layout
        self.chunks = ChunkIndex(dcp.metadata)
        self.parses = ArchiveParses()
        self.lock = threading.Lock()  # items are checked in the threads that read them

    def __call__(self, found: Found, item: _Item, data: memoryview) -> None:
        url = found.store.url(found.key_of(item.name))
        where = f"{url} bytes {item.offset}+{item.length} ({item.fqn})"
        layout = self.layout
        if layout is not None:
            expected = layout.chunks.get((item.name, item.offset))
            if expected is not None:
                check_chunk(data, expected, where)
            saved = layout.archives.get((item.name, item.offset))
            if saved is not None and saved.block_size:
                _check_blocks(saved, data, item, url)
        if item.transformed:
            return  # a transformed item is no plain archive: its checksums are all we have
        # Every record's zip CRC-32. A non-tensor item may hold any picklable value: whether
        # the trust boundary admits its classes is a matter of trust, not of damage.
        check_zip_records(data, where)
        if not item.tensor:
            return
        # The tensor as the reader finds it: from data.pkl through the boundary, without
        # copying its bytes (a whole load only for an archive laid out unusually).
        edge = min(len(data), _EDGE)
        head, tail = bytes(data[:edge]), bytes(data[len(data) - edge :])
        with self.lock:
            saved = parse_archive(head, tail, len(data), where, self.parses)
        if saved is not None:
            got: tuple[tuple[int, ...], torch.dtype] | None = (tuple(saved.size), saved.dtype)
        else:
            value = _load_item(found, item, data)
            got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
        want = self.chunks.get(item.index)
        if got is None or (want is not None and got != want):
            held = "no tensor" if got is None else f"{_dtype_name(got[1])} {list(got[0])}"
            raise CorruptCheckpointError(
                f"{where} holds {held}, not the tensor chunk .metadata describes"
            )


def _check_blocks(saved: SavedTensor, data: memoryview, item: _Item, url: str) -> None:
    """The CRC-32 of each block of a large tensor record (the layout index's)."""
    end = saved.data_offset + saved.record_size
    if end > len(data):
        raise CorruptCheckpointError(
            f"{url} bytes {item.offset}+{item.length} ({item.fqn}): the layout index places "
            "its record past the item's end"
        )
    BlockCheck(
        [data[saved.data_offset : end]],
        0,
        saved.block_size,
        saved.block_crcs,
        saved.record_size,
        item.offset + saved.data_offset,
        (url, item.fqn),
    )()


# -- a lone DCP data object ----------------------------------------------------------------


class _RangeFile:
    """A read-only, seekable file over the first ``end`` bytes of one object, read in
    1 MiB ranged reads kept in a small cache shared by the windows of one walk (the
    directories of neighbouring archives share blocks)."""

    BLOCK = 1 << 20

    def __init__(
        self, store: Store, key: str, size: int, end: int, cache: OrderedDict[int, bytes]
    ) -> None:
        self.store, self.key, self.size, self.end, self.cache = store, key, size, end, cache
        self.pos = 0

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.end)[whence]
        if base + offset < 0:
            raise ValueError("seek before the start of the data file")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _block(self, n: int) -> bytes:
        block = self.cache.get(n)
        if block is None:
            start = n * self.BLOCK
            block = self.store.get_range(self.key, start, min(self.size, start + self.BLOCK))
            self.cache[n] = block
            while len(self.cache) > 8:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(n)
        return block

    def read(self, n: int = -1) -> bytes:
        stop = self.end if n is None or n < 0 else min(self.end, self.pos + n)
        out = bytearray()
        while self.pos < stop:
            block = self._block(self.pos // self.BLOCK)
            start = self.pos % self.BLOCK
            piece = block[start : start + stop - self.pos]
            if not piece:
                break
            out += piece
            self.pos += len(piece)
        return bytes(out)


def _check_data_file(store: Store, key: str, size: int) -> None:
    """Walk a DCP data object's ``torch.save`` archives from its end back to byte 0,
    each directory and local header checked."""
    url = store.url(key)
    cache: OrderedDict[int, bytes] = OrderedDict()
    end = size
    while end > 0:
        window = _RangeFile(store, key, size, end, cache)
        try:
            with zipfile.ZipFile(window) as archive:  # type: ignore[arg-type]
                records = archive.infolist()
                if not records:
                    raise zipfile.BadZipFile("an archive without records")
                start = min(r.header_offset for r in records)
                for r in records:
                    if r.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                        raise zipfile.BadZipFile(f"record {r.filename!r} is compressed")
                    if r.header_offset + r.compress_size > archive.start_dir:
                        raise zipfile.BadZipFile(f"record {r.filename!r} runs into the directory")
                    with archive.open(r):  # reads and checks its local header
                        pass
        except (
            zipfile.BadZipFile,
            EOFError,
            ValueError,
            struct.error,
            NotImplementedError,
            RuntimeError,  # a record flagged as encrypted
        ) as exc:
            raise CorruptCheckpointError(
                f"{url} is damaged or truncated: the bytes before offset {end} do not end "
                f"with a torch archive ({exc})"
            ) from None
        if not 0 <= start < end:
            raise CorruptCheckpointError(f"{url} is damaged: an archive starts at {start}")
        end = start
