"""A local tier's drain records: how far the drain of each local checkpoint got, one
file per checkpoint name, ``_DRAINS/<name>.json`` in the tier (docs/tiers.md, "What a
drain keeps").

Every tier keeps them the same way: the manager's (``manager/tiers.py``, names
``step-N``), NeMo's (``nemo/tier.py``, NeMo's checkpoint names) and Lightning's
(``lightning/tier.py``, file names such as ``epoch=3-step=40.ckpt``). A record
says which local commit it belongs to (its time), the bucket it drains to, the objects
the drain wrote or proved there (size, ETag and time as the bucket gave them), whether
the bucket committed it, and the states a tier may need: ``started`` (a drain of this
commit has begun: the manager's tier writes no record before), ``due`` (Lightning:
still to be sent) and ``unlisted`` (Lightning: named without the bucket's listing). So "is
this checkpoint drained?" is answered from the tier itself, without asking the bucket.

A name is one path component: anything that could leave ``_DRAINS/`` (``/``, ``..``, a
NUL) is refused with InvalidURLError before any file is touched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, InvalidURLError, NotFoundError
from ..store import ObjectInfo, Store
from ..store.paths import MAX_RECORD_BYTES, read_capped

__all__ = [
    "JOURNAL_DIR",
    "JOURNAL_FORMAT",
    "DrainJournal",
    "DrainRecord",
    "check_name",
    "identity",
    "matches",
    "size_and_etag",
]

log = logging.getLogger("cloudckpt")

#: The folder of a tier's drain records: ``_DRAINS/<name>.json`` per checkpoint.
JOURNAL_DIR = "_DRAINS"
JOURNAL_FORMAT = "cloudckpt.drain/2"
#: The manager's records before NeMo and Lightning kept theirs here (read as they are).
_FORMATS = ("cloudckpt.drain/1", JOURNAL_FORMAT)
_SUFFIX = ".json"
#: The longest name kept (a file name holds 255 bytes, the suffix included).
_MAX_NAME_BYTES = 200


@dataclass(frozen=True)
class DrainRecord:
    """How far the drain of one local commit to the bucket ``remote`` got."""

    #: The local commit it belongs to: its marker's time (a file's modification time
    #: for Lightning); None when not known (a record of an earlier release).
    time: float | None
    remote: str
    #: The objects the drain wrote or proved in the bucket: {name: :func:`identity`}.
    objects: Mapping[str, str] = field(default_factory=dict)
    #: Whether the bucket committed this local commit.
    committed: bool = False
    #: A drain of this commit has begun (the manager's tier, NeMo's on it, writes its
    #: records from a drain only; an earlier release's NeMo: the folder was emptied).
    started: bool = False
    #: Lightning: the local copy waits to be sent.
    due: bool = False
    #: Lightning: the name was chosen while the bucket's directory could not be listed;
    #: the drain sends it over a bucket object only when ``objects`` names that object.
    unlisted: bool = False


def check_name(name: object) -> str:
    """``name`` when it can name a record (one path component, not ``.`` or ``..``, no
    NUL or backslash, at most 200 bytes); else InvalidURLError naming it."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(c in name for c in "/\\\x00")
        or len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES
    ):
        raise InvalidURLError(
            f"{name!r} cannot name a drain record: a checkpoint name is one path "
            f"component (no '/', '\\\\' or NUL, not '.' or '..', at most {_MAX_NAME_BYTES} bytes)"
        )
    return name


def identity(o: ObjectInfo) -> str:
    """What the bucket says of one object, as a record keeps it: size, ETag and time;
    any other write of that key changes at least one of them."""
    etag = (o.etag or "").strip('"')
    return f"{o.size}:{etag}:{'' if o.mtime is None else repr(float(o.mtime))}"


