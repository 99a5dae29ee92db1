"""Lightning's version counter (``enable_version_counter=True``, the default) with a
local tier: ``CloudModelCheckpoint`` asks whether each checkpoint's name exists before
every save; with ``CloudCheckpointIO(local_dir=...)`` serving its ``dirpath`` that is
answered from one listing taken at setup and the saves and removals since, never by
the bucket in the training loop (docs/tiers.md, "Lightning").

The bucket is moto behind a FaultProxy (test_tier_hanging_bucket.SilentBucket) that
answers the setup, then from the start of training accepts every request and answers
none until the test lets it. Every wait is bounded: a save that waits for the bucket
fails the test instead of hanging it.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from test_tier import mirrored
from test_tier_hanging_bucket import SilentBucket, fit_in_background, tiered
from tiny import Tiny, cpu_trainer, top_k_and_last

from cloudckpt.errors import StorageError
from cloudckpt.lightning import CloudCheckpointIO, CloudModelCheckpoint
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, free_port, unique_bucket_name

#: Seconds training may take while the bucket is silent (a tiny model's few epochs take
#: a few seconds; one save waiting for the bucket waits far longer).
BOUND = 90.0
#: Batches per epoch of tiny.Tiny (64 samples, 16 a batch).
STEPS = 4


class SilentWhileTraining(Callback):  # type: ignore[misc]
    """Silences the bucket when training starts (after every callback's setup); at the
    end of training notes whether it is still silent and what the tier holds."""

    def __init__(self, bucket: SilentBucket, tier: Path) -> None:
        self.bucket, self.tier = bucket, tier
        self.epochs_saved: list[int] = []
        self.silent_at_end = False
        self.ended = threading.Event()

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.bucket.hold()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.epochs_saved.append(trainer.current_epoch)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.silent_at_end = self.bucket.silent.is_set()
        self.ended.set()


def fit_while_silent(
    bucket: SilentBucket, io: CloudCheckpointIO, tier: Path, epochs: int, callback: Any
) -> SilentWhileTraining:
    """Fit Tiny for ``epochs`` with ``callback``, the bucket silent from the start of
    training; fail unless training ends within BOUND while it still is. The bucket then
    answers, and fit's teardown drains the tier."""
    watch = SilentWhileTraining(bucket, tier)
    run, errors = fit_in_background(cpu_trainer(epochs, [watch, callback], io), watch.ended)
    try:
        assert watch.ended.wait(BOUND), "a save waited for the bucket"
        assert not errors, errors
        assert watch.silent_at_end and watch.epochs_saved == list(range(epochs))
    finally:
        bucket.answer()  # fit's teardown drains what waits
        run.join(4 * BOUND)
    assert not run.is_alive() and not errors, errors
    return watch


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_epoch_saves_with_the_version_counter_while_the_bucket_never_answers(
    moto_server: S3Server, tmp_path: Path, async_save: bool
) -> None:
    epochs, tier = 4, tmp_path / "tier"
    seen: list[tuple[str, str]] = []  # the requests reaching the bucket while silent
    box: list[SilentBucket] = []

    def note(method: str, path: str) -> bool:
        if box and box[0].silent.is_set():
            seen.append((method, path))
        return False

    with tiered(moto_server, tier, note, async_save=async_save) as (bucket, io):
        box.append(bucket)
        # Lightning's default enable_version_counter=True: a check of each name per save.
        callback = top_k_and_last(bucket.url, bucket.options)
        fit_while_silent(bucket, io, tier, epochs, callback)
        # While training, the bucket was asked nothing but the drain's first upload
        # (which, held, holds the proxy): no HEAD, no listing from a save.
        assert seen and all(m in ("PUT", "POST") for m, _ in seen), seen
    local = mirrored(tier)
    assert sorted(local) == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]  # no -v1
    assert bucket.objects() == local
    assert torch.load(tier / "last.ckpt", weights_only=False)["epoch"] == epochs - 1


