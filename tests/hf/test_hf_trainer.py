"""The Hugging Face Trainer with ``cloudckpt.hf``: real Trainers on a moto S3 server, a
run killed by ``kill -9`` and resumed, retention in the bucket, fetching."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from run_train import Tokens, arguments, losses, tiny_model, tiny_trainer
from transformers import Trainer

from cloudckpt import CheckpointManager
from cloudckpt.cli import main as cli_main
from cloudckpt.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ConfigError,
    InvalidURLError,
    StorageError,
)
from cloudckpt.hf import CloudCheckpointCallback, fetch_latest
from docs_examples import docs_examples, run_example
from servers import unique_bucket_name

SCRIPT = str(Path(__file__).with_name("run_train.py"))


def committed(server, url):
    """The steps committed under ``url`` (the manager's listing: markers only)."""
    return [c.step for c in CheckpointManager(url, storage_options=server.storage_options()).list()]


def run_train(server, url, output_dir, max_steps, *extra):
    cmd = [sys.executable, SCRIPT, url, str(output_dir), json.dumps(server.storage_options())]
    return [*cmd, "--max-steps", str(max_steps), *extra]


def report_of(server, url, output_dir, max_steps, report, *extra):
    out = subprocess.run(
        run_train(server, url, output_dir, max_steps, "--report", str(report), *extra),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(report.read_text())


def test_a_run_killed_after_a_commit_resumes_with_the_same_losses(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-kill"))
    base = report_of(moto_server, f"s3://{bucket}/base", tmp_path / "base", 12, tmp_path / "a")
    assert [step for step, _ in base["losses"]] == list(range(1, 13))

    url = f"s3://{bucket}/run"
    cmd = run_train(moto_server, url, tmp_path / "killed", 12, "--block-at", "10")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while 8 not in committed(moto_server, url):
            assert proc.poll() is None, proc.stderr.read().decode()[-6000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "checkpoint-8 was never committed"
            time.sleep(0.2)
        proc.kill()  # SIGKILL: the training thread is blocked at step 10
    finally:
        proc.wait(60)
        if proc.stderr:
            proc.stderr.close()
    assert committed(moto_server, url) == [4, 8]

    resumed = report_of(moto_server, url, tmp_path / "resumed", 12, tmp_path / "b", "--resume")
    assert resumed["resumed_from"] == str(tmp_path / "resumed" / "checkpoint-8")
    assert resumed["losses"] == base["losses"]
    assert committed(moto_server, url) == [8, 12]  # save_total_limit=2 in the bucket too
    marker = moto_server.client().list_objects_v2(Bucket=bucket, Prefix="run/step-000000012/")
    names = {o["Key"].rpartition("/")[2] for o in marker["Contents"]}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= names
    assert {"trainer_state.json", "_CHECKPOINT.json"} <= names


def test_retention_follows_save_total_limit_and_keeps_the_best(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-best"))
    url = f"s3://{bucket}/run"
    callback = CloudCheckpointCallback(url, storage_options=moto_server.storage_options())
    args = arguments(
        str(tmp_path / "out"),
        12,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the highest eval loss: an early checkpoint is the best
    )
    trainer = Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(8),
        callbacks=[callback],
    )
    trainer.train()
    best = int(Path(trainer.state.best_model_checkpoint).name.split("-")[1])
    assert best != 12, "the best checkpoint must be an older one for this test to mean much"
    # The Trainer's rule with save_total_limit=1: the newest and the best survive.
    assert committed(moto_server, url) == sorted({best, 12})
    assert (tmp_path / "out" / f"checkpoint-{best}").is_dir()
    assert not (tmp_path / "out" / ".cloudckpt-upload").exists() or not any(
        (tmp_path / "out" / ".cloudckpt-upload").iterdir()
    )


def test_fetch_latest_ignores_an_uncommitted_newer_folder(
    moto_server, tmp_path, monkeypatch, capsys
):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-fetch"))
    url = f"s3://{bucket}/run"
    opts = moto_server.storage_options()
    assert fetch_latest(url, tmp_path / "empty", storage_options=opts) is None

    trainer = tiny_trainer(
        str(tmp_path / "out"), 4, [CloudCheckpointCallback(url, storage_options=opts)]
    )
    trainer.train()
    client = moto_server.client()
    for name in ("model.safetensors", "trainer_state.json"):  # a newer step, no marker
        client.put_object(Bucket=bucket, Key=f"run/step-000000099/{name}", Body=b"partial")

    # The command line reads the run too: the committed step, checked file by file.
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["verify", url]) == 0
    assert cli_main(["ls", url]) == 0
    assert "hf-trainer" in capsys.readouterr().out

    path = fetch_latest(url, tmp_path / "fetched", storage_options=opts)
    assert path == str(tmp_path / "fetched" / "checkpoint-4")
    local = sorted(p.name for p in (tmp_path / "out" / "checkpoint-4").iterdir())
    assert sorted(p.name for p in Path(path).iterdir()) == local
    for name in local:
        assert (Path(path) / name).read_bytes() == (
            tmp_path / "out" / "checkpoint-4" / name
        ).read_bytes()
    assert [p.name for p in (tmp_path / "fetched").iterdir()] == ["checkpoint-4"]
    # A second fetch finds the folder whole and returns it as it is.
    assert fetch_latest(url, tmp_path / "fetched", storage_options=opts) == path
    # Another run's checkpoint-4 of the same sizes is not the bucket's: its bytes are
    # hashed against the marker's MD5 ETags, and it is refused, never returned.
    stale = tmp_path / "stale" / "checkpoint-4"
    shutil.copytree(path, stale)
    weights = stale / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the same size, another value
    weights.write_bytes(bytes(data))
    with pytest.raises(AlreadyExistsError, match=r"model\.safetensors holds other bytes"):
        fetch_latest(url, tmp_path / "stale", storage_options=opts)

    # A Trainer resumes from there: its history up to step 4 is the first run's.
    resumed = tiny_trainer(str(tmp_path / "fetched"), 6)
    resumed.train(resume_from_checkpoint=path)
    assert losses(resumed)[:4] == losses(trainer)
    assert [step for step, _ in losses(resumed)[4:]] == [5, 6]


def test_a_bad_url_is_a_typed_error_before_training_starts(moto_server, tmp_path):
    with pytest.raises(InvalidURLError):
        CloudCheckpointCallback("s3://")
    missing = f"s3://{unique_bucket_name('hf-none')}/run"
    callback = CloudCheckpointCallback(missing, storage_options=moto_server.storage_options())
    trainer = tiny_trainer(str(tmp_path / "out"), 4, [callback])
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_keep_local_must_be_a_positive_integer(tmp_path):
    with pytest.raises(ConfigError, match="keep_local"):
        CloudCheckpointCallback(str(tmp_path / "bucket"), keep_local=0)


@pytest.mark.parametrize(
    "args",
    [
        {"timeout": "abc"},
        {"timeout": -5},
        {"timeout": float("nan")},
        {"storage_options": "x"},
        {"local_dir": 5},
    ],
)
def test_bad_callback_arguments_are_config_errors_naming_them(tmp_path, args):
    """Checked when the callback is made, not after the training run."""
    (name,) = args
    with pytest.raises(ConfigError, match=name):
        CloudCheckpointCallback(str(tmp_path / "bucket"), **args)


def test_bad_fetch_arguments_are_config_errors_naming_them(tmp_path):
    url = str(tmp_path / "bucket")
    for local in (None, 5):
        with pytest.raises(ConfigError, match="local_dir"):
            fetch_latest(url, local)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        fetch_latest(url, tmp_path / "out", tier_dir=tmp_path / "a-file")


def test_keep_local_deletes_committed_folders_beyond_the_newest(moto_server, tmp_path):
    bucket = moto_server.make_bucket(unique_bucket_name("hf-keep"))
    url = f"s3://{bucket}/run"
    callback = CloudCheckpointCallback(
        url, keep_local=1, storage_options=moto_server.storage_options()
    )
    trainer = tiny_trainer(str(tmp_path / "out"), 12, [callback], save_total_limit=None)
    trainer.train()
    assert committed(moto_server, url) == [4, 8, 12]  # no limit: every checkpoint kept
    # Each save, and the end, prune the local folders committed but the newest.
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-12"]


def test_a_failed_upload_is_raised_by_train_naming_the_checkpoint(
    moto_server, tmp_path, monkeypatch
):
    import cloudckpt.manager.tiers

    def refuse(*args, **kwargs):
        raise AccessDeniedError("the bucket refused the upload")

    monkeypatch.setattr(cloudckpt.manager.tiers, "copy_tree", refuse)
    bucket = moto_server.make_bucket(unique_bucket_name("hf-fail"))
    url = f"s3://{bucket}/run"
    callback = CloudCheckpointCallback(url, storage_options=moto_server.storage_options())
    trainer = tiny_trainer(str(tmp_path / "out"), 4, [callback])
    with pytest.raises(StorageError, match=r"step 4 .*refused the upload") as info:
        trainer.train()
    assert str(tmp_path / "out") in str(info.value)
    assert isinstance(info.value.__cause__, AccessDeniedError)
    assert committed(moto_server, url) == []
    # The step is committed in the local tier and waits there for a drain; the
    # Trainer's folder is untouched.
    (run_tier,) = (tmp_path / "out" / "_cloudckpt-tier").iterdir()  # one per run URL
    tier = run_tier / "step-000000004"
    assert (tier / "optimizer.pt").is_file() and (tier / "_CHECKPOINT.json").is_file()
    assert (tmp_path / "out" / "checkpoint-4" / "optimizer.pt").is_file()


def test_the_docs_example_runs(moto_server, tmp_path):
    """The Hugging Face section of docs/integrations.md, as written, on the local server."""
    bucket = run_example(moto_server, docs_examples("Hugging Face Trainer")[0], tmp_path, "hf-docs")
    assert committed(moto_server, f"s3://{bucket}/hf-run") == [8, 12]


def test_an_existing_folder_uploaded_in_parts_of_another_size_is_compared_not_refused(
    moto_server, tmp_path
):
    """A 9.5 MiB file committed in 9 MiB parts: its multipart ETag is not one the usual
    part sizes give, so fetch_latest compares the folder already there with the bucket
    byte for byte: the run's own download is returned, another run's is refused."""
    from cloudckpt.manager.folders import commit_folder

    bucket = moto_server.make_bucket(unique_bucket_name("hf-parts"))
    url, opts = f"s3://{bucket}/run", moto_server.storage_options()
    m = CheckpointManager(url, storage_options=opts, part_size=9 << 20, write_concurrency=1)
    folder = tmp_path / "out" / "checkpoint-3"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * (38 * 1024))
    (folder / "trainer_state.json").write_text("{}")
    info = commit_folder(
        m, 3, folder, kind="hf-trainer", metadata={"folder": folder.name}, group=None
    )
    assert {f.name: f.etag.endswith("-2") for f in info.files}["model.safetensors"]
    path = fetch_latest(url, tmp_path / "fetched", storage_options=opts)
    assert fetch_latest(url, tmp_path / "fetched", storage_options=opts) == path
    weights = Path(path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[5 << 20] ^= 0xFF  # the same size, another value, in the first part
    weights.write_bytes(bytes(data))
    with pytest.raises(AlreadyExistsError, match=r"model\.safetensors holds other bytes"):
        fetch_latest(url, tmp_path / "fetched", storage_options=opts)
