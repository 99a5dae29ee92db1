"""A local tier's peer copy (``replicate_to_peer=True``, docs/tiers.md "Peer copy").

The local directories of a job form a ring in rank order (a directory is its host name
and path; its first rank owns it). After each local commit every directory's files are
also sent to the next directory's owner over the checkpoint's gloo group, which keeps
them under ``_peers/rank-R/step-N/`` (R: the sending owner's global rank), committed by
the same marker, written last. On restore, a directory that lacks the chosen step (a
replaced node) gets it back from the directory holding its copy before anything is
loaded, so the step is read from local disks and not from the bucket.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.remove import remove_checkpoint
from ..errors import CorruptCheckpointError, NotFoundError
from ..ranks.collectives import agree, group_rank, settle
from ..ranks.groups import group_ranks
from ..store import Store
from ..store.base import MultipartUpload, UploadedPart
from ..store.paths import MAX_RECORD_BYTES, read_capped
from .marker import MARKER_NAME, decode_marker, list_checkpoints, step_dir
from .retention import KeepLast, to_delete
from .tiers import LocalTier

__all__ = ["PEERS", "Ring", "held", "peer_prefix", "receive_missing", "replicate", "ring"]

log = logging.getLogger("cloudckpt")

#: The folder of a local tier that holds the copies of other directories.
PEERS = "_peers"
_SOURCE = re.compile(r"rank-(\d+)")


def peer_root(source: int) -> str:
    return f"{PEERS}/rank-{source}"


def peer_prefix(source: int, step: int) -> str:
    return f"{peer_root(source)}/{step_dir(step)}/"


@dataclass(frozen=True)
class Ring:
    """The job's local directories in rank order, as every rank sees them alike."""

    #: Global rank of each group index.
    ranks: tuple[int, ...]
    #: Each group index's directory (host name, path).
    dirs: tuple[tuple[str, str], ...]
    #: This process's group index.
    me: int

    @property
    def owners(self) -> list[int]:
        """Group index of each directory's first rank, in rank order."""
        return [i for i, d in enumerate(self.dirs) if self.dirs.index(d) == i]

    def owner_of(self, index: int) -> int:
        return self.dirs.index(self.dirs[index])

    def holder_of(self, owner: int) -> int | None:
        """The owner keeping ``owner``'s copy (the next directory), None alone."""
        owners = self.owners
        if len(owners) < 2:
            return None
        return owners[(owners.index(owner) + 1) % len(owners)]

    def source_of(self, holder: int) -> int | None:
        """The owner whose copy ``holder`` keeps (the previous directory), None alone."""
        owners = self.owners
        if len(owners) < 2:
            return None
        return owners[(owners.index(holder) - 1) % len(owners)]

    @property
    def owns(self) -> bool:
        return self.owner_of(self.me) == self.me


def ring(tier: LocalTier, group: Any) -> Ring:
    """Every rank's directory (one ``agree`` on ``group``)."""
    mine = (socket.gethostname(), str(tier.path.resolve()))
    dirs = agree(value=mine, group=group).values
    return Ring(tuple(group_ranks(group)), tuple(dirs), group_rank(group)[0])


def held(tier: LocalTier) -> dict[int, list[int]]:
    """The peer copies in ``tier``: sending owner's global rank -> its steps held whole."""
    out: dict[int, list[int]] = {}
    base = tier.path / PEERS
    if not tier.owned or not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        match = _SOURCE.fullmatch(d.name)
        if match is None:
            continue
        source = int(match.group(1))
        steps = []
        for info in list_checkpoints(tier.store, peer_root(source), tier.options):
            try:
                tier.check_files(info, peer_prefix(source, info.step))
            except (CorruptCheckpointError, NotFoundError):
                continue
            steps.append(info.step)
        out[source] = steps
    return out


class _Files:
    """Reads and writes of one step's files under a prefix of a local tier's store:
    each incoming file is a multipart upload of the local store (published whole, or
    not at all)."""

    def __init__(self, tier: LocalTier, prefix: str) -> None:
        self.tier, self.prefix = tier, prefix
        self.store: Store = tier.store
        self._open: dict[str, tuple[MultipartUpload, list[UploadedPart]]] = {}

    def read(self, name: str, offset: int, view: memoryview) -> None:
        with open(self.tier.path / self.prefix / name, "rb") as f:
            f.seek(offset)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptCheckpointError(
                        f"{self.store.url(self.prefix + name)} ended at {offset + got} bytes, "
                        f"short of its marker's size"
                    )
                got += n

    def write(self, name: str, offset: int, view: memoryview, last: bool) -> None:
        key = self.prefix + name
        if name not in self._open:
            self._open[name] = (self.store.create_multipart(key), [])
        upload, parts = self._open[name]
        if len(view):
            parts.append(self.store.upload_part(upload, len(parts) + 1, view, offset))
        if last:
            del self._open[name]
            if parts:
                self.store.complete_multipart(upload, parts)
            else:
                self.store.abort_multipart(upload)
                self.store.put(key, b"")

    def abort(self) -> None:
        for upload, _ in self._open.values():
            try:
                self.store.abort_multipart(upload)
            except Exception as exc:  # the failure that got us here is the one reported
                log.debug("aborting %s: %s", upload.key, exc)
        self._open.clear()


