"""cloudckpt: save and load PyTorch checkpoints straight to object storage and filesystems.

    import cloudckpt
    cloudckpt.save(model.state_dict(), "s3://bucket/run1/step-100.pt")
    state = cloudckpt.load("s3://bucket/run1/step-100.pt", map_location="cpu")
    cloudckpt.save_safetensors(model.state_dict(), "s3://bucket/hf/", max_shard_size="5GB")
    cloudckpt.export_safetensors("s3://bucket/run1/step-100", "s3://bucket/hf/", dtype="bf16")

See docs/ for the store URLs, transfer options and the commit guarantees. Names that
need torch are imported on first use, so ``import cloudckpt`` (and the command line)
start fast.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import errors, redact
from ._lazy import imported, lazy_attributes
from .options import TransferOptions, configure, get_defaults

if TYPE_CHECKING:
    from ._runtime import set_fast_paths
    from .dcp.export import ExportResult, export_safetensors
    from .engine.async_save import async_save
    from .engine.handle import SaveHandle, wait_all
    from .engine.load import load
    from .engine.safetensors import load_safetensors, save_safetensors
    from .engine.save import SaveResult, save
    from .format.torch.unpickle import set_unpickler
    from .io.buffers import release_buffers
    from .manager import CheckpointInfo, CheckpointManager

from ._version import __version__

# Every module logs to "cloudckpt": whatever handlers an application sets up, no record
# of ours carries a secret (the CLI's -v also filters the SDKs' records: cli/main.py).
logging.getLogger(__name__).addFilter(redact.RedactingFilter())

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "ExportResult",
    "SaveHandle",
    "SaveResult",
    "TransferOptions",
    "__version__",
    "async_save",
    "configure",
    "errors",
    "export_safetensors",
    "get_defaults",
    "load",
    "load_safetensors",
    "release_buffers",
    "save",
    "save_safetensors",
    "set_fast_paths",
    "set_unpickler",
    "wait_all",
]

_LAZY = {
    "CheckpointInfo": ".manager",
    "CheckpointManager": ".manager",
    "ExportResult": ".dcp.export",
    "export_safetensors": ".dcp.export",
    "SaveHandle": ".engine.handle",
    "async_save": ".engine.async_save",
    "wait_all": ".engine.handle",
    "load": ".engine.load",
    "load_safetensors": ".engine.safetensors",
    "save_safetensors": ".engine.safetensors",
    "release_buffers": ".io.buffers",
    "SaveResult": ".engine.save",
    "save": ".engine.save",
    "set_fast_paths": "._runtime",
    "set_unpickler": ".format.torch.unpickle",
}


__getattr__, __dir__ = lazy_attributes(
    globals(), {name: imported(module, __name__, name) for name, module in _LAZY.items()}, __all__
)
