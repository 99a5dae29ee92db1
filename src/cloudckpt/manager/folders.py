"""What the integrations that commit a folder of files per step share (Accelerate,
DeepSpeed, the Hugging Face callback): the run's manager, the group their collectives
run on, a step's prefix, the checks of a step number, the files a folder holds, and
the upload of each rank's folder with the one commit after it; with a local tier
(Accelerate, DeepSpeed, the Hugging Face callback), the process's manager of a run and
directory, a save into it, and the steps drained from it."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.copy import TreeCopyResult, copy_tree
from ..engine.remove import remove_checkpoint
from ..errors import ConfigError, DistributedSaveError, NotFoundError
from ..options import TransferOptions
from ..ranks.collectives import agree, is_distributed, on_first, rank
from ..ranks.groups import checkpoint_group, drain_group
from ..store import Target, open_target
from ..store.local import LocalStore
from .manager import CheckpointManager
from .marker import (
    MARKER_NAME,
    CheckpointInfo,
    Written,
    commit_step,
    list_checkpoints,
    read_marker,
    root_prefix,
    step_dir,
)
from .payload import PayloadKind
from .retention import KeepLast, RetentionPolicy
from .tiered import TieredRun
from .tiers import check_positive

__all__ = [
    "TieredRuns",
    "checked_keep_local",
    "checked_path",
    "checked_step",
    "commit_folder",
    "committed_copy",
    "drained_steps",
    "files_under",
    "gathered",
    "newest_local_files",
    "open_run",
    "payload_call",
    "run_group",
    "save_to_tier",
    "step_prefix",
    "tier_folder",
    "tiered_run",
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
        if not isinstance(storage_options, Mapping):
            raise ConfigError(
                f"storage_options must be a mapping of the store's settings, not "
                f"{type(storage_options).__name__}"
            )
        manager_args["storage_options"] = dict(storage_options)
    return CheckpointManager(url, options=options, **manager_args)


#: An integration's managers of the runs saved with a local tier, one per (run URL,
#: local directory) in a process, with the settings each was opened with: the drainer
#: of a save's manager outlives the call, and the next save, load and drain use it.
TieredRuns = dict[tuple[str, str], tuple[tuple[Any, str], CheckpointManager]]

_tiered_lock = threading.Lock()


def tiered_run(
    runs: TieredRuns,
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
    kind: Callable[[Path], PayloadKind],
) -> CheckpointManager:
    """This process's manager in ``runs`` of the run at ``url`` with the local tier
    ``local_dir`` (made at the first call, its payload kind ``kind(directory)``);
    ConfigError when a call passes other ``options`` or ``storage_options`` than the
    first (a second manager would drain the same steps)."""
    path = checked_path("local_dir", local_dir).resolve()
    key = (os.fspath(url).rstrip("/"), str(path))
    settings = (options, json.dumps(dict(storage_options or {}), sort_keys=True, default=repr))
    with _tiered_lock:
        found = runs.get(key)
        if found is None:
            manager = open_run(url, options, storage_options, kind=kind(path), local_dir=path)
            runs[key] = (settings, manager)
            return manager
    if found[0] != settings:
        raise ConfigError(
            f"local_dir {path} serves the run {key[0]} in this process with other options= "
            "or storage_options=: pass the same ones to every call of the run"
        )
    return found[1]


def payload_call(state: Any, expected: type[Any], kind: str, functions: str) -> Any:
    """``state`` if it is an ``expected``: what a trainer's payload kind (DeepSpeed's,
    Accelerate's) takes from its own ``functions``; ConfigError naming it otherwise."""
    if not isinstance(state, expected):
        raise ConfigError(
            f"the {kind} payload kind takes the state its functions pass "
            f"({expected.__name__}), not {type(state).__name__}: use {functions} with "
            "local_dir="
        )
    return state


