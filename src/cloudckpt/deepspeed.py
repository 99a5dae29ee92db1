"""DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` on object storage, committed as a
:class:`cloudckpt.CheckpointManager` run.

    from cloudckpt.deepspeed import load_checkpoint, save_checkpoint

    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    load_checkpoint(engine, "s3://bucket/run1", missing_ok=True)  # newest committed step
    ...
    save_checkpoint(engine, "s3://bucket/run1")  # step engine.global_steps

Every process calls both, as it calls ``engine.save_checkpoint``. A save is DeepSpeed's
own ``engine.save_checkpoint`` (ZeRO 0-3: what it saves, which rank writes which file)
with the engine's checkpoint engine swapped for one that streams each file it is
handed to ``URL/step-N/<tag>/`` in the bucket (no local copy; the rank that made a file
writes it). What DeepSpeed writes past its checkpoint engine (the recovery scripts
``zero_to_fp32.py`` and ``zero_to_torch.py``, copied with ``shutil``) lands in a local
staging folder and is uploaded from there, with a ``latest`` file naming the tag; once
every rank's files are in the bucket, rank 0 writes the manager's
``_CHECKPOINT.json`` (create-only, last). So each committed ``step-N/`` is a complete
DeepSpeed checkpoint folder: ``cloudckpt cp`` it to disk and DeepSpeed's own
``load_checkpoint(dir)`` and ``zero_to_fp32.py dir out`` read it.

A load picks a committed step (the newest, ``step=`` or ``tag=``), checks that this
job can load it (the ZeRO stage and data-parallel world size DeepSpeed needs), reads
the files this rank needs (its model states once, its own optimizer partition), each
checked against the marker's size and ETag and its archive's CRC-32s, agrees with the other
ranks that every read succeeded, and only then runs DeepSpeed's own
``engine.load_checkpoint`` over them. Failures are typed and raised on every rank;
nothing returns a silent ``(None, None)``.

Why functions, not a checkpoint engine in the DeepSpeed config: the config selects only
DeepSpeed's built-in engines, and DeepSpeed touches the filesystem itself around its
checkpoint engine (``latest`` written with ``open()`` after ``commit``, which runs with no
barrier; the recovery scripts copied; ``glob`` of ``mp_rank_*``; ``os.path.exists``),
so a URL cannot pass through ``engine.save_checkpoint``. These functions give DeepSpeed
a local folder for those calls and install their checkpoint engine for the one call.

``save_checkpoint(..., async_save=True)`` returns once every rank's files are copied into
host memory and writes and commits them in a background thread. Not in this module yet:
the manager's local tier (docs/integrations.md).

deepspeed is imported only inside the functions: this module imports without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .engine.background import SaveLine
from .engine.copy import copy_tree
from .engine.handle import SaveHandle, in_flight
from .engine.load import load as load_object
from .engine.remove import remove_checkpoint
from .engine.save import write_object
from .engine.staging import Snapshot, get_pool, snapshot
from .errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    DistributedLoadError,
    DistributedSaveError,
    NotFoundError,
    UnsupportedFormatError,
)
from .format.commit import read_committed
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .manager.folders import checked_step as _checked_step
from .manager.folders import commit_folder
from .manager.folders import open_run as _open_run
from .manager.folders import run_group as _group
from .manager.folders import step_prefix as _step_prefix
from .manager.marker import Written, check_etag, check_files, check_remote, marker_key
from .options import TransferOptions
from .ranks.collectives import is_distributed, on_first, rank, settle, world_size
from .ranks.groups import drain_group
from .store import Store, Target
from .store.local import LocalStore

__all__ = ["DeepSpeedSaveHandle", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of a DeepSpeed checkpoint.
KIND = "deepspeed"

#: The file in each step's folder naming its tag, as DeepSpeed's own ``latest``.
LATEST = "latest"

#: The classes DeepSpeed pickles into its ZeRO optimizer states, allowed by a
#: ``weights_only`` load: ``(module, name)``.
_DEEPSPEED_GLOBALS: tuple[tuple[str, str], ...] = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


#: Background saves, one line per run URL: a run's next save or load waits for the one
#: before it (engine/background.py).
_line = SaveLine()

#: The step each engine was restored from, per run URL (``load_checkpoint`` records it,
#: as a manager's ``restored_step``): retention after a save never deletes it.
_restored: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


def _remember_restored(engine: Any, root_url: str, step: int) -> None:
    # An engine that takes no weak reference: nothing remembered, nothing protected.
    with contextlib.suppress(TypeError):
        _restored.setdefault(engine, {})[root_url] = step


def _restored_step(engine: Any, root_url: str) -> int | None:
    try:
        return _restored.get(engine, {}).get(root_url)
    except TypeError:
        return None


class DeepSpeedSaveHandle(SaveHandle[CheckpointInfo]):
    """A :func:`save_checkpoint` with ``async_save=True``: staged once every rank's files
    are copied into host memory (the call returned), done once the step is committed in
    the bucket (``result()``: its :class:`CheckpointInfo`) or failed."""

    kind = "deepspeed save"

    def __init__(self, step: int, url: str) -> None:
        super().__init__(url, staged=True)
        self.step = step


def _require_deepspeed() -> Any:
    """The ``deepspeed`` package (ImportError naming the extra when it is missing)."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "cloudckpt.deepspeed needs deepspeed (pip install 'cloudckpt[deepspeed]')"
        ) from exc
    return deepspeed


