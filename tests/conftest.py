"""Shared pytest fixtures: local S3 servers and storage targets.

Fixtures
--------
``moto_server`` (session)   -- a moto S3 server subprocess (:class:`servers.S3Server`).
``rclone_server`` (session) -- an ``rclone serve s3`` subprocess over a temp dir.
``s3_server`` (function, params ``moto``/``rclone``) -- one of the two above.
``gcs_server`` (session)    -- ``gcp-storage-emulator`` (:class:`servers.GCSServer`).
``azure_server`` (session)  -- Azurite's blob service (:class:`servers.AzureServer`);
    npm ``azurite`` is installed under ``.cache/node`` on first use.
``store_url`` (function, params ``file``/``moto``/``rclone``/``gcs``/``azure``) -- a
    fresh, empty :class:`StoreTarget`: a temp directory as ``file://`` URL, or a new
    bucket as ``s3://``, ``gs://`` or ``az://<bucket>`` with the server's
    ``storage_options``. The store contract adds ``memory`` (:func:`make_target`).

Servers start lazily, i.e. only when a collected test actually needs them, and
are stopped at the end of the session. Each test is marked with the servers it needs
(``moto``, ``rclone``, ``gcs``, ``azure``: by its fixtures, or a parameter naming the
server), so ``pytest -m "not rclone and not gcs and not azure"`` runs what needs none
of those (``make test-fast``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import (
    Emulator,
    S3Server,
    StoreTarget,
    launch,
    launch_emulator,
    stop,
    unique_bucket_name,
)

# StoreTarget and unique_bucket_name live in servers.py (import them from there: a
# nested conftest.py can shadow this module's name); re-exported here for old imports.
from silent import SilentServer

__all__ = ["StoreTarget", "unique_bucket_name"]

# ------------------------------------------------------------- environment hygiene

# AWS variables that must not leak in from the developer's shell: they could
# point boto3/botocore at a real account, profile, endpoint or role.
_AWS_ENV_PREFIXES = ("AWS_",)
_EXTRA_ENV_TO_DROP = ("BOTO_CONFIG", "BOTO_PATH", "STORAGE_EMULATOR_HOST", "API_ENDPOINT_OVERRIDE")
# Google and Azure settings that could reach a real project or account.
_CLOUD_ENV_PREFIXES = ("GOOGLE_", "CLOUDSDK_", "AZURE_", "GCE_")


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Strip AWS credentials/config from the environment for the whole session.

    * every ``AWS_*`` variable is removed (``AWS_PROFILE``, keys, session token,
      ``AWS_ENDPOINT_URL*``, role/web-identity settings, ...);
    * ``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE`` point at files that
      do not exist, so ``~/.aws/config`` and ``~/.aws/credentials`` are ignored;
    * ``AWS_EC2_METADATA_DISABLED=true`` stops botocore probing the instance
      metadata service for credentials;
    * ``GOOGLE_*``, ``CLOUDSDK_*``, ``AZURE_*`` and ``STORAGE_EMULATOR_HOST`` are
      removed too; gcloud's config dir points nowhere and ``NO_GCE_CHECK`` stops
      google-auth probing the GCE metadata server;
    * 127.0.0.1 is added to ``NO_PROXY`` so a shell proxy is never used for
      the local servers.

    Tests therefore have to pass credentials explicitly (``storage_options``)
    or set them with ``monkeypatch.setenv(...)`` from ``S3Server.env()``.
    Everything is restored when the session ends.
    """
    mp = pytest.MonkeyPatch()
    for key in list(os.environ):
        if key.startswith(_AWS_ENV_PREFIXES + _CLOUD_ENV_PREFIXES) or key in _EXTRA_ENV_TO_DROP:
            mp.delenv(key)
    nowhere = tmp_path_factory.mktemp("aws-home") / "does-not-exist"
    mp.setenv("AWS_CONFIG_FILE", str(nowhere))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # google-auth: no gcloud login file, no metadata-server probe.
    mp.setenv("CLOUDSDK_CONFIG", str(nowhere))
    mp.setenv("NO_GCE_CHECK", "True")
    for key in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(key, "")
        mp.setenv(key, ",".join(filter(None, [current, "127.0.0.1", "localhost"])))
    try:
        yield
    finally:
        mp.undo()


