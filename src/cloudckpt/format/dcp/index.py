"""``.cloudckpt-layout.json``: where large tensors' bytes sit, and the checksums of all reads.

:class:`CloudStorageWriter` writes it just before ``.metadata``; other readers ignore it.
Format 2 (format 1, written before checksums, has only ``save_id`` and ``archives``)::

    {
      "format": 2,
      "save_id": "4be1...",             # the save id in .metadata: a stale index is ignored
      "metadata_crc32": 1234567890,     # CRC-32 of the .metadata bytes written with it
      "archives": {                     # each tensor archive larger than 256 KiB
        "__0_0.distcp@4096": [dtype, size, stride, storage_offset, data_offset,
                              record_size, block_size, "<base64 CRC-32s>"]
      },
      "chunks": {"__0_0.distcp@0": 3735928559},  # CRC-32 of each chunk read whole
      "records": {"__0_0.distcp": [0, 448, 2882400018, ...]}, # small tensor records
      "metadata": {"v": 1, ...}         # .metadata described (format/dcp/described.py)
    }

``archives`` keys are ``relative_path@offset`` of the chunk in ``.metadata``;
``data_offset`` is where the tensor's storage record starts inside the chunk, and the
last two fields are the record's block size and the CRC-32 of each block, 4 bytes
little-endian each, base64 encoded (older 6-field entries have neither). ``chunks``
covers the chunks a reader reads whole: tensor archives up to 256 KiB and byte items.
``records`` (added in format 2; readers that predate it ignore it) places the storage
record of each small tensor archive written by cloudckpt's archive builder: per data
object, a flat list of ``offset, data_offset, crc32`` triples: the chunk's offset in
``.metadata``, where the record's bytes start inside it, and the record's zip CRC-32.
The tensor is the chunk ``.metadata`` describes (its sizes and dtype, contiguous), so a
reader reads those bytes straight into the destination and checks them, instead of
reading the archive whole and copying them out. ``metadata`` (optional in format 2;
readers that predate it ignore it) describes ``.metadata`` in JSON: a reader whose
``.metadata`` matches ``metadata_crc32`` builds the metadata from it instead of
unpickling ``.metadata`` (:func:`decode_committed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import ChecksumError, CorruptCheckpointError
from ...store.paths import MAX_INDEX_BYTES
from ..checksum import crc32
from .archive import SavedTensor, saved_from_json
from .described import build_metadata
from .layout import is_count
from .metadata import check_metadata, decode_metadata

__all__ = [
    "INDEX_FORMAT",
    "LayoutIndex",
    "decode_committed",
    "encode_index",
    "parse_index",
    "read_document",
    "save_id_of",
]

#: The format this version writes; it reads 1 and 2.
INDEX_FORMAT = 2
_READABLE = (1, 2)


@dataclass
class LayoutIndex:
    """A parsed layout index: tensor placement and checksums, keyed by (object, offset)."""

    archives: dict[tuple[str, int], SavedTensor] = field(default_factory=dict)
    chunks: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Small tensor records: (object, chunk offset) -> (data_offset, record CRC-32).
    records: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)


def encode_index(
    save_id: str,
    metadata_crc32: int,
    archives: dict[str, Any],
    chunks: dict[str, int],
    records: dict[str, list[int]] | None = None,
    metadata: dict[str, Any] | None = None,
) -> bytes:
    """The index's bytes (``archives`` values are :meth:`SavedTensor.to_json` lists,
    ``records`` values flat ``offset, data_offset, crc32`` triples, ``metadata`` the
    description of ``.metadata``, left out when it would take the index past half its
    size cap)."""
    body: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "save_id": save_id,
        "metadata_crc32": metadata_crc32,
        "archives": archives,
        "chunks": chunks,
    }
    if records:
        body["records"] = records
    if metadata is not None:
        described = json.dumps({**body, "metadata": metadata}, separators=(",", ":")).encode()
        if len(described) <= MAX_INDEX_BYTES // 2:
            return described
    return json.dumps(body, separators=(",", ":")).encode()


def read_document(payload: bytes, url: str) -> dict[str, Any]:
    """The index as a JSON object; CorruptCheckpointError when it is not one."""
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{url} is damaged ({exc}); delete it to load the checkpoint without the "
            "checksums of partial reads"
        ) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{url} is damaged: not a JSON object")
    return doc


def _where(key: Any) -> tuple[str, int] | None:
    if not isinstance(key, str):
        return None
    relative, _, offset = key.rpartition("@")
    if not relative or not offset.isascii() or not offset.isdigit() or len(offset) > 18:
        return None
    return relative, int(offset)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _crc(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def parse_index(doc: dict[str, Any], url: str) -> LayoutIndex:
    """Parse an index whose save id matched; CorruptCheckpointError for any damage.

    A damaged index is an error rather than ignored: ignoring it would quietly load
    without the checksums it holds.
    """

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{url} is damaged: {what}; delete it to load the checkpoint without the "
            "checksums of partial reads"
        )

    if doc.get("format") not in _READABLE:
        raise bad(f"format {_short(doc.get('format'))} is not one this version reads {_READABLE}")
    if "metadata_crc32" in doc and not _crc(doc["metadata_crc32"]):
        raise bad(f"metadata_crc32 is {_short(doc['metadata_crc32'])}")
    archives, chunks = doc.get("archives", {}), doc.get("chunks", {})
    if not isinstance(archives, dict) or not isinstance(chunks, dict):
        raise bad("archives or chunks is not a JSON object")
    index = LayoutIndex()
    for key, value in archives.items():
        where = _where(key)
        saved = saved_from_json(value)
        if where is None or saved is None:
            raise bad(f"archive entry {_short(key)}")
        index.archives[where] = saved
    for key, value in chunks.items():
        where = _where(key)
        if where is None or not _crc(value):
            raise bad(f"chunk entry {_short(key)}")
        index.chunks[where] = value
    records = doc.get("records", {})
    if not isinstance(records, dict):
        raise bad("records is not a JSON object")
    placed = index.records
    for relative, flat in records.items():
        if not relative or not isinstance(flat, list) or len(flat) % 3:
            raise bad(f"records of {_short(relative)}")
        triples = iter(flat)
        for offset, data_offset, crc in zip(triples, triples, triples, strict=True):
            if not (is_count(offset) and is_count(data_offset) and _crc(crc)):
                entry = _short([offset, data_offset, crc])
                raise bad(f"record entry {entry} of {_short(relative)}")
            placed[(relative, offset)] = (data_offset, crc)
    return index


def save_id_of(metadata: Any) -> str | None:
    """The id cloudckpt's writer gave the save (None for other writers)."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None


