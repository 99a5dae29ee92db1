"""Synchronous load: the archive's directory in one ranged read, then records in parallel.

Steps: HEAD the object; read its tail and parse the zip directory; fetch ``data.pkl``;
unpickle it with a storage loader that allocates each tensor's memory and starts the
ranged reads that fill it (so I/O overlaps unpickling); wait; check every record's
CRC-32. Adjacent small records are coalesced into one request; large records are split
into ``read_chunk_size`` pieces. With ``keys=[...]`` only the storages those top-level
entries reference are fetched.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import (
    BucketNotFoundError,
    ChecksumError,
    ConfigError,
    CorruptCheckpointError,
    MissingKeyError,
    NotAnObjectError,
    NotFoundError,
)
from ..format.checksum import crc32
from ..format.tensors import referenced_storages
from ..format.unpickle import StorageRef, parse_persistent_id, unpickle
from ..format.zipdir import (
    Entry,
    check_local_header,
)
from ..options import TransferOptions
from ..store import ObjectInfo, Store, open_target
from .directory import read_directory
from .memview import writable_view
from .progress import progress_bar
from .scheduler import TransferGroup

__all__ = ["load"]


def _storage_view(storage: torch.UntypedStorage) -> memoryview:
    """A writable view of a CPU storage's memory (no copy)."""
    return writable_view(storage.data_ptr(), storage.nbytes())


class _Record:
    """A record being fetched: destination, pieces outstanding, header scratch."""

    __slots__ = ("dest", "entry", "header", "pending", "storage")

    def __init__(self, entry: Entry, dest: memoryview, storage: Any = None) -> None:
        self.entry = entry
        self.dest = dest
        self.storage = storage  # keeps the memory behind ``dest`` alive
        self.header = memoryview(bytearray(entry.local_header_size))
        self.pending = 0


class _Fetcher:
    """Plans and runs the ranged reads that fill records, and checks them."""

    def __init__(self, store: Store, key: str, options: TransferOptions, advance: Any) -> None:
        self.store = store
        self.key = key
        self.url = store.url(key)
        self.options = options
        self.advance = advance
        self.group = TransferGroup(options, options.read_concurrency)
        self._lock = threading.Lock()
        self._batch: list[_Record] = []
        self._batch_bytes = 0

    def add(self, record: _Record) -> None:
        self._batch.append(record)
        self._batch_bytes += record.entry.size
        if self._batch_bytes >= self.options.read_chunk_size:
            self.flush()

    def flush(self) -> None:
        """Submit the batched records, coalescing neighbours into one request."""
        batch, self._batch = sorted(self._batch, key=lambda r: r.entry.header_offset), []
        self._batch_bytes = 0
        chunk, max_gap = self.options.read_chunk_size, self.options.read_gap
        run: list[_Record] = []
        run_end = -1
        run_size = 0
        for rec in batch:
            e = rec.entry
            total = e.local_header_size + e.size
            gap = e.header_offset - run_end  # data descriptors sit between records
            if run and (not 0 <= gap <= max_gap or run_size + gap + total > chunk):
                self._submit_run(run)
                run, run_size = [], 0
            if total > chunk:
                if run:
                    self._submit_run(run)
                    run, run_size = [], 0
                self._submit_split(rec, chunk)
                continue
            run.append(rec)
            run_size += total + (e.header_offset - run_end if len(run) > 1 else 0)
            run_end = e.end
        if run:
            self._submit_run(run)

    def _submit_run(self, run: list[_Record]) -> None:
        buffers: list[memoryview] = []
        previous_end = run[0].entry.header_offset
        for rec in run:
            rec.pending += 1
            gap = rec.entry.header_offset - previous_end
            if gap:
                buffers.append(memoryview(bytearray(gap)))
            buffers += [rec.header, rec.dest]
            previous_end = rec.entry.end
        start = run[0].entry.header_offset
        self._submit(start, buffers, run, sum(r.entry.size for r in run))

    def _submit_split(self, rec: _Record, chunk: int) -> None:
        pieces = [(rec.entry.header_offset, [rec.header, rec.dest[: chunk - len(rec.header)]])]
        pos = chunk - len(rec.header)
        while pos < len(rec.dest):
            pieces.append((rec.entry.data_offset + pos, [rec.dest[pos : pos + chunk]]))
            pos += chunk
        rec.pending += len(pieces)
        for start, buffers in pieces:
            self._submit(start, buffers, [rec], sum(len(b) for b in buffers))

    def _submit(self, start: int, buffers: list[memoryview], recs: list[_Record], n: int) -> None:
        def run() -> None:
            self.store.read_into(self.key, start, buffers)
            self.advance(n)
            done: list[_Record] = []
            with self._lock:
                for rec in recs:
                    rec.pending -= 1
                    if rec.pending == 0:
                        done.append(rec)
            for rec in done:
                self._check(rec)

        self.group.submit(run, f"read {self.url} bytes {start}+{n}")

    def _check(self, rec: _Record) -> None:
        check_local_header(rec.header, rec.entry, self.url)
        crc = crc32(rec.dest)
        if crc != rec.entry.crc32:
            raise ChecksumError(
                f"{self.url}: record {rec.entry.name!r} fails its CRC-32 check "
                f"(stored {rec.entry.crc32:08x}, read {crc:08x}): the object is corrupted"
            )

    def wait(self) -> None:
        self.flush()
        try:
            self.group.wait()
        except BaseException:
            self.group.cancel()
            raise


