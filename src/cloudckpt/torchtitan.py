"""torchtitan's checkpoints on object storage: its ``CheckpointManager`` with an ``s3://``
(``gs://``, ``az://``) folder.

    from torchtitan.trainer import Trainer
    from cloudckpt.torchtitan import CloudCheckpointManager

    config = Trainer.Config(
        checkpoint=CloudCheckpointManager.Config(
            enable=True, folder="s3://bucket/run1/checkpoint", interval=500,
            keep_latest_k=3, async_mode="async",
            cloud_options={"storage_options": {"region_name": "us-east-1"}},
        ),
        ...,
    )

torchtitan builds its checkpointer from ``config.checkpoint.build(...)``, so naming this
``Config`` selects the class; it is torchtitan's own ``CheckpointManager`` (what to save,
when, which states, ``model_only`` steps, ``exclude_from_loading``) with the storage
underneath replaced by :class:`cloudckpt.CheckpointManager` (``kind="dcp"``):

- a save writes ``folder/step-N/`` through :class:`~cloudckpt.dcp.CloudStorageWriter`
  (``async_mode="async"``: in DCP's background thread) and commits it with
  ``_CHECKPOINT.json`` once every rank's data is written;
- ``load`` restores the newest committed step in the bucket (or ``load_step``) through
  :class:`~cloudckpt.dcp.CloudStorageReader`, resharded to this run's ranks; a step
  that never committed is not seen;
- ``keep_latest_k`` is applied in the bucket after each commit; the newest committed
  step, the one restored and saves in flight are never deleted.

torchtitan is imported when :class:`CloudCheckpointManager` is first used. Not supported:
``async_mode="async_with_pinned_mem"`` and ``last_save_in_hf`` (ConfigError). See
docs/integrations.md (torchtitan).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from concurrent.futures import Future
from typing import Any

from ._lazy import lazy_attributes
from .errors import ConfigError, NotFoundError
from .manager import CheckpointManager as _Manager
from .manager import ManagedSaveHandle

__all__ = ["CloudCheckpointManager"]

#: Built on torchtitan's class when first used (``_define``, the module ``__getattr__`` at
#: the end).
CloudCheckpointManager: Any

log = logging.getLogger("cloudckpt")

#: The step of a checkpoint URL this module builds (``.../step-N/``).
_STEP_URL = re.compile(r"step-(\d+)/?$")


def _bridge(handle: ManagedSaveHandle) -> Future[Any]:
    """A ``concurrent.futures.Future`` (what torchtitan waits on) completed when
    ``handle``'s checkpoint is committed, or with its error."""
    future: Future[Any] = Future()

    def done(finished: Any) -> None:
        error = finished.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(finished.result())

    handle.add_done_callback(done)
    return future


