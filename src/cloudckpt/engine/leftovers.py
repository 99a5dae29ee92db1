"""What a crash leaves in a local tier: the temp files of writers killed mid-file,
swept the same way by every tier (the manager's, NeMo's and Lightning's) at each save
and retention (docs/tiers.md, "Leftovers of a crash"); and the private hard link an
upload reads one version of a file through (:func:`pinned`), left as such a temp file
when its process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator

from ..errors import NotFoundError, StorageError
from ..store.local import TMP_MARK, TMP_SUFFIX, LocalStore

__all__ = ["pinned", "sweep_leftovers"]

log = logging.getLogger("cloudckpt")

#: What tells a pinned link (``.NAME.cloudckpt-drain-ID.part``) from a writer's temp file.
_PIN = "drain-"


def sweep_leftovers(store: LocalStore) -> list[str]:
    """Remove the temp files of writers that are gone from the local tier ``store`` (a
    save, peer copy or download killed mid-file: store/local.py ``sweep_temps``); never
    a live writer's, whose lock is held. Returns their URLs; a failure is logged, never
    raised (the next sweep tries again)."""
    try:
        removed = store.sweep_temps("")
    except Exception as exc:
        log.warning("sweeping crash leftovers in the local tier %s failed: %s", store.root_url, exc)
        return []
    if removed:
        log.info(
            "removed %d temp file(s) crashed writers left in the local tier %s: %s",
            len(removed),
            store.root_url,
            ", ".join(removed),
        )
    return removed


@contextlib.contextmanager
def pinned(store: LocalStore, key: str) -> Iterator[tuple[str, float]]:
    """A private hard link of the file ``key`` for an upload that must read one version
    while saves rename newer ones over ``key``: (the link's key, that version's
    modification time). Named and locked like a writer's temp file, so a sweep keeps it
    while its holder lives and removes it after a crash; removed when the block ends.
    NotFoundError when ``key`` is absent."""
    dfd, name = store.open_parent(key, create=False)
    try:
        fd, link = _link_locked(store, key, dfd, name)
        try:
            folder = key.rpartition("/")[0]
            yield (f"{folder}/{link}" if folder else link), os.fstat(fd).st_mtime
        finally:
            with contextlib.suppress(OSError):
                os.unlink(link, dir_fd=dfd)
            os.close(fd)  # and the lock with it
    finally:
        os.close(dfd)


def _link_locked(store: LocalStore, key: str, dfd: int, name: str) -> tuple[int, str]:
    """A new hard link of ``name`` in the directory ``dfd``, opened and locked (as a
    writer locks its temp file); made again when a sweep took it before the lock."""
    for _ in range(3):
        link = f".{name}{TMP_MARK}{_PIN}{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            os.link(name, link, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotFoundError(f"{store.url(key)} not found") from None
        try:
            fd = os.open(link, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(link, dir_fd=dfd)
            raise
        with contextlib.suppress(OSError):  # a filesystem without locks: left unlocked
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            there = os.stat(link, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        mine = os.fstat(fd)
        if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            return fd, link
        os.close(fd)  # a sweep removed it between the link and the lock
    raise StorageError(f"cannot pin {store.url(key)} for its upload: removed three times")
