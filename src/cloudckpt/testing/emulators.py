"""Local cloud emulators: a GCS JSON API server and Azurite's blob service.

* ``gcs``   -- ``gcp-storage-emulator`` (PyPI), in memory; needs no credentials.
* ``azure`` -- Azurite's blob service (npm ``azurite``, installed on first use under
  a Node prefix, see :func:`azurite_binary`), in memory, with the well-known
  development account.

Both listen on a free port on 127.0.0.1 only.
"""

from __future__ import annotations

import functools
import http.client
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from ..errors import ConfigError
from ._process import HOST, LocalServer, start

EmulatorName = Literal["gcs", "azure"]
EMULATOR_NAMES: tuple[EmulatorName, ...] = ("gcs", "azure")

AZURITE_VERSION = "3.35.0"
# Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
GCS_PROJECT = "cloudckpt-test"


def _http_json(endpoint: str, method: str, path: str, body: Any = None) -> Any:
    """One JSON request to a local emulator; raise on an error status."""
    conn = http.client.HTTPConnection(urlsplit(endpoint).netloc, timeout=10)
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


@dataclass
class GCSServer(LocalServer):
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
        listing = _http_json(self.endpoint_url, "GET", f"/storage/v1/b/{name}/o") or {}
        for item in listing.get("items", []):
            obj = quote(item["name"], safe="")
            _http_json(self.endpoint_url, "DELETE", f"/storage/v1/b/{name}/o/{obj}")
        _http_json(self.endpoint_url, "DELETE", f"/storage/v1/b/{name}")


@dataclass
class AzureServer(LocalServer):
    """Azurite's blob service (in memory) with the well-known development account."""

    account: str = AZURITE_ACCOUNT
    account_key: str = field(default=AZURITE_KEY, repr=False)

    def connection_string(self) -> str:
        """The Azure connection string for this emulator's account."""
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
        """An ``azure.storage.blob.BlobServiceClient`` for this emulator: the same one for
        every call in a process (its connection pool is reused)."""
        return self.shared_client(self._new_client)

    def _new_client(self) -> Any:
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            raise ConfigError(
                "AzureServer.client() needs the Azure SDK: pip install azure-storage-blob"
            ) from None
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


def default_node_prefix() -> Path:
    """Where npm installs Azurite unless told otherwise: the user's cache directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cloudckpt" / "node"


def azurite_binary(node_prefix: str | os.PathLike[str] | None = None) -> str:
    """Path of Azurite's blob-only launcher, installing npm ``azurite`` on first use.

    The package goes under ``node_prefix`` (default :func:`default_node_prefix`), so
    only ``npm`` on PATH and the npm registry are needed.
    """
    prefix = Path(node_prefix) if node_prefix is not None else default_node_prefix()
    launcher = prefix / "node_modules" / ".bin" / "azurite-blob"
    if launcher.exists():
        return str(launcher)
    npm = shutil.which("npm")
    if npm is None:
        raise ConfigError("npm not found: Azurite (npm azurite) needs Node.js and npm")
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
         "--loglevel", "error", f"azurite@{AZURITE_VERSION}"],
        check=True, stdin=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    if not launcher.exists():
        raise ConfigError(f"npm install azurite did not create {launcher}")
    return str(launcher)


def _gcs_command(port: int, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "gcp_storage_emulator", "start",
            "--host", HOST, "--port", str(port), "--in-memory"]  # fmt: skip


def _azure_command(port: int, workdir: Path, *, binary: str) -> list[str]:
    return [
        binary, "--blobHost", HOST, "--blobPort", str(port),
        "--inMemoryPersistence",  # its working files go to the cwd, workdir
        "--disableTelemetry", "--skipApiVersionCheck", "--loose",
    ]  # fmt: skip


def launch_emulator(
    name: EmulatorName,
    *,
    ready_timeout: float = 60.0,
    node_prefix: str | os.PathLike[str] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> Emulator:
    """Start emulator ``name`` (``"gcs"`` or ``"azure"``); return once it answers HTTP.

    The caller owns it and must :func:`~cloudckpt.testing.stop` it (or use ``with``).
    Azurite is installed under ``node_prefix`` on first use (see :func:`azurite_binary`).
    """
    if name == "gcs":
        if importlib.util.find_spec("gcp_storage_emulator") is None:
            raise ConfigError(
                "the GCS emulator needs gcp-storage-emulator: pip install gcp-storage-emulator"
            )
        version = f"gcp-storage-emulator {importlib.metadata.version('gcp-storage-emulator')}"
        make = functools.partial(GCSServer, name=name, version=version)
        return start(name, _gcs_command, make, ready_timeout=ready_timeout, base_dir=base_dir)
    if name == "azure":
        command = functools.partial(_azure_command, binary=azurite_binary(node_prefix))
        make_azure = functools.partial(AzureServer, name=name, version=f"azurite {AZURITE_VERSION}")
        return start(name, command, make_azure, ready_timeout=ready_timeout, base_dir=base_dir)
    raise ConfigError(f"unknown emulator {name!r}; expected one of {EMULATOR_NAMES}")
