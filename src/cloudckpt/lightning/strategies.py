"""Lightning's FSDP and ModelParallel strategies with their sharded checkpoints on cloudckpt.

    from cloudckpt.lightning import CloudModelCheckpoint, CloudModelParallelStrategy

    trainer = Trainer(
        strategy=CloudModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1),
        callbacks=[CloudModelCheckpoint(dirpath="s3://bucket/run1", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

Lightning's strategies write a sharded checkpoint themselves, with
``torch.distributed.checkpoint.save(checkpoint_id=Path(...))``, never through the
``CheckpointIO`` plugin: there is no hook to hand them a storage writer. These
subclasses replace only ``save_checkpoint``, ``load_checkpoint`` and
``remove_checkpoint``. A checkpoint is a prefix (or a local folder) in
``FileSystemWriter``'s layout plus Lightning's ``meta.pt`` (everything but the model
and optimizer states), so a downloaded copy loads with stock Lightning:

- rank 0 first deletes what the name held (an older save: its ``.metadata`` first, so
  it is no longer committed, then the rest) and writes ``meta.pt``; then every rank
  writes its shards through
  :class:`~cloudckpt.dcp.CloudStorageWriter`, whose ``.metadata`` is written last and
  commits the whole checkpoint (docs/dcp.md);
- loading reads the shards through :class:`~cloudckpt.dcp.CloudStorageReader`
  (resharded to the ranks of this run) and ``meta.pt`` through ``cloudckpt.load``;
- removing a checkpoint (top-k or ``last`` rotation) deletes its ``.metadata`` first,
  then the rest of the prefix.

See docs/lightning.md.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from ..dcp import CloudStorageReader, CloudStorageWriter
from ..engine.load import load
from ..engine.remove import remove_checkpoint
from ..engine.save import save
from ..errors import ConfigError, DistributedLoadError, DistributedSaveError, NotFoundError
from ..options import TransferOptions
from ..ranks.collectives import on_first
from ..store import Settings, Target, join_key
from ..store.paths import classify, dir_prefix
from .fs import is_remote, settings_for, unwrap

try:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning.strategies import (  # type: ignore[no-redef,assignment]
        FSDPStrategy,
        ModelParallelStrategy,
    )

__all__ = [
    "META_NAME",
    "CloudFSDPStrategy",
    "CloudModelParallelStrategy",
    "kind_of",
    "open_checkpoint",
    "path_text",
    "refuse_full",
    "restore_sharded",
    "save_sharded",
    "strategy_settings",
]

#: Lightning's name for the rest of a sharded checkpoint (``lightning.fabric``'s
#: ``_METADATA_FILENAME``): loops, callbacks, hyper-parameters, epoch and step.
META_NAME = "meta.pt"


def _child(target: Target, name: str) -> Target:
    """The object ``name`` inside the prefix ``target``, with the same store and options."""
    key = join_key(target.key.rstrip("/"), name, target.url)
    return Target(f"{target.url.rstrip('/')}/{name}", target.store, key, target.options)


def path_text(path: Any) -> Any:
    """A path-like as its string (what a strategy broadcasts); anything else as given."""
    return os.fspath(path) if isinstance(path, os.PathLike) else path


def open_checkpoint(path: Any, settings: Settings | None, **extra: Any) -> Target:
    """``path`` (a URL, ``cloudckpt://``-wrapped or not, or a local path) resolved with
    ``settings``, else with those registered for it (the checkpoint I/O's or callback's)."""
    url = unwrap(path_text(path))
    return (settings or settings_for(url)).open(url, **extra)


def save_sharded(target: Target, shards: dict[str, Any], meta: dict[str, Any]) -> None:
    """Every rank: write a sharded checkpoint at ``target``, committed by ``.metadata``.

    Rank 0 first removes what the name held (a file, or an older save: its marker
    first) and writes ``meta``; then the shards go through the DCP writer, whose
    ``.metadata`` comes last."""

    def prepare() -> None:
        kind = classify(target.store, target.key).kind
        if kind == "object":  # a full checkpoint of the same name
            target.store.delete(target.key)
        elif kind == "prefix":
            remove_checkpoint(target.store, dir_prefix(target.key), target.options)
        save(meta, _child(target, META_NAME))

    on_first(
        prepare,
        what=f"clearing {target.url} and writing its {META_NAME}",
        error_type=DistributedSaveError,
    )

    import torch.distributed.checkpoint as dcp

    dcp.save(shards, storage_writer=CloudStorageWriter(target.resolved))


def kind_of(target: Target) -> str:
    """Every rank: what ``target`` names ("object", "prefix", "missing"), looked up by
    rank 0 alone."""
    kind: str = on_first(
        lambda: classify(target.store, target.key).kind,
        what=f"looking up {target.url}",
        error_type=DistributedLoadError,
    )
    if kind == "missing":
        raise NotFoundError(f"no checkpoint at {target.url}")
    return kind


def refuse_full(path: Any, strategy: Any, setting: str) -> None:
    """Full (one-file) checkpoints are these strategies' own local files only."""
    raise ConfigError(
        f"{type(strategy).__name__} keeps full (unsharded) checkpoints only at a local path, "
        f"not at {unwrap(path_text(path))}: save sharded ({setting}) or use a local path"
    )


def restore_sharded(
    target: Target,
    model: Any,
    model_key: str,
    optimizers: dict[str, Any],
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    """Every rank: read the model's and optimizers' states from ``target`` into them,
    resharded to this run's ranks; return the rest of the checkpoint (``meta.pt``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {model_key: get_model_state_dict(model)}
    for key, optim in optimizers.items():
        state[key] = get_optimizer_state_dict(model, optim)
    reader = CloudStorageReader(target.resolved, weights_only=weights_only)
    dcp.load(state, storage_reader=reader)
    set_model_state_dict(model, state[model_key], options=StateDictOptions(strict=strict))
    for key, optim in optimizers.items():
        set_optimizer_state_dict(model, optim, optim_state_dict=state[key])
    # Every rank reads it: its bytes are fetched once in all and shared.
    meta: dict[str, Any] = load(
        _child(target, META_NAME), map_location="cpu", weights_only=weights_only, share=True
    )
    return meta


class _ShardedCheckpoints:
    """Save, load and remove a Trainer strategy's sharded checkpoints through cloudckpt.

    Mixed into a Lightning strategy: ``_model_key`` is the name the strategy gives the
    model's state in the checkpoint, ``_sharded`` whether it saves sharded at all.
    """

    _model_key: str
    _sharded_setting: str
    _cloud_settings: Settings | None

    # The Lightning strategy this is mixed into provides these.
    broadcast: Any
    is_global_zero: bool
    model: Any
    optimizers: Any
    lightning_module: Any
    checkpoint_io: Any

    @property
    def _sharded(self) -> bool:  # pragma: no cover - each strategy answers
        raise NotImplementedError

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint``: sharded through the DCP writer (every rank), or, when the
        strategy saves full checkpoints, one local file as Lightning does.

        ``storage_options`` are TransferOptions fields over this strategy's settings."""
        path = self.broadcast(path_text(filepath))
        if not self._sharded:
            if is_remote(path):
                refuse_full(path, self, self._sharded_setting)
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
            return
        target = open_checkpoint(path, self._cloud_settings, **(storage_options or {}))
        shards = {self._model_key: checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{idx}"] = optim_state
        save_sharded(target, shards, checkpoint)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the model and optimizers in place from a sharded checkpoint (on any
        number of ranks) and return the rest; a local full checkpoint file loads as
        Lightning loads it."""
        path = self.broadcast(path_text(checkpoint_path))
        target = open_checkpoint(path, self._cloud_settings)
        if kind_of(target) == "object":
            if is_remote(path):
                refuse_full(path, self, self._sharded_setting)
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc,no-any-return]
        return restore_sharded(
            target,
            self.model,
            self._model_key,
            {f"optimizer_{i}": optim for i, optim in enumerate(self.optimizers)},
            strict=bool(self.lightning_module.strict_loading),
            weights_only=True if weights_only is None else weights_only,
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint, on rank 0: a sharded one's ``.metadata`` first, then the
        rest of its prefix (or folder); a single file through the checkpoint I/O."""
        if not self.is_global_zero:
            return
        target = open_checkpoint(filepath, self._cloud_settings)
        kind = classify(target.store, target.key.rstrip("/")).kind
        if kind == "object":
            self.checkpoint_io.remove_checkpoint(filepath)
        elif kind == "prefix":
            remove_checkpoint(target.store, dir_prefix(target.key), target.options)


class FSDPSettings:
    """What an FSDP strategy adds, the Trainer's or Fabric's alike: the store settings
    (``options``, ``storage_options``), and ``state_dict_type`` defaulting to
    ``"sharded"`` (Lightning's to ``"full"``), which says whether it saves sharded."""

    _state_dict_type: str
    _cloud_settings: Settings | None

    _sharded_setting = "state_dict_type='sharded'"

    def __init__(
        self,
        *,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        options: TransferOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # the Lightning strategy class after this one in the method order
        super().__init__(state_dict_type=state_dict_type, **kwargs)  # type: ignore[call-arg]
        self._cloud_settings = strategy_settings(options, storage_options)

    @property
    def _sharded(self) -> bool:
        return bool(self._state_dict_type == "sharded")


class ModelParallelSettings:
    """What a ModelParallel strategy adds, the Trainer's or Fabric's alike: the store
    settings; ``save_distributed_checkpoint`` says whether it saves sharded."""

    _save_distributed_checkpoint: bool
    _cloud_settings: Settings | None

    _sharded_setting = "save_distributed_checkpoint=True"

    def __init__(
        self,
        *args: Any,
        options: TransferOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._cloud_settings = strategy_settings(options, storage_options)

    @property
    def _sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)


class CloudFSDPStrategy(FSDPSettings, _ShardedCheckpoints, FSDPStrategy):  # type: ignore[misc]
    """``FSDPStrategy`` whose sharded checkpoints go through cloudckpt's DCP writer and
    reader, at ``s3://``, ``gs://``, ``az://`` URLs or local paths.

    ``state_dict_type`` defaults to ``"sharded"`` (Lightning's to ``"full"``); ``options``
    and ``storage_options`` are the store settings (else those the checkpoint I/O or
    the callback registered). Other arguments are ``FSDPStrategy``'s, by keyword.
    """

    _model_key = "model"


class CloudModelParallelStrategy(ModelParallelSettings, _ShardedCheckpoints, ModelParallelStrategy):  # type: ignore[misc]
    """``ModelParallelStrategy`` whose sharded checkpoints go through cloudckpt's DCP
    writer and reader, at ``s3://``, ``gs://``, ``az://`` URLs or local paths.

    ``options`` and ``storage_options`` are the store settings (else those the
    checkpoint I/O or the callback registered). Other arguments are
    ``ModelParallelStrategy``'s.
    """

    _model_key = "state_dict"


def strategy_settings(
    options: TransferOptions | None, storage_options: dict[str, Any] | None
) -> Settings | None:
    """The store settings given to a strategy, checked now; None when none were."""
    if options is None and not storage_options:
        return None
    return Settings(options, {"storage_options": storage_options} if storage_options else {})
