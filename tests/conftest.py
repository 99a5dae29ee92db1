"""Shared pytest fixtures: local S3 servers and storage targets.

Fixtures
--------
``moto_server`` (session)   -- a moto S3 server subprocess (:class:`servers.S3Server`).
``rclone_server`` (session) -- an ``rclone serve s3`` subprocess over a temp dir.
``s3_server`` (function, params ``moto``/``rclone``) -- one of the two above.
``store_url`` (function, params ``file``/``moto``/``rclone``) -- a fresh, empty
    :class:`StoreTarget`: a temp directory as ``file://`` URL, or a new bucket
    as ``s3://<bucket>`` with the server's ``storage_options``.

Servers start lazily, i.e. only when a collected test actually needs them, and
are stopped at the end of the session. Select a backend with ``-k``, e.g.
``pytest -k "not rclone"``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servers import S3Server, launch, stop

# ------------------------------------------------------------- environment hygiene

# AWS variables that must not leak in from the developer's shell: they could
# point boto3/botocore at a real account, profile, endpoint or role.
_AWS_ENV_PREFIXES = ("AWS_",)
_EXTRA_ENV_TO_DROP = ("BOTO_CONFIG", "BOTO_PATH")


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Strip AWS credentials/config from the environment for the whole session.

    * every ``AWS_*`` variable is removed (``AWS_PROFILE``, keys, session token,
      ``AWS_ENDPOINT_URL*``, role/web-identity settings, ...);
    * ``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE`` point at files that
      do not exist, so ``~/.aws/config`` and ``~/.aws/credentials`` are ignored;
    * ``AWS_EC2_METADATA_DISABLED=true`` stops botocore probing the instance
      metadata service for credentials;
    * 127.0.0.1 is added to ``NO_PROXY`` so a shell proxy is never used for
      the local servers.

    Tests therefore have to pass credentials explicitly (``storage_options``)
    or set them with ``monkeypatch.setenv(...)`` from ``S3Server.env()``.
    Everything is restored when the session ends.
    """
    mp = pytest.MonkeyPatch()
    for key in list(os.environ):
        if key.startswith(_AWS_ENV_PREFIXES) or key in _EXTRA_ENV_TO_DROP:
            mp.delenv(key)
    nowhere = tmp_path_factory.mktemp("aws-home") / "does-not-exist"
    mp.setenv("AWS_CONFIG_FILE", str(nowhere))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for key in ("NO_PROXY", "no_proxy"):
        current = os.environ.get(key, "")
        mp.setenv(key, ",".join(filter(None, [current, "127.0.0.1", "localhost"])))
    try:
        yield
    finally:
        mp.undo()


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


@pytest.fixture(params=["moto", "rclone"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Each S3 server in turn; started on first use only."""
    return request.getfixturevalue(f"{request.param}_server")


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class StoreTarget:
    """A fresh, empty place to store checkpoints.

    ``name`` is ``"file"``, ``"moto"`` or ``"rclone"``; ``base_url`` is
    ``file:///...`` or ``s3://<bucket>``; ``storage_options`` are the keyword
    arguments to reach it (``{}`` for files). ``server`` is the S3 server for
    the S3 targets (handy for inspecting the bucket with ``server.client()``).
    """

    name: str
    base_url: str
    storage_options: dict[str, Any]
    server: S3Server | None = field(default=None, compare=False)

    @property
    def bucket(self) -> str | None:
        """The bucket name of an ``s3://`` target, else None."""
        return self.base_url.removeprefix("s3://") if self.server is not None else None


_bucket_counter = itertools.count(1)
_SESSION_TAG = uuid.uuid4().hex[:8]  # distinguishes sessions sharing a server by hand


def unique_bucket_name(prefix: str = "ckpt") -> str:
    """A valid, unique S3 bucket name: lowercase letters, digits and hyphens, <= 63."""
    return f"{prefix}-{_SESSION_TAG}-{next(_bucket_counter):05d}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(params=["file", "moto", "rclone"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreTarget]:
    """A fresh storage target per test: a temp dir, or a new bucket on a server."""
    if request.param == "file":
        root = tmp_path / "store"
        root.mkdir()
        yield StoreTarget("file", root.as_uri(), {})
        return

    server: S3Server = request.getfixturevalue(f"{request.param}_server")
    bucket = server.make_bucket(unique_bucket_name())
    yield StoreTarget(request.param, f"s3://{bucket}", server.storage_options(), server)
    # Free memory (moto) / disk (rclone) between tests; never fail a test over it.
    with contextlib.suppress(Exception):
        server.remove_bucket(bucket)
