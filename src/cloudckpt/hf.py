"""The Hugging Face Trainer's checkpoints on object storage: each ``checkpoint-N``
folder the Trainer writes is committed to a bucket in the background, and the newest
committed one is fetched back for ``trainer.train(resume_from_checkpoint=...)``.

    from cloudckpt.hf import CloudCheckpointCallback, fetch_latest

    callback = CloudCheckpointCallback("s3://bucket/run1")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=fetch_latest("s3://bucket/run1", args.output_dir))

The bucket holds a :class:`cloudckpt.CheckpointManager` run: ``checkpoint-N`` goes to
``URL/step-00000000N/`` with the Trainer's file names kept, committed by the manager's
``_CHECKPOINT.json`` written last (``cloudckpt ls``, ``verify`` and
``CheckpointManager(URL).list()`` / ``latest()`` read it). ``on_save`` links the folder's
files into ``output_dir/.cloudckpt-upload/`` (hard links: no copy, and the Trainer's
rotation may delete the folder meanwhile) and returns; one background thread uploads
(``engine/copy.copy_tree``) and commits (``manager/marker.commit_step``), then applies
the Trainer's ``save_total_limit`` in the bucket, never deleting the best checkpoint
(``best_model_checkpoint``) nor the newest committed one. ``on_train_end`` waits and
raises the first failed upload's error. One process only (``world_size`` 1). See
docs/integrations.md (Hugging Face Trainer).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._lazy import lazy_attributes
from .engine.copy import copy_tree
from .engine.drain import Drainer
from .errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    NotFoundError,
    UnsafePathError,
)
from .format.commit import read_committed
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .manager.gc import delete_prefix
from .manager.marker import commit_step, root_prefix, step_dir
from .options import TransferOptions
from .store.local import LocalStore

__all__ = ["CloudCheckpointCallback", "fetch_latest"]

#: Built on transformers' ``TrainerCallback`` when first used (``_define``, the module
#: ``__getattr__`` at the end).
CloudCheckpointCallback: Any

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of a Trainer checkpoint.
KIND = "hf-trainer"
#: Where ``on_save`` links each folder's files until they are committed in the bucket
#: (under ``output_dir``; the Trainer's rotation only looks at ``checkpoint-*``).
STAGING = ".cloudckpt-upload"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")
#: File suffixes of torch archives, whose every record's CRC-32 ``fetch_latest`` checks.
_ARCHIVES = (".pt", ".pth", ".bin")


def _folder_step(path: str | os.PathLike[str] | None) -> int | None:
    """The step of a ``.../checkpoint-N`` path, or None."""
    if not path:
        return None
    found = _FOLDER.match(Path(path).name)
    return int(found.group(1)) if found else None


class TrainerRetention:
    """The Trainer's ``save_total_limit`` rule, applied in the bucket: the ``limit``
    newest checkpoints are kept, and the newest and the ``best`` one always (so two when
    ``limit`` is 1 and the best is older), as ``transformers.trainer_utils.
    rotate_checkpoints`` keeps them locally. ``limit`` None or below 1 keeps all."""

    def __init__(self, limit: int | None = None, best: int | None = None) -> None:
        self.limit = limit
        self.best = best

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The steps kept among ``checkpoints``."""
        steps = sorted(c.step for c in checkpoints)
        if not steps or self.limit is None or self.limit < 1:
            return set(steps)
        kept = {steps[-1]}
        if self.best in steps:
            kept.add(self.best)
        room = max(self.limit, len(kept))
        for step in reversed(steps):
            if len(kept) >= room:
                break
            kept.add(step)
        return kept


