"""Local or shared filesystem backend: temp file + fsync + rename, like an object store.

A multipart upload is a hidden temp file beside the target (``.NAME.cloudckpt-ID.part``)
that parts are written into at their offsets; completing it fsyncs the file, renames
it into place and fsyncs the directory, so a reader sees the whole object or none.

Every temp file is locked by its writer (``flock(LOCK_EX)`` on the descriptor it writes
through, from its creation until it is renamed into place or removed): a process that
dies, even by ``kill -9``, releases the lock with its descriptors. So whether a temp file
still has a writer is one non-blocking ``flock`` away, on this host and across processes:
:meth:`LocalStore.sweep_temps` removes those whose lock it can take (their writer is
gone) and never one held by a live process (docs/tiers.md, "Leftovers of a crash").

No write goes through a symbolic link inside the root (docs/security.md, "Links and
sizes"): every directory between the root and a file written, made or removed is opened
component by component with ``O_DIRECTORY | O_NOFOLLOW`` relative to the one above it
(:func:`open_dir`), the temp file is made with ``O_EXCL | O_NOFOLLOW`` in the directory so
opened, and the rename, link or unlink is made relative to it; a link met on the way is
refused (:class:`~cloudckpt.errors.UnsafePathError`, naming the path and the link). The
root itself is followed as the filesystem resolves it: the caller named it. The object's
own name being a link is never followed either: a rename replaces the link, an unlink
removes it. Reads follow links (a store's root may hold links a user made on purpose).

The filesystem store of ``file://`` URLs and plain paths (``LocalStore("/",
checked_below=None)``, store/registry.py) takes every directory of a key as the user
named it; :meth:`LocalStore.checked` gives the same store checking every directory
below a prefix, for a copy into a directory the user named (``cp -r``).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
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
    CloudCkptError,
    CorruptCheckpointError,
    NoSpaceError,
    NotAnObjectError,
    NotAPrefixError,
    NotFoundError,
    StorageError,
    UnsafePathError,
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

__all__ = ["TMP_MARK", "TMP_SUFFIX", "LocalStore", "open_dir", "refuse_link"]

#: A writer's temp file is ``.NAME`` + this + an id + :data:`TMP_SUFFIX` (what sweeps find).
TMP_MARK = ".cloudckpt-"
#: Most buffers one preadv call takes (the kernel refuses more with EINVAL).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
TMP_SUFFIX = ".part"
#: A directory opened as the filesystem resolves it (a root the caller named) ...
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: ... and one inside it: never a symbolic link.
_DIR_NOFOLLOW = _DIR | os.O_NOFOLLOW
#: A new temp file: exclusive, never through a link.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: A temp file opened to try its writer's lock: never through a link, never blocking.
_PROBE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class LocalStore(Store):
    """Objects are files under ``root``; keys are paths relative to it.

    ``checked_below``: the key prefix below which every directory a write goes through
    is opened without following a symbolic link (UnsafePathError when one is a link).
    ``""`` (the default): every directory under ``root``, which itself is resolved
    (a link named as the root is followed). ``None``: none, for the store of
    ``file://`` URLs, whose keys are whole paths a user names (:meth:`checked` gives a
    copy checking below a prefix). A key outside ``checked_below`` is checked from
    ``root``.
    """

    def __init__(
        self, root: str | os.PathLike[str] = "/", *, checked_below: str | None = ""
    ) -> None:
        self.root = Path(root).resolve()
        self.root_url = "file://" + str(self.root).rstrip("/") + "/"
        self._fds_lock = threading.Lock()
        self.checked_below = None if checked_below is None else _dir_parts(checked_below)

    def checked(self, prefix: str) -> LocalStore:
        """This store writing nothing through a link below the key prefix ``prefix``
        (its own directories are followed: the user named them): for a copy into a
        directory named by path (``cp -r``'s destination). A store that checks already
        (from its root, or another prefix) is returned as it is."""
        if self.checked_below is not None:
            return self
        clone = copy.copy(self)
        clone.checked_below = _dir_parts(prefix)
        return clone

    def make_dirs(self, prefix: str) -> Path:
        """Make the directory of the key prefix ``prefix`` (``a/b/``) and those above it,
        none through a link (UnsafePathError naming it): for a writer that fills it by
        path afterwards (a save addressed by URL). Returns its path."""
        key = prefix.strip("/")
        parts = key.split("/") if key else []
        if key:
            check_key(key, self.root_url)
        try:
            os.close(self._open_dir(parts, create=True))
        except (FileExistsError, NotADirectoryError):
            raise NotAPrefixError(
                f"cannot make {self.url(key)}: a part of its path is a file, not a directory"
            ) from None
        except OSError as exc:
            raise self._oserror(exc, key) from None
        return self.root.joinpath(*parts)

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
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return NoSpaceError(f"no space left for {url}: {exc.strerror or exc}")
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
                if TMP_MARK in name and name.endswith(TMP_SUFFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        st = full.stat()
                        found.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime))
        return sorted(found, key=lambda o: o.key), None

    # -- writes --------------------------------------------------------------------------
    def _open_dir(self, dirs: Sequence[str], *, create: bool) -> int:
        """A descriptor of the directory ``root/dirs...``: the part under
        :attr:`checked_below` followed, every directory below it opened without
        following a link (:func:`open_dir`)."""
        below = self.checked_below
        if below is None:
            trusted: Sequence[str] = dirs
        elif list(dirs[: len(below)]) == below:
            trusted = below
        else:
            trusted = ()
        return open_dir(self.root.joinpath(*trusted), dirs[len(trusted) :], create=create)

    def open_parent(self, key: str, *, create: bool) -> tuple[int, str]:
        """A descriptor of the directory ``key``'s file lies in (made, with those above
        it, if ``create``), never reached through a link below the checked prefix; and
        the file's name, for writes relative to it (``dir_fd``). The caller closes the
        descriptor. Errors are typed for ``key``: a link is UnsafePathError; a file in
        the path NotAPrefixError when writing, NotFoundError otherwise."""
        check_key(key, self.root_url)
        *dirs, name = key.split("/")
        try:
            return self._open_dir(dirs, create=create), name
        except (FileExistsError, NotADirectoryError) as exc:
            if not create:
                raise self._oserror(exc, key) from None
            raise NotAPrefixError(
                f"cannot write {self.url(key)}: a part of its path is a file, not a directory"
            ) from None
        except OSError as exc:
            raise self._oserror(exc, key) from None

    def _create_temp(self, key: str) -> tuple[int, str, int]:
        """A new temp file beside ``key``'s (``O_EXCL | O_NOFOLLOW``): the descriptor of
        its directory, its name, and its own descriptor. Made again when a delete removed
        the directory in between (:meth:`remove_prefix_dir`)."""
        for attempt in range(3):
            dfd, name = self.open_parent(key, create=True)
            tmp = f".{name}{TMP_MARK}{uuid.uuid4().hex}{TMP_SUFFIX}"
            try:
                fd = os.open(tmp, _CREATE, 0o644, dir_fd=dfd)
            except OSError as exc:
                os.close(dfd)
                if isinstance(exc, FileNotFoundError) and attempt < 2:
                    continue  # the directory went away since it was opened: make it again
                raise self._oserror(exc, key) from None
            if _hold(fd):
                return dfd, tmp, fd
            # A sweep took it between its creation and our lock (it holds no writer yet).
            os.close(fd)
            os.close(dfd)
        raise StorageError(f"cannot make a temp file for {self.url(key)}: removed three times")

    def _publish(self, dfd: int, tmp: str, key: str, if_none_match: bool) -> None:
        """Move a fully written, fsynced temp file of the directory ``dfd`` into place
        (a link in its place is replaced, not followed) and fsync the directory."""
        name = key.rpartition("/")[2]
        try:
            if if_none_match:
                try:
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # create-if-absent
                except FileExistsError:
                    raise AlreadyExistsError(f"{self.url(key)} already exists") from None
                finally:
                    _unlink_quietly(dfd, tmp)
            else:
                if _is_dir(dfd, name):
                    raise NotAnObjectError(
                        f"{self.url(key)} is a directory, not an object: name the object, "
                        f"e.g. {self.url(key)}/model.pt"
                    )
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
                os.fsync(dfd)
        except (AlreadyExistsError, NotAnObjectError):
            _unlink_quietly(dfd, tmp)
            raise
        except OSError as exc:
            _unlink_quietly(dfd, tmp)
            raise self._oserror(exc, key) from None

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> None:
        dfd, tmp, fd = self._create_temp(key)
        try:
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(data)
                    f.flush()
                os.fsync(fd)
            except OSError as exc:
                _unlink_quietly(dfd, tmp)
                raise self._oserror(exc, key) from None
            except BaseException:
                _unlink_quietly(dfd, tmp)
                raise
            self._publish(dfd, tmp, key, if_none_match)
        finally:
            _release(fd)  # the writer's lock goes with it: after the temp file is gone
            os.close(dfd)

    def _delete(self, key: str) -> None:
        try:
            dfd, name = self.open_parent(key, create=False)
        except NotFoundError:
            return  # no directory, no object
        try:
            os.unlink(name, dir_fd=dfd)  # a link is removed itself, never its target
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._oserror(exc, key) from None
        finally:
            os.close(dfd)

    def remove_prefix_dir(self, prefix: str) -> None:
        """Remove the directory of ``prefix`` (a key prefix ending in ``/``) if it is
        empty, and nothing above it: after a checkpoint's objects are deleted, so a
        prefix exists only while objects do, as in a bucket (retention would otherwise
        leave one empty ``step-N/`` per deleted step). A writer that loses the directory
        to this makes it again (:meth:`_create_temp`)."""
        key = prefix.rstrip("/")
        if not key:
            return
        check_key(key, self.root_url)
        try:
            dfd, name = self.open_parent(key, create=False)
        except CloudCkptError:  # gone, or reached only through a link: nothing to do
            return
        try:
            os.rmdir(name, dir_fd=dfd)
        except OSError:  # not empty, gone, or not a directory: nothing to do
            return
        finally:
            os.close(dfd)

    # -- multipart -----------------------------------------------------------------------
    def _create_multipart(self, key: str) -> MultipartUpload:
        dfd, tmp, fd = self._create_temp(key)
        os.close(dfd)  # opened again, checked again, to publish or abort
        return MultipartUpload(key=key, upload_id=tmp, backend=[fd, tmp])

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
        try:  # the file stays open (and locked) until it is in place or removed
            try:
                dfd, _ = self.open_parent(upload.key, create=False)
            except BaseException:
                self._remove_temp(upload.key, tmp)
                raise
            try:
                self._publish(dfd, tmp, upload.key, if_none_match=False)
            finally:
                os.close(dfd)
        finally:
            self._close_fd(upload)

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        if upload.backend is not None:
            try:  # removed while still locked by this writer, then closed
                self._remove_temp(upload.key, upload.backend[1])
            finally:
                self._close_fd(upload)
        else:  # found by list_multipart
            self._remove_temp(upload.key, upload.upload_id)

    def _remove_temp(self, key: str, tmp: str) -> None:
        """Remove the temp file ``tmp`` beside ``key``'s, if it is one (a name of this
        store's temp files) and is there."""
        if "/" in tmp or not (tmp.startswith(".") and TMP_MARK in tmp):
            return  # not an upload of this store: nothing of ours to remove
        try:
            dfd, _ = self.open_parent(key, create=False)
        except CloudCkptError:  # gone, or reached only through a link: nothing of ours
            return
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._oserror(exc, key) from None
        finally:
            os.close(dfd)

    def _close_fd(self, upload: MultipartUpload) -> None:
        with self._fds_lock:
            fd = upload.backend[0]
            if fd is not None:
                upload.backend[0] = None
                _release(fd)

    # -- crash leftovers --------------------------------------------------------------
    def upload_alive(self, upload: MultipartUpload, *, own: bool = False) -> bool | None:
        """Whether the temp file of ``upload`` (one :meth:`list_multipart` found) has a
        live writer: True when its lock is held by another process (or by this one, with
        ``own``), False when the lock can be taken (its writer is gone), None when that
        cannot be told (no such file, no locks here) or, without ``own``, its writer is
        this process (whose caller knows whether it still writes it)."""
        tmp = upload.upload_id
        if "/" in tmp or not _is_temp(tmp):
            return None
        try:
            dfd, _ = self.open_parent(upload.key, create=False)
        except CloudCkptError:
            return None
        try:
            fd = os.open(tmp, _PROBE, dir_fd=dfd)
        except OSError:
            return None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            with _HELD_LOCK:
                if (st.st_dev, st.st_ino) in _HELD:
                    return True if own else None
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        finally:
            os.close(fd)  # and with it the lock, if taken
        return False

    def sweep_temps(self, prefix: str = "") -> list[str]:
        """Remove the temp files under the directory of the key prefix ``prefix`` (``""``:
        the whole root) whose writer is gone: a save, upload or download killed before it
        published its file (``kill -9``, a lost node). A temp file whose writer lives
        holds its lock and is left alone; so is one whose lock cannot be tried. Nothing is
        followed through a link. Directories left empty by a removal are removed too.
        Returns the URLs of the files removed."""
        parts = _dir_parts(prefix)
        try:
            top = self._open_dir(parts, create=False)
        except (OSError, CloudCkptError):
            return []  # no such directory (or reached through a link): nothing of ours
        removed: list[str] = []
        emptied: list[str] = []
        try:
            for dirpath, _dirs, files, dfd in os.fwalk(".", dir_fd=top):
                gone = [n for n in files if _is_temp(n) and _remove_if_dead(dfd, n)]
                rel = os.path.normpath(dirpath)
                base = "/".join(parts + ([] if rel == "." else rel.split(os.sep)))
                removed += [self.url(f"{base}/{n}" if base else n) for n in gone]
                if gone and rel != ".":
                    emptied.append(rel)
            for rel in sorted(emptied, key=len, reverse=True):
                with contextlib.suppress(OSError):  # not empty: other files live there
                    os.rmdir(rel, dir_fd=top)
        finally:
            os.close(top)
        return removed

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        base_dir = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base_dir.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base_dir):
            for name in files:
                if not (name.startswith(".") and TMP_MARK in name and name.endswith(TMP_SUFFIX)):
                    continue
                target = name[1 : name.index(TMP_MARK)]
                key = (Path(dirpath) / target).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        mtime = (Path(dirpath) / name).stat().st_mtime
                        yield MultipartUpload(key=key, upload_id=name, initiated=mtime)