def decode_committed(
    payload: bytes, url: str, raw_index: bytes | None, index_url: str
) -> tuple[Any, LayoutIndex | None]:
    """``.metadata``'s bytes decoded (through the trust boundary), and the layout index
    beside it when it is the same save's (the save id agrees).

    An index of the same save vouches for ``.metadata`` with its CRC-32: the metadata
    is then built from the index's description of it when it has one
    (format/dcp/described.py), else decoded without the decoder's own scan. A
    ``.metadata`` that fails that CRC-32 is ChecksumError.
    """
    doc = None if raw_index is None else read_document(raw_index, index_url)
    expected = doc.get("metadata_crc32") if doc is not None else None
    vouched = type(expected) is int and expected == crc32(payload)
    metadata = None
    if vouched and doc is not None and "metadata" in doc:
        metadata = build_metadata(doc["metadata"], index_url)
        if metadata is not None:
            check_metadata(metadata, url)
            if save_id_of(metadata) != doc.get("save_id"):
                raise CorruptCheckpointError(
                    f"{index_url} is damaged: its description of .metadata names another "
                    "save; delete it to load the checkpoint from .metadata alone"
                )
    if metadata is None:
        metadata = decode_metadata(payload, url, scan=not vouched)
    save_id = save_id_of(metadata)
    if doc is None or not save_id or doc.get("save_id") != save_id:
        return metadata, None
    index = parse_index(doc, index_url)  # checks metadata_crc32 is a CRC-32
    if expected is not None and not vouched:
        raise ChecksumError(
            f"{url} fails the CRC-32 check recorded in {index_url} (stored "
            f"{expected:08x}, read {crc32(payload):08x}): the object is corrupted"
        )
    return metadata, index
