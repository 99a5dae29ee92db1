"""CloudCheckpointIO's local tier with a bucket that accepts every request and answers
none: saves of a file whose previous version is being uploaded, and Lightning's
rotation, go on locally at once; when the bucket answers again the newest version of
each file lands (docs/tiers.md, "Lightning").

The bucket is moto behind a FaultProxy whose matcher blocks (under the proxy's lock, so
no request gets through) until the test lets it answer. Every wait is bounded: a save
or removal that waits for the bucket fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from test_tier import Bucket, mirrored
from tiny import Tiny, cpu_trainer, top_k_and_last

import cloudckpt
from cloudckpt.lightning import CloudCheckpointIO
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, unique_bucket_name

#: Seconds any one wait of these tests may take (far beyond what each needs).
BOUND = 120.0


class SilentBucket:
    """A bucket that goes silent (with :meth:`hold`, or at a request ``goes_silent``
    matches): from then on every request is accepted and held unanswered until
    :meth:`answer`, which ends the silence."""

    def __init__(self, server: S3Server, goes_silent: Callable[[str, str], bool] | None) -> None:
        self.server, self.name = server, server.make_bucket(unique_bucket_name())
        self._goes_silent = goes_silent
        self.silent = threading.Event()
        #: Set once a request is held unanswered (cleared by :meth:`answer`).
        self.held = threading.Event()
        self._back = threading.Event()
        #: The storage options reaching it through its proxy.
        self.options: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"s3://{self.name}/run"

    def hold(self) -> None:
        self.silent.set()

    def answer(self) -> None:
        """Answer the requests held, and those after them until the next silence."""
        self.silent.clear()
        self.held.clear()
        back, self._back = self._back, threading.Event()
        back.set()

    def match(self, method: str, target: str) -> bool:
        """The proxy's matcher: blocks while the bucket is silent; injects nothing."""
        back = self._back  # before the check: an answer() from now on releases it
        path = unquote(urlsplit(target).path)
        if self._goes_silent is not None and self._goes_silent(method, path):
            self.silent.set()
        if self.silent.is_set():
            self.held.set()
            back.wait(4 * BOUND)  # never forever, whatever the test does
        return False

    def objects(self) -> dict[str, bytes]:
        """Every object under the run, by name, read past the proxy."""
        return Bucket(self.server, self.name, {}).files()


@contextmanager
def tiered(
    server: S3Server,
    tier: Path,
    goes_silent: Callable[[str, str], bool] | None = None,
    **io_options: Any,
) -> Iterator[tuple[SilentBucket, CloudCheckpointIO]]:
    """A :class:`SilentBucket` and a CloudCheckpointIO with the local tier ``tier``
    reaching it through its proxy (``bucket.options``); the bucket answers again when
    the block ends, so nothing is left held."""
    bucket = SilentBucket(server, goes_silent)
    with FaultProxy(server.endpoint_url, match=bucket.match) as proxy:
        bucket.options = {**server.storage_options(), "endpoint_url": proxy.url}
        try:
            yield (
                bucket,
                CloudCheckpointIO(local_dir=tier, storage_options=bucket.options, **io_options),
            )
        finally:
            bucket.answer()


def returns_within(call: Callable[[], object], what: str) -> None:
    """Run ``call`` in a thread; fail unless it returns (or raises) within BOUND."""
    done = threading.Thread(target=call, daemon=True)
    done.start()
    done.join(BOUND)
    assert not done.is_alive(), f"{what} waited for the bucket"


