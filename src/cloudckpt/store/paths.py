"""File-system verbs on store keys, written once: is it an object, a prefix, neither;
what lies one level below a prefix; the bytes of a small document, capped
(:func:`read_capped`).

An object store has no directories: a "directory" is a prefix ``key/`` that other keys
start with (on the filesystem store, also a real directory, which is never an object).
``load``, the Lightning and NeMo file systems and ``cloudckpt ls`` / ``rm`` ask these
questions here rather than each with a HEAD and a listing of its own. Deleting a whole
tree needs concurrent requests, so it lives above this layer
(``cloudckpt.engine.remove.remove_checkpoint``, over ``cloudckpt.io.bulk.delete_keys``).
"""

from __future__ import annotations

from itertools import islice
from typing import Literal, NamedTuple

from ..errors import (
    BucketNotFoundError,
    CorruptCheckpointError,
    NotAnObjectError,
    NotAPrefixError,
    NotFoundError,
)
from .base import ObjectInfo, Store

__all__ = [
    "MAX_INDEX_BYTES",
    "MAX_RECORD_BYTES",
    "Children",
    "Entry",
    "Kind",
    "check_prefix",
    "children",
    "classify",
    "dir_prefix",
    "exists",
    "head_object",
    "is_prefix",
    "read_capped",
]

#: The most bytes a small JSON document cloudckpt reads from a store may have: the
#: manager's ``_CHECKPOINT.json``, a tier's ``_TIER.json``, drain records and journals,
#: megatron's ``metadata.json``. A marker lists each file of its checkpoint in about
#: 150 bytes (16 MiB: 100,000 files); the others hold a few hundred bytes.
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: The most bytes of an index: DCP's ``.cloudckpt-layout.json`` (an entry of about 30
#: to 60 bytes per chunk, and 4 bytes per block of a large tensor's checksums: millions
#: of chunks fit). A safetensors index keeps the safetensors header bound
#: (``format/safetensors.MAX_HEADER_SIZE``, 100 MB): it names the same tensors.
MAX_INDEX_BYTES = 256 * 1024 * 1024

#: What a key names: one object, a prefix other objects start with, or nothing.
Kind = Literal["object", "prefix", "missing"]

#: Objects counted under a prefix for a message (one listing page on every store).
_COUNT_LIMIT = 1000


class Entry(NamedTuple):
    """What :func:`classify` found: the kind, and the object's info when it is one."""

    kind: Kind
    info: ObjectInfo | None = None


class Children(NamedTuple):
    """What lies one level under a key (:func:`children`)."""

    #: Each next path part that has objects under it, with all of them (any depth).
    dirs: dict[str, list[ObjectInfo]]
    #: Each object directly under the key, by name.
    files: dict[str, ObjectInfo]


def dir_prefix(key: str) -> str:
    """The prefix of the keys under ``key`` as a directory: ``key/``; "" for the root."""
    key = key.strip("/")
    return key + "/" if key else ""


def _bucket_missing(store: Store, key: str) -> BucketNotFoundError:
    return BucketNotFoundError(f"bucket does not exist: {store.root_url} (for {store.url(key)})")


def _object(store: Store, key: str) -> ObjectInfo | None:
    """The object at ``key``, or None (the root and a filesystem directory are none)."""
    if not key.strip("/"):
        return None
    try:
        return store.head(key)
    except BucketNotFoundError:
        raise _bucket_missing(store, key) from None
    except (NotFoundError, NotAnObjectError):
        return None


def _first_under(store: Store, key: str) -> ObjectInfo | None:
    """One object under ``key/`` (the first page of one listing), or None."""
    try:
        return next(iter(store.list(dir_prefix(key))), None)
    except BucketNotFoundError:
        raise _bucket_missing(store, key) from None


def _count_under(store: Store, key: str) -> str:
    """How many objects lie under ``key/``, in words ("3 objects", "1000 or more")."""
    try:
        n = sum(1 for _ in islice(store.list(dir_prefix(key)), _COUNT_LIMIT))
    except BucketNotFoundError:
        raise _bucket_missing(store, key) from None
    more = " or more" if n == _COUNT_LIMIT else ""
    return f"{n}{more} object{'' if n == 1 else 's'}"


