"""CloudCheckpointIO with a local tier: real Trainer runs, a temp directory as the tier,
moto as the bucket (reached through a recording proxy).

Saves commit to the local mirror and return; one thread uploads the same bytes to the
bucket. Resumes read the local copy when it is valid, the bucket's otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch
from tiny import Tiny, cpu_trainer, top_k_and_last

import cloudckpt
from cloudckpt.engine.drain import RUN_FILE
from cloudckpt.engine.journal import JOURNAL_DIR
from cloudckpt.errors import StorageError
from cloudckpt.lightning import CloudCheckpointIO
from cloudckpt.lightning.checkpoint_io import JOURNAL
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, recorded_bucket, unique_bucket_name


@dataclass
class Bucket:
    """A fresh moto bucket reached through a recording proxy."""

    server: S3Server
    name: str
    storage_options: dict[str, str]
    #: (method, path) of every request the proxy forwarded.
    requests: list[tuple[str, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"s3://{self.name}/run"

    def checkpoint_reads(self) -> int:
        """GETs of ``.ckpt`` objects so far (a HEAD or a listing is no payload)."""
        return sum(1 for m, p in self.requests if m == "GET" and p.endswith(".ckpt"))

    def files(self) -> dict[str, bytes]:
        """Every object under the run, by name, read past the proxy."""
        client = self.server.client()
        listing = client.list_objects_v2(Bucket=self.name, Prefix="run/")
        keys = [o["Key"] for o in listing.get("Contents", [])]
        return {
            k[len("run/") :]: client.get_object(Bucket=self.name, Key=k)["Body"].read()
            for k in keys
        }


@pytest.fixture
def bucket(moto_server: S3Server) -> Iterator[Bucket]:
    with recorded_bucket(moto_server) as (name, options, seen):
        yield Bucket(moto_server, name, options, seen)


def mirrored(tier: Path) -> dict[str, bytes]:
    """The checkpoints in the local tier, by name (its run file and journal aside)."""
    return {
        p.name: p.read_bytes()
        for p in tier.iterdir()
        if p.is_file() and p.name not in (RUN_FILE, JOURNAL) and not p.name.startswith(".")
    }


def journal(tier: Path) -> dict[str, Any]:
    """The mirror's drain records (engine/journal.py) as one journal: the files due."""
    records = {p.stem: json.loads(p.read_bytes()) for p in (tier / JOURNAL_DIR).glob("*.json")}
    return {"due": sorted(name for name, record in records.items() if record["due"])}


def fit(bucket: Bucket, tier: Path, epochs: int, *, async_save: bool, **kw: Any) -> Tiny:
    """A Trainer run of ``epochs`` with top-2 and last in the bucket, through the tier."""
    callback = top_k_and_last(bucket.url, bucket.storage_options)
    io = CloudCheckpointIO(
        async_save=async_save, local_dir=tier, storage_options=bucket.storage_options
    )
    trainer = cpu_trainer(epochs, [callback], io)
    model = Tiny()
    trainer.fit(model, **kw)
    return model


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fit_drains_the_local_mirror_and_resumes_from_it(
    bucket: Bucket, tmp_path: Path, async_save: bool
) -> None:
    tier = tmp_path / "tier"
    fit(bucket, tier, 3, async_save=async_save)
    local = mirrored(tier)
    assert sorted(local) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert bucket.files() == local  # the same files, the same bytes
    assert journal(tier)["due"] == []
    assert json.loads((tier / RUN_FILE).read_bytes())["root_url"] == bucket.url

    reads = bucket.checkpoint_reads()
    model = fit(bucket, tier, 4, async_save=async_save, ckpt_path="last")
    assert model.started_at_epoch == 3
    assert bucket.checkpoint_reads() == reads  # last.ckpt came from the local tier
    assert bucket.files() == mirrored(tier)
    assert sorted(mirrored(tier)) == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]


