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
raises the first failed upload's error.

On several processes (``torchrun``, ``accelerate launch``: DDP, FSDP, DeepSpeed) every
rank runs the callback: ``on_save`` waits until every rank wrote its part of
``checkpoint-N``, the ranks agree on who uploads which file (the rank a file's name
names: ``rng_state_R.pth``, DeepSpeed's ``zero_pp_rank_R_*``, DCP's ``__R_*.distcp``;
any other file the lowest rank that sees it, the Trainer's main process), and each
rank links its own files into ``output_dir/.cloudckpt-upload/rank-R/``. Each rank's
upload thread then uploads them, the ranks settle (one failed rank fails the step on
every rank, a ``DistributedSaveError`` naming it) and rank 0 writes the marker once
every rank's upload succeeded, on cloudckpt's own gloo group (never the training
group). ``fetch_latest`` is a collective there: rank 0 chooses the step, the first
process of each local directory (host and path) downloads it, the others wait. See
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
from .engine.drain import Drainer, directory_owner
from .engine.proof import matches_etag, md5_etag, multipart_etag, same_bytes
from .engine.remove import remove_checkpoint
from .errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    DistributedLoadError,
    DistributedSaveError,
    NotFoundError,
    UnsafePathError,
)
from .format.commit import read_committed
from .io.sink import choose_part_size
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .manager.folders import files_under as _files_under
from .manager.folders import gathered, open_run, written_by
from .manager.marker import (
    Written,
    check_remote,
    commit_step,
    root_prefix,
    step_dir,
)
from .options import TransferOptions
from .ranks.collectives import agree, is_distributed, on_first, rank, settle, world_size
from .ranks.groups import drain_group
from .store import Store
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
#: A file one rank writes, known by the rank its name carries: the Trainer's
#: ``rng_state_R.pth``, DeepSpeed's ZeRO files (``[bf16_]zero_pp_rank_R_*``) and DCP's
#: data files (``__R_0.distcp``: FSDP's sharded state).
_RANK_FILE = re.compile(r"(?:^|/)(?:rng_state_|(?:[^/]*_)?zero_pp_rank_|__)(\d+)[_.][^/]*$")


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
    """The manager of the run at ``url``: single objects, the Trainer's retention."""
    return open_run(
        url, options, storage_options, policies=[policy] if policy else None, kind="object"
    )


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of the folder ``src`` made of hard links (a real copy of each
    file where links are refused, e.g. across devices)."""
    for here, dirs, files in os.walk(src):
        rel = Path(here).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            _link(Path(here) / name, dst / rel / name)
        dirs.sort()


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a real copy where links are refused)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def file_owners(listings: Sequence[Sequence[str]]) -> dict[str, int]:
    """Which rank uploads each file of a ``checkpoint-N`` written by several ranks:
    ``listings[r]`` is what rank ``r`` sees in its folder (one folder shared by a node's
    ranks, or one per rank). A file goes to the rank its name names (``rng_state_R``,
    ``zero_pp_rank_R``, ``__R_*.distcp``: the rank that wrote it) when that rank sees
    it, else to the lowest rank that sees it (the Trainer's main process writes the
    rest). Each file is uploaded once."""
    seen: dict[str, list[int]] = {}
    for index, names in enumerate(listings):
        for name in names:
            seen.setdefault(name, []).append(index)
    owners: dict[str, int] = {}
    for name, ranks in seen.items():
        found = _RANK_FILE.search(name)
        named = int(found.group(1)) if found else None
        owners[name] = named if named in ranks else ranks[0]
    return owners


def _check_launched(what: str) -> None:
    """ConfigError when the launcher started several processes (``WORLD_SIZE``) and
    torch.distributed is not initialized yet: each would act alone."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and world_size() == 1:
        raise ConfigError(
            f"{what} runs in one of {launched} processes (WORLD_SIZE) before "
            "torch.distributed is initialized; create the Trainer first (its "
            "TrainingArguments start the process group), then call it on every process"
        )


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
        # Several processes (set by on_train_begin): this rank, the ranks, whether this
        # rank is the first of those sharing its output_dir, the upload thread's group.
        self._rank, self._world = 0, 1
        self._dir_owner = True
        self._group: Any = None
        #: Per step saved by several ranks: this rank's staging error, every file name.
        self._stage_errors: dict[int, BaseException] = {}
        self._expected: dict[int, set[str]] = {}
        #: Steps whose upload failed on every rank (a collective failure), to retry.
        self._failed: set[int] = set()

    # -- naming --------------------------------------------------------------------------
    def step_prefix(self, step: int) -> str:
        """The bucket key prefix of ``checkpoint-{step}`` (ends in ``/``)."""
        return f"{root_prefix(self.manager.root_key)}{step_dir(step)}/"

    def _staging(self) -> Path:
        """Where this rank links the folders it uploads (one process: STAGING itself)."""
        assert self.output_dir is not None
        root = self.output_dir / STAGING
        return root if self._world == 1 else root / f"rank-{self._rank}"

    # -- the Trainer's events ------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the setup before the first step: the bucket answers (a missing bucket
        or rejected credentials raise here, typed, on every rank); with several
        processes, torch.distributed is initialized over all of them, and a process
        group of several ranks is the Trainer's (it counts them all)."""
        world = int(getattr(args, "world_size", 1) or 1)
        if world > 1 and world_size() != world:
            raise ConfigError(
                f"CloudCheckpointCallback ({self.url}): the Trainer runs {world} processes "
                f"and torch.distributed's process group holds {world_size()}; launch them "
                "with torchrun or accelerate launch"
            )
        if world == 1 and world_size() > 1:
            # E.g. accelerate's DeepSpeed path on a host without a GPU: DeepSpeed joins
            # every rank while the Trainer counts one process, so each rank would save
            # and upload the same checkpoint-N as if it were alone.
            raise ConfigError(
                f"CloudCheckpointCallback ({self.url}): torch.distributed's process group "
                f"holds {world_size()} ranks and the Trainer counts 1 process "
                "(TrainingArguments.world_size), so every rank would save the same "
                "checkpoint as its own; make the Trainer see the processes (its device's "
                "distributed backend, e.g. CUDA with DeepSpeed) or run one process"
            )
        self._world = world
        self._rank = rank() if world > 1 else 0
        self.output_dir = Path(args.output_dir)
        self.policy.limit = args.save_total_limit
        self.policy.best = _folder_step(state.best_model_checkpoint)
        self.manager.list()  # several processes: rank 0 lists, every rank learns the outcome
        if self._drainer is not None:  # an earlier train() of this callback that raised
            for dropped in self._drainer.wait(self.timeout).values():
                log.warning("%s; dropped: this run saves its checkpoints again", dropped)
        self._stage_errors.clear()
        self._expected.clear()
        self._failed.clear()
        staging = self.output_dir / STAGING
        if world == 1:
            self._dir_owner = True
            if staging.exists():
                # Folders a killed process was uploading: the resumed run saves them again.
                log.warning("removing %s, left by an earlier run's unfinished uploads", staging)
                shutil.rmtree(staging)
        else:
            self._group = drain_group()  # made by every rank, in step (then reused)
            self._dir_owner, _ = directory_owner(self.output_dir, None)
            error: BaseException | None = None
            if self._dir_owner and staging.exists():
                log.warning("removing %s, left by an earlier run's unfinished uploads", staging)
                try:
                    shutil.rmtree(staging)
                except Exception as exc:
                    error = exc
            settle(error, f"removing {staging}, left by an earlier run")
        self._drainer = Drainer(
            self._upload if world == 1 else self._upload_ranks,
            str(self.output_dir),
            self.url,
            noun="checkpoint",
            at_exit="the resumed run saves those checkpoints again",
            retry="the next save or on_train_end",
            merge=world == 1,  # several ranks: every rank's thread runs the same steps
        )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Hand ``checkpoint-{global_step}`` to the upload thread and return (several
        processes: once every rank wrote its part and the ranks agreed who uploads what)."""
        if self._drainer is None:
            self.on_train_begin(args, state, control)
        assert self._drainer is not None and self.output_dir is not None
        step = int(state.global_step)
        folder = self.output_dir / f"checkpoint-{step}"
        if self._world > 1:
            self.policy.best = _folder_step(state.best_model_checkpoint)
            self._stage_ranks(step, folder)
            self._prune_local()
            return
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
        callback's); raise the error of the oldest one that failed again. With several
        processes, a collective: every rank calls it (``on_train_end`` does)."""
        if self._drainer is None:
            return
        limit = self.timeout if timeout is None else timeout
        if self._world > 1:
            # Once every rank's thread is idle, each knows the same failed steps (each
            # step's outcome is agreed); retry those every rank lists, in one order.
            self._drainer.wait(limit)
            with self._lock:
                mine = sorted(self._failed)
            for step in _failed_everywhere(agree(None, mine).values):
                self._drainer.submit(step)
        else:
            self._drainer.retry_failed()
        failed = self._drainer.wait(limit)
        if failed:
            raise failed[min(failed)]

    # -- several processes ---------------------------------------------------------------
    def _stage_ranks(self, step: int, folder: Path) -> None:
        """``on_save`` on several processes (every rank, in the training thread): once
        every rank wrote its part of ``folder``, agree who uploads which file, link this
        rank's into its staging folder and queue the step (after the steps that failed
        on every rank, tried again) for the upload thread."""
        assert self._drainer is not None
        if step in self._drainer.unfinished():
            self._drainer.wait(self.timeout)  # the same step saved again: after that one
        missing = None
        if not folder.is_dir():
            missing = NotFoundError(f"the Trainer's checkpoint folder {folder} is missing")
        # A barrier too: every rank's files of this step are written once all got here.
        settle(
            missing, f"the Trainer's {folder.name} on every rank", error_type=DistributedSaveError
        )
        error: BaseException | None = None
        names: list[str] = []
        try:
            names = _files_under(folder)
        except Exception as exc:
            error = exc
        with self._lock:
            failed = sorted(self._failed - {step})
        agreement = agree(error, (names, failed))
        if error is not None:
            raise error
        agreement.raise_failures(f"the listing of each rank's {folder.name}", DistributedSaveError)
        owners = file_owners([listed for listed, _ in agreement.values])
        staged = self._staging() / folder.name
        partial = staged.with_name(staged.name + ".partial")
        staging_error: BaseException | None = None
        try:
            for old in (staged, partial):
                if old.exists():
                    shutil.rmtree(old)
            partial.mkdir(parents=True)
            for name in names:
                if owners[name] == self._rank:
                    (partial / name).parent.mkdir(parents=True, exist_ok=True)
                    _link(folder / name, partial / name)
            partial.rename(staged)
        except Exception as exc:  # raised by the upload, where every rank learns it
            staging_error = exc
        with self._lock:
            self._expected[step] = set(owners)
            self._stage_errors.pop(step, None)
            if staging_error is not None:
                self._stage_errors[step] = staging_error
        for again in _failed_everywhere([f for _, f in agreement.values]):
            self._drainer.submit(again)
        self._drainer.submit(step)

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
            remove_checkpoint(store, prefix, options)
            self._cleared.add(step)
        copied = copy_tree(LocalStore(staged), "", store, prefix, options, exclude=(MARKER_NAME,))
        written = written_by(copied)
        commit_step(store, prefix, step, KIND, {}, {"folder": staged.name}, files=written)
        with self._lock:
            self._committed.add(step)
        shutil.rmtree(staged, ignore_errors=True)
        try:
            self.manager.apply_retention()
        except Exception as exc:
            log.warning(
                "retention under %s failed (the checkpoint is committed): %s", self.url, exc
            )

    def _upload_ranks(self, step: int) -> None:
        """The upload thread on several processes (every rank, the same steps in the
        same order, collectives on the upload group): rank 0 checks the step is not
        committed and clears leftovers; each rank uploads its staged files; once every
        rank's upload succeeded rank 0 commits and applies retention. A failure on any
        rank fails the step on every rank (DistributedSaveError naming it)."""
        try:
            self._upload_ranks_once(step)
        except BaseException:
            with self._lock:
                self._failed.add(step)
            raise
        with self._lock:
            self._failed.discard(step)
            self._committed.add(step)
            self._expected.pop(step, None)
            self._stage_errors.pop(step, None)
        shutil.rmtree(self._staging() / f"checkpoint-{step}", ignore_errors=True)

    def _upload_ranks_once(self, step: int) -> None:
        staged = self._staging() / f"checkpoint-{step}"
        store, options = self.manager.store, self.manager.options
        prefix = self.step_prefix(step)
        url = store.url(prefix)
        group = self._group

        def clear() -> None:  # the first rank
            if read_committed(store, prefix + MARKER_NAME) is not None:
                raise AlreadyExistsError(
                    f"{staged.name} of {self.output_dir} is already committed at {url}; "
                    "resume from the latest committed checkpoint"
                )
            if step not in self._cleared:  # a killed run's leftovers: never taken as ours
                remove_checkpoint(store, prefix, options)
                self._cleared.add(step)

        on_first(
            clear,
            group,
            what=f"the check that {url} is not committed",
            error_type=DistributedSaveError,
        )
        with self._lock:
            error = self._stage_errors.get(step)
            expected = set(self._expected.get(step, ()))
        mine: dict[str, Written] = {}
        if error is None:
            try:
                if not staged.is_dir():
                    raise NotFoundError(f"the staged copy {staged} of {staged.name} is missing")
                mine = written_by(
                    copy_tree(
                        LocalStore(staged), "", store, prefix, options, exclude=(MARKER_NAME,)
                    )
                )
            except Exception as exc:
                error = exc
        # Each name the ranks staged, with the size and ETag its rank's upload got.
        files: dict[str, Written | None] = dict.fromkeys(expected)
        for each in gathered(error, mine, group, f"the upload of each rank's files to {url}"):
            files.update(each)

        def commit() -> None:  # the first rank, once every rank's files are in the bucket
            metadata = {"folder": staged.name, "world_size": self._world}
            commit_step(store, prefix, step, KIND, {}, metadata, files=files)
            try:
                self.manager.apply_retention()
            except Exception as exc:
                log.warning(
                    "retention under %s failed (the checkpoint is committed): %s", self.url, exc
                )

        on_first(commit, group, what=f"the commit of {url}", error_type=DistributedSaveError)

    def _prune_local(self) -> None:
        """With ``keep_local``: delete local ``checkpoint-N`` folders committed in the
        bucket beyond the ``keep_local`` newest, never the best one (training thread
        only, so never beside the Trainer's own rotation; with several processes, the
        first rank of each output_dir)."""
        if self.keep_local is None or self.output_dir is None or not self._dir_owner:
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


