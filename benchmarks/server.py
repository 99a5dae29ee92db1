"""The benchmark's server: ``rclone serve s3`` on tmpfs, through :mod:`cloudckpt.testing`.

The data directory lives on ``/dev/shm`` (so the server's disk is not what is measured,
with the system's temporary directory as the fallback where there is no such tmpfs),
and the server logs at DEBUG level, where it writes one line per S3 request, so a worker
can count the requests it caused (``cloudckpt.testing.count_requests`` on the log,
before and after an operation).

Two rclone defaults are turned off because the server shares the machine's cores with
the clients being measured, and both would make it burn CPU per request that a real
object store spends on its own hardware:

- ``--etag-hash ''``: otherwise the server hashes each object (MD5) on its first read.
- ``--buffer-size 0``: otherwise every GET reads ahead of the range it serves (16 MiB
  per open file), which costs the server 0.9 ms of CPU per request even for one byte,
  2.2 ms for 1 MiB (0.3 and 0.9 without).
"""

from __future__ import annotations

import os

from cloudckpt.testing import S3Server, launch, stop

__all__ = ["S3Server", "start", "stop"]


def start(tmpfs: str = "/dev/shm", log_level: str = "DEBUG", etag_hash: str = "") -> S3Server:
    """Start ``rclone serve s3`` with its data under ``tmpfs``; return once it answers.

    ``etag_hash="MD5"`` gives rclone's default ETags back; ``log_level`` other than
    DEBUG stops request counting (and its logging cost), for studies that need neither.
    """
    return launch(
        "rclone",
        base_dir=tmpfs if os.path.isdir(tmpfs) else None,
        log_level=log_level,
        etag_hash=etag_hash,
        extra_args=("--buffer-size", "0"),
    )
