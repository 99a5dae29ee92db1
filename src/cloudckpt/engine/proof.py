"""Whether an object found at a destination holds the bytes of its source: proven, never
assumed from its size or its age.

A copy that resumes (``cp -r`` run again, a local tier's drain after a crash) finds
objects already at the destination. Keeping one is only right when its bytes are the
source's; the same size proves nothing (two saves of one step, the same shapes, other
values). An object is kept when one of these holds, else it is sent again:

* both stores are of one kind and report the same ETag (a content hash, or the
  store's own identity of one write);
* one side reports an S3-style MD5 ETag (a single-part upload's MD5, or a multipart
  upload's MD5 of its parts' MD5s with their count) and the other side is the
  filesystem: the local file is hashed the same way and compared
  (:func:`matches_etag`; a multipart ETag is tried with each whole-MiB part size that
  gives its number of parts, at most :data:`MAX_PART_SIZES` of them);
* both sides are the filesystem: their bytes are compared.

The stores' ETags (store/*.py): S3 reports the MD5 of a single-part upload and the
MD5 of part MD5s for a multipart one; the memory store a CRC-32; GCS and Azure an
opaque identity of one write, which proves nothing across two writes, so an object
there is kept only by the copy's own record of it (the local tier's drain journal,
manager/tiers.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from ..options import MiB
from ..store import ObjectInfo, Store
from ..store.local import LocalStore

__all__ = [
    "MAX_PART_SIZES",
    "matches_etag",
    "md5_etag",
    "multipart_etag",
    "proven_same",
    "replaced",
    "same_bytes",
]

_MD5 = re.compile(r"([0-9a-f]{32})(?:-([1-9][0-9]{0,4}))?")
#: Most part sizes one multipart ETag is tried with (each costs one MD5 of the bytes).
MAX_PART_SIZES = 4
#: Bytes read at a time to hash or compare a file.
_CHUNK = 8 * MiB


def _parse(etag: str | None) -> tuple[str, int] | None:
    """(hex digest, number of parts: 0 for a single-part upload) of an S3-style MD5 ETag."""
    m = _MD5.fullmatch((etag or "").strip('"').lower())
    if m is None:
        return None
    return m.group(1), int(m.group(2) or 0)


def _part_sizes(size: int, parts: int) -> list[int]:
    """The whole-MiB part sizes that split ``size`` bytes into ``parts`` parts, those a
    writer most likely chose first (powers of two and multiples of 5 MiB, then the
    smallest), at most :data:`MAX_PART_SIZES`."""
    if parts == 1:
        return [max(size, 1)]
    low = -(-size // parts)  # every part size p with ceil(size / p) == parts
    high = -(-size // (parts - 1)) - 1
    first, last = -(-low // MiB), high // MiB
    if last < first:
        return []
    found = range(first, last + 1)

    def rank(mib: int) -> tuple[int, int]:
        liked = mib & (mib - 1) == 0 or mib % 5 == 0
        return (0 if liked else 1, mib)

    return [mib * MiB for mib in sorted(found, key=rank)[:MAX_PART_SIZES]]


class _Parts:
    """The MD5 of each ``size``-byte part of a stream, fed in any pieces."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.digests: list[bytes] = []
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._filled = 0

    def feed(self, view: memoryview) -> None:
        while view.nbytes:
            take = min(view.nbytes, self.size - self._filled)
            self._md5.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.size:
                self.digests.append(self._md5.digest())
                self._md5 = hashlib.md5(usedforsecurity=False)
                self._filled = 0

    def etag(self) -> tuple[str, int]:
        digests = self.digests + ([self._md5.digest()] if self._filled else [])
        return hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest(), len(digests)


def _chunks(size: int) -> list[tuple[int, int]]:
    """(start, length) of each piece of ``size`` bytes read at a time."""
    return [(start, min(_CHUNK, size - start)) for start in range(0, size, _CHUNK)]


def md5_etag(etag: str | None) -> bool:
    """Whether ``etag`` is an S3-style MD5 ETag (:func:`matches_etag` can check bytes
    against it), not an opaque identity of one write."""
    return _parse(etag) is not None


def multipart_etag(etag: str | None) -> bool:
    """Whether ``etag`` has the form of an S3 multipart upload's (``<md5>-<parts>``)."""
    parsed = _parse(etag)
    return parsed is not None and parsed[1] > 0


def replaced(made: str | None, listed: str | None) -> bool:
    """Whether the object a listing shows (ETag ``listed``) is not the one an upload
    made (``made``, the ETag the store answered it with): both known, of one form, and
    different. A store may answer an upload with one form and list another (rclone
    lists a multipart object's MD5): ETags of two forms prove nothing either way."""
    a, b = (made or "").strip('"'), (listed or "").strip('"')
    return bool(a and b and a != b and multipart_etag(a) == multipart_etag(b))


def matches_etag(
    store: Store, key: str, size: int, etag: str | None, prefer: Sequence[int] = ()
) -> bool:
    """Whether the ``size`` bytes of ``key`` in ``store`` hash to the S3-style MD5 ETag
    ``etag`` (False when it is not one, or no part size tried gives it). A multipart
    ETag is tried with the part sizes in ``prefer`` first (the one cloudckpt's own
    upload of the object chose: ``io/sink.choose_part_size``), then whole-MiB ones."""
    parsed = _parse(etag)
    if parsed is None:
        return False
    digest, parts = parsed
    if parts == 0:
        whole = hashlib.md5(usedforsecurity=False)
        for start, n in _chunks(size):
            whole.update(store.get_range(key, start, start + n))
        return whole.hexdigest() == digest
    fitting = [p for p in prefer if p > 0 and -(-size // p) == parts]
    tries = [_Parts(p) for p in dict.fromkeys([*fitting, *_part_sizes(size, parts)])]
    if not tries:
        return False
    for start, n in _chunks(size):
        view = memoryview(store.get_range(key, start, start + n))
        for t in tries:
            t.feed(view)
    return any(t.etag() == (digest, parts) for t in tries)


def same_bytes(a: Store, a_key: str, b: Store, b_key: str, size: int) -> bool:
    """Whether two objects of ``size`` bytes hold the same bytes (both read, in chunks)."""
    return all(
        a.get_range(a_key, start, start + n) == b.get_range(b_key, start, start + n)
        for start, n in _chunks(size)
    )


def proven_same(src: Store, s: ObjectInfo, dst: Store, d: ObjectInfo) -> bool:
    """Whether the destination's object ``d`` is proven to hold the bytes of the
    source's ``s`` (the rules of this module's docstring); False when it cannot be."""
    if s.size != d.size:
        return False
    a, b = (s.etag or "").strip('"'), (d.etag or "").strip('"')
    if a and b and type(src) is type(dst) and a == b:
        return True
    if isinstance(src, LocalStore) and isinstance(dst, LocalStore):
        return same_bytes(src, s.key, dst, d.key, s.size)
    if isinstance(src, LocalStore) and b:
        return matches_etag(src, s.key, s.size, b)
    if isinstance(dst, LocalStore) and a:
        return matches_etag(dst, d.key, d.size, a)
    return False
