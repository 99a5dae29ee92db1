"""Accelerate's ``save_state`` / ``load_state`` on object storage, committed as a
:class:`cloudckpt.CheckpointManager` run.

    from cloudckpt.accelerate import load_state, save_state

    load_state(accelerator, "s3://bucket/run1")  # the newest committed step, or None
    ...
    save_state(accelerator, "s3://bucket/run1", step=step)

``accelerator.save_state(dir)`` itself writes each process's files (weights, optimizer,
schedulers, samplers, scaler, ``random_states_R.pkl``, registered objects; FSDP's
sharded files) into a local staging folder of that process; every file name is
uploaded once, by the lowest rank that wrote it, to ``URL/step-N/`` (``copy_tree``);
once every rank's upload succeeded, rank 0 writes the manager's ``_CHECKPOINT.json``
(create-only, last). ``load_state`` downloads a committed step (each rank its own RNG
file and everything shared), checks the files against the marker and hands the folder
to ``accelerator.load_state``, so exactly what accelerate restores is restored. See
docs/integrations.md (Accelerate).

``save_state(..., local_dir=DIR)`` uses the manager's local tier (docs/tiers.md)
instead: a :class:`CheckpointManager` with ``local_dir`` and the Accelerate payload
kind (:class:`AcceleratePayload`) has ``accelerator.save_state`` write into
``DIR/step-N/``, commits it there and returns, with no request to the bucket; the
manager's drainer copies it to ``URL/step-N/`` in the background and commits it there,
the same layout and marker as above (``drain`` waits for that). With several ranks
each directory also gets the files the main process alone wrote (its
``coordinator_files``: every file but the ranks' own RNG states and sharded files), so
every node's copy loads on its own. ``load_state(..., local_dir=DIR)`` is the
manager's restore: the newest step of either tier, copied from the local copy when it
is whole, else from the bucket. One manager per run and directory serves a process
(its drainer outlives the call).

accelerate is imported only inside the functions: this module imports without it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine.background import SaveLine
from .engine.copy import copy_tree
from .engine.handle import SaveHandle, in_flight
from .errors import (
    AlreadyExistsError,
    ConfigError,
    DistributedLoadError,
    DistributedSaveError,
)
from .format.commit import read_committed
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .manager.folders import (
    TieredRuns,
    checked_keep_local,
    commit_folder,
    committed_copy,
    gathered,
    newest_local_files,
    payload_call,
    save_to_tier,
    tier_folder,
    tiered_run,
)
from .manager.folders import checked_step as _checked_step
from .manager.folders import open_run as _open_run
from .manager.folders import run_group as _group
from .manager.folders import step_prefix as _step_prefix
from .manager.marker import check_files, check_remote, marker_key
from .options import TransferOptions
from .ranks.collectives import agree, is_distributed, on_first, rank, settle, world_size
from .ranks.groups import drain_group
from .store import Store, Target
from .store.local import LocalStore

__all__ = ["AccelerateSaveHandle", "drain", "load_state", "save_state"]

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of an Accelerate checkpoint.
KIND = "accelerate"
#: What a local tier's payload kind of this module is given by (its ConfigError names it).
_FUNCTIONS = "cloudckpt.accelerate.save_state / load_state"

#: The background saves, a line per run URL: the next save of a run waits (engine/background.py).
_line = SaveLine()


class AccelerateSaveHandle(SaveHandle[CheckpointInfo]):
    """An ``async_save`` of :func:`save_state`: staged once accelerate's files are on
    local disk (the call returned), done once the step is committed in the bucket
    (``result()``: its :class:`CheckpointInfo`) or failed."""

    kind = "accelerate save"

    def __init__(self, step: int, url: str) -> None:
        super().__init__(url, staged=True)
        self.step = step


def _require_accelerate() -> Any:
    """The ``accelerate`` package (ImportError naming the extra when it is missing)."""
    try:
        import accelerate
    except ImportError as exc:
        raise ImportError(
            "cloudckpt.accelerate needs accelerate (pip install 'cloudckpt[accelerate]')"
        ) from exc
    return accelerate


#: The RNG states file accelerate writes for each rank (its ``RNG_STATE_NAME``).
_RNG = re.compile(r"random_states_\d+\.pkl")

#: A file of accelerate's that one rank writes for itself (its own RNG states, its
#: shard of an FSDP sharded state: DCP's ``__R_N.distcp``), by its last name part: never
#: one of the files every local directory gets.
_PER_RANK = re.compile(rf"{_RNG.pattern}|__\d+_\d+\.distcp")

#: What a local tier's directories get from the main process before any save of this
#: process said otherwise, and before the tier holds a step (accelerate's weights).
_DEFAULT_SHARED = ("model.safetensors",)


def _rng_name(r: int) -> str:
    """The RNG states file accelerate writes for rank ``r`` (:data:`_RNG`)."""
    return f"random_states_{r}.pkl"


def _shared_files(names: list[str]) -> tuple[str, ...]:
    """Of the files the main process's directory holds, those every directory gets:
    all but the files a rank writes for itself (:data:`_PER_RANK`)."""
    return tuple(sorted(n for n in names if not _PER_RANK.fullmatch(n.rpartition("/")[2])))


@dataclass
class _SaveCall:
    """What :meth:`AcceleratePayload.save` saves: the accelerator and accelerate's arguments."""

    accelerator: Any
    safe_serialization: bool = True


