"""cloudckpt: save and load PyTorch checkpoints straight to object storage and filesystems.

    import cloudckpt
    cloudckpt.save(model.state_dict(), "s3://bucket/run1/step-100.pt")
    state = cloudckpt.load("s3://bucket/run1/step-100.pt", map_location="cpu")

See docs/ for the store URLs, transfer options and the commit guarantees.
"""

from __future__ import annotations

from . import errors
from .engine.async_save import SaveHandle, async_save, wait_all
from .engine.load import load
from .engine.save import SaveResult, save
from .options import TransferOptions, configure, get_defaults

__version__ = "0.1.0"

__all__ = [
    "SaveHandle",
    "SaveResult",
    "TransferOptions",
    "__version__",
    "async_save",
    "configure",
    "errors",
    "get_defaults",
    "load",
    "save",
    "wait_all",
]
