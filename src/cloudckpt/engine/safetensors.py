"""safetensors on any store: ranged reads into tensor memory, streamed multipart writes.

Load (:func:`load_safetensors`), in three steps:

- **find**: a ``.safetensors`` URL is one file, a ``.safetensors.index.json`` URL the
  shards its ``weight_map`` names (each file name checked as a key under the index's
  folder); any other URL is a folder, searched as transformers does
  (``model.safetensors``, then ``model.safetensors.index.json``, then the only one).
- **headers**: per file a HEAD and one ranged read of the first 64 KiB (a longer header
  costs one more read, of its rest and 64 KiB after it), validated by
  ``format/safetensors.py`` before anything is allocated; the shards' headers are read
  in parallel, only those of shards holding a wanted tensor.
- **tensors**: each wanted tensor is allocated with its own dtype and shape and its bytes
  are read straight into its memory by the range reader (neighbours joined, large
  tensors split, ``read_concurrency`` reads at once); small tensors that came with the
  header are copied from it. A tensor is moved to ``device`` as soon as its bytes are in,
  so a load onto a GPU holds little more than the reads in flight in host memory.

Save (:func:`save_safetensors`): the state is checked whole first (tensors only, string
names, no two tensors sharing memory), then each file is streamed through the sink
``save`` uses (``BorrowingSink``: large tensors sent from their own memory, parts
uploaded while the next fills, visible only once complete), shards one after another,
the index last: the index is the sharded checkpoint's commit marker. See
docs/safetensors.md for the overwrite rules.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .._runtime.gcpause import paused_gc
from .._runtime.memview import tensor_view
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    MissingKeyError,
    NotFoundError,
    SerializationError,
    UnsupportedFormatError,
)
from ..format.safetensors import (
    INDEX_SUFFIX,
    MAX_HEADER_SIZE,
    METADATA_KEY,
    Header,
    TensorEntry,
    dtype_of,
    encode_header,
    encode_index,
    is_safetensors_url,
    is_shard_name,
    parse_index,
    parse_shard_size,
    plan_shards,
    read_header,
    read_index,
    shard_names,
)
from ..io.progress import progress_bar
from ..io.ranges import RangeReader
from ..io.scheduler import TransferGroup, run_cleanup
from ..io.sink import BORROW_MIN, BorrowingSink
from ..options import TransferOptions
from ..store import Store, Target, join_key, object_url, open_target
from ..store.deadline import deadline_scope
from ..store.paths import read_capped
from .save import SaveResult

__all__ = ["load_safetensors", "save_safetensors"]

log = logging.getLogger("cloudckpt")

#: What a folder URL is searched for first (transformers' names).
DEFAULT_STEM = "model"
_Place = Callable[[torch.Tensor], torch.Tensor]


def _open(
    url: str | os.PathLike[str], options: TransferOptions | None, overrides: Mapping[str, Any]
) -> Target:
    """``url`` opened: a file or index URL as one object (so ``model.safetensors/`` is
    refused before anything is opened), a folder as it is."""
    if isinstance(url, (str, os.PathLike)) and is_safetensors_url(os.fspath(url).rstrip("/")):
        object_url(url)
    return open_target(url, options, **overrides)


# -- load --------------------------------------------------------------------------------


def _find(store: Store, key: str, url: str) -> str:
    """The key of the file or index that ``url`` means (a folder is searched)."""
    if is_safetensors_url(key):
        return key
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    children = {
        info.key[len(prefix) :] for info in store.list(prefix) if "/" not in info.key[len(prefix) :]
    }
    for name in (f"{DEFAULT_STEM}.safetensors", DEFAULT_STEM + INDEX_SUFFIX):
        if name in children:
            return prefix + name
    indexes = sorted(c for c in children if c.endswith(INDEX_SUFFIX))
    singles = sorted(c for c in children if c.endswith(".safetensors") and not is_shard_name(c))
    found = indexes or singles
    if len(found) == 1:
        return prefix + found[0]
    if not found:
        raise NotFoundError(
            f"no safetensors checkpoint at {url}: expected {DEFAULT_STEM}.safetensors, "
            f"an index (*{INDEX_SUFFIX}) or one *.safetensors file there"
        )
    raise ConfigError(f"{url} holds several safetensors checkpoints ({', '.join(found)}): name one")


def _read_headers(
    store: Store, options: TransferOptions, keys: Sequence[str]
) -> dict[str, tuple[Header, bytes]]:
    """The headers of ``keys``, ``read_concurrency`` files at a time."""
    if len(keys) == 1:
        return {keys[0]: read_header(store, keys[0])}
    found: dict[str, tuple[Header, bytes]] = {}
    group = TransferGroup(options, options.read_concurrency)

    def read(key: str) -> None:
        found[key] = read_header(store, key)

    try:
        for key in keys:
            group.submit(functools.partial(read, key), f"read the header of {store.url(key)}")
        group.wait()
    except BaseException:
        group.cancel()
        raise
    return {k: found[k] for k in keys}


def _wanted(
    names: Iterable[str], keys: Sequence[str] | None, prefixes: Sequence[str] | None, url: str
) -> set[str]:
    """The names selected by ``keys`` (exact) and ``prefixes``; every one must match."""
    every = set(names)
    if keys is None and prefixes is None:
        return every
    some = ", ".join(repr(n) for n in sorted(every)[:5]) + (", ..." if len(every) > 5 else "")
    missing = [k for k in keys or () if k not in every]
    if missing:
        raise MissingKeyError(f"{url} has no tensor(s) {missing}; it has {len(every)}: {some}")
    chosen = set(keys or ())
    for p in prefixes or ():
        matched = {n for n in every if n.startswith(p)}
        if not matched:
            raise MissingKeyError(
                f"{url} has no tensor named {p!r}...; it has {len(every)}: {some}"
            )
        chosen |= matched
    return chosen


def _placer(map_location: Any) -> _Place | None:
    """What moves a loaded CPU tensor where ``map_location`` says (None: stay put)."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        if device.type == "cpu":
            return None
        return lambda t: t.to(device)
    # A dict or a callable, applied as torch.load applies it to storages saved on "cpu".
    restore = torch.serialization._get_restore_location(map_location)

    def place(t: torch.Tensor) -> torch.Tensor:
        storage = restore(t.untyped_storage(), "cpu")
        if storage.device == t.device:
            return t
        moved = torch.empty(0, dtype=t.dtype, device=storage.device)
        return moved.set_(storage, 0, t.shape, t.stride())

    return place


