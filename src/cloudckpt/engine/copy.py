"""``cloudckpt cp``: copy an object, or every object under a prefix, between any two
stores, resumable after a failure or an interruption.

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

Leftovers are untrusted input: whoever can write beside ``DST`` can plant them. A journal
or partial file is used only if it is one cloudckpt made for this very copy: a regular
file (opened with ``O_NOFOLLOW``, never through a link) of this user with a single link,
a journal of bounded size and valid types, for the same source URL and identity, and
(downloads) naming the device and inode of the partial file actually opened, whose finished
chunks still hold the bytes whose CRC-32s the journal records (an inode number can be
reused by a file made in the partial's place). Anything else
is logged at WARNING and removed by name (a link itself, never its target), and the copy
starts over. A ``DST`` that is a symbolic link is refused (:class:`DestinationIsSymlinkError`)
rather than written through; the final rename makes ``DST`` a regular file. The directory
``DST`` lies in is reached the filesystem store's way (``LocalStore.open_parent``: no
link below the directory the user named, :class:`~cloudckpt.errors.UnsafePathError`), and
every file there is made, opened, renamed and removed relative to it.

A prefix (:func:`copy_tree`) is copied object by object, each as above, keys relative to
the prefix. To the filesystem, the destination directory named may itself be a link, but
nothing below it is followed: ``./dest/step-1`` linking elsewhere is refused
(:class:`~cloudckpt.errors.UnsafePathError`), at any depth. A rerun skips the objects
already whole at the destination (:func:`same_object`) and resumes the one that was in
progress. Commit markers (:data:`COMMIT_MARKERS`) are
copied after every other object, so the destination never looks committed while files
are missing.

Ctrl-C or a passed ``deadline`` stops a copy without waiting on a stalled network
(``TransferGroup.cancel``): requests in flight are abandoned, what is stored stays for
the next run, and :class:`CopyState` says what that is.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, StorageError, UnsafePathError
from ..format.checksum import crc32
from ..format.commit import COMMIT_MARKERS, SAFETENSORS_INDEX_SUFFIX
from ..io.ranges import split
from ..io.scheduler import Cancelled, TransferGroup
from ..io.sink import ObjectSink, choose_part_size
from ..options import TransferOptions
from ..store import MultipartUpload, ObjectInfo, Store, UploadedPart, check_key
from ..store.deadline import deadline_scope
from ..store.local import LocalStore
from ..store.paths import dir_prefix
from .proof import proven_same

__all__ = [
    "COMMIT_MARKERS",
    "CopyResult",
    "CopyState",
    "DestinationIsSymlinkError",
    "TreeCopyResult",
    "TreeEntry",
    "copy_object",
    "copy_tree",
    "default_state_dir",
    "plan_tree",
    "same_object",
]

log = logging.getLogger("cloudckpt")

PARTIAL_SUFFIX = ".cloudckpt-partial"
#: A journal's size bound: room for its fixed fields (URLs, identity) ...
_JOURNAL_BASE_BYTES = 64 * 1024
#: ... plus this much per chunk or part it can record (an index; a number, ETag and size).
_JOURNAL_ENTRY_BYTES = 512
_INDEX_SUFFIX = SAFETENSORS_INDEX_SUFFIX


class DestinationIsSymlinkError(UnsafePathError):
    """``cp`` to a path that is a symbolic link: refused, so nothing is written through it."""


@dataclass(frozen=True)
class CopyResult:
    """One object copied: its URLs, size, time taken and what an earlier run had done."""

    src: str
    dst: str
    size: int
    seconds: float
    #: Bytes a previous, interrupted run had already copied (0 for a fresh copy).
    resumed_bytes: int
    #: The ETag the destination store gave the object (None: it gave none).
    etag: str | None = None

    @property
    def moved_bytes(self) -> int:
        """Bytes this run transferred (a rate is over these, never over resumed ones)."""
        return self.size - self.resumed_bytes


@dataclass
class CopyState:
    """What a copy has done so far, kept current while it runs: after an interruption
    (when no result comes back) it says what stays for the next run."""

    #: Objects a recursive copy transfers in this run (0: a single object).
    objects: int = 0
    #: Of them, those finished.
    copied: int = 0
    #: The object in progress: its URL, its parts (uploads) or chunks (downloads), and
    #: how many of those are stored, to be kept by a rerun (0 parts: sent in one request).
    current: str = ""
    unit: str = "parts"
    pieces: int = 0
    pieces_kept: int = 0
    #: The object in progress goes up as a multipart upload, open (and in its journal)
    #: for the next run even while none of its parts is stored.
    upload_open: bool = False
    #: Bytes transferred in this run (resumed ones not included).
    moved_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_moved(self, n: int) -> None:
        """Count ``n`` bytes transferred (called from the transfer threads)."""
        with self._lock:
            self.moved_bytes += n

    def start(self, url: str) -> None:
        """A new object is in progress."""
        self.current, self.unit, self.pieces, self.pieces_kept = url, "parts", 0, 0
        self.upload_open = False

    def kept(self) -> str:
        """What an interrupted copy leaves for the next run, e.g. ``12 of 40 parts kept``."""
        pieces = f"{self.pieces_kept} of {self.pieces} {self.unit} kept" if self.pieces else ""
        # No part stored yet, but the upload is open for the rerun: say so.
        opened = (
            ", its multipart upload left open" if self.upload_open and not self.pieces_kept else ""
        )
        if not self.objects:
            return f"{pieces}{opened}" if pieces else "nothing kept"
        done = f"{self.copied} of {self.objects} objects copied"
        if pieces and self.copied < self.objects:
            return f"{done}, {pieces} of {self.current}{opened}"
        return done


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


def _is_int(value: object) -> bool:
    """A JSON integer (``bool`` is an ``int`` subclass, and not one)."""
    return type(value) is int


def _journal_limit(entries: int) -> int:
    """The most bytes an honest journal with ``entries`` chunks or parts can take."""
    return _JOURNAL_BASE_BYTES + _JOURNAL_ENTRY_BYTES * entries


def _write_json(path: Path | str, body: dict[str, Any], dir_fd: int | None = None) -> None:
    """Replace the journal at ``path`` (a name in the directory ``dir_fd``, when given)
    atomically. The temporary file gets a new random name (``O_EXCL | O_NOFOLLOW``, mode
    0600), so nothing planted beside it is written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:  # pragma: no cover - 64 random bits taken
            continue
    try:
        with open(fd, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _untrusted(st: os.stat_result) -> str:
    """Why a file with this status cannot be one cloudckpt made here ('' if it can be)."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links"
    return ""


def _open_trusted(
    path: Path | str, flags: int, dir_fd: int | None = None
) -> tuple[int | None, str]:
    """Open ``path`` (in the directory ``dir_fd``, when given) without following a symbolic
    link, and keep it only if it is a regular file of this user with a single link.
    Returns the fd, or None and why ('' if absent)."""
    try:
        # O_NONBLOCK: a planted FIFO must not hang the open; it changes nothing for a file.
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "it is a symbolic link"
        return None, f"it cannot be opened ({exc.strerror or exc})"
    why = _untrusted(os.fstat(fd))
    if why:
        os.close(fd)
        return None, why
    return fd, ""


def _read_journal(
    path: Path | str, max_bytes: int, dir_fd: int | None = None
) -> tuple[dict[str, Any] | None, str]:
    """The JSON object in a journal, or None and why not ('' if there is none). A journal
    is untrusted input: a link, another user's file, too large or not JSON is refused."""
    fd, why = _open_trusted(path, os.O_RDONLY, dir_fd)
    if fd is None:
        return None, why
    try:
        with open(fd, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror or exc})"
    if len(raw) > max_bytes:
        return None, f"it is larger than {max_bytes} bytes"
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "it is not valid JSON"
    if not isinstance(body, dict):
        return None, "it is not a JSON object"
    return body, ""


