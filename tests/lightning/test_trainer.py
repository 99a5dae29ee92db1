"""Real Trainer.fit runs with remote dirpaths: top-k, last, resume, failures."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import Tiny, cpu_trainer, top_k_and_last

import cloudckpt
from cloudckpt import errors
from cloudckpt.lightning import CloudCheckpointIO
from cloudckpt.testing import unique_bucket_name


def trainer(s3, dirpath, epochs, *, async_save, top_k=2, io=None):
    callback = top_k_and_last(dirpath, s3.storage_options(), save_top_k=top_k)
    io = io or CloudCheckpointIO(async_save=async_save, storage_options=s3.storage_options())
    return cpu_trainer(epochs, [callback], io), callback


def objects(s3, bucket, prefix="run/"):
    listing = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix) :] for o in listing.get("Contents", []))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_top_k_last_and_resume_on_a_bucket(s3_server, async_save):
    bucket = s3_server.make_bucket(f"lt-{s3_server.name}-{'a' if async_save else 's'}")
    dirpath = f"s3://{bucket}/run"
    t, cb = trainer(s3_server, dirpath, 4, async_save=async_save)
    t.fit(Tiny())
    assert objects(s3_server, bucket) == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert cb.best_model_path == f"{dirpath}/epoch=3.ckpt"
    last = cloudckpt.load(
        f"{dirpath}/last.ckpt", storage_options=s3_server.storage_options(), weights_only=False
    )
    assert last["epoch"] == 3

    # A new run resumes from the newest committed `last` on the bucket.
    t2, _ = trainer(s3_server, dirpath, 6, async_save=async_save)
    model = Tiny()
    t2.fit(model, ckpt_path="last")
    assert model.started_at_epoch == 4
    assert objects(s3_server, bucket) == ["epoch=4.ckpt", "epoch=5.ckpt", "last.ckpt"]


def test_the_checkpoint_resumed_from_is_never_rotated_away(s3_server):
    bucket = s3_server.make_bucket(f"lt-resume-{s3_server.name}")
    dirpath = f"s3://{bucket}/run"
    t, _ = trainer(s3_server, dirpath, 2, async_save=True, top_k=1)
    t.fit(Tiny())
    assert objects(s3_server, bucket) == ["epoch=1.ckpt", "last.ckpt"]
    t2, _ = trainer(s3_server, dirpath, 4, async_save=True, top_k=1)
    t2.fit(Tiny(), ckpt_path=f"{dirpath}/epoch=1.ckpt")
    # epoch=2 pushed epoch=1 out of the top-1, but the run resumed from it: it stays.
    assert objects(s3_server, bucket) == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]


def test_no_last_checkpoint_starts_fresh(s3_server):
    bucket = s3_server.make_bucket(f"lt-fresh-{s3_server.name}")
    t, _ = trainer(s3_server, f"s3://{bucket}/run", 1, async_save=False)
    model = Tiny()
    with pytest.warns(UserWarning, match="no last checkpoint"):
        t.fit(model, ckpt_path="last")
    assert model.started_at_epoch == 0


def test_the_logs_name_the_url_as_given(moto_server, caplog):
    """Lightning's resume messages show ``s3://...``, not the ``cloudckpt://s3://...``
    path its fsspec lookup needs (issue 41)."""
    dirpath = f"s3://{moto_server.make_bucket(unique_bucket_name('lt-logs'))}/run"
    t, _ = trainer(moto_server, dirpath, 1, async_save=False)
    t.fit(Tiny())
    caplog.set_level(logging.INFO)
    t2, _ = trainer(moto_server, dirpath, 2, async_save=False)
    t2.fit(Tiny(), ckpt_path="last")
    said = [r.getMessage() for r in caplog.records]
    assert f"Restoring states from the checkpoint path at {dirpath}/last.ckpt" in said, said
    assert f"Restored all states from the checkpoint at {dirpath}/last.ckpt" in said, said
    assert not [m for m in said if "cloudckpt://" in m]
    assert f"{t2.ckpt_path}" == f"{dirpath}/last.ckpt"


def test_a_failing_background_save_fails_the_run(moto_server):
    opts = moto_server.storage_options()
    io = CloudCheckpointIO(async_save=True, storage_options=opts, max_attempts=1)
    t, _ = trainer(moto_server, "s3://no-such-bucket-lt/run", 2, async_save=True, io=io)
    with pytest.raises(errors.BucketNotFoundError, match="no-such-bucket-lt"):
        t.fit(Tiny())
    cloudckpt.wait_all()


def test_removal_waits_for_earlier_saves_and_skips_when_they_failed(tmp_path, monkeypatch):
    io = CloudCheckpointIO(async_save=True)
    keep = tmp_path / "old.ckpt"
    io.save_checkpoint({"w": torch.zeros(2)}, keep)
    io.wait()

    # The next save fails in the background; removing the old one must not happen.
    def broken(*a, **k):
        raise errors.StorageError("injected failure")

    monkeypatch.setattr("cloudckpt.engine.async_save.write_object", broken)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "new.ckpt")
    io.remove_checkpoint(keep)
    with pytest.raises(errors.StorageError, match="injected"):
        io.teardown()
    assert keep.exists()