def _empty(entry: TensorEntry, url: str) -> torch.Tensor:
    dtype = entry.dtype.torch
    if dtype is None:
        raise UnsupportedFormatError(
            f"{url}: tensor {entry.name!r} has dtype {entry.dtype.name}, which torch "
            f"{torch.__version__} has no dtype for"
        )
    try:
        tensor = torch.empty(entry.torch_shape(url), dtype=dtype)
    except RuntimeError as exc:  # e.g. an empty tensor with absurd dimensions
        raise CorruptCheckpointError(f"{url}: tensor {entry.name!r}: {exc}") from None
    if tensor.nbytes != entry.nbytes:  # pragma: no cover - the header check guarantees it
        raise CorruptCheckpointError(f"{url}: tensor {entry.name!r} has the wrong size")
    return tensor


def _deliver(
    out: dict[str, torch.Tensor], name: str, t: torch.Tensor, place: _Place | None
) -> None:
    """A tensor whose bytes are all in: native byte order, then its device."""
    if sys.byteorder == "big" and t.element_size() > 1:  # pragma: no cover - little-endian CI
        t.untyped_storage().byteswap(t.dtype)
    out[name] = place(t) if place is not None else t


def _fetch(
    store: Store,
    options: TransferOptions,
    files: Mapping[str, Iterable[str]],
    headers: Mapping[str, tuple[Header, bytes]],
    place: _Place | None,
    what: str,
) -> dict[str, torch.Tensor]:
    """Allocate every wanted tensor and read its bytes into it; names in sorted order."""
    out: dict[str, torch.Tensor] = {}
    total = sum(headers[k][0].tensors[n].nbytes for k, names in files.items() for n in names)
    with (
        progress_bar(f"load {what}", total, options.progress) as advance,
        RangeReader(store, options, stream=True, advance=advance) as reader,
    ):
        for key, names in files.items():
            header, probe = headers[key]
            url = store.url(key)
            for entry in sorted((header.tensors[n] for n in names), key=lambda e: e.begin):
                tensor = _empty(entry, url)
                view = tensor_view(tensor)  # entry.nbytes, checked by _empty
                done = functools.partial(_deliver, out, entry.name, tensor, place)
                start = header.data_start + entry.begin
                if start + entry.nbytes <= len(probe):  # it came with the header
                    view[:] = probe[start : start + entry.nbytes]
                    advance(entry.nbytes)
                    done()
                else:
                    reader.add(key, start, view, done, tensor)
        reader.run()
    return {n: out[n] for n in sorted(out)}


