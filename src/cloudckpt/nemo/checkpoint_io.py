"""NeMo 2's checkpoint I/O on cloudckpt: ``MegatronCheckpointIO`` for any URL.

:class:`CloudMegatronCheckpointIO` does what NeMo's ``MegatronCheckpointIO``
(``nemo/lightning/io/pl.py``) does, through :mod:`cloudckpt.megatron` instead of
megatron-core's ``dist_checkpointing``: the ``weights/`` subfolder, ``content_metadata``
from ``storage_options``, NeMo's strictness handling and its default content metadata.
With ``async_save=True`` ``save_checkpoint`` returns the save's megatron-core
``AsyncRequest``, which :class:`CloudAsyncFinalizableCheckpointIO` schedules on
megatron-core's ``AsyncCallsQueue`` and NeMo's ``AsyncFinalizerCallback`` finalizes.

Call order, as MegatronStrategy drives it: ``save_checkpoint`` on every rank (async:
returns once staged; the request's finalize functions run on every rank when
``maybe_finalize_save_checkpoint`` finds the save done); ``load_content_metadata`` then
``load_checkpoint`` on every rank; ``remove_checkpoint`` on rank 0.

With ``local_dir=`` a checkpoint under the bucket ``dirpath`` is saved to node-local
storage and committed there (in the finalize step of an async save), then drained to
the bucket in the background (:mod:`cloudckpt.nemo.tier`, docs/megatron.md).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .. import megatron as cm
from ..errors import ConfigError, NotFoundError
from ..lightning.fs import register_settings
from ..options import TransferOptions
from ..ranks.collectives import agree, on_first
from ..ranks.groups import checkpoint_group
from ..store import Resolved, Settings, Target
from ._compat import (
    AsyncCompatibleCheckpointIO,
    AsyncFinalizableCheckpointIO,
    IOMixin,
    MegatronCheckpointIO,
    WrappingCheckpointIO,
)
from .paths import checkpoint_dir, remove_tree, weights_url
from .tier import NemoTier

__all__ = [
    "DEFAULT_CONTENT_METADATA",
    "CloudAsyncFinalizableCheckpointIO",
    "CloudMegatronCheckpointIO",
    "cloud_checkpoint_io",
]

log = logging.getLogger("cloudckpt")

#: What NeMo assumes for a checkpoint saved without content metadata (pre-2.1 NeMo).
DEFAULT_CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}

#: The constructor arguments NeMo may record in a checkpoint's ``context/io.json``
#: (IOMixin): never the store settings, which can hold credentials.
_RECORDED = ("async_save", "weights_only")


class CloudMegatronCheckpointIO(MegatronCheckpointIO):  # type: ignore[misc]
    """NeMo's ``MegatronCheckpointIO`` for ``s3://``, ``gs://``, ``az://`` URLs and paths.

    ``weights_only`` (the default) refuses pickled classes in the common state when
    loading; pass False for checkpoints you trust. ``options`` and other keywords are
    :class:`~cloudckpt.TransferOptions` fields (``storage_options={...}``, ``part_size``,
    ...). They are not recorded in NeMo's ``context/io.json``: prefer the environment
    or a cloudckpt profile for credentials. Megatron's save-strategy flags
    (``ckpt_parallel_save``, ``torch_dist_multiproc``, ...) do not apply: cloudckpt's
    writer has its own concurrency settings.

    ``local_dir``: a node-local directory each rank saves to first; the checkpoint is
    committed there and drained to the bucket in the background (:meth:`drain` waits;
    ``teardown`` drains what is left). ``keep_local``: the newest local copies kept
    per rank (None: all; one not drained yet is always kept).
    """

    validated_consistency: bool  # set by NeMo's constructor

    def __init__(
        self,
        async_save: bool = False,
        *,
        weights_only: bool = True,
        local_dir: str | os.PathLike[str] | None = None,
        keep_local: int | None = None,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__(save_ckpt_format="torch_dist", async_save=async_save)
        self.weights_only = weights_only
        self._options, self._overrides = options, overrides
        # Checked here: a bad option fails now, not at the first save.
        self._settings = Settings(options, overrides)
        if options is not None or overrides:
            register_settings("", self._settings)  # for the callback and resume lookups
        self._tier: NemoTier | None = None
        if local_dir is not None:
            local = self._settings.resolve(os.fspath(local_dir)).options
            self._tier = NemoTier(local_dir, keep_local, local)
        elif keep_local is not None:
            raise ConfigError(f"keep_local={keep_local!r} needs local_dir (a local tier)")

    def io_transform_args(self, init_fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """IOMixin's record of the constructor's arguments, without the store settings."""
        captured: dict[str, Any] = super().io_transform_args(init_fn, *args, **kwargs)
        return {k: v for k, v in captured.items() if k in _RECORDED}

    # -- save ----------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> Any:
        """Save to ``<path without .ckpt>/weights`` (with a local tier: to its local
        copy, committed before this returns or in the async save's finalize step, then
        queued for the bucket); async: return the ``AsyncRequest``."""
        url = weights_url(path)
        name = self._tier_name(path)
        where: dict[str, Any] = {"options": self._options, **self._overrides}
        if name is not None:
            assert self._tier is not None
            self._tier.check_room(checkpoint)  # LocalTierFullError before any write
            self._tier.forget(name)  # an earlier save of the same name is uncommitted
            url = self._tier.save_path(name)  # no link inside the tier followed
            where = {"options": self._tier.options}
        validate = not (self.validated_consistency and self.assume_constant_structure)
        self.validated_consistency = True
        start = time.monotonic()
        try:
            handle = cm.save(
                checkpoint,
                url,
                async_save=self.async_save,
                content_metadata=(storage_options or {}).get("content_metadata"),
                validate_access_integrity=validate,
                **where,
            )
        except BaseException:
            if name is not None:  # the local copy is not committed: its folder's lock goes
                assert self._tier is not None
                self._tier.release(name)
            raise
        log.info(
            "%s checkpoint to %s in %.3fs",
            "staged" if handle is not None else "saved",
            url,
            time.monotonic() - start,
        )
        step = int(checkpoint.get("global_step", 0))
        if handle is None:
            if name is not None:
                self._commit_local(name, step)
            return None
        request = handle.async_request()
        if name is not None:  # after the save's own finalize step (which raises its error)
            request.add_finalize_fn(functools.partial(self._commit_local, name, step))
        return request

    # -- the local tier ------------------------------------------------------------------
    @property
    def local_dir(self) -> Path | None:
        """The local tier's directory (None: checkpoints go straight to the bucket)."""
        return None if self._tier is None else self._tier.path

    def _tier_name(self, path: Any) -> str | None:
        """The checkpoint's name when the local tier serves ``path``'s ``dirpath``
        (binding the tier on first use: every rank calls this), else None."""
        if self._tier is None:
            return None
        dirpath, _, name = checkpoint_dir(path).rpartition("/")
        if self._tier.bind(dirpath, self._settings.open(dirpath)):
            return name
        return None

    def _commit_local(self, name: str, step: int) -> None:
        """Commit ``name`` in every rank's local tier, queue its drain, prune old copies."""
        assert self._tier is not None
        self._tier.commit(name, step)
        self._tier.queue(name)
        self._tier.retain()

    def _source(self, path: Any) -> Resolved | Target:
        """Where ``path`` is read from: the local copies when every rank holds the
        checkpoint whole locally (a collective), else the bucket's committed copy."""
        name = self._tier_name(path)
        if name is not None:
            assert self._tier is not None
            group = checkpoint_group()
            tier = self._tier
            lacking = agree(value=tier.whole(name), group=group).values
            if all(why is None for why in lacking):
                newer = on_first(
                    lambda: tier.bucket_newer(name), group, what=f"the bucket's commit of {name}"
                )
                if newer is None:
                    return tier.view(name)
                log.warning("%s: %s; reading the bucket's", checkpoint_dir(path), newer)
                return self._committed(path)
            log.warning(
                "checkpoint %s is not whole in every rank's local tier (%s): reading it "
                "from the bucket",
                checkpoint_dir(path),
                "; ".join(f"rank {r}: {why}" for r, why in enumerate(lacking) if why),
            )
        return self._committed(path)

    def drain(self, timeout: float | None = None) -> None:
        """Every rank: wait until every checkpoint saved to the local tier is committed
        in the bucket; a failed drain is tried again, and raised on every rank if it
        fails again (TimeoutError after ``timeout`` s). Nothing to do without a tier."""
        tier = self._tier
        if tier is None:
            return
        if tier.dirpath is None:  # a new process: the run file names the bucket dirpath
            dirpath = agree(value=tier.recorded_dirpath(), group=checkpoint_group()).values[0]
            if dirpath is None or not tier.bind(dirpath, self._settings.open(dirpath)):
                return
        tier.drain(timeout)

    def teardown(self) -> None:
        """Lightning's end of a run (every rank): drain what is left (errors logged)."""
        super().teardown()
        try:
            self.drain()
        except Exception as exc:
            log.warning(
                "the local tier's drain at teardown failed: %s; drain() with this "
                "local_dir finishes it",
                exc,
            )

    # -- load ----------------------------------------------------------------------------
    def _committed(self, path: Any) -> Resolved:
        """The committed megatron checkpoint of ``path``: ``<ckpt>/weights``, else
        ``<ckpt>``; resolved once, for the reads that follow."""
        base = checkpoint_dir(path)
        candidates = (weights_url(path), base)
        for url in candidates:
            where = self._settings.resolve(url)
            if cm.is_checkpoint(where):
                return where
        raise NotFoundError(
            f"no committed NeMo checkpoint at {base} (neither {candidates[0]} nor {base} "
            "holds megatron's metadata.json: the save did not finish, or the path is wrong)"
        )

    def load_checkpoint(
        self,
        path: Any,
        sharded_state_dict: dict[str, Any] | None = None,
        map_location: Any | None = None,
        strict: Any = None,
    ) -> Any:
        """Load ``path`` (the checkpoint or its ``weights/``) into ``sharded_state_dict``.

        ``strict`` as NeMo: None -> ``assume_ok_unexpected``; False drops what the
        checkpoint lacks (``adjust_non_strict_load``) and logs all mismatches; True ->
        ``assume_ok_unexpected``; a ``StrictHandling`` value is used as is.
        """
        if map_location is not None:
            raise ValueError("map_location is not supported by CloudMegatronCheckpointIO")
        if sharded_state_dict is None:
            raise ValueError("CloudMegatronCheckpointIO.load_checkpoint needs sharded_state_dict")
        where = self._source(path)
        if isinstance(strict, bool):
            # NeMo's own back-compat rule (megatron's strict check skips factories).
            if not strict:
                sharded_state_dict = self.adjust_non_strict_load(where, sharded_state_dict)
            strict = "assume_ok_unexpected" if strict else "log_all"
        start = time.monotonic()
        loaded = cm.load(
            sharded_state_dict,
            where,
            strict="assume_ok_unexpected" if strict is None else strict,
            weights_only=self.weights_only,
        )
        log.info("loaded checkpoint %s in %.3fs", where.url, time.monotonic() - start)
        return _on_current_device(loaded)

    def adjust_non_strict_load(self, path: Any, sharded_state_dict: dict[str, Any]) -> Any:
        """Drop the sharded entries the checkpoint does not hold (NeMo's non-strict load)."""
        from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        stored = cm.load_tensors_metadata(self._settings.open(path))  # a view kept as is
        missing: list[str] = []

        def absent(x: Any) -> bool:
            if isinstance(x, ShardedBase) and x.key not in stored:
                missing.append(x.key)
                return True
            return False

        _, kept = extract_matching_values(sharded_state_dict, absent)
        log.info("not in the checkpoint, so not loaded: %s", missing)
        return kept

    def load_content_metadata(
        self, path: Any = None, preloaded_state_dict: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The ``content_metadata`` saved with the checkpoint, or NeMo's back-compat default."""
        where = None if path is None else self._source(path)
        found = cm.load_content_metadata(where, preloaded_state_dict=preloaded_state_dict)
        if found is None:
            shown = None if where is None else where.url
            log.info("no content metadata in %s; assuming %s", shown, DEFAULT_CONTENT_METADATA)
            return dict(DEFAULT_CONTENT_METADATA)
        return dict(found)

    # -- remove --------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the whole NeMo checkpoint (weights and context), its commit marker
        first; with a local tier, after its drain (one not started never starts)."""
        dirpath, _, name = checkpoint_dir(path).rpartition("/")
        tier = self._tier
        if tier is not None and tier.usable and tier.dirpath == dirpath:
            tier.removing(name)
        removed = remove_tree(checkpoint_dir(path))
        log.debug("removed %s (%d objects)", checkpoint_dir(path), removed)


def trainer_io(trainer: Any) -> CloudMegatronCheckpointIO | None:
    """The trainer's CloudMegatronCheckpointIO inside Lightning's wrappers of it (NeMo's
    async one among them), or None when its strategy uses another I/O."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    while isinstance(io, WrappingCheckpointIO):
        io = io.checkpoint_io
    return io if isinstance(io, CloudMegatronCheckpointIO) else None


def _on_current_device(state: Any) -> Any:
    """NeMo's ``_fix_tensors_device``: CUDA tensors onto this rank's device (CPU: as is)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return state
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

    device = torch.device("cuda", torch.cuda.current_device())

    def move(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_cuda and t.device != device:
            return t.to(device)
        return t

    return dict_list_map_outplace(move, state)


class CloudAsyncFinalizableCheckpointIO(AsyncFinalizableCheckpointIO, IOMixin):  # type: ignore[misc]
    """NeMo's ``AsyncFinalizableCheckpointIO`` that starts with megatron-core >= 0.16.

    NeMo 2.7's own refuses to start there (it probes the removed
    ``strategies.tensorstore``). This one is the same class otherwise, so NeMo's
    ``ModelCheckpoint`` and ``AsyncFinalizerCallback`` accept it: ``save_checkpoint``
    schedules the wrapped IO's ``AsyncRequest`` (plus NeMo's ``finalize_fn``) on
    megatron-core's ``AsyncCallsQueue``; ``maybe_finalize_save_checkpoint`` finalizes.
    """

    def __init__(self, checkpoint_io: Any) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if not isinstance(checkpoint_io, AsyncCompatibleCheckpointIO):
            raise ValueError(f"Incompatible wrapped checkpoint_io type: {type(checkpoint_io)}")
        if not getattr(checkpoint_io, "async_save", False):
            raise ValueError(
                "CloudAsyncFinalizableCheckpointIO wraps an IO made with async_save=True "
                "(use cloud_checkpoint_io(async_save=...))"
            )
        WrappingCheckpointIO.__init__(self, checkpoint_io)
        self.async_calls_queue = AsyncCallsQueue()

    def drain(self, timeout: float | None = None) -> None:
        """Every rank: finalize the saves in flight, then the wrapped IO's ``drain``."""
        self.maybe_finalize_save_checkpoint(blocking=True)
        self.checkpoint_io.drain(timeout)

    def teardown(self) -> None:
        """NeMo's teardown, then the wrapped IO's (Lightning's wrapper does not call it):
        the local tier drains what was finalized."""
        super().teardown()
        self.checkpoint_io.teardown()


def cloud_checkpoint_io(
    async_save: bool, **options: Any
) -> CloudMegatronCheckpointIO | CloudAsyncFinalizableCheckpointIO:
    """The checkpoint I/O for ``MegatronStrategy(checkpoint_io=..., ckpt_async_save=...)``.

    Pass the strategy's ``ckpt_async_save`` as ``async_save`` (MegatronStrategy does not
    hand it to a given IO): True gives the async wrapper NeMo's callbacks require, False
    the plain IO. ``options`` (``local_dir=``, ``keep_local=``, transfer options) go to
    :class:`CloudMegatronCheckpointIO`.
    """
    io = CloudMegatronCheckpointIO(async_save=async_save, **options)
    return CloudAsyncFinalizableCheckpointIO(io) if async_save else io
