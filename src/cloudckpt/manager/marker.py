"""Checkpoint layout and the commit marker: the one answer to "is it committed?".

A managed checkpoint is the prefix ``ROOT/step-000000123/``: its payload objects, then a
small JSON marker ``ROOT/step-000000123/_CHECKPOINT.json`` written LAST, create-only (the
commit protocol of format/commit.py). A prefix without a marker is not a checkpoint,
however many bytes it holds; every reader decides through :func:`read_marker` /
:func:`list_checkpoints`, and deletion removes the marker FIRST.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.proof import replaced
from ..errors import CorruptCheckpointError, InvalidURLError, NotFoundError
from ..format.commit import MANAGER_MARKER, commit_marker, read_committed
from ..io.scheduler import TransferGroup
from ..options import TransferOptions
from ..store import ObjectInfo, Store, check_key
from ..store.paths import MAX_RECORD_BYTES, check_prefix, read_capped

__all__ = [
    "MARKER_FORMAT",
    "MARKER_NAME",
    "CheckpointInfo",
    "DamagedMarker",
    "FileEntry",
    "Written",
    "check_etag",
    "check_files",
    "check_remote",
    "commit_step",
    "decode_marker",
    "encode_marker",
    "list_checkpoints",
    "marker_key",
    "parse_step",
    "read_marker",
    "root_prefix",
    "step_dir",
    "write_marker",
]

MARKER_NAME = MANAGER_MARKER
MARKER_FORMAT = "cloudckpt.checkpoint/1"
_STEP_RE = re.compile(r"^step-(\d+)$")

log = logging.getLogger("cloudckpt")


def step_dir(step: int) -> str:
    """The directory name of ``step``: ``step-000000123`` (sorts by step as text too)."""
    return f"step-{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step-N`` directory name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def root_prefix(root_key: str) -> str:
    """The key prefix under which a root's checkpoints live (``""`` for a bucket root)."""
    root_key = root_key.strip("/")
    return root_key + "/" if root_key else ""


def marker_key(root_key: str, step: int) -> str:
    return f"{root_prefix(root_key)}{step_dir(step)}/{MARKER_NAME}"


@dataclass(frozen=True)
class FileEntry:
    """One payload object of a checkpoint, relative to its step prefix."""

    name: str
    size: int
    etag: str | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its marker describes it."""

    step: int
    url: str  # the step prefix, ending in "/"
    time: float
    size: int
    kind: str  # "object" (one torch.save archive) or "dcp" (a DCP directory)
    files: tuple[FileEntry, ...] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    library_version: str = ""
    #: How many processes saved it, where recorded (a local tier's commit in a job of
    #: several processes: it decides whether another world size may read that copy);
    #: 0: not recorded (and not written into the marker).
    ranks: int = 0
    #: Where the step is committed, for a manager with a local tier: ``"local"``,
    #: ``"remote"`` or both (empty: not said; never stored in the marker).
    tiers: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (used by ``--json`` output)."""
        return {
            "step": self.step,
            "url": self.url,
            "time": self.time,
            "size": self.size,
            "kind": self.kind,
            "files": [{"name": f.name, "size": f.size, "etag": f.etag} for f in self.files],
            "metrics": {k: _float_out(v) for k, v in self.metrics.items()},
            "metadata": dict(self.metadata),
            "library_version": self.library_version,
            "ranks": self.ranks,
            "tiers": list(self.tiers),
        }


@dataclass(frozen=True)
class DamagedMarker:
    """A step whose commit marker exists but cannot be decoded, or names another step:
    a damaged checkpoint (neither committed nor a leftover; docs/manager.md)."""

    step: int
    url: str  # the marker's URL
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "url": self.url, "reason": self.reason}


def _float_out(value: float) -> float | str:
    """JSON has no NaN or infinities: write them as strings so any parser reads the marker."""
    value = float(value)
    return value if math.isfinite(value) else repr(value)  # 'nan', 'inf', '-inf'


def _float_in(value: Any) -> float:
    return float(value)  # float('nan') / float('inf') parse the strings above


def encode_marker(info: CheckpointInfo) -> bytes:
    body = info.as_dict()
    del body["url"]  # where it lives is known from where it was read
    del body["tiers"]  # so is which tier holds it
    if not info.ranks:
        del body["ranks"]  # not recorded: the marker stays as readers before it knew
    body = {"format": MARKER_FORMAT, **body}
    return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode()


