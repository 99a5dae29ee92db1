"""What the integrations that commit a folder of files per step share (Accelerate,
DeepSpeed, the Hugging Face callback): the run's manager, the group their collectives
run on, a step's prefix, the checks of a step number, the files a folder holds."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..options import TransferOptions
from ..ranks.collectives import is_distributed
from ..ranks.groups import checkpoint_group
from .manager import CheckpointManager
from .marker import root_prefix, step_dir

__all__ = ["checked_step", "files_under", "open_run", "run_group", "step_prefix"]


def open_run(
    url: str | os.PathLike[str],
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
    **manager_args: Any,
) -> CheckpointManager:
    """The manager of the run at ``url`` (the URL and its options resolved once);
    ``manager_args`` go to :class:`CheckpointManager` as given."""
    if storage_options is not None:
        manager_args["storage_options"] = dict(storage_options)
    return CheckpointManager(url, options=options, **manager_args)


def run_group() -> Any:
    """The dedicated gloo group of a save's or load's collectives (None: one process)."""
    return checkpoint_group() if is_distributed() else None


def step_prefix(manager: CheckpointManager, step: int) -> str:
    """The key prefix of ``step``'s folder in the run's store (ending in ``/``)."""
    return f"{root_prefix(manager.root_key)}{step_dir(step)}/"


def checked_step(step: Any) -> int:
    """``step`` if it is a non-negative integer (ConfigError otherwise)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step={step!r} must be a non-negative integer")
    return step


def files_under(folder: Path) -> list[str]:
    """Every file under ``folder``, as sorted ``/``-separated relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
