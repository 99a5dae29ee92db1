"""Synchronous load in three steps: plan, fetch, restore.

- **plan** (:func:`_plan`): HEAD the object, read its tail and parse the zip directory
  (one ranged read, usually), and find ``data.pkl``. An archive that cannot be read
  record by record (legacy format, compressed records) is read whole by ``torch.load``.
- **fetch** (:func:`_fetch`): place every storage record from the directory and send
  all their reads (engine/records.py: large records into storages of their own, runs of
  small ones into shared blocks; io/ranges.py joins neighbours and splits large
  reads), then read ``data.pkl`` (from the tail when it is there) and unpickle it while
  the records arrive, each storage built over the memory its record lands in. Each
  record's local header and CRC-32 are checked in the thread that read it. With
  ``keys=[...]`` the structure comes first and only the storages those top-level
  entries reference are fetched.
- **restore** (:func:`_restore`): byte order, and ``map_location`` applied to the
  storages already in memory.
"""

from __future__ import annotations

import io
import mmap as mmap_module
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._runtime.gcpause import paused_gc
from ..errors import (
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    DistributedLoadError,
    MissingKeyError,
    UnsafeCheckpointError,
)
from ..format.safetensors import is_safetensors_url
from ..format.torch.restricted_pickle import validate_sparse
from ..format.torch.storages import fixed_storage
from ..format.torch.tensors import referenced_storages
from ..format.torch.unpickle import (
    StorageRef,
    byte_order,
    load_torch_bytes,
    parse_persistent_id,
    rebuilds_mapped,
    restore_location,
    typed_storage,
    unpickle,
)
from ..format.torch.zipdir import Entry
from ..io.progress import progress_bar
from ..io.ranges import RangeReader
from ..options import TransferOptions
from ..ranks.collectives import agree, group_rank, on_first, settle
from ..ranks.share import broadcast_views, report, share_group, split_even
from ..store import Store, Target, object_url, open_target
from ..store.deadline import deadline_scope
from ..store.local import LocalStore
from ..store.paths import head_object
from .directory import read_directory
from .records import (
    MappedRecords,
    PlacedRecords,
    RecordReads,
    check_record,
    read_record,
    storage_view,
)

__all__ = ["load"]


#: ``map_location`` not given to :func:`_structure`: the bytes are still being read.
_NOT_YET: Any = object()


@dataclass
class _Plan:
    """Where everything a load reads sits in the object (no tensor byte read yet)."""

    store: Store
    key: str
    url: str
    size: int
    #: The archive's records by name; empty when the object must be read whole.
    entries: dict[str, Entry] = field(default_factory=dict)
    #: Records are named ``{prefix}data.pkl``, ``{prefix}data/0``...
    prefix: str = ""
    #: The tail already read for the directory (small records may sit in it).
    tail: bytes = b""
    tail_start: int = 0
    #: The storage records (``{prefix}data/KEY``) by KEY.
    records: dict[str, Entry] = field(init=False)

    def __post_init__(self) -> None:
        data = self.prefix + "data/"
        self.records = {n[len(data) :]: e for n, e in self.entries.items() if n.startswith(data)}

    @property
    def whole(self) -> bool:
        """The object is read whole by ``torch.load`` (not record by record)."""
        return not self.entries


@dataclass
class _Fetched:
    """What the fetch step produced: the structure and the storages it filled."""

    result: Any
    data_pkl: memoryview
    byteorder: str
    refs: dict[str, StorageRef]
    storages: dict[str, torch.UntypedStorage]
    #: Sparse tensors the structure holds, checked once their bytes are in.
    sparse: list[Any] = field(default_factory=list)
    #: The structure was unpickled once the bytes were in, byte order and map_location
    #: applied (:func:`_read_first`): nothing left for :func:`_restore` to do.
    final: bool = False