def test_a_corrupt_or_missing_local_copy_is_read_from_the_bucket(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    fit(bucket, tier, 2, async_save=False)
    last = tier / "last.ckpt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    reads = bucket.checkpoint_reads()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        model = fit(bucket, tier, 3, async_save=False, ckpt_path="last")
    assert model.started_at_epoch == 2
    assert bucket.checkpoint_reads() > reads
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(last) in w and "ChecksumError" in w for w in warned), warned

    caplog.clear()
    (tier / "last.ckpt").unlink()
    io = CloudCheckpointIO(local_dir=tier, storage_options=bucket.storage_options)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        loaded = io.load_checkpoint(f"{bucket.url}/last.ckpt", weights_only=False)
    assert loaded["epoch"] == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(last) in w and "NotFoundError" in w for w in warned), warned


def test_an_undrained_file_is_loaded_from_local_and_a_failed_drain_raises_at_wait(
    moto_server: S3Server, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    url = "s3://no-such-bucket-tier/run/a.ckpt"
    io = CloudCheckpointIO(
        local_dir=tier, storage_options=moto_server.storage_options(), max_attempts=1
    )
    io.save_checkpoint({"w": torch.arange(8.0)}, url)
    loaded = io.load_checkpoint(url)
    assert torch.equal(loaded["w"], torch.arange(8.0))
    # read by mapping the local copy (load(mmap=True)), not into new memory
    path = os.path.realpath(next(tier.rglob("a.ckpt")))
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith(" " + path) for line in maps), path
    with pytest.raises(StorageError, match=r"drain of file a\.ckpt .* failed") as failed:
        io.teardown()
    assert "no-such-bucket-tier" in str(failed.value.__cause__)
    assert journal(tier)["due"] == ["a.ckpt"]  # still due: a later process tries again


def test_a_local_dir_of_another_run_is_not_used(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier"
    first = CloudCheckpointIO(local_dir=tier, storage_options=bucket.storage_options)
    first.save_checkpoint({"w": torch.zeros(4)}, f"{bucket.url}/a.ckpt")
    first.teardown()
    other = CloudCheckpointIO(local_dir=tier, storage_options=bucket.storage_options)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        other.save_checkpoint({"w": torch.ones(4)}, f"s3://{bucket.name}/other/b.ckpt")
    other.teardown()
    assert any(f"holds the local tier of {bucket.url}" in r.getMessage() for r in caplog.records)
    assert sorted(mirrored(tier)) == ["a.ckpt"]  # b.ckpt went to the bucket only
    loaded = other.load_checkpoint(f"s3://{bucket.name}/other/b.ckpt")
    assert torch.equal(loaded["w"], torch.ones(4))


_CHILD = """
import json, sys, threading
import torch
from cloudckpt.lightning import CloudCheckpointIO

io = CloudCheckpointIO(local_dir=sys.argv[2], storage_options=json.loads(sys.argv[3]))
io.save_checkpoint({"w": torch.arange(4096.0)}, sys.argv[1])
threading.Event().wait()  # the drain stalls in the proxy; killed here
"""


def test_a_drain_killed_midway_is_finished_by_the_next_io(
    moto_server: S3Server, tmp_path: Path
) -> None:
    name = moto_server.make_bucket(unique_bucket_name())
    url = f"s3://{name}/run/epoch=0.ckpt"
    tier = tmp_path / "tier"
    arrived = threading.Event()

    def stall(method: str, target: str) -> bool:
        if method == "PUT" and unquote(urlsplit(target).path).endswith("/epoch=0.ckpt"):
            arrived.set()
            return True  # held unanswered, never forwarded
        return False

    with FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=300, match=stall
    ) as proxy:
        options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, str(tier), json.dumps(options)],
            stderr=subprocess.PIPE,
        )
        try:
            assert arrived.wait(120), child.stderr.read().decode()[-2000:] if child.stderr else ""
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(60)
            if child.stderr:
                child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    listing = moto_server.client().list_objects_v2(Bucket=name, Prefix="run/")
    assert listing.get("Contents", []) == []  # nothing half-visible in the bucket
    assert journal(tmp_path / "tier")["due"] == ["epoch=0.ckpt"]

    io = CloudCheckpointIO(local_dir=tier, storage_options=moto_server.storage_options())
    io.wait()  # finds the file due and uploads it
    body = moto_server.client().get_object(Bucket=name, Key="run/epoch=0.ckpt")["Body"].read()
    assert body == (tier / "epoch=0.ckpt").read_bytes()
    assert journal(tier)["due"] == []
    assert torch.equal(io.load_checkpoint(url)["w"], torch.arange(4096.0))