def _discard(path: Path | str, dir_fd: int | None = None) -> None:
    """Remove a leftover by name: a symbolic link goes itself, never the file it names."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot remove the untrusted leftover {path}: {exc}") from None


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
    state: CopyState | None = None,
) -> CopyResult:
    """Copy ``src_key`` to ``dst_key``, continuing an interrupted copy of the same source.

    ``advance`` hears of bytes done (resumed ones first, at once); ``state``, when given,
    is kept current (what an interruption leaves). The copy is bounded by
    ``options.deadline``; Ctrl-C or the deadline keep what is stored for the next run."""
    started = time.perf_counter()
    state = state if state is not None else CopyState()
    src_url = src.url(src_key)
    with deadline_scope(options.deadline):
        info = src.head(src_key)
        on_size(info.size)
        state.start(dst.url(dst_key))

        def moved(n: int) -> None:
            state.add_moved(n)
            advance(n)

        etag: str | None = None
        if isinstance(dst, LocalStore):
            resumed = _download(src, info, dst, dst_key, options, advance, moved, state)
        else:
            resumed, etag = _upload(
                src, info, dst, dst_key, options, state_dir, advance, moved, state
            )
    return CopyResult(
        src=src_url,
        dst=dst.url(dst_key),
        size=info.size,
        seconds=time.perf_counter() - started,
        resumed_bytes=resumed,
        etag=etag,
    )


# -- to the filesystem ---------------------------------------------------------------------


def _not_a_link(dst: LocalStore, dst_key: str, dir_fd: int | None = None) -> Path:
    """The path of ``dst_key`` (whose name is looked up in the directory ``dir_fd``, when
    given); DestinationIsSymlinkError when it is a symbolic link."""
    path = dst.root / check_key(dst_key, dst.url(dst_key))
    where = path.name if dir_fd is not None else path
    try:
        st = os.stat(where, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return path  # absent (or unreachable: the write says why)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(where, dir_fd=dir_fd)
        raise DestinationIsSymlinkError(
            f"{path} is a symbolic link (to {target}); cp does not write through "
            "links: copy to the link's target, or remove the link first",
            path=str(path),
            link=target,
        )
    return path


def _journal_chunks(
    journal: dict[str, Any],
    partial: os.stat_result,
    fd: int,
    *,
    pieces: list[tuple[int, int]],
    source: str,
    identity: str,
    size: int,
    chunk: int,
    n_pieces: int,
) -> dict[int, int] | str:
    """The chunks a download journal records as done, or why it does not apply: it must be
    for this source, identity and chunk size, name the partial file actually opened, and
    each finished chunk there must still have the CRC-32 recorded for it."""
    if journal.get("source") != source:
        return "it is for another source"
    if journal.get("identity") != identity:
        return "the source changed since"
    if not _is_int(journal.get("chunk")) or journal["chunk"] != chunk:
        return "it was written with another chunk size"
    rec = journal.get("partial")
    if not (
        isinstance(rec, dict)
        and _is_int(rec.get("dev"))
        and _is_int(rec.get("ino"))
        and (rec["dev"], rec["ino"]) == (partial.st_dev, partial.st_ino)
    ):
        return "it records another partial file"
    if partial.st_size != size:
        return "the partial file has the wrong size"
    done = journal.get("done")
    crcs = journal.get("crc32")
    if (
        not isinstance(done, list)
        or not all(_is_int(i) and 0 <= i < n_pieces for i in done)
        or not isinstance(crcs, list)
        or len(crcs) != len(done)
        or not all(_is_int(c) for c in crcs)
    ):
        return "its list of finished chunks is malformed"
    for i, crc in zip(done, crcs, strict=True):
        start, n = pieces[i]
        if crc32(os.pread(fd, n, start)) != crc:
            return f"chunk {i} of the partial file is not the bytes it recorded"
    return dict(zip(done, crcs, strict=True))


def _open_partial(
    partial: str,
    journal_path: str,
    max_bytes: int,
    check: Callable[[dict[str, Any], os.stat_result, int], dict[int, int] | str],
    dir_fd: int,
    folder: Path,
) -> tuple[int, os.stat_result, dict[int, int]]:
    """The partial file to write into (fd and status) and the chunks it already holds
    (index -> CRC-32).

    A previous run's file is reused only if it and its journal prove that cloudckpt made
    them for this copy (see the module docstring); otherwise both are removed by name and a
    new file is made with ``O_EXCL | O_NOFOLLOW``, so no planted link is ever written. The
    names are of the directory ``dir_fd``, at ``folder`` (for messages)."""
    journal, why = _read_journal(journal_path, max_bytes, dir_fd)
    culprit = journal_path
    if journal is not None:
        fd, why = _open_trusted(partial, os.O_RDWR, dir_fd)
        culprit = partial
        if fd is None and not why:
            why = "it is missing"
        if fd is not None:
            st = os.fstat(fd)
            chunks = check(journal, st, fd)
            if isinstance(chunks, dict):
                return fd, st, chunks
            os.close(fd)
            why, culprit = chunks, journal_path
    elif not why and _lexists(partial, dir_fd):
        why, culprit = "there is no journal for it", partial
    if why:
        log.warning("not resuming from %s: %s; starting over", folder / culprit, why)
    _discard(journal_path, dir_fd)
    _discard(partial, dir_fd)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(partial, flags, 0o644, dir_fd=dir_fd)
    return fd, os.fstat(fd), {}


def _lexists(name: str, dir_fd: int) -> bool:
    """Whether ``name`` is in the directory ``dir_fd`` (a link counts, whatever it names)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _same_file(path: str, st: os.stat_result, dir_fd: int) -> bool:
    """Whether ``path`` itself (not a link's target) is the file ``st`` describes."""
    try:
        now = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