def size_and_etag(recorded: str | None) -> tuple[int | None, str] | None:
    """(size, ETag) of an :func:`identity` a record kept (None: none recorded; a size
    of None: not known, in a record converted from an earlier release's)."""
    if recorded is None:
        return None
    size, _, rest = recorded.partition(":")
    etag = rest.rpartition(":")[0]
    if size.isdigit():
        return int(size), etag
    return (None, etag) if not size else None


def matches(recorded: str | None, size: int, etag: str | None) -> bool:
    """Whether an object of ``size`` and ``etag`` is the one ``recorded`` describes, by
    size and ETag (times are not compared: a HEAD and a listing differ in precision)."""
    found = size_and_etag(recorded)
    if found is None:
        return False
    known, tag = found
    return (known is None or known == size) and tag == (etag or "").strip('"')


class DrainJournal:
    """The drain records of the local tier ``store`` for the bucket ``remote``: read,
    written and forgotten here only, each by its checkpoint name."""

    def __init__(self, store: Store, remote: str) -> None:
        self.store, self.remote = store, remote

    @staticmethod
    def key(name: str) -> str:
        """The key of ``name``'s record (InvalidURLError for a name that is not one)."""
        return f"{JOURNAL_DIR}/{check_name(name)}{_SUFFIX}"

    def read(self, name: str, time: float | None = None) -> DrainRecord | None:
        """``name``'s record; None when there is none, it is of another bucket, or of
        another local commit than the one at ``time`` (when given), or it cannot be read
        (a WARNING: it then proves nothing)."""
        key = self.key(name)
        try:
            body = json.loads(read_capped(self.store, key, MAX_RECORD_BYTES, what="drain record"))
            record = _decode(body)
        except NotFoundError:
            return None
        except (ValueError, KeyError, TypeError, CorruptCheckpointError) as exc:
            log.warning("ignoring the drain record %s: %s", self.store.url(key), exc)
            return None
        if record.remote != self.remote:
            return None
        if time is not None and record.time != time:
            return None  # an earlier commit of this name: proves nothing of this one
        return record

    def write(self, name: str, record: DrainRecord) -> None:
        """Write ``name``'s record (atomically: the store's temp file and rename)."""
        body = {
            "format": JOURNAL_FORMAT,
            "name": name,
            "time": record.time,
            "remote": record.remote,
            "objects": dict(sorted(record.objects.items())),
            "committed": record.committed,
            "started": record.started,
            "due": record.due,
            "unlisted": record.unlisted,
        }
        self.store.put(self.key(name), json.dumps(body, sort_keys=True).encode())

    def forget(self, name: str) -> None:
        """Delete ``name``'s record (its local copy is gone, or replaced)."""
        self.store.delete(self.key(name))

    def names(self) -> list[str]:
        """The names that have a record, sorted (a file that cannot name one is skipped)."""
        found = []
        for o in self.store.list(f"{JOURNAL_DIR}/"):
            rel = o.key[len(JOURNAL_DIR) + 1 :]
            name = rel[: -len(_SUFFIX)]
            if rel.endswith(_SUFFIX) and "/" not in rel:
                try:
                    found.append(check_name(name))
                except InvalidURLError:
                    continue
        return sorted(found)


def _decode(body: Any) -> DrainRecord:
    """A record from its JSON (either format); ValueError or TypeError when it is none."""
    if not isinstance(body, dict) or body.get("format") not in _FORMATS:
        raise ValueError(f"format is not {JOURNAL_FORMAT!r}")
    objects, time, remote = body["objects"], body["time"], body["remote"]
    if not isinstance(objects, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in objects.items()
    ):
        raise TypeError("objects must map names to strings")
    if time is not None and (isinstance(time, bool) or not isinstance(time, (int, float))):
        raise TypeError("time must be a number")
    flags = {k: body.get(k, False) for k in ("committed", "started", "due", "unlisted")}
    if not isinstance(remote, str) or not all(isinstance(v, bool) for v in flags.values()):
        raise TypeError("remote must be a string, committed, started, due and unlisted booleans")
    return DrainRecord(time=time, remote=remote, objects=objects, **flags)
