"""What the integrations that commit a folder of files per step share (Accelerate,
DeepSpeed, the Hugging Face callback): the run's manager, the group their collectives
run on, a step's prefix, the checks of a step number, the files a folder holds, and
the upload of each rank's folder with the one commit after it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..engine.copy import TreeCopyResult, copy_tree
from ..engine.remove import remove_checkpoint
from ..errors import ConfigError, DistributedSaveError
from ..options import TransferOptions
from ..ranks.collectives import agree, is_distributed, on_first, rank
from ..ranks.groups import checkpoint_group
from ..store.local import LocalStore
from .manager import CheckpointManager
from .marker import MARKER_NAME, CheckpointInfo, Written, commit_step, root_prefix, step_dir

__all__ = [
    "checked_step",
    "commit_folder",
    "files_under",
    "gathered",
    "open_run",
    "run_group",
    "step_prefix",
    "written_by",
]

log = logging.getLogger("cloudckpt")


def open_run(
    url: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
    **manager_args: Any,
) -> CheckpointManager:
    """The manager of the run at ``url`` (the URL and its options resolved once);
    ``manager_args`` go to :class:`CheckpointManager` as given."""
    if storage_options is not None:
        manager_args["storage_options"] = dict(storage_options)
    return CheckpointManager(url, options=options, **manager_args)


def run_group() -> Any:
    """The dedicated gloo group of a save's or load's collectives (None: one process)."""
    return checkpoint_group() if is_distributed() else None


def step_prefix(manager: CheckpointManager, step: int) -> str:
    """The key prefix of ``step``'s folder in the run's store (ending in ``/``)."""
    return f"{root_prefix(manager.root_key)}{step_dir(step)}/"


def checked_step(step: Any) -> int:
    """``step`` if it is a non-negative integer (ConfigError otherwise)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step={step!r} must be a non-negative integer")
    return step


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``, as sorted ``/``-separated relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def commit_folder(
    manager: CheckpointManager,
    step: int,
    folder: Path,
    *,
    kind: str,
    metadata: Mapping[str, Any],
    group: Any,
    metrics: Mapping[str, float] | None = None,
    written: Mapping[str, Written | int] | None = None,
    clear_first: bool = False,
    retain: Callable[[], object] | None = None,
) -> CheckpointInfo:
    """Upload each file of every rank's ``folder`` to ``step``'s prefix once (the lowest
    rank listing a name uploads it), then, once every rank's upload succeeded, commit
    the step on the first rank of ``group`` and apply retention; every rank returns the
    committed :class:`CheckpointInfo`. A collective: every rank calls it.

    The marker records exactly the files this save's ranks wrote: what they uploaded
    and what each already ``written`` under the prefix itself (name to its size, or to a
    :class:`~.marker.Written`: size and ETag); an object
    another save put under the prefix is left out, and one of this save's files removed,
    or rewritten by another save (another size, or another ETag than its upload got),
    fails the commit.
    ``clear_first``: the first rank removes what is under the prefix before any upload
    (an earlier, uncommitted try). ``retain``: run on the first rank after the commit
    (default the manager's ``apply_retention``); its failure is a WARNING, the step
    stays committed. A rank's failure raises on every rank (its own error there,
    :class:`~cloudckpt.errors.DistributedSaveError` naming it on the others).
    """
    store, options = manager.store, manager.options
    prefix, url = step_prefix(manager, step), manager.step_url(step)
    names: list[str] = []
    error: BaseException | None = None
    try:
        names = files_under(folder)
    except Exception as exc:
        error = exc
    listings = gathered(error, names, group, f"the listing of each rank's files for {url}")
    me = rank() if group is not None else 0
    owner: dict[str, int] = {}
    for index, listed in enumerate(listings):
        for name in listed:
            owner.setdefault(name, index)
    mine = [n for n in names if owner[n] == me]
    if clear_first:
        on_first(
            lambda: remove_checkpoint(store, prefix, options),
            group,
            what=f"clearing leftovers under {url}",
            error_type=DistributedSaveError,
        )
    uploaded: dict[str, Written | int] = dict(written or {})
    try:
        for name in set(names) - set(mine):  # another rank uploads the same file
            (folder / name).unlink()
        if mine:
            copied = copy_tree(
                LocalStore(folder), "", store, prefix, options, exclude=(MARKER_NAME,)
            )
            uploaded.update(written_by(copied))
    except Exception as exc:
        error = exc
    files: dict[str, Written | int | None] = {}
    for each in gathered(error, uploaded, group, f"the upload of each rank's files to {url}"):
        for name, size in each.items():
            files.setdefault(name, size)

    def commit() -> CheckpointInfo:  # every rank's files are in the bucket
        info = commit_step(store, prefix, step, kind, dict(metrics or {}), metadata, files=files)
        try:
            (retain or manager.apply_retention)()
        except Exception as exc:
            log.warning("retention under %s failed (step %d is committed): %s", url, step, exc)
        return info

    return on_first(commit, group, what=f"the commit of {url}", error_type=DistributedSaveError)


def written_by(copied: TreeCopyResult) -> dict[str, Written]:
    """What a copy to the bucket wrote, for the commit: each object's size and the ETag
    the store gave it (or, for one it kept, its listed ETag: proven the same bytes)."""
    return {e.name: Written(e.size, copied.etags.get(e.name)) for e in copied.entries}


def gathered(error: BaseException | None, value: Any, group: Any, what: str) -> tuple[Any, ...]:
    """Every rank's ``value``, in rank order, once every rank's part of ``what``
    succeeded: else a failed rank raises its own ``error``, the others
    DistributedSaveError naming it."""
    agreement = agree(error, value, group=group, what=what, error_type=DistributedSaveError)
    if error is not None:
        raise error
    agreement.raise_failures(what, DistributedSaveError)
    return agreement.values