class _SharedFile:
    """The partial file's descriptor, shared with the threads writing chunks into it.

    It is closed only once no thread is writing, and never lent after that: a chunk read
    finishing after the copy was cancelled (its request abandoned, not awaited) is
    dropped instead of written through a number the process may have reused."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._users = 0
        self._closed = False
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """The descriptor, for one chunk's writes; Cancelled once the file is closed."""
        with self._cond:
            if self._closed:
                raise Cancelled()
            self._users += 1
        try:
            yield self.fd
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Close once the writes under way (local, short) are done."""
        with self._cond:
            self._closed = True
            while self._users:
                self._cond.wait()
        os.close(self.fd)


def _download(
    src: Store,
    info: ObjectInfo,
    dst: LocalStore,
    dst_key: str,
    options: TransferOptions,
    advance: Callable[[int], None],
    moved: Callable[[int], None],
    state: CopyState,
) -> int:
    # The directory, made and opened with no link below the one the user named; every
    # file below is made, renamed and removed relative to it, never by its path.
    dir_fd, name = dst.open_parent(dst_key, create=True)
    try:
        return _download_into(dir_fd, name, src, info, dst, dst_key, options, advance, moved, state)
    finally:
        os.close(dir_fd)


def _download_into(
    dir_fd: int,
    name: str,
    src: Store,
    info: ObjectInfo,
    dst: LocalStore,
    dst_key: str,
    options: TransferOptions,
    advance: Callable[[int], None],
    moved: Callable[[int], None],
    state: CopyState,
) -> int:
    """:func:`_download` into the file ``name`` of the directory ``dir_fd``."""
    path = _not_a_link(dst, dst_key, dir_fd)
    partial = name + PARTIAL_SUFFIX
    journal_path = name + PARTIAL_SUFFIX + ".json"
    chunk = options.read_chunk_size
    pieces = split(0, info.size, chunk)  # the journal records them by index
    identity = _identity(info)
    source = src.url(info.key)
    check = functools.partial(
        _journal_chunks,
        pieces=pieces,
        source=source,
        identity=identity,
        size=info.size,
        chunk=chunk,
        n_pieces=len(pieces),
    )
    fd, made, done = _open_partial(
        partial, journal_path, _journal_limit(len(pieces)), check, dir_fd, path.parent
    )
    shared = _SharedFile(fd)
    lock = threading.Lock()
    finished = False
    try:
        resumed = sum(pieces[i][1] for i in done)
        state.unit, state.pieces, state.pieces_kept = "chunks", len(pieces), len(done)
        advance(resumed)
        os.ftruncate(fd, info.size)

        def fetch(i: int) -> None:
            start, n = pieces[i]
            buf = bytearray(n)
            src.read_into(info.key, start, [memoryview(buf)])
            view = memoryview(buf)
            with shared.use() as fd:
                written = 0
                while written < n:
                    written += os.pwrite(fd, view[written:], start + written)
                _datasync(fd)
                checksum = crc32(view)
                with lock:
                    done[i] = checksum
                    _write_json(
                        journal_path,
                        {
                            "source": source,
                            "identity": identity,
                            "chunk": chunk,
                            "partial": {"dev": made.st_dev, "ino": made.st_ino},
                            "done": sorted(done),
                            "crc32": [done[d] for d in sorted(done)],
                        },
                        dir_fd,
                    )
                    state.pieces_kept = len(done)
            moved(n)

        group = TransferGroup(options, options.read_concurrency)
        try:
            for i in range(len(pieces)):
                if i not in done:
                    group.submit(functools.partial(fetch, i), f"read {source} #{i}")
            group.wait()
        except BaseException:
            group.cancel()  # Ctrl-C or a passed deadline: a stalled read is not awaited
            raise
        os.fsync(fd)
        finished = True
    finally:
        shared.close()  # no chunk is written, nor the journal, after this
        if not finished and not done and _same_file(partial, made, dir_fd):
            # Not one chunk on disk ("nothing kept"): no journal was written, and a
            # partial file without one is of no use to a rerun (it starts over).
            with contextlib.suppress(StorageError):  # the copy's own error says more
                _discard(partial, dir_fd)
    # rename() replaces a link at DST rather than following it; the checks make sure what
    # lands there is the file written above, not something swapped in meanwhile.
    if not _same_file(partial, made, dir_fd):
        raise StorageError(
            f"{path}{PARTIAL_SUFFIX} was replaced during the copy; not moving it into place"
        )
    os.replace(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    with contextlib.suppress(OSError):  # durable like the filesystem store's renames
        os.fsync(dir_fd)
    if not _same_file(name, made, dir_fd):
        raise StorageError(f"{path} is not the file just copied; something replaced it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal_path, dir_fd=dir_fd)
    return resumed


# -- to an object store --------------------------------------------------------------------


def _journal_parts(
    journal: dict[str, Any],
    *,
    source: str,
    destination: str,
    identity: str,
    part_size: int,
    n_parts: int,
) -> tuple[str, dict[int, UploadedPart]] | str:
    """The upload id and finished parts an upload journal records, or why it does not
    apply: it must be for this source, destination, identity and part size, well formed."""
    if journal.get("source") != source or journal.get("destination") != destination:
        return "it is for another copy"
    if journal.get("identity") != identity:
        return "the source changed since"
    if not _is_int(journal.get("part_size")) or journal["part_size"] != part_size:
        return "it was written with another part size"
    upload_id = journal.get("upload_id")
    if not isinstance(upload_id, str) or not upload_id:
        return "its upload id is malformed"
    recorded = journal.get("parts")
    if not isinstance(recorded, dict):
        return "its list of finished parts is malformed"
    parts: dict[int, UploadedPart] = {}
    for key, value in recorded.items():
        number = int(key) if key.isascii() and key.isdecimal() and len(key) <= 9 else 0
        if not (
            1 <= number <= n_parts
            and isinstance(value, list)
            and len(value) == 2
            and isinstance(value[0], str)
            and _is_int(value[1])
            and value[1] >= 0
        ):
            return "its list of finished parts is malformed"
        parts[number] = UploadedPart(number, value[0], value[1])
    return upload_id, parts


def _upload(
    src: Store,
    info: ObjectInfo,
    dst: Store,
    dst_key: str,
    options: TransferOptions,
    state_dir: Path | None,
    advance: Callable[[int], None],
    moved: Callable[[int], None],
    state: CopyState,
) -> tuple[int, str | None]:
    """Copy to an object store through the sink ``save`` uses (its part size, buffers,
    byte budget and commit), each part read from the source in the thread that uploads
    it. A journal records the open upload and its stored parts, so an interrupted copy
    continues where it stopped. Returns the bytes resumed and the ETag the store gave."""
    dst_url = dst.url(dst_key)
    # The rule save uses (io/sink.py), so a profile's part_size means the same here.
    part_size = choose_part_size(info.size, options.part_size, options.write_concurrency)
    if info.size <= part_size:
        data = src.get_range(info.key, 0, info.size) if info.size else b""
        etag = dst.put(dst_key, data)
        moved(info.size)
        return 0, etag

    state_dir = state_dir or default_state_dir()
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    source = src.url(info.key)
    tag = hashlib.sha256(f"{source}\n{dst_url}".encode()).hexdigest()[:32]
    journal_path = state_dir / f"upload-{tag}.json"
    identity = _identity(info)
    n_parts = len(split(0, info.size, part_size))
    journal, why = _read_journal(journal_path, _journal_limit(n_parts))
    upload: MultipartUpload | None = None
    parts: dict[int, UploadedPart] = {}
    if journal is not None:
        recorded = _journal_parts(
            journal,
            source=source,
            destination=dst_url,
            identity=identity,
            part_size=part_size,
            n_parts=n_parts,
        )
        if isinstance(recorded, str):
            why = recorded
        else:
            open_ids = {u.upload_id for u in dst.list_multipart(dst_key) if u.key == dst_key}
            if recorded[0] in open_ids:
                upload = MultipartUpload(key=dst_key, upload_id=recorded[0])
                parts = recorded[1]
    if why:
        log.warning("not resuming from %s: %s; starting over", journal_path, why)
        _discard(journal_path)
    if upload is None:
        upload = dst.create_multipart(dst_key)
        parts = {}
    opened = upload
    resumed = sum(p.size for p in parts.values())
    state.unit, state.pieces, state.pieces_kept = "parts", n_parts, len(parts)
    advance(resumed)
    lock = threading.Lock()

    def save_journal(part: UploadedPart | None = None) -> None:
        with lock:
            if part is not None:
                parts[part.number] = part
                state.pieces_kept = len(parts)
            _write_json(
                journal_path,
                {
                    "source": source,
                    "destination": dst_url,
                    "identity": identity,
                    "part_size": part_size,
                    "upload_id": opened.upload_id,
                    "parts": {str(p.number): [p.etag, p.size] for p in parts.values()},
                },
            )

    save_journal()
    state.upload_open = True  # its journal names it: a rerun continues it
    sink = ObjectSink(
        dst,
        dst_key,
        options,
        size_hint=info.size,
        on_progress=moved,
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
        state.upload_open = False
        raise
    except BaseException:
        # The journal and the open upload stay for the next run; on Ctrl-C or a passed
        # deadline a stalled part is abandoned, not awaited (TransferGroup.cancel).
        sink.abort(keep_upload=True)
        raise
    with contextlib.suppress(OSError):
        journal_path.unlink()
    return resumed, sink.etag


# -- a whole prefix ------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeEntry:
    """One object of a recursive copy: where it comes from and goes, its size, and
    whether the destination already holds it (skipped)."""

    #: The key relative to both prefixes.
    name: str
    src_key: str
    dst_key: str
    size: int
    skip: bool = False
    #: A commit marker (:data:`COMMIT_MARKERS`): copied after every other object.
    marker: bool = False
    #: A skipped entry's destination ETag, as listed (proven the source's bytes).
    there: str | None = None


@dataclass(frozen=True)
class TreeCopyResult:
    """A recursive copy (or, with ``dry_run``, its plan): every entry in copy order."""

    src: str
    dst: str
    entries: list[TreeEntry]
    seconds: float
    dry_run: bool = False
    #: Bytes an earlier, interrupted run had already sent of the objects copied now.
    resumed_bytes: int = 0
    #: Bytes this run transferred.
    moved_bytes: int = 0
    #: The destination's ETag of each entry by name: the one the store gave the object
    #: this copy made, or a skipped entry's as listed (None: the store gave none).
    etags: dict[str, str | None] = field(default_factory=dict)

    @property
    def copied(self) -> list[TreeEntry]:
        """The entries copied (with ``dry_run``: to be copied)."""
        return [e for e in self.entries if not e.skip]

    @property
    def skipped(self) -> list[TreeEntry]:
        """The entries already at the destination, left alone."""
        return [e for e in self.entries if e.skip]

    @property
    def size(self) -> int:
        """Bytes of the objects copied (or to be copied)."""
        return sum(e.size for e in self.copied)


def _marker_rank(key: str) -> int | None:
    """The position of ``key``'s name in :data:`COMMIT_MARKERS` (None: not a marker)."""
    name = key.rpartition("/")[2]
    for rank, marker in enumerate(COMMIT_MARKERS):
        # The safetensors index is named after its model (model.safetensors.index.json).
        if name == marker or (marker == _INDEX_SUFFIX and name.endswith(marker)):
            return rank
    return None