def _checked_tag(tag: Any) -> str:
    """``tag`` as DeepSpeed names a checkpoint folder: one path component."""
    text = str(tag)
    if not text or text in (".", "..") or "/" in text or "\\" in text or text == LATEST:
        raise ConfigError(f"tag={tag!r} must name one folder (no '/', not '.', '..', 'latest')")
    return text


def _check_engine(engine: Any) -> None:
    if not (hasattr(engine, "save_checkpoint") and hasattr(engine, "checkpoint_engine")):
        raise ConfigError(
            f"{type(engine).__name__} is not a DeepSpeed engine (pass what "
            "deepspeed.initialize returned)"
        )
    if engine.load_universal_checkpoint():
        raise ConfigError("universal checkpoints are not supported by cloudckpt.deepspeed")


def _dp_world_size(engine: Any) -> int:
    """The data-parallel world size DeepSpeed records in and checks against a checkpoint."""
    return int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)


@contextlib.contextmanager
def _deepspeed_globals(weights_only: bool) -> Iterator[None]:
    """DeepSpeed's own checkpoint classes allowed for a ``weights_only`` load."""
    if not weights_only:
        yield
        return
    import importlib

    import torch

    allowed = []
    for module, name in _DEEPSPEED_GLOBALS:
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            allowed.append(found)
    with torch.serialization.safe_globals(allowed):
        yield