def _failed_everywhere(lists: Sequence[Sequence[int]]) -> list[int]:
    """The steps every rank's list holds, ascending."""
    common = set(lists[0]) if lists else set()
    for steps in lists[1:]:
        common &= set(steps)
    return sorted(common)


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
    ``local_dir`` is returned when its files match the marker's sizes (and hash to its
    MD5 ETags, where the store gives those), else refused
    (:class:`~cloudckpt.errors.AlreadyExistsError`). ``local_dir`` may be a link; nothing
    inside it is followed: a ``checkpoint-N``, its hidden folder or a folder below them
    that is a symbolic link is refused (:class:`~cloudckpt.errors.UnsafePathError`).

    On several processes (torch.distributed initialized, as after the Trainer is made)
    it is a collective, called by every process: rank 0 reads which step is the newest
    and every process gets that step; the first process of each local directory (host
    and resolved path) downloads it and the others wait, then every process returns
    the same path. A failure raises on every process (the failed one its own error, the
    others :class:`~cloudckpt.errors.DistributedLoadError` naming it). Called before
    the process group exists while the launcher started several processes
    (``WORLD_SIZE``), it raises :class:`~cloudckpt.errors.ConfigError`.
    """
    _check_launched("fetch_latest")
    manager = _open_run(url, options, storage_options)
    info = manager.latest()  # several processes: rank 0 lists, every rank gets the answer
    if info is None:
        return None
    local = Path(local_dir).expanduser()
    if not is_distributed():
        return _fetch(manager, info, local)
    first, _ = directory_owner(local, None)
    error: BaseException | None = None
    if first:
        try:
            _fetch(manager, info, local)
        except Exception as exc:
            error = exc
    settle(
        error,
        f"the fetch of {info.url} into each process's local_dir",
        error_type=DistributedLoadError,
    )
    return str(local / f"checkpoint-{info.step}")


def _fetch(manager: CheckpointManager, info: CheckpointInfo, local: Path) -> str:
    """Download ``info`` into ``local/checkpoint-N`` (one process; see fetch_latest)."""
    name = f"checkpoint-{info.step}"
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
            bucket_prefix = info.url[len(manager.store.url("")) :]
            _check_hashes(LocalStore(target), info, manager.store, bucket_prefix, manager.options)
        except (CorruptCheckpointError, NotFoundError) as exc:
            raise AlreadyExistsError(
                f"{target} exists and is not {info.url} ({exc}); move it away to fetch"
            ) from exc
        return str(target)
    store, prefix = manager.store, info.url[len(manager.store.url("")) :]
    check_remote(store, prefix, info)
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


def _check_hashes(
    store: LocalStore, info: CheckpointInfo, bucket: Store, prefix: str, options: TransferOptions
) -> None:
    """Every file the marker lists with an S3-style MD5 ETag (S3 and the stores that
    answer like it) hashes to it under ``store`` (engine/proof.py): a folder of another
    run's step of the same sizes is not the bucket's. An opaque ETag (GCS, Azure) proves
    nothing about local bytes: such a file is taken by its size (docs/integrations.md).
    A multipart ETag is tried first with the part size this run's uploads choose
    (``options``), then with the usual whole-MiB ones; when none gives it (an upload
    with another part size), the file is compared with the bucket's (``bucket`` under
    ``prefix``) byte for byte: a download of that file, never a guess."""
    for f in info.files:
        if not md5_etag(f.etag):
            continue
        ours = choose_part_size(f.size, options.part_size, options.write_concurrency)
        if matches_etag(store, f.name, f.size, f.etag, (ours,)):
            continue
        if multipart_etag(f.etag) and same_bytes(bucket, prefix + f.name, store, f.name, f.size):
            continue
        raise CorruptCheckpointError(
            f"{store.url(f.name)} holds other bytes than the bucket's (its MD5 is not "
            f"the ETag {f.etag} its marker {info.url} records)"
        )


def _check_sizes(store: LocalStore, info: CheckpointInfo) -> None:
    """Every file the marker lists is under ``store`` at its size."""
    for f in info.files:
        size = store.head(f.name).size  # NotFoundError when missing
        if size != f.size:
            raise CorruptCheckpointError(
                f"{store.url(f.name)} holds {size} bytes, its marker {info.url} says {f.size}"
            )


__getattr__, __dir__ = lazy_attributes(globals(), {"CloudCheckpointCallback": _define}, __all__)