def head_object(store: Store, key: str) -> ObjectInfo:
    """``Store.head``, with errors that say a bucket is missing or a URL is a prefix.

    A URL naming a directory, or a prefix with objects under it and none at the key,
    raises NotAnObjectError saying how many objects it holds and how to load the
    checkpoints such prefixes hold; a URL naming nothing raises NotFoundError.
    """
    try:
        return store.head(key)
    except BucketNotFoundError:
        raise _bucket_missing(store, key) from None
    except NotAnObjectError:  # a directory on the filesystem store
        kind = "directory"
    except NotFoundError:
        if _first_under(store, key) is None:
            raise
        kind = "prefix"
    url = store.url(key)
    raise NotAnObjectError(
        f"{url} is a {kind} with {_count_under(store, key)} under it, not an object: "
        "name one object under it; to load a DCP checkpoint use "
        f"torch.distributed.checkpoint.load(state, storage_reader=CloudStorageReader({url!r})) "
        f"(cloudckpt.dcp); a manager run: CheckpointManager({url!r}).restore()"
    ) from None


def read_capped(
    store: Store, key: str, max_bytes: int, *, size: int | None = None, what: str = "document"
) -> bytes:
    """The bytes of the small object ``key``, refused without reading them when it holds
    more than ``max_bytes``: CorruptCheckpointError naming its URL, its size and the cap.

    One HEAD for the size (``size``, from a listing, spares it), then one ranged read of
    exactly that many bytes: an object replaced meanwhile by a larger one still costs no
    more than the cap. NotFoundError (BucketNotFoundError) as ``Store.get`` raises it.
    Every JSON document cloudckpt reads from a store comes through here.
    """
    if size is None:
        size = store.head(key).size
    if size > max_bytes:
        raise CorruptCheckpointError(
            f"{store.url(key)} holds {size} bytes, more than the {max_bytes} bytes a {what} "
            "may have: refused without reading it (not one cloudckpt wrote)"
        )
    return store.get_range(key, 0, size) if size else b""


def check_prefix(store: Store, key: str, what: str) -> None:
    """Raise NotAPrefixError when ``key`` names one object: for a caller that expects a
    prefix (``what``, e.g. "a CheckpointManager root") and found nothing under
    ``key/``, so that it says why instead of "nothing there" (one HEAD)."""
    if _object(store, key) is not None:
        raise NotAPrefixError(
            f"{store.url(key)} is an object, not a prefix: {what} is a prefix (a folder) "
            "holding objects; load one object with cloudckpt.load"
        )


def exists(store: Store, key: str) -> bool:
    """Whether an object lies at ``key`` (one HEAD); a prefix or directory is not one.

    A missing bucket raises BucketNotFoundError: the URL or the credentials are wrong,
    which is not an answer.
    """
    return _object(store, key) is not None


def is_prefix(store: Store, key: str) -> bool:
    """Whether any object lies under ``key/`` (one listing request)."""
    return _first_under(store, key) is not None


def classify(store: Store, key: str) -> Entry:
    """What ``key`` names, with at most one HEAD and one listing request; an object
    wins over a prefix of the same name."""
    info = _object(store, key)
    if info is not None:
        return Entry("object", info)
    return Entry("prefix") if is_prefix(store, key) else Entry("missing")


def children(store: Store, key: str) -> Children:
    """What lies one level under ``key``, from one listing of everything under it."""
    prefix = dir_prefix(key)
    dirs: dict[str, list[ObjectInfo]] = {}
    files: dict[str, ObjectInfo] = {}
    try:
        for obj in store.list(prefix):
            name, slash, _ = obj.key[len(prefix) :].partition("/")
            if slash:
                dirs.setdefault(name, []).append(obj)
            else:
                files[name] = obj
    except BucketNotFoundError:
        raise _bucket_missing(store, key) from None
    return Children(dirs, files)