def _plan(store: Store, key: str) -> _Plan:
    """Locate the archive's records, or decide to read the object whole."""
    url = store.url(key)
    size = head_object(store, key).size
    if size == 0:
        raise CorruptCheckpointError(f"{url} is empty")
    whole = _Plan(store, key, url, size)
    try:
        found = read_directory(store, key, size)
    except CorruptCheckpointError:
        if size < 8 or store.get_range(key, 0, 2) == b"PK":
            raise
        return whole  # not a zip archive: torch's legacy format
    entries = found.directory.entries
    pkl_names = [n for n in entries if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pkl_names) != 1:
        raise CorruptCheckpointError(f"{url} is a zip archive but not a torch checkpoint")
    if any(e.method != 0 for e in entries.values()):
        return whole
    prefix = pkl_names[0][: -len("data.pkl")]
    return _Plan(store, key, url, size, entries, prefix, found.tail, found.tail_start)


def _small_records(plan: _Plan, options: TransferOptions) -> dict[str, memoryview]:
    """``data.pkl`` and ``byteorder``, checked: from the tail already read if they are in
    it, else in one more request."""
    found: dict[str, memoryview] = {}
    with RangeReader(plan.store, options) as reader:
        for name in (plan.prefix + "data.pkl", plan.prefix + "byteorder"):
            e = plan.entries.get(name)
            if e is None:
                continue
            dest = memoryview(bytearray(e.size))
            if e.header_offset >= plan.tail_start and e.end <= plan.tail_start + len(plan.tail):
                rel = e.header_offset - plan.tail_start
                header = memoryview(plan.tail)[rel : rel + e.local_header_size]
                dest[:] = plan.tail[rel + e.local_header_size : rel + e.local_header_size + e.size]
                check_record(plan.url, e, header, dest)
            else:
                read_record(reader, plan.key, plan.url, e, dest, None)  # owns its bytes
            found[name] = dest
        reader.run()
    return found


def _structure(
    plan: _Plan,
    small: dict[str, memoryview],
    weights_only: bool,
    keys: Sequence[str] | None,
    placed: PlacedRecords | MappedRecords | None,
    map_location: Any = _NOT_YET,
    settle: Callable[[], None] | None = None,
) -> _Fetched:
    """Unpickle ``data.pkl``, each storage it names taken from ``placed`` (else allocated,
    to be read after); with ``keys``, only the storages they reference are kept.
    ``small`` holds the records :func:`_small_records` read. With ``map_location``, the
    storages' bytes are in: each is put in the host's byte order and placed by it as
    the pickle names it (the result is final). ``settle``: while they are still being
    read, what makes them all in and checked; the unpickler calls it before anything
    that reads or writes tensor memory (a device copy, a quantized or sparse rebuild,
    torch's own unpickler)."""
    data_pkl = small[plan.prefix + "data.pkl"]
    byteorder = plan.prefix + "byteorder"
    order = byte_order(small.get(byteorder), plan.url)
    refs: dict[str, StorageRef] = {}
    storages: dict[str, torch.UntypedStorage] = {}
    typed: dict[str, torch.storage.TypedStorage] = {}
    #: Tensors made on the way to a storage, for the first tensor over it (engine/records.py).
    spares: dict[int, torch.Tensor] = {}
    records = plan.records
    final = map_location is not _NOT_YET
    restore = torch.serialization._get_restore_location(map_location) if final else None

    def persistent_load(saved_id: Any) -> Any:
        ref = parse_persistent_id(saved_id, plan.url)
        found = typed.get(ref.key)
        if found is not None:
            return found
        entry = records.get(ref.key)
        if entry is None:
            raise CorruptCheckpointError(f"{plan.url}: storage record data/{ref.key} is missing")
        if entry.size != ref.nbytes:
            raise CorruptCheckpointError(
                f"{plan.url}: record data/{ref.key} holds {entry.size} bytes, expected {ref.nbytes}"
            )
        if placed is None:
            storage, spare = fixed_storage(ref.nbytes), None
        else:
            storage, spare = placed.storage(entry, ref)
        refs[ref.key] = ref
        storages[ref.key] = storage
        if restore is not None:
            if order != sys.byteorder:
                storage.byteswap(ref.dtype)
            storage = restore_location(restore, storage, ref.location, map_location, plan.url)
            if storage.device.type != "cpu":
                spare = None
        found = typed_storage(storage, ref.dtype)
        if ref.nbytes:  # as torch.load: an empty storage is made anew at each reference
            typed[ref.key] = found
        if spare is not None:
            spares[id(found)] = spare
        return found

    sparse: list[Any] = []
    result = unpickle(
        data_pkl,
        persistent_load,
        weights_only=weights_only,
        url=plan.url,
        spares=spares,
        sparse=sparse,
        map_location=map_location if final else None,
        settle=settle,
    )
    if keys is not None:
        result = _select(result, keys, plan.url)
        wanted = referenced_storages(result, {s._cdata: k for k, s in storages.items()})
        for k in set(storages) - wanted:
            del storages[k]
    return _Fetched(result, data_pkl, order, refs, storages, sparse, final)