def _open_run(
    url: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
    policy: TrainerRetention | None = None,
) -> CheckpointManager:
    """The manager of the run at ``url`` (the URL and its options resolved once)."""
    overrides: dict[str, Any] = {}
    if storage_options is not None:
        overrides["storage_options"] = dict(storage_options)
    return CheckpointManager(
        url, policies=[policy] if policy else None, kind="object", options=options, **overrides
    )


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of the folder ``src`` made of hard links (a real copy of each
    file where links are refused, e.g. across devices)."""
    for here, dirs, files in os.walk(src):
        rel = Path(here).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(here) / name, dst / rel / name)
            except OSError:
                shutil.copy2(Path(here) / name, dst / rel / name)
        dirs.sort()


class CallbackBase:
    """What :class:`CloudCheckpointCallback` does, without transformers (its events:
    ``on_train_begin``, ``on_save``, ``on_train_end``)."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        keep_local: int | None = None,
        options: TransferOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        if keep_local is not None and (
            not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1
        ):
            raise ConfigError(f"keep_local={keep_local!r} must be a positive integer or None")
        self.policy = TrainerRetention()
        #: The run in the bucket; the URL is resolved (and checked) here.
        self.manager = _open_run(url, options, storage_options, self.policy)
        self.url = self.manager.root_url
        self.keep_local = keep_local
        self.timeout = timeout
        self.output_dir: Path | None = None
        self._drainer: Drainer[int] | None = None
        self._lock = threading.Lock()
        self._committed: set[int] = set()
        self._cleared: set[int] = set()

    # -- naming --------------------------------------------------------------------------
    def step_prefix(self, step: int) -> str:
        """The bucket key prefix of ``checkpoint-{step}`` (ends in ``/``)."""
        return f"{root_prefix(self.manager.root_key)}{step_dir(step)}/"

    def _staging(self) -> Path:
        assert self.output_dir is not None
        return self.output_dir / STAGING

    # -- the Trainer's events ------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the setup before the first step: one process, and the bucket answers
        (a missing bucket or rejected credentials raise here, typed)."""
        if getattr(args, "world_size", 1) > 1:
            raise ConfigError(
                f"CloudCheckpointCallback ({self.url}) supports a single-process Trainer; "
                f"this one runs {args.world_size} processes"
            )
        self.output_dir = Path(args.output_dir)
        self.policy.limit = args.save_total_limit
        self.policy.best = _folder_step(state.best_model_checkpoint)
        self.manager.list()
        if self._drainer is not None:  # an earlier train() of this callback that raised
            for error in self._drainer.wait(self.timeout).values():
                log.warning("%s; dropped: this run saves its checkpoints again", error)
        staging = self._staging()
        if staging.exists():
            # Folders a killed process was uploading: the resumed run saves them again.
            log.warning("removing %s, left by an earlier run's unfinished uploads", staging)
            shutil.rmtree(staging)
        self._drainer = Drainer(
            self._upload,
            str(self.output_dir),
            self.url,
            noun="checkpoint",
            at_exit="the resumed run saves those checkpoints again",
            retry="the next save or on_train_end",
        )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Hand ``checkpoint-{global_step}`` to the upload thread and return."""
        if self._drainer is None:
            self.on_train_begin(args, state, control)
        assert self._drainer is not None and self.output_dir is not None
        step = int(state.global_step)
        folder = self.output_dir / f"checkpoint-{step}"
        if not folder.is_dir():
            raise NotFoundError(f"the Trainer's checkpoint folder {folder} is missing")
        if step in self._drainer.unfinished():
            self._drainer.wait(self.timeout)  # the same step saved again: after that one
        self.policy.best = _folder_step(state.best_model_checkpoint)
        staged = self._staging() / folder.name
        if staged.exists():
            shutil.rmtree(staged)
        partial = staged.with_name(staged.name + ".partial")
        if partial.exists():
            shutil.rmtree(partial)
        _link_tree(folder, partial)
        partial.rename(staged)
        self._drainer.retry_failed()
        self._drainer.submit(step)
        self._prune_local()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait until every saved folder is committed in the bucket; a failed upload is
        tried once more, and its error (naming the folder) raised if it fails again.
        Then ``keep_local`` applies to the folders now committed."""
        self.wait()
        self._prune_local()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the uploads (TimeoutError after ``timeout`` s, default the
        callback's); raise the error of the oldest one that failed again."""
        if self._drainer is None:
            return
        self._drainer.retry_failed()
        failed = self._drainer.wait(self.timeout if timeout is None else timeout)
        if failed:
            raise failed[min(failed)]

    # -- the upload thread ---------------------------------------------------------------
    def _upload(self, step: int) -> None:
        """Copy the staged ``checkpoint-{step}`` to its step prefix, commit it with the
        manager's marker, then apply retention in the bucket."""
        staged = self._staging() / f"checkpoint-{step}"
        store, options = self.manager.store, self.manager.options
        prefix = self.step_prefix(step)
        if read_committed(store, prefix + MARKER_NAME) is not None:
            raise AlreadyExistsError(
                f"{staged.name} of {self.output_dir} is already committed at "
                f"{store.url(prefix)}; resume from the latest committed checkpoint"
            )
        if step not in self._cleared:  # a killed run's leftovers: never taken as ours
            delete_prefix(store, prefix, options)
            self._cleared.add(step)
        copy_tree(LocalStore(staged), "", store, prefix, options, exclude=(MARKER_NAME,))
        commit_step(store, prefix, step, KIND, {}, {"folder": staged.name})
        with self._lock:
            self._committed.add(step)
        shutil.rmtree(staged, ignore_errors=True)
        try:
            self.manager.apply_retention()
        except Exception as exc:
            log.warning(
                "retention under %s failed (the checkpoint is committed): %s", self.url, exc
            )

    def _prune_local(self) -> None:
        """With ``keep_local``: delete local ``checkpoint-N`` folders committed in the
        bucket beyond the ``keep_local`` newest, never the best one (training thread
        only, so never beside the Trainer's own rotation)."""
        if self.keep_local is None or self.output_dir is None:
            return
        folders = sorted(
            (step, path)
            for path in self.output_dir.glob("checkpoint-*")
            if path.is_dir() and (step := _folder_step(path)) is not None
        )
        with self._lock:
            committed = set(self._committed)
        for step, path in folders[: -self.keep_local]:
            if step in committed and step != self.policy.best:
                shutil.rmtree(path, ignore_errors=True)


