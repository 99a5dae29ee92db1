"""``rclone serve s3`` on tmpfs for the benchmark, and request counting from its log.

The data directory lives on ``/dev/shm`` (so the server's disk is not what is measured);
the server logs at DEBUG level, where it writes one line per S3 request, so a worker
can count the requests it caused by reading the log before and after an operation.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import free_port, rclone_binary

HOST = "127.0.0.1"
ACCESS_KEY = "cloudckpt-bench-access"
SECRET_KEY = "cloudckpt-bench-secret"
REGION = "us-east-1"
READY_TIMEOUT_S = 30.0
#: rclone's DEBUG log writes one "serve s3: <operation>" line per S3 request (plus detail
#: lines for listings, which the pattern leaves out). ListBuckets is not logged.
REQUEST_LINE = re.compile(
    rb"serve s3: (CREATE OBJECT|GET OBJECT|HEAD OBJECT|DELETE|LIST BUCKET|"
    rb"initiate multipart|put multipart|complete multipart|abort multipart|list multipart)",
    re.IGNORECASE,
)


@dataclass
class Server:
    endpoint: str
    workdir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    version: str

    def env(self) -> dict[str, str]:
        """Standard AWS variables for peers configured from the environment (s3fs)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def storage_options(self) -> dict[str, str]:
        """cloudckpt's ``storage_options`` for this server."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
            "region_name": REGION,
        }

    def make_bucket(self, name: str) -> None:
        (self.workdir / "data" / name).mkdir(parents=True, exist_ok=True)


def _answers(port: int) -> bool:
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


def start(tmpfs: str = "/dev/shm", log_level: str = "DEBUG", etag_hash: str = "") -> Server:
    """Start ``rclone serve s3`` with its data on ``tmpfs``; return once it answers HTTP.

    ``etag_hash=""`` turns off rclone's MD5 ETags: otherwise the server hashes each object
    on its first read, on the same (small) machine as the client being measured. Real S3
    does that on its own hardware. Pass ``"MD5"`` for rclone's default.

    ``--buffer-size 0`` turns off rclone's read-ahead: with its default (16 MiB per open
    file) every GET makes the server read ahead of the range it serves, which costs it
    0.9 ms of CPU per request even for one byte, 2.2 ms for 1 MiB (0.3 and 0.9 without),
    on the cores the clients being measured share. Real object stores pay their own
    serving costs on their own machines.
    """
    rclone = rclone_binary()
    version = subprocess.run([rclone, "version"], capture_output=True, text=True, check=True)
    base = tmpfs if os.path.isdir(tmpfs) else None
    workdir = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-", dir=base))
    (workdir / "data").mkdir()
    (workdir / "rclone.conf").touch()
    port = free_port()
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                rclone, "serve", "s3",
                "--config", str(workdir / "rclone.conf"),
                "--cache-dir", str(workdir / "cache"),
                "--addr", f"{HOST}:{port}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}",
                "--log-level", log_level,
                "--etag-hash", etag_hash,
                "--buffer-size", "0",
                f":local:{workdir / 'data'}",
            ],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = Server(f"http://{HOST}:{port}", workdir, log_path, process,
                    version.stdout.splitlines()[0])  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    delay = 0.02
    while not _answers(port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"rclone serve s3 did not start; log:\n{log_path.read_text()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    return server


def stop(server: Server) -> None:
    """Terminate the server's process group and remove its tmpfs directory."""
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)
    shutil.rmtree(server.workdir, ignore_errors=True)


def log_offset(path: str | Path) -> int:
    """The log's current size: where the next operation's lines will start."""
    return os.path.getsize(path)


def count_requests(path: str | Path, since: int) -> int:
    """S3 requests the server logged after byte offset ``since``."""
    with open(path, "rb") as f:
        f.seek(since)
        return len(REQUEST_LINE.findall(f.read()))
