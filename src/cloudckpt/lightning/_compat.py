"""The Lightning package in use: ``lightning`` (2.x) or the standalone ``pytorch_lightning``."""

from __future__ import annotations

from ..errors import ConfigError

try:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef,assignment]
        from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[no-redef,assignment]
    except ImportError:
        raise ConfigError(
            "cloudckpt.lightning needs Lightning: pip install 'lightning>=2.4'"
        ) from None

__all__ = ["CheckpointIO", "ModelCheckpoint"]
