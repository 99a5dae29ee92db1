"""Deleting checkpoints (marker first) and collecting what failed saves left behind.

Garbage is (1) a ``step-N/`` prefix with objects but no marker whose newest object is
older than the grace period (a save that died; a younger one may still be running),
and (2) a multipart upload under the root opened longer ago than the grace period.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..io.bulk import delete_keys
from ..options import TransferOptions
from ..store import ObjectInfo, Store
from .marker import MARKER_NAME, parse_step, root_prefix

__all__ = ["GcReport", "collect_garbage", "delete_prefix", "delete_tree"]

#: Default grace period: a save that has not touched its prefix for an hour is dead.
DEFAULT_GRACE_SECONDS = 3600.0


def delete_prefix(
    store: Store,
    prefix: str,
    options: TransferOptions,
    objects: Iterable[ObjectInfo] | None = None,
) -> int:
    """Delete every object under ``prefix`` (ending in ``/``), the marker first.

    Once the marker is gone the checkpoint no longer counts as committed, so an
    interrupted delete leaves garbage for :func:`collect_garbage`, never a checkpoint
    with missing files. Returns the number of objects deleted.
    """
    if objects is None:
        objects = list(store.list(prefix))
    keys = [o.key for o in objects]
    total = len(keys)
    marker = prefix + MARKER_NAME
    if marker in keys:
        store.delete(marker)
        keys.remove(marker)
    delete_keys(store, keys, options)
    return total


def delete_tree(
    store: Store,
    objects: list[ObjectInfo],
    options: TransferOptions,
    checkpoints: Iterable[str] = (),
) -> None:
    """Delete ``objects``: each committed checkpoint's prefix (in ``checkpoints``, keys
    ending in ``/``) marker first, so none looks committed while its files go; then
    the rest."""
    done = list(checkpoints)
    for step_prefix in done:
        delete_prefix(
            store, step_prefix, options, [o for o in objects if o.key.startswith(step_prefix)]
        )
    rest = [o.key for o in objects if not any(o.key.startswith(d) for d in done)]
    delete_keys(store, rest, options)


@dataclass
class GcReport:
    """What a garbage collection removed (or, in a dry run, would remove)."""

    dry_run: bool
    #: Uncommitted step prefixes: (url, number of objects, bytes).
    prefixes: list[tuple[str, int, int]] = field(default_factory=list)
    #: Stale multipart uploads: (url, upload id, seconds since initiated).
    uploads: list[tuple[str, str, float]] = field(default_factory=list)
    #: Uncommitted prefixes left alone because they are younger than the grace period.
    skipped_young: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.prefixes)


def collect_garbage(
    store: Store,
    root_key: str,
    options: TransferOptions,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    protected: Iterable[int] = (),
    now: float | None = None,
) -> GcReport:
    """Remove uncommitted ``step-N/`` prefixes and stale multipart uploads under a root."""
    now = time.time() if now is None else now
    prefix = root_prefix(root_key)
    protected = set(protected)
    report = GcReport(dry_run=dry_run)
    listing = list(store.list(prefix))
    by_step: dict[str, list[ObjectInfo]] = {}
    for obj in listing:
        head, sep, _ = obj.key[len(prefix) :].partition("/")
        step = parse_step(head)
        if sep and step is not None and step not in protected:
            by_step.setdefault(prefix + head + "/", []).append(obj)
    for step_prefix, objects in sorted(by_step.items()):
        if any(o.key == step_prefix + MARKER_NAME for o in objects):
            continue  # committed
        newest = max((o.mtime or now) for o in objects)
        if now - newest < grace_seconds:
            report.skipped_young.append(store.url(step_prefix))
            continue
        report.prefixes.append((store.url(step_prefix), len(objects), sum(o.size for o in objects)))
        if not dry_run:
            delete_prefix(store, step_prefix, options, objects)
    uploads = list(store.list_multipart(prefix))
    for upload in uploads:
        age = now - upload.initiated if upload.initiated is not None else float("inf")
        if age < grace_seconds:
            continue
        report.uploads.append((store.url(upload.key), upload.upload_id, age))
        if not dry_run:
            store.abort_multipart(upload)
    return report