@paused_gc(kept=True)  # a tensor and entry per name, kept (_runtime/gcpause.py)
def load_safetensors(
    url: str | os.PathLike[str],
    *,
    keys: Sequence[str] | str | None = None,
    prefix: Sequence[str] | str | None = None,
    device: Any = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> dict[str, torch.Tensor]:
    """Read a safetensors file, a sharded checkpoint (its index) or a folder holding one.

    Returns ``{name: tensor}`` sorted by name, as ``safetensors.torch.load_file`` does.
    ``keys`` selects tensors by exact name and ``prefix`` by the start of their name
    (either a string or a list; together, their union); only the bytes (and the shards)
    they need are read, and a key or prefix that matches nothing raises
    ``MissingKeyError``. ``device`` is a device or a ``map_location`` (dict or
    callable) applied as ``torch.load`` applies it. ``overrides`` are
    :class:`~cloudckpt.TransferOptions` fields (``read_concurrency``,
    ``read_chunk_size``, ``storage_options``...). A malformed file raises
    ``CorruptCheckpointError`` before anything is allocated for it.
    """
    keys = [keys] if isinstance(keys, str) else keys
    prefixes = [prefix] if isinstance(prefix, str) else prefix
    where = _open(url, options, overrides)
    with deadline_scope(where.options.deadline):  # the whole load (store/deadline.py)
        return _load_safetensors(where, keys, prefixes, device)


def _load_safetensors(
    where: Target,
    keys: Sequence[str] | None,
    prefixes: Sequence[str] | None,
    device: Any,
) -> dict[str, torch.Tensor]:
    """:func:`load_safetensors` of a resolved URL."""
    store, opts = where.store, where.options
    key = _find(store, where.key, where.url)
    place = _placer(device)
    what = key.rsplit("/", 1)[-1]
    if key.endswith(INDEX_SUFFIX):
        index_url = store.url(key)
        assigned = read_index(store, key)
        wanted = _wanted(
            (n for names in assigned.values() for n in names), keys, prefixes, index_url
        )
        files = {k: [n for n in names if n in wanted] for k, names in assigned.items()}
        files = {k: names for k, names in files.items() if names}
        headers = _read_headers(store, opts, list(files))
        for shard, names in files.items():
            missing = [n for n in names if n not in headers[shard][0].tensors]
            if missing:
                raise CorruptCheckpointError(
                    f"{index_url} places {missing[:5]} in {store.url(shard)}, which does not "
                    "hold them"
                )
        return _fetch(store, opts, files, headers, place, what)
    headers = {key: read_header(store, key)}
    wanted = _wanted(headers[key][0].tensors, keys, prefixes, store.url(key))
    return _fetch(store, opts, {key: wanted}, headers, place, what)


# -- save --------------------------------------------------------------------------------


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a (non-empty) tensor touches: ``[lo, hi)``."""
    size = t.element_size()
    last = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    lo = int(t.storage_offset()) * size
    return lo, lo + (last + 1) * size


def _refuse_shared(tensors: Mapping[str, torch.Tensor], url: str) -> None:
    """Refuse tensors whose memory overlaps (tied weights, views of one another):
    safetensors stores each tensor once, so they would load as separate copies."""
    by_storage: dict[tuple[torch.device, int], list[str]] = defaultdict(list)
    for name, t in tensors.items():
        if t.numel():
            by_storage[(t.device, t.untyped_storage().data_ptr())].append(name)
    shared: list[list[str]] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        cluster: list[str] = []
        end = -1
        for (lo, hi), name in sorted((_span(tensors[n]), n) for n in names):
            if cluster and lo < end:
                cluster.append(name)
            else:
                if len(cluster) > 1:
                    shared.append(cluster)
                cluster = [name]
            end = max(end, hi)
        if len(cluster) > 1:
            shared.append(cluster)
    if shared:
        raise SerializationError(
            f"{url}: these tensors share memory: {shared}. A safetensors file stores each "
            "tensor once, so they would load as separate copies; keep one name of each "
            "group (tied weights are re-tied by the model), or pass .clone()s to save copies"
        )


def _checked_state(state: Any, url: str) -> dict[str, torch.Tensor]:
    """The state as ``{name: tensor}``, or a SerializationError naming what does not fit."""
    if not isinstance(state, Mapping):
        raise SerializationError(
            f"{url}: save_safetensors needs a mapping of names to tensors, not a "
            f"{type(state).__name__}"
        )
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        where = f"state[{name!r}]"
        if not isinstance(name, str):
            raise SerializationError(f"{url}: {where}: names are strings in safetensors")
        if name == METADATA_KEY:
            raise SerializationError(f"{url}: {where}: {METADATA_KEY!r} is reserved (metadata=)")
        if not isinstance(value, torch.Tensor):
            hint = (
                "flatten nested dicts into dotted names"
                if isinstance(value, Mapping)
                else "pass strings as metadata= or save other values separately"
            )
            raise SerializationError(
                f"{url}: {where} is a {type(value).__name__}, not a tensor; a safetensors "
                f"file holds tensors only: {hint}"
            )
        if value.layout != torch.strided or value.device.type == "meta":
            what = "on the meta device" if value.device.type == "meta" else f"{value.layout}"
            raise SerializationError(
                f"{url}: {where} is a {what} tensor; only dense tensors with data can be saved"
            )
        dtype_of(value.dtype, f"{url}: {where}")
        out[name] = value.detach()
    _refuse_shared(out, url)
    return out


def header_metadata(metadata: Mapping[str, str] | None, url: str) -> dict[str, str]:
    """The header's ``__metadata__``: ``format: pt`` (transformers checks it), then the
    caller's."""
    given = dict(metadata or {})
    bad = {k: v for k, v in given.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise SerializationError(f"{url}: metadata must map strings to strings; not {bad!r:.200}")
    return {"format": "pt", **given}


def _payload(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A tensor's bytes as written (CPU, contiguous, little-endian) and their owner."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if sys.byteorder == "big" and t.element_size() > 1:  # pragma: no cover - little-endian CI
        t = t.clone()
        t.untyped_storage().byteswap(t.dtype)
    return tensor_view(t), t


@contextlib.contextmanager
def streamed_file(
    store: Store,
    key: str,
    options: TransferOptions,
    header: bytes,
    size: int,
    advance: Callable[[int], None],
) -> Iterator[Callable[[torch.Tensor], None]]:
    """Stream one file to ``key``: ``header`` (from ``encode_header``), then each tensor
    the caller passes to the yielded function, in the header's order. The file is
    visible only once the block ends without error; on any failure it is aborted.

    A tensor's memory is sent from where it lies (large ones) and must not change until
    the block ends; ``size`` is the file's size, for the part plan."""
    sink = BorrowingSink(store, key, options, size_hint=size, on_progress=advance)

    def put(t: torch.Tensor) -> None:
        view, owner = _payload(t)
        if view.nbytes >= BORROW_MIN:
            sink.write_borrowed(view, owner)
        elif view.nbytes:
            sink.write(view)

    try:
        sink.write(header)
        yield put
        sink.commit()
    except BaseException as exc:
        error = sink.abort_after(exc)
        if error is exc:
            raise
        raise error from None


def _write_file(
    store: Store,
    key: str,
    options: TransferOptions,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    advance: Callable[[int], None],
) -> int:
    """Stream one file holding ``tensors`` to ``key``; returns its size."""
    specs = ((n, t.dtype, tuple(t.shape), t.nbytes) for n, t in tensors.items())
    header, order = encode_header(specs, metadata, store.url(key))
    size = len(header) + sum(t.nbytes for t in tensors.values())
    with streamed_file(store, key, options, header, size, advance) as put:
        for name in order:
            put(tensors[name])
    return size


def file_names(key: str) -> tuple[str, str]:
    """``(folder, stem)`` of a save's files: ``.../x.safetensors`` and
    ``.../x.safetensors.index.json`` give stem ``x``; a folder gives ``model``."""
    folder, _, name = key.rpartition("/")
    for suffix in (INDEX_SUFFIX, ".safetensors"):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if not stem:
                raise ConfigError(f"no file name before {suffix!r} in {key!r}")
            return folder, stem
    return key.rstrip("/"), DEFAULT_STEM


def retire_index(store: Store, index_key: str, files: Sequence[str]) -> None:
    """Delete an existing index that names a file this save will overwrite, before the
    first byte is written: no reader may combine shards of two saves."""
    try:
        raw = read_capped(store, index_key, MAX_HEADER_SIZE, what="safetensors index")
        old = set(parse_index(raw, store.url(index_key)).values())
    except NotFoundError:
        return
    except CorruptCheckpointError:  # unreadable, or too large to be one: it goes
        old = None
    if old is None or old & set(files):
        store.delete(index_key)


def remove_stale(store: Store, folder: str, stem: str, keep: set[str]) -> None:
    """After a commit: delete what an earlier save under ``stem`` left that the new
    checkpoint does not use (index first). Failures are logged: the save is committed."""
    prefix = f"{folder}/" if folder else ""
    stale = []
    for info in store.list(prefix + stem):
        name = info.key[len(prefix) :]
        if name in keep:
            continue
        if name in (f"{stem}.safetensors", stem + INDEX_SUFFIX) or is_shard_name(name, stem):
            stale.append(info.key)
    for key in sorted(stale, key=lambda k: not k.endswith(INDEX_SUFFIX)):
        try:
            store.delete(key)
        except Exception as exc:
            log.warning("could not delete %s, left by an earlier save: %s", store.url(key), exc)


@paused_gc()  # headers and shard plans of thousands of entries (_runtime/gcpause.py)
def save_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    url: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> SaveResult:
    """Write ``{name: tensor}`` as safetensors at ``url``; returns what to load back.

    ``url`` is a file (``.../model.safetensors``), an index
    (``.../model.safetensors.index.json``) or a folder (files named ``model...``).
    Without ``max_shard_size`` one file is written. With it (bytes, or ``"5GB"``,
    ``"500MiB"`` as transformers reads them), tensors are split in order into shards
    ``{stem}-00001-of-0000N.safetensors``... of at most that many bytes of data, and
    ``{stem}.safetensors.index.json`` is written last; one file when all fit.
    ``metadata`` (str -> str) goes into each file's header, after ``format: pt``. The
    result's ``url`` is the file or the index, ``size`` the bytes written in all.
    Tensors may be non-contiguous or on a GPU (written contiguously from a host copy);
    tensors sharing memory, non-tensor values and nested dicts raise
    ``SerializationError`` before anything is written.
    """
    started = time.perf_counter()
    where = _open(url, options, overrides)
    with deadline_scope(where.options.deadline):  # the whole save (store/deadline.py)
        return _save_safetensors(where, state_dict, max_shard_size, metadata, started)


def _save_safetensors(
    where: Target,
    state_dict: Mapping[str, torch.Tensor],
    max_shard_size: int | str | None,
    metadata: Mapping[str, str] | None,
    started: float,
) -> SaveResult:
    """:func:`save_safetensors` to a resolved URL."""
    store, opts = where.store, where.options
    tensors = _checked_state(state_dict, where.url)
    meta = header_metadata(metadata, where.url)
    folder, stem = file_names(where.key)
    groups = [list(tensors)]
    if max_shard_size is not None:
        limit = parse_shard_size(max_shard_size)
        groups = plan_shards([(n, t.nbytes) for n, t in tensors.items()], limit)
    files = shard_names(stem, len(groups))
    keys = [join_key(folder, f, where.url) for f in files]
    payload = sum(t.nbytes for t in tensors.values())
    index_key = join_key(folder, stem + INDEX_SUFFIX, where.url)
    with progress_bar(f"save {stem}", payload, opts.progress) as advance:
        if len(groups) == 1:
            size = _write_file(store, keys[0], opts, tensors, meta, advance)
            remove_stale(store, folder, stem, {files[0]})
            return SaveResult(store.url(keys[0]), size, time.perf_counter() - started)
        retire_index(store, index_key, files)
        written: list[str] = []
        size = 0
        try:
            for key, names in zip(keys, groups, strict=True):
                size += _write_file(store, key, opts, {n: tensors[n] for n in names}, meta, advance)
                written.append(key)
            weight_map = {n: f for f, names in zip(files, groups, strict=True) for n in names}
            index = encode_index(weight_map, payload)
            written.insert(0, index_key)  # a put that fails may still have landed
            store.put(index_key, index)
        except BaseException:
            for key in written:  # the index first, then the shards
                with contextlib.suppress(Exception):
                    run_cleanup(opts, functools.partial(store.delete, key), f"delete {key}")
            raise
        remove_stale(store, folder, stem, {*files, stem + INDEX_SUFFIX})
    return SaveResult(store.url(index_key), size + len(index), time.perf_counter() - started)
