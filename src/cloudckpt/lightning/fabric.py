"""Lightning Fabric's FSDP and ModelParallel strategies with sharded checkpoints on cloudckpt.

    fabric = Fabric(strategy=CloudFabricModelParallelStrategy(parallelize_fn=shard))
    fabric.save("s3://bucket/run1/step-100", {"model": model, "optimizer": opt, "step": 100})
    rest = fabric.load("s3://bucket/run1/step-100", {"model": model, "optimizer": opt})

Fabric's other strategies (single device, DDP) write one file through their
``CheckpointIO``: ``Fabric(plugins=[CloudCheckpointIO()])`` is all they need. These two
write a sharded checkpoint themselves, so these subclasses replace their
``save_checkpoint`` and ``load_checkpoint`` with the same save and load as the Trainer's
strategies (cloudckpt.lightning.strategies): the layout is Fabric's (DCP's files and
``meta.pt``), committed by the DCP writer's ``.metadata``. See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, MissingKeyError
from .fs import is_remote
from .strategies import (
    FSDPSettings,
    ModelParallelSettings,
    kind_of,
    open_checkpoint,
    path_text,
    refuse_full,
    restore_sharded,
    save_sharded,
)

try:
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
except ImportError:  # pragma: no cover - depends on what is installed
    from lightning_fabric.strategies import (  # type: ignore[no-redef,assignment]
        FSDPStrategy,
        ModelParallelStrategy,
    )

__all__ = ["CloudFabricFSDPStrategy", "CloudFabricModelParallelStrategy"]


def _stateful(obj: Any) -> bool:
    """Whether ``obj`` saves and restores itself (Fabric's ``_Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _split(state: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """The one model in ``state`` (its key and itself) and its optimizers by key."""
    import torch

    models = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
    if len(models) != 1:
        raise ConfigError(
            f"a sharded checkpoint holds exactly one model; the state has {len(models)} "
            f"({', '.join(k for k, _ in models) or 'none'}): save each model to its own path"
        )
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    return models[0][0], models[0][1], optimizers


class _FabricShardedCheckpoints:
    """Save and load a Fabric strategy's sharded checkpoints through cloudckpt."""

    _sharded_setting: str
    _cloud_settings: Any
    broadcast: Any

    @property
    def _sharded(self) -> bool:  # pragma: no cover - each strategy answers
        raise NotImplementedError

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Every rank: write the model's and optimizers' shards and the rest of ``state``
        (``meta.pt``, from rank 0); ``storage_options`` are TransferOptions fields."""
        text = self.broadcast(path_text(path))
        if not self._sharded:
            if is_remote(text):
                refuse_full(text, self, self._sharded_setting)
            super().save_checkpoint(path, state, None, filter)  # type: ignore[misc]
            return
        target = open_checkpoint(text, self._cloud_settings, **(storage_options or {}))
        if filter is not None:
            raise ConfigError("filter= applies to full checkpoints; a sharded one saves whole")
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model_key, model, optimizers = _split(state)
        shards: dict[str, Any] = {model_key: get_model_state_dict(model)}
        for key, optim in optimizers.items():
            shards[key] = get_optimizer_state_dict(model, optim)
        meta = {
            k: v.state_dict() if _stateful(v) else v for k, v in state.items() if k not in shards
        }
        save_sharded(target, shards, meta)

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Every rank: restore the model and optimizers in ``state`` in place (resharded
        to this run's ranks), and its other keys from ``meta.pt``; return what is left."""
        text = self.broadcast(path_text(path))
        target = open_checkpoint(text, self._cloud_settings)
        if kind_of(target) == "object":
            if is_remote(text):
                refuse_full(text, self, self._sharded_setting)
            return super().load_checkpoint(path, state, strict, weights_only)  # type: ignore[misc,no-any-return]
        if not isinstance(state, dict) or not state:
            raise ConfigError(
                "loading a sharded checkpoint restores objects in place: pass "
                "state={'model': model, 'optimizer': optimizer, ...}"
            )
        model_key, model, optimizers = _split(state)
        meta = restore_sharded(
            target,
            model,
            model_key,
            optimizers,
            strict=strict,
            weights_only=True if weights_only is None else weights_only,
        )
        wanted = state.keys() - {model_key} - optimizers.keys()
        missing = wanted - meta.keys()
        if strict and missing:
            raise MissingKeyError(
                f"{target.url} holds no {', '.join(sorted(missing))} (its keys: "
                f"{', '.join(sorted(meta))}); pass strict=False to load the rest"
            )
        for key in wanted & meta.keys():
            value = meta.pop(key)
            if _stateful(state[key]):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return meta


class CloudFabricFSDPStrategy(FSDPSettings, _FabricShardedCheckpoints, FSDPStrategy):  # type: ignore[misc]
    """Fabric's ``FSDPStrategy`` whose sharded checkpoints go through cloudckpt's DCP
    writer and reader, at ``s3://``, ``gs://``, ``az://`` URLs or local paths.

    ``options`` and ``storage_options`` are the store settings (else those a
    ``CloudCheckpointIO`` registered). Other arguments are ``FSDPStrategy``'s, by keyword.
    """


class CloudFabricModelParallelStrategy(
    ModelParallelSettings, _FabricShardedCheckpoints, ModelParallelStrategy
):  # type: ignore[misc]
    """Fabric's ``ModelParallelStrategy`` whose sharded checkpoints go through
    cloudckpt's DCP writer and reader, at ``s3://``, ``gs://``, ``az://`` URLs or local
    paths.

    ``options`` and ``storage_options`` are the store settings (else those a
    ``CloudCheckpointIO`` registered). Other arguments are ``ModelParallelStrategy``'s.
    """
