"""Finding the checkpoint to resume from in a remote NeMo 2 checkpoint directory.

NeMo's ``AutoResume`` lists ``resume_from_directory`` with ``pathlib`` (only ``msc://``
is special-cased), so ``s3://...`` finds nothing and the run silently trains from
scratch. :class:`CloudAutoResume` keeps NeMo's rules (``*last`` checkpoints, ``*end``
ones refused unless ``resume_past_end``, ``-unfinished`` markers skipped, an error if
every ``*last`` is unfinished) and adds the commit: a checkpoint counts only once its
``weights/metadata.json`` exists. Among several, the newest commit wins (NeMo uses the
directory's mtime, which object stores do not have).

With ``torch.distributed`` initialized rank 0 lists and broadcasts the answer; before
that (NeMo calls ``AutoResume.setup`` before the process group exists) every rank
lists, and they agree as long as no save is still running into the directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..engine.drain import is_outage
from ..errors import NotFoundError
from ..lightning.callback import is_remote
from ..lightning.fs import register_options
from ..megatron.layout import CONFIG_NAME
from ..options import TransferOptions
from ..ranks.collectives import on_first
from ..redact import dataclass_repr
from ._compat import AppState, AutoResume
from .paths import (
    CONTEXT,
    UNFINISHED_SUFFIX,
    WEIGHTS,
    as_url,
    checkpoint_dir,
    children,
    download_tree,
    object_exists,
)
from .tier import committed_locally, newer_in_bucket

__all__ = ["CheckpointEntry", "CloudAutoResume", "latest_checkpoint", "list_checkpoints"]

log = logging.getLogger("cloudckpt")

_COMMIT = f"{WEIGHTS}/{CONFIG_NAME}"  # megatron-core's commit marker
_ADAPTER_META = f"{WEIGHTS}/adapter_metadata.json"


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One NeMo checkpoint directory under a checkpoint dirpath."""

    url: str
    committed_at: float | None  # mtime of weights/metadata.json; None: not committed
    unfinished: bool  # NeMo's <name>-unfinished marker is set
    #: Its commit is the local tier's (CloudAutoResume's ``local_dir``): the bucket's
    #: copy is older or not committed yet.
    local: bool = False

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def finished(self) -> bool:
        """Committed, and no save or removal of it under way."""
        return self.committed_at is not None and not self.unfinished


def list_checkpoints(dirpath: Any) -> list[CheckpointEntry]:
    """Every checkpoint directory under ``dirpath`` (one listing), oldest commit first.

    With ``torch.distributed`` initialized, rank 0 lists and every rank gets its answer.
    """
    root = as_url(dirpath)
    return on_first(lambda: _scan(root), what=f"the listing of {root}")


def _scan(root: str) -> list[CheckpointEntry]:
    """:func:`list_checkpoints`' listing, on this rank."""
    dirs, files = children(root)
    entries = []
    for name, objects in dirs.items():
        commit = [o.mtime for o in objects if o.key.endswith(f"/{name}/{_COMMIT}")]
        marker = name.removesuffix("-EMA") + UNFINISHED_SUFFIX
        entries.append(
            CheckpointEntry(f"{root}/{name}", commit[0] if commit else None, marker in files)
        )
    return _by_commit(entries)


def _by_commit(entries: list[CheckpointEntry]) -> list[CheckpointEntry]:
    return sorted(entries, key=lambda e: (e.committed_at or 0.0, e.name))


def _with_local_tier(root: str, local_dir: str | os.PathLike[str]) -> list[CheckpointEntry]:
    """:func:`_scan` of ``root`` with what the local tier at ``local_dir`` committed for
    it: a checkpoint committed there (not drained yet, or saved again since) counts,
    at its local commit's time. A bucket that cannot be reached leaves the local
    tier's alone (WARNING), when it holds any."""
    local = committed_locally(local_dir, root)
    try:
        entries = _scan(root)
    except Exception as exc:
        if not (local and is_outage(exc)):
            raise
        log.warning(
            "the bucket %s is unreachable (%s: %s); resuming from the local tier %s only: "
            "a checkpoint only the bucket holds is not seen",
            root,
            type(exc).__name__,
            exc,
            local_dir,
        )
        entries = []
    by_name = {e.name: e for e in entries}
    for info, name in local:
        seen = by_name.get(name)
        when = max(info.time, (seen.committed_at or 0.0) if seen else 0.0)
        newer = (
            seen is None
            or seen.committed_at is None
            or not newer_in_bucket(seen.committed_at, info.time)
        )
        by_name[name] = CheckpointEntry(
            f"{root}/{name}", when, seen.unfinished if seen else False, local=newer
        )
    return _by_commit(list(by_name.values()))


def latest_checkpoint(dirpath: Any, *, suffix: str = "last") -> str | None:
    """The newest finished checkpoint under ``dirpath`` whose name ends in ``suffix``.

    Returns its directory URL (``.../<name>``; the megatron weights are in
    ``.../<name>/weights``), or None.
    """
    found = [e for e in list_checkpoints(dirpath) if e.finished and e.name.endswith(suffix)]
    return found[-1].url if found else None