def _send(
    tier: LocalTier,
    group: Any,
    step: int,
    *,
    what: str,
    send: tuple[int, str] | None,
    receive: tuple[int, str] | None,
) -> bytes | None:
    """One exchange of a step's files: this rank sends those under its prefix ``send``
    = (to group index, prefix) and receives the files from ``receive`` = (from group
    index, prefix), each with the sender's marker, written after every file is whole
    and every rank succeeded. Raises on every rank when any rank failed; returns the
    marker this rank wrote (None when it received nothing)."""
    from ..ranks.peers import pass_files  # torch: only when copies move

    outgoing: list[tuple[str, int]] = []
    marker: bytes | None = None
    error: BaseException | None = None
    if send is not None:
        try:
            source = read_capped(tier.store, send[1] + MARKER_NAME, MAX_RECORD_BYTES)
            info = decode_marker(source, tier.store.url(send[1] + MARKER_NAME))
            outgoing = [(f.name, f.size) for f in info.files]
            marker = source
        except Exception as exc:
            error = exc
    headers = agree(error, value=(outgoing, marker), group=group)
    headers.raise_failures(what)
    ranks = group_ranks(group)
    incoming, their_marker = ([], None) if receive is None else headers.values[receive[0]]
    files = _Files(tier, receive[1] if receive is not None else "")
    reader = _Files(tier, send[1] if send is not None else "")
    error = pass_files(
        group,
        send_to=None if send is None else ranks[send[0]],
        outgoing=outgoing,
        read=reader.read,
        recv_from=None if receive is None else ranks[receive[0]],
        incoming=incoming,
        write=files.write,
    )
    if error is not None:
        files.abort()
    settle(error, what, group=group)
    if receive is None or their_marker is None:
        return None
    tier.store.put(receive[1] + MARKER_NAME, their_marker)  # last: commits the copy
    return bytes(their_marker)


def replicate(tier: LocalTier, step: int, group: Any, layout: Ring) -> None:
    """After the local commit of ``step`` on every rank: each directory's owner sends
    its files to the next directory's owner, which keeps them (then prunes its copies
    of that source to ``keep_local``). Raises on every rank if any rank failed."""
    if not layout.owns:
        send = receive = None
    else:
        holder, source = layout.holder_of(layout.me), layout.source_of(layout.me)
        send = None if holder is None else (holder, tier.step_prefix(step))
        receive = None if source is None else (source, peer_prefix(layout.ranks[source], step))
    _send(tier, group, step, what=f"the peer copy of step {step}", send=send, receive=receive)
    if receive is not None and tier.keep is not None:
        source_rank = layout.ranks[receive[0]]
        copies = list_checkpoints(tier.store, peer_root(source_rank), tier.options)
        for old in to_delete(copies, [KeepLast(tier.keep)], set()):
            remove_checkpoint(tier.store, peer_prefix(source_rank, old), tier.options)


def receive_missing(
    tier: LocalTier,
    step: int,
    group: Any,
    layout: Ring,
    lacking: Sequence[int],
) -> None:
    """Before a restore of ``step``: each owner in ``lacking`` (group indices) gets its
    files back from the owner holding its copy, into its own ``step-N/`` (marker
    last). A collective on ``group``; raises on every rank if any rank failed."""
    send = receive = None
    if layout.me in lacking:
        holder = layout.holder_of(layout.me)
        assert holder is not None
        receive = (holder, tier.step_prefix(step))
    source = layout.source_of(layout.me) if layout.owns else None
    if source is not None and source in lacking:
        send = (source, peer_prefix(layout.ranks[source], step))
    what = f"the copy of step {step} back from its peer"
    if receive is not None:
        # What a partial local copy left (a wrong-sized file) goes first.
        remove_checkpoint(tier.store, tier.step_prefix(step), tier.options)
    _send(tier, group, step, what=what, send=send, receive=receive)
