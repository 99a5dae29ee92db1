"""``cloudckpt.megatron.load`` and the metadata readers: megatron-core's, from any URL.

:func:`load` follows ``dist_checkpointing.load`` step by step (common state, factories,
non-persistent entries, integrity and strictness checks, factory merges) and loads the
sharded part with megatron's own ``TorchDistLoadShardedStrategy``, reading through a
:class:`~cloudckpt.dcp.CloudStorageReader`. Resharding is megatron's: a checkpoint
saved with one tensor/pipeline/data-parallel layout loads into another.
"""

from __future__ import annotations

import os
from typing import Any

from .._runtime.gcpause import paused_gc
from ..dcp.location import CheckpointLocation
from ..dcp.reader import MetadataOnceReader
from ..engine.load import load as load_object
from ..errors import BucketNotFoundError, NotFoundError
from ..format.commit import read_committed
from ..options import TransferOptions
from . import mcore
from .layout import COMMON_NAME, CONFIG_NAME, BackendRecord, decode_config
from .save import CONTENT_METADATA_KEY

__all__ = [
    "is_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
]


def _committed(url: str | os.PathLike[str], options: Any, overrides: dict[str, Any]) -> Any:
    """The checkpoint's location, once its ``metadata.json`` was found and read."""
    where = CheckpointLocation.resolve(url, options, **overrides)
    _record(where)
    return where


def _record(where: CheckpointLocation) -> BackendRecord:
    """``metadata.json`` (the commit marker, format/commit.py), or NotFoundError saying
    the URL holds no committed checkpoint."""
    payload = read_committed(where.store, where.key(CONFIG_NAME))
    if payload is None:
        raise NotFoundError(
            f"no committed Megatron checkpoint at {where.url} ({where.url_of(CONFIG_NAME)} "
            "is missing: the save did not finish, or the URL names another directory)"
        )
    return decode_config(payload, where.url_of(CONFIG_NAME))


def is_checkpoint(
    url: str | os.PathLike[str], *, options: TransferOptions | None = None, **overrides: Any
) -> bool:
    """True if ``url`` holds a committed Megatron checkpoint cloudckpt can read."""
    where = CheckpointLocation.resolve(url, options, **overrides)
    try:
        _record(where)
    except BucketNotFoundError:
        raise
    except NotFoundError:
        return False
    return True


def load_common_state_dict(
    url: str | os.PathLike[str],
    *,
    weights_only: bool = True,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The checkpoint's common (non-sharded) state: ``common.pt``.

    ``weights_only`` (the default) refuses pickled classes; Megatron-LM's ``args``
    namespace is one, so pass ``weights_only=False`` for checkpoints you trust.
    """
    return _common(_committed(url, options, overrides), weights_only)


def _common(where: CheckpointLocation, weights_only: bool) -> dict[str, Any]:
    # On the location's own store: a Target given to load() reads through its view.
    common = where.target_of(COMMON_NAME)
    loaded = load_object(common, map_location="cpu", weights_only=weights_only)
    return dict(loaded)


def load_content_metadata(
    url: str | os.PathLike[str] | None = None,
    *,
    preloaded_state_dict: dict[str, Any] | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> dict[str, Any] | None:
    """The ``content_metadata`` given to :func:`~cloudckpt.megatron.save` (None if none)."""
    if preloaded_state_dict is None:
        if url is None:
            raise ValueError("pass the checkpoint's url or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(url, options=options, **overrides)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def _reader(where: CheckpointLocation, weights_only: bool) -> MetadataOnceReader:
    return MetadataOnceReader(where.source, weights_only=weights_only)


def load_tensors_metadata(
    url: str | os.PathLike[str], *, options: TransferOptions | None = None, **overrides: Any
) -> dict[str, Any]:
    """Every tensor in the checkpoint as a ShardedTensor without data (global shape, dtype)."""
    mc = mcore.require()
    where = _committed(url, options, overrides)
    metadata = _reader(where, True).read_metadata()
    result: dict[str, Any] = mc.TorchDistLoadShardedStrategy().load_tensors_metadata(
        where.url, metadata
    )
    return result


def load_sharded_metadata(
    url: str | os.PathLike[str], *, options: TransferOptions | None = None, **overrides: Any
) -> dict[str, Any]:
    """Like :func:`load_tensors_metadata`, with the ShardedObjects too."""
    where = _committed(url, options, overrides)
    return _sharded_metadata(mcore.RemoteDir(where.url, _reader(where, True)))


def _sharded_metadata(remote: mcore.RemoteDir) -> dict[str, Any]:
    mcore.install_reader_hook()
    result: dict[str, Any] = (
        mcore.require().TorchDistLoadShardedStrategy().load_sharded_metadata(remote)
    )
    return result


@paused_gc(kept=True)  # megatron's steps and DCP's planners (_runtime/gcpause.py)
def load(
    sharded_state_dict: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    strict: Any = "assume_ok_unexpected",
    validate_access_integrity: bool = True,
    weights_only: bool = True,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> Any:
    """Load ``url`` into the layout ``sharded_state_dict`` describes (any parallel layout).

    Call on every rank, as ``dist_checkpointing.load``; returns the loaded state dict
    (and, for the ``strict`` values that ask for them, the missing and unexpected
    keys). ``weights_only`` (the default) refuses pickled classes in the common state
    and in ShardedObjects: pass False for checkpoints you trust (Megatron-LM's ``args``,
    numpy RNG states). Other keywords are :class:`~cloudckpt.TransferOptions` fields.
    """
    mc = mcore.require()
    where = _committed(url, options, overrides)
    # One reader for the whole load: megatron's steps ask for .metadata several times.
    remote = mcore.RemoteDir(where.url, _reader(where, weights_only))
    if mc.force_all_tensors_to_non_fp8 is not None:
        mc.force_all_tensors_to_non_fp8(sharded_state_dict)
    common = _common(where, weights_only)
    sharded, nonpersistent, factories = mc.load_preprocess(sharded_state_dict)
    mc.merge(common, nonpersistent)
    sharded, _ = mc.extract_sharded_base(sharded)

    handling = mc.parse_strict_flag(strict)
    ckpt_metadata = None
    if mc.StrictHandling.requires_explicit_ckpt_mismatch_check(handling):
        ckpt_metadata = _sharded_metadata(remote)
    local_metadata = global_metadata = None
    if validate_access_integrity or mc.StrictHandling.requires_global_app_metadata(handling):
        local_metadata, global_metadata = mc.determine_global_metadata(sharded)
    sharded, missing, unexpected = mc.validate_integrity_and_strict_load(
        sharded, handling, validate_access_integrity, local_metadata, global_metadata, ckpt_metadata
    )

    mcore.install_reader_hook()
    loaded = mc.TorchDistLoadShardedStrategy().load(sharded, remote)
    mc.merge(common, loaded)
    common = mc.apply_factory_merges(common, factories)
    if mc.StrictHandling.requires_returning_mismatch_keys(handling):
        return common, missing, unexpected
    return common