@dataclass
class _LoadCall:
    """What :meth:`AcceleratePayload.load` restores into, and how."""

    accelerator: Any
    staging_dir: str | os.PathLike[str] | None = None
    load_kwargs: dict[str, Any] = field(default_factory=dict)


class AcceleratePayload:
    """The manager's payload kind of an Accelerate checkpoint in a local tier
    (docs/tiers.md): :func:`save_state` and :func:`load_state` with ``local_dir=`` pass
    it to their :class:`CheckpointManager`; it is not meant to be given one by hand.

    ``save`` runs ``accelerator.save_state`` into the tier's ``step-N/`` folder (a
    local path) on every rank; ``load`` copies a committed copy (a URL, or the
    manager's view of both tiers) into a folder of its own and hands it to
    ``accelerator.load_state``, as :func:`load_state` does with the bucket's.
    """

    name = KIND

    def __init__(self, local_dir: Path) -> None:
        #: The tier's directory, whose newest step says which files are shared before
        #: a save of this process did.
        self.local_dir = local_dir
        #: The files every directory gets, as the ranks agreed on at the last save.
        self._shared: tuple[str, ...] | None = None

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """The files only the main process writes, which every local directory gets:
        those of the last save (every file of the main process's folder but the ranks'
        own: RNG states, FSDP shards); before one, those of the tier's newest step, else
        accelerate's weights file."""
        if self._shared is not None:
            return self._shared
        return _shared_files(newest_local_files(self.local_dir)) or _DEFAULT_SHARED

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> None:
        """``accelerator.save_state`` of ``state`` (a :class:`_SaveCall`) into the local
        folder ``prefix_url`` names, on every rank; a rank's failure raised on every
        rank. Then the ranks agree on the files every directory gets (those the main
        process's folder holds but the ranks' own)."""
        call = payload_call(state, _SaveCall, "Accelerate", _FUNCTIONS)
        folder = tier_folder(prefix_url, options, "Accelerate")
        group = _group()
        error: BaseException | None = None
        try:
            call.accelerator.save_state(str(folder), safe_serialization=call.safe_serialization)
        except Exception as exc:
            error = exc
        settle(
            error,
            f"accelerate's save_state to {prefix_url}",
            group=group,
            error_type=DistributedSaveError,
        )
        names: list[str] = []
        try:
            names = sorted(o.key for o in LocalStore(folder).list(""))  # no temp files
        except Exception as exc:
            error = exc
        listings = gathered(
            error, names, group, f"the listing of each rank's files in {prefix_url}"
        )
        self._shared = _shared_files(listings[0])
        return None  # the tier's commit lists the folder

    def load(
        self,
        prefix_url: str | Target,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> CheckpointInfo:
        """Restore ``state`` (a :class:`_LoadCall`) from the committed copy at
        ``prefix_url`` (a URL, or an opened ``Target``: the manager's view of the local
        copy over the bucket's); returns the copy's :class:`CheckpointInfo`. ``local``:
        a copy in a local tier, whose sizes the manager checked (the ETags are the
        bucket's to check)."""
        call = payload_call(state, _LoadCall, "Accelerate", _FUNCTIONS)
        target, prefix, info = committed_copy(prefix_url, options)
        _load_step(call, target.store, prefix, target.options, info, check_etags=not local)
        return info


#: The managers of the runs saved with a local tier, one per (run URL, local directory)
#: in a process (manager/folders.tiered_run): the drainer of a save's manager outlives
#: the call, and the next save, load and :func:`drain` use it.
_tiered: TieredRuns = {}


def _tiered_run(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
) -> CheckpointManager:
    """This process's manager of the run at ``url`` with the local tier ``local_dir``
    and the Accelerate payload kind (manager/folders.tiered_run)."""
    return tiered_run(_tiered, url, local_dir, options, storage_options, AcceleratePayload)


def _next_step(manager: CheckpointManager) -> int:
    """One past the newest committed step (0 for a new run); with a local tier on
    several ranks, one past the newest any rank's listing found, the same on every rank
    (each rank lists its own tier beside the bucket)."""
    newest = manager.latest()
    step = 0 if newest is None else newest.step + 1
    if is_distributed():
        step = max(agree(value=step, group=_group()).values)
    return step


def _check_naming(accelerator: Any) -> None:
    """ConfigError when accelerate names its checkpoint folders itself."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ConfigError(
            "cloudckpt.accelerate.save_state names the checkpoint itself; "
            "turn off ProjectConfiguration(automatic_checkpoint_naming=True)"
        )


def save_state(
    accelerator: Any,
    url: str | os.PathLike[str],
    *,
    step: int | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    keep_local: int | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo | AccelerateSaveHandle:
    """Save ``accelerator``'s state as step ``step`` of the run at ``url`` (every
    process calls it, as ``accelerator.save_state``).

    ``step`` None: one past the newest committed step (0 for a new run). A step
    already committed is refused (:class:`~cloudckpt.errors.AlreadyExistsError`);
    leftovers of an uncommitted save of it are deleted first. Returns the committed
    :class:`CheckpointInfo`; with ``async_save`` returns once accelerate's files are on
    local disk, and the upload and commit run in a background thread: the returned
    :class:`AccelerateSaveHandle`'s ``result()`` waits (the next save of the run waits
    for it first). ``keep_last``: the manager's retention after each commit.
    ``staging_dir``: where each process's local folder is made (default the temp dir;
    with ``local_dir`` accelerate writes into the tier instead).

    ``local_dir``: the manager's local tier (docs/tiers.md): accelerate writes into
    ``local_dir/step-N/``, committed there when this returns (no request to the bucket
    on the way, so a bucket that is away does not stop it) and drained to ``url`` in
    the background, where ``keep_last`` applies after each drain; ``keep_local`` newest
    local steps are kept (default all; never one not drained yet). Every rank passes its
    node's directory. Call :func:`drain` before a planned exit. Not with ``async_save``
    (ConfigError): the save already returns at local-disk speed.
    """
    _require_accelerate()
    _check_naming(accelerator)
    in_flight.raise_unreported()
    if local_dir is None and keep_local is not None:
        raise ConfigError("keep_local= needs local_dir=")
    if local_dir is not None and async_save:
        raise ConfigError(
            "async_save=True does not take local_dir=: a save to the local tier returns "
            "once committed on local disk and drains to the bucket in the background"
        )
    keep = checked_keep_local(keep_local)  # before the tier's directory is made
    if local_dir is not None:
        tiered = _tiered_run(url, local_dir, options, storage_options)
        _line.make_room(tiered.root_url)
        chosen = _checked_step(_next_step(tiered) if step is None else step)
        return save_to_tier(
            tiered,
            chosen,
            _SaveCall(accelerator, safe_serialization),
            metadata={"world_size": world_size()},
            keep_local=keep,
            keep_last=keep_last,
        )
    manager = _open_run(url, options, storage_options, keep_last=keep_last)
    _line.make_room(manager.root_url)
    group = _group()
    if step is None:
        newest = manager.latest()
        step = 0 if newest is None else newest.step + 1
    chosen = _checked_step(step)
    url_of_step = manager.step_url(chosen)

    def refuse_committed() -> None:
        if read_committed(manager.store, marker_key(manager.root_key, chosen)) is not None:
            raise AlreadyExistsError(
                f"step {chosen} is already committed at {url_of_step}; delete it first "
                "(cloudckpt rm) or save another step"
            )

    on_first(
        refuse_committed,
        group,
        what=f"the check that {url_of_step} is not committed",
        error_type=DistributedSaveError,
    )
    folder = Path(tempfile.mkdtemp(prefix=f"cloudckpt-accelerate-{chosen}-", dir=staging_dir))
    try:
        error: BaseException | None = None
        try:
            accelerator.save_state(str(folder), safe_serialization=safe_serialization)
        except Exception as exc:
            error = exc
        settle(
            error,
            f"accelerate's save_state for {url_of_step}",
            group=group,
            error_type=DistributedSaveError,
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    metadata = {"world_size": world_size()}

    def commit(on: Any) -> CheckpointInfo:  # on every rank, its leftovers cleared first
        return commit_folder(
            manager, chosen, folder, kind=KIND, metadata=metadata, group=on, clear_first=True
        )

    if not async_save:
        try:
            return commit(group)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    background = drain_group() if is_distributed() else None
    handle = AccelerateSaveHandle(chosen, url_of_step)

    def run() -> CheckpointInfo:
        try:
            return commit(background)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    _line.add(handle, manager.root_url)
    _line.start(handle, run, name=f"cloudckpt-accelerate-{chosen}")
    return handle


def load_state(
    accelerator: Any,
    url: str | os.PathLike[str],
    *,
    step: int | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **load_kwargs: Any,
) -> CheckpointInfo | None:
    """Restore ``accelerator``'s state from step ``step`` of the run at ``url`` (the
    newest committed one when None); returns its :class:`CheckpointInfo`, or None when
    the run has no committed checkpoint (a ``step`` not committed raises
    :class:`~cloudckpt.errors.NotFoundError`). Every process calls it.

    Each process downloads the step into a local folder of its own (under
    ``staging_dir``, default the temp dir; every file but the other ranks' RNG files),
    checks it against the marker (:class:`~cloudckpt.errors.CorruptCheckpointError`)
    and calls ``accelerator.load_state(folder, **load_kwargs)``.

    ``local_dir``: the local tier :func:`save_state` was given (the manager's restore,
    docs/tiers.md): the step is chosen among both tiers' committed steps (with several
    ranks, one every rank can read), copied from the local copy when it is whole (a
    local copy that fails its checks: a WARNING, and the bucket's copy), else from the
    bucket.
    """
    _require_accelerate()
    if local_dir is not None:
        tiered = _tiered_run(url, local_dir, options, storage_options)
        _line.make_room(tiered.root_url)  # this process's background save of the run first
        call = _LoadCall(accelerator, staging_dir, dict(load_kwargs))
        loaded: CheckpointInfo | None = tiered.restore(step, state=call)
        return loaded
    manager = _open_run(url, options, storage_options)
    _line.make_room(manager.root_url)  # this process's background save of the run commits first
    info = manager.latest() if step is None else manager.info(_checked_step(step))
    if info is None:
        return None
    call = _LoadCall(accelerator, staging_dir, dict(load_kwargs))
    _load_step(call, manager.store, _step_prefix(manager, info.step), manager.options, info)
    manager.restored_step = info.step
    return info


def _load_step(
    call: _LoadCall,
    store: Store,
    prefix: str,
    options: TransferOptions,
    info: CheckpointInfo,
    *,
    check_etags: bool = True,
) -> None:
    """Restore ``call.accelerator`` from the committed copy of ``info``'s step under
    ``prefix`` in ``store`` (the bucket's, a local tier's, or the manager's view of
    both): each rank copies every file but the other ranks' RNG files into a folder of
    its own, checked against the marker (``check_etags``: the ETags too, before the
    copy), the ranks agree, then ``accelerator.load_state`` of that folder."""
    group = _group()
    me, ranks = rank(), world_size()
    saved = info.metadata.get("world_size", ranks)
    if saved != ranks:
        log.warning(
            "%s was saved by %s processes and is restored by %d: accelerate restores the "
            "RNG states of the ranks both runs have",
            info.url,
            saved,
            ranks,
        )
    count = max(saved, ranks) if isinstance(saved, int) else ranks
    listed = {f.name for f in info.files if _RNG.fullmatch(f.name)}
    rngs = listed | {_rng_name(r) for r in range(count)}  # a view lists the bucket's too
    others = sorted(rngs - {_rng_name(me)})
    folder = Path(
        tempfile.mkdtemp(prefix=f"cloudckpt-accelerate-{info.step}-", dir=call.staging_dir)
    )
    try:
        error: BaseException | None = None
        try:
            fetched = LocalStore(folder)
            if check_etags:
                check_remote(store, prefix, info)  # sizes and ETags, naming the object
            copy_tree(store, prefix, fetched, "", options, exclude=(MARKER_NAME, *others))
            check_files(fetched, "", info, skip=others)
        except Exception as exc:
            error = exc
        settle(error, f"the download of {info.url}", group=group, error_type=DistributedLoadError)
        try:
            call.accelerator.load_state(str(folder), **call.load_kwargs)
        except Exception as exc:
            error = exc
        settle(
            error,
            f"accelerate's load_state of {info.url}",
            group=group,
            error_type=DistributedLoadError,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def drain(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    *,
    timeout: float | None = None,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Wait until every step :func:`save_state` committed in ``local_dir`` is committed
    in the bucket at ``url`` (the manager's ``drain``: failed drains tried again first,
    the error of one that fails again raised, naming its step; TimeoutError after
    ``timeout`` s). Every process calls it, before a planned exit: a drain left
    unfinished is finished by the next process on ``local_dir`` (accelerate itself is
    not needed: a drain copies the files as they are)."""
    _tiered_run(url, local_dir, options, storage_options).drain(timeout)