def _read_first(
    plan: _Plan,
    small: dict[str, memoryview],
    options: TransferOptions,
    weights_only: bool,
    keys: Sequence[str] | None,
    advance: Callable[[int], None],
    map_location: Any,
) -> _Fetched:
    """A ``data.pkl`` that names a device rebuild (which copies its tensor while the
    pickle is read): every record read and checked first, then one unpickle with the
    byte order and ``map_location`` applied, so no copy is made of memory not yet
    filled, and none twice."""
    with RangeReader(plan.store, options, advance=advance) as reader:
        placed = PlacedRecords(reader, plan.key, plan.url, plan.records.values())
        placed.check_arrived()  # every block is checked by the thread that reads it
        reader.run()
    return _structure(plan, small, weights_only, keys, placed, map_location)


def _moves(small: dict[str, memoryview], plan: _Plan) -> bool:
    """Whether ``data.pkl`` names one of torch's rebuilds that copy a tensor to a device
    while it is read (``_rebuild_device_tensor_from...``)."""
    return _DEVICE_REBUILD in bytes(small[plan.prefix + "data.pkl"])


def _fetch(
    plan: _Plan,
    options: TransferOptions,
    weights_only: bool,
    keys: Sequence[str] | None,
    advance: Callable[[int], None],
    map_location: Any,
) -> _Fetched:
    """Unpickle the structure and fill every storage it needs, in parallel, checked;
    without ``keys`` every record's read is sent before unpickling starts."""
    small = _small_records(plan, options)  # data.pkl first: the records' reads would slow it
    if _moves(small, plan):
        return _read_first(plan, small, options, weights_only, keys, advance, map_location)
    with RangeReader(plan.store, options, stream=keys is not None, advance=advance) as reader:
        if keys is None:
            placed = PlacedRecords(reader, plan.key, plan.url, plan.records.values())
            reader.start()

            def settle() -> None:
                reader.run()
                placed.check_arrived()

            fetched = _structure(plan, small, weights_only, None, placed, settle=settle)
            placed.check_arrived()
        else:
            try:  # the structure first: its storages are read after
                fetched = _structure(plan, small, weights_only, keys, None, settle=_no_bytes)
            except _NeedsBytes:
                reader.cancel()
                return _read_first(plan, small, options, weights_only, keys, advance, map_location)
            records = RecordReads(reader, plan.key, plan.url)
            for k in sorted(fetched.storages, key=lambda k: plan.records[k].header_offset):
                storage = fetched.storages[k]
                records.add(plan.records[k], storage_view(storage), storage)
            records.flush()
        reader.run()
    return fetched