class _Bucket:
    """DeepSpeed's checkpoint-engine calls for one save or load, on the step prefix.

    A path DeepSpeed passes is one under ``folder`` (the local folder it was given); it
    names the object at the same relative key under ``prefix``. A save never raises
    into DeepSpeed (a rank that raised would leave the others in DeepSpeed's barrier):
    its first failure is kept in :attr:`error` and later saves of the call are skipped.
    """

    def __init__(
        self,
        store: Store,
        prefix: str,
        folder: Path,
        options: TransferOptions,
        *,
        sizes: Mapping[str, int] | None = None,
        etags: Mapping[str, str | None] | None = None,
        step: int | None = None,
        weights_only: bool = True,
        stage: bool = False,
    ) -> None:
        self.store, self.prefix, self.folder, self.options = store, prefix, folder, options
        self.sizes = sizes
        #: The ETag the marker recorded for each file (a load), and the step it commits.
        self.etags = etags or {}
        self.step = step
        self.weights_only = weights_only
        self.error: BaseException | None = None
        #: With ``stage``: each file's snapshot, written later by :meth:`write_staged`.
        self.staged: list[tuple[str, Snapshot]] | None = [] if stage else None
        #: Each file written under ``prefix`` (a save), its size and ETag: what the commit lists.
        self.written: dict[str, Written] = {}
        #: Objects read ahead of DeepSpeed's load: name -> [object, reads left].
        self.ready: dict[str, list[Any]] = {}

    def name_of(self, path: Any) -> str:
        """``path``'s key relative to the step prefix (ConfigError outside the folder)."""
        try:
            name = Path(os.path.abspath(os.fspath(path))).relative_to(self.folder).as_posix()
        except ValueError:
            name = ""
        if name in ("", "."):
            raise ConfigError(f"DeepSpeed asked for {path}, outside its checkpoint folder")
        return name

    # -- save ----------------------------------------------------------------------------
    def save(self, state_dict: Any, path: str) -> None:
        if self.error is not None:
            return
        try:
            name = self.name_of(path)
            if self.staged is not None:  # copied now, written in the background
                self.staged.append((name, snapshot(state_dict, get_pool())))
            else:
                saved = write_object(state_dict, self.store, self.prefix + name, self.options)
                self.written[name] = Written(saved.size, saved.etag)
        except Exception as exc:
            self.error = exc

    def write_staged(self) -> None:
        """Write each staged file (in order), each snapshot's buffers given back once
        written; all of them given back on a failure."""
        try:
            while self.staged:
                name, snap = self.staged[0]
                saved = write_object(
                    snap.materialize(),
                    self.store,
                    self.prefix + name,
                    self.options,
                    size_hint=snap.nbytes,
                )
                self.written[name] = Written(saved.size, saved.etag)
                self.staged.pop(0)
                snap.release(get_pool())
        finally:
            self.release()

    def release(self) -> None:
        """Give back the buffers of every snapshot not written."""
        while self.staged:
            self.staged.pop()[1].release(get_pool())

    # -- load ----------------------------------------------------------------------------
    def read(self, name: str) -> Any:
        """The object ``name`` of the committed step, checked against its marker (its
        size and ETag; then its archive's CRC-32s as it is read)."""
        key = self.prefix + name
        url = self.store.url(key)
        expected = None if self.sizes is None else self.sizes.get(name)
        if self.sizes is not None and expected is None:
            raise NotFoundError(f"{url} is not part of the committed checkpoint")
        found = self.store.head(key)  # NotFoundError when missing
        if expected is not None and found.size != expected:
            raise CorruptCheckpointError(
                f"{url} holds {found.size} bytes, its marker says {expected}"
            )
        if self.step is not None:
            check_etag(url, self.step, found.etag, self.etags.get(name))
        with _deepspeed_globals(self.weights_only):
            return load_object(
                Target(url, self.store, key, self.options),
                map_location="cpu",
                weights_only=self.weights_only,
            )

    def prefetch(self, uses: Mapping[str, int]) -> None:
        """Read each object of ``uses`` now; DeepSpeed's next ``uses[name]`` loads of it
        get it without another read."""
        for name, count in uses.items():
            self.ready[name] = [self.read(name), count]

    def load(self, path: str, map_location: Any = None) -> Any:
        name = self.name_of(path)
        held = self.ready.get(name)
        if held is None:
            return self.read(name)
        held[1] -= 1
        if held[1] <= 0:
            del self.ready[name]
        return held[0]


_ENGINE_CLASS: Any = None


def _checkpoint_engine(bucket: _Bucket) -> Any:
    """A DeepSpeed ``CheckpointEngine`` whose calls go to ``bucket``."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        class CloudCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
            """DeepSpeed's checkpoint-engine calls on a cloudckpt step prefix."""

            def __init__(self, target: _Bucket) -> None:
                super().__init__(None)
                self.name = "CloudCheckpointEngine"
                self.target = target

            def create(self, info: Any) -> None:
                pass

            def makedirs(self, path: str, exist_ok: bool = False) -> None:
                self.target.name_of(os.path.join(path, "x"))  # inside the folder
                os.makedirs(path, exist_ok=exist_ok)

            def save(self, state_dict: Any, path: str) -> None:
                self.target.save(state_dict, path)

            def load(self, path: str, map_location: Any = None) -> Any:
                return self.target.load(path, map_location)

            def commit(self, info: Any) -> bool:
                return True  # the commit is the manager's, once every rank's files are in

        CloudCheckpointEngine.__module__ = __name__
        _ENGINE_CLASS = CloudCheckpointEngine
    return _ENGINE_CLASS(bucket)


