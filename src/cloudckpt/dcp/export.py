"""A DCP checkpoint as consolidated safetensors: :func:`export_safetensors` (``cloudckpt export``).

A checkpoint written by any number of ranks (by :class:`CloudStorageWriter`, torch's
``FileSystemWriter`` or megatron-core's ``torch_dist``) becomes the Hugging Face layout:
``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``, or one
``model.safetensors``. Each tensor is assembled whole from the chunks the ranks wrote
(resharding is DCP's own load planner), optionally cast and renamed, and written through
the streamed safetensors writer (``engine/safetensors.py``), from any store to any store.

How it bounds memory: the tensors of a shard are read in batches of ``batch_size`` bytes
(one ``dcp.load`` each, through one :class:`CloudStorageReader` whose ``.metadata`` is
read once), and each batch is handed to the shard's multipart upload from its own memory
as soon as it is in, so the next batch is read while the last one uploads. What is held
is one batch being read plus the parts in flight (``write_concurrency * part_size``, or
``max_bytes_in_flight``), whatever the size of the model or of a shard.

How it commits and restarts: each file is one atomic upload, the index is written last
(the sharded export's commit marker), and an index left by an earlier, different export
is deleted before the first shard is written, as ``save_safetensors`` does. Every header
and the index carry a fingerprint of the source (its ``.metadata``: save id, size, ETag,
time); a rerun of the same export finds each file already there whose size and header
are exactly the planned ones and keeps it (``reused``), so an export that stopped
resumes at the first file it had not finished. Shards of a failed export are left for
that rerun; without the index they are not a checkpoint.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._runtime.gcpause import paused_gc
from ..engine.safetensors import (
    file_names,
    header_metadata,
    remove_stale,
    retire_index,
    streamed_file,
)
from ..errors import ConfigError, CorruptCheckpointError, MissingKeyError, NotFoundError
from ..format.dcp.index import save_id_of
from ..format.dcp.layout import metadata_name
from ..format.dtype_names import dtype_named
from ..format.safetensors import (
    INDEX_SUFFIX,
    encode_header,
    encode_index,
    parse_shard_size,
    plan_shards,
    shard_names,
)
from ..io.progress import progress_bar
from ..options import MiB, TransferOptions
from ..store import Settings, Store, join_key, open_target
from ..store.paths import read_capped
from .reader import CloudStorageReader, MetadataOnceReader

__all__ = ["SOURCE_KEY", "ExportResult", "export_safetensors", "parse_dtype"]

log = logging.getLogger("cloudckpt")

#: The header and index field holding the source's fingerprint.
SOURCE_KEY = "cloudckpt_export_source"
DEFAULT_SHARD_SIZE = "5GB"
DEFAULT_BATCH_SIZE = 256 * MiB

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}

Rename = Mapping[str, str] | Callable[[str], "str | None"]


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    #: The index (sharded) or the one file: what ``cloudckpt.load_safetensors`` takes.
    url: str
    #: Every file of the export, index last.
    files: tuple[str, ...]
    #: Tensors written.
    tensors: int
    #: Bytes of all files.
    size: int
    #: Files a previous run of the same export had completed, kept as they were.
    reused: tuple[str, ...]
    #: The checkpoint's non-tensor entries (safetensors holds tensors only).
    skipped: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class _Tensor:
    source: str  # the DCP name
    name: str  # the safetensors name
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A floating-point dtype from ``torch.bfloat16``, ``"bf16"``, ``"torch.float16"``..."""
    if isinstance(value, torch.dtype):
        dtype: torch.dtype | None = value
    else:
        text = str(value).strip().lower().removeprefix("torch.")
        dtype = _DTYPES.get(text) or dtype_named(text)
    if dtype is None or not dtype.is_floating_point:
        raise ConfigError(
            f"dtype={value!r} is not a floating-point dtype (e.g. bfloat16, float16, float32)"
        )
    return dtype


def _patterns(value: str | Sequence[str] | None, what: str) -> list[str]:
    if value is None:
        return []
    found = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(p, str) and p for p in found):
        raise ConfigError(f"{what} must be name patterns (non-empty strings), not {value!r}")
    return found


