"""The test suite's servers: :mod:`cloudckpt.testing` with the repository's settings.

The launchers (moto, ``rclone serve s3``, the GCS emulator, Azurite) live in
``cloudckpt.testing``; this module re-exports what the tests import, installs Azurite
under ``.cache/node`` in the repository (git-ignored, so ``make test`` needs only
``npm``), and holds :class:`StoreTarget`, the ``store_url`` fixture's value, and
:func:`recorded_bucket`, a moto bucket behind a request-recording proxy.

Usage by hand (prints ``export K=V`` lines, then runs until killed)::

    python tests/servers.py rclone
    python tests/servers.py install-azurite   # what `make test` runs first
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from cloudckpt.testing import (
    AzureServer,
    GCSServer,
    S3Server,
    ServerStartError,
    free_port,
    start_server,
    stop,
    unique_bucket_name,
)
from cloudckpt.testing import emulators as _emulators
from cloudckpt.testing._cli import main as _main
from cloudckpt.testing.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    EMULATOR_NAMES,
    Emulator,
    EmulatorName,
)
from cloudckpt.testing.fault_proxy import FaultProxy
from cloudckpt.testing.s3 import SERVER_NAMES, ServerName, launch

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "EMULATOR_NAMES",
    "NODE_PREFIX",
    "SERVER_NAMES",
    "AzureServer",
    "Emulator",
    "EmulatorName",
    "GCSServer",
    "S3Server",
    "ServerName",
    "ServerStartError",
    "StoreTarget",
    "azurite_binary",
    "free_port",
    "launch",
    "launch_emulator",
    "main",
    "start_server",
    "stop",
    "unique_bucket_name",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_PREFIX = REPO_ROOT / ".cache" / "node"  # git-ignored; npm installs Azurite here


def azurite_binary() -> str:
    """Azurite's launcher under the repository's ``.cache/node``, installed on first use."""
    return _emulators.azurite_binary(NODE_PREFIX)


def launch_emulator(name: EmulatorName, **options: Any) -> Emulator:
    """:func:`cloudckpt.testing.launch_emulator`, with Azurite from ``.cache/node``."""
    options.setdefault("node_prefix", NODE_PREFIX)
    return _emulators.launch_emulator(name, **options)


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


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses the process ``pid`` listens on (a server must use 127.0.0.1)."""
    import psutil

    return [
        (c.laddr[0], c.laddr[1])
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]


@contextlib.contextmanager
def recorded_bucket(
    server: S3Server,
) -> Iterator[tuple[str, dict[str, str], list[tuple[str, str]]]]:
    """A fresh bucket on ``server`` reached through a proxy that records every request:
    (its name, storage options for the proxy, the list of (method, path) forwarded so
    far). The bucket is removed afterwards."""
    name = server.make_bucket(unique_bucket_name())
    seen: list[tuple[str, str]] = []

    def record(method: str, target: str) -> bool:
        seen.append((method, unquote(urlsplit(target).path)))
        return False  # inject nothing

    with FaultProxy(server.endpoint_url, match=record) as proxy:
        yield name, {**server.storage_options(), "endpoint_url": proxy.url}, seen
    with contextlib.suppress(Exception):
        server.remove_bucket(name)


def main(argv: list[str] | None = None) -> int:
    """``python tests/servers.py moto|rclone|gcs|azure|install-azurite``."""
    prog = f"python {os.path.relpath(__file__)}"
    return _main(argv, prog=prog, node_prefix=NODE_PREFIX)


if __name__ == "__main__":
    sys.exit(main())
