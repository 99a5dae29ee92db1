"""``cloudckpt cp``: copy one object between any two stores, resumable after a failure.

Every copy is store to store (a local path is the filesystem store):

* To the filesystem, chunks are written into ``DST.cloudckpt-partial`` at their offsets
  and a journal beside it (``DST.cloudckpt-partial.json``) records the chunks that are
  on disk (fsynced before being recorded). A rerun of the same copy skips them; the
  file is renamed into place when complete.
* To an object store, an object over one part goes up as a multipart upload and a
  journal in the state directory records its upload id and finished parts. A rerun
  finds the upload still open (``list_multipart``) and sends only the missing parts.

A journal is only reused when the source's size and ETag (or mtime) are unchanged.
Abandoned uploads are aborted by ``cloudckpt gc`` or by the bucket's lifecycle rules.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.ranges import split
from ..engine.scheduler import TransferGroup
from ..engine.sink import ObjectSink, choose_part_size
from ..errors import NotFoundError
from ..options import TransferOptions
from ..store import MultipartUpload, ObjectInfo, Store, UploadedPart
from ..store.local import LocalStore

__all__ = ["CopyResult", "copy_object", "default_state_dir"]

PARTIAL_SUFFIX = ".cloudckpt-partial"


@dataclass(frozen=True)
class CopyResult:
    src: str
    dst: str
    size: int
    seconds: float
    #: Bytes a previous, interrupted run had already copied (0 for a fresh copy).
    resumed_bytes: int


def default_state_dir() -> Path:
    """Where upload journals live: ``$CLOUDCKPT_STATE_DIR`` or ``~/.cache/cloudckpt/cp``."""
    env = os.environ.get("CLOUDCKPT_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cloudckpt" / "cp"


def _datasync(fd: int) -> None:
    """Make written chunk bytes durable before the journal says they are there."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _identity(info: ObjectInfo) -> str:
    return f"{info.size}:{info.etag or ''}:{info.mtime or ''}"