@dataclasses.dataclass(kw_only=True)
class CloudAutoResume(AutoResume):  # type: ignore[misc]
    """NeMo's ``AutoResume`` for checkpoint directories on object storage.

    ``resume_from_directory`` (default: the trainer's checkpoint callback's ``dirpath``
    when that is remote, else NeMo's ``<log_dir>/checkpoints``) and ``resume_from_path``
    may be URLs; local paths behave exactly as with NeMo's class. ``options`` and
    ``storage_options`` reach the store. The resume path given to the trainer is a URL
    string (``.../<name>/weights``).
    """

    options: TransferOptions | None = None
    storage_options: dict[str, Any] | None = None
    #: The checkpoint I/O's local tier (``CloudMegatronCheckpointIO(local_dir=...)``): a
    #: checkpoint committed there and not drained yet counts. Default: the trainer's
    #: I/O's, found by setup.
    local_dir: str | os.PathLike[str] | None = None
    #: The trainer's checkpoint callback's dirpath, when remote (set by setup).
    _callback_dirpath: str | None = dataclasses.field(default=None, init=False, repr=False)
    #: The local tier of the trainer's checkpoint I/O (set by setup).
    _io_local_dir: Path | None = dataclasses.field(default=None, init=False, repr=False)
    #: The checkpoints the last listing found committed in the local tier only.
    _local_only: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self._register(self.resume_from_directory, self.resume_from_path)

    def __repr__(self) -> str:
        """NeMo's dataclass repr, with the secrets of ``storage_options`` masked."""
        return dataclass_repr(self)

    def _register(self, *urls: Any) -> None:
        settings = {"storage_options": self.storage_options} if self.storage_options else {}
        if self.options is not None or settings:
            for url in urls:
                if url is not None and is_remote(url):
                    register_options(as_url(url), self.options, **settings)

    def setup(self, trainer: Any, model: Any = None) -> None:
        callback = getattr(trainer, "checkpoint_callback", None)
        dirpath = getattr(callback, "dirpath", None)
        self._callback_dirpath = as_url(dirpath) if dirpath and is_remote(dirpath) else None
        self._io_local_dir = _io_local_dir(trainer)
        self._register(self._callback_dirpath)
        super().setup(trainer, model)

    def _directory(self) -> str | None:
        """Where to look: ``resume_from_directory``, else a remote callback dirpath."""
        return self.resume_from_directory or self._callback_dirpath  # type: ignore[no-any-return]

    def _remote(self) -> bool:
        directory = self._directory()
        return directory is not None and is_remote(directory)

    def _find_trainer_ckpt_path(self) -> Any:
        if not self._remote():
            return super()._find_trainer_ckpt_path()
        directory = as_url(self._directory())
        tier = self.local_dir if self.local_dir is not None else self._io_local_dir
        if tier is None:
            entries = list_checkpoints(directory)
        else:
            entries = on_first(
                lambda: _with_local_tier(directory, tier), what=f"the listing of {directory}"
            )
        self._local_only = {e.url for e in entries if e.local}
        end = [e for e in entries if e.name.endswith("end")]
        last = [e for e in entries if e.name.endswith("last")]
        finished_end = [e for e in end if e.finished]
        finished_last = [e for e in last if e.finished]
        if end and not finished_end:
            raise ValueError(
                "End checkpoint is unfinished and cannot be used to resume the training. "
                f"Remove it ({', '.join(e.url for e in end)}) to avoid restarting from scratch."
            )
        if last and not finished_last:
            raise ValueError(
                f"Last checkpoint is unfinished (not committed, or marked unfinished): "
                f"{', '.join(e.url for e in last)}. Remove it to avoid restarting from scratch."
            )
        if finished_end:
            if not self.resume_past_end:
                raise ValueError(
                    f"Found {finished_end[-1].url} indicating that the last training run has "
                    "already completed."
                )
            return finished_end[-1].url
        if finished_last:
            return finished_last[-1].url
        message = f"There were no checkpoints found in checkpoint_dir {directory}."
        if self.resume_ignore_no_checkpoint:
            then = (
                "Trying to resume from RestoreConfig."
                if self.restore_config
                else "Training from scratch."
            )
            log.warning("%s %s", message, then)
            return None
        if self.restore_config:
            return None
        raise NotFoundError(message + " Cannot resume.")

    def get_trainer_ckpt_path(self, model: Any = None) -> Any:
        if self.resume_from_path and is_remote(self.resume_from_path):
            return self._weights_of(as_url(self.resume_from_path))
        if self.resume_from_path or not self._remote():
            return super().get_trainer_ckpt_path(model)
        AppState().restore = self.resume_if_exists
        checkpoint = self._find_trainer_ckpt_path() if self.resume_if_exists else None
        return None if checkpoint is None else self._weights_of(checkpoint)

    def get_context_path(self, model: Any = None) -> Any:
        if not self._remote() and not (self.resume_from_path and is_remote(self.resume_from_path)):
            return super().get_context_path(model)
        checkpoint = self.get_trainer_ckpt_path(model)
        if checkpoint is None:
            return None
        context = f"{checkpoint_dir(checkpoint)}/{CONTEXT}"
        local = Path(tempfile.mkdtemp(prefix="cloudckpt-nemo-context-")) / CONTEXT
        if download_tree(context, local) == 0:
            raise NotFoundError(f"no NeMo context at {context}")
        return local

    def _weights_of(self, url: str) -> str:
        """``<checkpoint>/weights`` if it is committed (in the bucket, or in the local
        tier where the last listing found it), else the URL as given."""
        base = checkpoint_dir(url)
        if base in self._local_only:  # the I/O loads the local copy: nothing to ask
            return f"{base}/{WEIGHTS}"
        if object_exists(f"{base}/{_ADAPTER_META}"):
            raise NotImplementedError(
                f"{base} is a PEFT adapter checkpoint; resuming adapters from object storage "
                "is not supported by cloudckpt.nemo"
            )
        return f"{base}/{WEIGHTS}" if object_exists(f"{base}/{_COMMIT}") else url


def _io_local_dir(trainer: Any) -> Path | None:
    """The local tier of the trainer's CloudMegatronCheckpointIO, if it has one."""
    from .checkpoint_io import trainer_io

    io = trainer_io(trainer)
    return None if io is None else io.local_dir
