"""A NeMo 2 checkpoint's layout, as string URLs, and the few store operations on it.

NeMo builds its paths with ``pathlib``, which turns ``s3://bucket/run`` into
``s3:/bucket/run``. Everything here joins strings instead::

    <dirpath>/<name>/                  one checkpoint (Lightning calls it <name>.ckpt)
      weights/                         the megatron-core torch_dist checkpoint;
        metadata.json                  ... its commit marker (written last)
      context/                         NeMo's io.json, model.yaml and artifacts
    <dirpath>/<name>-unfinished        NeMo's marker: a save or removal is under way

Store settings (credentials, endpoint) come from :func:`cloudckpt.lightning.fs.
register_options`, which the classes of cloudckpt.nemo call with what they were given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..engine.remove import remove_checkpoint
from ..lightning.fs import target_for, unwrap
from ..store import paths
from ..store.local import LocalStore

__all__ = [
    "CONTEXT",
    "UNFINISHED_SUFFIX",
    "WEIGHTS",
    "as_url",
    "checkpoint_dir",
    "children",
    "download_tree",
    "has_objects",
    "marker_url",
    "object_exists",
    "remove_object",
    "remove_tree",
    "touch",
    "upload_tree",
    "weights_url",
]

WEIGHTS = "weights"
CONTEXT = "context"
UNFINISHED_SUFFIX = "-unfinished"


def as_url(path: Any) -> str:
    """A path or URL as a string without a trailing slash (``cloudckpt://`` unwrapped)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return unwrap(text).rstrip("/")


def checkpoint_dir(path: Any) -> str:
    """NeMo's ``ckpt_to_dir`` on strings: ``.../name.ckpt`` (or ``.../name/weights``) ->
    ``.../name``."""
    url = as_url(path)
    url = url.removesuffix(".ckpt")
    return url.removesuffix("/" + WEIGHTS)


def weights_url(path: Any) -> str:
    """Where the megatron checkpoint of the NeMo checkpoint ``path`` lives."""
    return f"{checkpoint_dir(path)}/{WEIGHTS}"


def marker_url(path: Any) -> str:
    """NeMo's ``<checkpoint>-unfinished`` marker (one for a checkpoint and its EMA copy)."""
    return checkpoint_dir(path).removesuffix("-EMA") + UNFINISHED_SUFFIX


def object_exists(url: str) -> bool:
    """True if ``url`` is an object (not a prefix)."""
    where = target_for(url)
    return paths.exists(where.store, where.key)


def has_objects(url: str) -> bool:
    """True if any object lies under ``url/`` (a "directory" of an object store)."""
    where = target_for(url)
    return paths.is_prefix(where.store, where.key)


def touch(url: str) -> None:
    where = target_for(url)
    where.store.put(where.key, b"")


def remove_object(url: str) -> None:
    """Delete one object (absent already is fine)."""
    where = target_for(url)
    where.store.delete(where.key)


def children(url: str) -> paths.Children:
    """What lies directly under ``url``: ``(dirs, files)``, ``{dir name: its objects}``
    and ``{file name: object}``."""
    where = target_for(url)
    return paths.children(where.store, where.key)


def remove_tree(url: str) -> int:
    """Delete a NeMo checkpoint directory, its commit markers first (``weights/
    metadata.json``, engine/remove.py). Returns objects deleted."""
    where = target_for(url)
    return remove_checkpoint(where.store, paths.dir_prefix(where.key), where.options)


def upload_tree(local: Path, url: str) -> None:
    """Copy every file under the local directory ``local`` to ``url/<relative path>``."""
    where = target_for(url)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            where.store.put(f"{where.key}/{path.relative_to(local).as_posix()}", path.read_bytes())


def download_tree(url: str, local: Path) -> int:
    """Copy every object under ``url/`` into the local directory ``local``; returns the count.
    Each file is written by the filesystem store (temp file and rename), through no link
    inside ``local`` (UnsafePathError)."""
    where = target_for(url)
    prefix = paths.dir_prefix(where.key)
    into = LocalStore(local)
    count = 0
    for obj in where.store.list(prefix):
        into.put(obj.key[len(prefix) :], where.store.get(obj.key))
        count += 1
    return count
