"""Nothing to restore yet (issue 41, item 5): ``restore()`` of a run with no committed
checkpoint returns None with one INFO line naming the run, on every store, with a local
tier, and on every rank of a job; an explicit step that is not committed stays a
NotFoundError; a missing bucket, rejected credentials and an unreachable store still
raise (a fresh run is an empty prefix in a bucket that exists, nothing else).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudckpt.errors import BucketNotFoundError, CredentialsError, NotFoundError, StorageError
from cloudckpt.manager import CheckpointManager
from conftest import StoreTarget
from servers import S3Server, unique_bucket_name


def _fresh_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "starting fresh" in r.getMessage()]


def test_a_fresh_run_restores_none_and_says_so_once(
    store_url: StoreTarget, caplog: pytest.LogCaptureFixture
) -> None:
    m = CheckpointManager(f"{store_url.base_url}/fresh", storage_options=store_url.storage_options)
    caplog.set_level(logging.INFO, logger="cloudckpt")
    assert m.restore() is None
    assert m.restored_step is None
    [line] = _fresh_lines(caplog)
    assert line.levelno == logging.INFO
    assert line.getMessage() == f"no committed checkpoint under {m.root_url}: starting fresh"
    with pytest.raises(NotFoundError, match="step 3"):  # asked for by number: an error
        m.restore(step=3)
    # The documented resume line, as a training script runs it on its first start.
    state = m.restore()
    start = 0 if state is None else state["step"] + 1
    m.save(start, {"step": start, "w": torch.ones(2)})
    assert m.restore()["step"] == 0


def test_a_fresh_run_with_a_local_tier_restores_none(
    moto_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("fresh-tier"))
    m = CheckpointManager(
        f"s3://{bucket}/run",
        local_dir=tmp_path / "tier",
        storage_options=moto_server.storage_options(),
    )
    caplog.set_level(logging.INFO, logger="cloudckpt")
    assert m.restore() is None
    assert len(_fresh_lines(caplog)) == 1
    with pytest.raises(NotFoundError, match="step 1"):
        m.restore(step=1)


@pytest.mark.parametrize("tiered", [False, True], ids=["plain", "local-tier"])
def test_a_missing_bucket_is_not_a_fresh_run(
    moto_server: S3Server, tmp_path: Path, tiered: bool
) -> None:
    extra: dict[str, Any] = {"local_dir": tmp_path / "tier"} if tiered else {}
    m = CheckpointManager(
        f"s3://{unique_bucket_name('never-made')}/run",
        storage_options=moto_server.storage_options(),
        **extra,
    )
    with pytest.raises(BucketNotFoundError):
        m.restore()


def test_rejected_credentials_are_not_a_fresh_run(rclone_server: S3Server) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("fresh-creds"))
    wrong = {**rclone_server.storage_options(), "aws_secret_access_key": "not-the-secret"}
    m = CheckpointManager(f"s3://{bucket}/run", storage_options=wrong, max_attempts=1)
    with pytest.raises(CredentialsError):
        m.restore()


def test_an_unreachable_store_is_not_a_fresh_run() -> None:
    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "aws_access_key_id": "k",
        "aws_secret_access_key": "s",
    }
    m = CheckpointManager("s3://bucket/run", storage_options=options, max_attempts=1)
    with pytest.raises(StorageError):
        m.restore()


def _ranks_fresh(rank: int, world: int, url: str, so: dict[str, str], base: str) -> None:
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("cloudckpt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    state = {f"own{rank}": torch.zeros(4)}
    tiered = CheckpointManager(
        url, local_dir=Path(base) / f"node{rank}", kind="dcp", storage_options=so
    )
    assert tiered.restore(state=state) is None  # the path of several ranks with a tier
    plain = CheckpointManager(url, kind="dcp", storage_options=so)
    assert plain.restore(state=state) is None
    assert sum("starting fresh" in s for s in seen) == 2, seen
    with pytest.raises(NotFoundError, match="step 5"):
        tiered.restore(5, state=state)


def test_every_rank_of_a_fresh_run_restores_none(moto_server: S3Server, tmp_path: Path) -> None:
    pytest.importorskip("cloudckpt.dcp")
    from ranks import run_ranks

    bucket = moto_server.make_bucket(unique_bucket_name("fresh-ranks"))
    url = f"s3://{bucket}/run"
    run_ranks(_ranks_fresh, 2, url, moto_server.storage_options(), str(tmp_path), timeout=300)
