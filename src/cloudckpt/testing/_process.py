"""Run a local server as a subprocess on a free 127.0.0.1 port, and stop it again.

Shared by every kind of server in :mod:`cloudckpt.testing`: each gets a temporary
directory (its log ``server.log``, stdout and stderr together, and whatever data it
keeps), its own process group, a clean environment, and a place in a registry that
stops it when the interpreter exits.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

from ..errors import CloudCkptError

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0  # how long a server may take to answer HTTP
STOP_TIMEOUT_S = 10.0  # grace period between SIGTERM and SIGKILL
START_ATTEMPTS = 3  # retries if the chosen port got taken before the server bound it

_C = TypeVar("_C")  # a client type


class ServerStartError(CloudCkptError, OSError):
    """A server process exited early or never answered HTTP (the message has its log)."""


@dataclass
class LocalServer:
    """A server process on 127.0.0.1: its name and endpoint, then the handle to stop it.

    Only ``name`` and ``endpoint_url`` (and a subclass's connection fields) describe the
    server; the keyword-only fields are the handle :func:`stop` uses and are left out of
    ``repr`` and comparisons. ``with server:`` stops it on exit.
    """

    name: str
    endpoint_url: str
    workdir: Path | None = field(default=None, repr=False, compare=False, kw_only=True)
    log_path: Path | None = field(default=None, repr=False, compare=False, kw_only=True)
    process: subprocess.Popen[bytes] | None = field(
        default=None, repr=False, compare=False, kw_only=True
    )
    startup_s: float = field(default=0.0, repr=False, compare=False, kw_only=True)
    version: str = field(default="", repr=False, compare=False, kw_only=True)
    #: (pid, client) of :meth:`shared_client`: one per process, so a forked child never
    #: shares its parent's pooled connections.
    _shared: tuple[int, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for error messages."""
        return tail(self.log_path, lines)

    def log_offset(self) -> int:
        """The log's current size: where the lines of the next requests will start."""
        return self.log_path.stat().st_size if self.log_path is not None else 0

    def shared_client(self, make: Callable[[], _C]) -> _C:
        """The client ``make()`` returns, made once per server and process and reused.

        Making an SDK client costs far more than a request to a local server (boto3
        loads its service model: ~0.25 s), so bucket setup and checks share one. Two
        threads racing here at first use make two and keep one: harmless.
        """
        pid = os.getpid()
        shared = self._shared
        if shared is None or shared[0] != pid:
            shared = self._shared = (pid, make())
        return cast("_C", shared[1])

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stop(self)


_S = TypeVar("_S", bound=LocalServer)


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (or a placeholder when there is none)."""
    if path is None or not path.exists():
        return "<no log>"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "<empty log>"


def free_port() -> int:
    """A currently unused TCP port on 127.0.0.1 (the OS picks it).

    There is a small window between closing this socket and the server binding the
    port; :func:`start` retries with a new port if the server dies.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


_bucket_counter = itertools.count(1)
_SESSION_TAG = uuid.uuid4().hex[:8]  # distinguishes processes sharing one server


def unique_bucket_name(prefix: str = "ckpt") -> str:
    """A valid, unique bucket name: lowercase letters, digits and hyphens, at most 63."""
    return f"{prefix}-{_SESSION_TAG}-{next(_bucket_counter):05d}-{uuid.uuid4().hex[:6]}"


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for server subprocesses: no cloud, proxy or rclone settings leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "MOTO_", "RCLONE_", "AZURE_", "GOOGLE_"))
        and k not in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
        and k != "STORAGE_EMULATOR_HOST"
    }
    env.update(NO_PROXY="127.0.0.1,localhost", PYTHONUNBUFFERED="1", **(extra or {}))
    return env


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


def _wait_ready(server: LocalServer, port: int, timeout: float) -> None:
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


# Servers started by this process and not yet stopped, so an interpreter exit (a
# crashed test session, an uncaught error in a script) still takes them down.
_LIVE: list[LocalServer] = []
_LIVE_LOCK = threading.Lock()


def start(
    name: str,
    command: Callable[[int, Path], list[str]],
    make: Callable[..., _S],
    *,
    ready_timeout: float = READY_TIMEOUT_S,
    base_dir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> _S:
    """Run ``command(port, workdir)`` on a free port until it answers HTTP.

    ``make(endpoint_url=..., workdir=..., log_path=..., process=...)`` builds the server
    object. The temporary directory is created under ``base_dir`` (the system default
    when None). A process that exits before answering (most likely its port was taken
    in between) is retried on a new port; the directory, with server.log, is kept on
    failure.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"cloudckpt-{name}-", dir=base_dir))
    log_path = workdir / "server.log"
    last_error: ServerStartError | None = None
    for _attempt in range(START_ATTEMPTS):
        port = free_port()
        started = time.monotonic()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command(port, workdir),
                cwd=workdir,
                env=clean_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: a Ctrl-C in the terminal does not hit the server
                # mid-test, and stop() can signal the whole group.
                start_new_session=True,
            )
        endpoint_url = f"http://{HOST}:{port}"
        server = make(
            endpoint_url=endpoint_url, workdir=workdir, log_path=log_path, process=process
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


def _signal_group(process: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(process.pid, sig)  # pid == pgid thanks to start_new_session
        else:  # pragma: no cover - non-POSIX
            process.send_signal(sig)


def stop(server: LocalServer, *, remove_workdir: bool = True) -> None:
    """Terminate the server (SIGTERM, then SIGKILL after a grace period) and reap it.

    Waiting on the process reaps it, so no zombie is left behind. The temporary
    directory (data and log) is removed unless ``remove_workdir`` is false. Stopping a
    server twice is harmless.
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