def fit_in_background(
    trainer: Trainer, ended: threading.Event
) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``trainer.fit(Tiny())`` in a daemon thread; an error it raises is kept in
    the list returned and sets ``ended`` (which a callback sets when training ends)."""
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(Tiny())
        except BaseException as exc:
            errors.append(exc)
            ended.set()

    run = threading.Thread(target=fit, daemon=True)
    run.start()
    return run, errors


def record(tier: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((tier / "_DRAINS" / f"{name}.json").read_bytes()))


def pins(tier: Path, name: str) -> list[Path]:
    """The private hard links uploads of ``name`` read from."""
    return sorted(tier.glob(f".{name}.cloudckpt-drain-*.part"))


class Watch(Callback):  # type: ignore[misc]
    """At each epoch's start (the first's aside) and at the end of training: the epoch of
    the ``last.ckpt`` the IO loads, which must be the local file just saved. Before the
    second epoch, waits until the bucket holds the upload of the first ``last.ckpt``."""

    def __init__(self, io: CloudCheckpointIO, bucket: SilentBucket) -> None:
        self.io, self.bucket = io, bucket
        self.last: list[int] = []
        self.silent_at_end = False
        self.ended = threading.Event()

    def _last_epoch(self) -> int:
        loaded = self.io.load_checkpoint(f"{self.bucket.url}/last.ckpt", weights_only=False)
        return int(loaded["epoch"])

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1 and not self.bucket.held.wait(BOUND):
            raise AssertionError("the upload of last.ckpt never reached the bucket")
        if trainer.current_epoch > 0:
            self.last.append(self._last_epoch())

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.last.append(self._last_epoch())
        self.silent_at_end = self.bucket.held.is_set() and self.bucket.silent.is_set()
        self.ended.set()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fit_saves_last_every_epoch_while_the_bucket_never_answers(
    moto_server: S3Server, tmp_path: Path, async_save: bool
) -> None:
    epochs, tier, uploads = 3, tmp_path / "tier", 0

    def at_last_upload(method: str, path: str) -> bool:  # the first one: silent from there
        nonlocal uploads
        upload = method == "PUT" and path.endswith("/last.ckpt")
        uploads += upload
        return upload and uploads == 1

    with tiered(moto_server, tier, at_last_upload, async_save=async_save) as (bucket, io):
        watch = Watch(io, bucket)
        # Top-2 (epoch=0.ckpt is rotated out at epoch 2, during the silence) and last,
        # with Lightning's version counter: the IO answers it from the listing taken at
        # setup (docs/tiers.md, "Lightning"; test_tier_version_counter.py).
        callback = top_k_and_last(bucket.url, bucket.options)
        run, errors = fit_in_background(cpu_trainer(epochs, [watch, callback], io), watch.ended)
        try:
            assert watch.ended.wait(BOUND), "a save waited for the bucket"
            assert not errors, errors
            # Every epoch saved last.ckpt locally while the bucket held its first upload.
            assert watch.silent_at_end
            assert watch.last == list(range(epochs))
            assert sorted(bucket.objects()) == ["epoch=0.ckpt"]  # no last.ckpt there yet
        finally:
            bucket.answer()  # the bucket is back: fit's teardown drains what waits
            run.join(BOUND)
        assert not run.is_alive() and not errors, errors
    local = mirrored(tier)
    assert sorted(local) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]
    assert bucket.objects() == local  # the newest last.ckpt among them, byte for byte
    assert torch.load(tier / "last.ckpt", weights_only=False)["epoch"] == epochs - 1
    assert not any(record(tier, name)["due"] for name in local)
    assert pins(tier, "last.ckpt") == []


def test_a_version_replaced_during_its_upload_is_never_recorded_as_drained(
    moto_server: S3Server, tmp_path: Path
) -> None:
    tier, puts = tmp_path / "tier", 0

    def silent_at_each_put(method: str, path: str) -> bool:
        nonlocal puts
        put = method == "PUT" and path.endswith("/a.ckpt")
        puts += put
        return put and puts <= 2

    with tiered(moto_server, tier, silent_at_each_put) as (bucket, io):
        url, local = f"{bucket.url}/a.ckpt", tier / "a.ckpt"
        io.save_checkpoint({"w": torch.zeros(64)}, url)
        first = local.read_bytes()
        assert bucket.held.wait(BOUND)  # the upload of version 1, held
        returns_within(
            lambda: io.save_checkpoint({"w": torch.ones(64)}, url), "a save of a file uploading"
        )
        second = local.read_bytes()
        assert second != first
        (pin,) = pins(tier, "a.ckpt")  # version 1's upload reads its own link ...
        assert pin.read_bytes() == first  # ... which the second save's sweep kept
        version = local.stat().st_mtime
        assert record(tier, "a.ckpt")["due"] and record(tier, "a.ckpt")["time"] == version

        bucket.answer()  # version 1 lands; the bucket is silent again at the next PUT
        assert bucket.held.wait(BOUND) and puts == 2
        assert bucket.objects() == {"a.ckpt": first}
        found = record(tier, "a.ckpt")
        assert found["due"] and not found["committed"] and found["time"] == version
        assert torch.equal(io.load_checkpoint(url)["w"], torch.ones(64))  # the local copy

        bucket.answer()
        io.wait()
        assert bucket.objects() == {"a.ckpt": second}
        found = record(tier, "a.ckpt")
        assert found["committed"] and not found["due"] and found["time"] == version
        assert pins(tier, "a.ckpt") == []

        # A link a killed drain left (its lock gone with it) goes with the next save.
        dead = tier / ".a.ckpt.cloudckpt-drain-0123456789abcdef.part"
        os.link(local, dead)
        io.save_checkpoint({"w": torch.full((64,), 2.0)}, url)
        assert not dead.exists()
        io.teardown()
    assert bucket.objects() == {"a.ckpt": local.read_bytes()}


def test_a_removal_never_waits_for_the_bucket_in_the_training_loop(
    moto_server: S3Server, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    with tiered(moto_server, tier) as (bucket, io):
        for name in ("a.ckpt", "b.ckpt"):
            io.save_checkpoint({"w": torch.zeros(4)}, f"{bucket.url}/{name}")
        io.wait()  # both drained: the removal has nothing to wait for but the bucket
        bucket.hold()
        returns_within(lambda: io.remove_checkpoint(f"{bucket.url}/a.ckpt"), "a removal")
        assert sorted(bucket.objects()) == ["a.ckpt", "b.ckpt"]
        bucket.answer()
        io.teardown()
    assert sorted(bucket.objects()) == ["b.ckpt"] and bucket.objects() == mirrored(tier)


def test_a_file_newer_than_its_record_is_drained_by_the_next_io(
    moto_server: S3Server, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    with tiered(moto_server, tier) as (bucket, io):
        io.save_checkpoint({"w": torch.zeros(4)}, f"{bucket.url}/a.ckpt")
        io.teardown()
        # Killed between the local rename and the record: a.ckpt is newer than its
        # record says, b.ckpt has none.
        cloudckpt.save({"w": torch.ones(4)}, str(tier / "a.ckpt"))
        cloudckpt.save({"w": torch.ones(4)}, str(tier / "b.ckpt"))
        again = CloudCheckpointIO(local_dir=tier, storage_options=bucket.options)
        again.wait()
    assert bucket.objects() == mirrored(tier) and sorted(mirrored(tier)) == ["a.ckpt", "b.ckpt"]
    for name in ("a.ckpt", "b.ckpt"):
        found = record(tier, name)
        assert found["committed"] and found["time"] == (tier / name).stat().st_mtime
