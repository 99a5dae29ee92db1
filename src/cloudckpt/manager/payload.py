"""What a managed checkpoint holds besides its marker: one object, a DCP directory, or a
Megatron-core ``dist_checkpointing`` directory.

A payload kind writes the bytes of one checkpoint under its step prefix and reads them
back; it never writes the marker (the manager does, last, on rank 0). Call order on
save: ``kind.save(...)`` on every rank (a kind decides which ranks write), then the
manager commits: exactly the files the save says it wrote (``save``'s answer: names,
with sizes and ETags where known), else whatever it lists under the prefix. On restore:
``kind.load(...)`` on every rank.

A kind whose ranks each write their own files declares ``coordinator_files``: the files
its first rank alone writes, in the order they commit (paths under the step: ``a/b``
for one in a folder, as DeepSpeed's model states; a drain tells them by their last
part, as ``copy_tree`` excludes). A local tier on several ranks copies them into every
rank's directory (each directory then loads on its own) and drains them last; a kind
without them (``()``) takes a local tier on one process only. ``cloudckpt.deepspeed``
has a kind of its own (``DeepSpeedPayload``), given to the manager by its functions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from .._runtime.gcpause import paused_gc
from ..errors import ConfigError, DistributedLoadError
from ..options import TransferOptions
from ..ranks.collectives import on_first, rank
from ..store import Target
from .marker import Written

if TYPE_CHECKING:  # imports torch and megatron-core: only when a save runs
    from ..engine.save import SaveResult
    from ..megatron.save import MegatronSaveHandle

#: The files a save wrote under its prefix, each with what it knows of it (a
#: :class:`~.marker.Written`, a size, or None), for a commit of exactly those (an
#: earlier crashed save's leftovers under the prefix stay out of the marker); None:
#: not known, the commit lists the prefix.
Wrote = Mapping[str, "Written | int | None"] | None

__all__ = [
    "DcpPayload",
    "MegatronPayload",
    "ObjectPayload",
    "PayloadKind",
    "Wrote",
    "described",
    "payload_kind",
    "rank_failures",
]


class PayloadKind(Protocol):
    """Writes and reads the payload of one checkpoint under ``prefix_url`` (ends in ``/``).

    ``load(..., local=True)``: ``prefix_url`` is this node's local tier, whose files a
    kind may map rather than read (docs/tiers.md). A kind may also define
    ``needs_room(state) -> bool``: False when its save into a local tier takes no room
    there (the Hugging Face kind's hard links), so the tier's room check is skipped.
    """

    name: str

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """The files only the first rank writes, commit last (empty: one writer only)."""
        ...

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> Wrote:
        """Write the payload; the files it wrote (:data:`Wrote`; None: not known)."""
        ...

    def load(
        self,
        prefix_url: str,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> Any: ...


class ObjectPayload:
    """One ``torch.save`` archive (``state.pt``) written by rank 0 with cloudckpt.save.

    In a distributed job the state is assumed replicated (DDP); only rank 0 writes it.
    """

    name = "object"

    def __init__(self, filename: str = "state.pt") -> None:
        if not filename or "/" in filename:
            raise ConfigError(f"filename={filename!r} must be a plain object name")
        self.filename = filename

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """None: one process writes the whole payload."""
        return ()

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> Wrote:
        from ..engine.save import save  # imports torch: not at import (the CLI lists fast)

        url = prefix_url + self.filename
        saved = on_first(lambda: save(state, url, options=options), what=f"the save of {url}")
        return self.wrote(saved)

    def wrote(self, saved: SaveResult) -> Wrote:
        """What a save of the object (sync or async: its ``SaveResult``) wrote."""
        return {self.filename: Written(saved.size, saved.etag)}

    def load(
        self,
        prefix_url: str,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> Any:
        from ..engine.load import load  # imports torch: not at import

        return load(
            prefix_url + self.filename,
            map_location=map_location,
            weights_only=weights_only,
            mmap=local,
            options=options,
        )


class DcpPayload:
    """A ``torch.distributed.checkpoint`` directory written by every rank.

    Uses ``cloudckpt.dcp.CloudStorageWriter`` / ``CloudStorageReader``; restoring loads
    in place into ``state`` (DCP needs the target state dict to reshard into).
    """

    name = "dcp"

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """The layout index, then ``.metadata`` (DCP's commit)."""
        from ..format.dcp.layout import LAYOUT_NAME, METADATA_NAME  # imports torch

        return (LAYOUT_NAME, METADATA_NAME)

    def _dcp(self) -> Any:
        try:
            from .. import dcp as cloud_dcp  # type: ignore[attr-defined]
        except ImportError as exc:
            raise ConfigError(
                "kind='dcp' needs cloudckpt.dcp (CloudStorageWriter/CloudStorageReader), "
                "which this installation lacks"
            ) from exc
        return cloud_dcp

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> Wrote:
        import torch.distributed.checkpoint as dcp

        writer = self._dcp().CloudStorageWriter(prefix_url, options=options)
        with paused_gc():  # DCP's planners: a few objects per item (_runtime/gcpause.py)
            dcp.save(state, storage_writer=writer)
        return written_by_writer(writer)

    def async_save(
        self, state: Any, prefix_url: str, options: TransferOptions, process_group: Any
    ) -> Future[Any]:
        """``dcp.async_save`` through the cloudckpt writer: returns once DCP has staged
        ``state`` to host memory; the future completes once ``.metadata`` is written
        (every rank's data durable) or the save failed on any rank. Its collectives run
        on ``process_group`` (a gloo group of the checkpoint's own: never interleaved
        with training's)."""
        import torch.distributed.checkpoint as dcp

        writer = self._dcp().CloudStorageWriter(prefix_url, options=options)
        kwargs = {} if process_group is None else {"process_group": process_group}
        with paused_gc():  # the planning and staging part, in the caller
            pending: Any = dcp.async_save(state, storage_writer=writer, **kwargs)
        # torch >= 2.7 answers an AsyncSaveResponse when staging is asynchronous too.
        future: Future[Any] = getattr(pending, "upload_completion", pending)
        setattr(future, _WRITER, writer)  # its files, for the commit (wrote_async)
        return future

    def wrote_async(self, future: Future[Any]) -> Wrote:
        """The files the ``async_save`` that answered ``future`` wrote, once it is done."""
        return written_by_writer(getattr(future, _WRITER, None))

    def load(
        self,
        prefix_url: str | Target,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> Any:
        """DCP's load into ``state``; ``prefix_url`` may be an opened ``Target`` (a
        manager's view of a step in both tiers: its store is read as is). A rank whose
        reads failed raises its own error, the others DistributedLoadError naming it."""
        import torch.distributed.checkpoint as dcp

        if state is None:
            raise ConfigError("restoring a DCP checkpoint needs state= (the state dict to fill)")
        given = None if isinstance(prefix_url, Target) else options  # a Target has its own
        reader = self._dcp().CloudStorageReader(
            prefix_url, weights_only=weights_only, options=given
        )
        try:
            with paused_gc():
                dcp.load(state, storage_reader=reader)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = _load_error(exc, os.fspath(prefix_url))
            if error is exc:
                raise
            raise error from exc
        return state


class MegatronPayload:
    """A Megatron-core ``dist_checkpointing`` directory written by every rank.

    Saves a ``sharded_state_dict`` with :func:`cloudckpt.megatron.save` and restores with
    :func:`cloudckpt.megatron.load` into the ``sharded_state_dict`` given as ``state``
    (returning the loaded state dict); megatron's own loader reads the step's prefix too.
    """

    name = "megatron"

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """DCP's layout index and ``.metadata``, then ``common.pt`` and ``metadata.json``
        (megatron's commit), as megatron's save writes them."""
        from ..format.dcp.layout import LAYOUT_NAME, METADATA_NAME  # imports torch
        from ..format.megatron import COMMON_NAME, CONFIG_NAME

        return (LAYOUT_NAME, METADATA_NAME, COMMON_NAME, CONFIG_NAME)

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> Wrote:
        from .. import megatron  # imports torch and megatron-core: only when used

        megatron.save(state, prefix_url, options=options)
        return None  # megatron writes files of its own beside DCP's: the commit lists

    def async_save(
        self, state: Any, prefix_url: str, options: TransferOptions, process_group: Any
    ) -> MegatronSaveHandle:
        """``cloudckpt.megatron.save(async_save=True)``: returns once this rank's tensors
        are staged in host memory; the handle is done once ``metadata.json`` is written
        (every rank's data durable) or the save failed, on every rank alike; its done
        callbacks run in the save's background thread (or at once, once done). Its
        collectives run on the checkpoint's own gloo group over ``process_group``'s ranks."""
        from .. import megatron

        handle = megatron.save(
            state, prefix_url, async_save=True, process_group=process_group, options=options
        )
        assert handle is not None  # async_save=True always returns one
        return handle

    def load(
        self,
        prefix_url: str | Target,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> Any:
        """``cloudckpt.megatron.load`` into ``state``; ``prefix_url`` as in
        :meth:`DcpPayload.load`, and so are the errors of failed reads."""
        from .. import megatron

        if state is None:
            raise ConfigError(
                "restoring a Megatron checkpoint needs state= (the sharded_state_dict to load into)"
            )
        given = None if isinstance(prefix_url, Target) else options  # a Target has its own
        try:
            return megatron.load(state, prefix_url, weights_only=weights_only, options=given)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = _load_error(exc, os.fspath(prefix_url))
            if error is exc:
                raise
            raise error from exc


#: The attribute of an async save's future that holds its writer (wrote_async).
_WRITER = "_cloudckpt_writer"


def written_by_writer(writer: Any) -> Wrote:
    """What a DCP save through cloudckpt's ``writer`` wrote: on the coordinator (the
    rank that commits), each object with its size and the ETag its upload got
    (``CloudStorageWriter.committed``); elsewhere None."""
    made = getattr(writer, "committed", None)
    if isinstance(made, dict) and made:
        return {name: Written(size, etag) for name, (size, etag) in made.items()}
    return None


def rank_failures(error: BaseException) -> dict[int, BaseException]:
    """Each failed rank's error in a ``CheckpointException`` of DCP (whose message names
    only the ranks); empty for any other error."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return {}
    return {int(r): w[0] if isinstance(w, tuple) else w for r, w in failures.items()}


def described(failures: dict[int, BaseException]) -> dict[int, str]:
    """``{rank: "Type: message"}`` of :func:`rank_failures`, for the Distributed errors."""
    return {r: f"{type(e).__name__}: {e}" for r, e in failures.items()}


def _load_error(error: BaseException, url: str) -> BaseException:
    """A ``CheckpointException`` of DCP's load as this rank's own error where its part
    failed, else DistributedLoadError naming each failed rank and its error; any other
    error as it is."""
    named = rank_failures(error)
    if not named:
        return error
    own = named.get(rank())
    if isinstance(own, Exception):
        return own
    return DistributedLoadError.of(f"the load of {url}", described(named))


def payload_kind(kind: str | PayloadKind, filename: str = "state.pt") -> PayloadKind:
    """``"object"``, ``"dcp"``, ``"megatron"`` or a ready :class:`PayloadKind`."""
    if kind == "object":
        return ObjectPayload(filename)
    if kind == "dcp":
        return DcpPayload()
    if kind == "megatron":
        return MegatronPayload()
    if isinstance(kind, str):
        raise ConfigError(f"kind={kind!r} must be 'object', 'dcp', 'megatron' or a PayloadKind")
    return kind
