"""The Hugging Face Trainer's checkpoints on object storage: each ``checkpoint-N``
folder the Trainer writes is committed in a local tier at once and drained to a bucket
in the background, and the newest committed one is fetched back for
``trainer.train(resume_from_checkpoint=...)``.

    from cloudckpt.hf import CloudCheckpointCallback, fetch_latest

    callback = CloudCheckpointCallback("s3://bucket/run1")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=fetch_latest("s3://bucket/run1", args.output_dir))

The callback runs a :class:`cloudckpt.CheckpointManager` with a local tier
(docs/tiers.md), ``output_dir/_cloudckpt-tier/<id>`` (one per run URL) unless
``local_dir=`` names another, and this module's payload kind (:class:`TrainerPayload`):
``on_save`` hard-links the files the Trainer wrote for ``checkpoint-N`` into the tier's
``step-N/`` (no bytes copied; the Trainer's rotation may delete its folder meanwhile;
an earlier save's files left in the folder are not this save's: ``on_step_end`` notes
them, and gives files linked elsewhere bytes of their own before the Trainer writes in
place) and commits them there with the
manager's local marker, asking the bucket nothing; the manager's drainer then copies
the step to ``URL/step-00000000N/`` with the Trainer's file names kept and commits it
with the manager's ``_CHECKPOINT.json`` (``cloudckpt ls``, ``verify`` and
``CheckpointManager(URL).list()`` / ``latest()`` read it), then applies the Trainer's
``save_total_limit`` in the bucket, never deleting the best checkpoint
(``best_model_checkpoint``) nor the newest committed one. ``on_train_end`` waits for
the drains (``drain()``) and raises the error of one that failed again.

On several processes (``torchrun``, ``accelerate launch``: DDP, FSDP, DeepSpeed) every
rank runs the callback: once every rank wrote its part of ``checkpoint-N`` each rank
lists the files it wrote (the rank a file's name names: ``rng_state_R.pth``,
DeepSpeed's ``zero_pp_rank_R_*``, DCP's ``__R_*.distcp``; any other file the first
rank of the folder, the Trainer's main process) and links them into its node's tier
(each file once: :func:`file_owners`), and the manager's
tier of several ranks does the rest (every node's copy gets the main process's files;
the drains on cloudckpt's own gloo group, never the training group).
``fetch_latest`` is the manager's restore, a collective there: the ranks agree on the
step, the first process of each local directory (host and path) fetches it (from the
tier where whole, else from the bucket), the others wait. See docs/integrations.md
(Hugging Face Trainer).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ._lazy import lazy_attributes
from .engine.copy import copy_object, copy_tree
from .engine.drain import directory_owner
from .engine.leftovers import sweep_leftovers
from .engine.proof import matches_etag, md5_etag, multipart_etag, same_bytes
from .errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    DistributedLoadError,
    DistributedSaveError,
    NotFoundError,
    UnsafePathError,
)
from .io.sink import choose_part_size
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .manager.folders import (
    TieredRuns,
    checked_keep_local,
    checked_path,
    committed_copy,
    drained_steps,
    files_under,
    gathered,
    newest_local_files,
    payload_call,
    run_group,
    save_to_tier,
    tier_folder,
    tiered_run,
)
from .manager.folders import open_run as _open_run
from .manager.marker import check_remote
from .options import TransferOptions, check_seconds
from .ranks.collectives import agree, is_distributed, rank, settle, world_size
from .store import Store, Target
from .store.local import LocalStore

__all__ = ["CloudCheckpointCallback", "fetch_latest"]

#: Built on transformers' ``TrainerCallback`` when first used (``_define``, the module
#: ``__getattr__`` at the end).
CloudCheckpointCallback: Any

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of a Trainer checkpoint.
KIND = "hf-trainer"
#: The folder under ``output_dir`` that holds the callback's local tiers when it is
#: given no ``local_dir``, one per run URL. The Trainer's rotation only looks at
#: ``checkpoint-*``, and its ``push_to_hub`` leaves out ``_*`` (a leading dot would not:
#: the tier's copies and its run file would go to the Hub repository).
TIER = "_cloudckpt-tier"
#: Where the previous release linked each folder's files until uploaded: removed at
#: ``on_train_begin`` (the Trainer's folders are saved again as training goes on).
STAGING = ".cloudckpt-upload"
#: How many drained steps the tier keeps (hard links of the Trainer's folders: no
#: bytes while the Trainer keeps the folder); steps not drained yet are all kept.
TIER_KEEP = 1
#: What the payload kind of this module is given by (its ConfigError names it).
_FUNCTIONS = "cloudckpt.hf.CloudCheckpointCallback / fetch_latest"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")
#: File suffixes of torch archives, whose every record's CRC-32 ``fetch_latest`` checks.
_ARCHIVES = (".pt", ".pth", ".bin")
#: A file one rank writes, known by the rank its name carries: the Trainer's
#: ``rng_state_R.pth``, DeepSpeed's ZeRO files (``[bf16_]zero_pp_rank_R_*``) and DCP's
#: data files (``__R_0.distcp``: FSDP's sharded state).
_RANK_FILE = re.compile(r"(?:^|/)(?:rng_state_|(?:[^/]*_)?zero_pp_rank_|__)(\d+)[_.][^/]*$")
#: What every node's copy gets from the main process before a save of this process
#: said otherwise and before the tier holds a step (the Trainer always writes it).
_DEFAULT_SHARED = ("trainer_state.json",)


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


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a real copy where links are refused)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _link_files(src: Path, dst: Path, names: Iterable[str]) -> None:
    """Each of ``names`` (relative paths) under ``src`` linked at the same path under
    ``dst`` (:func:`_link`), its folders made."""
    for name in names:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        _link(src / name, dst / name)


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


@dataclass
class _FolderCall:
    """What :meth:`TrainerPayload.save` commits: the files of the Trainer's
    ``checkpoint-N`` folder that this process wrote (``writes``: by name) in this save
    (``before``: each file's identity before the Trainer saved, where the folder was
    there already: a file still so is an earlier save's, not this one's)."""

    folder: Path
    writes: Callable[[str], bool] = lambda name: True
    before: Mapping[str, tuple[int, ...]] | None = None

    def written(self) -> list[str]:
        """The files of the folder this process wrote in this save; an earlier save's
        left there (the Trainer does not empty a folder it saves into) are named at
        WARNING and left out."""
        names = [n for n in files_under(self.folder) if self.writes(n)]
        if not self.before:
            return names
        stale = [n for n in names if self.before.get(n) == _identity(self.folder / n)]
        if stale:
            log.warning(
                "%s: %s were left there by an earlier save and not written by this one; "
                "they are not part of this checkpoint",
                self.folder,
                stale,
            )
        return [n for n in names if n not in stale]


def _identity(path: Path) -> tuple[int, ...]:
    """What tells a file from a rewrite of it: its inode, size and times."""
    st = path.stat(follow_symlinks=False)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class _FetchCall:
    """Where :meth:`TrainerPayload.load` puts the step: ``local/checkpoint-N``."""

    local: Path


class TrainerPayload:
    """The manager's payload kind of a Hugging Face Trainer checkpoint (kind
    ``hf-trainer``): the callback and :func:`fetch_latest` pass it to their
    :class:`CheckpointManager`; it is not meant to be given one by hand.

    ``save`` hard-links the files of the Trainer's ``checkpoint-N`` into the tier's
    ``step-N/`` folder (several ranks: each rank the files :func:`file_owners` gives
    it); ``load`` fetches a committed copy (the bucket's, a local tier's, or the
    manager's view of both) into ``local/checkpoint-N`` and returns that path.
    """

    name = KIND

    def __init__(self, local_dir: Path | None = None) -> None:
        #: The tier's directory (None: a run without one), whose newest step says which
        #: files every node's copy gets before a save of this process did.
        self.local_dir = local_dir
        #: The files every node's copy gets, as the ranks agreed at the last save.
        self._shared: tuple[str, ...] | None = None

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """The files only the main process writes, which every node's copy gets: those
        it linked at the last save but the ones a rank writes for itself (its name
        names it); before one, those of the tier's newest step, else
        ``trainer_state.json``."""
        if self._shared is not None:
            return self._shared
        return _shared_files(newest_local_files(self.local_dir)) or _DEFAULT_SHARED

    def needs_room(self, state: Any) -> bool:
        """Whether a save of ``state`` takes room in the tier: only where the Trainer's
        folder is on another filesystem (links refused, each file copied)."""
        call = payload_call(state, _FolderCall, "Hugging Face Trainer", _FUNCTIONS)
        if self.local_dir is None:
            return True
        try:
            return call.folder.stat().st_dev != self.local_dir.stat().st_dev
        except OSError:
            return True  # the save names what is missing

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> None:
        """Link the files of the Trainer's folder that this save wrote (``state``, a
        :class:`_FolderCall`) into the tier's folder ``prefix_url`` names. Several
        ranks (every rank): once every rank wrote its part (a barrier), each lists the
        files it wrote and links those :func:`file_owners` gives it; a rank's failure is
        raised on every rank."""
        call = payload_call(state, _FolderCall, "Hugging Face Trainer", _FUNCTIONS)
        folder = tier_folder(prefix_url, options, "Hugging Face Trainer")
        if not is_distributed():
            if not call.folder.is_dir():
                raise NotFoundError(f"the Trainer's checkpoint folder {call.folder} is missing")
            _link_files(call.folder, folder, call.written())
            return None  # the tier's commit lists the folder
        group = run_group()
        missing = None
        if not call.folder.is_dir():
            missing = NotFoundError(f"the Trainer's checkpoint folder {call.folder} is missing")
        # A barrier too: every rank's files of this step are written once all got here.
        settle(
            missing,
            f"the Trainer's {call.folder.name} on every rank",
            group=group,
            error_type=DistributedSaveError,
        )
        error: BaseException | None = None
        names: list[str] = []
        try:  # each rank its own files: those it wrote in this save
            names = call.written()
        except Exception as exc:
            error = exc
        listings = gathered(error, names, group, f"the listing of each rank's {call.folder.name}")
        owners = file_owners(listings)
        me = rank()
        try:
            _link_files(call.folder, folder, [n for n in names if owners[n] == me])
        except Exception as exc:
            error = exc
        settle(
            error,
            f"the links of each rank's {call.folder.name} into its local tier",
            group=group,
            error_type=DistributedSaveError,
        )
        self._shared = _shared_files(n for n, owner in owners.items() if owner == 0)
        return None

    def load(
        self,
        prefix_url: str | Target,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> str:
        """Fetch the committed copy at ``prefix_url`` (a URL, or an opened ``Target``:
        the manager's view of the local copy over the bucket's) into
        ``state.local/checkpoint-N`` (``state``, a :class:`_FetchCall`) and return that
        path. Several processes: the first of each local directory fetches, the others
        wait; a failure is raised on every process. ``local``: a copy in a local tier
        (its sizes checked by the manager; the ETags are the bucket's to check)."""
        call = payload_call(state, _FetchCall, "Hugging Face Trainer", _FUNCTIONS)
        target, prefix, info = committed_copy(prefix_url, options)
        fetch = _fetch_tier if local else _fetch_bucket
        if not is_distributed():
            return fetch(target.store, prefix, target.options, info, call.local)
        first, _ = directory_owner(call.local, run_group())
        error: BaseException | None = None
        if first:
            try:
                fetch(target.store, prefix, target.options, info, call.local)
            except Exception as exc:
                error = exc
        settle(
            error,
            f"the fetch of {info.url} into each process's local_dir",
            group=run_group(),
            error_type=DistributedLoadError,
        )
        return str(call.local / f"checkpoint-{info.step}")


def _shared_files(names: Any) -> tuple[str, ...]:
    """Of ``names`` (files of the main process), those every node's copy gets: all but
    the files a rank writes for itself (:data:`_RANK_FILE`)."""
    return tuple(sorted(n for n in names if not _RANK_FILE.search(n)))


#: The managers of the runs with a local tier, one per (run URL, local directory) in a
#: process (manager/folders.tiered_run): the drainer outlives a callback's train().
_tiered: TieredRuns = {}


def _tiered_run(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
) -> CheckpointManager:
    """This process's manager of the run at ``url`` with the local tier ``local_dir``
    and the Trainer's payload kind (manager/folders.tiered_run)."""
    return tiered_run(_tiered, url, local_dir, options, storage_options, TrainerPayload)


def _own_bytes(tier: LocalStore, key: str, chunk: int = 64 << 20) -> None:
    """Give the file ``key`` of ``tier`` (a local folder) bytes of its own: a copy
    written to a locked temp file beside it and renamed over it, so an in-place write
    of it no longer reaches the files it was hard-linked with."""
    size = tier.head(key).size
    if size == 0:
        return
    upload = tier.create_multipart(key)
    try:
        parts = []
        for number, start in enumerate(range(0, size, chunk), 1):
            data = tier.get_range(key, start, min(size, start + chunk))
            parts.append(tier.upload_part(upload, number, data, start))
        tier.complete_multipart(upload, parts)
    except BaseException:
        tier.abort_multipart(upload)
        raise


def default_tier(output_dir: Path, url: str) -> Path:
    """The callback's local tier for the run ``url`` (a resolved root URL) under
    ``output_dir`` when no ``local_dir`` is given: ``_cloudckpt-tier/<id>``, the id a
    hash of the URL, so runs of other URLs sharing an ``output_dir`` (the Trainer's
    default is one name for every run) each have their own."""
    return output_dir / TIER / hashlib.sha256(url.encode()).hexdigest()[:16]


def _refuse_links_in(folder: Path) -> None:
    """UnsafePathError when ``folder`` (a ``checkpoint-N`` the Trainer is about to save
    into) is a symbolic link or holds one: the Trainer would write through it, into a
    copy elsewhere (another run's, a local tier's committed one)."""
    found = [folder] if folder.is_symlink() else []
    if not found:
        for here, dirs, files in os.walk(folder):  # links to folders are not entered
            found += [Path(here) / n for n in (*dirs, *files) if (Path(here) / n).is_symlink()]
    if found:
        raise _link_error(
            found[0],
            f"in the Trainer's {folder.name}, which it is about to save into: it would "
            "write through it, into the files it points to",
        )


def _link_error(path: Path, where: str) -> UnsafePathError:
    """The error of the symbolic link ``path`` found ``where``, naming its target."""
    link = os.readlink(path)
    return UnsafePathError(
        f"{path} is a symbolic link (to {link}) {where}; remove it", path=str(path), link=link
    )


def unshare(folder: Path, mine: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Give each file under ``folder`` (those ``mine`` accepts) that is hard-linked
    elsewhere bytes of its own (a copy renamed over it: :func:`_own_bytes`), so that
    writing it in place reaches no other link; returns the files so treated (WARNING
    naming them)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    sweep_leftovers(LocalStore(folder))  # a copy an unshare killed midway left
    shared = [
        rel
        for rel in files_under(folder)
        if mine(rel) and not (folder / rel).is_symlink() and (folder / rel).stat().st_nlink > 1
    ]
    if shared:
        log.warning(
            "%s is saved again and %d of its file(s) are hard-linked elsewhere (a local "
            "tier's copy): they get bytes of their own first, so the Trainer's write does "
            "not reach the other copy: %s",
            folder,
            len(shared),
            shared,
        )
        store = LocalStore(folder)
        for rel in shared:
            _own_bytes(store, rel)
    return shared


class CallbackBase:
    """What :class:`CloudCheckpointCallback` does, without transformers (its events:
    ``on_train_begin``, ``on_save``, ``on_train_end``)."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        local_dir: str | os.PathLike[str] | None = None,
        keep_local: int | None = None,
        options: TransferOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        checked_keep_local(keep_local)
        check_seconds("timeout", timeout)
        self.policy = TrainerRetention()
        #: The run in the bucket (the URL is resolved, and checked, here); the manager
        #: with the local tier once training begins.
        self.manager = _open_run(url, options, storage_options)
        self.url = self.manager.root_url
        self.local_dir = None if local_dir is None else checked_path("local_dir", local_dir)
        self.keep_local = keep_local
        self.timeout = timeout
        self.output_dir: Path | None = None
        self._settings = (options, storage_options)
        self._tier: CheckpointManager | None = None
        # Several processes (set by on_train_begin): the ranks, whether this rank is
        # the first of those sharing its output_dir.
        self._world = 1
        self._dir_owner = True
        #: The step whose folder was there before the Trainer saved it, and the identity
        #: of each of its files this process writes (on_step_end).
        self._before: tuple[int, dict[str, tuple[int, ...]]] | None = None

    def tier_dir(self) -> Path:
        """The local tier's directory: ``local_dir``, else the run's folder under
        ``output_dir/_cloudckpt-tier`` (:func:`default_tier`)."""
        if self.local_dir is not None:
            return self.local_dir
        assert self.output_dir is not None
        return default_tier(self.output_dir, self.url)

    # -- the Trainer's events ------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the setup before the first step: the bucket answers (a missing bucket
        or rejected credentials raise here, typed, on every rank; a bucket that cannot
        be reached is a WARNING, and the saves go on in the local tier); with several
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
        self.output_dir = Path(args.output_dir)
        self.policy.limit = args.save_total_limit
        self.policy.best = _folder_step(state.best_model_checkpoint)
        group = run_group()
        self._dir_owner = directory_owner(self.output_dir, group)[0] if world > 1 else True
        error: BaseException | None = None
        try:
            tier = _tiered_run(self.url, self.tier_dir(), *self._settings)
            tier.policies = [self.policy]
            self._tier = tier
            staging = self.output_dir / STAGING
            if self._dir_owner and staging.exists():
                log.warning("removing %s, left by the previous release's uploads", staging)
                shutil.rmtree(staging)
        except Exception as exc:
            error = exc
        settle(error, f"opening the local tier of {self.url} on every rank", group=group)
        assert self._tier is not None
        self._tier.list()  # several processes: rank 0 lists, every rank learns the outcome

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before the Trainer saves this step, when ``checkpoint-{global_step}`` is in
        ``output_dir`` already: its files hard-linked elsewhere (a local tier's
        committed copy, of this run or another) get files of their own first
        (:func:`unshare`), since the Trainer writes its files in place; then each
        file's identity is noted, so the save commits only what the Trainer wrote
        (:meth:`_FolderCall.written`). Each rank treats the files it writes itself
        (:meth:`_writes`), so no rank copies a file another rank is writing."""
        if self.output_dir is None:
            return
        step = int(state.global_step)
        folder = self.output_dir / f"checkpoint-{step}"
        self._before = None
        if os.path.lexists(folder):
            _refuse_links_in(folder)
        if folder.is_dir():
            unshare(folder, self._writes)
            self._before = (
                step,
                {n: _identity(folder / n) for n in files_under(folder) if self._writes(n)},
            )

    def _writes(self, name: str) -> bool:
        """Whether this process writes the file ``name`` of a ``checkpoint-N``: one its
        name names this rank by, or, any other, this rank is the first of its folder's."""
        found = _RANK_FILE.search(name)
        me = rank() if self._world > 1 else 0
        return int(found.group(1)) == me if found else self._dir_owner

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Commit ``checkpoint-{global_step}`` in the local tier (links, no request to
        the bucket) and return; the drainer commits it in the bucket (several
        processes: every rank, once every rank wrote its part)."""
        if self._tier is None:
            self.on_train_begin(args, state, control)
        assert self._tier is not None and self.output_dir is not None
        step = int(state.global_step)
        folder = self.output_dir / f"checkpoint-{step}"
        self.policy.best = _folder_step(state.best_model_checkpoint)
        metadata: dict[str, Any] = {"folder": folder.name}
        if self._world > 1:
            metadata["world_size"] = self._world
        before = self._before[1] if self._before and self._before[0] == step else None
        self._before = None
        save_to_tier(
            self._tier,
            step,
            _FolderCall(folder, self._writes, before),
            metadata=metadata,
            keep_local=TIER_KEEP,
            policies=[self.policy],
        )
        self._prune_local()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait until every saved folder is committed in the bucket; a failed drain is
        tried once more, and its error (naming the step) raised if it fails again.
        Then ``keep_local`` applies to the folders now committed."""
        self.wait()
        self._prune_local()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the drains (the manager's ``drain``: TimeoutError after ``timeout``
        s, default the callback's); raise the error of the oldest one that failed
        again. With several processes, a collective: every rank calls it
        (``on_train_end`` does)."""
        if self._tier is not None:
            self._tier.drain(self.timeout if timeout is None else timeout)

    def _prune_local(self) -> None:
        """With ``keep_local``: delete local ``checkpoint-N`` folders committed in the
        bucket beyond the ``keep_local`` newest, never the best one (training thread
        only, so never beside the Trainer's own rotation; with several processes, the
        first rank of each output_dir)."""
        if self.keep_local is None or self.output_dir is None or not self._dir_owner:
            return
        assert self._tier is not None
        folders = sorted(
            (step, path)
            for path in self.output_dir.glob("checkpoint-*")
            if path.is_dir() and (step := _folder_step(path)) is not None
        )
        committed = drained_steps(self._tier)
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
    tier_dir: str | os.PathLike[str] | None = None,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """Fetch the newest committed checkpoint of the run at ``url`` into
    ``local_dir/checkpoint-N`` and return that path (None: nothing committed).

    ``tier_dir``: the callback's local tier (default ``local_dir/_cloudckpt-tier``
    when that folder exists, the callback's own default): the step is then the newest
    committed in either tier (the manager's restore, docs/tiers.md), its files linked
    from the tier when its copy there is whole (a copy that fails its checks: a
    WARNING, and the bucket's), else downloaded; a bucket that cannot be reached leaves
    the tier's steps (WARNING; none there: ``StorageError``, never a fresh start).

    Downloaded files go into a hidden folder beside ``checkpoint-N``, are checked
    against the marker (sizes, ETags, every torch archive's CRC-32s) and the folder is
    renamed into place once whole; an interrupted fetch resumes there. A
    ``checkpoint-N`` already in ``local_dir`` is returned when it holds the step's
    bytes (the bucket's copy: its files match the marker's sizes and hash to its MD5
    ETags, where the store gives those; the tier's: each file is the tier's file or
    holds its bytes), else refused (:class:`~cloudckpt.errors.AlreadyExistsError`).
    ``local_dir`` may be a link; nothing inside it is followed: a ``checkpoint-N``, its
    hidden folder or a folder below them that is a symbolic link is refused
    (:class:`~cloudckpt.errors.UnsafePathError`).

    On several processes (torch.distributed initialized, as after the Trainer is made)
    it is a collective, called by every process: the ranks agree on the step; the
    first process of each local directory (host and resolved path) fetches it and the
    others wait, then every process returns the same path. A failure raises on every
    process (the failed one its own error, the others
    :class:`~cloudckpt.errors.DistributedLoadError` naming it). Called before the
    process group exists while the launcher started several processes
    (``WORLD_SIZE``), it raises :class:`~cloudckpt.errors.ConfigError`.
    """
    _check_launched("fetch_latest")
    local = checked_path("local_dir", local_dir)
    manager = _open_run(url, options, storage_options, kind=TrainerPayload())
    tier = _tier_of(local, manager.root_url, tier_dir)
    if tier is not None:  # a manager of its own: it only restores (never drains)
        error: BaseException | None = None
        try:
            tier = tier.resolve()
            manager = _open_run(
                url, options, storage_options, kind=TrainerPayload(tier), local_dir=tier
            )
        except Exception as exc:  # a damaged run file, a folder it cannot make
            error = exc
        if is_distributed():  # every rank learns of one that failed, at once
            settle(
                error,
                f"opening the local tier {tier} on every rank",
                group=run_group(),
                error_type=DistributedLoadError,
            )
        elif error is not None:
            raise error
    fetched: str | None = manager.restore(state=_FetchCall(local))
    return fetched


def _tier_of(local: Path, url: str, tier_dir: str | os.PathLike[str] | None) -> Path | None:
    """The local tier :func:`fetch_latest` reads: ``tier_dir``, else the callback's
    default for the run ``url`` under ``local`` when it exists (on any rank: the ranks
    agree), else None."""
    if tier_dir is not None:
        path = checked_path("tier_dir", tier_dir)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"tier_dir={str(tier_dir)!r} is not a directory")
        return path
    default = default_tier(local, url)
    found = default.is_dir()
    if is_distributed():
        found = any(agree(value=found, group=run_group()).values)
    return default if found else None


def _refuse_link(target: Path, names: Iterable[str] = ()) -> None:
    """UnsafePathError when ``target`` (a ``checkpoint-N`` in local_dir), or any folder
    or file on the way to one of ``names`` below it, is a symbolic link."""
    for rel in ("", *names):
        path = target
        for part in [p for p in rel.split("/") if p]:
            if not os.path.lexists(path):
                break
            _no_link(path)
            path = path / part
        if os.path.lexists(path):
            _no_link(path)


def _no_link(path: Path) -> None:
    """UnsafePathError when ``path`` is a symbolic link: neither returned, read through
    nor written through."""
    if path.is_symlink():
        raise _link_error(
            path,
            "inside local_dir; fetch_latest neither reads, writes through nor returns a link there",
        )


def _verify_archives(
    fetched: LocalStore, sizes: Mapping[str, int], options: TransferOptions
) -> None:
    """Every torch archive among ``sizes`` (name: size) has each record's CRC-32 right."""
    from .engine.verify import verify_archive

    local_options = options.replace(storage_options={})
    for name, size in sizes.items():
        if name.endswith(_ARCHIVES):
            verify_archive(fetched, name, local_options, expected_size=size)


def _fetch_bucket(
    store: Store, prefix: str, options: TransferOptions, info: CheckpointInfo, local: Path
) -> str:
    """Download the bucket's committed ``info`` (under ``prefix`` in ``store``) into
    ``local/checkpoint-N`` (one process; see fetch_latest). A folder there already
    keeps the files it holds when they are the bucket's, and gets the others."""
    target = local / f"checkpoint-{info.step}"
    _refuse_link(target, (f.name for f in info.files))
    if target.exists():
        present = tuple(f for f in info.files if os.path.lexists(target / f.name))
        try:
            _check_sizes(LocalStore(target), replace(info, files=present))
            _check_hashes(LocalStore(target), replace(info, files=present), store, prefix, options)
        except (CorruptCheckpointError, NotFoundError) as exc:
            raise AlreadyExistsError(
                f"{target} exists and is not {info.url} ({exc}); move it away to fetch"
            ) from exc
        missing = {f.name: f.size for f in info.files if f not in present}
        if missing:
            check_remote(store, prefix, info)
            _fill(
                target, missing, options, lambda dst, rel: _copy(store, prefix, dst, rel, options)
            )
        return str(target)
    check_remote(store, prefix, info)
    # Made with no link inside local_dir (UnsafePathError); written below it the same way.
    partial = LocalStore(local).make_dirs(f".{target.name}.cloudckpt-fetch/")
    fetched = LocalStore(partial)
    copy_tree(store, prefix, fetched, "", options, exclude=(MARKER_NAME,))
    _check_sizes(fetched, info)
    _verify_archives(fetched, {f.name: f.size for f in info.files}, options)
    partial.rename(target)
    return str(target)


def _fetch_tier(
    store: Store, prefix: str, options: TransferOptions, info: CheckpointInfo, local: Path
) -> str:
    """Put the step a local tier committed (``info``; under ``prefix`` in ``store``: the
    tier's folder, or the manager's view of it over the bucket's copy) into
    ``local/checkpoint-N``: each file the tier holds hard-linked from it (copied where
    links are refused), any other downloaded (one process; see fetch_latest). A folder
    there already keeps the files it holds when each is the tier's file or holds its
    bytes, and gets the others (a node's own folder holds its ranks' files only)."""
    target = local / f"checkpoint-{info.step}"
    sizes = {
        o.key[len(prefix) :]: o.size
        for o in store.list(prefix)
        if o.key[len(prefix) :] != MARKER_NAME
    }
    _refuse_link(target, sizes)

    def fetch_one(dst: LocalStore, rel: str) -> None:
        source = _local_path(store, prefix + rel)
        if source is None:
            _copy(store, prefix, dst, rel, options)
            return
        dst.make_dirs(rel.rpartition("/")[0] + "/" if "/" in rel else "")
        dest = dst.root / rel
        if os.path.lexists(dest):  # an interrupted fetch's
            dest.unlink()
        _link(source, dest)

    if not target.exists():
        partial = LocalStore(local).make_dirs(f".{target.name}.cloudckpt-fetch/")
        _fetch_files(LocalStore(partial), sizes, options, fetch_one)
        partial.rename(target)
        return str(target)
    mine = LocalStore(target)
    for rel, size in sizes.items():
        there = target / rel
        if not os.path.lexists(there):
            continue
        same = there.is_file() and not there.is_symlink() and there.stat().st_size == size
        if same and not _same_file(_local_path(store, prefix + rel), there):
            same = same_bytes(store, prefix + rel, mine, rel, size)
        if not same:
            raise AlreadyExistsError(
                f"{target} exists and is not step {info.step} of the local tier ({rel} "
                "holds other bytes); move it away to fetch"
            )
    missing = {rel: size for rel, size in sizes.items() if not os.path.lexists(target / rel)}
    if missing:
        _fill(target, missing, options, fetch_one)
    return str(target)


def _copy(store: Store, prefix: str, dst: LocalStore, rel: str, options: TransferOptions) -> None:
    """Download ``prefix + rel`` of ``store`` to ``rel`` under ``dst``."""
    copy_object(store, prefix + rel, dst, rel, options)


def _fetch_files(
    fetched: LocalStore,
    sizes: Mapping[str, int],
    options: TransferOptions,
    fetch_one: Callable[[LocalStore, str], None],
) -> None:
    """Fetch each file of ``sizes`` (name: size) into ``fetched`` by ``fetch_one``, then
    check it: its size, and each torch archive's CRC-32s."""
    for rel in sizes:
        fetch_one(fetched, rel)
    for rel, size in sizes.items():
        got = fetched.head(rel).size
        if got != size:
            raise CorruptCheckpointError(
                f"{fetched.url(rel)} holds {got} bytes where the checkpoint's has {size}"
            )
    _verify_archives(fetched, sizes, options)


def _fill(
    target: Path,
    missing: Mapping[str, int],
    options: TransferOptions,
    fetch_one: Callable[[LocalStore, str], None],
) -> None:
    """Fetch the files ``target`` (a ``checkpoint-N`` already there) lacks into a hidden
    folder beside it, check them, then move each into ``target``."""
    partial = LocalStore(target.parent).make_dirs(f".{target.name}.cloudckpt-fetch/")
    _fetch_files(LocalStore(partial), missing, options, fetch_one)
    have = LocalStore(target)  # its folders made without following a link
    for rel in missing:
        if "/" in rel:
            have.make_dirs(rel.rpartition("/")[0] + "/")
        os.replace(partial / rel, target / rel)
    shutil.rmtree(partial, ignore_errors=True)


def _local_path(store: Store, key: str) -> Path | None:
    """The file that serves ``key`` when it is on local disk (a ``file://`` URL)."""
    url = store.url(key)
    return Path(url[len("file://") :]) if url.startswith("file://") else None


def _same_file(a: Path | None, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (a hard link of each other)."""
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


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