# ----------------------------------------------------------------- markers by server

#: The servers a test can need; each is also a marker (``-m "not rclone"``).
SERVER_MARKERS = ("moto", "rclone", "gcs", "azure")


def pytest_configure(config: pytest.Config) -> None:
    """Register one marker per server, set on the tests that need it."""
    for name in SERVER_MARKERS:
        config.addinivalue_line("markers", f"{name}: the test needs the {name} server")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the servers it needs: a ``<name>_server`` fixture among its
    fixtures, or a parameter whose value is the server's name (``store_url[rclone]``,
    ``s3_server[moto]``: the fixtures that look the server up by that name)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        params = {v for v in callspec.params.values() if isinstance(v, str)} if callspec else set()
        for name in SERVER_MARKERS:
            if f"{name}_server" in fixtures or name in params:
                item.add_marker(name)


# --------------------------------------------------------------------------- servers


def _server(name: str) -> Iterator[S3Server]:
    server = launch(name)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        # Keep the temp dir (with server.log) if the server died during the session.
        stop(server, remove_workdir=server.running)


@pytest.fixture(scope="session")
def moto_server(_isolated_aws_env: None) -> Iterator[S3Server]:
    """moto's S3 server (in memory) on a free 127.0.0.1 port, for the whole session."""
    yield from _server("moto")


@pytest.fixture(scope="session")
def rclone_server(_isolated_aws_env: None) -> Iterator[S3Server]:
    """``rclone serve s3`` over a temp directory, for the whole session."""
    yield from _server("rclone")


def _emulator(name: str) -> Iterator[Emulator]:
    server = launch_emulator(name)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        stop(server, remove_workdir=server.running)


@pytest.fixture(scope="session")
def gcs_server(_isolated_aws_env: None) -> Iterator[Emulator]:
    """``gcp-storage-emulator`` (GCS JSON API, in memory) on a free 127.0.0.1 port."""
    yield from _emulator("gcs")


@pytest.fixture(scope="session")
def azure_server(_isolated_aws_env: None) -> Iterator[Emulator]:
    """Azurite's blob service (in memory) on a free 127.0.0.1 port."""
    yield from _emulator("azure")


@pytest.fixture(params=["moto", "rclone"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Each S3 server in turn; started on first use only."""
    return request.getfixturevalue(f"{request.param}_server")


# --------------------------------------------------------------------------- targets

_SCHEMES = {"moto": "s3", "rclone": "s3", "gcs": "gs", "azure": "az"}


#: The stores every integration test runs on (each in its own process where it spawns).
STORES = ["file", "moto", "rclone", "gcs", "azure"]


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    """A fresh storage target per test: a temp dir, or a new bucket on a server."""
    yield from make_target(request, request.param, tmp_path)


def make_target(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> Iterator[StoreTarget]:
    """A fresh target on the store ``name``; ``memory`` is the in-memory store (one
    process only: the store contract runs on it, multi-process tests do not)."""
    if name == "file":
        root = tmp_path / "store"
        root.mkdir()
        yield StoreTarget("file", root.as_uri(), {})
        return
    if name == "memory":
        from cloudckpt.store import memory

        bucket = unique_bucket_name()
        yield StoreTarget("memory", f"memory://{bucket}", {})
        memory.clear(bucket)
        return
    server: S3Server | Emulator = request.getfixturevalue(f"{name}_server")
    bucket = server.make_bucket(unique_bucket_name())
    scheme = _SCHEMES[name]
    yield StoreTarget(name, f"{scheme}://{bucket}", server.storage_options(), server)
    # Free memory (moto, emulators) / disk (rclone) between tests; never fail a test over it.
    with contextlib.suppress(Exception):
        server.remove_bucket(bucket)


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    """A server that accepts connections and never answers (tests/silent.py)."""
    server = SilentServer()
    yield server
    server.close()
