"""The NeMo 2 names cloudckpt.nemo subclasses, imported in one place.

Importing any of cloudckpt.nemo's modules imports NeMo (``import cloudckpt.nemo``
alone does not); without NeMo 2 this module raises ImportError naming the package.
Tested with nemo_toolkit 2.7.3, the last 2.x release (docs/megatron.md); NeMo 3 no
longer has the LLM training stack (``nemo.lightning.MegatronStrategy`` and friends).
"""

from __future__ import annotations

REQUIREMENT = "nemo_toolkit[lightning]>=2.7,<3"

try:
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from nemo.lightning.io.mixin import IOMixin
    from nemo.lightning.io.pl import MegatronCheckpointIO
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint
    from nemo.lightning.resume import AutoResume
    from nemo.utils.app_state import AppState
    from nemo.utils.callbacks.dist_ckpt_io import (
        AsyncCompatibleCheckpointIO,
        AsyncFinalizableCheckpointIO,
    )
    from nemo.utils.get_rank import is_global_rank_zero
except (ImportError, TypeError) as exc:  # TypeError: nv_one_logger with Lightning >= 2.5
    raise ImportError(
        f"cloudckpt.nemo needs NeMo 2 (pip install '{REQUIREMENT}'; NeMo 3 has no "
        f"nemo.lightning LLM stack). Importing it failed: {type(exc).__name__}: {exc}. "
        "NeMo 2.7 pins lightning<=2.4; for newer Lightning see docs/megatron.md (NeMo 2)."
    ) from exc

__all__ = [
    "REQUIREMENT",
    "AppState",
    "AsyncCompatibleCheckpointIO",
    "AsyncFinalizableCheckpointIO",
    "AutoResume",
    "IOMixin",
    "MegatronCheckpointIO",
    "ModelCheckpoint",
    "WrappingCheckpointIO",
    "is_global_rank_zero",
]

WrappingCheckpointIO = _WrappingCheckpointIO  # Lightning's (private) wrapper base class
