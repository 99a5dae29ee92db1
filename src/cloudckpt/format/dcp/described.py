"""DCP's ``.metadata`` described in JSON, inside the layout index: a load builds the
metadata from the description instead of unpickling ``.metadata``.

Decoding ``.metadata`` through the trust boundary's pickle machine runs each of its
opcodes in Python, about 70 per tensor: for 10,000 tensors that was a third of a DCP
load's CPU. cloudckpt's writer also describes the metadata it pickles, as plain JSON
(strings, integers, booleans, and names looked up in fixed tables), in the layout index
it writes just before ``.metadata``, beside the CRC-32 of ``.metadata``'s bytes. A
reader whose ``.metadata`` matches that CRC-32 builds the metadata from the description
(:func:`build_metadata`) and never unpickles ``.metadata``; every other case (another
writer, an older cloudckpt, a CRC-32 that does not match, a description of a version
this one does not read) decodes ``.metadata`` through the boundary as before.

Nothing a description holds can name a class or call anything: each object is one of
DCP's metadata classes, built by this module from values it checked; the metadata is
then checked field by field (``check_metadata``) as a decoded one is. A damaged
description is a :class:`~cloudckpt.errors.CorruptCheckpointError` naming the index.

The description (``"metadata"`` in the index)::

    {"v": 1, "version": "1.0.0",
     "storage_meta": [checkpoint_id, save_id, load_id, [module, ...]] or null,
     "properties": [["torch.float32", "torch.strided", false, "contiguous", false], ...],
     "shapes": [[4096, 1024], [0, 0], ...],          # each torch.Size, once
     "items": [[fqn, property, size, offsets, sizes, ...],   # a tensor and its chunks
               [fqn], ...],                                  # a bytes item
     "paths": ["__0_0.distcp", ...],
     "storage": [[fqn, offset or -1, index or null, path, offset, length,
                  transform_descriptors or null], ...] or null,
     "planner": [[fqn, key, ...], ...] or null}      # planner_data: fqn -> path tuple

Integers in ``properties``, ``items`` and ``storage`` index ``properties``, ``shapes``
and ``paths``. Equal strings and shapes are one object each in what is built, as the
writer shares them (format/dcp/sharing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError
from ..dtype_names import DTYPES
from .layout import MAX_COUNT, StorageInfo

__all__ = ["DESCRIPTION_VERSION", "build_metadata", "describe_metadata"]

#: The description's format (``"v"``); a reader builds only the versions it knows.
DESCRIPTION_VERSION = 1

_DTYPES = {f"torch.{name}": value for name, value in DTYPES.items()}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
#: The memory formats TensorProperties pickles (its __getstate__ refuses the others).
_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
}
_FORMAT_NAMES = {id(v): k for k, v in _FORMATS.items()}

_Size = torch.Size
_set = object.__setattr__
# The fields each object holds, as its class's constructor sets them: an object with
# any other (a field a newer torch added, an attribute set by hand) is not described.
_METADATA_FIELDS = frozenset(
    ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
)
_TENSOR_FIELDS = frozenset(("properties", "size", "chunks"))
_CHUNK_FIELDS = frozenset(("offsets", "sizes"))
_PROPERTY_FIELDS = frozenset(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"))
_STORAGE_META_FIELDS = frozenset(("checkpoint_id", "save_id", "load_id", "modules"))
_STORAGE_FIELDS = frozenset(StorageInfo.__dataclass_fields__)
_DESCRIPTORS = "transform_descriptors" in _STORAGE_FIELDS  # torch >= 2.7
#: This torch's metadata classes have the fields the description says (an older or
#: newer torch with others: nothing is described, and descriptions are not built).
_KNOWN_CLASSES = all(
    cls.__dataclass_fields__.keys() == names
    for cls, names in (
        (Metadata, _METADATA_FIELDS),
        (TensorStorageMetadata, _TENSOR_FIELDS),
        (ChunkStorageMetadata, _CHUNK_FIELDS),
        (TensorProperties, _PROPERTY_FIELDS),
        (StorageMeta, _STORAGE_META_FIELDS),
    )
)


class _NotDescribed(Exception):
    """The metadata holds something the description cannot say: not described."""


def _fields(obj: Any, names: frozenset[str]) -> None:
    """``obj`` holds no attribute but the fields ``names``, in any order (an unpickled
    TensorProperties sets ``memory_format`` last) and some perhaps left to the class's
    default (an unpickled ``_StorageInfo`` has no ``transform_descriptors`` when None):
    what the description says, read with ``getattr``, is then all it holds."""
    if not vars(obj).keys() <= names:
        raise _NotDescribed


def _text_or_none(value: Any) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _NotDescribed


def _count(value: Any) -> int:
    if type(value) is int and 0 <= value < MAX_COUNT:
        return value
    raise _NotDescribed


def describe_metadata(metadata: Any) -> dict[str, Any] | None:
    """The description of ``metadata`` (see the module's docstring), or None when it
    holds anything the description cannot say exactly (another class, another field,
    a value of another type): that save's readers decode ``.metadata`` instead."""
    if not _KNOWN_CLASSES:
        return None
    try:
        return _describe(metadata)
    except (_NotDescribed, AttributeError):  # AttributeError: a field missing
        return None


def _describe(metadata: Any) -> dict[str, Any]:
    if type(metadata) is not Metadata:
        raise _NotDescribed
    _fields(metadata, _METADATA_FIELDS)
    shapes: dict[Any, int] = {}  # by identity first, then by value
    shape_list: list[list[int]] = []

    def shape(value: Any) -> int:
        at = shapes.get(id(value))
        if at is not None:
            return at
        if type(value) is not _Size:
            raise _NotDescribed
        key = tuple(value)
        at = shapes.get(key)
        if at is None:
            at = shapes[key] = len(shape_list)
            shape_list.append([_count(v) for v in key])
        shapes[id(value)] = at
        return at

    properties: dict[Any, int] = {}
    property_list: list[list[Any]] = []

    def described_properties(value: Any) -> int:
        at = properties.get(id(value))
        if at is not None:
            return at
        if type(value) is not TensorProperties:
            raise _NotDescribed
        _fields(value, _PROPERTY_FIELDS)
        dtype, layout, grad = value.dtype, value.layout, value.requires_grad
        fmt, pinned = value.memory_format, value.pin_memory
        if (
            type(dtype) is not torch.dtype
            or type(layout) is not torch.layout
            or type(grad) is not bool
            or type(pinned) is not bool
            or id(fmt) not in _FORMAT_NAMES
        ):
            raise _NotDescribed
        dtype_name, layout_name = str(dtype), str(layout)
        if _DTYPES.get(dtype_name) is not dtype or _LAYOUTS.get(layout_name) is not layout:
            raise _NotDescribed
        entry = [dtype_name, layout_name, grad, _FORMAT_NAMES[id(fmt)], pinned]
        at = properties[id(value)] = len(property_list)
        property_list.append(entry)
        return at

    state = metadata.state_dict_metadata
    if type(state) is not dict:
        raise _NotDescribed
    items: list[list[Any]] = []
    for fqn, md in state.items():
        if type(fqn) is not str:
            raise _NotDescribed
        if type(md) is BytesStorageMetadata:
            _fields(md, frozenset())
            items.append([fqn])
            continue
        if type(md) is not TensorStorageMetadata or type(md.chunks) is not list:
            raise _NotDescribed
        _fields(md, _TENSOR_FIELDS)
        entry = [fqn, described_properties(md.properties), shape(md.size)]
        for chunk in md.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _NotDescribed
            _fields(chunk, _CHUNK_FIELDS)
            entry += (shape(chunk.offsets), shape(chunk.sizes))
        items.append(entry)
    paths: dict[str, int] = {}
    data = metadata.storage_data
    if data is not None and type(data) is not dict:
        raise _NotDescribed
    storage = None
    if data is not None:
        storage = [_describe_storage(i, info, shape, paths) for i, info in data.items()]
    planner = metadata.planner_data
    described_planner: list[list[Any]] | None = None
    if planner is not None:
        if type(planner) is not dict:
            raise _NotDescribed
        described_planner = []
        for fqn, path_keys in planner.items():
            if type(fqn) is not str or type(path_keys) is not tuple:
                raise _NotDescribed
            if any(type(k) is not str and type(k) is not int for k in path_keys):
                raise _NotDescribed
            described_planner.append([fqn, *path_keys])
    return {
        "v": DESCRIPTION_VERSION,
        "version": _text_or_none(metadata.version),
        "storage_meta": _describe_storage_meta(metadata.storage_meta),
        "properties": property_list,
        "shapes": shape_list,
        "items": items,
        "paths": list(paths),
        "storage": storage,
        "planner": described_planner,
    }


def _describe_storage(
    index: Any, info: Any, shape: Callable[[Any], int], paths: dict[str, int]
) -> list[Any]:
    """One ``storage_data`` entry: where an item's bytes are."""
    if type(index) is not MetadataIndex or type(info) is not StorageInfo:
        raise _NotDescribed
    _fields(info, _STORAGE_FIELDS)
    offset = getattr(index, "offset", None)
    at = index.index
    descriptors = getattr(info, "transform_descriptors", None)
    if type(index.fqn) is not str or type(info.relative_path) is not str:
        raise _NotDescribed
    if descriptors is not None and (
        type(descriptors) is not list or any(type(d) is not str for d in descriptors)
    ):
        raise _NotDescribed
    return [
        index.fqn,
        -1 if offset is None else shape(offset),
        None if at is None else _count(at),
        paths.setdefault(info.relative_path, len(paths)),
        _count(info.offset),
        _count(info.length),
        descriptors,
    ]


def _describe_storage_meta(meta: Any) -> list[Any] | None:
    if meta is None:
        return None
    if type(meta) is not StorageMeta:
        raise _NotDescribed
    _fields(meta, _STORAGE_META_FIELDS)
    modules = meta.modules
    if type(modules) is not list or any(type(m) is not str for m in modules):
        raise _NotDescribed
    return [
        _text_or_none(meta.checkpoint_id),
        _text_or_none(meta.save_id),
        _text_or_none(meta.load_id),
        list(modules),
    ]


class _Damaged(Exception):
    """A value of the description that is not what it must be."""


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise _Damaged("a list expected")
    return value


def _int(value: Any, limit: int = MAX_COUNT) -> int:
    if type(value) is not int or not 0 <= value < limit:
        raise _Damaged(f"{value!r:.40} is not a count below {limit}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Damaged(f"{value!r:.40} is not a boolean")
    return value


def _optional_text(value: Any) -> str | None:
    if value is not None and type(value) is not str:
        raise _Damaged(f"{value!r:.40} is not a string")
    return value


def _named(table: dict[str, Any], value: Any, what: str) -> Any:
    found = table.get(value) if type(value) is str else None
    if found is None:
        raise _Damaged(f"{value!r:.40} is not a {what}")
    return found


def build_metadata(doc: Any, index_url: str) -> Metadata | None:
    """The metadata a description says, built from checked values; None when ``doc``
    is a description of a version this one does not read (or this torch's metadata
    classes have other fields). A damaged description is CorruptCheckpointError naming
    ``index_url``."""
    if not _KNOWN_CLASSES or type(doc) is not dict:
        return None
    version = doc.get("v")
    if type(version) is not int or version != DESCRIPTION_VERSION:
        return None
    try:
        return _build(doc)
    except (_Damaged, TypeError, ValueError, IndexError, KeyError) as exc:
        raise CorruptCheckpointError(
            f"{index_url} is damaged: its description of .metadata ({exc}); delete it to "
            "load the checkpoint from .metadata alone"
        ) from None


def _build(doc: dict[str, Any]) -> Metadata:
    strings: dict[str, str] = {}
    text: Callable[[Any], str] = lambda value: strings.setdefault(value, value)  # noqa: E731

    def fqn_of(value: Any) -> str:
        if type(value) is not str:
            raise _Damaged(f"{value!r:.40} is not a name")
        return text(value)

    shapes = [_Size([_int(v) for v in _list(s)]) for s in _list(doc["shapes"])]
    properties = []
    for entry in _list(doc["properties"]):
        dtype, layout, grad, fmt, pinned = _list(entry)
        properties.append(
            TensorProperties(
                dtype=_named(_DTYPES, dtype, "dtype"),
                layout=_named(_LAYOUTS, layout, "layout"),
                requires_grad=_bool(grad),
                memory_format=_named(_FORMATS, fmt, "memory format"),
                pin_memory=_bool(pinned),
            )
        )
    n_shapes, n_properties = len(shapes), len(properties)
    state: dict[str, Any] = {}
    for entry in _list(doc["items"]):
        entry = _list(entry)
        fqn = fqn_of(entry[0])
        if len(entry) == 1:
            state[fqn] = BytesStorageMetadata()
            continue
        if len(entry) < 3 or len(entry) % 2 == 0:
            raise _Damaged(f"the entry of {fqn!r:.60} has {len(entry)} values")
        chunks = [
            ChunkStorageMetadata(
                offsets=shapes[_int(entry[at], n_shapes)],
                sizes=shapes[_int(entry[at + 1], n_shapes)],
            )
            for at in range(3, len(entry), 2)
        ]
        state[fqn] = TensorStorageMetadata(
            properties=properties[_int(entry[1], n_properties)],
            size=shapes[_int(entry[2], n_shapes)],
            chunks=chunks,
        )
    paths = [fqn_of(p) for p in _list(doc["paths"])]
    entries = doc["storage"]
    storage: dict[MetadataIndex, Any] | None = None if entries is None else {}
    for entry in [] if entries is None else _list(entries):
        fqn, offset, at, path, start, length, descriptors = _list(entry)
        index = MetadataIndex(fqn_of(fqn), None, None if at is None else _int(at))
        if offset != -1:
            _set(index, "offset", shapes[_int(offset, n_shapes)])
        where = (paths[_int(path, len(paths))], _int(start), _int(length))
        if descriptors is not None:
            if not _DESCRIPTORS:
                raise _Damaged("transform descriptors, which this torch has no field for")
            descriptors = [fqn_of(d) for d in _list(descriptors)]
        info = StorageInfo(*where, descriptors) if _DESCRIPTORS else StorageInfo(*where)
        storage[index] = info  # type: ignore[index]  # a dict whenever there are entries
    planner: dict[str, tuple[str | int, ...]] | None = None
    if doc["planner"] is not None:
        planner = {}
        for entry in _list(doc["planner"]):
            fqn, *keys = _list(entry)
            for key in keys:
                if type(key) is not str and type(key) is not int:
                    raise _Damaged(f"{key!r:.40} is not a name or an index")
            planner[fqn_of(fqn)] = tuple(text(k) if type(k) is str else k for k in keys)
    meta = doc["storage_meta"]
    storage_meta = None
    if meta is not None:
        checkpoint_id, save_id, load_id, modules = _list(meta)
        storage_meta = StorageMeta(
            checkpoint_id=_optional_text(checkpoint_id),
            save_id=_optional_text(save_id),
            load_id=_optional_text(load_id),
            modules=[fqn_of(m) for m in _list(modules)],
        )
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=storage_meta,
        version=_optional_text(doc["version"]),
    )