def _write_json(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            body = json.load(f)
        return body if isinstance(body, dict) else None
    except (OSError, ValueError):
        return None


def copy_object(
    src: Store,
    src_key: str,
    dst: Store,
    dst_key: str,
    options: TransferOptions,
    *,
    state_dir: Path | None = None,
    advance: Callable[[int], None] = lambda n: None,
    on_size: Callable[[int], None] = lambda n: None,
) -> CopyResult:
    """Copy ``src_key`` to ``dst_key``, continuing an interrupted copy of the same source."""
    started = time.perf_counter()
    src_url = src.url(src_key)
    info = src.head(src_key)
    on_size(info.size)
    if isinstance(dst, LocalStore):
        resumed = _download(src, info, dst, dst_key, options, advance)
    else:
        resumed = _upload(src, info, dst, dst_key, options, state_dir, advance)
    return CopyResult(
        src=src_url,
        dst=dst.url(dst_key),
        size=info.size,
        seconds=time.perf_counter() - started,
        resumed_bytes=resumed,
    )


# -- to the filesystem ---------------------------------------------------------------------


def _download(
    src: Store,
    info: ObjectInfo,
    dst: LocalStore,
    dst_key: str,
    options: TransferOptions,
    advance: Callable[[int], None],
) -> int:
    path = dst.root / dst_key
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    journal_path = path.with_name(path.name + PARTIAL_SUFFIX + ".json")
    chunk = options.read_chunk_size
    pieces = split(0, info.size, chunk)  # the journal records them by index
    identity = _identity(info)
    journal = _read_json(journal_path)
    done: set[int] = set()
    if (
        journal is not None
        and journal.get("identity") == identity
        and journal.get("chunk") == chunk
        and partial.exists()
    ):
        done = {int(i) for i in journal.get("done", [])}
    else:
        partial.unlink(missing_ok=True)
    resumed = sum(pieces[i][1] for i in done if i < len(pieces))
    advance(resumed)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    lock = threading.Lock()
    try:
        os.ftruncate(fd, info.size)

        def fetch(i: int) -> None:
            start, n = pieces[i]
            buf = bytearray(n)
            src.read_into(info.key, start, [memoryview(buf)])
            view = memoryview(buf)
            written = 0
            while written < n:
                written += os.pwrite(fd, view[written:], start + written)
            _datasync(fd)
            with lock:
                done.add(i)
                _write_json(
                    journal_path,
                    {
                        "source": src.url(info.key),
                        "identity": identity,
                        "chunk": chunk,
                        "done": sorted(done),
                    },
                )
            advance(n)

        group = TransferGroup(options, options.read_concurrency)
        for i in range(len(pieces)):
            if i not in done:
                group.submit(functools.partial(fetch, i), f"read {src.url(info.key)} #{i}")
        try:
            group.wait()
        except BaseException:
            group.cancel()
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    journal_path.unlink(missing_ok=True)
    return resumed


# -- to an object store --------------------------------------------------------------------


def _upload(
    src: Store,
    info: ObjectInfo,
    dst: Store,
    dst_key: str,
    options: TransferOptions,
    state_dir: Path | None,
    advance: Callable[[int], None],
) -> int:
    """Copy to an object store through the sink ``save`` uses (its part size, buffers,
    byte budget and commit), each part read from the source in the thread that uploads
    it. A journal records the open upload and its stored parts, so an interrupted copy
    continues where it stopped."""
    dst_url = dst.url(dst_key)
    # The rule save uses (engine/sink.py), so a profile's part_size means the same here.
    part_size = choose_part_size(info.size, options.part_size, options.write_concurrency)
    if info.size <= part_size:
        data = src.get_range(info.key, 0, info.size) if info.size else b""
        dst.put(dst_key, data)
        advance(info.size)
        return 0

    state_dir = state_dir or default_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(f"{src.url(info.key)}\n{dst_url}".encode()).hexdigest()[:32]
    journal_path = state_dir / f"upload-{tag}.json"
    identity = _identity(info)
    journal = _read_json(journal_path)
    upload: MultipartUpload | None = None
    parts: dict[int, UploadedPart] = {}
    if (
        journal is not None
        and journal.get("identity") == identity
        and journal.get("part_size") == part_size
    ):
        open_ids = {u.upload_id for u in dst.list_multipart(dst_key) if u.key == dst_key}
        if journal.get("upload_id") in open_ids:
            upload = MultipartUpload(key=dst_key, upload_id=str(journal["upload_id"]))
            parts = {
                int(n): UploadedPart(int(n), str(etag), int(size))
                for n, (etag, size) in journal.get("parts", {}).items()
            }
    if upload is None:
        upload = dst.create_multipart(dst_key)
        parts = {}
    opened = upload
    resumed = sum(p.size for p in parts.values())
    advance(resumed)
    lock = threading.Lock()

    def save_journal(part: UploadedPart | None = None) -> None:
        with lock:
            if part is not None:
                parts[part.number] = part
            _write_json(
                journal_path,
                {
                    "source": src.url(info.key),
                    "destination": dst_url,
                    "identity": identity,
                    "part_size": part_size,
                    "upload_id": opened.upload_id,
                    "parts": {str(p.number): [p.etag, p.size] for p in parts.values()},
                },
            )

    save_journal()
    sink = ObjectSink(
        dst,
        dst_key,
        options,
        size_hint=info.size,
        on_progress=advance,
        upload=upload,
        on_part=save_journal,
    )
    if sink.part_size != part_size:  # pragma: no cover - the same rule, the same hint
        raise AssertionError(f"part size {sink.part_size} != {part_size}")
    stored = dict(parts)
    try:
        for number, (start, n) in enumerate(split(0, info.size, part_size), 1):
            done = stored.get(number)
            if done is not None and done.size == n:
                sink.adopt_part(done)
                continue

            def fill(view: memoryview, start: int = start) -> None:
                src.read_into(info.key, start, [view])

            sink.add_part(n, fill)
        sink.commit()
    except NotFoundError:
        sink.abort()
        journal_path.unlink(missing_ok=True)  # the upload vanished; start over next time
        raise
    except BaseException:
        sink.abort(keep_upload=True)  # the journal and the open upload stay for the next run
        raise
    with contextlib.suppress(OSError):
        journal_path.unlink()
    return resumed
