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
host memory and writes and commits them in a background thread.

``save_checkpoint(..., local_dir=DIR)`` uses the manager's local tier (docs/tiers.md)
instead: a :class:`CheckpointManager` with ``local_dir`` and the DeepSpeed payload kind
(:class:`DeepSpeedPayload`) saves the step into ``DIR/step-N/`` (DeepSpeed's own folder
on disk, each file written by cloudckpt's writer through the same checkpoint engine),
commits it there and returns; the manager's drainer copies it to the bucket in the
background and commits it there (``drain`` waits for that). With several ranks each
directory also gets the files rank 0 alone wrote (``coordinator_files``: the model
states of ZeRO 0-2, the recovery scripts, ``latest``), so every node's copy loads on its
own. ``load_checkpoint(..., local_dir=DIR)`` is the manager's restore: the newest step
of either tier, read from local disk when its local copy is whole, else from the bucket.
One manager per run and directory serves a process (its drainer outlives the call).

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
from dataclasses import dataclass
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
from .manager.folders import (
    TieredRuns,
    checked_keep_local,
    commit_folder,
    committed_copy,
    payload_call,
    save_to_tier,
    tier_folder,
    tiered_run,
)
from .manager.folders import checked_step as _checked_step
from .manager.folders import open_run as _open_run
from .manager.folders import run_group as _group
from .manager.folders import step_prefix as _step_prefix
from .manager.marker import (
    Written,
    check_etag,
    check_files,
    check_remote,
    marker_key,
)
from .manager.payload import Wrote
from .options import TransferOptions
from .ranks.collectives import agree, is_distributed, on_first, rank, settle, world_size
from .ranks.groups import drain_group
from .store import Store, Target
from .store.local import LocalStore

__all__ = ["DeepSpeedSaveHandle", "drain", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger("cloudckpt")

#: The ``kind`` recorded in the marker of a DeepSpeed checkpoint.
KIND = "deepspeed"
#: What a local tier's payload kind of this module is given by (its ConfigError names it).
_FUNCTIONS = "cloudckpt.deepspeed.save_checkpoint / load_checkpoint"

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


def _deepspeed_save(
    engine: Any,
    bucket: _Bucket,
    folder: Path,
    tag: str,
    client_state: Mapping[str, Any] | None,
    exclude_frozen_parameters: bool,
) -> BaseException | None:
    """DeepSpeed's own ``save_checkpoint`` into ``folder``, its files going to
    ``bucket``, then ``latest`` naming ``tag`` (rank 0). Returns this rank's first
    failure rather than raising it: the ranks settle it together next."""
    try:
        with _installed(engine, bucket):
            engine.save_checkpoint(
                str(folder),
                tag=tag,
                client_state=dict(client_state or {}),
                save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters,
            )
        if rank() == 0:  # DeepSpeed's own ``latest``, committed with the folder
            (folder / LATEST).write_text(tag)
    except Exception as exc:
        return exc
    return bucket.error


def _metadata(deepspeed: Any, engine: Any, tag: str) -> dict[str, Any]:
    """What a step's marker records of the save: what a load checks before any read."""
    return {
        "tag": tag,
        "world_size": world_size(),
        "dp_world_size": _dp_world_size(engine),
        "zero_stage": int(engine.zero_optimization_stage()),
        "deepspeed_version": str(deepspeed.__version__),
    }


@dataclass
class _SaveCall:
    """What :meth:`DeepSpeedPayload.save` saves: the engine and DeepSpeed's arguments."""

    engine: Any
    tag: str
    client_state: Mapping[str, Any] | None
    exclude_frozen_parameters: bool


@dataclass
class _LoadCall:
    """What :meth:`DeepSpeedPayload.load` restores into, and how: DeepSpeed's arguments."""

    engine: Any
    load_module_strict: bool = True
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    custom_load_fn: Any = None
    staging_dir: str | os.PathLike[str] | None = None


#: What rank 0 alone writes at the top of a step's folder (ZeRO >= 1: DeepSpeed's
#: recovery scripts; always ``latest``), in commit order.
_ROOT_FILES = ("zero_to_fp32.py", "zero_to_torch.py", LATEST)


class DeepSpeedPayload:
    """The manager's payload kind of a DeepSpeed checkpoint in a local tier (docs/tiers.md):
    :func:`save_checkpoint` and :func:`load_checkpoint` with ``local_dir=`` pass it to
    their :class:`CheckpointManager`; it is not meant to be given one by hand.

    ``save`` runs DeepSpeed's own ``save_checkpoint`` into the tier's ``step-N/`` folder
    (a local path), each file DeepSpeed hands its checkpoint engine written by
    cloudckpt's writer; ``load`` reads a committed step's copy (a URL, or the manager's
    view of both tiers) as :func:`load_checkpoint` reads the bucket's.
    """

    name = KIND

    def __init__(self) -> None:
        #: The model states file rank 0 alone writes (ZeRO 0-2), as of the last save;
        #: before one, its name alone, which is what a drain compares.
        self._model_states: str | None = "mp_rank_00_model_states.pt"

    @property
    def coordinator_files(self) -> tuple[str, ...]:
        """The files only rank 0 writes, which every local directory gets: the model
        states of ZeRO 0-2 (``<tag>/mp_rank_00_model_states.pt``), the recovery scripts,
        ``latest`` last."""
        model = () if self._model_states is None else (self._model_states,)
        return (*model, *_ROOT_FILES)

    def save(self, state: Any, prefix_url: str, options: TransferOptions) -> Wrote:
        """DeepSpeed's save of ``state`` (a :class:`_SaveCall`) into the local folder
        ``prefix_url`` names; a rank's failure raised on every rank."""
        call = payload_call(state, _SaveCall, "DeepSpeed", _FUNCTIONS)
        folder = tier_folder(prefix_url, options, "DeepSpeed")
        engine = call.engine
        if int(engine.zero_optimization_stage()) < 3:
            model = Path(engine._get_ckpt_name(str(folder), call.tag)).name
            self._model_states = f"{call.tag}/{model}"
        else:  # each rank writes and loads its own model states
            self._model_states = None
        bucket = _Bucket(LocalStore(folder), "", folder, options)
        error = _deepspeed_save(
            engine, bucket, folder, call.tag, call.client_state, call.exclude_frozen_parameters
        )
        settle(
            error,
            f"DeepSpeed's save_checkpoint to {prefix_url}",
            group=_group(),
            error_type=DistributedSaveError,
        )
        return None  # the tier's commit lists the folder: the files DeepSpeed copied too

    def load(
        self,
        prefix_url: str | Target,
        options: TransferOptions,
        *,
        map_location: Any,
        weights_only: bool,
        state: Any,
        local: bool = False,
    ) -> tuple[CheckpointInfo, dict[str, Any]]:
        """Restore ``state`` (a :class:`_LoadCall`) from the committed copy at
        ``prefix_url`` (a URL, or an opened ``Target``: the manager's view of the local
        copy over the bucket's); returns the copy's :class:`CheckpointInfo` and
        DeepSpeed's client state. ``local``: a copy in a local tier, whose sizes the
        manager checked and whose files are read with their CRC-32s checked (the ETags
        are the bucket's to check)."""
        call = payload_call(state, _LoadCall, "DeepSpeed", _FUNCTIONS)
        target, prefix, found = committed_copy(prefix_url, options)
        info = _deepspeed_info(found)
        client_state = _load_step(
            call, target.store, prefix, target.options, info, weights_only, etags=not local
        )
        return info, client_state


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
    and the DeepSpeed payload kind (manager/folders.tiered_run)."""
    return tiered_run(
        _tiered, url, local_dir, options, storage_options, lambda _path: DeepSpeedPayload()
    )


def drain(
    url: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    timeout: float | None = None,
    *,
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Wait until every step :func:`save_checkpoint` committed in ``local_dir`` is
    committed in the bucket at ``url`` (the manager's ``drain``: failed drains tried
    again first, the error of one that fails again raised, naming its step;
    TimeoutError after ``timeout`` s). Every process calls it, before a planned exit:
    a drain left unfinished is finished by the next process on ``local_dir`` (deepspeed
    itself is not needed: a drain copies the files as they are)."""
    _tiered_run(url, local_dir, options, storage_options).drain(timeout)


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
    local_dir: str | os.PathLike[str] | None = None,
    keep_local: int | None = None,
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

    ``local_dir``: the manager's local tier (docs/tiers.md): the step is committed in
    ``local_dir/step-N/`` when this returns (no request to the bucket on the way, so a
    bucket that is away does not slow it) and drained to ``url`` in the background,
    where ``keep_last`` applies after each drain; ``keep_local`` newest local steps are
    kept (default all; never one not drained yet). Every rank passes its node's
    directory. Call :func:`drain` before a planned exit. Not with ``async_save``
    (ConfigError): the save already returns at local-disk speed.
    """
    deepspeed = _require_deepspeed()
    _check_engine(engine)
    in_flight.raise_unreported()
    if local_dir is None and keep_local is not None:
        raise ConfigError("keep_local= needs local_dir=")
    if local_dir is not None and async_save:
        raise ConfigError(
            "async_save=True does not take local_dir=: a save to the local tier returns "
            "once committed on local disk and drains to the bucket in the background"
        )
    keep = checked_keep_local(keep_local)  # before the tier's directory is made
    if local_dir is None:
        manager = _open_run(url, options, storage_options, keep_last=keep_last)
    else:
        manager = _tiered_run(url, local_dir, options, storage_options)
    _line.make_room(manager.root_url)  # this process's background save of the run first
    chosen = _checked_step(engine.global_steps if step is None else step)
    restored = _restored_step(engine, manager.root_url)
    name = _checked_tag(f"global_step{engine.global_steps}" if tag is None else tag)
    metadata = _metadata(deepspeed, engine, name)
    if local_dir is not None:
        if restored is not None:
            manager.restored_step = restored
        call = _SaveCall(engine, name, client_state, exclude_frozen_parameters)
        return save_to_tier(
            manager,
            chosen,
            call,
            metadata=metadata,
            metrics=metrics,
            keep_local=keep,
            keep_last=keep_last,
        )
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
        error = _deepspeed_save(
            engine, bucket, folder, name, client_state, exclude_frozen_parameters
        )
        settle(
            error,
            f"DeepSpeed's save_checkpoint to {url_of_step}",
            group=group,
            error_type=DistributedSaveError,
        )

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
    return _deepspeed_info(info)


def _deepspeed_info(info: CheckpointInfo) -> CheckpointInfo:
    """``info`` if :func:`save_checkpoint` committed it (UnsupportedFormatError if not)."""
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
    local_dir: str | os.PathLike[str] | None = None,
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

    ``local_dir``: the local tier :func:`save_checkpoint` was given (the manager's
    restore, docs/tiers.md): the step is chosen among both tiers' committed steps (with
    several ranks, one every rank can read), read from the local copy when it is whole
    (a local copy that fails its checks: a WARNING, and the bucket's copy), else from
    the bucket. The other keyword arguments are DeepSpeed's ``load_checkpoint``'s.
    """
    _require_deepspeed()
    _check_engine(engine)
    if engine.zero_nvme_offload_optimizer():
        raise ConfigError(
            "restoring with NVMe optimizer offload is not supported by cloudckpt.deepspeed "
            "(DeepSpeed copies its swap folder outside the checkpoint engine)"
        )
    call = _LoadCall(
        engine,
        load_module_strict,
        load_optimizer_states,
        load_lr_scheduler_states,
        load_module_only,
        custom_load_fn,
        staging_dir,
    )
    checked_tag = None if tag is None else _checked_tag(tag)
    if local_dir is not None:
        return _load_tiered(
            _tiered_run(url, local_dir, options, storage_options),
            call,
            step,
            checked_tag,
            missing_ok,
            weights_only,
        )
    manager = _open_run(url, options, storage_options)
    _line.make_room(manager.root_url)  # this process's background save of the run first
    info = _choose(manager, step, checked_tag, missing_ok)
    if info is None:
        return None
    prefix = _step_prefix(manager, info.step)
    client_state = _load_step(call, manager.store, prefix, manager.options, info, weights_only)
    manager.restored_step = info.step
    _remember_restored(engine, manager.root_url, info.step)
    return info, client_state


def _load_tiered(
    manager: CheckpointManager,
    call: _LoadCall,
    step: int | None,
    tag: str | None,
    missing_ok: bool,
    weights_only: bool,
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """:func:`load_checkpoint` with a local tier: the manager's restore of the newest
    step (or ``step``, or the newest tagged ``tag``, the same on every rank)."""
    _line.make_room(manager.root_url)  # this process's background save of the run first
    wanted = step
    if step is not None or tag is not None:
        info = _choose(manager, step, tag, missing_ok)
        assert info is not None  # a step or tag not committed raises
        wanted = info.step
        if tag is not None and is_distributed():  # each rank lists its own local tier
            found = agree(value=wanted, group=_group()).values
            if len(set(found)) > 1:
                raise ConfigError(
                    f"the ranks' newest steps tagged {tag!r} differ ({list(found)}: their "
                    "local tiers hold different steps); pass step="
                )
    loaded = manager.restore(wanted, weights_only=weights_only, state=call)
    if loaded is None:
        if missing_ok:
            return None
        raise NotFoundError(
            f"no committed DeepSpeed checkpoint under {manager.root_url} nor in its local tier"
        )
    info, client_state = loaded
    _remember_restored(call.engine, manager.root_url, info.step)
    return info, client_state


def _load_step(
    call: _LoadCall,
    store: Store,
    prefix: str,
    options: TransferOptions,
    info: CheckpointInfo,
    weights_only: bool,
    *,
    etags: bool = True,
) -> dict[str, Any]:
    """Restore ``call.engine`` from the committed copy of ``info``'s step under
    ``prefix`` in ``store`` (the bucket's, or a local tier's): checked loadable, each
    rank's files read and checked (sizes, ``etags`` against the marker's, CRC-32s), the
    ranks agreed, then DeepSpeed's own load over them. Returns the client state."""
    engine = call.engine
    _check_loadable(engine, info, call.load_optimizer_states, call.load_module_only)
    group = _group()
    saved_tag = str(info.metadata["tag"])
    folder = Path(
        os.path.abspath(tempfile.mkdtemp(prefix="cloudckpt-deepspeed-", dir=call.staging_dir))
    )
    sizes = {f.name: f.size for f in info.files}
    bucket = _Bucket(
        store,
        prefix,
        folder,
        options,
        sizes=sizes,
        etags={f.name: f.etag for f in info.files},
        step=info.step if etags else None,
        weights_only=weights_only,
    )
    try:
        error: BaseException | None = None
        try:
            stage3_module = (
                int(engine.zero_optimization_stage()) == 3 and not call.load_optimizer_states
            )
            if stage3_module:
                # DeepSpeed rebuilds the module from every rank's files itself
                # (zero_to_fp32's reader, straight from disk): fetch the whole step.
                check_remote(store, prefix, info)
                fetched = LocalStore(folder)
                copy_tree(store, prefix, fetched, "", options, exclude=(MARKER_NAME,))
                check_files(fetched, "", info, skip=(MARKER_NAME,))
            else:
                for name in sizes:  # DeepSpeed globs and tests for the names on disk
                    if name.startswith(saved_tag + "/"):
                        path = folder / name
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.touch()
            optimizer = call.load_optimizer_states and not call.load_module_only
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
                    load_module_strict=call.load_module_strict,
                    load_optimizer_states=call.load_optimizer_states,
                    load_lr_scheduler_states=call.load_lr_scheduler_states,
                    load_module_only=call.load_module_only,
                    custom_load_fn=call.custom_load_fn,
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
    return dict(loaded[1] or {})