def _dir_parts(prefix: str) -> list[str]:
    """The directory names of a key prefix (``a/b/`` or ``a/b``); [] for the root."""
    key = prefix.strip("/")
    if key:
        check_key(key, "file:///")
    return key.split("/") if key else []


def _is_dir(dfd: int, name: str) -> bool:
    """Whether ``name`` in the directory ``dfd`` is itself a directory (not a link to one)."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _is_temp(name: str) -> bool:
    """Whether ``name`` is the name of one of this store's temp files."""
    return name.startswith(".") and TMP_MARK in name and name.endswith(TMP_SUFFIX)


#: The temp files this process writes (device, inode), each locked by its writer.
_HELD: set[tuple[int, int]] = set()
_HELD_LOCK = threading.Lock()


def _hold(fd: int) -> bool:
    """Lock the new temp file ``fd`` for its writer (kept until the descriptor is
    closed, by the process or by its death); False when a sweep removed it first (it
    held the lock for that instant, then unlinked it). A filesystem without locks
    leaves it unlocked: a sweep there can take no lock either, so it keeps the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return True
    st = os.fstat(fd)
    if st.st_nlink == 0:
        return False
    with _HELD_LOCK:
        _HELD.add((st.st_dev, st.st_ino))
    return True


def _release(fd: int) -> None:
    """Close a temp file's descriptor (its writer's lock goes with it)."""
    try:
        st = os.fstat(fd)
        with _HELD_LOCK:
            _HELD.discard((st.st_dev, st.st_ino))
    finally:
        os.close(fd)


def _remove_if_dead(dfd: int, name: str) -> bool:
    """Remove the temp file ``name`` of the directory ``dfd`` if its writer is gone
    (its lock can be taken); True when removed. Never through a link, never a file
    that is not the one whose lock was taken."""
    try:
        fd = os.open(name, _PROBE, dir_fd=dfd)
    except OSError:
        return False  # gone, a link, or not ours to open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held by a live writer, or no locks on this filesystem
        try:
            now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(name, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _unlink_quietly(dfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def refuse_link(dfd: int, name: str, path: str | os.PathLike[str]) -> None:
    """UnsafePathError when ``name`` in the directory ``dfd`` (at ``path``) is a symbolic
    link, naming the path and the link's target; nothing when it is not (or is absent)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISLNK(st.st_mode):
        return
    try:
        target = os.readlink(name, dir_fd=dfd)
    except OSError:
        target = "?"
    raise UnsafePathError(
        f"{path} is a symbolic link (to {target}) inside the directory being written; "
        "cloudckpt writes nothing through a link there: remove the link, or name the "
        "directory it points to as the destination",
        path=str(path),
        link=target,
    )