def _define() -> Any:
    """Build the class on transformers' ``TrainerCallback`` (transformers imported now)."""
    try:
        from transformers import TrainerCallback
    except ImportError as exc:
        raise ImportError("cloudckpt.hf needs transformers (pip install 'cloudckpt[hf]')") from exc

    class CloudCheckpointCallback(CallbackBase, TrainerCallback):  # type: ignore[misc, valid-type]
        """A ``transformers.TrainerCallback`` committing each ``checkpoint-N`` folder to
        ``url`` in the background (module docstring).

        ``keep_local``: once a folder is committed in the bucket, keep only the
        ``keep_local`` newest local folders (never the best); None leaves them to the
        Trainer's ``save_total_limit``. ``options`` / ``storage_options``: cloudckpt's
        settings for ``url``. ``timeout``: seconds ``on_train_end`` waits (None: no limit).
        """

    CloudCheckpointCallback.__module__ = __name__
    CloudCheckpointCallback.__qualname__ = "CloudCheckpointCallback"
    return CloudCheckpointCallback


def fetch_latest(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    *,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """Download the newest committed checkpoint under ``url`` to
    ``local_dir/checkpoint-N`` and return that path (None: nothing committed).

    The files go into a hidden folder beside it, are checked against the marker (sizes,
    ETags, every torch archive's CRC-32s) and the folder is renamed into place once
    whole; an interrupted fetch resumes there. A ``checkpoint-N`` already in
    ``local_dir`` is returned when its files match the marker's sizes, else refused
    (:class:`~cloudckpt.errors.AlreadyExistsError`). ``local_dir`` may be a link; nothing
    inside it is followed: a ``checkpoint-N``, its hidden folder or a folder below them
    that is a symbolic link is refused (:class:`~cloudckpt.errors.UnsafePathError`).
    """
    manager = _open_run(url, options, storage_options)
    info = manager.latest()
    if info is None:
        return None
    name = f"checkpoint-{info.step}"
    local = Path(local_dir).expanduser()
    target = local / name
    if target.is_symlink():  # neither returned nor written through
        link = os.readlink(target)
        raise UnsafePathError(
            f"{target} is a symbolic link (to {link}) inside local_dir; fetch_latest "
            "neither writes through nor returns a link there: remove it",
            path=str(target),
            link=link,
        )
    if target.exists():
        try:
            _check_sizes(LocalStore(target), info)
        except (CorruptCheckpointError, NotFoundError) as exc:
            raise AlreadyExistsError(
                f"{target} exists and is not {info.url} ({exc}); move it away to fetch"
            ) from exc
        return str(target)
    store, prefix = manager.store, info.url[len(manager.store.url("")) :]
    _check_remote(manager, prefix, info)
    # Made with no link inside local_dir (UnsafePathError); written below it the same way.
    partial = LocalStore(local).make_dirs(f".{name}.cloudckpt-fetch/")
    fetched = LocalStore(partial)
    copy_tree(store, prefix, fetched, "", manager.options, exclude=(MARKER_NAME,))
    _check_sizes(fetched, info)
    from .engine.verify import verify_archive

    local_options = manager.options.replace(storage_options={})
    for f in info.files:
        if f.name.endswith(_ARCHIVES):
            verify_archive(fetched, f.name, local_options, expected_size=f.size)
    partial.rename(target)
    return str(target)


def _check_remote(manager: CheckpointManager, prefix: str, info: CheckpointInfo) -> None:
    """Every file the marker lists is in the bucket at its size and ETag
    (CorruptCheckpointError naming it otherwise)."""
    found = {o.key[len(prefix) :]: o for o in manager.store.list(prefix)}
    for f in info.files:
        o = found.get(f.name)
        url = manager.store.url(prefix + f.name)
        if o is None or o.size != f.size:
            raise CorruptCheckpointError(f"{url} is missing or not the size its marker says")
        if f.etag and o.etag and f.etag.strip('"') != o.etag.strip('"'):
            raise CorruptCheckpointError(f"{url} changed since it was committed (ETag differs)")


def _check_sizes(store: LocalStore, info: CheckpointInfo) -> None:
    """Every file the marker lists is under ``store`` at its size."""
    for f in info.files:
        size = store.head(f.name).size  # NotFoundError when missing
        if size != f.size:
            raise CorruptCheckpointError(
                f"{store.url(f.name)} holds {size} bytes, its marker {info.url} says {f.size}"
            )


__getattr__, __dir__ = lazy_attributes(globals(), {"CloudCheckpointCallback": _define}, __all__)