def test_a_name_an_earlier_run_left_in_the_bucket_gets_its_version(
    moto_server: S3Server, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    with tiered(moto_server, tier) as (bucket, io):
        earlier = {f"epoch=0-step={STEPS}.ckpt": b"an earlier run's", "last.ckpt": b"its last"}
        client = moto_server.client()
        for name, body in earlier.items():
            client.put_object(Bucket=bucket.name, Key=f"run/{name}", Body=body)
        callback = CloudModelCheckpoint(
            dirpath=bucket.url, save_top_k=-1, save_last=True, storage_options=bucket.options
        )
        fit_while_silent(bucket, io, tier, 2, callback)
    ours = [f"epoch=0-step={STEPS}-v1.ckpt", f"epoch=1-step={2 * STEPS}.ckpt", "last-v1.ckpt"]
    local = mirrored(tier)
    assert sorted(local) == ours  # as Lightning names them: the earlier files are taken
    there = bucket.objects()
    assert sorted(there) == sorted([*earlier, *ours])
    assert {name: there[name] for name in earlier} == earlier  # never overwritten
    assert {name: there[name] for name in ours} == local
    assert torch.load(tier / "last-v1.ckpt", weights_only=False)["epoch"] == 1


class BucketBack(Callback):  # type: ignore[misc]
    """Starts the proxy in front of the bucket at the end of training (the bucket
    refused every connection until then); notes the epochs saved."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.epochs_saved: list[int] = []

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.epochs_saved.append(trainer.current_epoch)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.proxy.__enter__()


def test_a_bucket_away_at_setup_saves_on_and_never_overwrites_an_earlier_runs_file(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """The bucket refuses connections from setup to the end of training: every epoch
    saves (names from the tier and the run's saves), and once it answers the drains
    send this run's files but not one over a file an earlier run left there."""
    tier = tmp_path / "tier"
    name = moto_server.make_bucket(unique_bucket_name("away-at-setup"))
    earlier = {f"epoch=0-step={STEPS}.ckpt": b"an earlier run's", "last.ckpt": b"its last"}
    for key, body in earlier.items():
        moto_server.client().put_object(Bucket=name, Key=f"run/{key}", Body=body)
    port = free_port()  # nothing listens there until the proxy starts
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    fast = {"max_attempts": 1, "connect_timeout": 1.0, "request_timeout": 2.0}
    io = CloudCheckpointIO(local_dir=tier, storage_options=options, **fast)
    callback = CloudModelCheckpoint(
        dirpath=f"s3://{name}/run", save_top_k=-1, save_last=True, storage_options=options
    )
    proxy = FaultProxy(moto_server.endpoint_url, port=port)
    back = BucketBack(proxy)
    try:
        # Before: the first save's check of its name failed the fit (connection refused).
        with pytest.raises(StorageError, match=re.escape(f"epoch=0-step={STEPS}.ckpt")) as err:
            cpu_trainer(2, [back, callback], io).fit(Tiny())
        assert "this run did not write it" in str(err.value)
        assert back.epochs_saved == [0, 1]
        local = mirrored(tier)
        assert sorted(local) == [
            f"epoch=0-step={STEPS}.ckpt",
            f"epoch=1-step={2 * STEPS}.ckpt",
            "last.ckpt",
        ]
        there = {
            o["Key"].removeprefix("run/"): o
            for o in moto_server.client().list_objects_v2(Bucket=name)["Contents"]
        }
        assert sorted(there) == sorted([*earlier, f"epoch=1-step={2 * STEPS}.ckpt"])
        for key, body in earlier.items():  # never overwritten
            got = moto_server.client().get_object(Bucket=name, Key=f"run/{key}")["Body"].read()
            assert got == body
        # The next process on this local_dir (the bucket answering) resumes the drains
        # left due: those two still fail, the earlier run's files are still intact.
        restarted = CloudCheckpointIO(local_dir=tier, storage_options=options, **fast)
        with pytest.raises(StorageError, match="this run did not write it"):
            restarted.wait()
        for key, body in earlier.items():  # before: overwritten by the restarted drains
            got = moto_server.client().get_object(Bucket=name, Key=f"run/{key}")["Body"].read()
            assert got == body
        assert mirrored(tier) == local
    finally:
        proxy.__exit__(None, None, None)