def committed_copy(
    prefix_url: str | Target, options: TransferOptions
) -> tuple[Target, str, CheckpointInfo]:
    """The committed copy a trainer's payload kind loads: ``prefix_url`` opened (a URL,
    or a ``Target`` as given: the manager's view of a local copy over the bucket's), the
    key prefix of its files (ending in ``/``, or empty) and its marker; NotFoundError
    when nothing is committed there."""
    target = prefix_url if isinstance(prefix_url, Target) else open_target(prefix_url, options)
    prefix = target.key.rstrip("/") + "/" if target.key else ""  # a folder's keys
    info = read_marker(target.store, prefix + MARKER_NAME)
    if info is None:
        raise NotFoundError(f"no committed checkpoint at {target.url}")
    return target, prefix, info


def tier_folder(prefix_url: str, options: TransferOptions, kind: str) -> Path:
    """The local folder ``prefix_url`` names, where a trainer writes a step of a local
    tier itself (ConfigError naming ``kind`` for one in a bucket)."""
    target = open_target(prefix_url, options)
    if not isinstance(target.store, LocalStore):
        raise ConfigError(
            f"the {kind} payload kind saves into a local tier's folder, not {prefix_url}"
        )
    return Path(os.path.abspath(target.store.root / target.key))


def checked_path(name: str, value: object) -> Path:
    """``value`` (the argument ``name``) as a path, ``~`` expanded; ConfigError naming
    it when it is not a ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name}={value!r} must be a path (str or os.PathLike)")
    return Path(value).expanduser()


def newest_local_files(local_dir: Path | None) -> list[str]:
    """The files the newest step committed in the local tier ``local_dir`` holds (none
    without one): what a trainer's payload kind learns its coordinator files from
    before a save of its process has told it."""
    if local_dir is None or not local_dir.is_dir():
        return []
    found = list_checkpoints(LocalStore(local_dir), "", TransferOptions())
    return [f.name for f in found[-1].files] if found else []


def checked_keep_local(value: int | None) -> int | None:
    """``keep_local`` checked by the rule of the manager's retention counts: a positive
    integer (ConfigError naming it otherwise), or None (every local step kept)."""
    check_positive("keep_local", value)
    return value


def save_to_tier(
    manager: CheckpointManager,
    step: int,
    state: Any,
    *,
    metadata: Mapping[str, Any],
    metrics: Mapping[str, float] | None = None,
    keep_local: int | None = None,
    keep_last: int | None = None,
    policies: Sequence[RetentionPolicy] | None = None,
) -> CheckpointInfo:
    """The save of ``step`` by ``manager`` (one of :func:`tiered_run`) into its local
    tier, committed there on return; ``keep_local`` newest local steps kept (None: all),
    ``keep_last`` the bucket's retention after each drain (``policies``: the bucket's
    retention rules instead, as given). One process: its drainer
    drains the step in the background. Several: every rank queues the step for its
    drainer after the same collective commit (the manager's order for an
    ``async_save``), the drain group made here, by every rank in step."""
    tiered = _tiered_of(manager)
    tiered.tier.keep = keep_local
    if policies is not None:
        manager.policies = list(policies)
    else:
        manager.policies = [] if keep_last is None else [KeepLast(keep_last)]
    info = manager.save(step, state, metrics=metrics, metadata=metadata)
    if tiered.ranked():
        drain_group()
        if tiered.tier.due(step):
            tiered.drainer.submit(step)
    return info


def _tiered_of(manager: CheckpointManager) -> TieredRun:
    """``manager``'s local tier run (ConfigError when it has no ``local_dir``)."""
    tiered = manager._tiered
    if tiered is None:
        raise ConfigError(f"{manager!r} has no local tier (local_dir=)")
    return tiered


def drained_steps(manager: CheckpointManager) -> set[int]:
    """The steps of ``manager``'s local tier committed in the bucket
    (:meth:`~.tiered.TieredRun.drained_steps`: no request to the bucket)."""
    return _tiered_of(manager).drained_steps()


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