@pytest.mark.parametrize("drain", ["held", "failing"])
def test_a_removal_waits_for_the_newer_drain_and_skips_when_it_failed(
    moto_server: S3Server, tmp_path: Path, drain: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = moto_server.make_bucket(unique_bucket_name())
    tier, old, new = tmp_path / "tier", f"s3://{name}/run/old.ckpt", f"s3://{name}/run/new.ckpt"
    release = threading.Event()

    def hold_new(method: str, target: str) -> bool:
        if method == "PUT" and unquote(urlsplit(target).path).endswith("/new.ckpt"):
            if drain == "failing":
                return True  # answered 500, never forwarded
            release.wait(120)
        return False

    with FaultProxy(
        moto_server.endpoint_url, rate=1.0, kinds=("internal",), match=hold_new
    ) as proxy:
        try:
            options = {**moto_server.storage_options(), "endpoint_url": proxy.url}
            io = CloudCheckpointIO(local_dir=tier, storage_options=options, max_attempts=1)
            io.save_checkpoint({"w": torch.zeros(4)}, old)
            io.wait()
            io.save_checkpoint({"w": torch.ones(4)}, new)  # committed locally; its drain held
            with caplog.at_level(logging.WARNING, logger="cloudckpt"):
                io.remove_checkpoint(old)  # queued behind the drain of new.ckpt
                assert (tier / "old.ckpt").exists()
                assert list(Bucket(moto_server, name, options).files()) == ["old.ckpt"]
                release.set()
                if drain == "failing":
                    with pytest.raises(StorageError, match=r"drain of file new\.ckpt"):
                        io.teardown()
                else:
                    io.teardown()
        finally:
            release.set()  # never leave the proxy holding a request
    files = Bucket(moto_server, name, options).files()
    if drain == "failing":  # the newer checkpoint is not in the bucket: the old one stays
        assert sorted(files) == ["old.ckpt"] and sorted(mirrored(tier)) == ["new.ckpt", "old.ckpt"]
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("not removing" in w and "new.ckpt" in w for w in warned), warned
    else:
        assert files == mirrored(tier) and sorted(files) == ["new.ckpt"]


def test_a_bucket_object_replaced_since_the_drain_is_read_from_the_bucket(
    bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier, url = tmp_path / "tier", f"{bucket.url}/last.ckpt"
    io = CloudCheckpointIO(local_dir=tier, storage_options=bucket.storage_options)
    io.save_checkpoint({"w": torch.zeros(4)}, url)
    io.wait()
    reads = bucket.checkpoint_reads()
    assert torch.equal(io.load_checkpoint(url)["w"], torch.zeros(4))
    assert bucket.checkpoint_reads() == reads  # drained and unchanged: the local copy
    # Another node of the same run saved a newer last.ckpt to the bucket.
    cloudckpt.save({"w": torch.ones(4)}, url, storage_options=bucket.storage_options)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        loaded = CloudCheckpointIO(local_dir=tier, storage_options=bucket.storage_options)
        assert torch.equal(loaded.load_checkpoint(url)["w"], torch.ones(4))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not the one drained" in w and str(tier) in w for w in warned), warned