def _fetch_shared(
    plan: _Plan,
    options: TransferOptions,
    weights_only: bool,
    keys: Sequence[str] | None,
    advance: Callable[[int], None],
    group: Any,
    map_location: Any,
) -> _Fetched:
    """:func:`_fetch` with every rank of ``group``: each reads and checks about 1/N of
    the records (contiguous in the object), then they exchange them (ranks/share.py)."""
    me, ranks = group_rank(group)
    error: BaseException | None = None
    fetched: _Fetched | None = None
    items: list[tuple[int, memoryview]] = []
    try:
        small = _small_records(plan, options)
        if _moves(small, plan):  # every rank reads it all (the same on every rank)
            fetched = _read_first(plan, small, options, weights_only, keys, advance, map_location)
            raise _ReadAlone
        try:  # the structure first: its storages are read after
            fetched = _structure(plan, small, weights_only, keys, None, settle=_no_bytes)
        except _NeedsBytes:  # (the same on every rank: the same bytes, checked)
            fetched = _read_first(plan, small, options, weights_only, keys, advance, map_location)
            raise _ReadAlone from None
        found = sorted(
            ((plan.records[k], fetched.storages[k]) for k in fetched.storages),
            key=lambda es: es[0].header_offset,
        )
        owners = split_even([e.size for e, _ in found], ranks)
        items = [(o, storage_view(st)) for o, (_, st) in zip(owners, found, strict=True)]
        with RangeReader(plan.store, options, stream=True, advance=advance) as reader:
            records = RecordReads(reader, plan.key, plan.url)
            for (owner, view), (entry, storage) in zip(items, found, strict=True):
                if owner == me:
                    records.add(entry, view, storage)
            records.flush()
            reader.run()
        total = sum(e.local_header_size + e.size for e, _ in found)
        report(plan.url, group, reader.requests, reader.bytes, total)
    except _ReadAlone:
        pass
    except Exception as exc:
        error = exc
    settle(error, f"the shared load of {plan.url}", group=group, error_type=DistributedLoadError)
    assert fetched is not None
    broadcast_views(group, items)
    return fetched


def _read_whole(plan: _Plan, map_location: Any, weights_only: bool) -> Any:
    """Archives we cannot read record by record: a zip with compressed records goes
    through the boundary whole (format/torch/unpickle.load_torch_bytes); torch's legacy
    (pre-zip) format through ``torch.load`` itself, whose weights-only unpickler is the
    reference our boundary follows (docs/security.md)."""
    data = plan.store.get_range(plan.key, 0, plan.size)
    if data[:2] == b"PK":
        return load_torch_bytes(
            data, map_location=map_location, weights_only=weights_only, url=plan.url
        )
    if data[:1] != b"\x80":  # the legacy format opens with a pickle's PROTO
        raise CorruptCheckpointError(
            f"{plan.url} is not a torch checkpoint (neither a zip archive nor a pickle)"
        )
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        if weights_only and "Unsupported global" in str(exc):  # torch's refusal of a name
            raise UnsafeCheckpointError(f"{plan.url}: torch.load refused it: {exc}") from None
        raise CorruptCheckpointError(
            f"{plan.url} is not a readable torch checkpoint: {exc}"
        ) from exc


#: Names torch's rebuilds that copy a tensor to a device (``.to`` at unpickling time).
_DEVICE_REBUILD = b"_rebuild_device_tensor_from"


class _ReadAlone(Exception):
    """A shared load whose ranks each read the object whole (:func:`_read_first`)."""


class _NeedsBytes(CloudCkptError):
    """The structure, unpickled before its storages are read (``keys=``, a shared load),
    calls something that reads tensor memory: it is read whole first instead (a
    CloudCkptError so that the unpickler lets it through; never raised to a caller)."""


def _no_bytes() -> None:
    raise _NeedsBytes


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


