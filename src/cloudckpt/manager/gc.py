"""Collecting what failed saves left behind (removing one: ``engine/remove.py``).

Leftovers are (1) ``step-N/`` prefixes with objects but no marker and (2) multipart
uploads under the root never completed or aborted (:func:`find_leftovers`, with their
ages). Garbage is the leftovers older than the grace period (a save that died); a
younger one may still be running, so gc keeps it and says so. On the filesystem an
upload is a temp file its writer holds locked (store/local.py): one whose lock is held
by another live process is kept whatever its age; with ``trust_locks`` (a node-local
directory: a local tier) so is one this process writes, and one whose lock can be
taken is garbage whatever its age (its writer is gone). A run root on a shared
filesystem keeps the grace period for those too: a mount without working locks lets
every lock be taken.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..engine.remove import remove_checkpoint
from ..options import TransferOptions
from ..store import MultipartUpload, ObjectInfo, Store
from .marker import MARKER_NAME, parse_step, root_prefix

__all__ = [
    "GcReport",
    "Leftover",
    "collect_garbage",
    "find_leftovers",
]

#: Default grace period: a save that has not touched its prefix for an hour is dead.
DEFAULT_GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class Leftover:
    """One thing a failed (or still running) save left under a run root."""

    #: ``"prefix"``: a ``step-N/`` prefix with objects but no commit marker;
    #: ``"upload"``: a multipart upload opened and never completed or aborted.
    kind: str
    url: str
    #: Seconds since the prefix's newest object was written, or since the upload was
    #: opened (``inf`` when the store does not say).
    age_s: float
    #: Younger than the grace period: gc leaves it alone (the save may still be running).
    kept: bool
    objects: int = 0
    bytes: int = 0
    upload_id: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The leftover for ``--json`` (an unknown age as None)."""
        return {
            "kind": self.kind,
            "url": self.url,
            "age_s": None if self.age_s == float("inf") else round(self.age_s, 3),
            "kept": self.kept,
            "objects": self.objects,
            "bytes": self.bytes,
            "upload_id": self.upload_id,
        }


@dataclass
class GcReport:
    """What a garbage collection removed (or, in a dry run, would remove), and what it
    kept because it was younger than the grace period."""

    dry_run: bool
    #: Uncommitted step prefixes: (url, number of objects, bytes).
    prefixes: list[tuple[str, int, int]] = field(default_factory=list)
    #: Stale multipart uploads: (url, upload id, seconds since initiated).
    uploads: list[tuple[str, str, float]] = field(default_factory=list)
    #: Uncommitted prefixes left alone because they are younger than the grace period.
    skipped_young: list[str] = field(default_factory=list)
    #: Every leftover found, removed or kept, with its age (:func:`find_leftovers`).
    leftovers: list[Leftover] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.prefixes)

    @property
    def kept(self) -> list[Leftover]:
        """The leftovers within the grace period (left alone)."""
        return [x for x in self.leftovers if x.kept]


def find_leftovers(
    store: Store,
    root_key: str,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    protected: Iterable[int] = (),
    now: float | None = None,
    listing: Iterable[ObjectInfo] | None = None,
    trust_locks: bool = False,
) -> list[Leftover]:
    """Uncommitted ``step-N/`` prefixes and open multipart uploads under a root, each with
    its age and whether the grace period keeps it: the plan :func:`collect_garbage` acts
    on, and what ``cloudckpt ls --all`` shows. ``listing`` is the root's listing if the
    caller has it already. The steps in ``protected`` (saves in flight) are left out,
    their prefixes and their uploads. An upload on the filesystem whose writer lives is
    kept, and so is its step's prefix whatever its age (a save between its payload and
    its marker holds a lock there: LocalTier.clear); with ``trust_locks`` an upload whose
    writer is gone is not kept (module docstring)."""
    now = time.time() if now is None else now
    prefix = root_prefix(root_key)
    protected = set(protected)
    by_step: dict[str, list[ObjectInfo]] = {}
    for obj in store.list(prefix) if listing is None else listing:
        head, sep, _ = obj.key[len(prefix) :].partition("/")
        step = parse_step(head)
        if obj.key.startswith(prefix) and sep and step is not None and step not in protected:
            by_step.setdefault(prefix + head + "/", []).append(obj)
    alive = getattr(store, "upload_alive", None)  # the filesystem: its writer's lock
    uploads: list[Leftover] = []
    busy: set[str] = set()  # step prefixes a live process writes (its temp files, its lock)
    for upload in store.list_multipart(prefix):
        age = now - upload.initiated if upload.initiated is not None else float("inf")
        head, sep, _ = upload.key[len(prefix) :].partition("/")
        if sep and parse_step(head) in protected:
            continue  # a save (or drain) in flight writes it
        live = alive(upload, own=trust_locks) if callable(alive) else None
        if live and sep and parse_step(head) is not None:
            busy.add(prefix + head + "/")
        by_age = live is None or (live is False and not trust_locks)
        kept = age < grace_seconds if by_age else bool(live)
        uploads.append(
            Leftover("upload", store.url(upload.key), age, kept=kept, upload_id=upload.upload_id)
        )
    found: list[Leftover] = []
    for step_prefix, objects in sorted(by_step.items()):
        if any(o.key == step_prefix + MARKER_NAME for o in objects):
            continue  # committed
        age = now - max((o.mtime or now) for o in objects)
        found.append(
            Leftover(
                "prefix",
                store.url(step_prefix),
                age,
                kept=age < grace_seconds or step_prefix in busy,
                objects=len(objects),
                bytes=sum(o.size for o in objects),
            )
        )
    found += uploads
    return found


def collect_garbage(
    store: Store,
    root_key: str,
    options: TransferOptions,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    protected: Iterable[int] = (),
    now: float | None = None,
    trust_locks: bool = False,
) -> GcReport:
    """Remove uncommitted ``step-N/`` prefixes and multipart uploads older than the grace
    period under a root; the report lists the younger ones too, as kept. On the
    filesystem, uploads as :func:`find_leftovers` says (``trust_locks``)."""
    leftovers = find_leftovers(
        store,
        root_key,
        grace_seconds=grace_seconds,
        protected=protected,
        now=now,
        trust_locks=trust_locks,
    )
    report = GcReport(dry_run=dry_run, leftovers=leftovers)
    base = store.url("")
    for item in leftovers:
        if item.kind == "prefix" and item.kept:
            report.skipped_young.append(item.url)
        elif item.kind == "prefix":
            report.prefixes.append((item.url, item.objects, item.bytes))
            if not dry_run:
                remove_checkpoint(store, item.url[len(base) :], options)
    for item in leftovers:
        if item.kind == "upload" and not item.kept:
            assert item.upload_id is not None
            report.uploads.append((item.url, item.upload_id, item.age_s))
            if not dry_run:
                key = item.url[len(base) :]
                store.abort_multipart(MultipartUpload(key=key, upload_id=item.upload_id))
                tidy = getattr(store, "remove_prefix_dir", None)  # the filesystem's folder
                if callable(tidy) and "/" in key:
                    tidy(key.rpartition("/")[0] + "/")
    return report
