"""Local or shared filesystem backend: temp file + fsync + rename, like an object store.

A multipart upload is a hidden temp file beside the target (``.NAME.cloudckpt-ID.part``)
that parts are written into at their offsets; completing it fsyncs the file, renames
it into place and fsyncs the directory, so a reader sees the whole object or none.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CorruptCheckpointError,
    NotAnObjectError,
    NotAPrefixError,
    NotFoundError,
    StorageError,
)
from .base import (
    MultipartUpload,
    ObjectInfo,
    Page,
    Store,
    UploadedPart,
    byte_view,
    check_key,
)

__all__ = ["LocalStore"]

_TMP_MARK = ".cloudckpt-"
#: Most buffers one preadv call takes (the kernel refuses more with EINVAL).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_TMP_SUFFIX = ".part"


class LocalStore(Store):
    """Objects are files under ``root``; keys are paths relative to it."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root).resolve()
        self.root_url = "file://" + str(self.root).rstrip("/") + "/"
        self._fds_lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.root_url + key

    def _path(self, key: str) -> Path:
        check_key(key, self.root_url)
        return self.root / key

    def _oserror(self, exc: OSError, key: str) -> Exception:
        url = self.url(key)
        if exc.errno == errno.ENOENT:
            return NotFoundError(f"no such object: {url}")
        if exc.errno == errno.ENOTDIR:  # as an object store answers: no object there
            return NotFoundError(f"no such object: {url} (a part of its path is a file)")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return AccessDeniedError(f"permission denied: {url} ({exc.strerror})")
        if exc.errno == errno.EISDIR:
            return NotAnObjectError(f"{url} is a directory, not a checkpoint object")
        return StorageError(f"filesystem error on {url}: {exc.strerror or exc}")

    # -- reads ---------------------------------------------------------------------------
    def _head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as exc:
            raise self._oserror(exc, key) from None
        if path.is_dir():
            raise NotAnObjectError(f"{self.url(key)} is a directory, not a checkpoint object")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def _open_read(self, key: str) -> int:
        """A read-only descriptor of ``key``'s file (NotFoundError and the like)."""
        try:
            return os.open(self._path(key), os.O_RDONLY)
        except OSError as exc:
            raise self._oserror(exc, key) from None

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        fd = self._open_read(key)
        try:
            pending = [byte_view(b) for b in buffers if b.nbytes]
            first = 0  # pending[first:] still needs filling
            offset = start
            while first < len(pending):
                n = os.preadv(fd, pending[first : first + _IOV_MAX], offset)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{self.url(key)} ends at byte {offset}, before the range being read"
                    )
                offset += n
                while first < len(pending) and n >= len(pending[first]):
                    n -= len(pending[first])
                    first += 1
                if n:
                    pending[first] = pending[first][n:]
        except OSError as exc:
            raise self._oserror(exc, key) from None
        finally:
            os.close(fd)

    def map_private(self, key: str) -> mmap.mmap:
        """``key``'s file mapped copy-on-write: reads share the file's pages, writes
        through the mapping stay in this process and never reach the file. For loads
        that build tensors over a local file instead of reading it (``mmap=True``)."""
        fd = self._open_read(key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAnObjectError(f"{self.url(key)} is not a file")
            size = st.st_size
            if size == 0:
                raise CorruptCheckpointError(f"{self.url(key)} is empty")
            return mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError as exc:
            raise self._oserror(exc, key) from None
        finally:
            os.close(fd)

    def _list_page(self, prefix: str, token: object) -> Page:
        """The whole listing is one page."""
        # Walk only the directory the prefix lives in, not the whole root.
        base_dir = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base_dir.is_dir():
            return [], None
        found: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(base_dir):
            for name in files:
                if _TMP_MARK in name and name.endswith(_TMP_SUFFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        st = full.stat()
                        found.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime))
        return sorted(found, key=lambda o: o.key), None

    # -- writes --------------------------------------------------------------------------
    def _temp_for(self, path: Path) -> Path:
        return path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex}{_TMP_SUFFIX}")

    def _publish(self, tmp: Path, path: Path, key: str, if_none_match: bool) -> None:
        """Move a fully written, fsynced temp file into place and fsync the directory."""
        try:
            if if_none_match:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    raise AlreadyExistsError(f"{self.url(key)} already exists") from None
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                if path.is_dir():
                    raise NotAnObjectError(
                        f"{self.url(key)} is a directory, not an object: name the object, "
                        f"e.g. {self.url(key)}/model.pt"
                    )
                os.replace(tmp, path)
            _fsync_dir(path.parent)
        except (AlreadyExistsError, NotAnObjectError):
            tmp.unlink(missing_ok=True)
            raise
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._oserror(exc, key) from None

    def _make_parents(self, path: Path, key: str) -> None:
        """The directories above ``path``; one of them being a file is NotAPrefixError
        (an object store would take the key, a filesystem cannot)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise NotAPrefixError(
                f"cannot write {self.url(key)}: a part of its path is a file, not a directory"
            ) from None
        except OSError as exc:
            raise self._oserror(exc, key) from None

    def _open_temp(self, tmp: Path, path: Path, key: str) -> int:
        """Create ``tmp`` (exclusive) for writing, with the directories above it; made
        again if a delete removed them in between (:meth:`remove_prefix_dir`)."""
        for attempt in range(3):
            self._make_parents(path, key)
            try:
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError as exc:
                if attempt == 2:
                    raise self._oserror(exc, key) from None
            except OSError as exc:
                raise self._oserror(exc, key) from None
        raise AssertionError("unreachable")

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> None:
        path = self._path(key)
        tmp = self._temp_for(path)
        fd = self._open_temp(tmp, path, key)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._oserror(exc, key) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._publish(tmp, path, key, if_none_match)

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._oserror(exc, key) from None

    def remove_prefix_dir(self, prefix: str) -> None:
        """Remove the directory of ``prefix`` (a key prefix ending in ``/``) if it is
        empty, and nothing above it: after a checkpoint's objects are deleted, so a
        prefix exists only while objects do, as in a bucket (retention would otherwise
        leave one empty ``step-N/`` per deleted step). A writer that loses the directory
        to this makes it again (:meth:`_open_temp`)."""
        directory = self._path(prefix.rstrip("/"))
        if directory == self.root:
            return
        try:
            directory.rmdir()
        except OSError:  # not empty, gone, or not a directory: nothing to do
            return

    # -- multipart -----------------------------------------------------------------------
    def _create_multipart(self, key: str) -> MultipartUpload:
        path = self._path(key)
        tmp = self._temp_for(path)
        fd = self._open_temp(tmp, path, key)
        return MultipartUpload(key=key, upload_id=tmp.name, backend=[fd, tmp])

    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart:
        return self._write_part(upload, number, [data], offset)

    def _upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """Each view written in place at its offset in the upload's file (no copy)."""
        return self._write_part(upload, number, views, offset)

    def _write_part(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        fd = upload.backend[0]
        pos = offset
        try:
            for data in views:
                view = byte_view(data)
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], pos + written)
                pos += len(view)
        except OSError as exc:
            raise self._oserror(exc, upload.key) from None
        return UploadedPart(number=number, etag=str(number), size=pos - offset)

    def _complete_multipart(self, upload: MultipartUpload, parts: Sequence[UploadedPart]) -> None:
        fd, tmp = upload.backend
        expected = sum(p.size for p in parts)
        try:
            os.ftruncate(fd, expected)
            os.fsync(fd)
        except OSError as exc:
            self._abort_multipart(upload)
            raise self._oserror(exc, upload.key) from None
        self._close_fd(upload)
        self._publish(tmp, self._path(upload.key), upload.key, if_none_match=False)

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        if upload.backend is not None:
            self._close_fd(upload)
            Path(upload.backend[1]).unlink(missing_ok=True)
        else:  # found by list_multipart
            (self.root / upload.key).parent.joinpath(upload.upload_id).unlink(missing_ok=True)

    def _close_fd(self, upload: MultipartUpload) -> None:
        with self._fds_lock:
            fd = upload.backend[0]
            if fd is not None:
                upload.backend[0] = None
                os.close(fd)

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        base_dir = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base_dir.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base_dir):
            for name in files:
                if not (name.startswith(".") and _TMP_MARK in name and name.endswith(_TMP_SUFFIX)):
                    continue
                target = name[1 : name.index(_TMP_MARK)]
                key = (Path(dirpath) / target).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        mtime = (Path(dirpath) / name).stat().st_mtime
                        yield MultipartUpload(key=key, upload_id=name, initiated=mtime)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; some filesystems refuse fsync on directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