def _is_leftover(key: str) -> bool:
    """A download in progress (its partial file or journal): never a source object."""
    return key.endswith((PARTIAL_SUFFIX, PARTIAL_SUFFIX + ".json"))


def same_object(src: Store, s: ObjectInfo, dst: Store, d: ObjectInfo) -> bool:
    """Whether ``d`` is proven to be a copy of ``s`` (engine/proof.py): the same ETag
    from two stores of one kind, an S3-style MD5 ETag of one side matching the other
    side's local file, or two local files with the same bytes. The same size alone
    proves nothing (two saves of one step with the same shapes): such an object is
    copied again."""
    return proven_same(src, s, dst, d)


def plan_tree(
    src: Store, src_prefix: str, dst: Store, dst_prefix: str, exclude: Sequence[str] = ()
) -> list[TreeEntry]:
    """Every object under ``src_prefix`` and where it lands under ``dst_prefix`` (keys
    relative to the prefix), in copy order: data first, commit markers last. An object
    already whole at the destination is marked ``skip``; one whose name (the part after
    the last ``/``) is in ``exclude`` is left out. One listing of each side."""
    src_dir, dst_dir = dir_prefix(src_prefix), dir_prefix(dst_prefix)
    there = {o.key: o for o in dst.list(dst_dir)}
    entries: list[tuple[tuple[int, str], TreeEntry]] = []
    for o in src.list(src_dir):
        if isinstance(src, LocalStore) and _is_leftover(o.key):
            continue
        if exclude and o.key.rpartition("/")[2] in exclude:
            continue
        rel = o.key[len(src_dir) :]
        dst_key = dst_dir + rel
        d = there.get(dst_key)
        rank = _marker_rank(rel)
        entry = TreeEntry(
            name=rel,
            src_key=o.key,
            dst_key=dst_key,
            size=o.size,
            skip=d is not None and same_object(src, o, dst, d),
            marker=rank is not None,
            there=None if d is None else d.etag,
        )
        entries.append(((-1 if rank is None else rank, rel), entry))
    return [e for _, e in sorted(entries, key=lambda item: item[0])]


