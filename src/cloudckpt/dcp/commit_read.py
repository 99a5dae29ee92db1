"""Reading what commits a DCP checkpoint: ``.metadata`` and the layout index beside it.

The coordinator writes the layout index (format/dcp/index.py) just before ``.metadata``
(the commit marker, written and read by format/commit.py) and puts the CRC-32 of
``.metadata``'s bytes in it. :func:`read_commit` reads both at once; the index is used
only when it belongs to the same save (its save id is the one in ``.metadata``) and its
CRC-32 matches, so a stale index left by an earlier save is ignored and a damaged
``.metadata`` is refused. :func:`adopt` refuses an index that describes bytes
``.metadata`` does not name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import BucketNotFoundError, CorruptCheckpointError, NotFoundError
from ..format.commit import read_committed
from ..format.dcp.index import LayoutIndex, decode_committed, read_document, save_id_of
from ..format.dcp.layout import layout_name, metadata_name
from ..io.scheduler import TransferGroup
from ..store.paths import MAX_INDEX_BYTES, check_prefix, read_capped
from .location import CheckpointLocation

__all__ = ["adopt", "layout_document", "read_commit"]


def _layout_payload(location: CheckpointLocation, rank: int | None) -> bytes | None:
    """The layout index's bytes beside ``metadata_name(rank)``; None when absent. One
    over :data:`~cloudckpt.store.paths.MAX_INDEX_BYTES` is CorruptCheckpointError,
    refused from its size."""
    try:
        key = location.key(layout_name(rank))
        return read_capped(location.store, key, MAX_INDEX_BYTES, what="layout index")
    except BucketNotFoundError:
        raise
    except NotFoundError:
        return None


def layout_document(location: CheckpointLocation, rank: int | None) -> dict[str, Any] | None:
    """The layout index as a JSON object; None when absent."""
    payload = _layout_payload(location, rank)
    return None if payload is None else read_document(payload, location.url_of(layout_name(rank)))


def read_commit(
    location: CheckpointLocation, rank: int | None
) -> tuple[Metadata, tuple[str, LayoutIndex] | None]:
    """``.metadata`` (checked against the layout index written with it), and that index
    with its save id when it is the same save's.

    A checkpoint without ``.metadata`` is not loadable: NotFoundError saying so.
    """
    name = metadata_name(rank)
    url = location.url_of(name)
    store, key = location.store, location.key(name)
    group = TransferGroup(location.options, 2)
    # .metadata is a pickle sized by the checkpoint's chunks: no JSON cap (format/commit.py).
    marker = group.submit(lambda: read_committed(store, key, max_bytes=None), f"read {url}")
    layout = group.submit(lambda: _layout_payload(location, rank), f"read layout of {url}")
    group.wait()
    payload, raw = marker.result(), layout.result()
    if payload is None:
        check_prefix(store, location.root_key, "a DCP checkpoint")  # an object's URL
        raise NotFoundError(
            f"no committed checkpoint at {location.url}: {url} does not exist (a save that "
            "did not finish leaves none)"
        )
    metadata, index = decode_committed(payload, url, raw, location.url_of(layout_name(rank)))
    save_id = save_id_of(metadata)
    return metadata, None if index is None or save_id is None else (save_id, index)


def adopt(index: LayoutIndex, storage_data: Mapping[Any, Any], layout_url: str) -> LayoutIndex:
    """The index, once every chunk it names is one ``.metadata`` has (else damaged)."""
    chunks = {(info.relative_path, info.offset) for info in storage_data.values()}
    for where in (*index.archives, *index.chunks, *index.records):
        if where not in chunks:
            raise CorruptCheckpointError(
                f"{layout_url} is damaged: it describes bytes {where[1]}+ of {where[0]}, "
                "where .metadata has no item; delete it to load the checkpoint without the "
                "checksums of partial reads"
            )
    return index