@paused_gc(kept=True)  # unpickling's per-tensor objects, kept (_runtime/gcpause.py)
def load(
    url: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool = True,
    *,
    keys: Sequence[str] | None = None,
    share: bool = False,
    process_group: Any = None,
    mmap: bool = False,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> Any:
    """Read a checkpoint written by :func:`cloudckpt.save` or ``torch.save``.

    Returns what ``torch.load`` returns for the same bytes. ``keys`` loads only those
    top-level entries of a dict checkpoint, fetching only the bytes they need. The
    storages of small tensors (up to 256 KiB) lie in shared blocks, each its own storage;
    no storage a load makes can grow (``resize_`` past its size raises, as after
    ``torch.load``); docs/format.md, "Parallel read", and docs/security.md.

    ``share=True``: every rank of ``process_group`` (default: the world) calls ``load``
    at once, as a DDP resume does, and the object's bytes are read once in all: each
    rank reads and checks a share of the records and the ranks exchange them over a
    gloo group (ranks/share.py). Ranks naming different objects each load their own;
    a rank that fails makes every rank raise. Without an initialized process group, or
    alone in it, it is a plain load.

    ``mmap=True`` (a local path or ``file://`` URL): as ``torch.load(..., mmap=True)``,
    the tensors are built over a copy-on-write mapping of the file instead of being
    read into new memory; every record is still checked (local header, CRC-32), which
    reads each page once. Writing to a tensor copies the pages it touches; the file
    is never changed. Keep the file in place (deleting it is safe; truncating it is
    not) while the tensors live.

    A URL ending in ``.safetensors`` or ``.safetensors.index.json`` is read by
    :func:`cloudckpt.load_safetensors` (``{name: tensor}``; ``keys`` are tensor names,
    ``map_location`` is its ``device``; ``weights_only`` does not apply: the format
    holds no code).
    """
    if isinstance(keys, str):
        keys = [keys]
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if isinstance(text, str) and is_safetensors_url(text):
        if mmap:
            raise ConfigError(f"mmap=True maps torch archives; {text} is a safetensors file")
        from .safetensors import load_safetensors  # it imports this module

        return load_safetensors(url, keys=keys, device=map_location, options=options, **overrides)
    where = open_target(object_url(url), options, **overrides)
    if mmap and share:
        raise ConfigError("mmap=True and share=True exclude each other: each rank maps its file")
    if mmap and not isinstance(where.store, LocalStore):
        raise ConfigError(
            f"mmap=True maps a local file; {where.store.url(where.key)} is not on a "
            "filesystem (pass a path or a file:// URL)"
        )
    with deadline_scope(where.options.deadline):  # bounds the whole load (store/deadline.py)
        if mmap:
            return _load_mapped(where, map_location, weights_only, keys)
        return _load(where, map_location, weights_only, keys, share, process_group)


def _load_mapped(
    where: Target, map_location: Any, weights_only: bool, keys: Sequence[str] | None
) -> Any:
    """:func:`load` with ``mmap=True`` of a file: the structure unpickled over storages
    built on the file's mapping, then the wanted records checked there."""
    assert isinstance(where.store, LocalStore)
    plan = _plan(where.store, where.key)
    if plan.whole:  # a legacy or compressed archive has no records to map
        result = _read_whole(plan, map_location, weights_only)
        return _select(result, keys, plan.url) if keys is not None else result
    memory = where.store.map_private(where.key)
    if keys is None:  # every page is checked: ask the kernel to read ahead now
        memory.madvise(mmap_module.MADV_WILLNEED)
    mapped = MappedRecords(memory, plan.url)
    small = _small_records(plan, where.options)
    if _moves(small, plan):  # checked before a device rebuild copies any of it
        mapped.check(plan.records.values(), where.options.read_concurrency)
        with rebuilds_mapped(map_location):
            fetched = _structure(plan, small, weights_only, keys, mapped, map_location)
    else:
        checked: list[bool] = []

        def settle() -> None:  # the bytes are there: check them all before they are used
            mapped.check(plan.records.values(), where.options.read_concurrency)
            checked.append(True)

        fetched = _structure(plan, small, weights_only, keys, mapped, settle=settle)
        if not checked:
            mapped.check(
                (plan.records[k] for k in fetched.storages), where.options.read_concurrency
            )
    validate_sparse(fetched.sparse, plan.url)
    return _restore(fetched, map_location, weights_only, plan.url, keys)


def _load(
    where: Target,
    map_location: Any,
    weights_only: bool,
    keys: Sequence[str] | None,
    share: bool,
    process_group: Any,
) -> Any:
    """:func:`load` of a resolved URL."""
    group = share_group(process_group) if share else None
    if group is None:
        plan = _plan(where.store, where.key)
    else:
        plan, group = _agreed_plan(where.store, where.key, keys, group)
    if plan.whole:
        result = _read_whole(plan, map_location, weights_only)
        return _select(result, keys, plan.url) if keys is not None else result
    total = sum(e.local_header_size + e.size for e in plan.records.values())
    name = f"load {where.key.rsplit('/', 1)[-1]}"
    # rebuilds_mapped: a device rebuild runs in the first pass too
    with (
        progress_bar(name, total, where.options.progress) as advance,
        rebuilds_mapped(map_location),
    ):
        if group is None:
            fetched = _fetch(plan, where.options, weights_only, keys, advance, map_location)
        else:
            fetched = _fetch_shared(
                plan, where.options, weights_only, keys, advance, group, map_location
            )
    validate_sparse(fetched.sparse, plan.url)  # the bytes are in now
    return _restore(fetched, map_location, weights_only, plan.url, keys)


def _agreed_plan(
    store: Store, key: str, keys: Sequence[str] | None, group: Any
) -> tuple[_Plan, Any]:
    """The plan, made once by the group's first rank (one HEAD and one directory read
    for all), and ``group`` if every rank loads this object the same way; else each
    rank's own plan and None (each loads on its own)."""
    if not agree(value=(store.url(key), keys and list(keys)), group=group).unanimous:
        return _plan(store, key), None

    def first() -> tuple[Any, ...]:  # everything but the store, which each rank opens itself
        plan = _plan(store, key)
        return (plan.url, plan.size, plan.entries, plan.prefix, plan.tail, plan.tail_start)

    what = f"the shared load of {store.url(key)}"
    got = on_first(first, group, what=what, error_type=DistributedLoadError)
    shared = _Plan(store, key, *got)
    return shared, None if shared.whole else group


def _restore(
    fetched: _Fetched,
    map_location: Any,
    weights_only: bool,
    url: str,
    keys: Sequence[str] | None,
) -> Any:
    """Fix the byte order of the loaded storages, then apply ``map_location`` to them
    (a second, metadata-only unpickle), where either is needed."""
    if fetched.final:
        return fetched.result
    storages, refs = fetched.storages, fetched.refs
    if fetched.byteorder != sys.byteorder:
        for k, storage in storages.items():
            storage.byteswap(refs[k].dtype)
    on_cpu = map_location in (None, "cpu") or map_location == torch.device("cpu")
    if on_cpu and all(r.location == "cpu" for r in refs.values()):
        return fetched.result
    restore = torch.serialization._get_restore_location(map_location)
    restored: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> Any:
        ref = parse_persistent_id(saved_id, url)
        if ref.key not in restored or not ref.nbytes:
            storage = storages.get(ref.key)
            if storage is None:  # not selected by keys=: leave it on the meta device
                storage = torch.UntypedStorage(ref.nbytes, device="meta")
            else:
                storage = restore_location(restore, storage, ref.location, map_location, url)
            restored[ref.key] = torch.storage.TypedStorage(
                wrap_storage=storage, dtype=ref.dtype, _internal=True
            )
        return restored[ref.key]

    result = unpickle(
        fetched.data_pkl,
        persistent_load,
        weights_only=weights_only,
        url=url,
        map_location=map_location,
    )
    return _select(result, keys, url) if keys is not None else result