def _small_limit(options: TransferOptions) -> int:
    """Objects up to this size are copied whole in one request each (one GET, one PUT),
    several at once: below a part and a read chunk, and at most 8 MiB, so the copies in
    flight hold at most ``write_concurrency`` x 8 MiB."""
    return min(options.part_size, options.read_chunk_size, 8 << 20)


def _copy_small(
    src: Store,
    dst: Store,
    entries: Sequence[TreeEntry],
    options: TransferOptions,
    advance: Callable[[int], None],
    state: CopyState,
) -> dict[str, str | None]:
    """Copy ``entries`` (each at most :func:`_small_limit`), ``write_concurrency`` at a
    time on the I/O threads: each read whole, checked against the listed size, and
    written in one atomic put (a filesystem destination through a temp file, never
    through a link). A failure cancels the rest and is raised. Returns each entry's
    ETag as the destination store gave it, by name."""
    etags: dict[str, str | None] = {}
    if not entries:
        return etags
    lock = threading.Lock()

    def one(e: TreeEntry) -> None:
        if isinstance(dst, LocalStore):
            _not_a_link(dst, e.dst_key)
        data = src.get(e.src_key)
        if len(data) != e.size:
            raise StorageError(
                f"{src.url(e.src_key)} changed during the copy: {len(data)} bytes read, "
                f"{e.size} listed; run the copy again"
            )
        etag = dst.put(e.dst_key, data)
        state.add_moved(len(data))
        advance(len(data))
        with lock:
            state.copied += 1
            etags[e.name] = etag

    group = TransferGroup(options, options.write_concurrency)
    for e in entries:
        group.submit(functools.partial(one, e), f"copy {src.url(e.src_key)}")
    group.wait()
    return etags