def _define() -> Any:
    """Build the class on torchtitan's ``CheckpointManager`` (torchtitan imported now)."""
    try:
        import torch
        import torch.distributed.checkpoint as dcp
        from torchtitan.components.checkpointer.base import MODEL
        from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
    except ImportError as exc:
        raise ImportError(
            "cloudckpt.torchtitan needs torchtitan (pip install 'cloudckpt[torchtitan]')"
        ) from exc

    from .dcp import CloudStorageReader

    class CloudCheckpointManager(CheckpointManager):  # type: ignore[misc, valid-type]
        """torchtitan's ``CheckpointManager`` saving to, resuming from and pruning
        ``config.folder`` on any cloudckpt store (module docstring)."""

        folder: str
        cloud: _Manager

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):  # type: ignore[misc, name-defined]
            cloud_options: dict[str, Any] = dataclasses.field(default_factory=dict)
            """cloudckpt settings for ``folder``: :class:`~cloudckpt.TransferOptions`
            fields, ``storage_options`` among them (a profile matching the URL
            applies too)."""

        def __init__(self, config: Any, **kwargs: Any) -> None:
            if config.enable and config.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise ConfigError(
                    "async_mode='async_with_pinned_mem' is not supported by "
                    f"CloudCheckpointManager (folder {config.folder}): use async_mode='async'"
                )
            if config.enable and config.last_save_in_hf:
                raise ConfigError(
                    "last_save_in_hf is not supported by CloudCheckpointManager (folder "
                    f"{config.folder}): the last step is saved as a DCP checkpoint"
                )
            # Retention runs in the bucket after each commit (cloudckpt's manager), so
            # torchtitan's purge thread, which deletes through fsspec, is not started.
            super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
            if not self.enable:
                return
            self.keep_latest_k = config.keep_latest_k
            self.cloud = _Manager(
                self.folder,
                keep_last=config.keep_latest_k or None,
                kind="dcp",
                **config.cloud_options,
            )
            self.folder = self.cloud.root_url

        def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
            """The URL of ``step``'s prefix (``folder`` is not used: one run per
            manager)."""
            return str(self.cloud.step_url(step))

        @torch.no_grad()
        def dcp_save(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            async_mode: Any,
            enable_garbage_collection: bool = False,
            to_hf: bool = False,
        ) -> Future[Any] | None:
            """Save and commit ``state_dict`` as the step ``checkpoint_id`` names: in
            place, or (``AsyncMode.ASYNC``) in the background, returning a future that
            completes once the step is committed."""
            if to_hf:
                raise ConfigError("saving in Hugging Face format is not supported")
            found = _STEP_URL.search(checkpoint_id)
            if found is None:
                raise ConfigError(f"{checkpoint_id!r} does not name a step-N checkpoint")
            step = int(found.group(1))
            if async_mode == AsyncMode.ASYNC:
                return _bridge(self.cloud.async_save(step, state_dict))
            self.cloud.save(step, state_dict)
            return None

        def dcp_load(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            from_hf: bool,
            from_quantized: bool,
        ) -> None:
            """Load ``checkpoint_id`` into ``state_dict``: a URL of a cloudckpt store
            through the cloudckpt reader, anything else as torchtitan does."""
            if from_hf or "://" not in checkpoint_id or checkpoint_id.startswith("file://"):
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
                return
            reader = CloudStorageReader(checkpoint_id, options=self.cloud.options)
            dcp.load(state_dict, storage_reader=reader)
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)

        @torch.no_grad()
        def _load(self, step: int = -1) -> bool:
            """Restore the newest committed step in the bucket (or ``step``); with none,
            the initial checkpoint torchtitan's config names, if any."""
            # info(step): NotFoundError (a FileNotFoundError) when it is not committed.
            info = self.cloud.latest() if step == -1 else self.cloud.info(step)
            if info is None:
                return self._initial_load()
            model_only = info.step == 0  # torchtitan's seed checkpoint
            states = self._states_to_load(model_only)
            log.info("torchtitan: loading step %d from %s", info.step, info.url)
            self.cloud.restore(info.step, state=states)
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(states)
            return True

        def _initial_load(self) -> bool:
            """A fresh run: ``initial_load_path`` (or the Hugging Face assets), as
            torchtitan's ``load`` reads them when its folder holds no checkpoint."""
            path = self.initial_load_path
            from_hf = self.initial_load_in_hf
            if not path and from_hf:
                path = getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                log.info("torchtitan: no committed checkpoint under %s", self.folder)
                return False
            states = self._states_to_load(self.initial_load_model_only)
            try:
                self.dcp_load(states, path, from_hf, self.initial_load_in_hf_quantized)
            except FileNotFoundError as exc:
                raise NotFoundError(f"checkpoint.initial_load_path {path}: {exc}") from exc
            return True

        def _purge_stale_checkpoints(self) -> None:
            """Nothing: retention runs in the bucket after each commit."""

        def _close(self) -> None:
            """Wait for a save in flight to commit (its error is raised), then close."""
            try:
                if getattr(self, "save_future", None) is not None:  # None: __init__ failed
                    self._wait_for_saving()
            finally:
                super()._close()

    CloudCheckpointManager.__module__ = __name__
    CloudCheckpointManager.__qualname__ = "CloudCheckpointManager"
    CloudCheckpointManager.Config.__qualname__ = "CloudCheckpointManager.Config"
    return CloudCheckpointManager


__getattr__, __dir__ = lazy_attributes(globals(), {"CloudCheckpointManager": _define}, __all__)
