"""The commit protocol: data first, the marker last, created once.

A checkpoint is committed when its marker exists: DCP's ``.metadata``, the manager's
``step-N/_CHECKPOINT.json``, Megatron's ``metadata.json``. Every writer keeps one order:

1. every data object is written and durable first (a put, or a completed multipart
   upload, appears whole or not at all);
2. then the marker, by :func:`commit_marker`: a create-only put (``if_none_match``), so
   a save never replaces the marker of another save that wrote the same prefix;
3. readers decide "is it committed?" from the marker alone (:func:`read_committed`): a
   prefix without one is not a checkpoint, however many bytes it holds. Deleting a
   checkpoint removes its marker first.

A retried write: the store retries a put whose answer was lost (a reset connection, a
timeout). When the lost attempt had landed, the retry finds the marker in place and the
create-only put fails with AlreadyExistsError. :func:`commit_marker` then reads the
marker back: the same bytes are this save's own earlier attempt, and the commit
succeeded; other bytes are another save's marker, and AlreadyExistsError names its URL.
Markers hold something of their own save (DCP's save id, the manager's commit time),
so two saves never write the same bytes; Megatron's ``metadata.json`` is the same for
every save, so its writer deletes an old one before writing any data.

A marker is read with a size cap (:func:`read_committed`, ``store/paths.read_capped``):
one larger than :data:`~cloudckpt.store.paths.MAX_RECORD_BYTES` (16 MiB) is refused
as CorruptCheckpointError from its size alone, never read whole. DCP's ``.metadata``, a
pickle whose size follows the checkpoint's number of chunks, is read without one
(``max_bytes=None``).
"""

from __future__ import annotations

from ..errors import AlreadyExistsError, BucketNotFoundError, CorruptCheckpointError, NotFoundError
from ..store import Store
from ..store.paths import MAX_RECORD_BYTES, read_capped

__all__ = [
    "COMMIT_MARKERS",
    "DCP_MARKER",
    "MANAGER_MARKER",
    "MEGATRON_MARKER",
    "SAFETENSORS_INDEX_SUFFIX",
    "commit_marker",
    "read_committed",
]

#: DCP's ``.metadata`` (one per checkpoint prefix; ``__R.metadata`` per rank).
DCP_MARKER = ".metadata"
#: A sharded safetensors checkpoint's index, ``<stem>.safetensors.index.json``, written
#: after its shards.
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
#: Megatron-core's backend record, ``metadata.json``.
MEGATRON_MARKER = "metadata.json"
#: The manager's ``step-N/_CHECKPOINT.json``, which commits whatever the step holds.
MANAGER_MARKER = "_CHECKPOINT.json"
#: Every marker name (the index as its suffix), in the order a copy of a checkpoint
#: writes them, after every other object: the manager's commits all the others.
COMMIT_MARKERS = (DCP_MARKER, SAFETENSORS_INDEX_SUFFIX, MEGATRON_MARKER, MANAGER_MARKER)


def commit_marker(store: Store, key: str, payload: bytes) -> None:
    """Commit by creating the marker ``key`` holding ``payload`` (call it after every
    data object is durable). Raises AlreadyExistsError naming the marker's URL when it
    already holds other bytes; the same bytes (this call's own retried write) succeed."""
    try:
        store.put(key, payload, if_none_match=True)
    except AlreadyExistsError:
        try:  # ours has exactly len(payload) bytes: a larger one is not read
            found = read_committed(store, key, max_bytes=len(payload))
        except CorruptCheckpointError:
            found = None
        if found == bytes(payload):
            return  # an earlier attempt of this put landed before its answer was lost
        raise AlreadyExistsError(
            f"another save committed {store.url(key)} while this one was writing; the "
            "data objects under the same prefix may be mixed, save again to a new URL"
        ) from None


def read_committed(
    store: Store, key: str, *, max_bytes: int | None = MAX_RECORD_BYTES
) -> bytes | None:
    """The marker's bytes, or None when there is none (the checkpoint is not
    committed). A missing bucket is an error (BucketNotFoundError), not "no marker".
    One larger than ``max_bytes`` is CorruptCheckpointError naming its URL and the cap,
    found from its size without reading it (``store/paths.read_capped``); ``None``: no
    cap, one GET (DCP's ``.metadata``)."""
    try:
        if max_bytes is None:
            return store.get(key)
        return read_capped(store, key, max_bytes, what="commit marker")
    except BucketNotFoundError:
        raise
    except NotFoundError:
        return None