def _open_child(parent: int, name: str, path: Path, create: bool) -> int:
    """The directory ``name`` of the directory ``parent``, opened without following a
    link (made first, if missing and ``create``)."""
    try:
        return os.open(name, _DIR_NOFOLLOW, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except OSError:
        refuse_link(parent, name, path)  # ELOOP (or EMLINK, ENOTDIR): say it is a link
        raise
    with contextlib.suppress(FileExistsError):  # made meanwhile by another writer
        os.mkdir(name, 0o777, dir_fd=parent)
    try:
        return os.open(name, _DIR_NOFOLLOW, dir_fd=parent)
    except OSError:
        refuse_link(parent, name, path)  # a link made in its place meanwhile
        raise


def open_dir(base: Path, parts: Sequence[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``base/parts[0]/parts[1]/...``, reached through no
    symbolic link below ``base``: each part is opened with ``O_DIRECTORY | O_NOFOLLOW``
    relative to the one above it (``dir_fd``), and made (mode 0o777 less the umask)
    when missing if ``create``. ``base`` itself is opened as the filesystem resolves it
    (a link the caller names is followed), made with its parents if missing and
    ``create``.

    UnsafePathError naming the path and the link when a part is a symbolic link;
    FileNotFoundError when one is missing (not ``create``), NotADirectoryError when one
    is a file. The caller closes the descriptor. The one place cloudckpt opens a
    directory it writes in: the filesystem store, ``cp``'s downloads and the callers
    that make a directory to fill by path (:meth:`LocalStore.make_dirs`) go through it.
    """
    try:
        fd = os.open(base, _DIR)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(base, exist_ok=True)
        fd = os.open(base, _DIR)
    path = base
    try:
        for name in parts:
            path = path / name
            child = _open_child(fd, name, path, create)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd
