"""Ray Train checkpoints written, committed and read by cloudckpt; Ray only told.

    import cloudckpt.ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_func(config):
        state = cloudckpt.ray.restore()  # the newest committed step of this run, or None
        ...
        cloudckpt.ray.report({"loss": loss}, state, step=step)  # on every worker

    fs, path = cloudckpt.ray.storage("s3://bucket/ray-runs")
    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run1", storage_path=path, storage_filesystem=fs))

Order of one :func:`report` (every worker calls it with the same ``step``):

1. the run's :class:`~cloudckpt.CheckpointManager` (its root is Ray's experiment folder,
   ``storage_path/name``) saves ``state`` as ``step-N/`` and commits it with its marker
   (``kind="object"``: rank 0 writes one ``torch.save`` archive, the state of a DDP
   run; ``kind="dcp"``: every rank writes its shards of a DCP state dict);
2. ``ray.train.report(metrics, checkpoint=Checkpoint(step-N), checkpoint_upload_mode=
   NO_UPLOAD)`` on every rank, the same committed folder (Ray keeps rank 0's metrics);
   Ray copies nothing.

So Ray's checkpoint manager, ``ray.train.get_checkpoint()``, ``Result.checkpoint`` and
``CheckpointConfig(num_to_keep=...)`` see each step, and ``cloudckpt ls``/``verify``/
``latest`` see the same folders. Retention is Ray's: ``num_to_keep`` deletes the step
folders Ray drops (the newest is never dropped), through the filesystem :func:`storage`
returns, which removes a step's marker first; cloudckpt deletes nothing of a Ray run,
since a new ``fit()`` refuses a run whose snapshot names a folder that is gone
(docs/integrations.md, "Ray Train").

:func:`restore` (every worker) reads the newest committed step under the run's root
through cloudckpt's reader (checked, ``weights_only``), never through Ray's download;
a step written but never committed (a worker killed mid-save) is not seen.

``ray`` is imported inside the functions (pyarrow, where installed, on import, for the
filesystem wrapper): this module imports without either.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError, NotFoundError
from .manager import MARKER_NAME, CheckpointInfo, CheckpointManager
from .options import TransferOptions

try:  # with Ray Train (pyarrow is among its requirements); this module imports without
    from pyarrow.fs import FileSystemHandler as _Handler
except ImportError:  # pragma: no cover - without Ray
    _Handler = object  # type: ignore[assignment, misc]

__all__ = ["report", "restore", "run_url", "storage"]

log = logging.getLogger("cloudckpt")

#: The URL scheme of each pyarrow filesystem cloudckpt has a store for (``type_name``).
_SCHEMES = {"s3": "s3", "gcs": "gs"}

#: A step folder of the manager (``.../step-N``).
_STEP = re.compile(r"/step-(\d+)$")

#: This worker's managers, one per (run root, kind): a restore and the saves after it
#: share one (the restored step is never pruned; markers already read are cached).
_managers: dict[tuple[str, str, str], CheckpointManager] = {}


def _require_ray() -> Any:
    """The ``ray.train`` package (ImportError naming the extra when it is missing)."""
    try:
        import ray.train
    except ImportError as exc:
        raise ImportError("cloudckpt.ray needs Ray Train (pip install 'ray[train]')") from exc
    return ray.train


class _MarkerFirst(_Handler):  # type: ignore[misc, valid-type]
    """A pyarrow filesystem handler over another filesystem (``fs``) whose
    ``delete_dir`` removes a checkpoint's marker before the rest of its folder, so Ray's
    retention (``num_to_keep``) uncommits a step before deleting it, as cloudckpt's own
    retention does; everything else is ``fs``'s. Picklable (Ray sends it to workers)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MarkerFirst) and bool(self.fs.equals(other.fs))

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self), self.fs.type_name))

    def get_type_name(self) -> str:
        return f"cloudckpt+{self.fs.type_name}"

    def normalize_path(self, path: str) -> str:
        return str(self.fs.normalize_path(path))

    def get_file_info(self, paths: Any) -> Any:
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> Any:
        return self.fs.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        import pyarrow.fs

        marker = f"{path.rstrip('/')}/{MARKER_NAME}"
        if self.fs.get_file_info(marker).type == pyarrow.fs.FileType.File:
            self.fs.delete_file(marker)  # uncommitted first: never a partial step
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.fs.open_append_stream(path, metadata=metadata)


def _unwrap(fs: Any) -> Any:
    """The filesystem under :func:`storage`'s marker-first wrapper (else ``fs``)."""
    handler = getattr(fs, "handler", None)
    return handler.fs if isinstance(handler, _MarkerFirst) else fs


def storage(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    filesystem: Any = None,
) -> tuple[Any, str]:
    """``(storage_filesystem, storage_path)`` for ``RunConfig`` from an ``s3://`` URL.

    Ray needs a pyarrow filesystem rooted at the bucket and a path without the scheme
    (it turns ``s3://`` into ``s3:/``). The filesystem uses the endpoint and region
    cloudckpt would (``storage_options`` ``endpoint_url``/``region_name``, else
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` and ``AWS_REGION``), and keys given in
    ``storage_options``, else the standard chain. The filesystem is pickled to every
    worker, where :func:`report` and :func:`restore` take the same endpoint, region
    and keys from it. ``filesystem``: a pyarrow filesystem of your own to use instead
    (any scheme; ``url`` then gives the path alone).

    Either way it is wrapped so that Ray's retention deletes a step's marker before
    the rest of its folder (a ``PyFileSystem``: its ``type_name`` is ``py::cloudckpt+s3``).
    """
    try:
        import pyarrow.fs
    except ImportError as exc:
        raise ImportError("cloudckpt.ray needs Ray Train (pip install 'ray[train]')") from exc

    parts = urlsplit(url)
    path = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    if filesystem is not None:
        if not parts.scheme or not parts.netloc:
            raise ConfigError(f"cloudckpt.ray.storage({url!r}) takes a scheme://bucket/prefix URL")
        return pyarrow.fs.PyFileSystem(_MarkerFirst(_unwrap(filesystem))), path
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(
            f"cloudckpt.ray.storage({url!r}) takes an s3://bucket/prefix URL; for other "
            "stores give RunConfig a pyarrow filesystem of your own"
        )
    opts = dict(storage_options or {})
    kwargs: dict[str, Any] = {}
    endpoint = (
        opts.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        where = urlsplit(endpoint)
        kwargs["endpoint_override"] = where.netloc or endpoint
        kwargs["scheme"] = where.scheme or "https"
    region = opts.get("region_name") or os.environ.get("AWS_REGION")
    if region:
        kwargs["region"] = region
    if opts.get("aws_access_key_id"):
        kwargs["access_key"] = opts["aws_access_key_id"]
        kwargs["secret_key"] = opts.get("aws_secret_access_key")
        if opts.get("aws_session_token"):
            kwargs["session_token"] = opts["aws_session_token"]
    return pyarrow.fs.PyFileSystem(_MarkerFirst(pyarrow.fs.S3FileSystem(**kwargs))), path


def _filesystem_options(fs: Any) -> dict[str, Any]:
    """cloudckpt storage options matching a pyarrow ``S3FileSystem`` (its endpoint,
    region and explicit keys, read from what pickling it would carry); empty for any
    other filesystem."""
    fs = _unwrap(fs)
    if getattr(fs, "type_name", None) != "s3":
        return {}
    try:
        (settings,) = fs.__reduce__()[1]
    except (TypeError, ValueError):
        return {}
    opts: dict[str, Any] = {}
    if settings.get("endpoint_override"):
        endpoint = settings["endpoint_override"]
        if "://" not in endpoint:
            endpoint = f"{settings.get('scheme') or 'https'}://{endpoint}"
        opts["endpoint_url"] = endpoint
    if settings.get("region"):
        opts["region_name"] = settings["region"]
    if settings.get("access_key"):
        opts["aws_access_key_id"] = settings["access_key"]
        opts["aws_secret_access_key"] = settings.get("secret_key")
        if settings.get("session_token"):
            opts["aws_session_token"] = settings["session_token"]
    return opts


def _run_storage() -> tuple[Any, str]:
    """This run's ``(storage_filesystem, experiment_fs_path)`` (inside a ``train_func``)."""
    train = _require_ray()
    try:
        context = train.get_context()
        where = context.get_storage()
    except (RuntimeError, AttributeError) as exc:
        raise ConfigError(f"call cloudckpt.ray inside a Ray Train train_func ({exc})") from exc
    return where.storage_filesystem, str(where.experiment_fs_path).rstrip("/")


def run_url() -> str:
    """The URL of this run's folder (``storage_path/name``) as cloudckpt names it:
    ``s3://bucket/...`` or ``gs://...`` for Ray's S3 and GCS filesystems, the path
    itself for the local one; the root of the run's :class:`~cloudckpt.CheckpointManager`
    (``cloudckpt ls URL``). Inside a ``train_func`` only."""
    fs, path = _run_storage()
    kind = getattr(_unwrap(fs), "type_name", "")
    if kind == "local":
        return path
    scheme = _SCHEMES.get(kind)
    if scheme is None:
        raise ConfigError(
            f"cloudckpt.ray cannot name a URL for Ray's {kind!r} filesystem at {path}: "
            "use an S3 (cloudckpt.ray.storage), GCS or local storage_path"
        )
    return f"{scheme}://{path}"


def _manager(
    kind: str,
    filename: str,
    options: TransferOptions | None,
    storage_options: Mapping[str, Any] | None,
    overrides: Mapping[str, Any],
) -> tuple[CheckpointManager, Any]:
    """This run's manager (made once per worker) and Ray's filesystem."""
    fs, _ = _run_storage()
    url = run_url()
    key = (url, kind, filename)
    manager = _managers.get(key)
    if manager is None:
        settings = dict(overrides)
        if storage_options is not None:
            settings["storage_options"] = dict(storage_options)
        elif options is None or not options.storage_options:
            derived = _filesystem_options(fs)
            if derived:
                settings["storage_options"] = derived
        manager = CheckpointManager(url, kind=kind, filename=filename, options=options, **settings)
        _managers[key] = manager
    return manager, fs


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics (the marker records numbers only)."""
    return {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def report(
    metrics: Mapping[str, Any],
    state: Any,
    *,
    step: int,
    kind: str = "object",
    filename: str = "state.pt",
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> CheckpointInfo:
    """Save ``state`` as checkpoint ``step`` of this run, commit it, then
    ``ray.train.report(metrics, checkpoint=...)`` the committed folder; on every worker,
    in place of ``ray.train.report``. Returns the committed :class:`CheckpointInfo`.

    ``kind="object"``: ``state`` is the same on every rank (DDP); rank 0 writes it.
    ``kind="dcp"``: every rank writes its part of a DCP state dict (FSDP, TP).
    ``storage_options`` default to the endpoint, region and keys of Ray's S3
    filesystem; ``options`` and other keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields. A save that fails raises on every
    worker before anything is reported (Ray's ``FailureConfig`` then restarts the run).
    """
    train = _require_ray()
    from ray.train import CheckpointUploadMode

    manager, fs = _manager(kind, filename, options, storage_options, overrides)
    info = manager.save(step, state, metrics=_numbers(metrics))
    # The same Checkpoint from every rank (Ray takes one; each rank's get_checkpoint()
    # then names it).
    checkpoint = train.Checkpoint(path=_fs_path(info.url), filesystem=fs)
    train.report(
        dict(metrics),
        checkpoint=checkpoint,
        checkpoint_dir_name=_fs_path(info.url).rsplit("/", 1)[-1],
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )
    return info


def _fs_path(url: str) -> str:
    """The path on Ray's filesystem of a cloudckpt URL (no scheme, no trailing ``/``)."""
    parts = urlsplit(url)
    if parts.scheme in _SCHEMES.values():
        return f"{parts.netloc}{parts.path}".rstrip("/")
    if parts.scheme == "file":  # the local store names its folders file:///...
        return parts.path.rstrip("/")
    return url.rstrip("/")


def restore(
    *,
    state: Any = None,
    map_location: Any = None,
    weights_only: bool = True,
    kind: str = "object",
    filename: str = "state.pt",
    options: TransferOptions | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Any:
    """The newest committed checkpoint of this run, read by cloudckpt (every worker):
    ``kind="object"`` returns the saved object; ``kind="dcp"`` loads into ``state``
    in place and returns it. None on a run with nothing committed yet, so a first
    start and a restart (``FailureConfig(max_failures=...)``, or a new ``fit()`` with
    the same ``RunConfig(name=...)``) run the same code.

    What Ray says to resume from (``ray.train.get_checkpoint()``) is compared, never
    downloaded: the newest committed step is restored even when Ray never heard of it
    (the worker died between the commit and Ray's taking the report), and every such
    step is reported to Ray here, oldest first (a ``ray.train.report`` with the
    metrics its marker recorded, on every worker), so Ray's retention covers it.
    """
    train = _require_ray()
    from ray.train import CheckpointUploadMode

    manager, fs = _manager(kind, filename, options, storage_options, overrides)
    committed = manager.list()
    told = train.get_checkpoint()
    told_step = -1
    if told is not None:
        told_step = _told_step(told.path, manager)
        if not committed:
            raise NotFoundError(
                f"Ray resumes this run from {told.path}, but no committed checkpoint "
                f"is under {manager.root_url}: was it written by cloudckpt.ray.report?"
            )
    if not committed:
        return manager.restore(state=state, map_location=map_location, weights_only=weights_only)
    latest = committed[-1]
    if latest.step != told_step:
        log.info(
            "ray: restoring step %d from %s (Ray's latest reported checkpoint: %s)",
            latest.step,
            latest.url,
            told.path if told is not None else "none",
        )
    result = manager.restore(
        latest.step, state=state, map_location=map_location, weights_only=weights_only
    )
    # Steps committed but never reported (the worker died before Ray heard of them)
    # are reported now, oldest first, so Ray's retention and get_checkpoint() see them.
    for info in committed:
        if info.step > told_step:
            path = _fs_path(info.url)
            train.report(
                dict(info.metrics),
                checkpoint=train.Checkpoint(path=path, filesystem=fs),
                checkpoint_dir_name=path.rsplit("/", 1)[-1],
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
    return result


def _told_step(path: str, manager: CheckpointManager) -> int:
    """The step of the checkpoint Ray resumes from (a folder of this run's manager);
    ConfigError for any other checkpoint (``resume_from_checkpoint`` of another run)."""
    found = _STEP.search(path.rstrip("/"))
    root = _fs_path(manager.root_url)
    parent = path.rstrip("/").rsplit("/", 1)[0]
    if found is None or parent != root:
        raise ConfigError(
            f"Ray resumes from {path}, which is not a cloudckpt.ray checkpoint of this run "
            f"({manager.root_url}): resume_from_checkpoint is not supported by cloudckpt.ray"
        )
    return int(found.group(1))