def _renamer(rename: Rename | None) -> Callable[[str], str | None]:
    """``rename`` as a function: a mapping replaces the longest matching name prefix."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
        raise ConfigError(f"rename must map name prefixes to replacements, not {rename!r}")
    prefixes = sorted(rename, key=len, reverse=True)

    def by_prefix(name: str) -> str:
        for prefix in prefixes:
            if name.startswith(prefix):
                return rename[prefix] + name[len(prefix) :]
        return name

    return by_prefix


def _select(
    metadata: Metadata,
    include: list[str],
    exclude: list[str],
    rename: Callable[[str], str | None],
    dtype: torch.dtype | None,
    url: str,
) -> tuple[list[_Tensor], list[str]]:
    """The tensors to write (in the checkpoint's order) and the non-tensor names skipped."""
    tensors: list[_Tensor] = []
    skipped: list[str] = []
    matched: set[str] = set()
    by_name: dict[str, str] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        if include:
            hits = [p for p in include if fnmatch.fnmatchcase(fqn, p)]
            if not hits:
                continue
            matched.update(hits)
        if any(fnmatch.fnmatchcase(fqn, p) for p in exclude):
            continue
        name = rename(fqn)
        if name is None:
            continue
        if not isinstance(name, str) or not name:
            raise ConfigError(f"rename gave {name!r} for {fqn!r}; names must be non-empty strings")
        if name in by_name:
            raise ConfigError(
                f"{url}: {by_name[name]!r} and {fqn!r} would both be written as {name!r}"
            )
        by_name[name] = fqn
        saved = md.properties.dtype
        out = dtype if dtype is not None and saved.is_floating_point else saved
        tensors.append(_Tensor(fqn, name, out, tuple(md.size)))
    missing = [p for p in include if p not in matched]
    if missing:
        raise MissingKeyError(f"{url}: no tensor matches {missing} (include=)")
    if not tensors:
        raise MissingKeyError(f"{url}: nothing to export: no tensor is selected")
    return tensors, skipped


def _fingerprint(reader: CloudStorageReader, metadata: Metadata) -> str:
    """What identifies the source checkpoint's save: every save rewrites ``.metadata``."""
    info = reader.location.store.head(reader.location.key(metadata_name(None)))
    text = f"{save_id_of(metadata)}|{info.size}|{info.etag}|{info.mtime}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _batches(order: list[str], plan: Mapping[str, _Tensor], limit: int) -> Iterator[list[str]]:
    """``order`` cut into runs of at most ``limit`` bytes (a larger tensor alone)."""
    batch: list[str] = []
    size = 0
    for name in order:
        n = plan[name].nbytes
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += n
    if batch:
        yield batch


def _load(reader: CloudStorageReader, state: dict[str, torch.Tensor]) -> None:
    """Fill ``state`` (DCP names -> destinations) in this process alone, whether or not a
    process group exists (an export from a training rank takes no collective)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=reader,
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )


def _complete(store: Store, key: str, header: bytes, size: int) -> bool:
    """Whether ``key`` is this export's file already: its size and header exactly."""
    try:
        info = store.head(key)
    except NotFoundError:
        return False
    return info.size == size and store.get_range(key, 0, len(header)) == header


@paused_gc()  # DCP's planners and the headers: a few objects per item (_runtime/gcpause.py)
def export_safetensors(
    source: str | os.PathLike[str],
    url: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    rename: Rename | None = None,
    max_shard_size: int | str | None = DEFAULT_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    resume: bool = True,
    options: TransferOptions | None = None,
    source_options: TransferOptions | None = None,
    **overrides: Any,
) -> ExportResult:
    """Write the tensors of the DCP checkpoint at ``source`` as safetensors at ``url``.

    ``url`` is a folder (files named ``model...``), a ``.safetensors`` file or an
    ``.safetensors.index.json`` (as for :func:`cloudckpt.save_safetensors`); shards hold
    at most ``max_shard_size`` bytes (``"5GB"`` by default, transformers' default;
    ``None``: one file). ``include``/``exclude`` are glob patterns on the checkpoint's
    names (``"model.*"``); an ``include`` pattern that matches no tensor is
    ``MissingKeyError``. ``rename`` maps name prefixes to replacements (``{"model.":
    ""}``, the longest prefix wins) or is a function returning the new name or ``None``
    to drop the tensor. ``dtype`` casts floating-point tensors (integer and bool ones
    keep theirs). ``options`` applies to the destination, ``source_options`` (default:
    ``options``) to the source; keyword overrides to both. With ``resume`` a rerun keeps
    the files an earlier run of the same export completed.
    """
    started = time.perf_counter()
    cast = parse_dtype(dtype) if dtype is not None else None
    batch = parse_shard_size(batch_size)
    # Settings given for both sides apply to each as to the command line's URLs: a
    # local path takes none of the object stores' storage options.
    shared = Settings(options, overrides)
    if source_options is None:
        reader = MetadataOnceReader(shared.resolve(source))
    else:
        reader = MetadataOnceReader(source, options=source_options, **overrides)
    checkpoint = reader.read_metadata()
    where = open_target(shared.resolve(url))
    store, opts = where.store, where.options
    plan_list, skipped = _select(
        checkpoint,
        _patterns(include, "include"),
        _patterns(exclude, "exclude"),
        _renamer(rename),
        cast,
        reader.url,
    )
    plan = {t.name: t for t in plan_list}
    fingerprint = _fingerprint(reader, checkpoint)
    meta = header_metadata({**(metadata or {}), SOURCE_KEY: fingerprint}, where.url)
    groups = [list(plan)]
    if max_shard_size is not None:
        groups = plan_shards(
            [(t.name, t.nbytes) for t in plan_list], parse_shard_size(max_shard_size)
        )
    folder, stem = file_names(where.key)
    files = shard_names(stem, len(groups))
    keys = [join_key(folder, f, where.url) for f in files]
    headers = [
        encode_header(
            ((n, plan[n].dtype, plan[n].shape, plan[n].nbytes) for n in names), meta, store.url(k)
        )
        for names, k in zip(groups, keys, strict=True)
    ]
    sizes = [len(h) + sum(plan[n].nbytes for n in order) for h, order in headers]
    payload = sum(t.nbytes for t in plan_list)
    index_key = join_key(folder, stem + INDEX_SUFFIX, where.url)
    index = b""
    if len(groups) > 1:
        weight_map = {n: f for f, names in zip(files, groups, strict=True) for n in names}
        index = encode_index(weight_map, payload, {SOURCE_KEY: fingerprint})
        try:  # ours has exactly len(index) bytes: a larger one is not read
            kept = resume and read_capped(store, index_key, len(index)) == index
        except (NotFoundError, CorruptCheckpointError):
            kept = False
        if not kept:
            retire_index(store, index_key, files)
    reused: list[str] = []
    log.info(
        "export %s -> %s: %d tensors in %d file(s)", reader.url, where.url, len(plan), len(files)
    )
    with progress_bar(f"export {stem}", sum(sizes), opts.progress) as advance:
        for key, (header, order), size in zip(keys, headers, sizes, strict=True):
            if resume and _complete(store, key, header, size):
                reused.append(store.url(key))
                advance(size)
                continue
            with streamed_file(store, key, opts, header, size, advance) as put:
                for names in _batches(order, plan, batch):
                    got = {n: torch.empty(plan[n].shape, dtype=plan[n].dtype) for n in names}
                    _load(reader, {plan[n].source: t for n, t in got.items()})
                    for n in names:
                        put(got[n])
        written = [store.url(k) for k in keys]
        if index:
            store.put(index_key, index)
            written.append(store.url(index_key))
            remove_stale(store, folder, stem, {*files, stem + INDEX_SUFFIX})
        else:
            remove_stale(store, folder, stem, {files[0]})
    return ExportResult(
        url=written[-1],
        files=tuple(written),
        tensors=len(plan),
        size=sum(sizes) + len(index),
        reused=tuple(reused),
        skipped=tuple(skipped),
        seconds=time.perf_counter() - started,
    )