def _head(store: Store, key: str, options: TransferOptions) -> ObjectInfo:
    url = store.url(key)
    try:
        return store.head(key)
    except BucketNotFoundError:
        raise BucketNotFoundError(f"bucket does not exist: {store.root_url} (for {url})") from None
    except NotFoundError:
        # An object store has no directories: say so if the URL is really a prefix.
        try:
            first = next(iter(store.list(key.rstrip("/") + "/")), None)
        except BucketNotFoundError:
            raise BucketNotFoundError(
                f"bucket does not exist: {store.root_url} (for {url})"
            ) from None
        if first is not None:
            raise NotAnObjectError(
                f"{url} is a prefix holding other objects, not a checkpoint object"
            ) from None
        raise


def _fallback_torch_load(
    store: Store,
    key: str,
    size: int,
    options: TransferOptions,
    map_location: Any,
    weights_only: bool,
) -> Any:
    """Archives we cannot read record by record (legacy format, compressed records)."""
    url = store.url(key)
    data = store.get_range(key, 0, size)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        raise CorruptCheckpointError(f"{url} is not a readable torch checkpoint: {exc}") from exc


def _select(result: Any, keys: Sequence[str], url: str) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise ConfigError(
            "keys= needs a checkpoint whose top level is a dict; "
            f"{url} holds a {type(result).__name__}"
        )
    missing = [k for k in keys if k not in result]
    if missing:
        raise MissingKeyError(
            f"{url} has no top-level key(s) {missing}; it has {sorted(map(str, result))}"
        )
    return {k: result[k] for k in keys}