def copy_tree(
    src: Store,
    src_prefix: str,
    dst: Store,
    dst_prefix: str,
    options: TransferOptions,
    *,
    state_dir: Path | None = None,
    dry_run: bool = False,
    advance: Callable[[int], None] = lambda n: None,
    on_size: Callable[[int], None] = lambda n: None,
    state: CopyState | None = None,
    exclude: Sequence[str] = (),
) -> TreeCopyResult:
    """Copy every object under ``src_prefix`` to ``dst_prefix``, keys relative to it
    (objects named in ``exclude`` left out: :func:`plan_tree`).

    Objects already whole at the destination are skipped. To the filesystem, nothing is
    written through a link below ``dst_prefix`` (:meth:`LocalStore.checked`). Small ones
    (one request each, :func:`_small_limit`) go first, ``write_concurrency`` at a time;
    then the larger ones one by one through :func:`copy_object` (each in parallel parts,
    and resumed midway after an interruption); commit markers last, one by one.
    ``on_size`` hears the bytes to copy, once. With ``dry_run`` nothing is written: the
    result is the plan. The whole copy is bounded by ``options.deadline``."""
    started = time.perf_counter()
    state = state if state is not None else CopyState()
    src_url, dst_url = src.url(dir_prefix(src_prefix)), dst.url(dir_prefix(dst_prefix))
    if isinstance(dst, LocalStore):
        # The directory named may be a link (followed); nothing below it is (UnsafePathError).
        dst = dst.checked(dst_prefix)
    with deadline_scope(options.deadline):
        entries = plan_tree(src, src_prefix, dst, dst_prefix, exclude)
        if not entries:
            raise NotFoundError(f"no objects under {src_url}")
        todo = [e for e in entries if not e.skip]
        if dry_run:
            return TreeCopyResult(src_url, dst_url, entries, time.perf_counter() - started, True)
        state.objects = len(todo)
        on_size(sum(e.size for e in todo))
        resumed = 0
        small = _small_limit(options)
        quick = [e for e in todo if not e.marker and e.size <= small]
        etags = {e.name: e.there for e in entries if e.skip}
        etags.update(_copy_small(src, dst, quick, options, advance, state))
        for e in [e for e in todo if e.marker or e.size > small]:
            result = copy_object(
                src,
                e.src_key,
                dst,
                e.dst_key,
                options,
                state_dir=state_dir,
                advance=advance,
                state=state,
            )
            resumed += result.resumed_bytes
            etags[e.name] = result.etag
            state.copied += 1
    return TreeCopyResult(
        src_url,
        dst_url,
        entries,
        time.perf_counter() - started,
        resumed_bytes=resumed,
        moved_bytes=state.moved_bytes,
        etags=etags,
    )
