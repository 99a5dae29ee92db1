"""``cloudckpt.megatron.save``: megatron-core's ``dist_checkpointing.save`` to any URL.

The steps are megatron's own for its default ``torch_dist`` backend (factories applied,
non-persistent entries dropped, sharding validated, keys mapped to sharded keys,
``MCoreSavePlanner``), through :class:`~cloudckpt.dcp.CloudStorageWriter`. The commit
order makes a half-written checkpoint impossible to load, with cloudckpt or megatron:

1. the coordinator removes a previous ``metadata.json`` (the marker megatron checks);
2. every rank reports whether its local preparation worked (``settle``: a rank that
   failed makes every rank fail, instead of leaving the others in a collective);
3. DCP's save: data objects, then ``.metadata`` once every rank's data is durable;
4. the coordinator writes ``common.pt``, then creates ``metadata.json`` (the commit,
   format/commit.py), and every rank learns whether it did (``on_first``).

Steps 2-4 run on a gloo group made for checkpointing (ranks/groups.py), through the
collectives of ranks/collectives.py; with ``async_save=True`` they run on a background
thread, after the tensors were copied into pooled host buffers
(``engine/staging.stage_tensors``, the async save's own copy), so training can change
its parameters right away.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._runtime.gcpause import paused_gc
from ..dcp.location import CheckpointLocation
from ..dcp.writer import CloudStorageWriter
from ..engine.background import SaveLine
from ..engine.handle import SaveHandle
from ..engine.staging import StagedTensors, stage_tensors
from ..errors import CloudCkptError, DistributedSaveError
from ..format.commit import commit_marker
from ..format.torch.picklability import raise_if_unpicklable
from ..options import TransferOptions
from ..ranks.collectives import first_rank, on_first, rank, settle
from ..ranks.groups import checkpoint_group, group_ranks
from ..store.deadline import deadline_scope
from . import mcore
from .layout import COMMON_NAME, CONFIG_NAME, encode_config

__all__ = ["DistributedSaveError", "MegatronSaveHandle", "save"]

CONTENT_METADATA_KEY = "content_metadata"


class MegatronSaveHandle(SaveHandle[None]):
    """An asynchronous Megatron save: the one :class:`~cloudckpt.SaveHandle` (``done()``,
    ``result()``), plus :meth:`async_request` for megatron-core's own queue.

    ``result()`` returns once the checkpoint is committed on every rank (or raises the
    save's error). :meth:`async_request` wraps the handle for megatron-core's
    ``AsyncCallsQueue`` (what NeMo and Megatron-LM schedule async saves with).
    """

    kind = "Megatron save"

    def __init__(self, url: str) -> None:
        super().__init__(url, staged=True)  # returned once this rank's state is staged
        self._signals: list[Any] = []

    def async_request(self) -> Any:
        """This save as megatron-core's ``AsyncRequest``, for ``AsyncCallsQueue``.

        Its async function, run by megatron's checkpoint process, only waits for this
        save's signal (the upload itself runs here); its finalize function raises the
        save's error on every rank, as megatron's finalization does.
        """
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        return AsyncRequest(_wait_for_signal, (self._signal(),), [self.result])

    def _signal(self) -> Any:
        """The reading end of a pipe that receives one byte when the save finishes."""
        import multiprocessing

        reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
        with self._lock:
            if self._done.is_set():
                writer.send_bytes(b"1")
            else:
                self._signals.append(writer)
        return reader

    def finish(self, result: None, error: BaseException | None) -> None:
        """Done: wake megatron's waiting process (if any), then the handle's waiters."""
        super().finish(result, error)
        with self._lock:
            signals, self._signals = self._signals, []
        for writer in signals:
            with contextlib.suppress(OSError):  # the waiting process is gone
                writer.send_bytes(b"1")


def _wait_for_signal(reader: Any) -> None:
    """Megatron's async function: return when the save's thread signals it finished."""
    with contextlib.suppress(EOFError):
        reader.recv_bytes()


# A save on a group waits for the previous one on that group: two saves' collectives
# on one group would interleave. One line per set of ranks (engine/background.py).
_line = SaveLine()


@paused_gc()  # the caller's part: all of a synchronous save (_runtime/gcpause.py)
def save(
    sharded_state_dict: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    async_save: bool = False,
    process_group: Any = None,
    content_metadata: dict[str, Any] | None = None,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[dict[str, Any]], Any] | None = None,
    overwrite: bool = True,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> MegatronSaveHandle | None:
    """Save a Megatron sharded state dict to ``url`` (``s3://``, ``gs://``, ``az://``, a path).

    Call on every rank of ``process_group`` (default: all ranks), as
    ``dist_checkpointing.save``. Returns None once committed, or with
    ``async_save=True`` a :class:`MegatronSaveHandle` as soon as the state is staged.
    ``content_metadata`` is stored as megatron stores it (read it back with
    :func:`~cloudckpt.megatron.load_content_metadata`); ``overwrite=False`` refuses a
    URL holding a committed checkpoint. Other keywords are
    :class:`~cloudckpt.TransferOptions` fields.
    """
    mc = mcore.require()
    if not dist.is_initialized():
        raise CloudCkptError(
            "cloudckpt.megatron.save needs torch.distributed initialized (megatron's "
            "parallel state); for a single process use init_process_group('gloo', "
            "world_size=1)"
        )
    text = os.fspath(url)
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    sharded, common = mc.save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    ranks = group_ranks(process_group)
    group = checkpoint_group(process_group)
    job = _SaveJob(url, group, overwrite)
    job.prepare(mc, sharded, common, async_save, options, overrides)
    handle = MegatronSaveHandle(text)
    # Saves on one set of ranks run one after another (their collectives share the
    # group), in the order every rank called them; a staged save queues its upload
    # behind the previous one instead of holding up the training loop.
    previous = _line.add(handle, ranks)
    if not async_save:
        _line.run(handle, job.run, after=previous)
        handle.result()
        return None
    # Not daemon: the interpreter joins it before the groups go.
    _line.start(handle, job.run, name="cloudckpt-megatron-save", after=previous, daemon=False)
    return handle


class _SaveJob:
    """One rank's part of one save: prepared on the caller's thread, run on either."""

    def __init__(self, url: str | os.PathLike[str], group: Any, overwrite: bool) -> None:
        self.source = url  # as given: a URL resolved already is not resolved again
        self.url = os.fspath(url)
        self.what = f"save to {url}"  # names the save in the errors of its collectives
        self.group = group
        self.overwrite = overwrite
        self.coordinator = first_rank(group)
        self.is_coordinator = rank() == self.coordinator
        self.location: CheckpointLocation | None = None
        self.pyt_state: dict[str, Any] | None = None
        self.common_bytes: bytes | None = None
        self.error: BaseException | None = None
        self.staged: StagedTensors | None = None

    # -- caller's thread ---------------------------------------------------------------
    def prepare(
        self,
        mc: Any,
        sharded: dict[str, Any],
        common: dict[str, Any],
        stage: bool,
        options: TransferOptions | None,
        overrides: dict[str, Any],
    ) -> None:
        """Everything local: resolve the URL, serialize the common state, map keys, stage."""
        try:
            self.location = CheckpointLocation.resolve(self.source, options, **overrides)
            if self.is_coordinator:
                self.common_bytes = _serialize_common(common, self.location.url_of(COMMON_NAME))
            # Keys mapped first: that drops the replicas another rank saves, so only
            # the tensors this rank writes are staged.
            flat, _, _ = mc.replace_keys_with_sharded_keys(sharded, True)
            if stage:
                flat = self._stage(mc, flat)
            self.pyt_state = mc.mcore_to_pyt_state_dict(flat, False)
        except Exception as exc:
            self.error = exc
            self.release()

    def _stage(self, mc: Any, flat: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Copies of ``flat``'s ShardedTensors whose data sits in pooled host buffers."""
        tensors = [
            t.data
            for group in flat.values()
            for t in group
            if isinstance(t, mc.ShardedTensor) and t.data is not None
        ]
        self.staged = stage_tensors(tensors)
        copies = {id(t): c for t, c in zip(tensors, self.staged.copies, strict=True)}

        def staged(value: Any) -> Any:
            if isinstance(value, mc.ShardedTensor) and value.data is not None:
                clone = value.without_data()
                clone.data = copies[id(value.data)]
                return clone
            return value

        return {key: [staged(v) for v in group] for key, group in flat.items()}

    def release(self) -> None:
        """Give the staging buffers back to the pool for the next save."""
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.release()

    # -- the save's collectives (caller's thread or background) ------------------------
    def run(self) -> None:
        """Clear the marker, agree, write, commit (after the previous save on the ranks:
        engine/background.py); raises the save's error."""
        if self.is_coordinator and self.error is None:
            try:  # here, not in prepare: a queued save may target the previous one's URL
                assert self.location is not None
                self.location.clear_marker(CONFIG_NAME, self.overwrite)
            except Exception as exc:
                self.error = exc
        deadline = None if self.location is None else self.location.options.deadline
        try:
            # Every rank learns whether every rank prepared; a failed one fails them all.
            settle(self.error, self.what, group=self.group, error_type=DistributedSaveError)
            with deadline_scope(deadline):  # the writes and the commit (store/deadline.py)
                self._write()
                on_first(self._commit, self.group, what=self.what, error_type=DistributedSaveError)
        finally:
            # The buffers go back before anyone learns the outcome: the next save reuses them.
            self.pyt_state = None
            self.release()

    def _write(self) -> None:
        """DCP's save with megatron's planner: data objects, then ``.metadata``."""
        assert self.location is not None and self.pyt_state is not None
        mc = mcore.require()
        writer = CloudStorageWriter(self.location.resolved)  # resolved once, in prepare
        planner = mc.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        dcp.save(self.pyt_state, storage_writer=writer, planner=planner, process_group=self.group)

    def _commit(self) -> None:
        """Coordinator: ``common.pt``, then the commit marker ``metadata.json``."""
        where = self.location
        assert where is not None and self.common_bytes is not None
        where.store.put(where.key(COMMON_NAME), self.common_bytes)
        commit_marker(where.store, where.key(CONFIG_NAME), encode_config())


def _serialize_common(common: dict[str, Any], url: str) -> bytes:
    """``common.pt``'s bytes, as megatron's ``torch.save`` writes them."""
    buffer = io.BytesIO()
    try:
        torch.save(common, buffer)
    except Exception as exc:
        raise_if_unpicklable(common, exc, url)
        raise
    return buffer.getvalue()