@contextlib.contextmanager
def _installed(engine: Any, bucket: _Bucket) -> Iterator[None]:
    """``engine`` with its checkpoint engine going to ``bucket`` for the block."""
    previous = engine.checkpoint_engine
    engine.checkpoint_engine = _checkpoint_engine(bucket)
    try:
        yield
    finally:
        engine.checkpoint_engine = previous


def save_checkpoint(
    engine: Any,
    url: str | os.PathLike[str],
    tag: str | None = None,
    *,
    step: int | None = None,
    client_state: Mapping[str, Any] | None = None,
    exclude_frozen_parameters: bool = False,
    metrics: Mapping[str, float] | None = None,
    keep_last: int | None = None,
    async_save: bool = False,
    staging_dir: str | os.PathLike[str] | None = None,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo | DeepSpeedSaveHandle:
    """Save ``engine`` (what ``deepspeed.initialize`` returned) as step ``step`` of the
    run at ``url``, DeepSpeed tag ``tag``; every process calls it.

    ``step`` None: ``engine.global_steps``; ``tag`` None: DeepSpeed's default
    ``global_step<N>``. The step is committed once every rank's files are written, and
    its :class:`CheckpointInfo` returned on every rank (the tag is in its
    ``metadata["tag"]``). A step already committed is refused
    (:class:`~cloudckpt.errors.AlreadyExistsError`); leftovers of an uncommitted save of
    it are deleted first. A rank whose write failed raises its own error, the others
    :class:`~cloudckpt.errors.DistributedSaveError` naming it; nothing is committed.
    ``client_state`` is DeepSpeed's (saved in the model states); ``metrics`` go into
    the marker (``keep_top_k`` retention); ``keep_last``: the manager's retention after
    the commit, which never deletes the newest committed step, this step, nor the step
    this engine was restored from by :func:`load_checkpoint` (docs/integrations.md,
    "DeepSpeed"). ``staging_dir``: where the small local folder DeepSpeed writes its
    recovery scripts into is made (default the temp dir).

    ``async_save``: return once every rank's files are copied into host memory
    (cloudckpt's staging buffers, as ``cloudckpt.async_save``), with a
    :class:`DeepSpeedSaveHandle`; the writes and the commit run in a background thread
    (with several ranks, on a second gloo group of cloudckpt's), and ``result()`` waits
    for the commit. The run's next save or load waits for it first; a failure nobody
    asked for is raised by the next save (``cloudckpt.wait_all()`` raises it too).
    """
    deepspeed = _require_deepspeed()
    _check_engine(engine)
    in_flight.raise_unreported()
    manager = _open_run(url, options, storage_options, keep_last=keep_last)
    _line.make_room(manager.root_url)  # this process's background save of the run first
    chosen = _checked_step(engine.global_steps if step is None else step)
    restored = _restored_step(engine, manager.root_url)
    name = _checked_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    store, prefix, url_of_step = (
        manager.store,
        _step_prefix(manager, chosen),
        manager.step_url(chosen),
    )
    group = _group()

    def prepare() -> None:
        if read_committed(store, marker_key(manager.root_key, chosen)) is not None:
            raise AlreadyExistsError(
                f"step {chosen} is already committed at {url_of_step}; delete it first "
                "(cloudckpt rm) or save another step"
            )
        remove_checkpoint(store, prefix, manager.options)  # an earlier, uncommitted try

    on_first(
        prepare,
        group,
        what=f"preparing {url_of_step}",
        error_type=DistributedSaveError,
    )
    folder = Path(tempfile.mkdtemp(prefix=f"cloudckpt-deepspeed-{chosen}-", dir=staging_dir))
    folder = Path(os.path.abspath(folder))
    bucket = _Bucket(store, prefix, folder, manager.options, stage=async_save)
    try:
        error: BaseException | None = None
        try:
            with _installed(engine, bucket):
                engine.save_checkpoint(
                    str(folder),
                    tag=name,
                    client_state=dict(client_state or {}),
                    save_latest=False,
                    exclude_frozen_parameters=exclude_frozen_parameters,
                )
            if rank() == 0:  # DeepSpeed's own ``latest``, uploaded with the folder
                (folder / LATEST).write_text(name)
        except Exception as exc:
            error = exc
        settle(
            error or bucket.error,
            f"DeepSpeed's save_checkpoint to {url_of_step}",
            group=group,
            error_type=DistributedSaveError,
        )
        metadata = {
            "tag": name,
            "world_size": world_size(),
            "dp_world_size": _dp_world_size(engine),
            "zero_stage": int(engine.zero_optimization_stage()),
            "deepspeed_version": str(deepspeed.__version__),
        }

        def commit(on: Any) -> CheckpointInfo:  # on every rank, after every rank's writes
            return commit_folder(
                manager,
                chosen,
                folder,
                kind=KIND,
                metadata=metadata,
                group=on,
                metrics=metrics,
                written=bucket.written,
                retain=lambda: _retain(manager, chosen, restored),
            )

        if not async_save:
            try:
                return commit(group)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    except BaseException:
        bucket.release()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    background = drain_group() if is_distributed() else None
    handle = DeepSpeedSaveHandle(chosen, url_of_step)

    def run() -> CheckpointInfo:
        try:
            failed: BaseException | None = None
            try:
                bucket.write_staged()
            except Exception as exc:
                failed = exc
            settle(
                failed,
                f"the writes of each rank's files to {url_of_step}",
                group=background,
                error_type=DistributedSaveError,
            )
            return commit(background)
        finally:
            bucket.release()
            shutil.rmtree(folder, ignore_errors=True)

    _line.add(handle, manager.root_url)
    _line.start(handle, run, name=f"cloudckpt-deepspeed-{chosen}")
    return handle


def _retain(manager: CheckpointManager, saved: int, restored: int | None) -> list[int]:
    """The manager's retention (docs/manager.md) after the commit of ``saved``, on the
    first rank: never the newest committed step, ``saved`` (held as the manager's save in
    flight), nor the step this engine was ``restored`` from (its ``restored_step``).
    Each save opens a manager of its own, so both are told to it here. Returns the steps
    deleted."""
    manager.restored_step = restored
    with manager._lock:
        manager._pending.add(saved)
    try:
        return manager.apply_retention()
    finally:
        with manager._lock:
            manager._pending.discard(saved)


def _choose(
    manager: CheckpointManager, step: int | None, tag: str | None, missing_ok: bool
) -> CheckpointInfo | None:
    """The committed step to load: ``step``, the newest with ``tag``, or the newest."""
    if step is not None and tag is not None:
        raise ConfigError("pass step= or tag=, not both")
    info: CheckpointInfo | None
    if step is not None:
        info = manager.info(_checked_step(step))  # NotFoundError when not committed
    else:
        found = manager.list()
        if tag is not None:
            found = [c for c in found if c.metadata.get("tag") == tag]
        info = found[-1] if found else None
        if info is None:
            if missing_ok and tag is None:
                return None
            what = "checkpoint" if tag is None else f"checkpoint tagged {tag!r}"
            raise NotFoundError(f"no committed DeepSpeed {what} under {manager.root_url}")
    if info.kind != KIND or not isinstance(info.metadata.get("tag"), str):
        raise UnsupportedFormatError(
            f"{info.url} is a {info.kind!r} checkpoint, not one saved by "
            "cloudckpt.deepspeed.save_checkpoint"
        )
    return info


def _check_loadable(
    engine: Any, info: CheckpointInfo, optimizer_states: bool, module_only: bool
) -> None:
    """ConfigError, before any read, when DeepSpeed cannot load ``info`` in this job."""
    saved_stage = info.metadata.get("zero_stage")
    saved_dp = info.metadata.get("dp_world_size")
    stage, dp = int(engine.zero_optimization_stage()), _dp_world_size(engine)
    with_optimizer = optimizer_states and not module_only
    if saved_stage is not None and (saved_stage == 3) != (stage == 3):
        raise ConfigError(
            f"{info.url} was saved with ZeRO stage {saved_stage} and this engine runs "
            f"stage {stage}: DeepSpeed reads a ZeRO-3 checkpoint only with ZeRO-3"
        )
    if with_optimizer and saved_stage is not None and (saved_stage == 0) != (stage == 0):
        raise ConfigError(
            f"{info.url} was saved with ZeRO stage {saved_stage} and this engine runs "
            f"stage {stage}: its optimizer states do not carry over (pass "
            "load_optimizer_states=False to load the module only)"
        )
    same_world = stage == 3 or (
        stage >= 1 and with_optimizer and not engine.zero_elastic_checkpoint()
    )
    if same_world and saved_dp is not None and saved_dp != dp:
        raise ConfigError(
            f"{info.url} was saved by {saved_dp} data-parallel ranks and this job has {dp}: "
            f"DeepSpeed's ZeRO stage {stage} loads "
            + (
                "it only on as many ranks"
                if stage == 3
                else "its optimizer states only on as many ranks"
            )
            + (" (load_optimizer_states=False loads the module alone)" if stage < 3 else "")
        )


def _needed(
    engine: Any, folder: Path, tag: str, info: CheckpointInfo, optimizer: bool
) -> dict[str, int]:
    """The objects this rank's DeepSpeed load reads, with how many times it reads each."""
    names = {f.name for f in info.files}
    base = folder.as_posix() + "/"
    model = engine._get_ckpt_name(str(folder), tag)
    uses = {Path(model).as_posix().removeprefix(base): 2}  # DeepSpeed checks it, then loads it
    if optimizer and int(engine.zero_optimization_stage()) >= 1:
        dp_rank = engine.global_rank
        optimizer_group = getattr(engine.optimizer, "dp_process_group", None)
        if optimizer_group is not None:
            from deepspeed import comm

            dp_rank = comm.get_rank(group=optimizer_group)
        saved_dp = int(info.metadata.get("dp_world_size", _dp_world_size(engine)))
        ranks = range(saved_dp) if engine.zero_elastic_checkpoint() else [dp_rank]
        bf16 = bool(engine.bfloat16_enabled())
        for r in ranks:
            for mode in (bf16, not bf16):  # DeepSpeed's own order of trying
                path = engine._get_rank_zero_ckpt_name(
                    str(folder), tag, engine.checkpoint_mp_rank, r, mode
                )
                name = Path(path).as_posix().removeprefix(base)
                if name in names:
                    uses[name] = 1
                    break
            else:
                raise NotFoundError(
                    f"{info.url} holds no ZeRO optimizer states of data-parallel rank {r}"
                )
    return uses


def load_checkpoint(
    engine: Any,
    url: str | os.PathLike[str],
    tag: str | None = None,
    *,
    step: int | None = None,
    missing_ok: bool = False,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
    weights_only: bool = True,
    staging_dir: str | os.PathLike[str] | None = None,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """Restore ``engine`` from a committed step of the run at ``url``: the newest one,
    the newest tagged ``tag``, or ``step``; every process calls it.

    Returns ``(info, client_state)``: the step's :class:`CheckpointInfo` and what
    DeepSpeed's ``load_checkpoint`` returns as client state. A run with no committed
    checkpoint raises :class:`~cloudckpt.errors.NotFoundError` (``missing_ok=True``:
    returns None, a fresh start); so does a ``step`` or ``tag`` not committed. A step
    this job cannot load (another ZeRO-3 world size, ZeRO stages whose files differ)
    raises :class:`~cloudckpt.errors.ConfigError` before any read. A read that fails on
    any rank (missing or truncated file, a file whose ETag is not its marker's, a
    corrupt record, a bucket refusing) fails
    every rank before DeepSpeed's load starts: that rank raises its own error, the
    others :class:`~cloudckpt.errors.DistributedLoadError`.

    ``weights_only`` (default True): every file is read by cloudckpt's restricted
    unpickler, which allows DeepSpeed's own ``LossScaler``, ``DynamicLossScaler``,
    ``ZeroStageEnum`` and ``fragment_address``; pass False only for checkpoints you
    trust that hold other classes (``torch.serialization.add_safe_globals`` is the
    narrower way). Every file is read to CPU memory, as DeepSpeed's own loads map it.
    The other keyword arguments are DeepSpeed's ``load_checkpoint``'s.
    """
    _require_deepspeed()
    _check_engine(engine)
    if engine.zero_nvme_offload_optimizer():
        raise ConfigError(
            "restoring with NVMe optimizer offload is not supported by cloudckpt.deepspeed "
            "(DeepSpeed copies its swap folder outside the checkpoint engine)"
        )
    manager = _open_run(url, options, storage_options)
    _line.make_room(manager.root_url)  # this process's background save of the run first
    group = _group()
    info = _choose(manager, step, None if tag is None else _checked_tag(tag), missing_ok)
    if info is None:
        return None
    _check_loadable(engine, info, load_optimizer_states, load_module_only)
    saved_tag = str(info.metadata["tag"])
    prefix = _step_prefix(manager, info.step)
    folder = Path(os.path.abspath(tempfile.mkdtemp(prefix="cloudckpt-deepspeed-", dir=staging_dir)))
    sizes = {f.name: f.size for f in info.files}
    bucket = _Bucket(
        manager.store,
        prefix,
        folder,
        manager.options,
        sizes=sizes,
        etags={f.name: f.etag for f in info.files},
        step=info.step,
        weights_only=weights_only,
    )
    try:
        error: BaseException | None = None
        try:
            stage3_module = int(engine.zero_optimization_stage()) == 3 and not load_optimizer_states
            if stage3_module:
                # DeepSpeed rebuilds the module from every rank's files itself
                # (zero_to_fp32's reader, straight from disk): fetch the whole step.
                check_remote(manager.store, prefix, info)
                fetched = LocalStore(folder)
                copy_tree(
                    manager.store, prefix, fetched, "", manager.options, exclude=(MARKER_NAME,)
                )
                check_files(fetched, "", info, skip=(MARKER_NAME,))
            else:
                for name in sizes:  # DeepSpeed globs and tests for the names on disk
                    if name.startswith(saved_tag + "/"):
                        path = folder / name
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.touch()
            optimizer = load_optimizer_states and not load_module_only
            bucket.prefetch(_needed(engine, folder, saved_tag, info, optimizer))
        except Exception as exc:
            error = exc
        settle(error, f"the read of {info.url}", group=group, error_type=DistributedLoadError)
        loaded: Any = None
        try:
            with _installed(engine, bucket):
                loaded = engine.load_checkpoint(
                    str(folder),
                    tag=saved_tag,
                    load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    custom_load_fn=custom_load_fn,
                )
            if loaded is None or loaded[0] is None:
                raise NotFoundError(f"DeepSpeed found no model states in {info.url}")
        except Exception as exc:
            error = exc
        settle(
            error,
            f"DeepSpeed's load_checkpoint of {info.url}",
            group=group,
            error_type=DistributedLoadError,
        )
    finally:
        bucket.ready.clear()
        shutil.rmtree(folder, ignore_errors=True)
    manager.restored_step = info.step
    _remember_restored(engine, manager.root_url, info.step)
    return info, dict(loaded[1] or {})