def _count(value: Any, what: str) -> int:
    """A non-negative integer field (JSON has no other kind of count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {_short(value)}, not a non-negative integer")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what} is {_short(value)}, not a number")
    return float(value)  # OverflowError for ints beyond a float: caught by the caller


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _file(value: Any, url: str) -> FileEntry:
    if not isinstance(value, dict):
        raise ValueError(f"a file entry is {_short(value)}, not an object")
    name, etag = value.get("name"), value.get("etag")
    if not isinstance(name, str):
        raise ValueError(f"a file name is {_short(name)}, not a string")
    if etag is not None and not isinstance(etag, str):
        raise ValueError(f"the etag of {name!r} is {_short(etag)}, not a string")
    return FileEntry(check_key(name, url), _count(value.get("size"), f"size of {name!r}"), etag)


def decode_marker(data: bytes, url: str) -> CheckpointInfo:
    """Parse a marker; anything malformed is a CorruptCheckpointError naming ``url``.

    Every field is checked for its type (a step, a size: non-negative integers; file
    names: keys that stay inside the checkpoint's prefix).
    """
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("format") != MARKER_FORMAT:
            found = body.get("format") if isinstance(body, dict) else body
            raise ValueError(f"format is {_short(found)}, expected {MARKER_FORMAT!r}")
        files, metrics = body["files"], body.get("metrics", {})
        metadata = body.get("metadata", {})
        if not isinstance(files, list):
            raise ValueError(f"files is {_short(files)}, not a list")
        if not isinstance(metrics, dict) or not isinstance(metadata, dict):
            raise ValueError("metrics and metadata must be JSON objects")
        kind, version = body["kind"], body.get("library_version", "")
        if not isinstance(kind, str) or not isinstance(version, str):
            raise ValueError("kind and library_version must be strings")
        return CheckpointInfo(
            step=_count(body["step"], "step"),
            url=url.rsplit("/", 1)[0] + "/",
            time=_number(body["time"], "time"),
            size=_count(body["size"], "size"),
            kind=kind,
            files=tuple(_file(f, url) for f in files),
            metrics={str(k): _float_in(_number(v, f"metric {k!r}")) for k, v in metrics.items()},
            metadata=metadata,
            library_version=version,
            ranks=_count(body.get("ranks", 0), "ranks"),
        )
    except InvalidURLError as exc:  # a file name that would leave the checkpoint's prefix
        raise CorruptCheckpointError(f"{url} is not a valid checkpoint marker: {exc}") from exc
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        # ValueError covers bad JSON and UnicodeDecodeError; RecursionError, JSON nested
        # too deep; OverflowError, a number too large for a float.
        raise CorruptCheckpointError(f"{url} is not a valid checkpoint marker: {exc}") from exc


def write_marker(store: Store, key: str, info: CheckpointInfo) -> None:
    """Commit a checkpoint: create its marker (after its payload), create-only.

    Raises AlreadyExistsError when another marker is already there; this call's own
    retried write is success (format/commit.py).
    """
    commit_marker(store, key, encode_marker(info))


def commit_step(
    store: Store,
    prefix: str,
    step: int,
    kind: str,
    metrics: Mapping[str, float],
    metadata: Mapping[str, Any],
    when: float | None = None,
    ranks: int = 0,
    files: Mapping[str, Written | int | None] | None = None,
) -> CheckpointInfo:
    """Commit the step whose payload is under ``prefix`` (ends in ``/``): list its
    objects, then write its marker recording their sizes and ETags (after the payload).

    ``when`` is the commit time to record (default now): a drained copy keeps the time
    of its local commit, so a retried drain writes the same marker bytes. ``ranks``:
    how many processes saved it, recorded when not 0. ``files``: the names this save
    wrote, each with what it knows of it (:class:`Written`: the size, and the ETag its
    upload got; or the size alone); the marker then records exactly those (any other
    object under ``prefix`` is another save's and left out), and one missing, of another
    size or of another ETag fails the commit (see :func:`_written`).
    """
    listed = [o for o in store.list(prefix) if o.key != prefix + MARKER_NAME]
    if files is not None:
        listed = _written(store, prefix, step, listed, files)
    entries = tuple(
        FileEntry(o.key[len(prefix) :], o.size, o.etag.strip('"') if o.etag else None)
        for o in listed
    )
    if not entries:
        raise NotFoundError(f"the payload of step {step} is missing under {store.url(prefix)}")
    from .._version import __version__

    info = CheckpointInfo(
        step=step,
        url=store.url(prefix),
        time=time.time() if when is None else when,
        size=sum(f.size for f in entries),
        kind=kind,
        files=entries,
        metrics=dict(metrics),
        metadata=dict(metadata),
        library_version=__version__,
        ranks=ranks,
    )
    write_marker(store, prefix + MARKER_NAME, info)
    return info


@dataclass(frozen=True)
class Written:
    """What a save knows of one file it wrote, for its commit (:func:`commit_step`):
    the size, and the ETag the store gave its upload (None: not known, or none given)."""

    size: int | None
    etag: str | None = None


def _written(
    store: Store,
    prefix: str,
    step: int,
    listed: Sequence[ObjectInfo],
    files: Mapping[str, Written | int | None],
) -> list[ObjectInfo]:
    """The objects of ``listed`` that are this save's ``files`` (in listing order).

    A name of ``files`` not listed is NotFoundError; one listed at another size, or
    with another ETag than the store gave this save's upload of it, is
    CorruptCheckpointError: another save of the step removed or rewrote it, and
    committing would record its bytes as this save's (two runs saving one step with the
    same shapes write files of the same sizes: only the ETag tells them apart). Objects
    not in ``files`` are left out with a WARNING naming them."""
    mine = [o for o in listed if o.key[len(prefix) :] in files]
    found = {o.key[len(prefix) :]: o for o in mine}
    for name, given in sorted(files.items()):
        wrote = given if isinstance(given, Written) else Written(given)
        url = store.url(prefix + name)
        o = found.get(name)
        if o is None:
            raise NotFoundError(
                f"{url}, written by this save of step {step}, is missing at its commit "
                "(another save of the step may have removed it); nothing committed"
            )
        if wrote.size is not None and o.size != wrote.size:
            raise CorruptCheckpointError(
                f"{url} holds {o.size} bytes at the commit of step {step}, whose save "
                f"wrote {wrote.size} (another save of the step rewrote it); nothing committed"
            )
        if replaced(wrote.etag, o.etag):
            there, made = (o.etag or "").strip('"'), (wrote.etag or "").strip('"')
            raise CorruptCheckpointError(
                f"{url} is not the object this save of step {step} wrote, at its commit "
                f"(ETag {there}, its upload's {made}: another save of the step rewrote it); "
                "nothing committed"
            )
    others = sorted(o.key[len(prefix) :] for o in listed if o.key[len(prefix) :] not in files)
    if others:
        log.warning(
            "left out of the marker of step %d under %s, not written by this save: %s%s",
            step,
            store.url(prefix),
            ", ".join(others[:5]),
            f" and {len(others) - 5} more" if len(others) > 5 else "",
        )
    return mine


def check_files(store: Store, prefix: str, info: CheckpointInfo, skip: Sequence[str] = ()) -> None:
    """Every file the marker ``info`` lists (but those in ``skip``) is under ``prefix``
    of ``store`` at its size: else NotFoundError, or CorruptCheckpointError naming the
    file, both sizes and the marker's checkpoint."""
    for f in info.files:
        if f.name in skip:
            continue
        found = store.head(prefix + f.name)  # NotFoundError when missing
        if found.size != f.size:
            raise CorruptCheckpointError(
                f"{store.url(prefix + f.name)} holds {found.size} bytes, its marker "
                f"({info.url}) says {f.size}"
            )


def check_etag(url: str, step: int, found: str | None, recorded: str | None) -> None:
    """CorruptCheckpointError naming ``url`` and ``step`` when the object's ETag is not
    the one its marker recorded (as ``cloudckpt verify`` checks): another step's file
    of the same size, or one rewritten since the commit."""
    if recorded and found and recorded.strip('"') != found.strip('"'):
        raise CorruptCheckpointError(
            f"{url} changed since step {step} was committed (ETag differs from its "
            "marker's): not the file the marker committed"
        )


def check_remote(store: Store, prefix: str, info: CheckpointInfo) -> None:
    """Every file the marker ``info`` lists is under ``prefix`` of ``store`` at its size
    and ETag (one listing, before a download): else NotFoundError naming the file and
    the marker, or CorruptCheckpointError naming the file."""
    found = {o.key[len(prefix) :]: o for o in store.list(prefix)}
    for f in info.files:
        if f.name == MARKER_NAME:
            continue
        url = store.url(prefix + f.name)
        o = found.get(f.name)
        if o is None:
            raise NotFoundError(f"{url} is missing: its marker {info.url} lists it")
        if o.size != f.size:
            raise CorruptCheckpointError(f"{url} holds {o.size} bytes, its marker says {f.size}")
        check_etag(url, info.step, o.etag, f.etag)


def read_marker(store: Store, key: str) -> CheckpointInfo | None:
    """The checkpoint committed by the marker at ``key``; None when there is no marker
    (a missing bucket raises BucketNotFoundError).

    A marker in a ``step-N/`` directory that names another step is corrupt (as in
    :func:`list_checkpoints`, which skips it).
    """
    url = store.url(key)
    data = read_committed(store, key)
    if data is None:
        return None
    info = decode_marker(data, url)
    parts = key.rstrip("/").split("/")
    expected = parse_step(parts[-2]) if len(parts) >= 2 else None
    if expected is not None and info.step != expected:
        raise CorruptCheckpointError(
            f"{url} is not a valid checkpoint marker: it names step {info.step}, "
            f"in the directory of step {expected}"
        )
    return info


def list_checkpoints(
    store: Store,
    root_key: str,
    options: TransferOptions,
    cache: dict[tuple[str, int], CheckpointInfo] | None = None,
    listing: Sequence[ObjectInfo] | None = None,
    damaged: list[DamagedMarker] | None = None,
) -> list[CheckpointInfo]:
    """Committed checkpoints under a root, oldest step first.

    One listing of the root, then one GET per marker (in parallel; ``cache``, keyed by
    marker key and size, skips markers already read since they never change). Payload
    objects are never HEADed; ``listing`` reuses a listing of the root already made. A
    marker that cannot be decoded, or names another step, is a damaged checkpoint: it
    is left out with a WARNING naming the step and the marker, and added to ``damaged``
    (oldest step first) when given. A marker deleted since the listing is left out.
    """
    prefix = root_prefix(root_key)
    found: list[tuple[str, int]] = []
    if listing is None:
        listing = list(store.list(prefix))
        if not listing and root_key:  # say why an object's URL holds no checkpoints
            check_prefix(store, root_key, "a CheckpointManager root")
    for obj in listing:
        rest = obj.key[len(prefix) :]
        parts = rest.split("/")
        if len(parts) == 2 and parts[1] == MARKER_NAME and parse_step(parts[0]) is not None:
            found.append((obj.key, obj.size))
    results: dict[str, CheckpointInfo] = {}
    broken: dict[str, str] = {}  # marker key -> why it cannot be read
    todo = []
    for key, size in found:
        hit = cache.get((key, size)) if cache is not None else None
        if hit is not None:
            results[key] = hit
        else:
            todo.append((key, size))
    if todo:
        group = TransferGroup(options, options.read_concurrency)

        def fetch(key: str, size: int) -> None:
            try:
                # One ranged GET: the listing gave the size (markers never change); one
                # over the cap is refused from that size, unread, and skipped.
                data = read_capped(store, key, MAX_RECORD_BYTES, size=size, what="marker")
                info = decode_marker(data, store.url(key))
            except NotFoundError:
                return  # deleted since the listing
            except CorruptCheckpointError as exc:
                broken[key] = str(exc)
                return
            results[key] = info
            if cache is not None:
                cache[(key, size)] = info

        for key, size in todo:
            group.submit(functools.partial(fetch, key, size), f"read marker {store.url(key)}")
        group.wait()
    out = []
    bad = []
    for key, _ in found:
        step = parse_step(key[len(prefix) :].split("/")[0])
        assert step is not None  # only step-N/ markers were collected
        info = results.get(key)
        if info is not None and info.step == step:
            out.append(info)
        elif info is not None:
            url = store.url(key)
            bad.append(
                DamagedMarker(
                    step,
                    url,
                    f"{url} is not a valid checkpoint marker: it names step {info.step}, "
                    f"in the directory of step {step}",
                )
            )
        elif key in broken:
            bad.append(DamagedMarker(step, store.url(key), broken[key]))
    bad.sort(key=lambda d: d.step)
    for d in bad:
        log.warning(
            "step %d is damaged: its commit marker %s cannot be used (%s); skipped",
            d.step,
            d.url,
            d.reason,
        )
    if damaged is not None:
        damaged.extend(bad)
    return sorted(out, key=lambda c: c.step)
