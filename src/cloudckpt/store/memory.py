"""An in-memory store (``memory://bucket/key``): the contract without a server.

For unit tests and examples: objects live in this process's memory, per bucket name,
for as long as the process runs (:func:`clear` forgets them). It behaves as a strict
object store: conditional puts are enforced, multipart parts stay invisible until the
upload completes, every part but the last must be at least 5 MiB, and a ranged read
past the end of an object is refused. It passes the same contract suite as every real
backend (tests/stores/test_contract.py).
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import AlreadyExistsError, CorruptCheckpointError, NotFoundError, StorageError
from .base import MultipartUpload, ObjectInfo, Page, Store, UploadedPart

__all__ = ["MemoryStore", "clear"]

_MIN_PART = 5 * 1024 * 1024
_PAGE = 1000  # keys per listing page, as S3 answers


@dataclass
class _Bucket:
    objects: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    uploads: dict[str, tuple[str, float, dict[int, bytes]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _etag(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}-{len(data)}"


_buckets: dict[str, _Bucket] = {}
_buckets_lock = threading.Lock()


def clear(bucket: str | None = None) -> None:
    """Forget one bucket's objects (or every bucket's)."""
    with _buckets_lock:
        if bucket is None:
            _buckets.clear()
        else:
            _buckets.pop(bucket, None)


class MemoryStore(Store):
    """One bucket of objects held in this process's memory."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.root_url = f"memory://{bucket}"
        with _buckets_lock:
            self._data = _buckets.setdefault(bucket, _Bucket())

    def _object(self, key: str) -> tuple[bytes, float]:
        found = self._data.objects.get(key)
        if found is None:
            raise NotFoundError(f"no such object: {self.url(key)}")
        return found

    def _head(self, key: str) -> ObjectInfo:
        data, mtime = self._object(key)
        return ObjectInfo(key=key, size=len(data), mtime=mtime, etag=_etag(data))

    def _get(self, key: str) -> bytes:
        return self._object(key)[0]

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        data = self._object(key)[0]
        end = start + sum(b.nbytes for b in buffers)
        if end > len(data):
            raise CorruptCheckpointError(
                f"{self.url(key)} ends at byte {len(data)}, before the range being read"
            )
        pos = start
        for buf in buffers:
            buf[:] = data[pos : pos + buf.nbytes]
            pos += buf.nbytes

    def _list_page(self, prefix: str, token: object) -> Page:
        with self._data.lock:
            keys = sorted(k for k in self._data.objects if k.startswith(prefix))
        if isinstance(token, str):
            keys = [k for k in keys if k > token]
        page = keys[:_PAGE]
        items = []
        for key in page:
            found = self._data.objects.get(key)
            if found is not None:
                data, mtime = found
                items.append(ObjectInfo(key=key, size=len(data), mtime=mtime, etag=_etag(data)))
        return items, (page[-1] if len(keys) > _PAGE else None)

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> str | None:
        value = bytes(data)
        with self._data.lock:
            if if_none_match and key in self._data.objects:
                raise AlreadyExistsError(f"{self.url(key)} already exists")
            self._data.objects[key] = (value, time.time())
        return _etag(value)

    def _delete(self, key: str) -> None:
        with self._data.lock:
            self._data.objects.pop(key, None)

    def _create_multipart(self, key: str) -> MultipartUpload:
        upload_id = uuid.uuid4().hex
        now = time.time()
        with self._data.lock:
            self._data.uploads[upload_id] = (key, now, {})
        return MultipartUpload(key=key, upload_id=upload_id, initiated=now)

    def _parts_of(self, upload: MultipartUpload) -> dict[int, bytes]:
        found = self._data.uploads.get(upload.upload_id)
        if found is None:
            raise NotFoundError(f"no such multipart upload: {self.url(upload.key)}")
        return found[2]

    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart:
        value = bytes(data)
        with self._data.lock:
            self._parts_of(upload)[number] = value
        return UploadedPart(number=number, etag=f"{number}-{len(value)}", size=len(value))

    def _complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        with self._data.lock:
            stored = self._parts_of(upload)
            chunks = []
            for i, part in enumerate(parts):
                value = stored.get(part.number)
                if value is None or len(value) != part.size:
                    raise StorageError(
                        f"complete {self.url(upload.key)}: part {part.number} was not stored"
                    )
                if i < len(parts) - 1 and len(value) < _MIN_PART:
                    raise StorageError(
                        f"complete {self.url(upload.key)}: part {part.number} is smaller "
                        "than 5 MiB and not the last"
                    )
                chunks.append(value)
            made = b"".join(chunks)
            self._data.objects[upload.key] = (made, time.time())
            del self._data.uploads[upload.upload_id]
        return _etag(made)

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        with self._data.lock:
            self._data.uploads.pop(upload.upload_id, None)

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        with self._data.lock:
            uploads = sorted(self._data.uploads.items(), key=lambda kv: (kv[1][0], kv[0]))
        for upload_id, (key, initiated, _parts) in uploads:
            if key.startswith(prefix):
                yield MultipartUpload(key=key, upload_id=upload_id, initiated=initiated)
