"""Point PyTorch's own DCP tests at cloudckpt: adapters, the patch, and a pytest plugin.

``torch_dcp_suite.py`` runs torch's test modules with ``CLOUDCKPT_TORCH_DCP_MODE`` set and
``torch_dcp_site/`` on ``PYTHONPATH``, whose ``sitecustomize`` calls :func:`install_from_env`
at interpreter start: in pytest's process and in every rank that ``MultiProcessTestCase``
spawns (the ranks re-import the test module, so the patch must precede that import).
Loaded with ``pytest -p torch_dcp_patch`` the module also checks the patch is in effect and
replaces the classes in each collected test module's namespace.

Modes: ``torch`` (nothing patched: the baseline), ``cloudckpt`` (writer and reader),
``writer`` (cloudckpt writes, torch's FileSystemReader reads), ``reader`` (the reverse).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _storage_utils, filesystem, format_utils
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

MODE_ENV = "CLOUDCKPT_TORCH_DCP_MODE"
UNGATE_ENV = "CLOUDCKPT_TORCH_DCP_UNGATE_GPU"
WEIGHTS_ONLY_ENV = "CLOUDCKPT_TORCH_DCP_WEIGHTS_ONLY"
LOG_ENV = "CLOUDCKPT_TORCH_DCP_LOG"
MODES = ("torch", "cloudckpt", "writer", "reader")

TorchWriter = filesystem.FileSystemWriter
TorchReader = filesystem.FileSystemReader
#: Modules whose ``FileSystemWriter``/``FileSystemReader`` names DCP's tests reach: the
#: package (``dcp.FileSystemWriter``, ``from torch.distributed.checkpoint import ...``),
#: ``checkpoint_id=`` auto-detection, and dcp_to_torch_save / torch_save_to_dcp.
#: ``filesystem`` itself keeps torch's classes (FsspecWriter and the HF writers subclass them).
PATCHED_MODULES = (dcp, _storage_utils, format_utils)


def _log(event: str) -> None:
    """One line per adapter use, so the suite can show the patch reached every process."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {event}\n")


class CloudFileSystemWriter(CloudStorageWriter, BlockingAsyncStager):
    """``FileSystemWriter``'s signature over :class:`CloudStorageWriter`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = filesystem.SerializationFormat.TORCH_SAVE,
    ) -> None:
        # single_file_per_rank: ignored. cloudckpt always writes `files_per_rank` objects
        # per rank; False (one file per item) only changes the file layout, which readers
        # take from .metadata.
        # sync_files: ignored. The local store always fsyncs each object and its directory
        # before renaming it into place (store/local.py); object stores are durable on PUT.
        # thread_count: mapped to files_per_rank, the same idea (that many data files per
        # rank, written concurrently).
        # per_thread_copy_ahead: ignored. cloudckpt copies a device tensor to the host
        # right before it is written, bounded by max_bytes_in_flight.
        # overwrite: mapped as is (False refuses a URL holding a committed checkpoint).
        super().__init__(path, files_per_rank=max(1, int(thread_count)), overwrite=overwrite)
        # cache_staged_state_dict: mapped by inheriting torch's BlockingAsyncStager, as
        # FileSystemWriter does, so dcp.async_save stages through this writer.
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        # _extensions: ignored, with a warning. CloudStorageWriter has no stream
        # extensions (it writes plain torch.save archives); the data round-trips unchanged
        # but is not compressed/transformed. The `reader` mode covers decoding them.
        if _extensions:
            names = [type(e).__name__ for e in _extensions]
            warnings.warn(f"cloudckpt adapter: _extensions={names} ignored", stacklevel=2)
            _log(f"writer-extensions-ignored {names}")
        # serialization_format: only TORCH_SAVE, the format cloudckpt writes.
        if serialization_format != filesystem.SerializationFormat.TORCH_SAVE:
            raise NotImplementedError(
                f"cloudckpt adapter: serialization_format={serialization_format} "
                "(CloudStorageWriter writes torch.save archives only)"
            )
        _log("writer")


class CloudFileSystemReader(CloudStorageReader):
    """``FileSystemReader``'s signature over :class:`CloudStorageReader`."""

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None) -> None:
        # _extension_registry: mapped to extension_registry (decodes stream extensions).
        # weights_only: cloudckpt's default (True) unless the suite passes
        # --reader-weights-only=false; FileSystemReader has no such check.
        weights_only = os.environ.get(WEIGHTS_ONLY_ENV, "1") != "0"
        super().__init__(path, weights_only=weights_only, extension_registry=_extension_registry)
        _log("reader")


def replacements(mode: str) -> dict[str, type]:
    """Names to replace in each module for ``mode``: {'FileSystemWriter': adapter, ...}."""
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {MODES}")
    out: dict[str, type] = {}
    if mode in ("cloudckpt", "writer"):
        out["FileSystemWriter"] = CloudFileSystemWriter
    if mode in ("cloudckpt", "reader"):
        out["FileSystemReader"] = CloudFileSystemReader
    return out


def patch_namespace(module: ModuleType, mode: str) -> None:
    """Replace torch's classes in ``module`` wherever it holds them, by any name."""
    originals = {"FileSystemWriter": TorchWriter, "FileSystemReader": TorchReader}
    for name, adapter in replacements(mode).items():
        for attr, value in list(vars(module).items()):
            if value is originals[name]:
                setattr(module, attr, adapter)


def _ungate_gpu_skips() -> None:
    """Run tests gated only by ``skip_if_lt_x_gpu`` on CPU (gloo), as ``allow_cpu=True``
    does; a test that really needs a device then fails with torch's own classes too."""
    from torch.testing._internal import common_distributed

    original = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True) -> Any:
        return original(x, allow_cpu=allow_cpu)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _patch_spawned_ranks(mode: str) -> None:
    """A spawned rank imports the test module by name; patch its namespace there too."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    run = MultiProcessTestCase._run.__func__  # type: ignore[attr-defined]

    def _run(cls: type, *args: Any, **kwargs: Any) -> None:
        patch_namespace(sys.modules[cls.__module__], mode)
        run(cls, *args, **kwargs)

    MultiProcessTestCase._run = classmethod(_run)  # type: ignore[method-assign,assignment]


def install(mode: str, *, ungate_gpu: bool = False) -> None:
    """Apply ``mode``'s patches (before any test module is imported)."""
    for module in PATCHED_MODULES:
        patch_namespace(module, mode)
    if ungate_gpu:
        _ungate_gpu_skips()
    if mode != "torch":
        _patch_spawned_ranks(mode)


def install_from_env() -> None:
    """Called by ``torch_dcp_site/sitecustomize.py`` when :data:`MODE_ENV` is set."""
    install(os.environ[MODE_ENV], ungate_gpu=os.environ.get(UNGATE_ENV) == "1")


# -- pytest plugin (``-p torch_dcp_patch``) ----------------------------------------------
def pytest_sessionstart(session: Any) -> None:
    """Fail fast if sitecustomize did not patch this process as the mode says."""
    mode = os.environ.get(MODE_ENV, "torch")
    want = {"FileSystemWriter": TorchWriter, "FileSystemReader": TorchReader}
    want.update(replacements(mode))
    got = {name: getattr(dcp, name) for name in want}
    if got != want:
        raise RuntimeError(f"torch_dcp_patch: mode {mode!r} expects {want}, found {got}")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Replace the classes in every collected test module's namespace."""
    mode = os.environ.get(MODE_ENV, "torch")
    for module in {id(m): m for m in (getattr(i, "module", None) for i in items) if m}.values():
        patch_namespace(module, mode)
