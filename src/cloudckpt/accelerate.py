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

accelerate is imported only inside the functions: this module imports without it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
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
from .manager import MARKER_NAME, CheckpointInfo
from .manager.folders import checked_step as _checked_step
from .manager.folders import commit_folder
from .manager.folders import open_run as _open_run
from .manager.folders import run_group as _group
from .manager.folders import step_prefix as _step_prefix
from .manager.marker import check_files, check_remote, marker_key
from .options import TransferOptions
from .ranks.collectives import is_distributed, on_first, rank, settle, world_size
from .ranks.groups import drain_group
from .store.local import LocalStore

__all__ = ["AccelerateSaveHandle", "load_state", "save_state"]

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of an Accelerate checkpoint.
KIND = "accelerate"

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


def save_state(
    accelerator: Any,
    url: str | os.PathLike[str],
    *,
    step: int | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
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
    ``staging_dir``: where each process's local folder is made (default the temp dir).
    """
    _require_accelerate()
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ConfigError(
            "cloudckpt.accelerate.save_state names the checkpoint itself; "
            "turn off ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    in_flight.raise_unreported()
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
    """
    _require_accelerate()
    from accelerate.utils import RNG_STATE_NAME

    manager = _open_run(url, options, storage_options)
    _line.make_room(manager.root_url)  # this process's background save of the run commits first
    group = _group()
    info = manager.latest() if step is None else manager.info(_checked_step(step))
    if info is None:
        return None
    prefix = _step_prefix(manager, info.step)
    me, ranks = rank(), world_size()
    if info.metadata.get("world_size", ranks) != ranks:
        log.warning(
            "%s was saved by %s processes and is restored by %d: accelerate restores the "
            "RNG states of the ranks both runs have",
            info.url,
            info.metadata.get("world_size"),
            ranks,
        )
    others = tuple(
        f.name
        for f in info.files
        if f.name.startswith(RNG_STATE_NAME + "_")
        and f.name != f"{RNG_STATE_NAME}_{me}.pkl"
        and "/" not in f.name
    )
    folder = Path(tempfile.mkdtemp(prefix=f"cloudckpt-accelerate-{info.step}-", dir=staging_dir))
    try:
        error: BaseException | None = None
        try:
            fetched = LocalStore(folder)
            check_remote(manager.store, prefix, info)  # sizes and ETags, naming the object
            copy_tree(
                manager.store, prefix, fetched, "", manager.options, exclude=(MARKER_NAME, *others)
            )
            check_files(fetched, "", info, skip=others)
        except Exception as exc:
            error = exc
        settle(error, f"the download of {info.url}", group=group, error_type=DistributedLoadError)
        try:
            accelerator.load_state(str(folder), **load_kwargs)
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
    manager.restored_step = info.step
    return info