def load(
    url: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool = True,
    *,
    keys: Sequence[str] | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> Any:
    """Read a checkpoint written by :func:`cloudckpt.save` or ``torch.save``.

    Returns what ``torch.load`` returns for the same bytes. ``keys`` loads only those
    top-level entries of a dict checkpoint, fetching only the bytes they need.
    """
    if isinstance(keys, str):
        keys = [keys]
    where = open_target(url, options, **overrides)
    store, key, opts = where.store, where.key, where.options
    target = store.url(key)
    info = _head(store, key, opts)
    if info.size == 0:
        raise CorruptCheckpointError(f"{target} is empty")
    try:
        found = read_directory(store, key, info.size)
    except CorruptCheckpointError:
        if info.size < 8 or store.get_range(key, 0, 2) == b"PK":
            raise
        result = _fallback_torch_load(store, key, info.size, opts, map_location, weights_only)
        return _select(result, keys, target) if keys is not None else result
    entries = found.directory.entries
    tail, tail_start = found.tail, found.tail_start
    pkl_names = [n for n in entries if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkl_names) != 1:
        raise CorruptCheckpointError(f"{target} is a zip archive but not a torch checkpoint")
    prefix = pkl_names[0][: -len("data.pkl")]
    if any(e.method != 0 for e in entries.values()):
        result = _fallback_torch_load(store, key, info.size, opts, map_location, weights_only)
        return _select(result, keys, target) if keys is not None else result

    started = time.perf_counter()
    payload = sum(e.size for n, e in entries.items() if n.startswith(prefix + "data/"))
    with progress_bar(f"load {key.rsplit('/', 1)[-1]}", payload, opts.progress) as advance:
        # Small records (data.pkl, byteorder) first, from the tail already read if there.
        meta = {}
        fetcher = _Fetcher(store, key, opts, lambda n: None)
        for name in (prefix + "data.pkl", prefix + "byteorder"):
            e = entries.get(name)
            if e is None:
                continue
            if e.header_offset >= tail_start and e.end <= tail_start + len(tail):
                rel = e.header_offset - tail_start
                rec = _Record(e, memoryview(bytearray(e.size)))
                rec.header[:] = tail[rel : rel + e.local_header_size]
                rec.dest[:] = tail[rel + e.local_header_size : rel + e.local_header_size + e.size]
                fetcher._check(rec)
            else:
                rec = _Record(e, memoryview(bytearray(e.size)))
                fetcher.add(rec)
            meta[name] = rec
        fetcher.wait()
        data_pkl = meta[prefix + "data.pkl"].dest
        byteorder = (
            bytes(meta[prefix + "byteorder"].dest).decode()
            if prefix + "byteorder" in meta
            else "little"
        )

        fetcher = _Fetcher(store, key, opts, advance)
        refs: dict[str, StorageRef] = {}
        storages: dict[str, torch.UntypedStorage] = {}
        typed: dict[str, torch.storage.TypedStorage] = {}
        eager = keys is None

        def persistent_load(saved_id: Any) -> Any:
            ref = parse_persistent_id(saved_id, target)
            if ref.key in typed:
                return typed[ref.key]
            entry = entries.get(f"{prefix}data/{ref.key}")
            if entry is None:
                raise CorruptCheckpointError(f"{target}: storage record data/{ref.key} is missing")
            if entry.size != ref.nbytes:
                raise CorruptCheckpointError(
                    f"{target}: record data/{ref.key} holds {entry.size} bytes, "
                    f"expected {ref.nbytes}"
                )
            storage = torch.UntypedStorage(ref.nbytes)
            refs[ref.key] = ref
            storages[ref.key] = storage
            if eager:
                fetcher.add(_Record(entry, _storage_view(storage), storage))
            typed[ref.key] = torch.storage.TypedStorage(
                wrap_storage=storage, dtype=ref.dtype, _internal=True
            )
            return typed[ref.key]

        try:
            result = unpickle(data_pkl, persistent_load, weights_only=weights_only, url=target)
            if keys is not None:
                result = _select(result, keys, target)
                wanted = referenced_storages(result, {s._cdata: k for k, s in storages.items()})
                for k in sorted(wanted):
                    fetcher.add(
                        _Record(
                            entries[f"{prefix}data/{k}"], _storage_view(storages[k]), storages[k]
                        )
                    )
                for k in set(storages) - wanted:
                    del storages[k]
            fetcher.wait()
        except BaseException:
            fetcher.group.cancel()
            raise
    if byteorder != sys.byteorder:
        for k, storage in storages.items():
            storage.byteswap(refs[k].dtype)

    needs_restore = map_location not in (None, "cpu") and map_location != torch.device("cpu")
    needs_restore = needs_restore or any(r.location != "cpu" for r in refs.values())
    if needs_restore:
        result = _restore(data_pkl, storages, map_location, weights_only, target, keys)
    _ = time.perf_counter() - started
    return result


def _restore(
    data_pkl: memoryview,
    storages: dict[str, torch.UntypedStorage],
    map_location: Any,
    weights_only: bool,
    url: str,
    keys: Sequence[str] | None,
) -> Any:
    """Second, metadata-only unpickle that applies ``map_location`` to the loaded storages."""
    restore_location = torch.serialization._get_restore_location(map_location)
    restored: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> Any:
        ref = parse_persistent_id(saved_id, url)
        if ref.key not in restored:
            storage = storages.get(ref.key)
            if storage is None:  # not selected by keys=: leave it on the meta device
                storage = torch.UntypedStorage(ref.nbytes, device="meta")
            else:
                storage = restore_location(storage, ref.location)
            restored[ref.key] = torch.storage.TypedStorage(
                wrap_storage=storage, dtype=ref.dtype, _internal=True
            )
        return restored[ref.key]

    result = unpickle(data_pkl, persistent_load, weights_only=weights_only, url=url)
    return _select(result, keys, url) if keys is not None else result
